"""The rollback's plan and report (plugins/plugin_utils/rollback.py), without Ansible: each note says what is true."""
import pathlib

import pytest
import yaml

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import rollback

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = "/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py"
RECORD = {"method": "process", "argv": ["python", "-m", "sglang.launch_server"], "port": 30000, "host": "127.0.0.1",
          "log_file": "/var/lib/gpufleet/sglang.log", "pid_file": "/var/lib/gpufleet/sglang.pid",
          "recorded_at": "2026-12-01T10:00:00Z", "nccl_env": {"NCCL_PROTO": "Simple"}}
HOST_WIDE = ["driver_not_loaded", "gpu_lost", "timeout"]


def read(record=None, reason=None, msg=None):
    out = {"launch_record": {"record": record, "reason": reason}}
    if msg:
        out = {"failed": True, "msg": msg}
    return out


def make_plan(record=RECORD, **kw):
    args = dict(phase="launch", stopped=True, enabled=True, error_class=None, host_wide_classes=HOST_WIDE,
                record_file="/var/lib/gpufleet/launch.json", old_pid=4242, stop_signalled=False,
                engine={"files": [{"path": ENGINE, "previous_file": "/state/engine.py.prev", "sha256": "a" * 64}]})
    args.update(kw)
    return rollback.plan(read(record), **args)


def facts(plan, **kw):
    out = {"plan": plan, "stopped": True, "server_ran": True, "old_pid": 4242, "stat": {}, "wait": {},
           "server_gpus": {}, "relaunch": {"pid": 0, "started": False, "log_offset": 0}, "workers": {},
           "record_file": "/var/lib/gpufleet/launch.json", "ready_path": "/health_generate", "ready_timeout_s": 900,
           "log_file": "/var/log/sglang.log", "host": "gpu-01"}
    out.update(kw)
    return out


def restored_stat():
    item = {"path": ENGINE, "previous_file": "/state/engine.py.prev", "sha256": "a" * 64}
    return {"results": [{"item": item, "stat": {"exists": True, "checksum": "b" * 64}}]}


# plan

def test_plan_relaunches_the_recorded_launch_when_a_gpufleet_server_was_stopped():
    plan = make_plan()
    assert plan["relaunch"] and plan["no_relaunch"] == ""
    assert plan["record"] == RECORD and plan["method"] == "process"
    assert plan["stop_new"] and plan["wait"] and plan["check_port"]
    assert plan["wait_step"] == rollback.WAIT


@pytest.mark.parametrize("kw, words", [
    ({"stopped": False}, "the old server was never stopped"),
    ({"enabled": "false"}, "gpufleet_rollback is false"),
    ({"phase": "wait", "error_class": "gpu_lost"}, "host-wide (GPU layer: gpu_lost)"),
    ({"record": {}}, "there is no launch record (/var/lib/gpufleet/launch.json)"),
    ({"old_pid": None}, "no server gpufleet started was running"),
    ({"old_pid": 0}, "no server gpufleet started was running"),
])
def test_plan_names_the_first_reason_not_to_relaunch(kw, words):
    plan = make_plan(**kw)
    assert words in plan["no_relaunch"]
    assert not plan["relaunch"] and not plan["wait"]


def test_a_never_stopped_server_outranks_every_other_reason():
    assert make_plan(stopped=False, enabled=False, record={}, old_pid=None)["no_relaunch"] == \
        "the old server was never stopped"


def test_a_host_wide_class_outside_the_wait_phase_still_relaunches():
    assert make_plan(phase="launch", error_class="gpu_lost")["relaunch"]


def test_a_refused_record_is_named_with_its_reason_and_file():
    plan = rollback.plan(read(msg="owned by uid 1000, not root"), record_file="/s/launch.json", old_pid=1)
    assert plan["no_relaunch"] == ("the launch record /s/launch.json was refused (owned by uid 1000, not root), so "
                                   "nothing in it was written or started: remove or fix that file")
    assert plan["record"] == {}


