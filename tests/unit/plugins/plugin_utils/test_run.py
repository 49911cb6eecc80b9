"""plugins/plugin_utils/run.py: restart.yml's summary rows and what a run cut short left on a host (moved here
from tests/unit/test_filter_gpufleet_run.py with the functions)."""
import pytest

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import run


# -- summary rows ------------------------------------------------------------------------------------

BASE = {"host": "h1", "now": 1100.0, "stop_started_epoch": 1000.0, "stop_old_pid": 77, "stop_signalled": 9,
        "release_wait_ms": 250, "new_pid": 88}


def test_ok_row_counts_downtime_from_stop_to_ready():
    row = run.restart_row(dict(BASE, ready_epoch=1012.34, nccl_ok=True, tokens_per_s="340.1"))
    assert row["result"] == "ok" and row["downtime_s"] == 12.3 and row["still_down"] is False
    assert row["nccl"] == "ok" and row["tokens_per_s"] == 340.1 and row["old_pid"] == 77 and row["new_pid"] == 88
    assert set(row) == set(run.ROW_KEYS)


def test_the_prefetch_figures_go_into_the_row_and_its_note_into_the_advice():
    pre = {"prefetch_gib": 7.5, "prefetch_s": 3.2, "resident_pct": 60.0,
           "prefetch_note": "prefetch stopped at the memory bound (...): 5.0 GiB left cold (...)"}
    row = run.restart_row(dict(BASE, ready_epoch=1012.34, nccl_ok=True, prefetch=pre))
    assert (row["prefetch_gib"], row["prefetch_s"], row["resident_pct"]) == (7.5, 3.2, 60.0)
    assert row["result"] == "ok" and row["advice"] == pre["prefetch_note"]
    assert run.gpufleet_summary_table([row]).splitlines()[1].split()[4] == "7.5G/3.2s/60%"
    # a failed host keeps its advice first; the note follows it
    failed = run.restart_row(dict(BASE, failed_phase="launch", failed_cause="crashed", prefetch=pre))
    assert failed["advice"].endswith("; " + pre["prefetch_note"]) and failed["prefetch_gib"] == 7.5
    # no prefetch (disabled, or --tags): nothing in the row
    row = run.restart_row(dict(BASE, ready_epoch=1012.34, nccl_ok=True))
    assert row["prefetch_gib"] is row["resident_pct"] is row["advice"] is None


def test_downtime_comes_from_the_targets_clock_when_stop_and_ready_times_are_known():
    # The target's SIGTERM and first-ready times win over the controller's task boundaries (and their skew).
    row = run.restart_row(dict(BASE, ready_epoch=1012.34, stop_signal_epoch=5000.5,
                                        ready_target_epoch=5003.04))
    assert row["downtime_s"] == 2.5
    # Only one of the two known: the controller pair, as before.
    row = run.restart_row(dict(BASE, ready_epoch=1012.34, stop_signal_epoch=5000.5, ready_target_epoch=None))
    assert row["downtime_s"] == 12.3


def test_first_run_without_an_old_server_has_no_downtime():
    row = run.restart_row(dict(BASE, stop_old_pid=None, stop_signalled=0, ready_epoch=1030.0))
    assert row["downtime_s"] == 0.0 and row["old_pid"] is None and row["result"] == "ok"
    # the wait's first poll took 250 ms, but no memory was released: not a release time
    assert row["release_wait_ms"] is None
    assert run.restart_row(dict(BASE, ready_epoch=1030.0))["release_wait_ms"] == 250


def test_a_stop_without_a_launch_is_down_not_ok_in_silence():
    # --tags stop: the server was stopped, nothing was started and nothing failed.
    row = run.restart_row(dict(BASE, new_pid=None))
    assert row["result"] == "ok" and row["still_down"] is True and row["downtime_s"] == 100.0
    assert row["advice"].startswith("only the stop ran (tags)") and "--tags launch" in row["advice"]
    assert run.restart_row(dict(BASE, ready_epoch=1012.0))["still_down"] is False


