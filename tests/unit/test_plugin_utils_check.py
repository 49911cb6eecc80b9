"""Unit tests of plugins/plugin_utils/check.py (the gpufleet_check filters' core): one test per verdict rule, the
reads check.yml asks for, the fleet view, JSON schema and the table (the
Prometheus textfile: test_plugin_utils_metrics.py)."""
import copy
import importlib.util
import json
import pathlib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import check as chk

_spec = importlib.util.spec_from_file_location("gpufleet_check_filters", ROOT / "plugins" / "filter" / "gpufleet_check.py")
filters = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(filters)
SCHEMA = json.loads((ROOT / "docs" / "schemas" / "check.schema.json").read_text())


def _gpu(i, **over):
    g = {"index": i, "uuid": "GPU-%08d" % i, "name": "NVIDIA H200", "memory_used_mib": 120009,
         "memory_total_mib": 143771, "temperature_gpu_c": 40, "temperature_memory_c": 45, "power_draw_w": 250.0,
         "utilization_gpu_pct": 0, "persistence_mode": "Enabled", "mig_mode_current": "Disabled",
         "mig_mode_pending": "Disabled", "ecc_errors_uncorrected_volatile_total": 0,
         "ecc_errors_uncorrected_aggregate_total": 0, "remapped_rows_pending": False,
         "remapped_rows_failure": False, "retired_pages_pending": None, "clocks_event_reasons": [],
         "pcie_link_gen_current": 5, "pcie_link_gen_max": 5, "pcie_link_width_current": 16,
         "pcie_link_width_max": 16,
         "nvlinks": [{"link": n, "state": "active", "replay_errors": 0, "recovery_errors": 0, "crc_flit_errors": 0,
                      "crc_data_errors": 0} for n in range(18)],
         "processes": [{"pid": 200 + i, "used_memory_mib": 120000, "name": "sglang::scheduler_TP%d" % i,
                        "kind": "gpu", "source": ["nvidia-smi", "proc_fd"]},
                       {"pid": 9, "used_memory_mib": None, "name": "nvidia-persistenced", "kind": "monitor",
                        "source": ["proc_fd"]}]}
    g.update(over)
    return g


def _patched(relative, changed=False, block="same", block_env=None, mtime=1000.0):
    """One entry of sglang_nccl_patch's RV files (check mode)."""
    return {"path": "/x/sglang/" + relative, "relative": relative, "changed": changed, "block": block,
            "block_env": {"NCCL_ALGO": "Ring"} if block_env is None and block == "same" else block_env, "mtime": mtime}


def healthy():
    return {
        "gpu": {"changed": False, "gpu_count": 8, "driver_version": "580.159.04", "gpus": [_gpu(i) for i in range(8)],
                "xid_status": "ok", "xid_events": []},
        "health": {"status": 200, "url": "http://127.0.0.1:30000/health_generate"},
        "server_info": {"status": 200, "json": {"version": "0.5.23", "tp_size": 8, "model_path": "/m"}},
        "host": {"managed_pid": 100, "managed_running": True},
        "args": {"sglang_version": "0.5.23", "dest_values": {"tp_size": 8, "model_path": "/m"}},
        "patch_present": {"changed": False, "path": "/x/sglang/srt/entrypoints/engine.py", "sglang_version": "0.5.23",
                          "env": {"NCCL_ALGO": "Ring"},
                          "files": [_patched("srt/entrypoints/engine.py")]},
        "workers": {"workers": [{"pid": 200 + i, "title": "sglang::scheduler_TP%d" % i, "match": True,
                                 "missing": [], "mismatched": {}} for i in range(8)], "all_match": True},
        "started": {"create_time": 1950.0, "now": 2000.0},
    }


def verdict(g, **config):
    return chk.gpufleet_check_verdict(g, config)


def codes(result):
    return {(r["severity"], r["code"], r["gpu"]) for r in result["reasons"]}


def test_healthy_host_is_ok_with_all_gpus():
    r = verdict(healthy(), expected_gpus=8)
    assert r["verdict"] == "OK" and r["reasons"] == []
    assert (r["gpus_ok"], r["gpus_total"]) == (8, 8)
    assert r["sglang"]["nccl_block"] == "present" and r["sglang"]["workers_nccl_ok"] == 8


@pytest.mark.parametrize("field,value,expected", [
    ("ecc_errors_uncorrected_volatile_total", 4, ("CRIT", "ecc_uncorrected", 1)),
    ("remapped_rows_pending", True, ("CRIT", "remap_pending", 1)),
    ("remapped_rows_failure", True, ("CRIT", "remap_failure", 1)),
    ("retired_pages_pending", True, ("CRIT", "retired_pages_pending", 1)),
    ("clocks_event_reasons", ["hw_slowdown"], ("WARN", "throttle", 1)),
    ("temperature_gpu_c", 86, ("WARN", "gpu_temperature", 1)),
    ("temperature_gpu_c", 91, ("CRIT", "gpu_temperature", 1)),
    ("temperature_memory_c", 96, ("CRIT", "memory_temperature", 1)),
    ("pcie_link_width_current", 8, ("WARN", "pcie_degraded", 1)),
    ("persistence_mode", "Disabled", ("WARN", "persistence_off", 1)),
    ("mig_mode_current", "Enabled", ("CRIT", "mig_mode", 1)),
    ("mig_mode_pending", "Enabled", ("WARN", "mig_pending", 1)),
])
def test_gpu_field_gives_reason_on_that_gpu(field, value, expected):
    g = healthy()
    g["gpu"]["gpus"][1][field] = value
    r = verdict(g)
    assert codes(r) == {expected}
    assert r["verdict"] == expected[0]
    assert r["gpus_ok"] == 7 and r["gpus_total"] == 8


