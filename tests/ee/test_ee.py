"""The execution environment built for real (``make ee``), run the way AWX runs a job: ansible-runner with process
isolation starts the image under podman, with the job's private data dir at /runner, the inventory in
/runner/inventory and the machine credential handed to ssh-agent (env/ssh_key), nothing of this checkout mounted.
The playbooks and modules come from the gpufleet.fleet collection installed in the image.

The lab hosts are reached from the root network namespace: the container shares the host's network
(``--network=host``). It runs as root: runner writes the key as a 0600 root-owned fifo, which the image's default
user (1000) cannot read under rootful podman (under AWX the credential reaches the pod its own way).
"""
import json
import os
import shutil

import ansible_runner
import pytest
import yaml

CONTAINERS_CONF = os.environ.get("CONTAINERS_CONF")


def _private_data_dir(lab, path):
    """A job's private data dir for ``lab``: its inventory with the connection settings an AWX job would get (key
    through ssh-agent, known_hosts inside /runner, ControlPath sockets in the container's own home)."""
    os.makedirs(os.path.join(path, "inventory", "group_vars"))
    os.makedirs(os.path.join(path, "env"))
    shutil.copy(lab.inventory_file, os.path.join(path, "inventory", "hosts.yml"))
    group_vars = dict(lab.group_vars)
    for name in ("ansible_ssh_private_key_file", "ansible_control_path_dir"):
        group_vars.pop(name, None)
    group_vars["ansible_ssh_common_args"] = "-o UserKnownHostsFile=/runner/known_hosts -o StrictHostKeyChecking=yes"
    with open(os.path.join(path, "inventory", "group_vars", "gpu_hosts.yml"), "w") as fh:
        yaml.safe_dump(group_vars, fh)
    shutil.copy(os.path.join(lab.lab_dir, "ssh", "known_hosts"), os.path.join(path, "known_hosts"))
    shutil.copy(os.path.join(lab.lab_dir, "ssh", "id_ed25519"), os.path.join(path, "env", "ssh_key"))
    return str(path)


def _run_in_ee(image, pdd, **kwargs):
    """ansible_runner.run in the image (podman, process isolation); the Runner (status, rc, events)."""
    assert CONTAINERS_CONF and os.path.exists(CONTAINERS_CONF), "run through make ee (CONTAINERS_CONF)"
    return ansible_runner.run(private_data_dir=pdd, process_isolation=True, process_isolation_executable="podman",
                              container_image=image, container_options=["--network=host", "--user=root"],
                              quiet=True, timeout=300, **kwargs)


def _ok_results(runner):
    return {e["event_data"]["host"]: e["event_data"]["res"] for e in runner.events if e["event"] == "runner_on_ok"}


def _output(runner):
    return runner.stdout.read()[-4000:]


def test_ad_hoc_nvidia_gpu_info_in_the_ee_reads_every_gpu_of_both_hosts(ee_image, ee_lab, tmp_path):
    runner = _run_in_ee(ee_image, _private_data_dir(ee_lab, tmp_path / "job"),
                        module="gpufleet.fleet.nvidia_gpu_info", host_pattern="gpu_hosts")
    assert runner.status == "successful", _output(runner)
    results = _ok_results(runner)
    assert set(results) == set(ee_lab.hosts) and len(results) == 2
    for host, res in results.items():
        # the module ran on the host and read its GPUs: the simulator's own UUIDs, in index order. The default
        # (short) answer groups GPUs by what differs: every UUID differs, so one group per GPU, named by its index.
        by_index = {g["gpus"]: g["uuid"] for g in res["gpu_groups"]}
        assert res["gpu_count"] == 8 and "gpus" not in res, host
        assert [by_index[str(i)] for i in range(8)] == [g["uuid"] for g in ee_lab.gpus(host)], host
        assert res["changed"] is False


def test_check_playbook_in_the_ee_reports_both_hosts_as_their_state_is(ee_image, ee_lab, tmp_path):
    ok, bad = ee_lab.hosts
    ee_lab.fault(bad, remap_pending=True)
    try:
        runner = _run_in_ee(ee_image, _private_data_dir(ee_lab, tmp_path / "job"),
                            playbook="gpufleet.fleet.check", tags="gpu")
    finally:
        ee_lab.clear_faults(bad)
    # One host CRIT: the job fails, as AWX shows it, and the failure is that host's own (the recap); the verdicts
    # and reasons come back through set_stats (the job's artifacts, AWX's artifacts of the job).
    assert runner.status == "failed" and runner.rc != 0, _output(runner)
    assert runner.stats["failures"] == {bad: 1}, _output(runner)
    stats = [e["event_data"] for e in runner.events if e["event"] == "playbook_on_stats"]
    report = stats[-1]["artifact_data"]["gpufleet_check"]
    assert set(report) == {ok, bad}, json.dumps(report)
    assert report[ok]["verdict"] == "OK", json.dumps(report)
    assert report[ok]["gpus_ok"] == report[ok]["gpus_total"] == 8
    # the fault is on GPU 1 alone: the other seven are fine
    assert report[bad]["verdict"] == "CRIT" and "remap_pending" in {r["code"] for r in report[bad]["reasons"]}, \
        json.dumps(report)
    assert (report[bad]["gpus_ok"], report[bad]["gpus_total"]) == (7, 8), json.dumps(report)
    out = runner.stdout.read()
    assert ok in out and bad in out, out[-4000:]
