"""nvidia_gpu_wait: main() with module arguments; release after N polls, timeout naming holders, errors."""
import os
import time

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
from fake_pynvml import make_fake_nvml
from gpu_module_harness import load_module, recorded_process_info, run_main, use_recorded_processes, write_fake_smi

MODULE = load_module("nvidia_gpu_wait")


@pytest.fixture
def recorded_procs(monkeypatch):
    use_recorded_processes(monkeypatch)


def releasing_nvml(monkeypatch, release_after_calls):
    """Fake NVML, loaded as recorded; the workers die after ``release_after_calls`` memory queries."""
    fake = make_fake_nvml("loaded")
    real = fake.nvmlDeviceGetMemoryInfo

    def memory(handle, version=None):
        if fake.fake.memory_calls >= release_after_calls:
            for gpu in fake.fake.gpus:
                gpu["used"] = 0
                gpu["procs"] = []
        return real(handle, version)

    fake.nvmlDeviceGetMemoryInfo = memory
    monkeypatch.setattr(G, "pynvml", fake)
    return fake


def test_wait_returns_once_memory_is_released_with_elapsed_and_polls(monkeypatch, recorded_procs):
    fake = releasing_nvml(monkeypatch, release_after_calls=2 * 4)  # 2 GPUs per poll: free at poll 5
    done = run_main(monkeypatch, MODULE, {"poll_interval_ms": 10, "timeout_s": 30})
    r = done.result
    assert not done.failed, r
    assert r["changed"] is False and r["polls"] == 5 and r["backend"] == "nvml"
    assert 30 <= r["elapsed_ms"] < 5000
    assert all(g["free"] and g["memory_used_mib"] == 0 for g in r["gpus"])
    assert fake.fake.init_calls == 1 and fake.fake.initialized == 0  # one session for all polls, closed


def test_wait_fails_naming_holders_on_timeout(monkeypatch, recorded_procs):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    done = run_main(monkeypatch, MODULE, {"timeout_s": 0.2, "poll_interval_ms": 20})
    r = done.result
    assert done.failed and r["changed"] is False
    msg = r["msg"]
    assert "GPU 0 (GPU-8b76e503-d849-6334-acea-f57e29736cb3): 31339 MiB used" in msg
    assert "GPU 1 (GPU-fc5ce087-20ff-f609-f8fc-c4b5cbf772f5): 31339 MiB used" in msg
    assert "pid 682 (31330 MiB): /opt/torch/.venv/bin/python3 -B -c from multiprocessing.spawn" in msg
    assert "pid 683 (31330 MiB)" in msg
    assert r["polls"] >= 2 and r["elapsed_ms"] >= 200
    assert [p["pid"] for p in r["gpus"][0]["processes"]] == [682]


def test_wait_timeout_lists_fd_holders_apart_from_memory_owners(monkeypatch):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    recorded = recorded_process_info()
    recorded[77] = {"pid": 77, "name": "dcgm", "cmdline": ["nv-hostengine"], "user": "root"}
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {77: ["/dev/nvidia0", "/dev/nvidiactl"]})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: recorded.get(p) for p in pids})
    done = run_main(monkeypatch, MODULE, {"gpus": [0], "timeout_s": 0})
    msg = done.result["msg"]
    assert "held by pid 682 (31330 MiB)" in msg and "device also open in pid 77: nv-hostengine" in msg
    assert msg.index("pid 682") < msg.index("pid 77")


def test_wait_through_nvidia_smi_names_processes_when_psutil_cannot_see_them(monkeypatch, tmp_path):
    monkeypatch.setattr(G, "pynvml", None)
    write_fake_smi(tmp_path, state="loaded")
    monkeypatch.setenv("PATH", "%s:%s" % (tmp_path, os.environ["PATH"]))
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: None for p in pids})  # container: host pids
    done = run_main(monkeypatch, MODULE, {"timeout_s": 0.1, "poll_interval_ms": 50})
    r = done.result
    assert done.failed and r["backend"] == "nvidia-smi"
    assert "pid 682 (31330 MiB): /opt/torch/.venv/bin/python3" in r["msg"]


def test_wait_runs_in_check_mode(monkeypatch, recorded_procs):
    releasing_nvml(monkeypatch, release_after_calls=2)
    done = run_main(monkeypatch, MODULE, {"_ansible_check_mode": True, "poll_interval_ms": 5})
    assert not done.failed and done.result["changed"] is False and done.result["polls"] == 2