def test_idle_gpu_link_trained_down_is_not_degraded_but_busy_one_is():
    g = healthy()
    g["gpu"]["gpus"][2].update(pcie_link_gen_current=1, clocks_event_reasons=["gpu_idle"])
    assert verdict(g)["verdict"] == "OK"
    g["gpu"]["gpus"][2]["clocks_event_reasons"] = []
    assert codes(verdict(g)) == {("WARN", "pcie_degraded", 2)}


def test_nvlink_down_is_crit_and_error_counts_warn_over_threshold():
    g = healthy()
    g["gpu"]["gpus"][1]["nvlinks"][3]["state"] = "inactive"
    assert codes(verdict(g)) == {("CRIT", "nvlink_down", 1)}
    g = healthy()
    g["gpu"]["gpus"][0]["nvlinks"][0]["replay_errors"] = 101
    assert codes(verdict(g)) == {("WARN", "nvlink_errors", 0)}
    assert verdict(g, nvlink_errors_warn=1000)["verdict"] == "OK"


def test_xid_severity_map_and_unknown_xid_and_unreadable_log():
    g = healthy()
    g["gpu"]["xid_events"] = [{"xid": 79, "gpu_index": 1, "text": "NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus."},
                              {"xid": 31, "gpu_index": 2, "text": "NVRM: Xid 31"},
                              {"xid": 4242, "gpu_index": 3, "text": "NVRM: Xid 4242"}]
    assert codes(verdict(g)) == {("CRIT", "xid_79", 1), ("WARN", "xid_31", 2), ("WARN", "xid_4242", 3)}
    # The map is configuration: an operator can raise 31 to CRIT and unknown Xids too.
    r = verdict(g, xid_severity={"31": "CRIT"}, xid_unknown_severity="CRIT")
    assert ("CRIT", "xid_31", 2) in codes(r) and ("CRIT", "xid_4242", 3) in codes(r)
    g = healthy()
    g["gpu"].update(xid_status="unknown", xid_events=None, xid_reason="/dev/kmsg: Permission denied")
    r = verdict(g)
    assert codes(r) == {("WARN", "xid_unknown", None)} and "Permission denied" in r["reasons"][0]["text"]


@pytest.mark.parametrize("error_class", ["no_devices", "driver_mismatch", "timeout", "gpu_lost"])
def test_driver_failure_is_crit_with_its_class(error_class):
    g = healthy()
    g["gpu"] = {"failed": True, "error_class": error_class, "msg": "No devices were found\nmore"}
    r = verdict(g, expected_gpus=8)
    assert codes(r) == {("CRIT", error_class, None)}
    assert (r["gpus_ok"], r["gpus_total"]) == (0, 8) and "No devices were found" in r["reasons"][0]["text"]


def test_fewer_gpus_than_expected_is_crit():
    g = healthy()
    g["gpu"]["gpus"] = g["gpu"]["gpus"][:7]
    g["gpu"]["gpu_count"] = 7
    r = verdict(g, expected_gpus=8)
    assert codes(r) == {("CRIT", "fewer_gpus", None)}
    assert r["gpus_total"] == 7
    assert verdict(g)["verdict"] == "OK"  # no expectation set: 7 is what the host has


def test_memory_held_with_no_server_and_foreign_process():
    g = healthy()
    g["host"] = {"managed_pid": None, "managed_running": False}
    g["health"] = {"status": -1, "msg": "Connection refused"}
    g["server_info"] = {"skipped": True}
    g["workers"] = {"skipped": True}
    g["started"] = {"skipped": True}
    r = verdict(g)
    got = codes(r)
    assert ("CRIT", "sglang_not_serving", None) in got
    assert {c for c in got if c[1] == "memory_held_no_server"} == {("WARN", "memory_held_no_server", i) for i in range(8)}
    g = healthy()
    g["gpu"]["gpus"][5]["processes"].append({"pid": 777, "used_memory_mib": 500, "name": "python", "kind": "gpu",
                                             "source": ["nvidia-smi"]})
    assert codes(verdict(g)) == {("WARN", "foreign_gpu_process", 5)}


