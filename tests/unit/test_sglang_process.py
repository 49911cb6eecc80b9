"""sglang_process: detached start with pid file and log file, idempotence, early-exit failure."""
import importlib.util
import json
import os
import pathlib
import signal
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sglang_process", ROOT / "plugins" / "modules" / "sglang_process.py")
proc_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proc_mod)
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_process_states as states  # noqa: E402
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_spawn as spawn  # noqa: E402


def run_main(args, capsys):
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args(args):
        with pytest.raises(SystemExit) as exc:
            proc_mod.main()
    return exc.value.code, json.loads(capsys.readouterr().out)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_starts_in_own_session_with_env_log_and_pid_file(tmp_path, capsys):
    code = "import os,sys,time;print('NCCL_PROTO='+os.environ['NCCL_PROTO'],os.getsid(0),flush=True);time.sleep(30)"
    args = {"argv": [sys.executable, "-c", code], "env": {"NCCL_PROTO": "LL", "FLAG": True},
            "log_file": str(tmp_path / "s.log"), "pid_file": str(tmp_path / "s.pid"), "startup_check_s": 0.5,
            "chdir": str(tmp_path)}
    rc, result = run_main(args, capsys)
    try:
        assert rc == 0 and result["changed"] and result["started"]
        pid = result["pid"]
        assert (tmp_path / "s.pid").read_text() == "%d\n" % pid
        assert os.getsid(pid) == pid, "must lead its own session (no SIGHUP from the SSH session)"
        for _ in range(50):
            if (tmp_path / "s.log").read_text():
                break
            time.sleep(0.1)
        assert (tmp_path / "s.log").read_text().split() == ["NCCL_PROTO=LL", str(pid)]
        # second run: already running, nothing started
        rc, again = run_main(args, capsys)
        assert rc == 0 and again["changed"] is False and again["pid"] == pid
    finally:
        _kill_group(result["pid"])


def test_fails_with_log_tail_when_process_exits_at_once(tmp_path, capsys):
    code = "import sys;print('error: unrecognized arguments: --tp-sise');sys.exit(2)"
    rc, result = run_main({"argv": [sys.executable, "-c", code], "log_file": str(tmp_path / "s.log"),
                           "pid_file": str(tmp_path / "s.pid"), "startup_check_s": 3}, capsys)
    assert rc == 1 and result["failed"]
    assert "exited with status 2" in result["msg"] and str(tmp_path / "s.log") in result["msg"]
    assert "unrecognized arguments: --tp-sise" in result["log_tail"]
    assert not (tmp_path / "s.pid").exists()


def test_check_mode_starts_nothing(tmp_path, capsys):
    rc, result = run_main({"argv": [sys.executable, "-c", "pass"], "log_file": str(tmp_path / "s.log"),
                           "pid_file": str(tmp_path / "s.pid"), "_ansible_check_mode": True}, capsys)
    assert rc == 0 and result["changed"] and result["pid"] is None
    assert not (tmp_path / "s.pid").exists() and not (tmp_path / "s.log").exists()


def test_missing_state_dir_is_a_clear_error(tmp_path, capsys):
    rc, result = run_main({"argv": ["/bin/true"], "log_file": str(tmp_path / "nope" / "s.log"),
                           "pid_file": str(tmp_path / "s.pid")}, capsys)
    assert rc == 1 and "create sglang_state_dir first" in result["msg"]


def test_stale_pid_file_does_not_count_as_running(tmp_path):
    pid_file = tmp_path / "s.pid"
    pid_file.write_text("%d\n" % os.getpid())
    os.utime(pid_file, (time.time() - 3600 * 24 * 365, time.time() - 3600 * 24 * 365))
    assert states.running_pid(str(pid_file)) is None  # this process started after that mtime
    os.utime(pid_file, None)
    assert states.running_pid(str(pid_file)) == os.getpid()


def test_build_env_overrides_and_removes():
    env = spawn.build_env({"A": 1, "B": None, "C": False}, True, base={"B": "x", "PATH": "/bin"})
    assert env == {"A": "1", "C": "0", "PATH": "/bin"}
    assert spawn.build_env({"A": "v"}, False, base={"PATH": "/bin"}) == {"A": "v"}


def test_api_key_reaches_the_process_argv_but_never_the_task_result(tmp_path, capsys):
    key = "sk-gpufleet-unit-7f3a9c"
    # The "server" echoes its last two arguments and the key alone, and dies, so the failure message quotes the log
    # tail: the redaction (gpufleet_redact) hides the flag's value, Ansible's no_log masking the bare key.
    code = "import sys;print('started with ' + ' '.join(sys.argv[-2:]), sys.argv[-1], flush=True);sys.exit(2)"
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args({"argv": [sys.executable, "-c", code], "api_key": key,
                            "log_file": str(tmp_path / "s.log"), "pid_file": str(tmp_path / "s.pid"),
                            "startup_check_s": 3}):
        with pytest.raises(SystemExit):
            proc_mod.main()
    out = capsys.readouterr().out
    assert (tmp_path / "s.log").read_text().split() == ["started", "with", "--api-key", key, key]
    result = json.loads(out)
    assert result["failed"] and "started with --api-key ********" in result["log_tail"], "the tail is in the failure"
    assert key not in out, "the no_log api_key must be masked in the module's JSON result"
    assert "--api-key" not in result["argv"]


def test_with_api_key_appends_only_a_non_empty_key():
    assert spawn.with_api_key(["sglang", "serve"], "k") == ["sglang", "serve", "--api-key", "k"]
    assert spawn.with_api_key(["sglang", "serve"], None) == ["sglang", "serve"]
    assert spawn.with_api_key(["sglang", "serve"], "") == ["sglang", "serve"]


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