def test_wait_with_require_no_processes_fails_while_a_process_remains(monkeypatch, recorded_procs):
    fake = make_fake_nvml("loaded")
    for gpu in fake.fake.gpus:
        gpu["used"] = 0  # memory below the limit, but the recorded compute processes are still listed
    monkeypatch.setattr(G, "pynvml", fake)
    done = run_main(monkeypatch, MODULE, {"require_no_processes": True, "timeout_s": 0.1})
    assert done.failed and "held by pid 682" in done.result["msg"] and "0 MiB used" in done.result["msg"]
    done = run_main(monkeypatch, MODULE, {"require_no_processes": False, "timeout_s": 0.1})
    assert not done.failed


def test_wait_default_limit_passes_an_idle_gpu_and_fails_a_loaded_one(monkeypatch, recorded_procs):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    assert not run_main(monkeypatch, MODULE, {"timeout_s": 0}).failed
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    assert run_main(monkeypatch, MODULE, {"timeout_s": 0}).failed


def test_wait_on_one_gpu_ignores_the_others(monkeypatch, recorded_procs):
    fake = make_fake_nvml("loaded")
    fake.fake.gpus[1]["used"] = 0
    monkeypatch.setattr(G, "pynvml", fake)
    done = run_main(monkeypatch, MODULE, {"gpus": ["GPU-fc5ce087-20ff-f609-f8fc-c4b5cbf772f5"], "timeout_s": 0})
    assert not done.failed and [g["index"] for g in done.result["gpus"]] == [1]


@pytest.mark.parametrize("args,text", [({"poll_interval_ms": 0}, "poll_interval_ms"),
                                       ({"timeout_s": -1}, "timeout_s"),
                                       ({"max_used_mib": -5}, "max_used_mib"),
                                       ({"gpus": ["bogus"]}, "neither a GPU index")])
def test_wait_rejects_bad_arguments(monkeypatch, recorded_procs, args, text):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    done = run_main(monkeypatch, MODULE, args)
    assert done.failed and text in done.result["msg"]


def test_wait_reports_a_lost_gpu(monkeypatch, recorded_procs):
    fake = make_fake_nvml("loaded")
    fake.fake.lost = {0}
    monkeypatch.setattr(G, "pynvml", fake)
    done = run_main(monkeypatch, MODULE, {"timeout_s": 1})
    assert done.failed and "is lost" in done.result["msg"] and "reboot" in done.result["msg"]


# ------------------------------------------------------------------------------------------------ issue 9

@pytest.fixture
def smi_path(monkeypatch, tmp_path):
    """No nvidia-ml-py; install(**write_fake_smi kwargs) puts a replaying nvidia-smi first on PATH."""
    monkeypatch.setattr(G, "pynvml", None)
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: None for p in pids})

    def install(**kw):
        write_fake_smi(tmp_path, **kw)
        monkeypatch.setenv("PATH", "%s:%s" % (tmp_path, os.environ["PATH"]))

    return install


def test_wait_fails_at_once_when_memory_used_reads_na(monkeypatch, smi_path):
    smi_path(state="loaded", overrides={"memory.used": "[N/A]"})
    t = time.monotonic()
    done = run_main(monkeypatch, MODULE, {"timeout_s": 30})
    r = done.result
    assert done.failed and r["error_class"] == "field_unavailable" and time.monotonic() - t < 10
    assert r["msg"].startswith("GPU 0 (GPU-8b76e503-d849-6334-acea-f57e29736cb3): memory.used unreadable "
                               "(nvidia-smi reads '[N/A]')")
    assert "held" not in r["msg"]
    assert "None MiB" not in r["msg"]


def test_wait_fails_at_once_when_nvidia_smi_finds_no_devices(monkeypatch, smi_path):
    smi_path(fail=[6, "No devices were found\n"])
    done = run_main(monkeypatch, MODULE, {"timeout_s": 30})
    assert done.failed and done.result["error_class"] == "no_devices"
    assert done.result["msg"].startswith("No devices were found")


def test_wait_fails_when_fewer_gpus_than_expected(monkeypatch, recorded_procs):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    done = run_main(monkeypatch, MODULE, {"expected_count": 8, "timeout_s": 30})
    assert done.failed and done.result["error_class"] == "fewer_gpus" and "expected 8" in done.result["msg"]
    assert not run_main(monkeypatch, MODULE, {"expected_count": 2, "timeout_s": 0}).failed


