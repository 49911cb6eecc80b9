"""gpufleet_gpu: both backends against a real H200 recording, errors, backend choice, selectors, wait loop."""
import json
import os

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
from fake_pynvml import (
    DRIVER_NOT_LOADED_TEXT,
    GPU_LOST_TEXT,
    RecordedSmi,
    make_fake_nvml,
    parse_query_gpu,
    recording,
)
from gpu_module_harness import ROOT

COMMON = ("index", "uuid", "name", "pci_bus_id", "memory_used_mib", "memory_total_mib", "memory_reserved_mib",
          "utilization_gpu_pct", "temperature_gpu_c", "power_draw_w", "power_limit_w", "persistence_mode",
          "compute_mode", "ecc_errors_corrected_volatile_total", "ecc_errors_uncorrected_volatile_total",
          "remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending",
          "remapped_rows_failure")


def nvml_backend(state="loaded", **fake_state):
    fake = make_fake_nvml(state)
    for key, value in fake_state.items():
        setattr(fake.fake, key, value)
    backend, reason = G.open_backend("nvml", nvml=fake)
    return backend, fake


def smi_backend(**kw):
    runner = RecordedSmi(**kw)
    backend, _ = G.open_backend("nvidia-smi", runner=runner, smi_path="/usr/bin/nvidia-smi")
    return backend, runner


# ------------------------------------------------------------------------------------------------ fields

def test_smi_backend_returns_recorded_csv_values_converted():
    backend, _ = smi_backend(state="loaded")
    rows = parse_query_gpu("loaded-query-gpu-noheader-nounits.csv")
    gpus = backend.details()
    assert [g["uuid"] for g in gpus] == [r["uuid"] for r in rows]
    for gpu, row in zip(gpus, rows):
        assert gpu["memory_used_mib"] == int(row["memory.used"])
        assert gpu["memory_reserved_mib"] == int(row["memory.reserved"])
        assert gpu["power_draw_w"] == float(row["power.draw"])
        assert gpu["temperature_gpu_c"] == int(row["temperature.gpu"])
        assert gpu["persistence_mode"] == row["persistence_mode"]
        assert gpu["remapped_rows_pending"] is False  # recorded "No"
        assert set(gpu) == set(G.GPU_FIELDS)


def test_nvml_and_smi_backends_agree_on_recorded_loaded_h200():
    nvml, _ = nvml_backend("loaded")
    smi, _ = smi_backend(state="loaded")
    for a, b in zip(nvml.details(), smi.details()):
        for key in COMMON:
            assert a[key] == b[key], key
    assert [(p["gpu_index"], p["pid"], p["used_memory_mib"]) for p in nvml.compute_processes()] == \
           [(p["gpu_index"], p["pid"], p["used_memory_mib"]) for p in smi.compute_processes()]


def test_nvml_memory_used_excludes_reserved_memory_like_nvidia_smi():
    nvml, fake = nvml_backend("idle")
    smi, _ = smi_backend(state="idle")
    assert [m["memory_used_mib"] for m in nvml.memory()] == [m["memory_used_mib"] for m in smi.memory()] == [0, 0]
    # v1 would have said 615+ (reserved counted as used): the backend must not use it while v2 works.
    v1 = fake.nvmlDeviceGetMemoryInfo(0)
    assert G.bytes_to_mib(v1.used) > 600


def test_bytes_to_mib_rounds_up_as_measured_on_real_h200():
    with open(os.path.join(ROOT, "tests", "gpu", "results", "h200x2-driver580-run1.json")) as fh:
        measured = json.load(fh)
    for state in ("idle_raw", "loaded_raw"):
        smi_rows = [[int(v) for v in line.split(",")] for line in measured[state]["smi_mib"].splitlines()]
        for raw, smi in zip(measured[state]["nvml_v2_bytes"], smi_rows):
            assert [G.bytes_to_mib(raw[k]) for k in ("used_b", "reserved_b", "free_b", "total_b")] == smi[1:]