@pytest.mark.parametrize("phase, error_class, signalled, wait, step, port", [
    ("launch", None, False, True, rollback.WAIT, True),
    ("verify", None, False, True, rollback.WAIT, True),
    ("wait", "not_released", False, True, rollback.WAIT_AGAIN, True),
    ("wait", "field_unavailable", False, True, rollback.WAIT_REREAD, True),
    ("stop", None, True, True, rollback.WAIT_AFTER_FAILED_STOP, False),
    ("stop", None, False, False, rollback.WAIT_AFTER_FAILED_STOP, False),
])
def test_plan_picks_the_steps_for_the_phase_that_failed(phase, error_class, signalled, wait, step, port):
    plan = make_plan(phase=phase, error_class=error_class, stop_signalled=signalled)
    assert (plan["wait"], plan["wait_step"], plan["check_port"]) == (wait, step, port)
    assert plan["stop_new"] == (phase in ("launch", "verify"))


# the GPU wait

def test_a_wait_that_passed_or_was_skipped_lets_the_relaunch_go_on_without_a_note():
    assert rollback.wait_outcome({"changed": False}, {}) == {"relaunch": True, "note": ""}
    assert rollback.wait_outcome({"skipped": True}, {}) == {"relaunch": True, "note": ""}


def test_unreadable_memory_does_not_hold_the_relaunch_back_and_the_note_names_gpu_and_field():
    wait = {"failed": True, "error_class": "field_unavailable",
            "msg": "GPU 3: memory.used reads [N/A]. What to do: check the driver."}
    out = rollback.wait_outcome(wait, {})
    assert out["relaunch"]
    assert out["note"].startswith("GPU memory could not be read (GPU 3: memory.used reads [N/A])")


def test_memory_held_without_a_preflight_measure_stops_the_relaunch():
    wait = {"failed": True, "error_class": "not_released", "gpus": [{"index": 0, "memory_used_mib": 70000,
                                                                      "memory_total_mib": 143771}]}
    assert rollback.wait_outcome(wait, {}) == {"relaunch": False, "note": ""}


def test_memory_others_took_is_relaunched_beside_when_the_previous_server_fits():
    wait = {"failed": True, "error_class": "not_released",
            "gpus": [{"index": 0, "memory_used_mib": 20000, "memory_total_mib": 143771, "memory_reserved_mib": 0}]}
    server = {"gpus": [{"index": 0, "held_by_stop_set": True, "memory_used_mib": 90000}], "world_size": 1}
    out = rollback.wait_outcome(wait, server)
    assert out["relaunch"] and out["note"]


# relaunch and steps

def test_relaunched_reads_the_process_result_or_the_unit():
    assert rollback.relaunched("process", {"pid": 77, "started": True, "log_offset": 12}) == \
        {"pid": 77, "started": True, "log_offset": 12}
    assert rollback.relaunched("systemd", {"skipped": True}, {"changed": True}, {"status": {"MainPID": "88"}},
                               {"stat": {"size": 4096}}) == {"pid": 88, "started": True, "log_offset": 4096}
    assert rollback.relaunched(None) == {"pid": 0, "started": False, "log_offset": 0}


def test_every_task_of_rollback_yml_has_a_step_and_every_step_entry_a_task():
    tasks = yaml.safe_load((ROOT / "roles/sglang_launch/tasks/rollback.yml").read_text())
    names = set()

    def walk(items):
        for task in items or []:
            names.add(task.get("name", ""))
            for key in ("block", "rescue", "always"):
                walk(task.get(key))
    walk(tasks)
    block = {n[len(rollback.TASK_PREFIX):] for n in names if n.startswith(rollback.TASK_PREFIX)}
    blocks_and_rescue = {"undo and relaunch", "relaunch the previous server", "look once more at the relaunched server",
                         "report what the failed rollback left"}
    assert block - blocks_and_rescue == set(rollback.TASK_STEPS)


