"""plugins/module_utils/gpufleet_gpu_memory.py and its filters (plugins/filter/gpufleet_gpu.py): what the GPU memory
wait after the stop must be able to read, the memory others hold that it waits beside, SGLang's start rule beside
that memory, and the rollback's note when memory cannot be read (issue 30)."""
import importlib.util
import pathlib

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_info as GI
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_memory as M
from fake_pynvml import RecordedSmi, make_fake_nvml

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpufleet_gpu_filters", ROOT / "plugins" / "filter" / "gpufleet_gpu.py")
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)
_nvi = importlib.util.spec_from_file_location("nvidia_gpu_info_mod", ROOT / "library" / "nvidia_gpu_info.py")
NVI = importlib.util.module_from_spec(_nvi)
_nvi.loader.exec_module(NVI)

UUID0 = "GPU-8b76e503-d849-6334-acea-f57e29736cb3"


def gpu(index, **kw):
    entry = {"index": index, "uuid": "GPU-%d" % index, "memory_used_mib": 120009, "memory_total_mib": 143771,
             "unsupported": {}}
    entry.update(kw)
    return entry


# ------------------------------------------------------------------------------ fields the wait cannot read

@pytest.mark.parametrize("key,field,raw", [
    ("memory_used_mib", "memory.used", "[N/A]"),
    ("memory_total_mib", "memory.total", "[Unknown Error]"),
    ("memory_used_mib", "memory.used", "Unknown Error (nvmlDeviceGetMemoryInfo(v2))"),
])
def test_an_unreadable_memory_field_is_named_with_gpu_field_and_value(key, field, raw):
    info = {"gpus": [gpu(0), gpu(5, **{key: None, "unsupported": {key: raw}})]}
    (entry,) = M.unreadable_wait_fields(info)
    assert entry == {"index": 5, "uuid": "GPU-5", "field": field, "raw": raw}
    text = M.unreadable_refusal([entry])
    assert "GPU 5 (GPU-5): %s unreadable (reads %r)" % (field, raw) in text
    assert "old server keeps serving" in text and "nvidia-smi -q -i" in text


@pytest.mark.parametrize("key,field", [("compute_apps.pid", "compute-apps pid"),
                                       ("compute_apps.used_memory", "compute-apps used_memory"),
                                       ("compute_apps", "the compute-apps list")])
def test_an_unreadable_compute_apps_field_is_named(key, field):
    info = {"gpus": [gpu(2, unsupported={key: "[N/A]", "retired_pages_pending": "[N/A]"})]}
    assert M.unreadable_wait_fields(info) == [{"index": 2, "uuid": "GPU-2", "field": field, "raw": "[N/A]"}]


def test_fields_the_wait_does_not_read_and_fields_not_asked_for_are_no_reason():
    info = {"gpus": [{"index": 0, "uuid": "GPU-0", "power_draw_w": None,
                      "unsupported": {"power_draw_w": "[N/A]", "retired_pages_pending": "[N/A]"}}]}
    assert M.unreadable_wait_fields(info) == [] and M.unreadable_refusal([]) == ""
    assert M.unreadable_wait_fields(None) == [] and M.unreadable_wait_fields({"msg": "failed"}) == []


def test_smi_compute_apps_na_values_are_reported_per_gpu_and_a_row_without_pid_is_dropped():
    runner = RecordedSmi(state="loaded", apps_extra=[
        "[N/A], [N/A], %s, 00000000:00:06.0, python3" % UUID0])
    backend, _ = G.open_backend("nvidia-smi", runner=runner, smi_path="/usr/bin/nvidia-smi")
    rows = backend.compute_processes()
    assert all(r["pid"] is not None for r in rows)
    assert backend.apps_unreadable == {0: {"compute_apps.pid": "[N/A]", "compute_apps.used_memory": "[N/A]"}}