def test_smi_na_and_not_supported_values_become_null():
    row = recording("idle-query-gpu-noheader-nounits.csv").splitlines()[0]
    assert "[N/A]" in row  # the recording itself carries [N/A] (retired_pages.pending, fan.speed)

    def runner(argv, timeout_s=None):
        fields = argv[1].split("=", 1)[1].split(",")
        if fields[0] == "index" and len(fields) > 4:
            values = {"index": "0", "uuid": "GPU-1", "pci.bus_id": "00000000:00:06.0", "name": "NVIDIA H200",
                      "memory.used": "0", "memory.total": "143771", "memory.reserved": "[N/A]",
                      "power.draw": "[Not Supported]", "ecc.errors.corrected.volatile.total": "[N/A]",
                      "remapped_rows.pending": "[Not Supported]", "persistence_mode": "Enabled"}
            return 0, ", ".join(values.get(f, "[N/A]") for f in fields) + "\n", ""
        return RecordedSmi(state="idle")(argv)

    backend = G.SmiBackend(runner, "nvidia-smi")
    gpu = backend.details([0])[0]
    assert gpu["memory_reserved_mib"] is None
    assert gpu["power_draw_w"] is None
    assert gpu["ecc_errors_corrected_volatile_total"] is None
    assert gpu["remapped_rows_pending"] is None
    assert gpu["persistence_mode"] == "Enabled"
    assert gpu["unsupported"]["memory_reserved_mib"] == "[N/A]"
    assert gpu["unsupported"]["power_draw_w"] == "[Not Supported]"


def test_nvml_not_supported_field_is_null_not_a_crash():
    backend, fake = nvml_backend("loaded", unsupported={"remapped", "power", "ecc", "temp"})
    gpu = backend.details()[0]
    assert gpu["remapped_rows_pending"] is None and gpu["remapped_rows_correctable"] is None
    assert gpu["power_draw_w"] is None and gpu["temperature_gpu_c"] is None
    assert gpu["ecc_errors_uncorrected_volatile_total"] is None
    assert gpu["memory_used_mib"] == 31339


def test_nvml_falls_back_to_v1_memory_on_drivers_without_v2():
    backend, _ = nvml_backend("loaded", no_v2=True)
    mem = backend.memory()[0]
    assert mem["memory_reserved_mib"] is None
    # v1 "used" counts the reserved memory (recorded: v1 31953 vs v2 31338 floored, 615 apart).
    assert mem["memory_used_mib"] - 31339 in (615, 616)


def test_cuda_version_from_nvml_and_from_nvidia_smi_banner_agree():
    nvml, _ = nvml_backend()
    smi, _ = smi_backend()
    assert nvml.system() == smi.system() == {"driver_version": "580.159.04", "cuda_version": "13.0"}


# ------------------------------------------------------------------------------------------------ errors

def test_nvml_lost_gpu_raises_with_reset_or_reboot_advice():
    backend, fake = nvml_backend("loaded")
    backend.inventory()
    fake.fake.lost = {1}
    with pytest.raises(G.GpuLostError) as err:
        backend.details()
    assert "GPU 1" in err.value.msg and "00000000:00:07.0" in err.value.msg and "reboot" in err.value.msg


def test_smi_lost_gpu_message_raises_naming_the_bus_id():
    with pytest.raises(G.GpuLostError) as err:
        smi_backend(fail=(15, GPU_LOST_TEXT))
    assert "0000:00:07.0" in err.value.msg and "Xid 79" in err.value.msg
    assert err.value.rc == 15 and "GPU is lost" in err.value.stdout


def test_smi_driver_not_loaded_raises_with_what_to_check():
    with pytest.raises(G.DriverNotLoadedError) as err:
        smi_backend(fail=(9, DRIVER_NOT_LOADED_TEXT))
    assert "lsmod" in err.value.msg and err.value.fail_kwargs()["rc"] == 9


def test_smi_missing_binary_is_reported():
    with pytest.raises(G.BackendUnavailableError) as err:
        G.open_backend("nvidia-smi", runner=RecordedSmi(), smi_path=None)
    assert "nvidia-smi was not found" in err.value.msg


def test_smi_drops_fields_an_older_driver_rejects_and_remembers():
    backend, runner = smi_backend(state="loaded", invalid_fields={"memory.reserved", "remapped_rows.pending"})
    gpu = backend.details()[0]
    assert gpu["memory_reserved_mib"] is None and gpu["remapped_rows_pending"] is None
    assert gpu["memory_used_mib"] == 31339 and gpu["remapped_rows_correctable"] == 0
    before = len(runner.calls)
    backend.memory()
    assert len(runner.calls) == before + 1  # no second round of rejected queries


def test_smi_rejecting_a_required_field_fails_with_rc_and_output():
    backend, runner = smi_backend(state="loaded")
    runner.invalid_fields = {"memory.used"}
    with pytest.raises(G.GpuError) as err:
        backend.memory()
    assert err.value.rc == 2 and "memory.used" in err.value.stdout


