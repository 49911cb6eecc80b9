"""nvidia_gpu_info and nvidia_gpu_wait on the lab fleet, over real SSH, through ansible-runner (as AWX runs them).

Each lab host has a simulated nvidia-smi with 8 H200s and no libnvidia-ml.so.1, so ``backend: auto`` must fall
back to nvidia-smi there. The hosts' nvidia-ml-py is installed, so nvmlInit is what fails. The stand-in SGLang
server (``lab.start_standin``) spawns 8 TP workers titled ``sglang::scheduler_TP<n>``. Each holds memory on
GPU n and keeps /dev/nvidia<n> open. A simulated nvidia-persistenced keeps /dev/nvidiactl and /dev/nvidia0
open.

Assertions compare module results with the simulator's own state (``lab.gpus(host)``), so the modules must
read the truth, not just succeed.

Run: ``.venv/bin/python -m pytest tests/integration/test_gpu_modules.py -m lab`` (root; ``make setup`` first).
"""
import json
import os
import time

import pytest

pytestmark = pytest.mark.lab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAYBOOK = os.path.join(ROOT, "tests", "integration", "playbooks", "gpu_modules.yml")
GPU_FIELDS = {"index", "uuid", "name", "pci_bus_id", "minor_number", "memory_used_mib", "memory_total_mib",
              "memory_reserved_mib", "utilization_gpu_pct", "temperature_gpu_c", "power_draw_w", "power_limit_w",
              "persistence_mode", "compute_mode", "ecc_errors_corrected_volatile_total",
              "ecc_errors_uncorrected_volatile_total", "remapped_rows_correctable", "remapped_rows_uncorrectable",
              "remapped_rows_pending", "remapped_rows_failure", "processes"}


def args(**kw):
    """Module arguments as a JSON string: ansible -a parses JSON (lists stay lists), not k=v pairs."""
    return json.dumps(kw)


def results(lab, runner, action):
    """host -> (ok: bool, res dict) for the last ok/failed event of ``action``."""
    out = {}
    for event in ("runner_on_ok", "runner_on_failed"):
        for data in lab.events(runner, event, action):
            out[data["host"]] = (event == "runner_on_ok", data["res"])
    return out


def sim_apps(lab, host):
    """uuid -> [{pid, name, used_mib}] from the simulator, asked inside the host (its PID namespace).

    ``lab.gpus(host)["apps"]`` is read from the controller, where the hosts' pids are not visible, so the
    simulated nvidia-smi is asked instead.
    """
    out = lab.exec(host, ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory,process_name",
                          "--format=csv,noheader,nounits"], check=True).stdout
    apps = {}
    for line in out.splitlines():
        uuid, pid, mib, name = [p.strip() for p in line.split(",", 3)]
        apps.setdefault(uuid, []).append({"pid": int(pid), "used_mib": int(mib), "name": name})
    return apps


def ps(lab, host):
    out = lab.exec(host, ["ps", "-eo", "pid=,args="], check=True).stdout
    procs = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        procs[int(pid)] = args.strip()
    return procs


@pytest.fixture
def standin(lab):
    """A running stand-in server on the first host (its workers hold memory on all 8 GPUs); stopped after."""
    host = lab.hosts[0]
    pid = lab.start_standin(host)
    try:
        assert lab.wait_http(host, timeout_s=60) == 200
        yield host, pid
    finally:
        stop_standin(lab, host, pid)


def stop_standin(lab, host, pid, timeout_s=30):
    lab.exec(host, ["kill", "-TERM", str(pid)])
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pid not in ps(lab, host) and all(g["used_mib"] == 0 for g in lab.gpus(host)):
            return
        time.sleep(0.2)


def test_info_reports_eight_h200_per_host_with_every_field(lab):
    runner = lab.run_module("nvidia_gpu_info")
    assert runner.status == "successful"
    res = results(lab, runner, "nvidia_gpu_info")
    assert sorted(res) == sorted(lab.hosts)
    for host, (ok, r) in res.items():
        assert ok and r["changed"] is False
        assert r["backend"] == "nvidia-smi" and "libnvidia-ml.so.1" in r["backend_fallback_reason"]
        assert r["gpu_count"] == 8 and len(r["gpus"]) == 8
        assert r["driver_version"] == "580.159.04" and r["cuda_version"] == "13.0"
        truth = lab.gpus(host)
        for gpu, sim in zip(r["gpus"], truth):
            assert set(gpu) == GPU_FIELDS
            assert gpu["uuid"] == sim["uuid"] and gpu["pci_bus_id"] == sim["pci_bus_id"]
            assert gpu["memory_used_mib"] == sim["used_mib"] and gpu["memory_total_mib"] == 143771
            assert gpu["memory_reserved_mib"] == 616 and gpu["remapped_rows_pending"] is False
        # the simulated nvidia-persistenced holds /dev/nvidia0 and /dev/nvidiactl: found by the fd scan only
        holders = {h["pid"]: h for h in r["device_holders"]}
        monitor = [h for h in holders.values() if "nvidia-persistenced" in (h["cmdline"] or "")]
        assert monitor and monitor[0]["gpu_indices"] == [0]
        assert any(p["source"] == ["proc_fd"] and "nvidia-persistenced" in p["cmdline"]
                   for p in r["gpus"][0]["processes"])