HTTP_SERVER = ("import http.server,sys,time;time.sleep(%f);print('Load weight end',flush=True)\n"
               "class H(http.server.BaseHTTPRequestHandler):\n"
               "    def do_GET(self):\n"
               "        self.send_response(200); self.end_headers()\n"
               "    def log_message(self, *a):\n"
               "        pass\n"
               "http.server.HTTPServer(('127.0.0.1',%d),H).serve_forever()\n")


def _start(tmp_path, capsys, code, **extra):
    args = {"argv": [sys.executable, "-c", code], "log_file": str(tmp_path / "s.log"),
            "pid_file": str(tmp_path / "s.pid"), "startup_check_s": 0.1}
    args.update(extra)
    return run_main(args, capsys)


def _ready(tmp_path, capsys, started, port, **extra):
    args = {"state": "ready", "pid": started["pid"], "pid_file": str(tmp_path / "s.pid"),
            "log_file": str(tmp_path / "s.log"), "log_offset": started["log_offset"], "port": port,
            "url": "http://127.0.0.1:%d/health_generate" % port, "timeout_s": 60, "slice_s": 5,
            "poll_interval_ms": 50}
    args.update(extra)
    return run_main(args, capsys)


def test_server_runs_under_a_reaper_that_records_its_exit_status(tmp_path, capsys):
    rc, started = _start(tmp_path, capsys, "import time;time.sleep(30)")
    assert rc == 0 and started["exit_file"] == str(tmp_path / "s.pid.exit")
    import psutil
    parent = psutil.Process(started["pid"]).parent()
    assert parent.name() == "gpufleet-reaper" and os.getsid(parent.pid) == parent.pid != os.getsid(0)
    os.kill(started["pid"], signal.SIGTERM)
    assert _wait_for(lambda: (tmp_path / "s.pid.exit").exists())
    record = json.loads((tmp_path / "s.pid.exit").read_text())
    assert record["pid"] == started["pid"] and record["returncode"] == -signal.SIGTERM
    assert states.read_exit_file(str(tmp_path / "s.pid.exit"), started["pid"] + 1) is None
    assert _wait_for(lambda: not psutil.pid_exists(parent.pid) or parent.status() == psutil.STATUS_ZOMBIE)


def test_start_refuses_a_taken_port_naming_its_holder_and_starts_nothing(tmp_path, capsys):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, result = _start(tmp_path, capsys, "import time;time.sleep(30)", port=port, host="0.0.0.0")
    assert rc == 1 and result["pid"] is None and not (tmp_path / "s.pid").exists()
    assert "port %d taken by pid %d" % (port, os.getpid()) in result["msg"]
    assert "before launch" in result["msg"] and result["listeners"][0]["pid"] == os.getpid()


def test_port_free_names_the_holder_or_passes(tmp_path, capsys):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, result = run_main({"state": "port_free", "port": port}, capsys)
        assert rc == 1 and "pid %d" % os.getpid() in result["msg"]
    rc, result = run_main({"state": "port_free", "port": port}, capsys)
    assert rc == 0 and result["listeners"] == [] and not result["changed"]


def test_ready_slice_returns_progress_while_the_server_loads(tmp_path, capsys):
    port = _free_port()
    (tmp_path / "s.log").write_text("an earlier run's line\n")
    code = "import time;print('Load weight begin',flush=True);time.sleep(30)"
    rc, started = _start(tmp_path, capsys, code)
    try:
        assert started["log_offset"] == len("an earlier run's line\n")
        t0 = time.monotonic()
        rc, result = _ready(tmp_path, capsys, started, port, slice_s=1)
        assert rc == 0 and result["ready"] is False and not result.get("failed")
        assert result["running"] is True  # the rollback's last look reads this: it may still come up
        assert 0.8 <= time.monotonic() - t0 < 5
        assert result["progress"].startswith("waiting for /health_generate on 127.0.0.1:%d (pid %d): "
                                             % (port, started["pid"]))
        assert "of 60 s, last: connection refused; log: 'Load weight begin'" in result["progress"]
    finally:
        _kill_group(started["pid"])


def test_ready_fails_at_once_with_exit_code_and_only_this_launchs_log(tmp_path, capsys):
    port = _free_port()
    (tmp_path / "s.log").write_text("Traceback from an earlier run\n")
    code = "import sys,time;time.sleep(0.5);print('RuntimeError: scheduler failed while loading',flush=True);sys.exit(3)"
    rc, started = _start(tmp_path, capsys, code)
    t0 = time.monotonic()
    rc, result = _ready(tmp_path, capsys, started, port, slice_s=10)
    assert rc == 1 and result["rc"] == 3 and time.monotonic() - t0 < 5
    lived = float(result["msg"].split("exited with status 3 ", 1)[1].split(" s after", 1)[0])
    assert 0.4 <= lived < 5, result["msg"]
    assert result["elapsed_s"] == lived  # how long it ran, as the message says
    assert "exited with status 3" in result["msg"] and "within" not in result["msg"]
    assert "running" not in result
    assert "scheduler failed while loading" in result["log_tail"]
    assert "earlier run" not in result["log_tail"] and "earlier run" not in result["msg"]