def test_nvml_compute_list_refused_and_used_memory_unknown_are_reported():
    fake = make_fake_nvml("loaded")
    fake.fake.unsupported = {"procs"}
    backend, _ = G.open_backend("nvml", nvml=fake)
    assert backend.compute_processes() == []
    assert backend.apps_unreadable[0]["compute_apps"].startswith("Not Supported")
    fake = make_fake_nvml("loaded")
    fake.fake.gpus[0]["procs"] = [(4242, None)]
    backend, _ = G.open_backend("nvml", nvml=fake)
    assert backend.compute_processes()[0]["used_memory_mib"] is None
    assert "usedGpuMemory not available" in backend.apps_unreadable[0]["compute_apps.used_memory"]


def test_nvidia_gpu_info_carries_the_unreadable_compute_apps_fields_in_unsupported(monkeypatch):
    runner = RecordedSmi(state="loaded", apps_extra=["4242, [N/A], %s, 00000000:00:06.0, python3" % UUID0])
    backend, _ = G.open_backend("nvidia-smi", runner=runner, smi_path="/usr/bin/nvidia-smi", smi_prefetch_details=True)
    # gather lives in module_utils (nvidia_gpu_info re-exports it): its gpu_processes is the one to replace.
    monkeypatch.setattr(GI, "gpu_processes", lambda b, idx, exclude_pids=None: (
        b.compute_processes(idx) and {}, []))
    result = NVI.gather(backend, [], processes=True, nvlink=False)
    assert result["gpus"][0]["unsupported"]["compute_apps.used_memory"] == "[N/A]"
    assert [e["field"] for e in M.unreadable_wait_fields(result)] == ["compute-apps used_memory"]


# ------------------------------------------------------------------------------ memory others hold

def test_foreign_memory_is_what_no_listed_process_accounts_for():
    gpus = [{"index": 0, "remaining_mib": 9, "accounting": "complete", "held_by_stop_set": True},
            {"index": 3, "remaining_mib": 20018, "accounting": "complete", "held_by_stop_set": True},
            {"index": 4, "remaining_mib": 20018, "accounting": "complete", "held_by_stop_set": True,
             "foreign_listed": True},
            {"index": 5, "remaining_mib": 120009, "accounting": "incomplete", "held_by_stop_set": True},
            {"index": 6, "remaining_mib": 5000, "accounting": "incomplete", "held_by_stop_set": False},
            {"index": 7, "remaining_mib": None}]
    assert M.foreign_memory(gpus, 1024) == {"3": 20018, "6": 5000}


def test_wait_limit_adds_the_baseline_under_either_key_type():
    assert M.wait_limit(3, 1024, {"3": 20018}) == 21042
    assert M.wait_limit(3, 1024, {3: 100}) == 1124
    assert M.wait_limit(2, 1024, {"3": 20018}) == 1024 and M.wait_limit(0, 1024, None) == 1024
    assert M.baseline_text({"5": 10, "3": 20018}) == "GPU 3: 20018 MiB, GPU 5: 10 MiB"


def after_gpus(baseline, held=range(8)):
    return [{"index": i, "memory_total_mib": 143771, "memory_reserved_mib": 616, "held_by_stop_set": i in held}
            for i in range(8)]


def test_sglang_would_not_start_beside_20000_mib_on_one_gpu_of_tp8():
    text = M.tp_balance_problem(after_gpus({"3": 20018}), {"3": 20018}, 8)
    assert "GPU 3 123137 MiB free against 143155 MiB on GPU 0" in text
    assert "The memory capacity is unbalanced" in text and "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false" in text


