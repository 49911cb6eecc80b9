"""roles/sglang_verify/tasks/findings.yml in a real ansible-playbook run on a local host (no lab), on canned
results of sglang_process state=verified: the facts it sets and the one assert's message, which names every
failed part once."""
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FINDINGS = ROOT / "roles" / "sglang_verify" / "tasks" / "findings.yml"

PLAYBOOK = """
- hosts: all
  gather_facts: false
  vars:
    _sglang_verify_url: http://127.0.0.1:30000
    _sglang_verify_port: 30000
    sglang_verify_min_workers: 2
    sglang_verify_throughput: false
  tasks:
    - name: Judge
      ansible.builtin.import_tasks: %s
    - name: Show the facts
      ansible.builtin.debug:
        msg:
          generate_ok: "{{ sglang_verify_generate_ok }}"
          nccl_ok: "{{ sglang_verify_nccl_ok }}"
          owner_ok: "{{ sglang_verify_owner_ok }}"
""" % FINDINGS

WORKER_OK = {"title": "sglang::scheduler_TP0", "pid": 11, "match": True, "missing": [], "mismatched": {}}
WORKER_BAD = {"title": "sglang::scheduler_TP1", "pid": 12, "match": False, "missing": ["NCCL_PROTO"],
              "mismatched": {}}
GOOD = {"generate": {"status": 200, "json": {"text": " Paris."}, "msg": "OK"},
        "workers": {"workers": [WORKER_OK, dict(WORKER_OK, title="sglang::scheduler_TP1", pid=12)],
                    "worker_count": 2, "all_match": True},
        "owner": {"ready": True, "pid": 10, "msg": "pid 10 runs and answered on its own socket"}}


def _run(tmp_path, look, cmdline=None):
    """(rc, {task name: its result}) of one run through ansible-runner (its events carry every result)."""
    import ansible_runner
    local = dict(ansible_connection="local", ansible_python_interpreter=sys.executable, _sglang_verify_look=look)
    (tmp_path / "inv.json").write_text(json.dumps({"all": {"hosts": {"h1": local}}}))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}
    pd = tmp_path / ("pd%d" % len(list(tmp_path.glob("pd*"))))
    pd.mkdir()
    runner = ansible_runner.run(private_data_dir=str(pd), project_dir=str(ROOT),
                                playbook=str(tmp_path / "play.yml"), inventory=str(tmp_path / "inv.json"),
                                envvars=env, quiet=True, cmdline=cmdline)
    tasks = {ev["event_data"]["task"]: ev["event_data"]["res"] for ev in runner.events
             if ev.get("event") in ("runner_on_ok", "runner_on_failed")}
    return runner.rc, tasks


def test_a_verified_server_passes_and_every_fact_is_true(tmp_path):
    rc, tasks = _run(tmp_path, GOOD)
    assert rc == 0, tasks
    assert tasks["Show the facts"]["msg"] == {"generate_ok": True, "nccl_ok": True, "owner_ok": True}
    report = tasks["Report every worker"]["msg"]
    assert report == "POST /generate gave 7 characters of text; 2/2 GPU workers carry the configured NCCL values"


def test_a_server_that_is_gone_is_named_once_and_the_nccl_verdict_is_unknown(tmp_path):
    gone = "pid 10 exited with code 1 (see the server log)"
    look = {"generate": {"status": None, "json": None, "msg": "connection refused"},
            "workers": {"workers": [], "worker_count": 0, "all_match": False, "server_pid": None,
                        "msg": "server pid 10 is not running"},
            "owner": {"ready": False, "pid": 10, "msg": gone}}
    rc, tasks = _run(tmp_path, look)
    msg = tasks["The server generates, every worker carries the NCCL values, and the launched server owns the port"]["msg"]
    assert rc == 2, tasks
    assert msg.startswith("POST http://127.0.0.1:30000/generate answered ? without generated text (connection refused)")
    assert msg.count(gone) == 1 and "No GPU worker was read: server pid 10 is not running." in msg, msg
    assert "  " not in msg and "After verification" not in msg, msg
    # No worker could be looked for: the summary's NCCL column must not say the patch failed.
    assert tasks["Report every worker"]["msg"] == ("POST /generate gave no text (below); no GPU worker read: server pid 10 "
                                                   "is not running")
    # Generated (e.g. by a stranger on the port), then gone: the look names it after the workers' part.
    rc, tasks = _run(tmp_path, dict(look, generate=GOOD["generate"]))
    msg = tasks["The server generates, every worker carries the NCCL values, and the launched server owns the port"]["msg"]
    assert rc == 2 and msg == ("No GPU worker was read: server pid 10 is not running. After verification on h1: "
                               + gone + " (the answers above do not prove the launched server serves)."), msg