def test_first_launch_says_so_instead_of_passing_for_an_instant_restart():
    row = run.restart_row(dict(BASE, stop_old_pid=None, stop_signalled=0, ready_epoch=1030.0, nccl_ok=True))
    assert row["advice"] == "no server ran before this run (a first launch, or the host was down), so none was interrupted (downtime_s 0.0)"
    assert set(row) == set(run.ROW_KEYS)
    failed = run.restart_row(dict(BASE, stop_old_pid=None, stop_signalled=0, failed_phase="launch",
                                           failed_cause="the server exited with status 1",
                                           rollback={"state": "file_only", "detail": "nothing to relaunch"}))
    assert failed["advice"].startswith("no server ran before this run: this host serves nothing now")
    # A restart, and a stop-only run that launched nothing, carry no such note.
    assert run.restart_row(dict(BASE, ready_epoch=1012.0, nccl_ok=True))["advice"] is None
    assert run.restart_row(dict(BASE, stop_old_pid=None, stop_signalled=0, new_pid=None))["advice"] is None


def test_a_first_launch_after_an_interrupted_run_says_that_run_left_the_host_down():
    # Ctrl-C after the stop, then a rerun: it found no server and said "a first launch ... downtime_s 0.0", and
    # the outage the interrupted run left was recorded nowhere.
    prev = {"run_id": "20261203T2100-77", "controller": "ctl-1", "started": "2026-12-03T21:00:00Z",
            "started_epoch": 900.0}
    row = run.restart_row(dict(BASE, stop_old_pid=None, stop_signalled=0, ready_epoch=1030.0, nccl_ok=True,
                                        previous_run=prev))
    assert row["downtime_s"] == 0.0 and row["result"] == "ok"
    assert row["advice"].startswith("no server ran before this run: the previous restart of this host (run "
                                    "20261203T2100-77 from ctl-1, started 2026-12-03T21:00:00Z) did not finish")
    assert "at most since it started, 100 s before this run's stop" in row["advice"]
    # A taken-over lock on a host that still served: an ordinary restart, no such note.
    assert run.restart_row(dict(BASE, ready_epoch=1012.0, nccl_ok=True, previous_run=prev))["advice"] is None


def test_a_launch_without_verify_says_it_was_not_verified():
    # --tags launch (the recovery after --tags stop): the server answers health, verify never ran.
    launch_only = dict(host="h1", now=1100.0, ready_epoch=1030.0, new_pid=88)
    row = run.restart_row(launch_only)
    assert row["result"] == "ok" and row["advice"].startswith("launched but not verified")
    assert "--tags verify" in row["advice"] and "not recorded" in row["advice"]
    # With a stop before it (--tags stop,wait,launch) the note follows the first-launch or downtime note.
    row = run.restart_row(dict(BASE, stop_old_pid=None, stop_signalled=0, ready_epoch=1030.0))
    assert row["advice"].startswith("no server ran before this run") and "launched but not verified" in row["advice"]
    # Verify ran (nccl_ok is known, pass or fail): no note; check mode and failures carry their own advice.
    assert run.restart_row(dict(launch_only, nccl_ok=False))["advice"] is None
    assert run.restart_row(dict(launch_only, check_mode=True))["advice"] is None
    failed = run.restart_row(dict(BASE, failed_phase="verify", failed_cause="x",
                                           rollback={"state": "rolled_back", "detail": "y"}))
    assert "not verified" not in failed["advice"]
    # The stop-only advice names a recovery that verifies and records.
    assert "--tags launch,verify" in run.restart_row(dict(BASE, new_pid=None))["advice"]


def test_a_failure_before_the_stop_on_a_host_where_nothing_ran_says_none_ran():
    # A rerun after a failed run left the host down: the router drain (or the patch) fails before any stop; the
    # advice said "nothing was stopped: the old server still serves" while no server ran.
    facts = dict(host="h1", now=1100.0, failed_phase="stop", failed_cause="/v1/loads answered -1",
                 rollback={"state": "not_needed", "detail": "x"})
    row = run.restart_row(dict(facts, ran_before=False))
    assert row["advice"].startswith("nothing was stopped, and no SGLang server ran on this host when the run began "
                                    "(preflight saw none), so it most likely serves nothing"), row["advice"]
    assert "still serves" not in row["advice"] and "\n" not in row["advice"]
    for known in (True, None):  # a server ran, or preflight could not tell: as before
        assert "the old server still serves" in run.restart_row(dict(facts, ran_before=known))["advice"]
    # --check changes nothing and says nothing about serving
    assert "preflight saw none" not in run.restart_row(dict(facts, ran_before=False, check_mode=True))["advice"]