def test_info_lists_standin_workers_per_gpu_from_both_sources(lab, standin):
    host, _ = standin
    runner = lab.run_module("nvidia_gpu_info", args(gpus=[2, 5]), hosts=host)
    ok, r = results(lab, runner, "nvidia_gpu_info")[host]
    assert ok and [g["index"] for g in r["gpus"]] == [2, 5]
    truth = {g["index"]: g for g in lab.gpus(host)}
    apps = sim_apps(lab, host)
    for gpu in r["gpus"]:
        sim = truth[gpu["index"]]
        assert gpu["memory_used_mib"] == sim["used_mib"] > 1024
        app = apps[gpu["uuid"]][0]
        worker = [p for p in gpu["processes"] if p["pid"] == app["pid"]]
        assert worker, gpu["processes"]
        assert worker[0]["cmdline"] == "sglang::scheduler_TP%d" % gpu["index"]
        assert worker[0]["used_memory_mib"] == app["used_mib"]
        assert worker[0]["source"] == ["nvidia-smi", "proc_fd"]


def test_info_rejects_a_gpu_the_host_does_not_have(lab):
    host = lab.hosts[0]
    runner = lab.run_module("nvidia_gpu_info", args(gpus=[8]), hosts=host)
    ok, r = results(lab, runner, "nvidia_gpu_info")[host]
    assert not ok and "no GPU with index 8" in r["msg"] and "7 (GPU-" in r["msg"]


def test_wait_fails_naming_holders_while_the_standin_holds_memory(lab, standin):
    host, _ = standin
    started = time.monotonic()
    runner = lab.run_module("nvidia_gpu_wait", args(timeout_s=2, poll_interval_ms=100), hosts=host)
    assert time.monotonic() - started >= 2
    ok, r = results(lab, runner, "nvidia_gpu_wait")[host]
    assert not ok and r["changed"] is False and r["polls"] >= 2 and r["elapsed_ms"] >= 2000
    msg = r["msg"]
    apps = sim_apps(lab, host)
    for sim in lab.gpus(host):
        worker = apps[sim["uuid"]][0]
        assert "GPU %d (%s): %d MiB used, held by pid %d (%d MiB): sglang::scheduler_TP%d" % (
            sim["index"], sim["uuid"], sim["used_mib"], worker["pid"], worker["used_mib"], sim["index"]) in msg
    assert "device also open in" in msg and "nvidia-persistenced" in msg  # GPU 0's monitor, listed apart


def test_wait_returns_once_the_standin_is_stopped_and_memory_is_free(lab, standin):
    host, pid = standin
    # The stop is scheduled inside the host, so this process stays single-threaded while ansible-runner
    # forks (forkpty in a multi-threaded process may deadlock). By then the module is polling.
    lab.exec(host, ["sh", "-c", "(sleep 6; kill -TERM %d) >/dev/null 2>&1 &" % pid], check=True)
    started = time.monotonic()
    runner = lab.run_module("nvidia_gpu_wait", args(timeout_s=60, poll_interval_ms=50), hosts=host)
    ok, r = results(lab, runner, "nvidia_gpu_wait")[host]
    assert ok, r.get("msg")
    # It polled busy GPUs first (more than one poll) and returned only after the stop.
    assert r["changed"] is False and r["polls"] > 1 and time.monotonic() - started >= 6 - 1
    assert all(g["free"] and g["memory_used_mib"] <= 1024 for g in r["gpus"]) and len(r["gpus"]) == 8
    assert all(sim["used_mib"] == 0 for sim in lab.gpus(host))  # the simulator agrees: released


def test_playbook_runs_both_modules_in_check_mode_and_changes_nothing(lab):
    runner = lab.run_playbook(PLAYBOOK, check=True)
    assert runner.status == "successful"
    assert lab.ok_hosts(runner, "nvidia_gpu_info") == set(lab.hosts)
    assert lab.ok_hosts(runner, "nvidia_gpu_wait") == set(lab.hosts)
    assert not lab.events(runner, "runner_on_skipped", "nvidia_gpu_wait")  # not skipped under --check
    assert {h: n for h, n in (runner.stats or {}).get("changed", {}).items() if n} == {}
    for data in lab.events(runner, "runner_on_ok", "nvidia_gpu_wait"):
        assert data["res"]["backend"] == "nvidia-smi" and len(data["res"]["gpus"]) == 8


def test_playbook_wait_fails_on_the_busy_host_only(lab, standin):
    host, _ = standin
    runner = lab.run_playbook(PLAYBOOK, extravars={"gpu_wait_timeout_s": 1})
    assert lab.failed_hosts(runner, "nvidia_gpu_wait") == {host}
    assert lab.ok_hosts(runner, "nvidia_gpu_wait") == set(lab.hosts) - {host}
    failed = [d for d in lab.events(runner, "runner_on_failed", "nvidia_gpu_wait")][0]
    assert "sglang::scheduler_TP0" in failed["res"]["msg"]