def test_smi_no_devices_rc6_fails_at_once_with_the_driver_text_first():
    out = recording("error-bad-index.txt").split("rc=")[0]
    backend = G.SmiBackend(lambda argv, timeout_s=None: (6, out, ""), "nvidia-smi")
    with pytest.raises(G.NoDevicesError) as err:
        backend.inventory()
    assert err.value.msg.startswith("No devices were found\n")
    assert err.value.fail_kwargs()["error_class"] == "no_devices" and err.value.rc == 6


def test_smi_process_name_with_commas_and_invalid_utf8_is_kept_whole():
    weird = "999, 2048, GPU-8b76e503-d849-6334-acea-f57e29736cb3, 00000000:00:06.0, /opt/a, b/py\udcffthon"
    backend, _ = smi_backend(state="loaded", apps_extra=[weird])
    procs = {p["pid"]: p for p in backend.compute_processes()}
    assert procs[999]["process_name"] == "/opt/a, b/py\ufffdthon"
    assert procs[999]["gpu_index"] == 0 and procs[999]["used_memory_mib"] == 2048
    json.dumps(procs[999]).encode("utf-8")


# ------------------------------------------------------------------------------------------------ choice

def test_auto_falls_back_to_nvidia_smi_when_libnvidia_ml_is_missing():
    fake = make_fake_nvml()
    fake.fake.init_error = "LIBRARY_NOT_FOUND"
    backend, reason = G.open_backend("auto", runner=RecordedSmi(), smi_path="nvidia-smi", nvml=fake)
    assert backend.name == "nvidia-smi"
    assert "libnvidia-ml.so.1" in reason


def test_auto_falls_back_when_nvidia_ml_py_is_not_installed(monkeypatch):
    monkeypatch.setattr(G, "pynvml", None)
    backend, reason = G.open_backend("auto", runner=RecordedSmi(), smi_path="nvidia-smi")
    assert backend.name == "nvidia-smi" and "not installed" in reason


def test_auto_prefers_nvml_when_it_initialises():
    fake = make_fake_nvml()
    backend, reason = G.open_backend("auto", runner=RecordedSmi(), smi_path="nvidia-smi", nvml=fake)
    assert backend.name == "nvml" and reason is None and fake.fake.init_calls == 1


def test_explicit_nvml_without_library_raises_missing_library(monkeypatch):
    monkeypatch.setattr(G, "pynvml", None)
    with pytest.raises(G.MissingLibraryError) as err:
        G.open_backend("nvml")
    assert err.value.library == "nvidia-ml-py"


def test_explicit_nvml_with_driver_not_loaded_does_not_fall_back():
    fake = make_fake_nvml()
    fake.fake.init_error = "DRIVER_NOT_LOADED"
    with pytest.raises(G.DriverNotLoadedError) as err:
        G.open_backend("nvml", runner=RecordedSmi(), nvml=fake)
    assert "driver is not loaded" in err.value.msg


def test_auto_reports_both_reasons_when_no_backend_works():
    fake = make_fake_nvml()
    fake.fake.init_error = "DRIVER_NOT_LOADED"
    with pytest.raises(G.DriverNotLoadedError) as err:
        G.open_backend("auto", runner=RecordedSmi(fail=(9, DRIVER_NOT_LOADED_TEXT)), nvml=fake)
    msg = err.value.msg
    assert msg.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    assert "NVML: NVML" not in msg and msg.count("NVML was tried first: Driver Not Loaded") == 1
    assert msg.count("What to do:") == 1 and err.value.error_class == "driver_not_loaded"


def test_nvml_session_is_closed_once():
    backend, fake = nvml_backend()
    backend.close()
    backend.close()
    assert fake.fake.initialized == 0


# ------------------------------------------------------------------------------------------------ selectors

INV = [{"index": 0, "uuid": "GPU-8b76e503-d849-6334-acea-f57e29736cb3"},
       {"index": 1, "uuid": "GPU-fc5ce087-20ff-f609-f8fc-c4b5cbf772f5"}]


def test_selectors_accept_indices_and_uuids_in_inventory_order():
    assert G.resolve_selectors(["GPU-FC5CE087-20ff-f609-f8fc-c4b5cbf772f5", 0], INV) == [0, 1]
    assert G.resolve_selectors(["1"], INV) == [1]
    assert G.resolve_selectors([], INV) == [0, 1]