def test_ready_failures_first_line_stands_alone_with_how_the_log_ends(tmp_path, capsys):
    # The launch role and restart.yml's summary quote only the first line: it must not end in "log:" with the
    # lines it announces left behind.
    port = _free_port()
    code = "import sys;print('Load weight begin',flush=True);print('RuntimeError: scheduler failed',flush=True);sys.exit(1)"
    rc, started = _start(tmp_path, capsys, code)
    rc, died = _ready(tmp_path, capsys, started, port)
    first, rest = died["msg"].split("\n", 1)
    assert rc == 1 and first.endswith("answered. Its log ends: 'RuntimeError: scheduler failed'."), first
    assert rest.startswith("Last lines of this launch's log:\nLoad weight begin\nRuntimeError: scheduler failed\n")
    assert rest.endswith("Full log: %s" % (tmp_path / "s.log"))
    rc, started = _start(tmp_path, capsys, "import time;print('still loading',flush=True);time.sleep(30)")
    try:
        rc, late = _ready(tmp_path, capsys, started, port, timeout_s=1, slice_s=5)
    finally:
        _kill_group(started["pid"])
    first, rest = late["msg"].split("\n", 1)
    assert rc == 1 and first.endswith("or read the log %s." % (tmp_path / "s.log")), first
    assert rest == "Last lines of this launch's log:\nstill loading"


def test_ready_names_the_port_holder_when_the_server_died_on_eaddrinuse(tmp_path, capsys):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = ("import socket,sys;s=socket.socket()\ntry:\n    s.bind(('127.0.0.1',%d))\nexcept OSError as e:\n"
                "    print('ERROR: [Errno 98] error while attempting to bind', flush=True);sys.exit(1)\n" % port)
        rc, started = _start(tmp_path, capsys, code, startup_check_s=0)
        # (while it still loads, the same call fails naming the stranger: see the test below)
        assert _wait_for(lambda: (tmp_path / "s.pid.exit").exists())
        rc, result = _ready(tmp_path, capsys, started, port)
    assert rc == 1 and result["rc"] == 1
    assert "Port %d is held by pid %d" % (port, os.getpid()) in result["msg"]
    assert "Errno 98" in result["log_tail"] and "within" not in result["msg"]


def test_ready_refuses_an_answer_from_a_listener_outside_the_servers_tree(tmp_path, capsys):
    import http.server
    import threading
    stray = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    port = stray.server_address[1]
    rc, started = _start(tmp_path, capsys, "import time;time.sleep(30)")  # fork before the thread starts
    threading.Thread(target=stray.serve_forever, daemon=True).start()
    try:
        rc, result = _ready(tmp_path, capsys, started, port)
        assert rc == 1 and result["ready"] is False
        assert "port %d is answered by pid %d" % (port, os.getpid()) in result["msg"]
        assert "not by the launched server (pid %d" % started["pid"] in result["msg"]
        # the server still runs, but it cannot come up on a taken port: not the "may still come up" of a timeout
        assert "running" not in result
    finally:
        stray.shutdown()
        stray.server_close()
        _kill_group(started["pid"])


def test_ready_counts_an_answer_on_the_servers_own_socket(tmp_path, capsys):
    port = _free_port()
    rc, started = _start(tmp_path, capsys, HTTP_SERVER % (0.5, port))
    try:
        result = None
        for _ in range(10):
            rc, result = _ready(tmp_path, capsys, started, port, slice_s=2)
            if result["ready"] or rc:
                break
        assert rc == 0 and result["ready"] is True and result["ready_wait_ms"] >= 400
        assert "answered on pid %d's socket" % started["pid"] in result["progress"]
    finally:
        _kill_group(started["pid"])


def test_ready_times_out_from_the_servers_start_and_leaves_it_running(tmp_path, capsys):
    port = _free_port()
    rc, started = _start(tmp_path, capsys, "import time;print('still loading',flush=True);time.sleep(30)")
    try:
        rc, result = _ready(tmp_path, capsys, started, port, timeout_s=1, slice_s=5)
        assert rc == 1 and "did not answer /health_generate on 127.0.0.1:%d within 1 s" % port in result["msg"]
        # past tense: a summary quotes this after the rollback may have stopped the pid
        assert result["msg"].startswith("the server (pid %d) was running but did not answer" % started["pid"])
        assert "still loading" in result["log_tail"]
        assert states.pid_alive(started["pid"])
        # the rollback reads this to tell "still loading" from "gone"
        assert result["running"] is True
    finally:
        _kill_group(started["pid"])


def test_ready_without_pid_pid_file_or_unit_is_refused(capsys):
    rc, result = run_main({"state": "ready", "port": 1234}, capsys)
    assert rc == 1 and "pid, pid_file, unit" in result["msg"]


def test_unit_show_parses_systemctl_properties():
    calls = []

    def fake_run(argv, environ_update=None):
        calls.append(argv)
        return 0, "MainPID=4242\nExecMainStatus=1\nExecMainCode=1\nActiveState=failed\n", ""
    props = states.unit_show(fake_run, "sglang.service")
    assert props["MainPID"] == "4242" and props["ExecMainStatus"] == "1" and calls[0][-1] == "sglang.service"


def test_unit_exit_counts_the_units_exit_status_only_for_the_pid_that_died():
    props = {"ExecMainPID": "466", "ExecMainStatus": "1", "ExecMainCode": "1",
             "ExecMainStartTimestampMonotonic": "5000000", "ExecMainExitTimestampMonotonic": "7250000"}
    assert states.unit_exit(props, 466) == {"rc": 1, "elapsed_s": 2.25, "note": ""}
    # CLD_KILLED: ExecMainStatus is the signal, not an exit status
    assert states.unit_exit(dict(props, ExecMainStatus="9", ExecMainCode="2"), 466)["rc"] == -9
    # Restart= ran the unit again: the status (0, the new process still runs) belongs to pid 512, not to 466
    # systemd has not processed the exit yet: ExecMainStatus still reads 0, which is not an exit status
    assert states.unit_exit(dict(props, ExecMainStatus="0", ExecMainExitTimestampMonotonic="0"), 466)["rc"] is None
    later = dict(props, ExecMainPID="512", ExecMainStatus="0", ExecMainCode="0", ExecMainExitTimestampMonotonic="0")
    assert states.unit_exit(later, 466) == {
        "rc": None, "elapsed_s": None,
        "note": "systemd has run the unit again since, as pid 512 (Restart= after a crash)"}