def test_nccl_block_missing_differs_and_uncheckable():
    g = healthy()
    g["patch_present"]["changed"] = True
    g["patch_present"]["files"] = [_patched("srt/entrypoints/engine.py", changed=True, block="none")]
    r = verdict(g)
    assert codes(r) == {("CRIT", "nccl_block_missing", None)} and "playbooks/patch.yml" in r["reasons"][0]["text"]
    assert "/x/sglang/srt/entrypoints/engine.py" in r["reasons"][0]["text"]
    g["patch_present"]["files"] = [_patched("srt/entrypoints/engine.py", changed=True, block="other",
                                            block_env={"NCCL_ALGO": "Tree"})]
    r = verdict(g)
    assert codes(r) == {("CRIT", "nccl_block_values", None)}
    assert "NCCL_ALGO is 'Tree', wanted 'Ring'" in r["reasons"][0]["text"] and r["sglang"]["nccl_block"] == "differs"
    # A block removed after the server started: the fix named is "patch, then restart", no second reason.
    g["patch_present"]["files"] = [_patched("srt/entrypoints/engine.py", changed=True, block="none", mtime=1990.0)]
    assert codes(verdict(g)) == {("CRIT", "nccl_block_missing", None)}
    g["patch_present"] = {"failed": True, "msg": "def _set_envs_and_config() not found", "files": []}
    assert codes(verdict(g)) == {("WARN", "nccl_check_failed", None)}


def test_every_patched_file_is_judged_and_named():
    # SGLang after 0.5.23: worker_launch.py's copy runs instead of engine.py's when SGLANG_PRESPAWN_WORKERS=1.
    g = healthy()
    g["patch_present"]["changed"] = True
    g["patch_present"]["files"].append(_patched("srt/entrypoints/worker_launch.py", changed=True, block="none"))
    r = verdict(g)
    assert codes(r) == {("CRIT", "nccl_block_missing", None)}
    assert "worker_launch.py" in r["reasons"][0]["text"] and "engine.py" not in r["reasons"][0]["text"]
    assert r["sglang"]["nccl_files"] == {"srt/entrypoints/engine.py": "present",
                                         "srt/entrypoints/worker_launch.py": "missing"}
    g = healthy()
    g["patch_present"]["files"].append(_patched("srt/entrypoints/worker_launch.py", mtime=1990.0))
    r = verdict(g)
    assert codes(r) == {("WARN", "restart_needed", None)}
    assert r["reasons"][0]["text"].startswith("/x/sglang/srt/entrypoints/worker_launch.py changed after the server started")


def test_worker_without_nccl_values_and_restart_needed():
    g = healthy()
    g["workers"]["workers"][3].update(match=False, missing=["NCCL_PROTO"])
    r = verdict(g)
    assert codes(r) == {("CRIT", "nccl_worker_env", None)} and "NCCL_PROTO" in r["reasons"][0]["text"]
    g = healthy()
    g["patch_present"]["files"][0]["mtime"] = 1990.0  # changed 40 s after the server started
    assert codes(verdict(g)) == {("WARN", "restart_needed", None)}


def test_release_and_server_args_drift():
    g = healthy()
    g["server_info"]["json"].update(version="0.5.22", tp_size=4)
    got = codes(verdict(g))
    assert got == {("WARN", "sglang_release", None), ("WARN", "server_args_drift", None)}
    assert verdict(healthy(), sglang_version="0.5.24")["reasons"][0]["code"] == "sglang_release"


def test_skipped_parts_are_not_judged():
    g = {"gpu": {"skipped": True}, "health": {"skipped": True}, "host": {"managed_running": True, "managed_pid": 1}}
    r = verdict(g)
    assert r["verdict"] == "OK" and r["gpus_total"] == 0


def test_fleet_marks_hosts_without_result_crit_and_report_matches_schema():
    jsonschema = pytest.importorskip("jsonschema")
    ok = verdict(healthy())
    bad = healthy()
    bad["gpu"]["gpus"][1]["ecc_errors_uncorrected_volatile_total"] = 4
    hostvars = {"a": {"fleet_check_result": ok}, "b": {"fleet_check_result": verdict(bad)}, "c": {}}
    fleet = chk.gpufleet_check_fleet(hostvars, ["a", "b", "c", "d"])
    assert [fleet[h]["verdict"] for h in "abcd"] == ["OK", "CRIT", "CRIT", "CRIT"]
    assert fleet["d"]["reasons"][0]["code"] == "unreachable"
    doc = json.loads(json.dumps(chk.gpufleet_check_report(fleet)))
    jsonschema.validate(doc, SCHEMA)
    broken = copy.deepcopy(doc)
    broken["hosts"]["a"]["verdict"] = "FINE"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)
    stats = chk.gpufleet_check_stats(fleet)
    assert set(stats["b"]) == {"verdict", "reasons", "gpus_ok", "gpus_total"}


def test_unreachable_verdict():
    r = chk.gpufleet_check_unreachable("Failed to connect to the host via ssh: timeout\nmore", 8)
    assert r["verdict"] == "CRIT" and r["reasons"][0]["code"] == "unreachable" and r["gpus_total"] == 8
    assert "timeout" in r["reasons"][0]["text"] and "more" not in r["reasons"][0]["text"]


@pytest.mark.parametrize("fail_on,expected", [("crit", ["c"]), ("warn", ["w", "c"]), ("never", [])])
def test_failing_hosts_by_fail_on(fail_on, expected):
    fleet = {"o": {"verdict": "OK"}, "w": {"verdict": "WARN"}, "c": {"verdict": "CRIT"}}
    assert chk.gpufleet_check_failing(fleet, fail_on) == expected


