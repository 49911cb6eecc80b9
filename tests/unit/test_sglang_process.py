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
spec = importlib.util.spec_from_file_location("sglang_process", ROOT / "library" / "sglang_process.py")
proc_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proc_mod)


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
    assert proc_mod.running_pid(str(pid_file)) is None  # this process started after that mtime
    os.utime(pid_file, None)
    assert proc_mod.running_pid(str(pid_file)) == os.getpid()


def test_build_env_overrides_and_removes():
    env = proc_mod.build_env({"A": 1, "B": None, "C": False}, True, base={"B": "x", "PATH": "/bin"})
    assert env == {"A": "1", "C": "0", "PATH": "/bin"}
    assert proc_mod.build_env({"A": "v"}, False, base={"PATH": "/bin"}) == {"A": "v"}


def test_wait_port_fails_at_once_with_log_tail_when_the_server_dies_while_loading(tmp_path, capsys):
    code = "import sys,time;time.sleep(0.5);print('RuntimeError: scheduler failed while loading',flush=True);sys.exit(1)"
    started = time.monotonic()
    rc, result = run_main({"argv": [sys.executable, "-c", code], "log_file": str(tmp_path / "s.log"),
                           "pid_file": str(tmp_path / "s.pid"), "startup_check_s": 0.1,
                           "wait_port": _free_port(), "wait_timeout_s": 60}, capsys)
    assert rc == 1 and "before port" in result["msg"] and "status 1" in result["msg"]
    assert "scheduler failed while loading" in result["log_tail"]
    assert time.monotonic() - started < 10, "must not wait for the port timeout"
    assert not (tmp_path / "s.pid").exists()


def test_wait_port_returns_once_the_server_listens(tmp_path, capsys):
    port = _free_port()
    code = ("import socket,time;time.sleep(0.5);s=socket.socket();s.bind(('127.0.0.1',%d));s.listen();"
            "time.sleep(30)" % port)
    rc, result = run_main({"argv": [sys.executable, "-c", code], "log_file": str(tmp_path / "s.log"),
                           "pid_file": str(tmp_path / "s.pid"), "startup_check_s": 0.1,
                           "wait_port": port, "wait_timeout_s": 20}, capsys)
    try:
        assert rc == 0 and result["port_wait_ms"] >= 400
    finally:
        _kill_group(result["pid"])


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_url_fails_at_once_when_the_server_dies_after_opening_its_port(tmp_path, capsys):
    port = _free_port()
    code = ("import socket,sys,time;s=socket.socket();s.bind(('127.0.0.1',%d));s.listen();time.sleep(1);"
            "print('warm-up failed',flush=True);sys.exit(3)" % port)
    started = time.monotonic()
    rc, result = run_main({"argv": [sys.executable, "-c", code], "log_file": str(tmp_path / "s.log"),
                           "pid_file": str(tmp_path / "s.pid"), "startup_check_s": 0.1, "wait_port": port,
                           "wait_url": "http://127.0.0.1:%d/health_generate" % port, "wait_timeout_s": 60}, capsys)
    assert rc == 1 and "status 3" in result["msg"] and "/health_generate" in result["msg"]
    assert "warm-up failed" in result["log_tail"]
    assert time.monotonic() - started < 15


def test_wait_url_returns_when_readiness_answers_200(tmp_path, capsys):
    port = _free_port()
    code = ("import http.server,time;time.sleep(0.3)\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers()\n"
            "http.server.HTTPServer(('127.0.0.1',%d),H).serve_forever()\n" % port)
    rc, result = run_main({"argv": [sys.executable, "-c", code], "log_file": str(tmp_path / "s.log"),
                           "pid_file": str(tmp_path / "s.pid"), "startup_check_s": 0.1, "wait_port": port,
                           "wait_url": "http://127.0.0.1:%d/health_generate" % port, "wait_timeout_s": 30}, capsys)
    try:
        assert rc == 0 and result["ready_wait_ms"] is not None and result["ready_wait_ms"] >= 300
    finally:
        _kill_group(result["pid"])


def test_api_key_reaches_the_process_argv_but_never_the_task_result(tmp_path, capsys):
    key = "sk-gpufleet-unit-7f3a9c"
    # The "server" echoes its last two arguments and dies, so the failure message quotes the log tail.
    code = "import sys;print('server_args api_key=' + ' '.join(sys.argv[-2:]), flush=True);sys.exit(2)"
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args({"argv": [sys.executable, "-c", code], "api_key": key,
                            "log_file": str(tmp_path / "s.log"), "pid_file": str(tmp_path / "s.pid"),
                            "startup_check_s": 3}):
        with pytest.raises(SystemExit):
            proc_mod.main()
    out = capsys.readouterr().out
    assert (tmp_path / "s.log").read_text().split() == ["server_args", "api_key=--api-key", key]
    result = json.loads(out)
    assert result["failed"] and "api_key=--api-key" in out, "the log tail is part of the failure"
    assert key not in out, "the no_log api_key must be masked in the module's JSON result"
    assert "--api-key" not in result["argv"]


def test_with_api_key_appends_only_a_non_empty_key():
    assert proc_mod.with_api_key(["sglang", "serve"], "k") == ["sglang", "serve", "--api-key", "k"]
    assert proc_mod.with_api_key(["sglang", "serve"], None) == ["sglang", "serve"]
    assert proc_mod.with_api_key(["sglang", "serve"], "") == ["sglang", "serve"]