def test_ready_on_a_unit_whose_crashed_server_was_already_restarted_does_not_make_up_a_status(tmp_path, capsys,
                                                                                              monkeypatch):
    # Seen in the systemd lab with RestartSec=0: the launched pid was gone before the first look and systemd had
    # started the unit again; the message said "exited with status 0 0.0 s after it started".
    import subprocess
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "s.log").write_text("RuntimeError: scheduler failed while loading the model\n")
    monkeypatch.setattr(states, "unit_show", lambda run, unit: {
        "MainPID": "0", "ExecMainPID": str(gone.pid + 100000), "ExecMainStatus": "0", "ExecMainCode": "0",
        "ActiveState": "activating"})
    port = _free_port()
    rc, result = run_main({"state": "ready", "pid": gone.pid, "unit": "sglang.service", "port": port,
                           "url": "http://127.0.0.1:%d/health_generate" % port,
                           "log_file": str(tmp_path / "s.log"), "timeout_s": 5, "slice_s": 1}, capsys)
    first = result["msg"].splitlines()[0]
    assert rc == 1 and result["failed"] and result["elapsed_s"] is None
    assert first.startswith("the server (pid %d) exited (exit status unknown: systemd has run the unit again "
                            "since, as pid %d (Restart= after a crash)), before /health_generate" % (
                                gone.pid, gone.pid + 100000)), first
    assert "status 0" not in first and "0.0 s" not in first
    assert "scheduler failed while loading the model" in first