def test_table_lists_each_host_with_short_reasons_and_counts():
    bad = healthy()
    bad["gpu"]["gpus"][1]["clocks_event_reasons"] = ["hw_slowdown"]
    fleet = {"gpu-01": verdict(healthy()), "gpu-02": verdict(bad)}
    lines = chk.gpufleet_check_table(fleet).splitlines()
    assert lines[0].split() == ["host", "verdict", "gpus", "reasons"]
    assert lines[1].split() == ["gpu-01", "OK", "8/8", "-"]
    assert lines[2].split()[:5] == ["gpu-02", "WARN", "7/8", "WARN", "throttle"]
    assert lines[-1] == "2 host(s): 1 OK, 1 WARN, 0 CRIT"


def test_a_running_server_that_does_not_answer_yet_is_not_told_to_restart_at_once():
    # restart.yml's rollback can leave the previous server relaunched and still loading (relaunched_loading) and
    # sends the operator here "to see when it serves"; the reason used to say only "restart with
    # playbooks/restart.yml", which would kill that load.
    g = healthy()
    g["health"] = {"status": -1, "url": "http://10.0.0.1:30000/health_generate", "msg": "Connection refused"}
    g["server_info"] = {"skipped": True}
    g["host"] = {"managed_pid": 404, "managed_running": True}
    g["started"] = {"create_time": 1796223685.525, "now": 1796223745.9}
    [reason] = [x for x in verdict(g)["reasons"] if x["code"] == "sglang_not_serving"]
    assert reason["severity"] == "CRIT"
    assert "the server (pid 404) runs since 2026-12-02 15:01:25 UTC (host clock, 60 s ago)" in reason["text"], \
        reason["text"]
    assert "may still be loading" in reason["text"] and "check.yml again" in reason["text"]
    # Up for three weeks and hanging: not a load; the host's own clock says how old it is.
    g["started"] = {"create_time": 1794409285.5, "now": 1796223745.9}
    [reason] = [x for x in verdict(g)["reasons"] if x["code"] == "sglang_not_serving"]
    assert "loading" not in reason["text"].replace("loading_window_s", "") and "read its log" in reason["text"]
    assert "has run since 2026-11-11" in reason["text"], reason["text"]
    # A longer window (fleet_check_loading_window_s) counts it as loading again.
    [reason] = [x for x in chk.gpufleet_check_verdict(g, {"loading_window_s": 30 * 86400})["reasons"]
                if x["code"] == "sglang_not_serving"]
    assert "may still be loading" in reason["text"]
    # No server process: nothing is loading, restarting is the advice.
    g["host"] = {"managed_pid": None, "managed_running": False}
    g["started"] = {"skipped": True}
    [reason] = [x for x in verdict(g)["reasons"] if x["code"] == "sglang_not_serving"]
    assert reason["text"].endswith(": restart with playbooks/restart.yml") and "loading" not in reason["text"]


def test_a_file_the_patch_refuses_does_not_hide_the_others():
    # worker_launch.py with its start-method call in a branch: the module fails, but engine.py's state is in files.
    g = healthy()
    g["patch_present"] = {"failed": True, "changed": False, "msg": "cannot patch /x/sglang/srt/entrypoints/worker_launch.py",
                          "env": {"NCCL_ALGO": "Ring"},
                          "files": [_patched("srt/entrypoints/engine.py", changed=True, block="none"),
                                    {"path": "/x/sglang/srt/entrypoints/worker_launch.py",
                                     "relative": "srt/entrypoints/worker_launch.py",
                                     "error": "cannot patch /x/sglang/srt/entrypoints/worker_launch.py: line 9 ..."}]}
    r = verdict(g)
    assert codes(r) == {("CRIT", "nccl_block_missing", None), ("WARN", "nccl_check_failed", None)}
    assert r["verdict"] == "CRIT" and r["sglang"]["nccl_block"] == "missing"
    assert r["sglang"]["nccl_files"] == {"srt/entrypoints/engine.py": "missing",
                                         "srt/entrypoints/worker_launch.py": "unknown"}
    [failed] = [x for x in r["reasons"] if x["code"] == "nccl_check_failed"]
    assert failed["text"].startswith("NCCL block not checkable in /x/sglang/srt/entrypoints/worker_launch.py")


def test_a_worker_with_another_value_is_said_to_hold_it_not_to_miss_it():
    g = healthy()
    g["workers"]["workers"][2].update(match=False, mismatched={"CUDA_DEVICE_MAX_CONNECTIONS": {"actual": "8", "expected": "1"}})
    r = verdict(g)
    assert "sglang::scheduler_TP2 (CUDA_DEVICE_MAX_CONNECTIONS=8, expected 1)" in r["reasons"][0]["text"]