def test_a_failed_task_names_its_step():
    plan = make_plan(phase="wait", error_class="not_released")
    assert rollback.step_of("Rollback - wait until GPU memory is released", plan) == rollback.WAIT_AGAIN
    assert rollback.step_of("Rollback - put back the bytes from before this run", plan) == rollback.RESTORE
    assert rollback.step_of("Rollback - check that nothing listens on the port") == rollback.PORT
    # ready.yml's tasks: the relaunched server's readiness wait
    assert rollback.step_of("Wait until the launched server answers readiness on its own socket (/health)") == \
        rollback.READY


def test_truncate_cuts_at_a_word_like_jinja():
    assert rollback.truncate("a" * 305, 300) == "a" * 305
    assert rollback.truncate("word " * 100, 20) == "word word word..."


# report: the block ran to its end

def test_a_relaunch_that_serves_with_the_recorded_values_says_previous_configuration():
    workers = {"workers": [{"title": "TP0", "match": True}, {"title": "TP1", "match": True}]}
    out = rollback.report(facts(make_plan(), stat=restored_stat(), workers=workers,
                                relaunch={"pid": 5151, "started": True, "log_offset": 0}))
    assert out["state"] == "rolled_back" and out["pid"] == 5151
    assert out["detail"] == (
        "engine.py restored to its bytes from before this run (sha256 aaaaaaaaaaaa); the previous server was "
        "relaunched from /var/lib/gpufleet/launch.json (recorded 2026-12-01T10:00:00Z) as pid 5151 and answers "
        "/health_generate: the host serves the previous configuration (its 2 workers carry the recorded NCCL values).")


def test_workers_without_the_recorded_values_are_never_called_previous_configuration():
    workers = {"workers": [{"title": "TP0", "match": False, "missing": ["NCCL_PROTO"]}]}
    out = rollback.report(facts(make_plan(), workers=workers, relaunch={"pid": 5, "started": True}))
    assert "previous configuration" not in out["detail"]
    assert "1 of 1 workers lack them (TP0: missing NCCL_PROTO)" in out["detail"]


def test_a_wait_note_follows_the_file_note():
    wait = {"error_class": "field_unavailable", "msg": "GPU 1: memory.used reads [N/A]"}
    out = rollback.report(facts(make_plan(), wait=wait, relaunch={"pid": 5, "started": True}))
    assert out["detail"].startswith("no file changed by this run's NCCL patch; GPU memory could not be read (GPU 1")


def test_no_relaunch_reports_file_only_and_that_the_host_is_not_serving():
    out = rollback.report(facts(make_plan(record={}), stat=restored_stat()))
    assert out == {"state": "file_only", "pid": None, "detail": (
        "engine.py restored to its bytes from before this run (sha256 aaaaaaaaaaaa); the previous server was not "
        "relaunched: there is no launch record (/var/lib/gpufleet/launch.json): gpufleet never launched a server "
        "that passed verification on this host. The host is not serving (no SGLang server runs): fix the cause, "
        "then rerun playbooks/restart.yml -e target=gpu-01")}


def test_a_server_never_stopped_still_serves_and_the_note_names_its_pid():
    out = rollback.report(facts(make_plan(stopped=False), stopped=False))
    assert out == {"state": "not_needed", "pid": 4242, "detail": (
        "no file changed by this run's NCCL patch; the old server was never stopped (pid 4242): it still serves, "
        "with the engine.py it loaded when it started.")}


def test_nothing_stopped_and_no_server_before_says_it_most_likely_serves_nothing():
    out = rollback.report(facts(make_plan(stopped=False), stopped=False, server_ran=False, old_pid=None))
    assert out["state"] == "not_needed" and out["pid"] is None
    assert out["detail"].endswith("it most likely serves nothing.")
    assert "still serves" not in out["detail"]


def test_a_relaunch_that_found_the_server_running_is_not_needed():
    out = rollback.report(facts(make_plan(), relaunch={"pid": 4242, "started": False}))
    assert out == {"state": "not_needed", "pid": 4242, "detail": (
        "the previous server (pid 4242) still runs and answers /health_generate; no file changed by this run's NCCL "
        "patch.")}


