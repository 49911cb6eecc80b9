"""nvidia_gpu_info: main() driven with module arguments, on the recorded H200 through both backends."""
import ast
import os

import pytest
import yaml

from ansible.module_utils import gpufleet_gpu as G
from fake_pynvml import DRIVER_NOT_LOADED_TEXT, make_fake_nvml
from gpu_module_harness import (ROOT, load_module, recorded_process_info, run_main, use_recorded_processes,
                                write_fake_smi)

MODULE = load_module("nvidia_gpu_info")


@pytest.fixture
def no_holders(monkeypatch):
    """Keep this machine's /proc out of it and describe pids from the recording (loaded-proc.txt)."""
    use_recorded_processes(monkeypatch)


@pytest.fixture
def nvml(monkeypatch):
    fake = make_fake_nvml("loaded")
    monkeypatch.setattr(G, "pynvml", fake)
    return fake


@pytest.fixture
def smi_only(monkeypatch, tmp_path):
    """No nvidia-ml-py; a replaying nvidia-smi first on PATH."""
    monkeypatch.setattr(G, "pynvml", None)

    def install(**kw):
        d = tmp_path / "bin"
        d.mkdir(exist_ok=True)
        write_fake_smi(d, **kw)
        monkeypatch.setenv("PATH", "%s:%s" % (d, os.environ["PATH"]))

    return install


def return_doc():
    tree = ast.parse(open(os.path.join(ROOT, "library", "nvidia_gpu_info.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "RETURN":
            return yaml.safe_load(node.value.value)


def test_info_reports_every_gpu_with_documented_fields_via_nvml(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, {})
    r = done.result
    assert not done.failed and r["changed"] is False
    assert r["backend"] == "nvml" and r["gpu_count"] == 2 and r["driver_version"] == "580.159.04"
    assert r["cuda_version"] == "13.0"
    doc = return_doc()
    gpu_keys = set(doc["gpus"]["contains"])
    for gpu in r["gpus"]:
        assert set(gpu) == gpu_keys
        assert gpu["memory_used_mib"] == 31339 and gpu["memory_reserved_mib"] == 616
    proc = r["gpus"][0]["processes"][0]
    assert proc["pid"] == 682 and proc["used_memory_mib"] == 31330 and proc["source"] == ["nvml"]
    assert "spawn_main(tracker_fd=4, pipe_handle=6)" in proc["cmdline"]
    assert set(proc) == set(doc["gpus"]["contains"]["processes"]["contains"])
    assert set(r) - {"changed", "invocation"} <= set(doc)


def test_info_runs_in_check_mode_and_changes_nothing(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, {"_ansible_check_mode": True, "processes": False})
    assert not done.failed and done.result["changed"] is False and len(done.result["gpus"]) == 2
    assert nvml.fake.initialized == 0  # session closed


def test_info_falls_back_to_nvidia_smi_without_nvml_and_survives_invalid_utf8(monkeypatch, smi_only, no_holders):
    smi_only(state="loaded", apps_extra=[b"4242, 100, GPU-8b76e503-d849-6334-acea-f57e29736cb3, "
                                         b"00000000:00:06.0, /opt/w\xffrker"])
    done = run_main(monkeypatch, MODULE, {})
    r = done.result
    assert not done.failed, r
    assert r["backend"] == "nvidia-smi" and "not installed" in r["backend_fallback_reason"]
    assert r["cuda_version"] == "13.0"  # from the table banner
    names = {p["pid"]: p["name"] for p in r["gpus"][0]["processes"]}
    assert names[4242] == "/opt/w\ufffdrker"  # pid unknown to psutil: nvidia-smi's process_name is kept
    assert r["gpus"][0]["processes"][0]["source"] == ["nvidia-smi"]


def test_info_selects_gpus_by_uuid_and_index(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, {"gpus": ["GPU-fc5ce087-20ff-f609-f8fc-c4b5cbf772f5"]})
    assert [g["index"] for g in done.result["gpus"]] == [1] and done.result["gpu_count"] == 2
    done = run_main(monkeypatch, MODULE, {"gpus": [0]})
    assert [g["index"] for g in done.result["gpus"]] == [0]


def test_info_fails_clearly_for_an_unknown_gpu(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, {"gpus": [3]})
    assert done.failed and "no GPU with index 3" in done.result["msg"]
    assert "GPU-8b76e503-d849-6334-acea-f57e29736cb3" in done.result["msg"]


def test_info_rejects_a_malformed_selector(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, {"gpus": ["gpu0"]})
    assert done.failed and "neither a GPU index" in done.result["msg"]


def test_info_rejects_an_unknown_backend_choice(monkeypatch, nvml):
    done = run_main(monkeypatch, MODULE, {"backend": "dcgm"})
    assert done.failed and "backend" in done.result["msg"]


def test_info_with_explicit_nvml_reports_missing_library(monkeypatch):
    monkeypatch.setattr(G, "pynvml", None)
    done = run_main(monkeypatch, MODULE, {"backend": "nvml"})
    assert done.failed and "nvidia-ml-py" in done.result["msg"] and "Failed to import" in done.result["msg"]


def test_info_reports_missing_psutil_only_when_processes_are_asked(monkeypatch, nvml):
    monkeypatch.setattr(MODULE, "HAS_PSUTIL", False)
    done = run_main(monkeypatch, MODULE, {})
    assert done.failed and "psutil" in done.result["msg"]
    done = run_main(monkeypatch, MODULE, {"processes": False})
    assert not done.failed and "processes" not in done.result["gpus"][0]


def test_info_fails_with_driver_advice_when_nvidia_smi_cannot_reach_the_driver(monkeypatch, smi_only):
    smi_only(fail=[9, DRIVER_NOT_LOADED_TEXT])
    done = run_main(monkeypatch, MODULE, {"backend": "nvidia-smi"})
    assert done.failed and done.result["rc"] == 9 and "lsmod" in done.result["msg"]
    assert "couldn't communicate" in done.result["stdout"]


def test_info_fails_when_no_backend_exists(monkeypatch, tmp_path):
    monkeypatch.setattr(G, "pynvml", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(MODULE.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: None)
    done = run_main(monkeypatch, MODULE, {})
    msg = done.result["msg"]
    assert done.failed and done.result["error_class"] == "backend_unavailable"
    assert msg.startswith("nvidia-smi was not found") and "NVML was tried first: nvidia-ml-py" in msg


def test_info_device_holders_match_their_documentation(monkeypatch, nvml):
    recorded = recorded_process_info()
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {682: ["/dev/nvidia0", "/dev/nvidiactl"],
                                                                 900: ["/dev/nvidiactl", "/dev/nvidia-uvm"]})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: recorded.get(p) for p in pids})
    r = run_main(monkeypatch, MODULE, {}).result
    doc = return_doc()["device_holders"]["contains"]
    holders = {h["pid"]: h for h in r["device_holders"]}
    assert all(set(h) == set(doc) for h in holders.values())
    assert holders[900]["gpu_indices"] == [] and holders[682]["gpu_indices"] == [0]
    gpu0 = {p["pid"]: p["source"] for p in r["gpus"][0]["processes"]}
    assert gpu0 == {682: ["nvml", "proc_fd"]}