@pytest.mark.parametrize("gpu_over,field,raw", [
    ({"memory_used_mib": None, "unsupported": {"memory_used_mib": "[N/A]"}}, "memory.used", "[N/A]"),
    ({"memory_total_mib": None, "unsupported": {"memory_total_mib": "[Unknown Error]"}}, "memory.total",
     "[Unknown Error]"),
    ({"unsupported": {"compute_apps.used_memory": "[N/A]"}}, "compute-apps used_memory", "[N/A]"),
    ({"unsupported": {"compute_apps": "Not Supported (nvmlDeviceGetComputeRunningProcesses)"}},
     "the compute-apps list", "Not Supported (nvmlDeviceGetComputeRunningProcesses)"),
])
def test_a_field_the_restart_wait_reads_that_reads_no_number_is_crit_on_that_gpu_naming_it(gpu_over, field, raw):
    g = healthy()
    g["gpu"]["gpus"][6].update(gpu_over)
    r = verdict(g)
    assert codes(r) == {("CRIT", "gpu_field_unreadable", 6)}
    [reason] = r["reasons"]
    assert "GPU 6 (GPU-00000006): %s unreadable (reads %r)" % (field, raw) in reason["text"]
    assert "a restart would be refused" in reason["text"]


def test_hand_typed_lines_in_the_function_are_named_with_what_a_restart_does():
    g = healthy()
    g["patch_present"]["hand_edits"] = [
        {"path": "/x/e.py", "line": 1950, "text": 'os.environ["NCCL_PROTO"] = "Simple"', "names": ["NCCL_PROTO"],
         "after_anchor": True, "action": "refused"},
        {"path": "/x/e.py", "line": 1900, "text": 'os.environ["NCCL_DEBUG"] = "INFO"', "names": ["NCCL_DEBUG"],
         "after_anchor": False, "action": "reported"},
        {"path": "/x/e.py", "line": 1901, "text": "taken before", "names": ["NCCL_ALGO"], "after_anchor": False,
         "action": "kept"},
    ]
    r = verdict(g)
    assert codes(r) == {("WARN", "nccl_hand_edit", None)} and len(r["reasons"]) == 2
    first, second = [x["text"] for x in r["reasons"]]
    assert first.startswith('/x/e.py:1950: os.environ["NCCL_PROTO"] = "Simple" is typed by hand')
    assert "overrides the NCCL block" in first and "sglang_nccl_patch_hand_edits=take_over" in first
    assert second.endswith("sglang_nccl_env does not set that variable, the line applies")


def test_a_host_where_root_would_run_code_another_user_can_change_is_crit_and_names_it():
    text = ("ansible_python_interpreter /v/bin/python runs as root, but /v/lib/python3.11/site-packages "
            "(owner sglang, mode 0755)")
    r = chk.gpufleet_check_root_code([text], 8)
    assert r["verdict"] == "CRIT" and r["gpus_ok"] == 0 and r["gpus_total"] == 8
    [reason] = r["reasons"]
    assert reason["code"] == "root_code_untrusted" and "owner sglang" in reason["text"]
    assert chk.gpufleet_check_root_code([])["reasons"][0]["text"].endswith("another user can change")
    assert chk.gpufleet_check_fleet({"h": {"fleet_check_result": r}}, ["h"])["h"]["verdict"] == "CRIT"


# ------------------------------------------------------------------------------ check.yml's one read

def test_check_reads_follow_the_tags_and_split_only_for_become():
    every = ["server", "gpu", "sglang", "nccl_files", "nccl_workers"]
    assert chk.check_reads(["all"], []) == {"login": every, "become": []}
    assert chk.check_reads(["tagged"], []) == {"login": every, "become": []}
    # --tags gpu: the server (the GPU verdict needs it) and the GPUs, nothing of SGLang or NCCL.
    assert chk.check_reads(["gpu"], []) == {"login": ["server", "gpu"], "become": []}
    assert chk.check_reads(["sglang", "nccl"], []) == {
        "login": ["server", "sglang", "nccl_files", "nccl_workers"], "become": []}
    assert chk.check_reads(["all"], ["nccl"]) == {"login": ["server", "gpu", "sglang"], "become": []}
    assert chk.check_reads(["all"], ["gpu", "sglang", "nccl"]) == {"login": [], "become": []}
    assert chk.check_reads(["untagged"], []) == {"login": [], "become": []}
    # With become, what needs root (kernel log, other users' processes and environs) goes to the second call;
    # what runs SGLang's python stays with the login user.
    assert chk.check_reads(["all"], [], become=True) == {
        "login": ["server", "sglang", "nccl_files"], "become": ["gpu", "nccl_workers"]}
    assert chk.check_reads(["gpu"], [], become=True) == {"login": ["server"], "become": ["gpu"]}
    assert filters.FilterModule().filters()["gpufleet_check_reads"](["gpu"], [], True) == {
        "login": ["server"], "become": ["gpu"]}


def test_the_one_read_gives_the_verdict_the_separate_reads_gave():
    g = healthy()
    g["gpu"]["gpus"][2]["remapped_rows_pending"] = True
    g["workers"]["workers"][1]["match"] = False
    g["workers"]["workers"][1]["missing"] = ["NCCL_ALGO"]
    separate = verdict(copy.deepcopy(g))
    one = dict(copy.deepcopy(g), changed=False, gathered=["server", "gpu", "sglang", "nccl_files", "nccl_workers"])
    assert chk.gpufleet_check_verdict(one) == separate
    # The login call and the become call (fleet_check_become): the parts merge, a skipped call counts for nothing.
    login = {k: v for k, v in one.items() if k not in ("gpu", "workers")}
    become = {"changed": False, "gathered": ["gpu", "nccl_workers"], "gpu": g["gpu"], "workers": g["workers"]}
    assert chk.gpufleet_check_verdict([login, become]) == separate
    assert chk.gpufleet_check_verdict([one, {"skipped": True, "changed": False}]) == separate
    assert {r["code"] for r in separate["reasons"]} == {"remap_pending", "nccl_worker_env"}