def test_after_a_rollback_new_pid_is_the_relaunched_server_not_the_failed_one():
    failed = dict(BASE, failed_phase="launch", failed_cause="exited with status 1", new_pid=172)
    row = run.restart_row(dict(failed, rollback={"state": "rolled_back", "pid": 220, "detail": "x"}))
    assert row["result"] == "rolled_back" and row["new_pid"] == 220
    row = run.restart_row(dict(failed, rollback={"state": "relaunched_loading", "pid": "221", "detail": "x"}))
    assert row["new_pid"] == 221
    # no relaunch, nothing serves: the launched server is gone (crashed, or stopped by the rollback), no pid names it
    assert run.restart_row(dict(failed, rollback={"state": "failed", "pid": None, "detail": "x"}))["new_pid"] is None
    # ...unless the rollback could not stop it: then it may still run, and its pid is what to look at
    stuck = {"state": "failed", "pid": None,
             "detail": "rollback failed while stopping the server this run launched: timeout"}
    assert run.restart_row(dict(failed, rollback=stuck))["new_pid"] == 172
    # a new server that serves but failed verify with no rollback keeps its pid
    kept = run.restart_row(dict(failed, failed_phase="verify", ready_epoch=1012.0,
                                         rollback={"state": "not_needed", "detail": "gpufleet_rollback is false"}))
    assert kept["new_pid"] == 172


def test_failed_host_that_was_stopped_shows_downtime_so_far_and_still_down():
    row = run.restart_row(dict(BASE, failed_phase="wait", failed_cause="GPU memory not released: GPU 3",
                                        rollback={"state": "failed", "detail": "relaunch failed: port taken"},
                                        new_pid=None))
    assert row["result"] == "failed" and row["phase"] == "wait"
    assert row["cause"] == "GPU memory not released: GPU 3"
    assert row["downtime_s"] == 100.0 and row["still_down"] is True
    assert row["rollback"] == "failed: relaunch failed: port taken"
    assert "serves nothing" in row["advice"] and "-e target=h1" in row["advice"]


def test_rolled_back_host_serves_again():
    row = run.restart_row(dict(BASE, failed_phase="launch", failed_cause="exit code 1",
                                        rollback={"state": "rolled_back", "detail": "previous server 99 serves"}))
    assert row["result"] == "rolled_back" and row["still_down"] is False and row["downtime_s"] == 100.0
    assert "serves again" in row["advice"]


def test_a_relaunch_still_loading_is_not_called_a_host_that_serves_nothing():
    row = run.restart_row(dict(BASE, failed_phase="launch", failed_cause="did not answer within 3 s",
                                        rollback={"state": "relaunched_loading", "pid": 4242,
                                                  "detail": "the previous server was relaunched as pid 4242"}))
    assert row["result"] == "failed" and row["still_down"] is True and row["downtime_s"] == 100.0
    assert "serves nothing" not in row["advice"], row["advice"]
    assert "relaunched (pid 4242) and still loads" in row["advice"]
    assert "check.yml -e target=h1" in row["advice"] and "restart.yml -e target=h1" in row["advice"]


def test_a_host_left_out_of_the_router_pool_says_so_in_its_advice():
    # Behind a router, a relaunched_loading host stays out of the pool even once its server serves; check.yml
    # does not look at the router, so the summary's note is the operator's only hint.
    facts = dict(BASE, failed_phase="launch", failed_cause="did not answer within 5 s",
                 rollback={"state": "relaunched_loading", "pid": 948, "detail": "relaunched as pid 948"})
    row = run.restart_row(dict(facts, router_out_of_pool="http://10.0.0.254:38000",
                                        router_worker_url="http://10.0.0.11:30000"))
    assert "out of the pool of the router http://10.0.0.254:38000" in row["advice"], row["advice"]
    assert "add http://10.0.0.11:30000 back with the router's POST /workers" in row["advice"], row["advice"]
    assert "relaunched (pid 948) and still loads" in row["advice"]
    assert "pool" not in run.restart_row(dict(facts, router_out_of_pool=None))["advice"]


def test_failure_before_the_stop_says_the_old_server_still_serves():
    row = run.restart_row({"host": "h1", "failed_phase": "stop", "failed_msg": "boom",
                                    "rollback": {"state": "not_needed", "detail": "x"}})
    assert row["result"] == "failed" and row["downtime_s"] is None and "still serves" in row["advice"]
    # old_pid names the server that still serves (preflight's check-mode stop found it); it showed "-"
    assert row["old_pid"] is None
    facts = {"host": "h1", "failed_phase": "patch", "failed_msg": "boom", "running_pid": "4242"}
    assert run.restart_row(facts)["old_pid"] == 4242
    assert run.restart_row(dict(facts, check_mode=True, failed_phase=None, failed_msg=None))["old_pid"] == 4242
    # once this run stopped something, old_pid is the stopped server's (or none), never preflight's
    stopped = dict(facts, stop_started_epoch=1000.0, now=1010.0)
    assert run.restart_row(dict(stopped, stop_old_pid=77))["old_pid"] == 77
    assert run.restart_row(stopped)["old_pid"] is None


