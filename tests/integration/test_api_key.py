"""sglang_api_key against the lab fleet: the restart passes SGLang's --api-key without it showing anywhere.

The lab stand-in enforces --api-key like SGLang 0.5.23 (srt/utils/auth.py): 401 without
"Authorization: Bearer <key>" on every path except /health*, /ready*, /metrics*. Asserted: restart.yml with
the key as an extra var succeeds on one host (so verify's POST /generate sent the bearer), no ansible-runner
event (stdout or event_data, as AWX stores them) contains the key, and the new server refuses a request
without it; api-key inside sglang_launch_args is refused by preflight before anything is stopped. Issue 31: a keyed
restart over a keyed server, a failed keyed launch and check.yml leave the key in no artifact, report or state file
but the server log, which is 0640.
"""
import json
import os
import secrets

import pytest

from test_restart import FAST, PLAYBOOK, alive, ensure_serving, server_pid, stdout_of

pytestmark = pytest.mark.lab

# Run inside a lab host: status code of one HTTP request (argv: method url [bearer]).
HTTP_STATUS = r"""
import sys, urllib.error, urllib.request
method, url = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, method=method, data=b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'
                             if method == "POST" else None, headers={"Content-Type": "application/json"})
if len(sys.argv) > 3:
    req.add_header("Authorization", "Bearer " + sys.argv[3])
try:
    print(urllib.request.urlopen(req, timeout=30).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def real_stops(lab, runner):
    """sglang_stop events of the rolling play: preflight also runs the module, in check mode, to list the stop set."""
    return [d for d in lab.events(runner, "runner_on_ok", "sglang_stop") if not d.get("play", "").startswith("Preflight")]


@pytest.fixture(scope="module", autouse=True)
def host_left_as_found(lab):
    """The lab is shared: a host that ran no server before these tests runs none after them."""
    host = lab.hosts[0]
    pid = server_pid(lab, host)
    was_serving = bool(pid and alive(lab, host, pid))
    yield
    if not was_serving:
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop,wait")
        assert runner.status == "successful", stdout_of(runner)[-3000:]


def http_status(lab, host, method, path, key=None):
    hv = lab.host_vars(host)
    url = "http://%s:%d%s" % (hv.get("sglang_host", "127.0.0.1"), int(hv.get("sglang_port", 30000)), path)
    argv = [lab.host_vars(host)["sglang_python"], "-c", HTTP_STATUS, method, url] + ([key] if key else [])
    return int(lab.exec(host, argv, check=True).stdout.strip())


def cmdline(lab, host, pid):
    return lab.exec(host, ["cat", "/proc/%d/cmdline" % pid], check=True).stdout.split("\0")


def test_restart_with_api_key_never_shows_it_and_the_server_demands_it(lab):
    host = lab.hosts[0]
    before = ensure_serving(lab, [host])[host]
    key = "sk-gpufleet-" + secrets.token_hex(16)
    try:
        # The throughput smoke too: its module sends the bearer as well (a lax regression bound: not under test).
        smoke = dict(sglang_verify_throughput=True, sglang_verify_throughput_requests=4,
                     sglang_verify_throughput_max_new_tokens=8, sglang_verify_max_regression_fraction=0.99)
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_api_key=key, **smoke), limit=host, diff=True)
        out = stdout_of(runner)
        assert runner.status == "successful", out[-4000:]
        new = server_pid(lab, host)
        assert new and new != before and not alive(lab, host, before)
        # The key reached SGLang (the module appended it) ...
        # (the stand-in retitles itself like SGLang's main process keeps its argv: one string with spaces)
        assert ("--api-key " + key) in " ".join(cmdline(lab, host, new))
        # ... and verify's generation went through with the bearer.
        verified = [d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_process")
                    if d["host"] == host and "in a burst, read every GPU worker" in d.get("task", "")]
        assert verified and verified[0]["generate"]["status"] == 200, verified
        # The key is a no_log option: where the result carries the task's arguments (ansible-core 2.19; 2.21 leaves
        # them out), they show it masked.
        shown = verified[0].get("invocation", {}).get("module_args", {}).get("api_key")
        assert shown in (None, "VALUE_SPECIFIED_IN_NO_LOG_PARAMETER"), shown
        assert lab.events(runner, "runner_on_ok", "sglang_process"), "the process method launched"
        assert host in lab.ok_hosts(runner, task_action="sglang_generate_bench")
        # No event, as AWX stores it, holds the key: search every event's whole JSON and the stdout.
        leaks = [ev.get("event") + ":" + str(ev.get("event_data", {}).get("task"))
                 for ev in runner.events if key in json.dumps(ev)]
        assert leaks == []
        assert key not in out
        # The new server enforces it; readiness paths stay open, as in SGLang.
        assert http_status(lab, host, "POST", "/generate") == 401
        assert http_status(lab, host, "POST", "/generate", key="wrong-" + key) == 401
        assert http_status(lab, host, "POST", "/generate", key=key) == 200
        assert http_status(lab, host, "GET", "/health_generate") == 200
        # The launch history (issue 34) says a key was set, never which.
        history = lab.exec(host, ["cat", lab.host_vars(host)["sglang_state_dir"] + "/history.jsonl"], check=True).stdout
        assert key not in history and json.loads(history.splitlines()[-1])["api_key_set"] is True
    finally:
        # Leave the host as the other tests expect it: a server without a key.
        restore = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert restore.status == "successful", stdout_of(restore)[-3000:]


@pytest.mark.lab_only_once
def test_verify_without_the_key_names_sglang_api_key(lab):
    host = lab.hosts[0]
    key = "sk-gpufleet-" + secrets.token_hex(16)
    try:
        started = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_api_key=key), limit=host)
        assert started.status == "successful", stdout_of(started)[-3000:]
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="verify")
        assert runner.status == "failed"
        text = json.dumps([d.get("res", {}).get("msg", "") for d in lab.events(runner, "runner_on_failed")])
        assert "401" in text and "sglang_api_key" in text, text[:2000]
    finally:
        restore = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert restore.status == "successful", stdout_of(restore)[-3000:]


def test_preflight_refuses_api_key_in_launch_args_and_stops_nothing(lab):
    host = lab.hosts[0]
    before = ensure_serving(lab, [host])[host]
    key = "sk-gpufleet-" + secrets.token_hex(16)
    launch_args = lab.launch_args_expr({"api-key": key})
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_launch_args=launch_args), limit=host)
    assert runner.status == "failed", stdout_of(runner)[-3000:]
    text = json.dumps([d.get("res", {}).get("msg", "") for d in lab.events(runner, "runner_on_failed")])
    assert "api-key in sglang_launch_args" in text and "set sglang_api_key" in text, text[:3000]
    assert key not in text, "the refusal must not repeat the key"
    assert real_stops(lab, runner) == []
    assert alive(lab, host, before), "preflight refused, yet the server was stopped"


def files_holding(root, text):
    """Every file under ``root`` (controller side) whose bytes hold ``text``."""
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as handle:
                if text.encode() in handle.read():
                    found.append(os.path.relpath(path, root))
    return sorted(found)


def host_files_holding(lab, host, directory, text):
    """Every file under ``directory`` on ``host`` that holds ``text`` (grep -rlF, as the host's root)."""
    res = lab.exec(host, ["grep", "-rlF", "--", text, directory])
    return sorted(res.stdout.split())


def mode_of(lab, host, path):
    return int(lab.exec(host, ["stat", "-c", "%a", path], check=True).stdout.strip(), 8)


@pytest.mark.lab_only_once
def test_the_key_is_in_no_artifact_report_or_state_file_only_in_the_0640_server_log(lab, tmp_path):
    # Issue 31: a keyed restart over a keyed server (preflight's host read the listener's one-string title: the key
    # was at event_data.res.port.listeners[0].cmdline[0]), check.yml against it, a failed keyed launch whose log
    # tail is shown with the key masked.
    host = lab.hosts[0]
    hv = lab.host_vars(host)
    state = hv["sglang_state_dir"]
    key = "sk-gpufleet-" + secrets.token_hex(16)
    keyed = dict(FAST, sglang_api_key=key)
    runners = []
    try:
        for extra in ({}, {"cmdline": "-vvv"}):  # first keyed, then over the keyed server (verbose, as -vvv)
            if extra:  # a log an earlier release left world-readable: the start tightens it
                lab.exec(host, ["chmod", "0644", state + "/sglang.log"], check=True)
            runner = lab.run_playbook(PLAYBOOK, extravars=keyed, limit=host, **extra)
            assert runner.status == "successful", stdout_of(runner)[-3000:]
            runners.append(runner)
        pid = server_pid(lab, host)
        assert ("--api-key " + key) in " ".join(cmdline(lab, host, pid)), "the keyed server serves"
        listeners = [d["res"]["host"]["port"]["listeners"]
                     for d in lab.events(runners[1], "runner_on_ok", "sglang_preflight_info")
                     if d["host"] == host and ((d.get("res") or {}).get("host") or {}).get("port")]
        assert listeners and "--api-key ********" in json.dumps(listeners), listeners  # the title was read, redacted
        report = tmp_path / "report"
        check = lab.run_playbook("playbooks/check.yml", limit=host, extravars={
            "gpufleet_report_dir": str(report), "gpufleet_textfile_dir": "{{ lab_host_dir }}/textfile"})
        assert check.status == "successful", stdout_of(check)[-3000:]
        assert sorted(os.listdir(report)) == ["check.html", "check.json"]
        runners.append(check)
        # Only the changed launch crashes: the rollback brings the keyed server back (its pid file then exists).
        args = dict(hv["sglang_launch_args"], **{"max-running-requests": 77})
        lab.fault(host, crash_with_arg="--max-running-requests")
        try:
            failed = lab.run_playbook(PLAYBOOK, extravars=dict(keyed, sglang_launch_args=args), limit=host)
        finally:
            lab.clear_faults(host)
        assert failed.status == "failed"
        assert ("--api-key " + key) in " ".join(cmdline(lab, host, server_pid(lab, host))), "rolled back, keyed"
        [tail] = [d["res"]["msg"] for d in lab.events(failed, "runner_on_ok", "debug")
                  if d["task"] == "Show the end of the server log"]
        assert any("api_key='********'" in line for line in tail), tail  # the stand-in logs server_args as SGLang
        runners.append(failed)
        # Every artifact ansible-runner wrote (job_events/*.json, stdout, status, the command), every report.
        for runner in runners:
            assert files_holding(runner.config.artifact_dir, key) == [], runner.config.artifact_dir
        assert files_holding(str(report), key) == []
        assert host_files_holding(lab, host, hv["lab_host_dir"] + "/textfile", key) == []
        # On the host: only the server log (SGLang logs server_args with the key), owner and group only.
        log = state + "/sglang.log"
        assert host_files_holding(lab, host, state, key) == [log]
        modes = {name: mode_of(lab, host, state + "/" + name)
                 for name in ("sglang.log", "sglang.pid", "launch.json", "history.jsonl")}
        assert all(mode & 0o027 == 0 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}
    finally:
        restore = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert restore.status == "successful", stdout_of(restore)[-3000:]