@pytest.mark.parametrize("bad", ["gpu0", -1, True, "00000000:00:06.0", 1.5, ""])
def test_selectors_reject_malformed_values(bad):
    with pytest.raises(G.SelectorError):
        G.parse_selectors([bad])


def test_unknown_selector_lists_the_gpus_present():
    with pytest.raises(G.SelectorError) as err:
        G.resolve_selectors([7], INV)
    assert "index 7" in err.value.msg and "1 (GPU-fc5ce087" in err.value.msg


# ------------------------------------------------------------------------------------------------ processes

def test_gpu_processes_merges_backend_list_and_fd_scan(monkeypatch):
    backend, _ = nvml_backend("loaded")
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {
        682: ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"], 900: ["/dev/nvidiactl", "/dev/nvidia-uvm"]})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: {"name": "n%d" % p, "cmdline": ["c", str(p)],
                                                              "user": "u"} for p in pids})
    per_gpu, holders = G.gpu_processes(backend, [0, 1])
    gpu0 = {p["pid"]: p for p in per_gpu[0]}
    assert gpu0[682]["source"] == ["nvml", "proc_fd"] and gpu0[682]["used_memory_mib"] == 31330
    gpu1 = {p["pid"]: p for p in per_gpu[1]}
    assert gpu1[683]["source"] == ["nvml"] and gpu1[682]["source"] == ["proc_fd"]
    assert gpu1[682]["used_memory_mib"] is None and gpu1[682]["cmdline"] == "c 682"
    by_pid = {h["pid"]: h for h in holders}
    assert by_pid[900]["gpu_indices"] == [] and by_pid[682]["gpu_indices"] == [0, 1]


def test_gpu_processes_leaves_out_the_calling_process(monkeypatch):
    backend, _ = nvml_backend("idle")
    me = os.getpid()
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: None for p in pids})
    calls = {}

    def holders(**kw):
        calls.update(kw)
        return {}

    monkeypatch.setattr(G, "find_device_holders", holders)
    G.gpu_processes(backend, [0])
    assert me in calls["exclude_pids"]


# ------------------------------------------------------------------------------------------------ wait loop

class Clock:
    def __init__(self, poll_cost_s=0.0):
        self.t = 100.0
        self.sleeps = []
        self.poll_cost_s = poll_cost_s

    def now(self):
        return self.t

    def sleep(self, s):
        self.sleeps.append(round(s, 6))
        self.t += s


class ScriptedBackend:
    """Memory per poll from a script; the last entry repeats."""
    name = "nvml"

    def __init__(self, used_per_poll, procs_per_call=None, clock=None):
        self.used = list(used_per_poll)
        self.procs = list(procs_per_call or [])
        self.clock = clock
        self.memory_calls = 0

    def memory(self, indices=None):
        self.memory_calls += 1
        used = self.used.pop(0) if len(self.used) > 1 else self.used[0]
        if self.clock:
            self.clock.t += self.clock.poll_cost_s
        return [{"index": i, "uuid": "GPU-%d" % i, "memory_used_mib": u, "memory_total_mib": 143771,
                 "memory_reserved_mib": 616} for i, u in enumerate(used) if indices is None or i in indices]

    def compute_processes(self, indices=None):
        return self.procs.pop(0) if len(self.procs) > 1 else (self.procs[0] if self.procs else [])


def test_wait_returns_when_memory_released_after_several_polls():
    clock = Clock()
    backend = ScriptedBackend([[31339, 31339], [31339, 0], [0, 0]])
    out = G.wait_for_memory(backend, [0, 1], 1024, poll_interval_ms=50, timeout_s=10, clock=clock.now,
                            sleep=clock.sleep)
    assert out["ready"] and out["polls"] == 3 and out["elapsed_ms"] == 100 and out["busy"] == []


def test_wait_times_out_and_names_busy_gpus():
    clock = Clock()
    backend = ScriptedBackend([[31339, 0]])
    out = G.wait_for_memory(backend, [0, 1], 1024, poll_interval_ms=100, timeout_s=1, clock=clock.now,
                            sleep=clock.sleep)
    assert not out["ready"] and out["busy"] == [0] and out["polls"] == 11 and out["elapsed_ms"] == 1000