def test_a_read_that_returned_nothing_is_crit_not_ok():
    # A task timeout or a module error leaves no part: the host must not pass as OK for want of findings.
    timed_out = {"failed": True, "msg": "The task exceeded its timeout of 150 seconds.\nmore", "changed": False}
    r = chk.gpufleet_check_verdict([timed_out, {}])
    assert r["verdict"] == "CRIT"
    assert [(x["code"], x["text"]) for x in r["reasons"]] == [
        ("check_read_failed", "the host could not be read: The task exceeded its timeout of 150 seconds.")]
    # A read whose parts failed one by one is judged part by part (the module itself did not fail).
    part_failed = {"changed": False, "gathered": ["gpu"], "gpu": {"failed": True, "msg": "no GPU found",
                                                                  "error_class": "no_devices"}}
    assert [x["code"] for x in chk.gpufleet_check_verdict([part_failed])["reasons"]] == ["no_devices"]
    # The connection lost before the call with become: CRIT unreachable, as when the first call cannot reach it.
    lost = {"unreachable": True, "msg": "Failed to connect to the host via ssh: timed out", "changed": False}
    r = chk.gpufleet_check_verdict([dict(part_failed, gathered=["server"]), lost], {"expected_gpus": 8})
    assert r == chk.gpufleet_check_unreachable(lost["msg"], 8) and r["reasons"][0]["code"] == "unreachable"


def test_root_code_in_the_read_is_the_root_code_verdict():
    read = {"changed": False, "gathered": [], "root_code": [{"text": "ansible_python_interpreter /v/bin/python "
                                                                     "runs as root, but /v is writable by uid 1000"}]}
    r = chk.gpufleet_check_verdict([read, {"skipped": True}], {"expected_gpus": 8})
    assert r == chk.gpufleet_check_root_code([read["root_code"][0]["text"]], 8)
    assert r["verdict"] == "CRIT" and r["reasons"][0]["code"] == "root_code_untrusted"


def test_the_line_said_per_host():
    g = healthy()
    g["gpu"]["gpus"][1]["clocks_event_reasons"] = ["hw_slowdown"]
    assert chk.gpufleet_check_line(verdict(g)) == "WARN, GPUs 7/8: WARN throttle GPU 1: clocks slowed: hw_slowdown"
    assert chk.gpufleet_check_line(verdict(healthy())) == "OK, GPUs 8/8"
    root = chk.gpufleet_check_root_code(["ansible_python_interpreter /v/bin/python runs as root, but ..."], 8)
    assert chk.gpufleet_check_line(root) == ("CRIT: not checked with become: ansible_python_interpreter /v/bin/python "
                                             "runs as root, but ...")


# ------------------------------------------------------------------------------ gpufleet_check_judge

def _judge(task_args, task_vars=None):
    """Run the gpufleet_check_judge action plugin as the task executor would, with no connection."""
    from ansible.playbook.task import Task
    from ansible.playbook.play_context import PlayContext
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible_collections.gpufleet.fleet.plugins.action.gpufleet_check_judge import ActionModule
    task = Task()
    task.action = "gpufleet.fleet.gpufleet_check_judge"
    task.args = task_args
    loader = DataLoader()
    # No host is contacted: a connection without a temporary directory is all the base class looks at.
    connection = types.SimpleNamespace(_shell=types.SimpleNamespace(tmpdir=None))
    action = ActionModule(task, connection=connection, play_context=PlayContext(), loader=loader,
                          templar=Templar(loader), shared_loader_obj=None)
    return action.run(task_vars=task_vars or {})


def test_the_judge_registers_the_verdict_and_its_line_and_the_fleet_keeps_only_the_verdict():
    unreachable = {"unreachable": True, "msg": "ssh: connect to host h port 22: No route to host"}
    skipped = {"skipped": True, "skip_reason": "Conditional result was False"}
    result = _judge({"reads": [unreachable, skipped], "config": {"expected_gpus": 8}})
    assert result["verdict"] == "CRIT" and result["gpus_total"] == 8 and not result["changed"]
    assert [r["code"] for r in result["reasons"]] == ["unreachable"]
    assert result["msg"] == chk.gpufleet_check_line(chk.gpufleet_check_verdict([unreachable], {"expected_gpus": 8}))
    fleet = chk.gpufleet_check_fleet({"h": {"fleet_check_result": result}}, ["h"])
    assert set(fleet["h"]) == set(chk.VERDICT_KEYS) and "msg" not in fleet["h"]
    # A read that returned nothing usable: CRIT check_read_failed, not OK.
    failed = _judge({"reads": [{"failed": True, "msg": "Timeout (70s) waiting for the module"}]})
    assert failed["verdict"] == "CRIT" and [r["code"] for r in failed["reasons"]] == ["check_read_failed"]
    assert "Timeout (70s)" in failed["msg"]


def test_the_judge_refuses_an_unknown_argument():
    from ansible.errors import AnsibleActionFail
    with pytest.raises(AnsibleActionFail, match="thresholds"):
        _judge({"reads": [], "thresholds": {}})


