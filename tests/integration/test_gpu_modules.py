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
              "remapped_rows_pending", "remapped_rows_failure", "processes",
              # issue 9 health fields
              "serial", "vbios_version", "temperature_memory_c", "pstate", "clocks_sm_mhz", "clocks_max_sm_mhz",
              "clocks_event_reasons_mask", "clocks_event_reasons", "pcie_link_gen_current", "pcie_link_gen_max",
              "pcie_link_width_current", "pcie_link_width_max", "mig_mode_current", "mig_mode_pending",
              "ecc_mode_current", "ecc_errors_corrected_aggregate_total", "ecc_errors_uncorrected_aggregate_total",
              "retired_pages_single_bit_ecc_count", "retired_pages_double_bit_ecc_count", "retired_pages_pending",
              "unsupported", "nvlinks"}


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


@pytest.fixture(scope="module", autouse=True)
def idle_gpus(lab):
    """No SGLang server on any host when this module starts: the waits and the per-GPU process lists below need
    free GPU memory, and an earlier module (in any order, e.g. under pytest-xdist) may have left servers running."""
    stopped = lab.run_playbook("playbooks/restart.yml", extravars={"gpufleet_serial": len(lab.hosts)}, tags="stop,wait")
    with open(stopped.stdout.name) as handle:
        assert stopped.status == "successful", handle.read()[-3000:]


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
    runner = lab.run_module("nvidia_gpu_info", args(detail="full"))
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
        assert monitor and monitor[0]["gpu_indices"] == [0] and monitor[0]["kind"] == "monitor"
        # health as the recorded idle H200 prints it; 18 NVLinks per GPU on the simulated HGX board
        assert gpu["unsupported"]["retired_pages_pending"] == "[N/A]" and gpu["pcie_link_width_max"] == 16
        assert len(gpu["nvlinks"]) == 18 and all(link["state"] == "active" for link in gpu["nvlinks"])
        # lab hosts have no /dev/kmsg: Xid unknown, never "none"
        assert r["xid_events"] is None and r["xid_status"] == "unknown"
        assert any(p["source"] == ["proc_fd"] and "nvidia-persistenced" in p["cmdline"]
                   for p in r["gpus"][0]["processes"])
    # the default (detail: short) says what every GPU shares once and groups the GPUs by what differs (issue 33:
    # an ad-hoc read of 8 hosts printed every GPU's entry whole)
    runner = lab.run_module("nvidia_gpu_info", args(fields=["name", "memory.used", "uuid"]))
    for host, (ok, r) in results(lab, runner, "nvidia_gpu_info").items():
        truth = lab.gpus(host)
        assert ok and "gpus" not in r
        assert r["gpus_same"] == {"name": "NVIDIA H200", "memory_used_mib": 0}
        assert r["gpu_groups"] == [{"gpus": str(i), "uuid": sim["uuid"]} for i, sim in enumerate(truth)]


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_info_lists_standin_workers_per_gpu_from_both_sources(lab, standin):
    host, _ = standin
    runner = lab.run_module("nvidia_gpu_info", args(gpus=[2, 5], detail="full"), hosts=host)
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
    # GPU 0's monitor, listed apart from the memory owners as a monitor
    assert "monitors with it open (they hold no memory, leave them): pid" in msg and "nvidia-persistenced" in msg


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


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_playbook_wait_fails_on_the_busy_host_only(lab, standin):
    host, _ = standin
    runner = lab.run_playbook(PLAYBOOK, extravars={"gpu_wait_timeout_s": 1})
    assert lab.failed_hosts(runner, "nvidia_gpu_wait") == {host}
    assert lab.ok_hosts(runner, "nvidia_gpu_wait") == set(lab.hosts) - {host}
    failed = [d for d in lab.events(runner, "runner_on_failed", "nvidia_gpu_wait")][0]
    assert "sglang::scheduler_TP0" in failed["res"]["msg"]


# ------------------------------------------------------------------------------------------------ issue 9 knobs

