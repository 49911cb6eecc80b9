"""DCGM's health watches in the fleet check: `dcgmi health -c -j` read and normalized
(plugins/module_utils/gpufleet_dcgm.py), its incidents as reasons (plugins/plugin_utils/check.py dcgm_reasons),
the read in sglang_fleet_check_info, and the lab's stand-in dcgmi (tests/lab/standin/dcgmi_standin.py).

The documented shapes: NVIDIA/DCGM 4.6.0 dcgmi/Health.cpp and dcgmi/DcgmiOutput.cpp (see gpufleet_dcgm's
docstring); the messages are DCGM's own texts (dcgmlib/dcgm_errors.h DCGM_FR_*_MSG)."""
import importlib.util
import json
import os
import pathlib
import stat
import sys
import time

import pytest

from ansible.module_utils.testing import patch_module_args
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_dcgm as dcgm
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_host_reads as host_reads
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import check as chk

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "lab" / "standin"))
import dcgmi_standin  # noqa: E402

_spec = importlib.util.spec_from_file_location("sglang_fleet_check_info_dcgm",
                                               ROOT / "plugins" / "modules" / "sglang_fleet_check_info.py")
mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mod)

# Health::GenerateOutputFromResponse's tree for the incidents of dcgmi/tests/HealthTests.cpp's first scenario
# (GPU 0 memory Warning; GPU 1 memory Failure and SM Warning), a Switch incident and an incident DCGM raises for
# every system (Xid 79: dcgmi names its system "Internal error"), as jsoncpp's styled writer prints
# DcgmiOutputJson: keys sorted, messages cut into lines of at most 54 characters in "overflow".
DOCUMENTED = """{
   "body" : {
      "GPU" : {
         "children" : {
            "0" : {
               "children" : {
                  "Errors" : {
                     "children" : {
                        "Memory system" : {
                           "overflow" : [
                              "More than 10 single-bit ECC error(s) detected in GPU",
                              "0 Volatile SBEs: 12"
                           ],
                           "value" : "Warning"
                        }
                     }
                  }
               },
               "value" : "Warning"
            },
            "1" : {
               "children" : {
                  "Errors" : {
                     "children" : {
                        "Memory system" : {
                           "overflow" : [ "Detected 2 volatile double-bit ECC error(s) in GPU 1." ],
                           "value" : "Failure"
                        },
                        "SM system" : {
                           "overflow" : [ "Detected clocks event due to thermal violation in GPU", "1." ],
                           "value" : "Warning"
                        }
                     }
                  }
               },
               "value" : "Failure"
            },
            "7" : {
               "children" : {
                  "Errors" : {
                     "children" : {
                        "Internal error" : {
                           "overflow" : [ "GPU 7 has fallen off the bus" ],
                           "value" : "Failure"
                        }
                     }
                  }
               },
               "value" : "Failure"
            }
         }
      },
      "Overall Health" : {
         "value" : "Failure"
      },
      "Switch" : {
         "children" : {
            "0" : {
               "children" : {
                  "Errors" : {
                     "children" : {
                        "Internal error" : {
                           "overflow" : [ "Detected nonfatal errors on NvSwitch 0 link 4" ],
                           "value" : "Warning"
                        }
                     }
                  }
               },
               "value" : "Warning"
            }
         }
      }
   },
   "header" : [ "Health Monitor Report" ]
}
"""
HEALTHY = '{\n   "body" : {\n      "Overall Health" : {\n         "value" : "Healthy"\n      }\n   },\n' \
          '   "header" : [ "Health Monitor Report" ]\n}\n'


def test_documented_report_is_one_incident_per_entity_and_system_with_dcgms_message():
    r = dcgm.parse_health_check(0, DOCUMENTED, "", "/usr/bin/dcgmi")
    assert (r["status"], r["overall"], r["overall_text"], r["rc"]) == ("ok", "fail", "Failure", 0)
    got = [(i["entity_group"], i["entity_id"], i["gpu"], i["system"], i["health"], i["message"])
           for i in r["incidents"]]
    assert got == [
        ("GPU", "0", 0, "memory", "warn", "More than 10 single-bit ECC error(s) detected in GPU 0 Volatile SBEs: 12"),
        ("GPU", "1", 1, "memory", "fail", "Detected 2 volatile double-bit ECC error(s) in GPU 1."),
        ("GPU", "1", 1, "sm", "warn", "Detected clocks event due to thermal violation in GPU 1."),
        ("GPU", "7", 7, "other", "fail", "GPU 7 has fallen off the bus"),
        ("Switch", "0", None, "other", "warn", "Detected nonfatal errors on NvSwitch 0 link 4"),
    ]
    assert r["incidents"][1]["system_text"] == "Memory system" and r["incidents"][1]["health_text"] == "Failure"