@pytest.mark.parametrize("baseline,world,env,held", [
    ({"3": 5009}, 8, None, range(8)),                                   # within 10 % of a GPU
    ({"3": 20018}, 1, None, range(8)),                                  # one GPU: SGLang checks no balance
    ({"3": 20018}, 8, {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false"}, range(8)),
    ({"3": 20018}, 8, {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0"}, range(8)),
    ({"7": 20018}, 4, None, range(4)),                                  # not a GPU of the server
    ({}, 8, None, range(8)),
])
def test_sglang_starts_beside_memory_its_check_allows(baseline, world, env, held):
    assert M.tp_balance_problem(after_gpus(baseline, held), baseline, world, env) == ""


def test_the_balance_check_stays_on_for_a_true_value():
    env = {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "1"}
    assert M.tp_balance_problem(after_gpus({"3": 20018}), {"3": 20018}, 8, env)


# ------------------------------------------------------------------------------ the wait beside it

class Backend:
    name = "nvidia-smi"

    def __init__(self, used, procs=()):
        self.used, self.procs = used, list(procs)

    def memory(self, indices=None):
        return [{"index": i, "uuid": "GPU-%d" % i, "memory_used_mib": u} for i, u in enumerate(self.used)]

    def compute_processes(self, indices=None):
        return self.procs


def test_the_wait_counts_a_gpu_free_at_its_baseline_plus_the_limit():
    out = G.wait_for_memory(Backend([0, 0, 0, 20009]), [0, 1, 2, 3], 1024, True, timeout_s=0,
                            baseline_mib={"3": 20018})
    assert out["ready"] and "plus what others held while the old server ran: GPU 3: 20018 MiB" in out["progress"]
    out = G.wait_for_memory(Backend([0, 0, 0, 20009]), [0, 1, 2, 3], 1024, True, timeout_s=0)
    assert not out["ready"] and out["busy"] == [3]
    # more than the baseline: the server's own memory (or new foreign memory) is still there
    out = G.wait_for_memory(Backend([0, 0, 0, 140018]), [0, 1, 2, 3], 1024, True, timeout_s=0,
                            baseline_mib={"3": 20018})
    assert out["busy"] == [3]


def test_the_timeout_message_names_the_baseline_of_a_gpu():
    from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_wait import timeout_message
    gpus = [{"index": 3, "uuid": "GPU-3", "memory_used_mib": 40027, "free": False, "processes": []}]
    msg = timeout_message({"polls": 4, "backend": "nvidia-smi"}, gpus, 1024, 120, True, [], {"3": 20018})
    assert "GPU 3 (GPU-3): 40027 MiB used (20018 MiB of it held by others while the old server ran)" in msg
    assert "beyond what others held while the old server ran (GPU 3: 20018 MiB)" in msg


# ------------------------------------------------------------------------------ filters

def test_filters_call_the_decisions():
    entry = {"index": 3, "uuid": "GPU-3", "field": "memory.used", "raw": "[N/A]"}
    assert F.gpufleet_gpu_unreadable_refusal([entry]).startswith("GPU memory unreadable: GPU 3 (GPU-3)")
    assert F.gpufleet_gpu_unreadable_refusal(None) == ""
    assert F.gpufleet_gpu_baseline_text({"3": 20018}) == "GPU 3: 20018 MiB"
    assert F.gpufleet_gpu_baseline_text("x") == ""


def test_rollback_note_when_memory_could_not_be_read():
    smi = {"failed": True, "error_class": "field_unavailable",
           "msg": "GPU 3 (GPU-3): memory.used unreadable (nvidia-smi reads '[N/A]'), so whether its memory is free "
                  "cannot be told. What to do: look for Xid errors"}
    note = F.gpufleet_rollback_unreadable(smi)
    assert note.startswith("GPU memory could not be read (GPU 3 (GPU-3): memory.used unreadable (nvidia-smi reads "
                           "'[N/A]'), so whether its memory is free cannot be told)")
    assert "relaunched without a memory check" in note and "held" not in note
    nvml = {"error_class": "field_unavailable",
            "msg": "NVML: nvmlDeviceGetMemoryInfo(v2): Unknown Error\nGPU 2 (00000000:2A:00.0): memory.used / "
                   "memory.total unreadable, so whether its memory is free cannot be told. What to do: reset"}
    assert "Unknown Error GPU 2 (00000000:2A:00.0): memory.used / memory.total unreadable" in \
        F.gpufleet_rollback_unreadable(nvml)


@pytest.mark.parametrize("result", [{}, {"skipped": True}, {"ready": True}, None,
                                    {"failed": True, "error_class": "not_released", "msg": "held"}])
def test_no_rollback_note_for_a_wait_that_read_memory(result):
    assert F.gpufleet_rollback_unreadable(result) == ""


# ------------------------------------------------------------------------------ rollback beside memory taken later

def server_gpus(n=8, held=120000, world=8, env=None, complete=True):
    """sglang_preflight_server_gpus of a TP8 server holding ``held`` MiB per GPU while it ran."""
    return {"gpus": [{"index": i, "stop_set_mib": held, "memory_used_mib": held + 9, "held_by_stop_set": True,
                      "accounting": "complete" if complete else "incomplete", "memory_total_mib": 143771,
                      "memory_reserved_mib": 616} for i in range(n)],
            "world_size": world, "env": env or {}}


def wait_gpus(taken, n=8):
    """The rollback wait's gpus once the servers are gone, ``taken`` {index: MiB} held by others."""
    return [{"index": i, "memory_used_mib": taken.get(i, 0), "memory_total_mib": 143771, "memory_reserved_mib": 616,
             "free": i not in taken} for i in range(n)]


def not_released(taken):
    return {"failed": True, "error_class": "not_released", "msg": "held", "gpus": wait_gpus(taken)}


def test_the_previous_server_is_relaunched_beside_memory_it_still_fits_beside():
    fit = F.gpufleet_rollback_fit(not_released({3: 5009}), server_gpus())
    assert fit["fits"] is True
    assert "free (least: 138146 MiB free for at most 120000 MiB), so it was relaunched beside it" in fit["text"]


def test_no_relaunch_when_a_gpu_lacks_what_the_previous_server_held_there():
    fit = M.rollback_fit(wait_gpus({3: 30000, 5: 22500}), server_gpus())
    assert fit["fits"] is False
    # 143771 - 616 - 30000 = 113155 < 120000 + 1024; GPU 5: 120655 < 121024 (the margin counts)
    assert fit["text"] == ("the previous server would not fit beside it (GPU 3: 113155 MiB free, the previous server "
                           "held 120000 MiB; GPU 5: 120655 MiB free, the previous server held 120000 MiB)")


def test_no_relaunch_when_sglang_would_refuse_the_unbalanced_world_unless_its_check_is_off():
    small = server_gpus(held=60000)
    fit = M.rollback_fit(wait_gpus({3: 20000}), small)
    assert fit["fits"] is False and "GPU 3 has 123155 MiB free against 143155 MiB on GPU 0" in fit["text"]
    assert M.rollback_fit(wait_gpus({3: 20000}), server_gpus(held=60000, world=1))["fits"] is True
    assert M.rollback_fit(wait_gpus({3: 20000}), server_gpus(
        held=60000, env={"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false"}))["fits"] is True


def test_the_footprint_of_a_server_whose_memory_no_list_names_in_full_is_all_it_used():
    assert M.server_footprint(server_gpus(complete=False)["gpus"][0]) == 120009
    assert M.server_footprint({"index": 0, "held_by_stop_set": False, "memory_used_mib": 5}) is None


@pytest.mark.parametrize("result,server", [
    ({"failed": True, "error_class": "field_unavailable", "gpus": wait_gpus({})}, server_gpus()),
    ({"ready": True, "gpus": wait_gpus({})}, server_gpus()),
    ({"skipped": True}, server_gpus()),
    (None, server_gpus()),
    (not_released({3: 5009}), {}),                      # preflight measured nothing (a --tags run)
    (not_released({3: 5009}), {"gpus": [], "world_size": 8}),
    ({"failed": True, "error_class": "not_released", "gpus": wait_gpus({3: 5009}, n=2)}, server_gpus()),  # GPU unread
])
def test_nothing_known_keeps_the_rollback_refusing_as_before(result, server):
    assert F.gpufleet_rollback_fit(result, server) == {"fits": False, "text": ""}