KMSG = "{{ lab_host_dir }}/kmsg"  # the simulated kernel log (gpusim.kmsg_path); lab hosts have no /dev/kmsg


def with_faults(lab, per_host):
    """Set per-host fault knobs; returns a function that clears them all again."""
    for host, knobs in per_host.items():
        lab.fault(host, **knobs)

    def undo():
        for host in per_host:
            lab.clear_faults(host)
    return undo


def test_info_names_driver_failures_and_reads_health_faults_per_host(lab):
    """One ad-hoc run per group of four knobs (one host each): driver failures fail with their class and the
    driver's line first; health faults come back as fields; fewer GPUs than expected fails."""
    h = lab.hosts
    bus1 = lab.gpus(h[0])[1]["pci_bus_id"]
    groups = [
        ({h[0]: {"smi_rc": 18, "xid": 79}, h[1]: {"smi_rc": 255},
          h[2]: {"ecc_errors": 4, "remap_pending": True, "throttle": "hw_slowdown", "mig_on": True,
                 "nvlink_down": 3, "xid": [48]},
          h[3]: {"gpus_visible": 6}},
         {h[0]: ("driver_mismatch", "Failed to initialize NVML: Driver/library version mismatch"),
          h[1]: ("device_handle_error", "Unable to determine the device handle for GPU %s: Unknown Error"
                 % bus1[4:]),
          h[2]: None,
          h[3]: ("fewer_gpus", "nvidia-smi lists 6 GPUs, expected 8")}),
        ({h[0]: {"smi_rc": 9}, h[1]: {"smi_rc": 6}, h[2]: {"smi_rc": 15},
          h[3]: {"smi_field_values": {"memory.used": "[N/A]"}}},
         {h[0]: ("driver_not_loaded", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"),
          h[1]: ("no_devices", "No devices were found"),
          h[2]: ("gpu_lost", "Unable to determine the device handle for GPU%s: GPU is lost." % bus1[4:]),
          h[3]: None}),
    ]
    results_by_group = []
    for knobs, expect in groups:
        undo = with_faults(lab, knobs)
        try:
            runner = lab.run_module("nvidia_gpu_info", args(expected_count=8, processes=False, kmsg_path=KMSG, detail="full"))
            res = results(lab, runner, "nvidia_gpu_info")
        finally:
            undo()
        results_by_group.append(res)
        for host, want in expect.items():
            ok, r = res[host]
            if want is None:
                assert ok, r.get("msg")
                continue
            assert not ok and r["error_class"] == want[0], (host, r.get("error_class"), r.get("msg"))
            assert r["msg"].startswith(want[1]), (host, r["msg"][:300])
            assert "NVML: NVML" not in r["msg"] and "What to do" in r["msg"]
    # group 1: the mismatch host's failure carries the Xid the kernel log holds
    _, r = results_by_group[0][h[0]]
    assert r["xid_events"][0]["xid"] == 79 and "Xid events (" in r["msg"]
    # group 1: health faults on GPU 1 of host 2, the other GPUs untouched
    _, r = results_by_group[0][h[2]]
    g0, g1 = r["gpus"][0], r["gpus"][1]
    assert g1["ecc_errors_uncorrected_volatile_total"] == 4 and g1["ecc_errors_corrected_aggregate_total"] == 4
    assert g1["remapped_rows_pending"] is True and g1["remapped_rows_uncorrectable"] == 1
    assert g1["clocks_event_reasons"] == ["hw_slowdown"] and g0["clocks_event_reasons"] == ["gpu_idle"]
    assert all(g["mig_mode_current"] == "Enabled" for g in r["gpus"])
    assert g1["nvlinks"][3]["state"] == "inactive" and g1["nvlinks"][3]["recovery_errors"] == 3
    assert [link["state"] for link in g0["nvlinks"]] == ["active"] * 18
    assert g0["ecc_errors_uncorrected_volatile_total"] == 0 and g0["remapped_rows_pending"] is False
    assert r["xid_status"] == "ok" and [(e["xid"], e["gpu_index"]) for e in r["xid_events"]] == [(48, 1)]
    # group 2: memory.used [N/A] is null with the raw text for the info call, not a failure
    _, r = results_by_group[1][h[3]]
    assert r["gpus"][0]["memory_used_mib"] is None and r["gpus"][0]["unsupported"]["memory_used_mib"] == "[N/A]"


@pytest.mark.lab_only_once
def test_wait_fails_at_once_on_na_memory_hang_and_handle_error(lab):
    """One ad-hoc nvidia_gpu_wait over all hosts: [N/A] memory fails at once (field_unavailable), a hung
    nvidia-smi fails after its limit (timeout) instead of hanging, rc 255 names the device, a clean host waits
    and passes."""
    h = lab.hosts
    undo = with_faults(lab, {h[0]: {"smi_field_values": {"memory.used": "[N/A]"}}, h[1]: {"smi_hang_s": 60},
                             h[2]: {"smi_rc": 255}})
    try:
        started = time.monotonic()
        runner = lab.run_module("nvidia_gpu_wait", args(timeout_s=4, poll_interval_ms=100))
        took = time.monotonic() - started
        res = results(lab, runner, "nvidia_gpu_wait")
    finally:
        undo()
    assert took < 30  # the hung host did not hold the run for its 60 s
    ok, r = res[h[0]]
    assert not ok and r["error_class"] == "field_unavailable"
    assert "memory.used unreadable (nvidia-smi reads '[N/A]')" in r["msg"], r["msg"]
    assert r["msg"].startswith("GPU 0 (GPU-")
    ok, r = res[h[1]]
    assert not ok and r["error_class"] == "timeout" and "did not answer within" in r["msg"]
    assert "D state" in r["msg"]
    ok, r = res[h[2]]
    assert not ok and r["error_class"] == "device_handle_error"
    ok, r = res[h[3]]
    assert ok and r["ready"] is True
    # nothing of the hang is left on the host: the abandoned nvidia-smi was killed
    assert not [a for a in ps(lab, h[1]).values() if "nvidia-smi" in a]


@pytest.mark.lab_only_once
def test_gpu_memory_wait_role_prints_progress_between_slices_until_release(lab, standin):
    """The role waits in 2 s slices: while the stand-in holds memory a progress line is printed, then the
    stop (scheduled inside the host 3 s after the wait's first nvidia-smi poll, so a slow playbook start on a
    loaded machine cannot race it) releases it and the release time counts from the first slice."""
    host, pid = standin
    # [.] keeps the watcher's own command line from matching its pattern
    watcher = ("(i=0; while [ $i -lt 1200 ] && ! pgrep -f 'memory[.]used,memory[.]total' >/dev/null; do"
               " i=$((i+1)); sleep 0.05; done; sleep 3; kill -TERM %d) >/dev/null 2>&1 &" % pid)
    lab.exec(host, ["sh", "-c", watcher], check=True)
    runner = lab.run_playbook(os.path.join(ROOT, "tests", "integration", "playbooks", "gpu_memory_wait.yml"),
                              limit=host, extravars={"gpu_memory_wait_slice_s": 2, "gpu_memory_wait_timeout_s": 60,
                                                     "gpufleet_expected_gpus": 8}, tags="wait")
    assert runner.status == "successful"
    progress = [d["res"]["msg"] for d in lab.events(runner, "runner_on_ok", "debug")
                if d["res"].get("msg", "").startswith("GPU memory: ")]
    assert progress and "8 of 8 GPUs above 1024 MiB" in progress[0], progress
    waits = lab.events(runner, "runner_on_ok", "nvidia_gpu_wait")
    assert len(waits) >= 2 and waits[0]["res"]["ready"] is False and waits[-1]["res"]["ready"] is True
    assert waits[-1]["res"]["elapsed_ms"] >= 2000  # from the first slice's start (a whole 2 s slice went before)
    assert len({w["res"]["started_at"] for w in waits}) == 1