def test_every_failed_part_is_named_with_its_remedy(tmp_path):
    look = dict(GOOD, generate={"status": 401, "json": {"error": "Unauthorized"}, "msg": "HTTP Error 401"},
                workers={"workers": [WORKER_OK, WORKER_BAD], "worker_count": 2, "all_match": False})
    rc, tasks = _run(tmp_path, look)
    msg = tasks["The server generates, every worker carries the NCCL values, and the launched server owns the port"]["msg"]
    assert rc == 2
    assert "answered 401 without generated text" in msg and "set sglang_api_key" in msg, msg
    assert "Workers without the configured NCCL values: sglang::scheduler_TP1." in msg, msg
    assert "After verification" not in msg, msg
    report = tasks["Report every worker"]["msg"]
    assert report == ("POST /generate gave no text (below); 1/2 GPU workers carry the configured NCCL values; sglang::scheduler_TP1 (pid 12) missing "
                      "NCCL_PROTO, mismatched {}"), report


def test_check_mode_says_the_report_is_of_the_server_that_runs_now_and_asserts_nothing(tmp_path):
    look = dict(GOOD, workers={"workers": [WORKER_OK, WORKER_BAD], "worker_count": 2, "all_match": False})
    rc, tasks = _run(tmp_path, look, cmdline="--check")
    assert rc == 0, tasks
    report = tasks["Report every worker"]["msg"]
    assert report.startswith("check mode, so this is the server that runs now, not restarted") and "1/2" in report


VERIFY_ASSERT = "The server generates, every worker carries the NCCL values, and the launched server owns the port"
BURST_HUNG = {"ok": False, "requests": 32, "concurrency": 8, "answered": 5, "timed_out": 8, "connection_errors": 0,
              "http_errors": {}, "not_sent": 19, "wall_s": 3.2, "slowest_ms": 40, "first_error": "no answer within 3 s",
              "timeout_s": 3.0,
              "msg": "5 of 32 answered in 3.2 s (8 at a time); 8 got no answer within 3 s; 19 not sent after the "
                     "first request without an answer"}


def test_a_burst_that_got_5_of_32_answers_fails_verification_naming_the_counts(tmp_path):
    rc, tasks = _run(tmp_path, dict(GOOD, burst=BURST_HUNG))
    msg = tasks[VERIFY_ASSERT]["msg"]
    assert rc == 2
    assert msg.startswith("POST http://127.0.0.1:30000/generate burst after the single generation: 5 of 32 answered "
                          "in 3.2 s (8 at a time); 8 got no answer within 3 s;"), msg
    assert "sglang_verify_burst_requests=0 turns this check off" in msg and "NCCL" not in msg, msg


def test_a_full_burst_passes_and_is_named_in_the_success_line_and_a_skipped_one_adds_no_failure(tmp_path):
    full = dict(BURST_HUNG, ok=True, answered=32, timed_out=0, not_sent=0, msg="32 of 32 answered in 0.4 s (8 at a time)")
    rc, tasks = _run(tmp_path, dict(GOOD, burst=full))
    assert rc == 0, tasks
    assert "burst: 32 of 32 answered in 0.4 s (8 at a time);" in tasks[VERIFY_ASSERT]["msg"]
    skipped = {"skipped": True, "ok": None, "msg": "not sent: the single generation failed first"}
    rc, tasks = _run(tmp_path, dict(GOOD, generate={"status": None, "json": None, "msg": "timed out"}, burst=skipped))
    msg = tasks[VERIFY_ASSERT]["msg"]
    assert rc == 2 and "answered ? without generated text (timed out)" in msg and "burst" not in msg, msg