def test_what_is_left_on_a_host_follows_the_read_and_the_hosts_that_need_it_are_the_next_plays():
    read = {"gathered": ["server", "sglang"], "host": {"managed_pid": 1, "managed_running": True}}
    ok = _judge({"reads": [read], "become_reads": ["gpu", "nccl_workers"], "textfile_dir": "/var/lib/node_exporter"})
    assert ok["pending"] == {"become": ["gpu", "nccl_workers"], "textfile": "/var/lib/node_exporter"}
    # Nothing more on a host the read could not reach, nor where root would run others' code.
    gone = _judge({"reads": [{"unreachable": True, "msg": "no route"}], "become_reads": ["gpu"], "textfile_dir": "/d"})
    untrusted = _judge({"reads": [{"gathered": [], "root_code": [{"text": "writable by uid 1000"}]}],
                        "become_reads": ["gpu"], "textfile_dir": "/d"})
    assert gone["pending"] == untrusted["pending"] == {"become": [], "textfile": ""}
    # Check mode writes no textfile; the call with become leaves nothing to read with become.
    assert chk.pending_steps([read], ["gpu"], "/d", check_mode=True) == {"become": ["gpu"], "textfile": ""}
    hostvars = {"a": {"fleet_check_result": ok}, "b": {"fleet_check_result": gone}, "c": {},
                "d": {"fleet_check_result": dict(ok, pending={"become": [], "textfile": "/d"})}}
    assert chk.gpufleet_check_pending(hostvars, "become") == ["a"]
    assert chk.gpufleet_check_pending(hostvars, "textfile") == ["a", "d"]
    assert set(chk.gpufleet_check_fleet(hostvars, ["a"])["a"]) == set(chk.VERDICT_KEYS)


def test_a_read_that_returned_no_part_is_crit_even_when_failed_when_cleared_failed():
    # failed_when: false leaves "failed" false; the module's own failure is the missing "gathered".
    broken = {"failed": False, "failed_when_result": False, "rc": 126, "changed": False,
              "msg": "Module result deserialization failed: No start of json char found",
              "module_stderr": "/bin/sh: 1: /v/bin/python: Permission denied\n"}
    verdict = chk.gpufleet_check_verdict([broken])
    assert verdict["verdict"] == "CRIT" and [r["code"] for r in verdict["reasons"]] == ["check_read_failed"]
    assert "deserialization failed" in verdict["reasons"][0]["text"] and "Permission denied" in verdict["reasons"][0]["text"]
    # Only stderr: that is the text.
    only_stderr = chk.gpufleet_check_verdict([{"rc": 127, "module_stderr": "python: not found"}])
    assert "python: not found" in only_stderr["reasons"][0]["text"]
    # A good first read and a broken become read: CRIT, not the first read's OK.
    good = {"gathered": ["server"], "host": {"managed_pid": 1, "managed_running": False}}
    assert chk.gpufleet_check_verdict([good, broken])["verdict"] == "CRIT"


def test_a_verdict_that_still_waits_for_the_become_call_is_not_the_hosts():
    ok = _judge({"reads": [{"gathered": ["server"], "host": {}}], "become_reads": ["gpu"]})
    assert ok["verdict"] == "OK" and ok["pending"]["become"] == ["gpu"]
    fleet = chk.gpufleet_check_fleet({"h": {"fleet_check_result": ok}}, ["h"])
    assert fleet["h"]["verdict"] == "CRIT" and fleet["h"]["reasons"][0]["code"] == "unreachable"
    done = _judge({"reads": [{"gathered": ["server"], "host": {}}, {"gathered": ["gpu"]}]})
    # After the call with become nothing waits: the fleet takes the host's own verdict.
    assert done["pending"]["become"] == []
    assert chk.gpufleet_check_fleet({"h": {"fleet_check_result": done}}, ["h"])["h"] == dict(
        (key, done[key]) for key in chk.VERDICT_KEYS)


# ------------------------------------------------------------------------------ reasons as they are said (grouped)

def _hot(temps):
    """A verdict whose GPUs have these core temperatures (C), else healthy."""
    g = healthy()
    for i, t in temps.items():
        g["gpu"]["gpus"][i]["temperature_gpu_c"] = t
    return verdict(g)


def test_the_same_reason_on_eight_gpus_is_said_once_with_its_gpus_in_the_line():
    r = _hot({i: 87 for i in range(8)})
    # the verdict keeps one reason per GPU (set_stats, check.json, the textfile read them per GPU)...
    assert [x["gpu"] for x in r["reasons"] if x["code"] == "gpu_temperature"] == list(range(8))
    # ...the line says it once
    assert chk.gpufleet_check_line(r) == "WARN, GPUs 0/8: WARN gpu_temperature GPU 0\u20137: GPU temperature 87 C >= 85 C"


