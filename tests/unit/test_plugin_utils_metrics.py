"""Unit tests of plugins/plugin_utils/metrics.py (the fleet check's node_exporter textfile, written with
prometheus_client) and of what ships over it: monitoring/prometheus/gpufleet.rules.yml (promtool check rules,
promtool test rules) and monitoring/grafana/gpufleet.json. Every metric and label the rules and the dashboard use
is one the textfile writes (or dcgm-exporter's)."""
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import yaml

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "prometheus" / "gpufleet.rules.yml"
RULES_TEST = ROOT / "monitoring" / "prometheus" / "gpufleet.rules.test.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "gpufleet.json"
parser = pytest.importorskip("prometheus_client.parser")

# The verdicts of the check's unit tests (a healthy 8-GPU host and its faults), not invented ones.
_spec = importlib.util.spec_from_file_location("gpufleet_check_unit_cases", ROOT / "tests" / "unit" /
                                               "test_plugin_utils_check.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

# dcgm-exporter's series the rules and the dashboard join with (its default-counters.csv: memory in MiB, the
# core temperature, the last Xid) and their labels.
DCGM_METRICS = {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS"}
DCGM_LABELS = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"}
# Labels Prometheus adds to every scraped series.
SCRAPE_LABELS = {"instance", "job"}


def families(text):
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def faulty_verdict():
    g = cases.healthy()
    g["gpu"]["gpus"][1]["ecc_errors_uncorrected_volatile_total"] = 4
    g["gpu"]["gpus"][1]["pci_bus_id"] = "00000000:19:00.0"
    g["gpu"]["gpus"][2]["clocks_event_reasons"] = ["hw_slowdown"]
    return cases.verdict(g)


def test_gpu_series_carry_dcgm_exporters_labels_and_host_series_hostname():
    text = metrics.gpufleet_check_prom(faulty_verdict(), "gpu-01", now_epoch=1764570000.5)
    fams = families(text)
    healthy = {s.labels["gpu"]: s for s in fams["gpufleet_gpu_healthy"].samples}
    assert set(healthy) == {str(i) for i in range(8)}
    assert healthy["1"].labels == {"gpu": "1", "UUID": "GPU-00000001", "pci_bus_id": "00000000:19:00.0",
                                   "device": "nvidia1", "modelName": "NVIDIA H200", "Hostname": "gpu-01"}
    assert healthy["1"].value == 0 and healthy["2"].value == 0 and healthy["0"].value == 1
    severity = {s.labels["UUID"]: s.value for s in fams["gpufleet_gpu_severity"].samples}
    assert severity["GPU-00000001"] == 2 and severity["GPU-00000002"] == 1 and severity["GPU-00000000"] == 0
    for name in ("gpufleet_check_severity", "gpufleet_gpus_ok", "gpufleet_gpus", "gpufleet_sglang_serving",
                 "gpufleet_nccl_block_present", "gpufleet_check_timestamp_seconds"):
        assert [s.labels for s in fams[name].samples] == [{"Hostname": "gpu-01"}], name
    assert fams["gpufleet_check_severity"].samples[0].value == 2
    assert fams["gpufleet_gpus_ok"].samples[0].value == 6 and fams["gpufleet_gpus"].samples[0].value == 8
    assert fams["gpufleet_check_timestamp_seconds"].samples[0].value == 1764570000
    verdicts = {s.labels["verdict"]: s.value for s in fams["gpufleet_check_verdict"].samples}
    assert verdicts == {"OK": 0, "WARN": 0, "CRIT": 1}
    # No label of the old spelling is left, and nothing DCGM exports already is exported again.
    assert not re.search(r'\b(host|uuid)="', text)
    assert "temperature" not in text and "memory_used" not in text


def test_reasons_name_the_gpu_by_index_and_uuid_and_host_wide_ones_neither():
    g = cases.healthy()
    g["gpu"]["gpus"][3]["remapped_rows_pending"] = True
    g["health"] = {"status": 503, "url": "http://127.0.0.1:30000/health_generate", "msg": "Service Unavailable"}
    r = cases.verdict(g)
    fams = families(metrics.gpufleet_check_prom(r, "gpu-01"))
    by_code = {s.labels["code"]: s.labels for s in fams["gpufleet_check_reasons"].samples}
    assert by_code["remap_pending"] == {"Hostname": "gpu-01", "code": "remap_pending", "severity": "CRIT",
                                        "gpu": "3", "UUID": "GPU-00000003"}
    # An empty label is no label in Prometheus: a host-wide reason has no gpu and no UUID to join on.
    assert by_code["sglang_not_serving"]["gpu"] == "" and by_code["sglang_not_serving"]["UUID"] == ""
    assert fams["gpufleet_sglang_serving"].samples[0].value == 0
    assert "gpufleet_check_timestamp_seconds" not in fams


def test_a_healthy_host_writes_no_empty_reasons_family_and_escapes_its_name():
    text = metrics.gpufleet_check_prom(cases.verdict(cases.healthy()), 'gpu-"01"\\a')
    fams = families(text)
    assert "gpufleet_check_reasons" not in fams
    assert fams["gpufleet_check_severity"].samples[0].labels == {"Hostname": 'gpu-"01"\\a'}
    assert 'Hostname="gpu-\\"01\\"\\\\a"' in text


def test_an_unreachable_host_is_crit_with_the_gpus_it_should_have():
    fams = families(metrics.gpufleet_check_prom(cases.chk.gpufleet_check_unreachable("no route", 8), "gpu-09"))
    assert fams["gpufleet_check_severity"].samples[0].value == 2
    assert fams["gpufleet_gpus"].samples[0].value == 8 and fams["gpufleet_gpus_ok"].samples[0].value == 0
    assert "gpufleet_gpu_healthy" not in fams


def test_without_prometheus_client_the_textfile_says_what_to_install(monkeypatch):
    monkeypatch.setattr(metrics, "HAS_PROMETHEUS_CLIENT", False)
    with pytest.raises(ImportError, match="prometheus-client .*requirements.txt"):
        metrics.gpufleet_check_prom({"verdict": "OK"}, "gpu-01")


def test_a_textfile_asked_for_without_prometheus_client_is_a_warn_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(metrics, "HAS_PROMETHEUS_CLIENT", False)
    ok = cases.verdict(cases.healthy())
    verdict, pending = metrics.textfile_requirement(ok, {"become": ["gpu"], "textfile": "/var/lib/ne"})
    assert pending == {"become": ["gpu"], "textfile": ""}
    assert verdict["verdict"] == "WARN" and verdict["gpus_ok"] == 8
    [reason] = verdict["reasons"]
    assert reason["code"] == "textfile_write_failed" and reason["gpu"] is None and reason["severity"] == "WARN"
    assert reason["text"].startswith("/var/lib/ne/gpufleet.prom not written: the Python package prometheus-client")
    g = cases.healthy()
    g["gpu"]["gpus"][1]["remapped_rows_pending"] = True
    crit, _ = metrics.textfile_requirement(cases.verdict(g), {"become": [], "textfile": "/d"})
    assert crit["verdict"] == "CRIT" and [r["code"] for r in crit["reasons"]][-1] == "textfile_write_failed"
    # Nothing asked for (no directory, check mode): nothing to say.
    assert metrics.textfile_requirement(ok, {"become": [], "textfile": ""}) == (ok, {"become": [], "textfile": ""})
    monkeypatch.setattr(metrics, "HAS_PROMETHEUS_CLIENT", True)
    assert metrics.textfile_requirement(ok, {"become": [], "textfile": "/d"}) == (ok, {"become": [], "textfile": "/d"})


def test_the_judge_action_says_the_textfile_cannot_be_written_in_its_line(monkeypatch):
    monkeypatch.setattr(metrics, "HAS_PROMETHEUS_CLIENT", False)
    read = {"gathered": ["server"], "host": {"managed_pid": None, "managed_running": False}}
    result = cases._judge({"reads": [read], "textfile_dir": "/var/lib/ne"})
    assert result["pending"]["textfile"] == "" and result["verdict"] == "WARN"
    assert "textfile_write_failed" in result["msg"] and not result["changed"]


def test_the_filter_is_the_metrics_function():
    spec = importlib.util.spec_from_file_location("gpufleet_check_filters_m", ROOT / "plugins" / "filter" /
                                                  "gpufleet_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.FilterModule().filters()["gpufleet_check_prom"] is metrics.gpufleet_check_prom


def written():
    """Metric and label names the textfile writes, from a render of every family (not from METRICS)."""
    r = faulty_verdict()
    fams = families(metrics.gpufleet_check_prom(r, "gpu-01", now_epoch=1.0))
    assert set(fams) == set(metrics.METRICS)
    return set(fams), {k for f in fams.values() for s in f.samples for k in s.labels}


_LABEL_LIST = re.compile(r"\b(?:on|ignoring|by|without|group_left|group_right)\s*\(([^)]*)\)")
_LABEL_MATCHER = re.compile(r"[{,]\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_NAME = re.compile(r"\b([A-Za-z_:][A-Za-z0-9_:]*)\b")


def used(expr):
    """(metric names, label names) a PromQL expression uses; label values, strings and functions left out."""
    bare = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    labels = {n.strip() for group in _LABEL_LIST.findall(bare) for n in group.split(",") if n.strip()}
    labels |= set(_LABEL_MATCHER.findall(bare))
    names = {n for n in _NAME.findall(bare) if n.startswith(("gpufleet_", "DCGM_"))}
    return names, labels


def rule_exprs():
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def dashboard_exprs():
    dash = json.loads(DASHBOARD.read_text())
    out = {}
    for p in dash["panels"]:
        for t in p["targets"]:
            out["%s/%s" % (p["title"], t["refId"])] = t["expr"]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out["$" + var["name"]] = var["definition"]
    return out


def test_the_parser_of_exprs_finds_names_and_labels():
    names, labels = used('DCGM_FI_DEV_FB_USED > 1024 and on(UUID) sum by (Hostname, gpu) '
                         '(gpufleet_gpu_healthy{Hostname=~"$Hostname", code="on(x) gpufleet_fake"})')
    assert names == {"DCGM_FI_DEV_FB_USED", "gpufleet_gpu_healthy"}
    assert labels == {"UUID", "Hostname", "gpu", "code"}


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_metric_and_label_used_is_one_the_textfile_writes_or_dcgm_exporters(source):
    names_written, labels_written = written()
    exprs = rule_exprs() if source == "rules" else dashboard_exprs()
    assert len(exprs) >= 7
    seen = set()
    for where, expr in exprs.items():
        names, labels = used(expr)
        if expr.startswith("label_values("):
            labels |= {expr.rstrip(")").rsplit(",", 1)[1].strip()}
        assert names, "%s uses no gpufleet or DCGM metric: %s" % (where, expr)
        assert names <= names_written | DCGM_METRICS, (where, names - names_written - DCGM_METRICS)
        assert labels <= labels_written | DCGM_LABELS | SCRAPE_LABELS, (where, labels)
        seen |= names
    # The joins are on the label both sides carry under the same name.
    assert any("DCGM_" in e and "on(UUID)" in e for e in exprs.values())
    assert seen & names_written


def test_rule_annotations_use_only_labels_the_series_carry():
    doc = yaml.safe_load(RULES.read_text())
    _, labels_written = written()
    for group in doc["groups"]:
        for rule in group["rules"]:
            for text in rule["annotations"].values():
                for label in re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", text):
                    assert label in labels_written | DCGM_LABELS, (rule["alert"], label)


def test_dashboard_takes_its_datasource_from_a_template_variable():
    dash = json.loads(DASHBOARD.read_text())
    [ds] = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    ref = "${%s}" % ds["name"]
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == ref and all(t["datasource"]["uid"] == ref for t in p["targets"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def promtool():
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing in CI: make system-packages installs Debian's prometheus")
        pytest.skip("promtool missing (Debian's prometheus package; make test installs it)")
    return path


def test_promtool_checks_the_rules():
    res = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: %d rules found" % len(rule_exprs()) in res.stdout


def test_promtool_parses_every_dashboard_query(tmp_path):
    # As recording rules (Grafana's $Hostname as the "All" value .*): promtool parses each expression.
    exprs = [e.replace("$Hostname", ".*") for k, e in sorted(dashboard_exprs().items()) if not k.startswith("$")]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": "gpufleet:dashboard_query_%d" % i, "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: %d rules found" % len(exprs) in res.stdout


def test_promtool_unit_tests_of_the_rules_pass():
    # gpufleet.rules.test.yml: the CRIT host alerts, the DCGM join fires for the critical GPU only (with
    # dcgm-exporter's labels), the stale check fires after 3 h.
    res = subprocess.run([promtool(), "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                         timeout=60, cwd=str(RULES_TEST.parent))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_prometheus_client_is_a_controller_requirement_of_the_collection_not_a_target_one():
    from packaging.requirements import Requirement
    wanted = [Requirement(line) for line in (ROOT / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    [prom] = [r for r in wanted if r.name == "prometheus-client"]
    for name in ("controller.txt", "controller-ansible-2.20.txt", "controller-ansible-2.21.txt"):
        pins = dict(line.split("==") for line in (ROOT / "requirements" / name).read_text().splitlines()
                    if "==" in line and not line.startswith("#"))
        assert prom.specifier.contains(pins["prometheus-client"]), name
    # The text is rendered on the controller and copied: a managed host needs no prometheus_client.
    assert "prometheus" not in (ROOT / "requirements" / "target.txt").read_text()