def test_wait_keeps_a_fixed_cadence_when_polls_cost_time():
    clock = Clock(poll_cost_s=0.030)  # an nvidia-smi call
    backend = ScriptedBackend([[31339], [31339], [0]], clock=clock)
    G.wait_for_memory(backend, [0], 1024, poll_interval_ms=50, timeout_s=5, clock=clock.now, sleep=clock.sleep)
    assert clock.sleeps == [0.02, 0.02]


def test_wait_requires_no_compute_process_when_asked():
    clock = Clock()
    backend = ScriptedBackend([[0]], procs_per_call=[[{"gpu_index": 0, "pid": 5}], []])
    out = G.wait_for_memory(backend, [0], 1024, require_no_processes=True, poll_interval_ms=10, timeout_s=5,
                            clock=clock.now, sleep=clock.sleep)
    assert out["ready"] and out["polls"] == 2 and out["processes"] == []


def test_wait_reads_processes_only_once_memory_is_low():
    clock = Clock()
    backend = ScriptedBackend([[31339], [0]], procs_per_call=[[]])
    calls = []
    backend.compute_processes = lambda indices=None: calls.append(1) or []
    G.wait_for_memory(backend, [0], 1024, require_no_processes=True, poll_interval_ms=10, timeout_s=5,
                      clock=clock.now, sleep=clock.sleep)
    assert len(calls) == 1


def test_wait_with_zero_timeout_polls_once():
    clock = Clock()
    out = G.wait_for_memory(ScriptedBackend([[5000]]), [0], 1024, timeout_s=0, clock=clock.now, sleep=clock.sleep)
    assert out["polls"] == 1 and not out["ready"] and clock.sleeps == []


def test_smi_minor_numbers_come_from_the_driver_proc_files(tmp_path):
    for bus, minor in (("0000:00:06.0", 3), ("0000:00:07.0", 1)):
        d = tmp_path / bus
        d.mkdir()
        (d / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nDevice Minor: \t %d\n" % minor)
    backend = G.SmiBackend(RecordedSmi(state="loaded"), "nvidia-smi", driver_root=str(tmp_path))
    assert [g["minor_number"] for g in backend.inventory()] == [3, 1]


def test_fd_scan_maps_device_nodes_by_minor_number_not_index(monkeypatch):
    class Inv:
        name = "nvidia-smi"

        def inventory(self):
            return [{"index": 0, "minor_number": 3}, {"index": 1, "minor_number": 1}]

        def compute_processes(self, indices=None):
            return []

    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {50: ["/dev/nvidia3"], 51: ["/dev/nvidia0"]})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: None for p in pids})
    per_gpu, holders = G.gpu_processes(Inv(), [0, 1])
    assert [p["pid"] for p in per_gpu[0]] == [50] and per_gpu[1] == []
    assert {h["pid"]: h["gpu_indices"] for h in holders} == {50: [0], 51: []}  # no GPU has minor 0


# ------------------------------------------------------------------------------------------------ health fields

def health_row():
    from fake_pynvml import parse_health_query_gpu
    return parse_health_query_gpu()


def test_smi_health_fields_read_as_the_h200_prints_them():
    backend, runner = smi_backend(state="idle")
    rec = health_row()
    gpu = backend.details()[0]
    assert gpu["serial"] == rec["serial"] and gpu["vbios_version"] == "96.00.A5.00.1A"
    assert gpu["temperature_memory_c"] == 34 and gpu["pstate"] == "P0"
    assert gpu["clocks_max_sm_mhz"] == 1980
    assert (gpu["pcie_link_gen_current"], gpu["pcie_link_gen_max"], gpu["pcie_link_width_current"],
            gpu["pcie_link_width_max"]) == (5, 5, 16, 16)
    assert gpu["mig_mode_current"] == "Disabled" and gpu["mig_mode_pending"] == "Disabled"
    assert gpu["ecc_mode_current"] == "Enabled" and gpu["ecc_errors_uncorrected_aggregate_total"] == 0
    # H200 retired pages: [N/A] -> null with the raw text, never a failure
    assert gpu["retired_pages_pending"] is None and gpu["unsupported"]["retired_pages_pending"] == "[N/A]"
    assert gpu["retired_pages_single_bit_ecc_count"] is None
    assert set(gpu) == set(G.GPU_FIELDS)


def test_clock_event_reasons_mask_to_names():
    assert G.clock_event_reason_names(0x1) == ["gpu_idle"]
    assert G.clock_event_reason_names(0x0) == []
    assert G.clock_event_reason_names(0x28) == ["hw_slowdown", "sw_thermal_slowdown"]
    assert G.clock_event_reason_names(None) is None