def test_group_reasons_keeps_order_lists_gpus_as_ranges_and_never_merges_host_wide_reasons():
    reasons = [chk._reason("CRIT", "nvlink_down", "NVLink link(s) 3 down", 1),
               chk._reason("WARN", "gpu_temperature", "GPU temperature 87 C >= 85 C", 0),
               chk._reason("WARN", "gpu_temperature", "GPU temperature 87 C >= 85 C", 1),
               chk._reason("WARN", "gpu_temperature", "GPU temperature 91 C >= 85 C", 3),
               chk._reason("WARN", "gpu_temperature", "GPU temperature 87 C >= 85 C", 2),
               chk._reason("WARN", "gpu_temperature", "GPU temperature 87 C >= 85 C", 5),
               chk._reason("WARN", "xid_unknown", "Xid events unknown: no log"),
               chk._reason("WARN", "xid_unknown", "Xid events unknown: no log")]
    groups = chk.group_reasons(reasons)
    assert [(g["code"], g["gpus"], g["label"]) for g in groups] == [
        ("nvlink_down", [1], "GPU 1: NVLink link(s) 3 down"),
        ("gpu_temperature", [0, 1, 2, 5], "GPU 0\u20132, 5: GPU temperature 87 C >= 85 C"),
        ("gpu_temperature", [3], "GPU 3: GPU temperature 91 C >= 85 C"),
        ("xid_unknown", [], "Xid events unknown: no log"),
        ("xid_unknown", [], "Xid events unknown: no log")]
    # the same text with another severity or code is another reason
    two = chk.group_reasons([chk._reason("WARN", "a", "t", 0), chk._reason("CRIT", "a", "t", 1),
                             chk._reason("WARN", "b", "t", 2)])
    assert [g["gpus"] for g in two] == [[0], [1], [2]]
    assert chk.group_reasons([]) == [] and chk.group_reasons(None) == []


def test_the_table_names_a_grouped_reason_with_its_gpus_and_counts_groups_not_gpus():
    hot = _hot({i: 87 for i in range(8)})
    assert chk.short_reasons(hot["reasons"]) == "WARN gpu_temperature GPU 0\u20137"
    g = healthy()
    for i in range(8):
        g["gpu"]["gpus"][i]["temperature_gpu_c"] = 87
        g["gpu"]["gpus"][i]["persistence_mode"] = "Disabled"
    g["gpu"]["gpus"][1]["clocks_event_reasons"] = ["hw_slowdown"]
    text = chk.short_reasons(verdict(g)["reasons"], limit=2)
    assert text == "WARN gpu_temperature GPU 0\u20137, WARN persistence_off GPU 0\u20137 (+1)"
    line = chk.gpufleet_check_table({"gpu-01": hot}).splitlines()[1]
    assert line.split()[:4] == ["gpu-01", "WARN", "0/8", "WARN"] and line.endswith("gpu_temperature GPU 0\u20137")


def test_report_rows_put_the_worst_hosts_first_then_by_name_with_grouped_reasons():
    bad = healthy()
    bad["gpu"]["gpus"][1]["ecc_errors_uncorrected_volatile_total"] = 2
    fleet = {"gpu-03": verdict(healthy()), "gpu-02": _hot({i: 87 for i in range(8)}), "gpu-04": verdict(bad),
             "gpu-01": verdict(healthy()), "gpu-00": _hot({0: 87}), "gpu-05": {"verdict": "bogus"}}
    rows = chk.gpufleet_check_report_rows(fleet)
    assert [(r["host"], r["verdict"]) for r in rows] == [
        ("gpu-04", "CRIT"), ("gpu-05", "CRIT"), ("gpu-00", "WARN"), ("gpu-02", "WARN"), ("gpu-01", "OK"),
        ("gpu-03", "OK")]
    assert [g["label"] for g in rows[3]["reason_groups"]] == ["GPU 0\u20137: GPU temperature 87 C >= 85 C"]
    assert len(rows[3]["reasons"]) == 8  # the verdict itself is untouched
    assert fleet["gpu-02"].get("reason_groups") is None
    assert filters.FilterModule().filters()["gpufleet_check_report_rows"] is chk.gpufleet_check_report_rows


def test_the_html_report_lists_hosts_worst_first_and_a_shared_reason_once(tmp_path):
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROOT / "roles" / "fleet_check" / "templates")),
                             autoescape=False)
    env.filters["gpufleet.fleet.gpufleet_check_report_rows"] = chk.gpufleet_check_report_rows
    fleet = {"gpu-01": verdict(healthy()), "gpu-02": _hot({i: 87 for i in range(8)})}
    bad = healthy()
    bad["gpu"]["gpus"][1]["ecc_errors_uncorrected_volatile_total"] = 2
    fleet["gpu-03"] = verdict(bad)
    html = env.get_template("check.html.j2").render(gpufleet_check_fleet=fleet,
                                                    gpufleet_check_generated_at="2026-12-05T08:00:00Z")
    order = [html.index('data-host="%s" data-verdict' % h) for h in ("gpu-03", "gpu-02", "gpu-01")]
    assert order == sorted(order)
    assert html.count('data-code="gpu_temperature"') == 1
    assert 'data-gpus="0,1,2,3,4,5,6,7">WARN gpu_temperature: GPU 0\u20137: GPU temperature 87 C &gt;= 85 C</li>' \
        in html
    # the per-GPU tables follow the same order
    assert html.index('<table class="gpus" data-host="gpu-03"') < html.index('<table class="gpus" data-host="gpu-01"')