def test_cause_falls_back_to_the_whole_message_when_its_first_line_only_introduces_it():
    row = run.restart_row(dict(BASE, failed_phase="verify", failed_cause="Validation of arguments failed:",
                                        failed_msg="Validation of arguments failed:\nargument 'x' is bad"))
    assert row["cause"] == "Validation of arguments failed: argument 'x' is bad"


def test_lock_refusal_row():
    row = run.restart_row({"host": "h1", "lock_refused": "h1: locked by another restart: run 7"})
    assert row["result"] == "refused" and row["phase"] == "lock" and "unlock.yml -e target=h1" in row["advice"]


def test_check_mode_row():
    row = run.restart_row(dict(BASE, check_mode=True, ready_epoch=None, nccl_ok=True))
    assert row["result"] == "check" and row["downtime_s"] is None and row["new_pid"] is None and row["nccl"] is None


def test_preflight_rows_name_refused_unreachable_and_not_started_hosts():
    hostvars = {"h1": {}, "h2": {"_gpufleet_refused": "preflight refused the host: port 30000 held by pid 5"},
                "h3": {}, "h4": {}}
    rows = run.preflight_rows(hostvars, ["h1", "h2", "h3", "h4"], ["h1", "h2", "h3", "h4"],
                                       ["h1", "h2", "h4"])
    assert rows["h2"]["result"] == "refused" and "port 30000" in rows["h2"]["cause"]
    assert rows["h3"]["result"] == "unreachable" and rows["h3"]["phase"] == "preflight"
    assert rows["h1"]["result"] == rows["h4"]["result"] == "not_started"
    assert "h2" in rows["h1"]["cause"] and "h3" in rows["h1"]["cause"]
    assert run.preflight_rows({"h1": {}}, ["h1"], ["h1"], ["h1"]) == {}


def test_a_refused_hosts_advice_says_whether_a_server_ran_when_the_run_began():
    refused = {"_gpufleet_refused": "preflight refused the host: GPU 0 would stay in use"}
    advice = {ran: run.preflight_rows({"h1": dict(refused, sglang_preflight_server_ran=ran)}, ["h1"], ["h1"],
                                               ["h1"])["h1"]["advice"] for ran in (True, False, None)}
    assert advice[True].startswith("the old server still serves")
    assert "most likely serves nothing" in advice[False] and "still serves" not in advice[False]
    assert advice[None].startswith("nothing was changed on this host") and "still serves" not in advice[None]


def test_not_started_rows_are_the_later_batches_only():
    hostvars = {"h1": {"gpufleet_summary_row": {"result": "ok"}}, "h2": {}, "h3": {}, "h4": {}}
    rows = run.not_started_rows(hostvars, ["h1", "h2", "h3", "h4"], ["h2"], "h2", "failed")
    assert sorted(rows) == ["h3", "h4"] and rows["h3"]["result"] == "not_started"
    assert "stopped at h2 (failed)" in rows["h3"]["cause"]


def test_ok_row_names_memory_left_to_holders_no_gpu_list_names():
    row = run.restart_row(dict(BASE, ready_epoch=1012.34, nccl_ok=True,
                                        foreign_gpu_mib={"5": 4009, "3": 20018}))
    assert row["result"] == "ok"
    assert row["advice"] == ("GPU memory held by processes no GPU list names was there while the old server ran and "
                             "was left to them (GPU 3: 20018 MiB, GPU 5: 4009 MiB): the wait after the stop waited "
                             "for the server's own memory only")
    # nothing stopped (refused, check mode): nothing was waited beside
    assert "no GPU list names" not in str(run.restart_row(
        dict(BASE, stop_started_epoch=None, new_pid=None, foreign_gpu_mib={"3": 20018}))["advice"])
    assert run.restart_row(dict(BASE, ready_epoch=1012.34, nccl_ok=True, foreign_gpu_mib={}))["advice"] \
        is None


# -- what a cancel really did (issue 30, item 6) ----------------------------------------------------------------