def test_smi_clock_reasons_hex_mask_is_parsed():
    backend, runner = smi_backend(state="idle")
    runner.overrides = {"clocks_event_reasons.active": "0x0000000000000048"}
    gpu = backend.details()[0]
    assert gpu["clocks_event_reasons_mask"] == 0x48
    assert gpu["clocks_event_reasons"] == ["hw_slowdown", "hw_thermal_slowdown"]


def test_nvml_health_fields_from_the_recorded_calls():
    backend, fake = nvml_backend("loaded")
    gpu = backend.details()[0]
    assert gpu["serial"] == "1650000000001" and gpu["vbios_version"] == "96.00.A5.00.1A"
    assert gpu["temperature_memory_c"] == 34 and gpu["pstate"] == "P0" and gpu["clocks_sm_mhz"] == 1980
    assert gpu["clocks_event_reasons"] == [] and gpu["mig_mode_current"] == "Disabled"
    assert gpu["retired_pages_pending"] is None
    assert gpu["unsupported"]["retired_pages_single_bit_ecc_count"].startswith(
        "Not Supported (nvmlDeviceGetRetiredPages")


def test_both_backends_agree_on_every_field_of_the_recorded_loaded_h200():
    nvml, _ = nvml_backend("loaded")
    smi, _ = smi_backend(state="loaded")
    for a, b in zip(nvml.details(), smi.details()):
        for key in G.GPU_FIELDS:
            if key == "unsupported":
                assert set(a[key]) == set(b[key]), (a[key], b[key])
            elif key not in ("temperature_gpu_c", "minor_number"):
                # temperature: the fake NVML and the csv were read at different moments; minor_number: no
                # /proc/driver/nvidia here (test_smi_minor_numbers_come_from_the_driver_proc_files)
                assert a[key] == b[key], key


def test_nvml_unsupported_health_fields_are_null_with_the_error():
    backend, fake = nvml_backend("loaded", unsupported={"serial", "pcie", "mig", "field_values"})
    gpu = backend.details()[0]
    assert gpu["serial"] is None and gpu["pcie_link_gen_max"] is None and gpu["mig_mode_pending"] is None
    assert gpu["temperature_memory_c"] is None
    assert gpu["unsupported"]["mig_mode_pending"].startswith("Not Supported")
    assert gpu["memory_used_mib"] == 31339


# ------------------------------------------------------------------------------------------------ NVLink

LAB_NVLINK_S = ("GPU 0: NVIDIA H200 (UUID: GPU-8b76e503-d849-6334-acea-f57e29736cb3)\n"
                "\t Link 0: 26.562 GB/s\n\t Link 1: <inactive>\n"
                "GPU 1: NVIDIA H200 (UUID: GPU-fc5ce087-20ff-f609-f8fc-c4b5cbf772f5)\n\t Link 0: 26.562 GB/s\n"
                "\t Link 1: 26.562 GB/s\n")
LAB_NVLINK_E = "".join("GPU %d: NVIDIA H200 (UUID: %s)\n" % (i, u) + "".join(
    "\t Link %d: Replay Errors: 0\n\t Link %d: Recovery Errors: %d\n\t Link %d: CRC Errors: 0\n"
    % (link, link, 2 if (i, link) == (0, 1) else 0, link) for link in (0, 1))
    for i, u in ((0, "GPU-8b76e503-d849-6334-acea-f57e29736cb3"), (1, "GPU-fc5ce087-20ff-f609-f8fc-c4b5cbf772f5")))


def test_no_nvlink_peers_reads_as_no_links_on_both_backends():
    nvml, _ = nvml_backend("loaded")
    smi, runner = smi_backend(state="loaded")
    assert nvml.nvlinks() == smi.nvlinks() == {0: [], 1: []}
    assert [c[1:] for c in runner.calls[-2:]] == [["nvlink", "-s"], ["nvlink", "-e"]]