def test_healthy_report_has_no_incident():
    r = dcgm.parse_health_check(0, HEALTHY)
    assert (r["status"], r["overall"], r["incidents"]) == ("ok", "pass", [])


@pytest.mark.parametrize("rc,out,status", [
    # dcgmi/Command.cpp: no nv-hostengine to connect to (DCGM_ST_CONNECTION_NOT_VALID, exit 256 - 21)
    (235, "Error: unable to establish a connection to the specified host: localhost\nError: Unable to connect to "
          "host engine. Host engine connection invalid/disconnected.\n", "hostengine_down"),
    # dcgmi/Health.cpp CheckWatches: no watch set (DCGM_ST_GENERIC_ERROR, exit 256 - 3)
    (253, "Error: Health watches not enabled. Please enable watches. \n", "no_watches"),
    (253, "Error: Unable to check health watches. Return: The Group is not found\n", "error"),
    (127, "", "error"),
])
def test_dcgmi_errors_are_told_apart_in_its_own_words(rc, out, status):
    r = dcgm.parse_health_check(rc, out, "")
    assert r["status"] == status and r["rc"] == rc and r["incidents"] == []
    assert r["msg"] == (" ".join(line.strip() for line in out.splitlines() if line.strip())
                        or "dcgmi exited %d without a message" % rc)


@pytest.mark.parametrize("out", ['{\n   "body" : {\n      "Overall Health" : {', "", "[1, 2]", '{"header": []}'])
def test_output_that_is_not_dcgmis_json_is_malformed_with_its_text(out):
    r = dcgm.parse_health_check(0, out)
    assert r["status"] == "malformed" and r["incidents"] == []
    # dcgmi's text, its lines joined
    assert " ".join(line.strip() for line in out.splitlines())[:30] in r["msg"] if out else "no output" in r["msg"]