def _seen(*results, now=1000.0):
    seen = {}
    for res in results:
        run.server_seen(seen, res, now)
    return seen


STOPPED = {"signalled": [{"pid": 20, "signals": ["SIGTERM"]}], "main_pid": 20, "stop_ms": 500}
STOPPED_AND_STARTED = dict(STOPPED, start={"started": True, "pid": 31})
NOTHING_TO_STOP_BUT_STARTED = {"signalled": [], "main_pid": None, "stop_ms": 3, "start": {"started": True, "pid": 31}}
PREVIEW = {"signalled": [{"pid": 20, "signals": []}], "main_pid": 20, "stop_ms": 0}  # preflight's check-mode stop


@pytest.mark.parametrize("phase,results,words", [
    ("preflight", [PREVIEW], "cancelled in preflight: nothing was changed on this host (untouched)"),
    ("patch", [PREVIEW], "cancelled in the patch, before the stop: the old server still serves"),
    ("stop", [PREVIEW], "cancelled after the stop began, before a new server was seen serving"),
    ("wait", [STOPPED], "cancelled after the stop (old server pid 20), before a new server was started: this host "
                        "serves nothing now"),
    ("wait", [STOPPED_AND_STARTED], "cancelled after the stop (old server pid 20): the new server (pid 31) was "
                                    "started but not verified and not recorded"),
    ("launch", [NOTHING_TO_STOP_BUT_STARTED], "cancelled after the stop (no server was running): the new server "
                                              "(pid 31) was started but not verified and not recorded"),
    ("launch", [STOPPED], "cancelled in the launch, after the stop (old server pid 20): the new server may have "
                          "been started"),
    ("launch", [STOPPED_AND_STARTED, {"pid": 31, "ready": True}],
     "cancelled after the new server (pid 31) answered, before verify ended: it serves but was not verified"),
    ("rollback", [STOPPED], "cancelled during the rollback: this host may serve nothing now"),
])
def test_a_cancel_note_says_what_the_results_seen_show(phase, results, words):
    note = run.cut_short(phase, "gpu-07", "cancelled", _seen(*results))
    assert note.startswith(words), note
    if phase != "preflight":
        assert "rerun playbooks/restart.yml -e target=gpu-07" in note


def test_a_cancel_note_names_the_lock_left_and_how_it_is_cleared():
    lock = {"run_id": "awx-4711", "lease_s": 300}
    note = run.cut_short("wait", "gpu-07", "cancelled", _seen(STOPPED_AND_STARTED), lock)
    assert note.endswith("The restart lock (run awx-4711) stays on the host: a rerun from this controller takes it "
                         "over at once (its pid is gone), one from elsewhere (a new AWX job) once its lease ends (300 s "
                         "after its last renewal), or at once after playbooks/unlock.yml -e target=gpu-07"), note
    assert run.cut_short("wait", "h", "cancelled", {}, False).endswith(". No restart lock was left")
    assert "restart lock" not in run.cut_short("wait", "h", "cancelled", {}, None)  # not known: no word
    assert "restart lock" not in run.cut_short("preflight", "h", "cancelled", {}, lock)
    assert run.cut_short("nonsense", "h") is None


def test_the_lock_a_run_holds_follows_the_lock_modules_results():
    lock = {"run_id": "r1", "lease_s": 300}
    held = run.lock_seen(None, {"result": "taken", "acquired": True, "lock": lock, "lease_s": 300})
    assert held == lock
    assert run.lock_seen(held, {"result": "renewed", "acquired": True, "lock": dict(lock, renewed_at=5),
                                         "lease_s": 300})["renewed_at"] == 5
    assert run.lock_seen(held, {"result": "released", "acquired": False, "lock": lock, "lease_s": 300}) \
        is False
    assert run.lock_seen(held, {"lock_release": {"result": "released"}}) is False
    # another run's lock refused us: we hold none (and nothing else changes what we know)
    assert run.lock_seen(None, {"result": "refused", "acquired": False, "lock": {"run_id": "other"},
                                         "lease_s": 300}) is None
    assert run.lock_seen(held, {"msg": "an unrelated result"}) == held
    assert run.lock_seen(held, "not a mapping") == held


def test_a_stop_that_found_nothing_but_started_the_new_server_is_seen_and_a_preview_is_not():
    seen = _seen(NOTHING_TO_STOP_BUT_STARTED)
    assert seen["stop_done"] and seen["new_pid"] == 31 and "stopped_at" not in seen
    assert _seen(PREVIEW) == {}