# report: the rescue

def failure(task, msg="boom\nsecond line", look=None, **result):
    return {"task": task, "result": dict(msg=msg, **result), "look": look or {"skipped": True}}


def test_a_failed_port_check_says_the_port_was_taken_and_keeps_the_wait_note():
    wait = {"error_class": "field_unavailable", "msg": "GPU 1: memory.used reads [N/A]"}
    out = rollback.report(facts(make_plan(), stat=restored_stat(), wait=wait),
                          failure("Rollback - check that nothing listens on the port", "port 30000 is taken by nc"))
    assert out["state"] == "failed" and out["pid"] is None
    assert out["detail"].startswith(
        "rollback failed while checking the port before relaunching: port 30000 is taken by nc. engine.py restored")
    assert "; GPU memory could not be read (GPU 1" in out["detail"]
    assert "it could not bind a taken port. The host is not serving. Fix the cause named here, then rerun " \
           "playbooks/restart.yml -e target=gpu-01. Server log: /var/lib/gpufleet/sglang.log." in out["detail"]


def test_a_failed_wait_names_its_own_step_and_no_wait_note():
    wait = {"failed": True, "error_class": "not_released", "msg": "GPU 0 held"}
    plan = make_plan(phase="wait", error_class="not_released")
    out = rollback.report(facts(plan, stat=restored_stat(), wait=wait),
                          failure("Rollback - wait until GPU memory is released", "GPU 0: 70000 MiB held by pid 9"))
    assert out["detail"].startswith("rollback failed while waiting once more for the GPU memory the wait found "
                                    "held: GPU 0: 70000 MiB held by pid 9. engine.py restored")
    assert "reset the GPUs with nvidia-smi -r" in out["detail"]


def test_a_failed_copy_says_which_files_may_still_hold_the_patch():
    out = rollback.report(facts(make_plan(), stat=restored_stat()),
                          failure("Rollback - put back the bytes from before this run", "Read-only file system"))
    assert out["detail"] == (
        "rollback failed while restoring engine.py: Read-only file system. no file changed by this run's NCCL patch. "
        "engine.py may still hold this run's patch (the pre-run bytes are in /state/engine.py.prev); the previous "
        "server was not relaunched. The host is not serving. Fix the cause named here, then rerun "
        "playbooks/restart.yml -e target=gpu-01. Server log: /var/lib/gpufleet/sglang.log.")


def test_a_relaunch_that_answers_the_last_look_is_rolled_back():
    out = rollback.report(facts(make_plan(), relaunch={"pid": 99, "started": True}),
                          failure("Wait until the launched server answers readiness", "lock taken over",
                                  look={"ready": True}))
    assert out["state"] == "rolled_back" and out["pid"] == 99
    assert "Its readiness wait ended without an answer (lock taken over), but a last look saw it answer " \
           "/health_generate on its own socket: the host serves the previous argv and environment; its workers' " \
           "NCCL values could not be read." in out["detail"]


def test_a_relaunch_still_loading_is_relaunched_loading_not_down():
    out = rollback.report(facts(make_plan(), relaunch={"pid": 99, "started": True}),
                          failure("Wait until the launched server answers readiness", "timed out", running=True,
                                  last="503", look={"ready": False, "running": True}))
    assert out["state"] == "relaunched_loading" and out["pid"] == 99
    assert "did not answer /health_generate within sglang_launch_ready_timeout_s (900 s; last: 503). It is most " \
           "likely still loading" in out["detail"]
    assert "not serving" not in out["detail"].split("It is most likely")[0]


def test_a_relaunch_that_died_says_the_host_is_not_serving_now():
    out = rollback.report(facts(make_plan(), relaunch={"pid": 99, "started": True}),
                          failure("Wait until the launched server answers readiness", "exited with 1",
                                  look={"ready": False, "running": False}))
    assert out["state"] == "failed"
    assert "The relaunched server (pid 99) did not answer /health_generate. The host is not serving now." \
        in out["detail"]