def test_nvlink_state_and_counters_agree_between_backends():
    nvml, fake = nvml_backend("loaded")
    fake.fake.gpus[0]["nvlinks"] = [(1, [0, 0, 0, 0]), (0, [0, 2, 0, 0])]
    fake.fake.gpus[1]["nvlinks"] = [(1, [0, 0, 0, 0]), (1, [0, 0, 0, 0])]
    smi, runner = smi_backend(state="loaded")
    runner.nvlink = {"-s": LAB_NVLINK_S, "-e": LAB_NVLINK_E}
    a, b = nvml.nvlinks(), smi.nvlinks()
    assert a[0][1] == {"link": 1, "state": "inactive", "replay_errors": 0, "recovery_errors": 2,
                       "crc_flit_errors": 0, "crc_data_errors": 0}
    assert b[0][1]["state"] == "inactive" and b[0][1]["recovery_errors"] == 2 and b[0][1]["crc_data_errors"] is None
    for key in ("link", "state", "replay_errors", "recovery_errors", "crc_flit_errors"):
        assert [[l[key] for l in a[i]] for i in (0, 1)] == [[l[key] for l in b[i]] for i in (0, 1)], key


# ------------------------------------------------------------------------------------------------ failures by class

def test_smi_rc255_among_good_rows_is_a_device_handle_error_with_its_line_first():
    out = "0, GPU-1, 0, 143771, 616\nUnable to determine the device handle for GPU 0000:1B:00.0: Unknown Error\n"
    backend = G.SmiBackend(lambda argv, timeout_s=None: (255, out, ""), "nvidia-smi")
    with pytest.raises(G.DeviceHandleError) as err:
        backend.inventory()
    assert err.value.msg.startswith("Unable to determine the device handle for GPU 0000:1B:00.0: Unknown Error")
    assert err.value.fail_kwargs()["error_class"] == "device_handle_error" and err.value.rc == 255


def test_smi_version_mismatch_is_its_own_class():
    with pytest.raises(G.DriverMismatchError) as err:
        smi_backend(fail=(18, "Failed to initialize NVML: Driver/library version mismatch\n"
                              "NVML library version: 580.159\n"))
    assert err.value.error_class == "driver_mismatch" and "reboot" in err.value.msg.lower()


def test_nvml_init_mismatch_is_driver_mismatch():
    fake = make_fake_nvml()
    fake.fake.init_error = "LIB_RM_VERSION_MISMATCH"
    with pytest.raises(G.DriverMismatchError):
        G.open_backend("nvml", nvml=fake)


def test_nvml_zero_gpus_is_no_devices():
    backend, fake = nvml_backend("idle", count_override=0)
    with pytest.raises(G.NoDevicesError):
        backend.inventory()


def test_nvml_handle_error_is_device_handle_error_and_lost_is_gpu_lost():
    backend, fake = nvml_backend("idle", handle_error=(1, "UNKNOWN"))
    with pytest.raises(G.DeviceHandleError) as err:
        backend.inventory()
    assert err.value.msg.startswith("NVML: nvmlDeviceGetHandleByIndex(1): NVML Error with code 999")
    backend, fake = nvml_backend("idle", handle_error=(0, "GPU_IS_LOST"))
    with pytest.raises(G.GpuLostError):
        backend.inventory()


def test_fewer_gpus_than_expected_fails_listing_those_present():
    backend, _ = nvml_backend("idle")
    G.require_gpu_count(backend.inventory(), 2)
    with pytest.raises(G.FewerGpusError) as err:
        G.require_gpu_count(backend.inventory(), 8, "NVML")
    assert err.value.msg.startswith("NVML lists 2 GPUs, expected 8") and "00000000:00:07.0" in err.value.msg
    with pytest.raises(G.NoDevicesError):
        G.require_gpu_count([], None)


@pytest.mark.parametrize("raw", ["[N/A]", "[Unknown Error]", "[Not Supported]"])
def test_smi_memory_unreadable_fails_the_wait_naming_gpu_field_and_raw(raw):
    backend, runner = smi_backend(state="idle")
    runner.overrides = {"memory.used": raw}
    with pytest.raises(G.FieldUnavailableError) as err:
        backend.memory()
    assert err.value.gpu == 0 and err.value.field == "memory.used" and err.value.raw == raw
    assert err.value.msg.startswith("GPU 0 (GPU-8b76e503") and raw in err.value.msg
    gpu = backend.details()[0]  # the info call reports it instead
    assert gpu["memory_used_mib"] is None and gpu["unsupported"]["memory_used_mib"] == raw


def test_nvml_memory_unreadable_fails_the_wait_but_not_the_details():
    backend, fake = nvml_backend("loaded", unsupported={"memory"})
    with pytest.raises(G.FieldUnavailableError) as err:
        backend.memory()
    assert err.value.error_class == "field_unavailable" and "GPU 0 (00000000:00:06.0)" in err.value.msg
    assert backend.details()[0]["memory_used_mib"] is None