def test_wait_on_a_hung_nvidia_smi_fails_within_its_budget(monkeypatch, smi_path):
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_errors as E
    monkeypatch.setattr(E, "MIN_CALL_TIMEOUT_S", 0.5)
    smi_path(state="idle", hang_s=60)
    t = time.monotonic()
    done = run_main(monkeypatch, MODULE, {"timeout_s": 1})
    took = time.monotonic() - t
    assert done.failed and done.result["error_class"] == "timeout" and took < 4, took
    assert "did not answer within 1.0 s" in done.result["msg"] and "D state" in done.result["msg"]


def test_wait_in_slices_reports_progress_then_counts_from_the_first_start(monkeypatch, recorded_procs):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    # 20 s: a slice lasts at least timeout_s / 100 (0.2 s here)
    done = run_main(monkeypatch, MODULE, {"timeout_s": 20, "slice_s": 0.2, "poll_interval_ms": 50})
    r = done.result
    assert not done.failed and r["ready"] is False and r["polls"] >= 4
    assert r["progress"].startswith("GPU memory: 2 of 2 GPUs above 1024 MiB (max 31339 MiB on GPU 0), 0 s of 20 s")
    started = r["started_at"]
    releasing_nvml(monkeypatch, release_after_calls=4)
    done = run_main(monkeypatch, MODULE, {"timeout_s": 60, "slice_s": 5, "poll_interval_ms": 10,
                                         "started_at": started - 20})
    assert not done.failed and done.result["ready"] is True
    assert 20000 <= done.result["elapsed_ms"] < 30000 and done.result["started_at"] == round(started - 20, 3)


def test_wait_slice_past_the_whole_timeout_fails_as_not_released(monkeypatch, recorded_procs):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    done = run_main(monkeypatch, MODULE, {"timeout_s": 10, "slice_s": 5, "started_at": time.time() - 10})
    assert done.failed and done.result["error_class"] == "not_released" and done.result["polls"] == 1
    assert done.result["msg"].startswith("GPU memory not released after 10.0 s")


def test_wait_message_names_fd_holders_when_no_compute_process_is_listed(monkeypatch):
    fake = make_fake_nvml("loaded")
    for gpu in fake.fake.gpus:
        gpu["procs"] = []  # 31 GiB used, nothing listed (a container without the host PID namespace)
    monkeypatch.setattr(G, "pynvml", fake)
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {
        300: ["/dev/nvidiactl", "/dev/nvidia-uvm"], 77: ["/dev/nvidia0", "/dev/nvidiactl"],
        90: ["/dev/nvidia1"]})
    names = {300: ("python3", ["python3", "-m", "my_job"]), 77: ("nv-hostengine", ["nv-hostengine"]),
             90: ("python3", ["python3", "train.py"])}
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: {"name": names[p][0], "cmdline": names[p][1]}
                                                          for p in pids})
    done = run_main(monkeypatch, MODULE, {"timeout_s": 0})
    msg = done.result["msg"]
    assert "kill the pids listed" not in msg
    assert "processes with a GPU device open: pid 90: python3 train.py" in msg
    assert "processes holding only the shared nodes (nvidiactl, nvidia-uvm): pid 300: python3 -m my_job" in msg
    assert msg.index("pid 90: python3 train.py |") < msg.index("pid 300")
    assert "pid 77" not in msg.split("candidates")[1]  # the monitor is not a candidate ...
    assert "monitors with it open (they hold no memory, leave them): pid 77: nv-hostengine" in msg  # ... but named
    kinds = {h["pid"]: h["kind"] for h in done.result["device_holders"]}
    assert kinds == {90: "gpu", 300: "shared_only", 77: "monitor"}


def test_a_slice_lasts_at_least_a_hundredth_of_the_timeout():
    # gpu_memory_wait chains slices by a recursive include_tasks: -e gpu_memory_wait_slice_s=0.05 with memory not
    # released made ansible-playbook die ~245 levels deep ("Exceeded maximum object depth") after the stop, with no
    # rescue and no rollback.
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_wait as W
    assert W.slice_length({"slice_s": 10, "timeout_s": 120}) == 10.0  # the defaults: unchanged
    assert W.slice_length({"slice_s": 0.05, "timeout_s": 900}) == 9.0
    assert W.slice_length({"slice_s": None, "timeout_s": 900}) is None  # one call for the whole wait
    assert W._budget({"slice_s": 0.05, "timeout_s": 900}, started_at=100.0, now=lambda: 100.0) == 9.0
