"""plugins/plugin_utils/workflow.py: which targeted hosts restart.yml restarts after a fleet check (an AWX
workflow's check node passes check.yml's set_stats gpufleet_check on to the restart)."""
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import check, guard, run, workflow

CRIT_ECC = {"verdict": "CRIT", "gpus_ok": 7, "gpus_total": 8,
            "reasons": [{"severity": "CRIT", "code": "ecc_uncorrected", "gpu": 1, "text": "2 uncorrected ECC errors"}]}
OK = {"verdict": "OK", "reasons": [], "gpus_ok": 8, "gpus_total": 8}
WARN = {"verdict": "WARN", "gpus_ok": 8, "gpus_total": 8,
        "reasons": [{"severity": "WARN", "code": "throttle", "gpu": 3, "text": "HW slowdown"}]}


def test_without_a_check_every_target_is_restarted():
    for unset in (None, "", "  ", {}):
        assert workflow.restart_skips(["h1", "h2"], unset) == {}
    assert workflow.check_errors(None) == [] and workflow.check_errors({}) == [] and workflow.check_errors("") == []


def test_a_crit_host_is_skipped_naming_its_reasons_and_an_ok_host_is_restarted():
    skips = workflow.restart_skips(["h1", "h2"], {"h1": CRIT_ECC, "h2": OK})
    assert list(skips) == ["h1"]
    assert "found it CRIT (CRIT ecc_uncorrected GPU 1" in skips["h1"] and "GPUs ok 7/8" in skips["h1"]
    assert "only OK hosts are restarted (gpufleet_restart_verdicts)" in skips["h1"]


def test_warn_is_skipped_by_default_and_restarted_when_the_verdicts_allow_it():
    fleet = {"h1": WARN, "h2": OK, "h3": CRIT_ECC}
    assert list(workflow.restart_skips(["h1", "h2", "h3"], fleet)) == ["h1", "h3"]
    assert list(workflow.restart_skips(["h1", "h2", "h3"], fleet, ["OK", "WARN"])) == ["h3"]
    # an AWX survey's text answer, any case
    assert list(workflow.restart_skips(["h1", "h2", "h3"], fleet, "ok, warn")) == ["h3"]
    assert "only OK/WARN hosts" in workflow.restart_skips(["h3"], fleet, ["OK", "WARN"])["h3"]


def test_a_host_the_check_did_not_judge_is_skipped_not_restarted_blindly():
    # e.g. the artifact of one slice of a sliced check, or a check of another target
    skips = workflow.restart_skips(["h1", "h2", "h3"], {"h2": OK})
    assert list(skips) == ["h1", "h3"]
    assert "gave this host no verdict (it judged 1 other host(s): h2)" in skips["h1"]


def test_skips_follow_the_target_order_and_only_targets_count():
    fleet = {"h9": CRIT_ECC, "h1": CRIT_ECC, "h2": CRIT_ECC}
    assert list(workflow.restart_skips(["h2", "h1"], fleet)) == ["h2", "h1"]


def test_the_check_stats_check_yml_publishes_are_accepted_as_they_are():
    fleet = {"h1": dict(CRIT_ECC, gpus=[], sglang={}, driver_version="550"), "h2": dict(OK, gpus=[])}
    stats = check.gpufleet_check_stats(fleet)
    assert workflow.check_errors(stats) == []
    assert list(workflow.restart_skips(["h1", "h2"], stats)) == ["h1"]


def test_malformed_check_results_are_refused_naming_the_variable():
    [error] = workflow.check_errors("h1=CRIT")
    assert error.startswith("gpufleet_check is a string;")
    assert workflow.check_errors(["h1"])[0].startswith("gpufleet_check is a list;")
    [error] = workflow.check_errors({"h1": OK, "h2": {"verdict": "BAD"}, "h3": "CRIT"})
    assert "gives no verdict (OK, WARN or CRIT) for h2, h3" in error
    # refused input decides nothing here (the guard has failed the run)
    assert workflow.restart_skips(["h1"], {"h1": "CRIT"}) == {}


def test_restart_verdicts_must_name_verdicts():
    assert workflow.check_errors({"h1": OK}, ["OK", "WARN"]) == []
    assert workflow.check_errors({"h1": OK}, "") == [] and workflow.check_errors({"h1": OK}, None) == []
    # the maintenance workflow's survey answers (awx/configure.yml): text, read as a list
    assert workflow.check_errors({"h1": OK}, "OK") == [] and workflow.check_errors({"h1": OK}, "OK, WARN") == []
    [error] = workflow.check_errors(None, ["OK", "GOOD"])
    assert "gpufleet_restart_verdicts names GOOD" in error
    [error] = workflow.check_errors(None, [])
    assert "gpufleet_restart_verdicts is empty" in error


def test_the_guard_refuses_a_malformed_check_before_any_host_is_touched():
    errors = guard.gpufleet_guard_errors({"gpufleet_check": ["h1"], "gpufleet_restart_verdicts": ["FINE"]}, "h1")
    assert len(errors) == 2 and all(e.startswith("h1: gpufleet_") for e in errors), errors
    assert guard.gpufleet_guard_errors({"gpufleet_check": {"h1": OK}, "gpufleet_restart_verdicts": ["OK"]}) == []


def test_skip_rows_are_summary_rows_saying_why_and_what_to_do():
    rows = workflow.skip_rows(workflow.restart_skips(["h1", "h2"], {"h1": CRIT_ECC, "h2": OK}))
    assert list(rows) == ["h1"]
    row = rows["h1"]
    assert set(row) == set(run.ROW_KEYS) and row["result"] == "skipped" and row["host"] == "h1"
    assert row["cause"].startswith("not restarted: the fleet check found it CRIT")
    assert "untouched" in row["advice"] and "playbooks/check.yml -e target=h1" in row["advice"]
    assert row["old_pid"] is None and row["downtime_s"] is None


def test_the_plays_host_pattern_leaves_the_skipped_group_out_only_when_it_holds_hosts():
    assert workflow.restart_hosts("gpu_hosts", {"all": ["h1"], "gpu_hosts": ["h1"]}) == "gpu_hosts"
    assert workflow.restart_hosts("gpu_hosts", None) == "gpu_hosts"
    # a list: "h1,h2:!group" would be read as the patterns h1 and "h2:!group"
    assert workflow.restart_hosts("h1,h2", {workflow.SKIPPED_GROUP: ["h2"]}) == ["h1,h2", "!gpufleet_restart_skipped"]
