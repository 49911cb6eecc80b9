"""nvidia_gpu_info: main() driven with module arguments, on the recorded H200 through both backends."""
import ast
import os
import time

import pytest
import yaml

import module_docs

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_info as GI
from fake_pynvml import DRIVER_NOT_LOADED_TEXT, make_fake_nvml
from gpu_module_harness import (ROOT, load_module, recorded_process_info, run_main, use_recorded_processes,
                                write_fake_smi)

MODULE = load_module("nvidia_gpu_info")
# One whole entry per GPU (the tests read gpus); the default short form has tests of its own.
FULL = {"detail": "full"}


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
    tree = ast.parse(open(os.path.join(ROOT, "plugins", "modules", "nvidia_gpu_info.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "RETURN":
            return yaml.safe_load(node.value.value)


def test_info_reports_every_gpu_with_documented_fields_via_nvml(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, FULL | {})
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
    done = run_main(monkeypatch, MODULE, FULL | {"_ansible_check_mode": True, "processes": False})
    assert not done.failed and done.result["changed"] is False and len(done.result["gpus"]) == 2
    assert nvml.fake.initialized == 0  # session closed


def test_info_falls_back_to_nvidia_smi_without_nvml_and_survives_invalid_utf8(monkeypatch, smi_only, no_holders):
    smi_only(state="loaded", apps_extra=[b"4242, 100, GPU-8b76e503-d849-6334-acea-f57e29736cb3, "
                                         b"00000000:00:06.0, /opt/w\xffrker"])
    done = run_main(monkeypatch, MODULE, FULL | {})
    r = done.result
    assert not done.failed, r
    assert r["backend"] == "nvidia-smi" and "not installed" in r["backend_fallback_reason"]
    assert r["cuda_version"] == "13.0"  # from the table banner
    names = {p["pid"]: p["name"] for p in r["gpus"][0]["processes"]}
    assert names[4242] == "/opt/w\ufffdrker"  # pid unknown to psutil: nvidia-smi's process_name is kept
    assert r["gpus"][0]["processes"][0]["source"] == ["nvidia-smi"]


def test_info_selects_gpus_by_uuid_and_index(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, FULL | {"gpus": ["GPU-fc5ce087-20ff-f609-f8fc-c4b5cbf772f5"]})
    assert [g["index"] for g in done.result["gpus"]] == [1] and done.result["gpu_count"] == 2
    done = run_main(monkeypatch, MODULE, FULL | {"gpus": [0]})
    assert [g["index"] for g in done.result["gpus"]] == [0]


def test_info_fails_clearly_for_an_unknown_gpu(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, FULL | {"gpus": [3]})
    assert done.failed and "no GPU with index 3" in done.result["msg"]
    assert "GPU-8b76e503-d849-6334-acea-f57e29736cb3" in done.result["msg"]


def test_info_rejects_a_malformed_selector(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, FULL | {"gpus": ["gpu0"]})
    assert done.failed and "neither a GPU index" in done.result["msg"]


def test_info_rejects_an_unknown_backend_choice(monkeypatch, nvml):
    done = run_main(monkeypatch, MODULE, FULL | {"backend": "dcgm"})
    assert done.failed and "backend" in done.result["msg"]


def test_info_with_explicit_nvml_reports_missing_library(monkeypatch):
    monkeypatch.setattr(G, "pynvml", None)
    done = run_main(monkeypatch, MODULE, FULL | {"backend": "nvml"})
    assert done.failed and "nvidia-ml-py" in done.result["msg"] and "Failed to import" in done.result["msg"]


def test_info_reports_missing_psutil_only_when_processes_are_asked(monkeypatch, nvml):
    monkeypatch.setattr(MODULE, "HAS_PSUTIL", False)
    done = run_main(monkeypatch, MODULE, FULL | {})
    assert done.failed and "psutil" in done.result["msg"]
    done = run_main(monkeypatch, MODULE, FULL | {"processes": False})
    assert not done.failed and "processes" not in done.result["gpus"][0]


def test_info_fails_with_driver_advice_when_nvidia_smi_cannot_reach_the_driver(monkeypatch, smi_only):
    smi_only(fail=[9, DRIVER_NOT_LOADED_TEXT])
    done = run_main(monkeypatch, MODULE, FULL | {"backend": "nvidia-smi"})
    assert done.failed and done.result["rc"] == 9 and "lsmod" in done.result["msg"]
    assert "couldn't communicate" in done.result["stdout"]


def test_info_fails_when_no_backend_exists(monkeypatch, tmp_path):
    monkeypatch.setattr(G, "pynvml", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(MODULE.AnsibleModule, "get_bin_path", lambda self, name, *a, **k: None)
    done = run_main(monkeypatch, MODULE, FULL | {})
    msg = done.result["msg"]
    assert done.failed and done.result["error_class"] == "backend_unavailable"
    assert msg.startswith("nvidia-smi was not found") and "NVML was tried first: nvidia-ml-py" in msg


def test_info_device_holders_match_their_documentation(monkeypatch, nvml):
    recorded = recorded_process_info()
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {682: ["/dev/nvidia0", "/dev/nvidiactl"],
                                                                 900: ["/dev/nvidiactl", "/dev/nvidia-uvm"]})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: recorded.get(p) for p in pids})
    r = run_main(monkeypatch, MODULE, FULL | {}).result
    doc = return_doc()["device_holders"]["contains"]
    holders = {h["pid"]: h for h in r["device_holders"]}
    assert all(set(h) == set(doc) for h in holders.values())
    assert holders[900]["gpu_indices"] == [] and holders[682]["gpu_indices"] == [0]
    gpu0 = {p["pid"]: p["source"] for p in r["gpus"][0]["processes"]}
    assert gpu0 == {682: ["nvml", "proc_fd"]}
    # gpus=1: the holder of GPU 0 only is not GPU 1's; the one that holds no specific GPU still counts
    r = run_main(monkeypatch, MODULE, FULL | {"gpus": [1]}).result
    assert [h["pid"] for h in r["device_holders"]] == [900]


# ------------------------------------------------------------------------------------------------ issue 9

MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.159\n"
LOST = ("Unable to determine the device handle for GPU0000:00:07.0: GPU is lost.  "
        "Reboot the system to recover this GPU\n")
HANDLE = "0, GPU-8b76e503-d849-6334-acea-f57e29736cb3, 00000000:00:06.0, NVIDIA H200\n" \
         "Unable to determine the device handle for GPU 0000:00:07.0: Unknown Error\n"


@pytest.mark.parametrize("rc, text, cls", [(6, "No devices were found\n", "no_devices"),
                                           (9, DRIVER_NOT_LOADED_TEXT, "driver_not_loaded"),
                                           (15, LOST, "gpu_lost"), (18, MISMATCH, "driver_mismatch"),
                                           (255, HANDLE, "device_handle_error")])
def test_info_names_each_nvidia_smi_failure_with_the_driver_text_first(monkeypatch, smi_only, tmp_path, rc, text,
                                                                      cls):
    log = tmp_path / "kmsg"
    log.write_text("4,1,%d,-;NVRM: Xid (PCI:0000:00:07): 79, pid=1, name=python3, GPU has fallen off the bus.\n"
                   % int((time.monotonic() - 60) * 1e6))
    smi_only(fail=[rc, text])
    done = run_main(monkeypatch, MODULE, FULL | {"kmsg_path": str(log)})
    r = done.result
    assert done.failed and r["error_class"] == cls and r["rc"] == rc
    first = [ln for ln in text.splitlines() if ln.startswith(("Unable", "No dev", "NVIDIA-SMI", "Failed"))][0]
    assert r["msg"].startswith(first.strip())
    assert "NVML: NVML" not in r["msg"] and "NVML was tried first" in r["msg"]
    # the kernel log is read into the failure: the operator sees the Xid at once
    assert r["xid_status"] == "ok" and r["xid_events"][0]["xid"] == 79 and "Xid events (" in r["msg"]


def test_info_reports_health_fields_with_raw_text_for_what_h200_cannot_report(monkeypatch, smi_only, no_holders):
    smi_only(state="idle")
    r = run_main(monkeypatch, MODULE, FULL | {}).result
    gpu = r["gpus"][0]
    assert gpu["unsupported"] == {"retired_pages_single_bit_ecc_count": "[N/A]",
                                  "retired_pages_double_bit_ecc_count": "[N/A]", "retired_pages_pending": "[N/A]"}
    assert gpu["nvlinks"] == [] and gpu["pcie_link_width_max"] == 16 and gpu["temperature_memory_c"] == 34
    assert set(gpu) == set(return_doc()["gpus"]["contains"])


def test_info_fails_on_fewer_gpus_than_expected_and_passes_on_enough(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, FULL | {"expected_count": 8, "processes": False})
    assert done.failed and done.result["error_class"] == "fewer_gpus"
    assert done.result["msg"].startswith("NVML lists 2 GPUs, expected 8")
    assert not run_main(monkeypatch, MODULE, FULL | {"expected_count": 2, "processes": False}).failed


def test_info_reads_xid_events_in_the_window_and_maps_them_to_gpus(monkeypatch, nvml, no_holders, tmp_path):
    now = time.monotonic()
    log = tmp_path / "kmsg"
    log.write_text("".join("4,%d,%d,-;NVRM: Xid (PCI:0000:00:%s): %d, pid=9, name=x, t\n" % (n, int(ts * 1e6), bus, x)
                           for n, (ts, bus, x) in enumerate([(now - 7200, "06", 13), (now - 30, "07", 48),
                                                             (now - 5, "1b", 79)])))
    r = run_main(monkeypatch, MODULE, FULL | {"kmsg_path": str(log), "xid_window_min": 60, "processes": False}).result
    assert r["xid_status"] == "ok" and r["xid_source"] == str(log)
    assert [(e["xid"], e["gpu_index"]) for e in r["xid_events"]] == [(48, 1), (79, None)]
    assert set(r["xid_events"][0]) == set(return_doc()["xid_events"]["contains"])


def test_info_unreadable_kernel_log_is_unknown_not_none(monkeypatch, nvml, no_holders, tmp_path):
    r = run_main(monkeypatch, MODULE, FULL | {"kmsg_path": str(tmp_path / "missing"), "processes": False}).result
    assert r["xid_events"] is None and r["xid_status"] == "unknown" and "Xid events unknown" in r["xid_reason"]
    r = run_main(monkeypatch, MODULE, FULL | {"xid_window_min": 0, "processes": False}).result
    assert r["xid_status"] == "skipped" and r["xid_events"] is None


def test_info_on_a_hung_nvidia_smi_fails_as_timeout_within_timeout_s(monkeypatch, tmp_path):
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_errors as E
    monkeypatch.setattr(E, "MIN_CALL_TIMEOUT_S", 0.5)
    monkeypatch.setattr(G, "pynvml", None)
    write_fake_smi(tmp_path, state="idle", hang_s=60)
    monkeypatch.setenv("PATH", "%s:%s" % (tmp_path, os.environ["PATH"]))
    t = time.monotonic()
    done = run_main(monkeypatch, MODULE, FULL | {"timeout_s": 1, "processes": False})
    assert done.failed and done.result["error_class"] == "timeout" and time.monotonic() - t < 4
    assert done.result["msg"].startswith("`nvidia-smi --query-gpu=index,uuid,pci.bus_id,serial,")


def test_info_nvlink_state_through_nvml(monkeypatch, nvml, no_holders):
    nvml.fake.gpus[0]["nvlinks"] = [(1, [0, 0, 0, 0]), (0, [0, 5, 0, 0])]
    r = run_main(monkeypatch, MODULE, FULL | {"processes": False}).result
    assert [(l["link"], l["state"], l["recovery_errors"]) for l in r["gpus"][0]["nvlinks"]] == [
        (0, "active", 0), (1, "inactive", 5)]
    assert r["gpus"][1]["nvlinks"] == []
    assert set(r["gpus"][0]["nvlinks"][0]) == set(return_doc()["gpus"]["contains"]["nvlinks"]["contains"])


@pytest.mark.parametrize("name, options", [
    ("nvidia_gpu_info", {"gpus", "fields", "detail", "processes", "backend", "expected_count", "timeout_s", "nvlink", "xid_window_min",
                         "kmsg_path"}),
    ("nvidia_gpu_wait", {"gpus", "max_used_mib", "baseline_mib", "require_no_processes", "poll_interval_ms",
                         "timeout_s", "slice_s",
                         "started_at", "expected_count", "backend"}),
])
def test_documentation_parses_and_documents_every_option(name, options):
    """Options as ansible-doc shows them: the module's own plus the nvidia_gpu doc fragment's."""
    rendered = module_docs.rendered()[name]
    assert set(rendered["doc"]["options"]) == options
    tree = ast.parse(open(os.path.join(ROOT, "plugins", "modules", name + ".py")).read())
    docs = {n.targets[0].id: yaml.safe_load(n.value.value) for n in tree.body
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") in ("DOCUMENTATION", "RETURN", "EXAMPLES")}
    assert "error_class" in docs["RETURN"] and isinstance(docs["EXAMPLES"], list)


def test_info_runs_nvidia_smi_five_times_for_a_full_read_and_twice_for_a_bare_one(monkeypatch, smi_only,
                                                                                   no_holders, tmp_path):
    """Issue 14: the open runs the full details query (it carries the inventory and the driver version),
    so one call costs 5 runs (was 7): details, the banner for CUDA, nvlink -s, nvlink -e, compute apps."""
    log = tmp_path / "smi-calls"
    smi_only(state="loaded", call_log=log)
    done = run_main(monkeypatch, MODULE, FULL | {})
    assert not done.failed, done.result
    calls = log.read_text().splitlines()
    assert [c.split("=", 1)[0] for c in calls] == ["--query-gpu", "", "nvlink -s", "nvlink -e",
                                                   "--query-compute-apps"]
    assert calls[0] == "--query-gpu=%s --format=csv,noheader,nounits" % ",".join(f for f, _, _ in G.SMI_GPU_QUERY)
    assert done.result["driver_version"] == "580.159.04" and done.result["gpus"][1]["pci_bus_id"]
    log.write_text("")
    assert not run_main(monkeypatch, MODULE, FULL | {"processes": False, "nvlink": False}).failed
    assert [c.split("=", 1)[0] for c in log.read_text().splitlines()] == ["--query-gpu", ""]


def test_info_reads_the_same_through_the_prefetched_details_as_through_separate_queries(no_holders):
    """The prefetching open gives gather() what the probe + driver + details queries gave, field for field,
    also when the driver rejects an optional field (rc 2, dropped and retried once)."""
    from fake_pynvml import RecordedSmi
    for rejected in ((), ("memory.reserved",)):
        results, runs = [], []
        for prefetch in (False, True):
            smi = RecordedSmi(state="loaded", invalid_fields=rejected)
            backend = G.SmiBackend(smi, "nvidia-smi", prefetch_details=prefetch).open()
            results.append(MODULE.gather(backend, [], processes=True, exclude_pids=set()))
            runs.append(len(smi.calls))
        assert results[0] == results[1]
        assert runs == [7 + len(rejected), 5 + len(rejected)]
    gpu = results[1]["gpus"][0]
    assert gpu["memory_reserved_mib"] is None and "not known" in gpu["unsupported"]["memory_reserved_mib"]


def test_info_prefetched_details_serve_one_details_call_only(no_holders):
    """A second details() in the same session reads the driver again (a prefetched snapshot must not go stale)."""
    from fake_pynvml import RecordedSmi
    smi = RecordedSmi(states=["loaded", "idle"])
    backend = G.SmiBackend(smi, "nvidia-smi", prefetch_details=True).open()
    assert backend.details()[0]["memory_used_mib"] > 30000
    assert backend.details()[0]["memory_used_mib"] == 0
    assert len(smi.calls) == 2


def test_fields_cut_each_gpu_to_the_keys_asked_by_either_name(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, FULL | {"fields": ["memory.used", "utilization_gpu_pct", "memory.used"]})
    assert not done.failed, done.result
    gpus = done.result["gpus"]
    assert [list(g) for g in gpus] == [["index", "memory_used_mib", "utilization_gpu_pct"]] * 2
    assert gpus[0]["memory_used_mib"] == 31339 and done.result["device_holders"] is None  # processes not asked: not read


def test_fields_read_nvlinks_and_processes_only_when_asked(monkeypatch, smi_only, no_holders, tmp_path):
    log = tmp_path / "smi-calls"
    smi_only(state="loaded", call_log=log)
    done = run_main(monkeypatch, MODULE, FULL | {"fields": ["memory.used", "power.draw"]})
    assert not done.failed, done.result
    assert [c.split("=", 1)[0] for c in log.read_text().splitlines()] == ["--query-gpu", ""]
    assert set(done.result["gpus"][0]) == {"index", "memory_used_mib", "power_draw_w"}
    log.write_text("")
    done = run_main(monkeypatch, MODULE, FULL | {"fields": ["processes", "nvlinks"], "processes": False, "nvlink": False})
    assert not done.failed, done.result
    assert [c.split("=", 1)[0] for c in log.read_text().splitlines()] == ["--query-gpu", "", "nvlink -s", "nvlink -e",
                                                                         "--query-compute-apps"]
    assert set(done.result["gpus"][0]) == {"index", "nvlinks", "processes"} and done.result["gpus"][0]["processes"]


def test_fields_keep_the_raw_answer_of_an_unsupported_field_asked_for(monkeypatch, smi_only, no_holders):
    smi_only(state="loaded")
    full = run_main(monkeypatch, MODULE, FULL | {"processes": False}).result["gpus"][0]
    raw = sorted(full["unsupported"])
    assert raw, full  # the H200 recording prints [N/A] for some fields
    done = run_main(monkeypatch, MODULE, FULL | {"fields": [raw[0], "memory.used"]})
    gpu = done.result["gpus"][0]
    assert gpu[raw[0]] is None and gpu["unsupported"] == {raw[0]: full["unsupported"][raw[0]]}
    assert "unsupported" not in run_main(monkeypatch, MODULE, FULL | {"fields": ["memory.used"]}).result["gpus"][0]


def test_an_unknown_field_fails_before_any_gpu_is_read(monkeypatch, nvml):
    done = run_main(monkeypatch, MODULE, FULL | {"fields": ["memory.used", "memory.free_gb", "unsupported"]})
    assert done.failed and done.result["error_class"] == "bad_option"
    assert "'memory.free_gb', 'unsupported' not a GPU field" in done.result["msg"]
    assert "memory_used_mib" in done.result["msg"] and "utilization.gpu" in done.result["msg"]
    assert nvml.fake.initialized == 0


# ------------------------------------------------------------------------------ detail: short (the default)

def test_short_answer_says_what_every_gpu_shares_once_and_groups_the_rest(monkeypatch, smi_only, no_holders):
    smi_only(state="loaded")
    full = run_main(monkeypatch, MODULE, FULL | {"processes": False}).result
    short = run_main(monkeypatch, MODULE, {"processes": False}).result
    assert "gpus" not in short and set(short) - {"gpus_same", "gpu_groups"} == set(full) - {"gpus"}
    same, groups = short["gpus_same"], short["gpu_groups"]
    # the recorded host's two GPUs share the product, the driver's [N/A] answers and their memory use ...
    assert same["name"] == full["gpus"][0]["name"] and same["unsupported"] == full["gpus"][0]["unsupported"]
    assert same["memory_used_mib"] == 31339
    # ... and differ in identity: one group each, holding only what differs
    assert [g["gpus"] for g in groups] == ["0", "1"]
    assert {"uuid", "pci_bus_id"} <= set(groups[0]) and not set(groups[0]) & set(same)
    # nothing is lost: the shared values combined with a GPU's group are its whole entry
    for gpu, group in zip(full["gpus"], groups):
        whole = dict(same, **{k: v for k, v in group.items() if k != "gpus"})
        assert whole == {k: v for k, v in gpu.items() if k != "index"}


def test_short_answer_of_one_field_the_same_on_every_gpu_is_one_group(monkeypatch, nvml, no_holders):
    done = run_main(monkeypatch, MODULE, {"fields": ["memory.used"]})
    assert not done.failed, done.result
    assert done.result["gpus_same"] == {"memory_used_mib": 31339}
    assert done.result["gpu_groups"] == [{"gpus": "0,1"}]


def test_short_form_groups_gpus_by_the_values_that_differ_in_index_order():
    gpus = [{"index": i, "name": "NVIDIA H200", "memory_used_mib": 0 if i in (0, 1, 2, 5) else 31339,
             "nvlinks": [{"link": 0, "state": "active"}]} for i in range(8)]
    out = GI.short_form(gpus)
    assert out["gpus_same"] == {"name": "NVIDIA H200", "nvlinks": [{"link": 0, "state": "active"}]}
    assert out["gpu_groups"] == [{"gpus": "0-2,5", "memory_used_mib": 0}, {"gpus": "3,4,6,7", "memory_used_mib": 31339}]
    # a key one GPU lacks is never "the same on every GPU"
    out = GI.short_form([{"index": 0, "unsupported": {"x": "[N/A]"}}, {"index": 1}])
    assert out == {"gpus_same": {}, "gpu_groups": [{"gpus": "0", "unsupported": {"x": "[N/A]"}}, {"gpus": "1"}]}
    assert GI.short_form([]) == {"gpus_same": {}, "gpu_groups": []}


@pytest.mark.parametrize("indices, machine, people", [
    ([0, 1, 2, 3, 4, 5, 6, 7], "0-7", "0\u20137"),
    ([5, 0, 2, 1, 1], "0-2,5", "0\u20132, 5"),
    ([3], "3", "3"),
    ([0, 1], "0,1", "0, 1"),
    ([1, 3, 4, 6, 7, 8], "1,3,4,6-8", "1, 3, 4, 6\u20138"),
    ([], "", ""),
])
def test_index_ranges_for_machines_and_for_people(indices, machine, people):
    assert GI.index_ranges(indices) == machine
    assert GI.index_ranges(indices, dash="\u2013", sep=", ") == people