def test_smi_hung_call_is_a_timeout_naming_command_seconds_and_where_to_look():
    def hung(argv, timeout_s):
        raise G.CallTimedOut(argv, timeout_s)

    with pytest.raises(G.GpuTimeoutError) as err:
        G.open_backend("nvidia-smi", runner=hung, smi_path="nvidia-smi", deadline=G.Deadline(5))
    msg = err.value.msg
    assert msg.startswith("`nvidia-smi --query-gpu=index,uuid,pci.bus_id,name --format=csv,noheader,nounits` "
                          "did not answer within 5.0 s")
    assert "dmesg" in msg and "awk '$2 ~ /D/'" in msg and err.value.error_class == "timeout"


def test_each_smi_call_gets_the_time_left_of_the_budget():
    now = [0.0]
    deadline = G.Deadline(20, clock=lambda: now[0])
    runner = RecordedSmi(state="idle")
    backend = G.SmiBackend(runner, "nvidia-smi", deadline=deadline)
    backend.inventory()
    now[0] = 19.0
    backend.memory()
    assert runner.timeouts == [20.0, G.MIN_CALL_TIMEOUT_S]


def test_nvml_init_that_blocks_is_abandoned_as_a_timeout(monkeypatch):
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_errors as E
    monkeypatch.setattr(E, "MIN_CALL_TIMEOUT_S", 0.2)
    fake = make_fake_nvml()
    fake.fake.init_delay_s = 2.0
    with pytest.raises(G.GpuTimeoutError) as err:
        G.open_backend("auto", runner=RecordedSmi(), nvml=fake, deadline=G.Deadline(0.1))
    assert err.value.msg.startswith("nvmlInit (NVML initialisation) did not return within 0.2 s")


# ------------------------------------------------------------------------------------------------ holders, slices

def test_device_holders_are_classified_and_ordered_gpu_shared_monitor(monkeypatch):
    backend, _ = nvml_backend("idle")
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {
        5: ["/dev/nvidiactl", "/dev/nvidia0"], 6: ["/dev/nvidiactl", "/dev/nvidia-uvm"], 7: ["/dev/nvidia1"]})
    names = {5: "nvidia-persiste", 6: "python3", 7: "python3"}
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: {"name": names[p], "cmdline": ["x"]} for p in pids})
    per_gpu, holders = G.gpu_processes(backend, [0, 1])
    assert [(h["pid"], h["kind"]) for h in holders] == [(7, "gpu"), (6, "shared_only"), (5, "monitor")]
    assert per_gpu[0][0]["kind"] == "monitor" and per_gpu[1][0]["kind"] == "gpu"


def test_wait_slice_ends_early_with_progress_and_time_left():
    clock = Clock()
    backend = ScriptedBackend([[31339, 0]])
    out = G.wait_for_memory(backend, [0, 1], 1024, poll_interval_ms=100, timeout_s=120, clock=clock.now,
                            sleep=clock.sleep, slice_s=1, elapsed_before_s=19.0)
    assert not out["ready"] and out["slice_ended"] and out["elapsed_ms"] == 20000
    assert out["progress"] == "GPU memory: 1 of 2 GPUs above 1024 MiB (max 31339 MiB on GPU 0), 20 s of 120 s"


def test_wait_last_slice_is_a_real_timeout():
    clock = Clock()
    out = G.wait_for_memory(ScriptedBackend([[31339]]), [0], 1024, poll_interval_ms=100, timeout_s=120,
                            clock=clock.now, sleep=clock.sleep, slice_s=10, elapsed_before_s=115.0)
    assert not out["ready"] and not out["slice_ended"] and out["elapsed_ms"] == 120000


def test_progress_counts_gpus_with_processes_apart():
    mem = [{"index": 0, "memory_used_mib": 0}, {"index": 1, "memory_used_mib": 5000}]
    text = G.progress_text(mem, [0, 1], 1024, 3.2, 60, processes=[{"gpu_index": 0, "pid": 5}])
    assert text == ("GPU memory: 1 of 2 GPUs above 1024 MiB (max 5000 MiB on GPU 1); 1 GPU under the limit still "
                    "running a compute process (GPU 0), 3 s of 60 s")
    assert G.progress_text(mem[:1], [], 1024, 0.15, 60).startswith("GPU memory: all 1 GPUs at or below 1024 MiB")