def _script(tmp_path, body):
    path = tmp_path / "dcgmi"
    path.write_text("#!%s\n%s\n" % (sys.executable, body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_read_runs_dcgmi_with_its_arguments_and_no_shell(tmp_path):
    seen = tmp_path / "argv.json"
    path = _script(tmp_path, "import json, os, sys\njson.dump([sys.argv[1:], os.environ.get('LC_ALL')], "
                             "open(%r, 'w'))\nsys.stdout.write(%r)" % (str(seen), HEALTHY))
    r = dcgm.read_dcgm_health("dcgmi", 5, which=lambda name: path)
    assert (r["status"], r["dcgmi"], r["overall"]) == ("ok", path, "pass")
    assert json.loads(seen.read_text()) == [["health", "-c", "-j"], "C"]


def test_dcgmi_not_installed_is_absent_and_a_missing_path_is_not_found(tmp_path):
    calls = []
    r = dcgm.read_dcgm_health("dcgmi", 5, which=lambda name: None, run=lambda *a: calls.append(a))
    assert r == {"status": "absent", "dcgmi": "dcgmi", "incidents": []} and calls == []
    r = dcgm.read_dcgm_health(str(tmp_path / "nothere"), 5, which=lambda name: None)
    assert r["status"] == "not_found" and "nothere is not an executable file" in r["msg"]


def test_a_dcgmi_that_does_not_answer_is_abandoned_after_its_time_limit(tmp_path):
    path = _script(tmp_path, "import time\ntime.sleep(60)")
    t0 = time.monotonic()
    r = dcgm.read_dcgm_health(path, 0.5, which=None)
    assert time.monotonic() - t0 < 10
    assert r["status"] == "timeout" and "did not finish in 0.5 s" in r["msg"] and r["incidents"] == []


def _gpu_result():
    gpus = [{"index": i, "uuid": "GPU-%08d" % i, "memory_used_mib": 0, "persistence_mode": "Enabled"}
            for i in range(8)]
    return {"changed": False, "gpu_count": 8, "gpus": gpus, "xid_status": "ok", "xid_events": []}


def test_failure_is_crit_on_its_gpu_warning_warn_with_dcgms_message_and_system_code():
    reasons = chk.dcgm_reasons(dcgm.parse_health_check(0, DOCUMENTED))
    assert [(r["severity"], r["code"], r["gpu"]) for r in reasons] == [
        ("WARN", "dcgm_health_memory", 0), ("CRIT", "dcgm_health_memory", 1), ("WARN", "dcgm_health_sm", 1),
        ("CRIT", "dcgm_health_other", 7), ("WARN", "dcgm_health_other", None)]
    assert reasons[1]["text"] == "DCGM Memory system Failure: Detected 2 volatile double-bit ECC error(s) in GPU 1."
    assert reasons[3]["text"] == "DCGM health Failure: GPU 7 has fallen off the bus"
    assert reasons[4]["text"] == "Switch 0: DCGM health Warning: Detected nonfatal errors on NvSwitch 0 link 4"


def test_verdict_folds_dcgm_into_the_host_and_its_gpus():
    read = {"gathered": ["server", "gpu"], "host": {"managed_pid": None, "managed_running": False},
            "gpu": _gpu_result(), "dcgm": dcgm.parse_health_check(0, dcgmi_standin.styled(
                dcgmi_standin.report("fail", 3)))}
    v = chk.gpufleet_check_verdict(read, {"expected_gpus": 8})
    assert v["verdict"] == "CRIT" and (v["gpus_ok"], v["gpus_total"]) == (7, 8)
    assert [(r["severity"], r["code"], r["gpu"]) for r in v["reasons"]] == [("CRIT", "dcgm_health_memory", 3)]
    assert "Detected 2 volatile double-bit ECC error(s) in GPU 3." in chk.gpufleet_check_line(v)
    assert [g["verdict"] for g in v["gpus"]] == ["OK"] * 3 + ["CRIT"] + ["OK"] * 4
    read["dcgm"] = dcgm.parse_health_check(0, HEALTHY)
    assert chk.gpufleet_check_verdict(read, {"expected_gpus": 8})["verdict"] == "OK"
    # With fleet_check_become the GPUs (and DCGM) come from the second call: its dcgm counts.
    login = {"gathered": ["server"], "host": {"managed_pid": None, "managed_running": False}}
    become = {"gathered": ["gpu"], "gpu": _gpu_result(), "dcgm": dcgm.parse_health_check(0, DOCUMENTED)}
    assert chk.gpufleet_check_verdict([login, become])["verdict"] == "CRIT"


@pytest.mark.parametrize("read,code,words", [
    ({"status": "hostengine_down", "rc": 235, "msg": "Error: Unable to connect to host engine."},
     "dcgm_hostengine_down", ["cannot reach the host engine", "Unable to connect", "fleet_check_dcgmi=''"]),
    ({"status": "no_watches", "rc": 253, "msg": "Error: Health watches not enabled. Please enable watches."},
     "dcgm_no_watches", ["no health watch is set", "`dcgmi health -s a`", "Health watches not enabled"]),
    ({"status": "malformed", "rc": 0, "msg": "not JSON (Expecting value: line 1 column 1 (char 0)): Segfault"},
     "dcgm_read_failed", ["dcgmi malformed, rc 0", "Segfault"]),
    ({"status": "timeout", "msg": "/usr/bin/dcgmi health -c -j did not finish in 10 s"},
     "dcgm_read_failed", ["dcgmi timeout)", "did not finish in 10 s"]),
])
def test_a_dcgmi_that_cannot_answer_is_one_warn_never_crit(read, code, words):
    read = dict(read, dcgmi="/usr/bin/dcgmi", incidents=[])
    [reason] = chk.dcgm_reasons(read)
    assert (reason["severity"], reason["code"], reason["gpu"]) == ("WARN", code, None)
    for word in words:
        assert word in reason["text"], reason["text"]
    v = chk.gpufleet_check_verdict({"gathered": ["gpu"], "gpu": _gpu_result(), "dcgm": read})
    assert v["verdict"] == "WARN" and v["gpus_ok"] == 8


def test_no_dcgmi_or_a_skipped_read_says_nothing():
    assert chk.dcgm_reasons({"status": "absent", "dcgmi": "dcgmi", "incidents": []}) == []
    assert chk.dcgm_reasons(None) == [] and chk.dcgm_reasons({"skipped": True}) == []
    v = chk.gpufleet_check_verdict({"gathered": ["gpu"], "gpu": _gpu_result(),
                                    "dcgm": {"status": "absent", "dcgmi": "dcgmi", "incidents": []}})
    assert v["verdict"] == "OK" and v["reasons"] == []


@pytest.mark.parametrize("state,status,overall,incident", [
    ("pass", "ok", "pass", None),
    ("warn", "ok", "warn", ("pcie", "warn", 3, "Detected more than 8 PCIe replays per minute for GPU 3 : 12")),
    ("fail", "ok", "fail", ("memory", "fail", 3, "Detected 2 volatile double-bit ECC error(s) in GPU 3.")),
    ({"state": "fail", "gpu": 5}, "ok", "fail", ("memory", "fail", 5,
                                                 "Detected 2 volatile double-bit ECC error(s) in GPU 5.")),
    ("no_watches", "no_watches", None, None),
    ("hostengine_down", "hostengine_down", None, None),
    ("malformed", "malformed", None, None),
])
def test_lab_standin_says_what_dcgmi_says_for_each_knob(tmp_path, state, status, overall, incident):
    host = tmp_path / "gpu-lab-01"
    (host / "bin").mkdir(parents=True)
    faults = {"dcgmi": state}
    (host / "faults.json").write_text(json.dumps(faults))
    path = dcgmi_standin.sync_dcgmi(str(host), faults, sys.executable)
    r = dcgm.read_dcgm_health("dcgmi", 20, which=lambda name: path)
    assert (r["status"], r.get("overall")) == (status, overall), r
    got = [(i["system"], i["health"], i["gpu"], i["message"]) for i in r["incidents"]]
    assert got == ([incident] if incident else [])
    # Cleared: no dcgmi on the host (DCGM not installed), and read as absent.
    assert dcgmi_standin.sync_dcgmi(str(host), {}, sys.executable) is None and not os.path.exists(path)


def test_lab_standin_refuses_an_unknown_state():
    with pytest.raises(ValueError, match="the state is one of pass"):
        dcgmi_standin.check_knob("broken")
    with pytest.raises(ValueError):
        dcgmi_standin.check_knob({"state": "fail", "gpu": 9})


def _run_module(capsys, args):
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


def test_module_reads_dcgm_with_the_gpus_and_returns_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(host_reads, "read_gpu_info", lambda *a, **k: _gpu_result())
    host = tmp_path / "gpu-lab-01"
    (host / "bin").mkdir(parents=True)
    (host / "faults.json").write_text(json.dumps({"dcgmi": "fail"}))
    path = dcgmi_standin.sync_dcgmi(str(host), {"dcgmi": "fail"}, sys.executable)
    result = _run_module(capsys, {"gather": ["gpu"], "dcgmi": path, "dcgmi_timeout_s": 20, "xid_window_min": 0})
    assert result["dcgm"]["status"] == "ok" and result["dcgm"]["dcgmi"] == path
    assert [(i["gpu"], i["system"], i["health"]) for i in result["dcgm"]["incidents"]] == [(3, "memory", "fail")]
    assert chk.gpufleet_check_verdict(result)["verdict"] == "CRIT"
    # Not read without the GPUs, nor with dcgmi ''; a name not on PATH is absent.
    assert "dcgm" not in _run_module(capsys, {"gather": ["server"], "dcgmi": path})
    assert "dcgm" not in _run_module(capsys, {"gather": ["gpu"], "dcgmi": "", "xid_window_min": 0})
    assert _run_module(capsys, {"gather": ["gpu"], "dcgmi": "gpufleet-no-such-dcgmi",
                                "xid_window_min": 0})["dcgm"]["status"] == "absent"


def test_module_refuses_a_negative_dcgmi_timeout(capsys):
    result = _run_module(capsys, {"gather": ["gpu"], "dcgmi_timeout_s": -1})
    assert result["failed"] and result["msg"] == "dcgmi_timeout_s must be 0 or more (got -1.0)"