def test_log_tail_from_an_offset_and_after_truncation(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("old 1\nold 2\nnew 1\nnew 2\n")
    assert states.log_tail(str(log), 10, offset=len("old 1\nold 2\n")) == "new 1\nnew 2"
    assert states.log_tail(str(log), 10, offset=10 ** 6) == "old 1\nold 2\nnew 1\nnew 2"


def test_ready_renews_the_restart_lock_each_slice(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(states.gpufleet_lock, "renew_lease", lambda lock_dir, owner: calls.append((lock_dir, owner)))
    port = _free_port()
    rc, started = _start(tmp_path, capsys, "import time;time.sleep(30)")
    try:
        rc, result = _ready(tmp_path, capsys, started, port, slice_s=0, lock_dir=str(tmp_path / "lock"),
                            lock_owner="run-1")
        assert rc == 0 and result["lock_renewed"] is True and calls == [(str(tmp_path / "lock"), "run-1")]
    finally:
        _kill_group(started["pid"])


def test_ready_renews_the_lock_again_when_it_sees_the_server_serve_and_a_lost_lock_there_is_no_failed_wait(
        tmp_path, capsys, monkeypatch):
    # restart.yml skips verify's own renewal when the slice renewed at readiness (lock_renewed_at_ready).
    calls = []
    lost_at = {"n": None}

    def renew(lock_dir, owner):
        calls.append((lock_dir, owner))
        if len(calls) == lost_at["n"]:
            raise states.gpufleet_lock.LockLost("the restart lock %s is gone" % lock_dir)
    monkeypatch.setattr(states.gpufleet_lock, "renew_lease", renew)
    port = _free_port()
    rc, started = _start(tmp_path, capsys, HTTP_SERVER % (0.2, port))
    try:
        rc, result = _ready(tmp_path, capsys, started, port, lock_dir=str(tmp_path / "lock"), lock_owner="run-1")
        assert rc == 0 and result["ready"] is True
        assert result["lock_renewed"] is True and result["lock_renewed_at_ready"] is True
        assert calls == [(str(tmp_path / "lock"), "run-1")] * 2
        # The lock lost right at readiness: the server serves, the wait is not failed, the loss is named.
        calls[:] = []
        lost_at["n"] = 2
        rc, result = _ready(tmp_path, capsys, started, port, lock_dir=str(tmp_path / "lock"), lock_owner="run-1")
        assert rc == 0 and result["ready"] is True and result["lock_renewed_at_ready"] is False
        assert "is gone" in result["lock_renewed_at_ready_error"]
        # Without a lock nothing is renewed and the field is null.
        rc, result = _ready(tmp_path, capsys, started, port)
        assert rc == 0 and result["ready"] is True and result["lock_renewed_at_ready"] is None
    finally:
        _kill_group(started["pid"])


def test_ready_stops_at_once_when_another_run_holds_the_lock(tmp_path, capsys, monkeypatch):
    def lost(lock_dir, owner):
        raise states.gpufleet_lock.LockLost("the restart lock %s is now held by run 77" % lock_dir)
    monkeypatch.setattr(states.gpufleet_lock, "renew_lease", lost)
    rc, started = _start(tmp_path, capsys, "import time;time.sleep(30)")
    try:
        rc, result = _ready(tmp_path, capsys, started, _free_port(), lock_dir=str(tmp_path / "lock"),
                            lock_owner="run-1")
        assert rc == 1 and "held by run 77" in result["msg"] and "left running" in result["msg"]
        assert states.pid_alive(started["pid"])
    finally:
        _kill_group(started["pid"])


def test_check_mode_start_warns_about_a_held_port_instead_of_failing(tmp_path, capsys):
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, result = _start(tmp_path, capsys, "pass", port=port, _ansible_check_mode=True)
    assert rc == 0 and result["changed"] and result["pid"] is None and not (tmp_path / "s.pid").exists()
    # ansible-core 2.19+ reports warnings as structured summaries, older ones as strings: look at the text
    assert "port %d is held now by pid %d" % (port, os.getpid()) in json.dumps(result.get("warnings"))


# ------------------------------------------------------------------ state=started with wait_ready / create_dirs

def test_start_with_wait_ready_returns_once_the_server_answers_on_its_own_socket(tmp_path, capsys):
    port = _free_port()
    before = time.time()
    rc, started = _start(tmp_path, capsys, HTTP_SERVER % (0.5, port), startup_check_s=20, wait_ready=True,
                         port=port, url="http://127.0.0.1:%d/health_generate" % port, poll_interval_ms=200)
    try:
        assert rc == 0 and started["started"] is True and started["ready"] is True
        # It returned at readiness (after the 0.5 s "load"), not at the end of the 20 s window.
        assert started["ready_wait_ms"] >= 400
        assert started["ready_epoch"] - started["started_at"] < 20
        assert before <= started["started_at"] <= started["ready_epoch"] <= time.time()
        assert "answered on pid %d's socket" % started["pid"] in started["progress"]
    finally:
        _kill_group(started["pid"])


def test_start_with_wait_ready_returns_not_ready_when_the_window_ends_first(tmp_path, capsys):
    port = _free_port()
    rc, started = _start(tmp_path, capsys, HTTP_SERVER % (30, port), startup_check_s=0.5, wait_ready=True,
                         port=port, url="http://127.0.0.1:%d/health_generate" % port)
    try:
        assert rc == 0 and started["started"] is True and started["ready"] is False
        assert started["ready_epoch"] is None and started["ready_wait_ms"] is None
        assert started["last"] == "connection refused"
        assert states.pid_alive(started["pid"])
        # ready.yml goes on from here with state=ready, as before.
        rc, result = _ready(tmp_path, capsys, started, port, slice_s=0)
        assert rc == 0 and result["ready"] is False
    finally:
        _kill_group(started["pid"])


def test_start_with_wait_ready_fails_with_the_exit_status_of_a_server_that_dies(tmp_path, capsys):
    port = _free_port()
    rc, result = _start(tmp_path, capsys, "import sys,time;print('bad flag',flush=True);time.sleep(0.3);sys.exit(3)",
                        startup_check_s=10, wait_ready=True, port=port)
    assert rc == 1 and result["rc"] == 3 and "exited with status 3" in result["msg"]
    assert "bad flag" in result["log_tail"]
    assert not (tmp_path / "s.pid").exists()


def test_start_with_wait_ready_refuses_a_stranger_that_took_the_port(tmp_path, capsys):
    import http.server
    import threading
    port = _free_port()
    code = "import time;time.sleep(30)"
    stray = {}

    def take_port():  # after the start's own port check, while the server "loads"
        time.sleep(0.3)
        stray["server"] = http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler)
        stray["server"].serve_forever()

    thread = threading.Thread(target=take_port, daemon=True)
    thread.start()
    rc, result = _start(tmp_path, capsys, code, startup_check_s=10, wait_ready=True, port=port)
    try:
        assert rc == 1 and result["ready"] is False
        assert "port %d is answered by pid %d" % (port, os.getpid()) in result["msg"]
    finally:
        if "server" in stray:
            stray["server"].shutdown()
            stray["server"].server_close()
        _kill_group(result["pid"])


def test_wait_ready_needs_a_port(tmp_path, capsys):
    rc, result = _start(tmp_path, capsys, "pass", wait_ready=True)
    assert rc == 1 and "port" in result["msg"]


def test_create_dirs_makes_the_state_dir_before_the_start(tmp_path, capsys):
    state = tmp_path / "state" / "deeper"
    rc, result = run_main({"argv": [sys.executable, "-c", "import time;time.sleep(30)"],
                           "log_file": str(state / "s.log"), "pid_file": str(state / "s.pid"),
                           "startup_check_s": 0.1, "create_dirs": True}, capsys)
    try:
        assert rc == 0 and result["started"] and result["created_dirs"] == [str(state)]
        assert state.is_dir() and (state / "s.pid").read_text().strip() == str(result["pid"])
    finally:
        _kill_group(result["pid"])


def test_create_dirs_in_check_mode_creates_nothing(tmp_path, capsys):
    state = tmp_path / "state"
    rc, result = run_main({"argv": ["/bin/true"], "log_file": str(state / "s.log"), "pid_file": str(state / "s.pid"),
                           "create_dirs": True, "_ansible_check_mode": True}, capsys)
    assert rc == 0 and result["changed"] and result["created_dirs"] == [str(state)]
    assert not state.exists()


def test_recorded_writes_the_record_atomically_and_only_when_it_changes(tmp_path, capsys):
    path = tmp_path / "launch.json"
    record = {"format": 1, "argv": ["/opt/sglang/bin/python", "-m", "sglang.launch_server"], "port": 30000,
              "pid": 4242, "unit_text": None, "api_key_set": False}
    rc, result = run_main({"state": "recorded", "record_file": str(path), "record": record, "_ansible_diff": True},
                          capsys)
    assert rc == 0 and result["changed"] and result["record_file"] == str(path)
    assert json.loads(path.read_text()) == record and path.read_text().endswith("}\n")
    assert oct(path.stat().st_mode & 0o777) == "0o640"  # owner and group only (issue 31)
    assert result["diff"]["before"] == "" and json.loads(result["diff"]["after"]) == record
    assert [p.name for p in tmp_path.iterdir()] == ["launch.json"]  # no temporary file left
    rc, result = run_main({"state": "recorded", "record_file": str(path), "record": record}, capsys)
    assert rc == 0 and not result["changed"]
    # check mode: reports the change, writes nothing
    rc, result = run_main({"state": "recorded", "record_file": str(path), "record": dict(record, pid=5),
                           "_ansible_check_mode": True}, capsys)
    assert rc == 0 and result["changed"] and json.loads(path.read_text())["pid"] == 4242


def test_recorded_in_check_mode_diffs_only_the_launch_configuration(tmp_path, capsys):
    # restart.yml --check --diff: the would-be launch's argv against the recorded one; the pid and the time are
    # known only after a real launch, so they keep the recorded values instead of showing as changes.
    path = tmp_path / "launch.json"
    old = {"format": 1, "argv": ["python3", "-m", "sglang.launch_server", "--tp-size", "8"], "pid": 4242,
           "recorded_at": "2026-12-01T10:00:00Z"}
    path.write_text(json.dumps(old, indent=4, sort_keys=True) + "\n")
    same = dict(old, pid=0, recorded_at="2026-12-02T16:00:00Z")
    args = {"state": "recorded", "record_file": str(path), "check_mode_keep": ["pid", "recorded_at"],
            "_ansible_check_mode": True, "_ansible_diff": True}
    rc, result = run_main(dict(args, record=same), capsys)
    assert rc == 0 and not result["changed"], result["diff"]
    new = dict(same, argv=old["argv"] + ["--enable-metrics"])
    rc, result = run_main(dict(args, record=new), capsys)
    assert rc == 0 and result["changed"]
    after = json.loads(result["diff"]["after"])
    assert after["argv"][-1] == "--enable-metrics" and after["pid"] == 4242
    assert after["recorded_at"] == "2026-12-01T10:00:00Z"
    assert json.loads(path.read_text()) == old  # nothing written
    # Outside check mode the keys are written as given.
    rc, result = run_main(dict(args, record=new, _ansible_check_mode=False), capsys)
    assert rc == 0 and json.loads(path.read_text())["pid"] == 0


def test_recorded_in_check_mode_into_a_missing_directory_warns_instead_of_failing(tmp_path, capsys):
    # restart.yml --check on a host gpufleet never launched on: the real run creates sglang_state_dir first.
    path = tmp_path / "state" / "launch.json"
    rc, result = run_main({"state": "recorded", "record_file": str(path), "record": {"pid": 1},
                           "_ansible_check_mode": True, "_ansible_diff": True}, capsys)
    assert rc == 0 and result["changed"] and not result.get("failed")
    assert "a real run creates it" in json.dumps(result["warnings"]) and not (tmp_path / "state").exists()


def test_recorded_into_a_missing_directory_fails_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "no-such-dir" / "launch.json"
    rc, result = run_main({"state": "recorded", "record_file": str(path), "record": {"pid": 1}}, capsys)
    assert rc == 1 and "does not exist" in result["msg"] and not path.parent.exists()


def test_recorded_keeps_the_previous_record_when_the_write_fails(tmp_path, capsys, monkeypatch):
    path = tmp_path / "launch.json"
    path.write_text('{"pid": 1}\n')

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(states, "write_file_atomic", refuse)
    rc, result = run_main({"state": "recorded", "record_file": str(path), "record": {"pid": 2}}, capsys)
    assert rc == 1 and "No space left" in result["msg"] and "unchanged" in result["msg"]
    assert path.read_text() == '{"pid": 1}\n'


def test_recorded_releases_the_restart_lock_it_is_given_after_the_record_and_leaves_another_runs_lock(
        tmp_path, capsys):
    lock = str(tmp_path / "restart.lock")
    path = tmp_path / "launch.json"
    states.gpufleet_lock.take_lease(lock, {"run_id": "run-1"}, 300)
    args = {"state": "recorded", "record_file": str(path), "record": {"pid": 7}, "lock_dir": lock,
            "lock_owner": "run-1"}
    # Check mode writes nothing and releases nothing.
    rc, result = run_main(dict(args, _ansible_check_mode=True), capsys)
    assert rc == 0 and result["lock_release"] is None and os.path.isdir(lock) and not path.exists()
    rc, result = run_main(args, capsys)
    assert rc == 0 and result["changed"] and json.loads(path.read_text()) == {"pid": 7}
    assert result["lock_release"] == "released" and not os.path.exists(lock)
    # Another run's lock (taken over after this run's lease ended) stays.
    states.gpufleet_lock.take_lease(lock, {"run_id": "run-2"}, 300)
    rc, result = run_main(args, capsys)
    assert rc == 0 and result["lock_release"] == "not_owner" and not result["changed"]
    assert states.gpufleet_lock.read_holder(lock)["run_id"] == "run-2"
    assert result["lock_holder"]["run_id"] == "run-2" and "held by run run-2" in json.dumps(result.get("warnings"))
    # The same record again with our own lock: the release alone is a change.
    states.gpufleet_lock.release_lease(lock, "run-2")
    states.gpufleet_lock.take_lease(lock, {"run_id": "run-1"}, 300)
    rc, result = run_main(args, capsys)
    assert rc == 0 and result["changed"] and result["lock_release"] == "released" and not os.path.exists(lock)


def test_recorded_keeps_the_lock_when_the_record_fails_and_reports_a_failed_release_without_failing(
        tmp_path, capsys, monkeypatch):
    lock = str(tmp_path / "restart.lock")
    states.gpufleet_lock.take_lease(lock, {"run_id": "run-1"}, 300)
    args = {"state": "recorded", "record": {"pid": 7}, "lock_dir": lock, "lock_owner": "run-1"}
    rc, result = run_main(dict(args, record_file=str(tmp_path / "missing" / "launch.json")), capsys)
    assert rc == 1 and "does not exist" in result["msg"] and os.path.isdir(lock)

    def broken(*a, **k):
        raise states.gpufleet_lock.LockError("cannot read %s: Permission denied" % lock)
    monkeypatch.setattr(states.gpufleet_lock, "release_lease", broken)
    rc, result = run_main(dict(args, record_file=str(tmp_path / "launch.json")), capsys)
    assert rc == 0 and result["changed"] and result["lock_release"] is None
    assert "Permission denied" in result["lock_release_error"] and os.path.isdir(lock)


def test_ready_that_cannot_attribute_the_socket_does_not_say_the_server_may_still_come_up(tmp_path, capsys,
                                                                                        monkeypatch):
    import http.server
    import threading
    stray = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    port = stray.server_address[1]
    rc, started = _start(tmp_path, capsys, "import time;time.sleep(30)")
    threading.Thread(target=stray.serve_forever, daemon=True).start()
    monkeypatch.setattr(states, "tree_listens", lambda pid, port: None)  # another user's sockets: unknown
    try:
        rc, result = _ready(tmp_path, capsys, started, port)
        assert rc == 1 and "run this task as root (become)" in result["msg"]
        assert "running" not in result
    finally:
        stray.shutdown()
        stray.server_close()
        _kill_group(started["pid"])


# A stand-in for state=verified: GET answers 200; POST /generate answers {"text": ...}, or 401 without the bearer
# when a key is set; two children titled like GPU workers (matched by a test pattern), one with NCCL_PROTO=LL.
VERIFY_SERVER = r"""
import http.server, json, os, subprocess, sys
port, key = int(sys.argv[1]), sys.argv[2]
child = "import time; time.sleep(60)  # verify-worker-marker"
for rank, env in enumerate(({"NCCL_PROTO": "LL"}, {})):
    full = dict(os.environ); full.pop("NCCL_PROTO", None); full.update(env)
    subprocess.Popen([sys.executable, "-c", child, "rank%d" % rank], env=full)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if key and self.headers.get("Authorization") != "Bearer " + key:
            out, code = {"error": "Unauthorized"}, 401
        else:
            out, code = {"text": " Paris" * body["sampling_params"]["max_new_tokens"], "prompt": body["text"]}, 200
        raw = json.dumps(out).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw))); self.end_headers(); self.wfile.write(raw)
    def log_message(self, *a):
        pass
print("fired up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _verified(tmp_path, capsys, port, **extra):
    args = {"state": "verified", "pid_file": str(tmp_path / "s.pid"), "log_file": str(tmp_path / "s.log"),
            "port": port, "url": "http://127.0.0.1:%d/health_generate" % port,
            "generate": {"url": "http://127.0.0.1:%d/generate" % port, "max_new_tokens": 2, "timeout_s": 10},
            "worker_env": {"expected": {"NCCL_PROTO": "LL"}, "title_pattern": "verify-worker-marker"}}
    args.update(extra)
    return run_main(args, capsys)


def test_verified_generates_reads_every_worker_and_looks_at_the_socket_in_one_call(tmp_path, capsys):
    port = _free_port()
    (tmp_path / "srv.py").write_text(VERIFY_SERVER)
    rc, started = run_main({"argv": [sys.executable, str(tmp_path / "srv.py"), str(port), "sekret"],
                            "log_file": str(tmp_path / "s.log"), "pid_file": str(tmp_path / "s.pid"),
                            "startup_check_s": 10, "wait_ready": True, "port": port,
                            "url": "http://127.0.0.1:%d/health_generate" % port}, capsys)
    try:
        assert rc == 0 and started["ready"], started
        assert _wait_for(lambda: len(psutil_children(started["pid"])) >= 2)
        rc, result = _verified(tmp_path, capsys, port, api_key="sekret")
        assert rc == 0 and not result["changed"] and result["pid"] == started["pid"]
        assert result["generate"]["status"] == 200 and result["generate"]["json"]["text"] == " Paris Paris"
        assert result["generate"]["json"]["prompt"] == "The capital of France is"
        workers = result["workers"]
        assert workers["worker_count"] == 2 and workers["all_match"] is False and workers["server_pid"] == started["pid"]
        assert [w["match"] for w in workers["workers"]] == [True, False]
        assert workers["workers"][1]["missing"] == ["NCCL_PROTO"]
        assert result["owner"]["ready"] is True and result["owner"]["pid"] == started["pid"]
        # The burst after the single generation, with the bearer, in the same call (before the look).
        burst = {"url": "http://127.0.0.1:%d/generate" % port, "requests": 12, "concurrency": 4, "timeout_s": 10}
        rc, result = _verified(tmp_path, capsys, port, api_key="sekret", burst=burst)
        assert rc == 0 and result["burst"]["ok"] is True and result["burst"]["answered"] == 12, result["burst"]
        assert result["burst"]["msg"].startswith("12 of 12 answered in ") and result["owner"]["ready"] is True
        # Without the key SGLang answers 401: reported with the body, not a failed task; no burst after it.
        rc, result = _verified(tmp_path, capsys, port, owner=False, burst=burst)
        assert rc == 0 and result["generate"]["status"] == 401 and result["generate"]["json"] == {"error": "Unauthorized"}
        assert "owner" not in result and "sekret" not in json.dumps(result)
        assert result["burst"] == {"skipped": True, "ok": None, "msg": "not sent: the single generation failed first"}
        # Bad burst settings fail, naming the option; requests 0 is no burst.
        rc, result = _verified(tmp_path, capsys, port, api_key="sekret", burst=dict(burst, concurrency=0))
        assert rc == 1 and result["msg"].startswith("burst.concurrency must be 1 to 64"), result
        rc, result = _verified(tmp_path, capsys, port, api_key="sekret", burst=dict(burst, requests=0))
        assert rc == 0 and "burst" not in result
    finally:
        _kill_group(started["pid"])
        for child in psutil_children(started["pid"]):
            child.kill()


def psutil_children(pid):
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_verified_reports_a_server_that_is_gone_and_a_missing_pid_file_without_failing(tmp_path, capsys):
    port = _free_port()
    # It outlives the start's 0.1 s startup check (an exit within it fails the start), then exits 3.
    rc, started = _start(tmp_path, capsys, "import sys, time; time.sleep(1.5); sys.exit(3)")
    assert rc == 0, started
    assert _wait_for(lambda: (tmp_path / "s.pid.exit").exists())
    rc, result = _verified(tmp_path, capsys, port)
    assert rc == 0 and result["pid"] == started["pid"]
    assert result["generate"]["status"] is None and result["generate"]["msg"].startswith("Request failed")
    assert result["workers"]["worker_count"] == 0 and "is not running" in result["workers"]["msg"]
    assert result["owner"]["ready"] is False and "exited with status 3" in result["owner"]["msg"]
    (tmp_path / "s.pid").unlink()
    rc, result = _verified(tmp_path, capsys, port)
    assert rc == 0 and result["pid"] is None
    assert "cannot read the pid file" in result["workers"]["msg"] and "cannot read the pid file" in result["owner"]["msg"]
    # Bad input still fails, naming it.
    rc, result = _verified(tmp_path, capsys, port, pid=1, pid_file=None,
                           worker_env={"expected": {}, "title_pattern": "("})
    assert rc == 1 and "invalid worker_env.title_pattern" in result["msg"]


def test_a_port_holder_whose_title_is_padded_reads_as_one_line(monkeypatch):
    # A process that set its title (setproctitle) pads argv with blanks: the port holder's line carried ~80 spaces.
    class Proc:
        def __init__(self, pid):
            self.pid = pid

        def cmdline(self):
            return ["python3 stray_listener.py" + " " * 80, ""]

        def name(self):
            return "python3"

        def username(self):
            return "root"

    monkeypatch.setattr(spawn.psutil, "Process", Proc)
    assert spawn._describe_pid(4242) == ("root", "python3 stray_listener.py")


def test_log_tail_redacts_keys_and_leaves_out_a_line_its_window_cuts(tmp_path):
    key = "sk-" + "k" * 40
    log = tmp_path / "s.log"
    # The last 64 KiB begin in the middle of the key of a 0.5.23 server_args line: its name is cut off.
    prefix = "server_args={'api_key': '"
    cut = prefix + key + "'}\n"
    last = "server_args=ServerArgs(api_key='%s', port=1)\n" % key
    filler_len = 64 * 1024 - len(cut) + len(prefix) + len(key) // 2 - len(last)
    filler = ("filler line\n" * (filler_len // 12 + 1))[:filler_len - 1] + "\n"
    log.write_text(cut + filler + last)
    assert log.stat().st_size - 64 * 1024 == len(prefix) + len(key) // 2
    tail = states.log_tail(str(log), 5)
    assert key not in tail and "k" * 10 not in tail
    assert tail.splitlines()[-1] == "server_args=ServerArgs(api_key='********', port=1)"
    assert "k" * 10 not in states.log_tail(str(log), 100000)


def test_the_server_log_is_created_0640_and_an_older_0644_log_is_tightened(tmp_path):
    fresh, old = tmp_path / "fresh.log", tmp_path / "old.log"
    old.write_text("server_args=ServerArgs(api_key='k')\n")
    old.chmod(0o666)
    for log in (fresh, old):
        spawn.start_detached(["/bin/true"], {"PATH": "/bin:/usr/bin"}, str(tmp_path), str(log)).wait()
        assert oct(log.stat().st_mode & 0o777) == "0o640", log
    assert old.read_text().startswith("server_args"), "the old lines are kept (appended)"


def test_state_files_are_written_0640(tmp_path):
    spawn.write_pid_file(str(tmp_path / "s.pid"), 4242)
    spawn.write_file_atomic(str(tmp_path / "launch.json"), "{}\n")
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()} == {
        "s.pid": "0o640", "launch.json": "0o640"}


def test_an_unreadable_pid_file_fails_the_start_by_name_and_starts_nothing(tmp_path, capsys):
    pid_file = tmp_path / "s.pid"
    pid_file.mkdir()  # open() fails with EISDIR, also for root
    rc, result = run_main({"argv": [sys.executable, "-c", "import time; time.sleep(30)"],
                           "log_file": str(tmp_path / "s.log"), "pid_file": str(pid_file)}, capsys)
    assert rc == 1 and result["started"] is False and result["pid"] is None
    assert result["msg"] == ("cannot read the pid file %s ([Errno 21] Is a directory: '%s'): nothing was started; "
                             "check its owner and mode" % (pid_file, pid_file))
    assert not (tmp_path / "s.log").exists()
