"""sglang_stop: which processes are chosen, how they are stopped, which shm segments go.

Real processes are started by the tests themselves with a title unique to the test run, and the module's
pattern is narrowed to that title: the tests never signal anything they did not start.
"""
import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "library" / (name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


stop = load("sglang_stop")


def run_main(module, args, capsys):
    """Drive module.main() with ``args``; return the parsed JSON result."""
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            module.main()
    return json.loads(capsys.readouterr().out)


def P(pid, cmdline, user="sglang", ppid=100, pgid=None, sid=None, create_time=1000.0):
    return stop.Proc(pid, ppid, pgid or pid, sid or pid, 1000, user, cmdline, create_time)


PATTERN = re.compile(stop.SGLANG_PATTERN)
PROTECT = re.compile(stop.PROTECT_PATTERN)


def test_leftovers_match_sglang_titles_and_orphans_only():
    procs = [
        P(10, "sglang::scheduler_TP0", ppid=1),                      # orphan worker
        P(11, "python3 -m sglang.launch_server --model-path /m"),
        P(12, "python3 -m sglang.bench_serving --num-prompts 10"),
        P(13, "sglang::detokenizer"),
        P(14, "python3 train.py --out sglang_results"),               # no SGLang title
        P(15, "vim /opt/sglang/srt/server_args.py"),                  # a path, not sglang.srt
    ]
    chosen = stop.select_leftovers(procs, PATTERN, {"sglang"}, set(), PROTECT)
    assert sorted(p.pid for p, _ in chosen) == [10, 11, 12, 13]
    assert {reason for _, reason in chosen} == {"pattern"}


def test_leftovers_never_include_monitors_other_users_self_or_ancestors():
    procs = [
        P(20, "nvidia-persistenced --user nvidia-persistenced"),
        P(21, "/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/dcp-metrics-included.csv sglang::"),
        P(22, "sglang::scheduler_TP1", user="alice"),                 # another user's job
        P(23, "python3 -m sglang.launch_server (our own ancestor)"),
        P(24, "sglang::scheduler_TP2"),
        P(1, "sglang::init-lookalike"),
    ]
    chosen = stop.select_leftovers(procs, PATTERN, {"sglang"}, {23}, PROTECT)
    assert [p.pid for p, _ in chosen] == [24]


def test_server_phase_takes_pid_file_process_and_its_group_but_not_monitor_in_group():
    procs = [
        P(30, "python3 standin.py --port 30000"),
        P(31, "sglang::scheduler_TP0", pgid=30, sid=30, ppid=30),
        P(32, "helper without title", pgid=30, sid=30, ppid=30),
        P(33, "nvidia-smi --query-gpu=memory.used", pgid=30, sid=30, ppid=30),
        P(34, "sglang::scheduler_TP0", pgid=99, sid=99),              # another server: not in phase 1
    ]
    chosen = stop.select_server(procs, 30, {"sglang"}, set(), PROTECT)
    assert [(p.pid, r) for p, r in chosen] == [(30, "pid_file"), (31, "process_group"), (32, "process_group")]


def test_pid_file_naming_a_reused_pid_is_stale(tmp_path):
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("40\n")
    pid, mtime = stop.read_pid_file(str(pid_file))
    assert pid == 40
    old = P(40, "python3 -m sglang.launch_server", create_time=mtime - 30)
    new = P(40, "bash", create_time=mtime + 600)
    assert stop.pid_file_process([old], pid, mtime) is old
    assert stop.pid_file_process([new], pid, mtime) is None


def test_pid_file_with_garbage_is_an_error(tmp_path):
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("not a pid")
    with pytest.raises(ValueError, match="does not hold a pid"):
        stop.read_pid_file(str(pid_file))
    assert stop.read_pid_file(str(tmp_path / "absent")) == (None, None)


def test_stale_segments_keep_held_foreign_and_unmatched(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("nccl-free", "cuda.shm.free", "sgl_shm_free", "nccl-held", "other-app"):
        (shm / name).write_bytes(b"x")
    uid = os.getuid()
    holders = {str(shm / "nccl-held"): {4242}}
    removable, kept = stop.stale_segments(str(shm), ["nccl-*", "cuda.shm.*", "sgl_shm_*"], {uid}, holders, set())
    assert sorted(os.path.basename(p) for p in removable) == ["cuda.shm.free", "nccl-free", "sgl_shm_free"]
    assert kept == [{"path": str(shm / "nccl-held"), "holders": [4242], "reason": "held"}]
    removable, kept = stop.stale_segments(str(shm), ["nccl-*"], {uid + 1}, {}, set())
    assert removable == [] and all("not a managed user" in k["reason"] for k in kept)


def test_shm_holders_sees_open_fd_and_mapping(tmp_path):
    seg = tmp_path / "nccl-live"
    seg.write_bytes(b"\0" * 4096)
    code = ("import mmap,sys,time;f=open(sys.argv[1],'r+b');m=mmap.mmap(f.fileno(),4096);"
            "print('ready',flush=True);time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(seg)], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        holders, _ = stop.shm_holders(str(tmp_path))
        assert child.pid in holders[str(seg)]
    finally:
        child.kill()
        child.wait()


def _start_titled(title, ignore_term=False, new_session=True):
    code = ("import setproctitle,signal,sys,time;setproctitle.setproctitle(sys.argv[1]);"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN);" if ignore_term else "")
            + "print('ready',flush=True);time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code, title], stdout=subprocess.PIPE,
                             start_new_session=new_session)
    assert child.stdout.readline().strip() == b"ready"
    return child


@pytest.fixture
def unique_title():
    return "gpufleet-test-%s::scheduler_TP0" % uuid.uuid4().hex[:10]


def test_module_sigkills_a_worker_that_ignores_sigterm_after_grace(unique_title, tmp_path, capsys):
    child = _start_titled(unique_title, ignore_term=True)
    try:
        result = run_main(stop, {"pattern": re.escape(unique_title), "grace_s": 0.5, "kill_timeout_s": 5,
                                 "shm_dir": str(tmp_path)}, capsys)
        child.wait(timeout=5)
    finally:
        if child.poll() is None:
            child.kill()
    assert result["changed"] is True
    [entry] = result["signalled"]
    assert entry["pid"] == child.pid
    assert entry["signals"] == ["SIGTERM", "SIGKILL"]
    assert entry["ended"] == "after SIGKILL"
    assert entry["wait_ms"] >= 500


def test_module_stops_pid_file_group_with_sigterm_and_removes_pid_file(unique_title, tmp_path, capsys):
    child = _start_titled(unique_title)
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("%d\n" % child.pid)
    try:
        result = run_main(stop, {"pid_file": str(pid_file), "pattern": "no-such-title-" + uuid.uuid4().hex,
                                 "grace_s": 5, "shm_dir": str(tmp_path)}, capsys)
        child.wait(timeout=5)
    finally:
        if child.poll() is None:
            child.kill()
    assert result["main_pid"] == child.pid
    assert [(e["pid"], e["reason"], e["signals"], e["ended"]) for e in result["signalled"]] == [
        (child.pid, "pid_file", ["SIGTERM"], "after SIGTERM")]
    assert result["pid_file_removed"] and not pid_file.exists()


def test_check_mode_reports_without_signalling(unique_title, tmp_path, capsys):
    child = _start_titled(unique_title)
    (tmp_path / "nccl-stale").write_bytes(b"x")
    try:
        result = run_main(stop, {"pattern": re.escape(unique_title), "shm_dir": str(tmp_path),
                                 "_ansible_check_mode": True}, capsys)
        time.sleep(0.2)
        assert child.poll() is None, "check mode must not signal"
    finally:
        child.kill()
        child.wait()
    assert result["changed"] is True
    assert [(e["pid"], e["ended"]) for e in result["signalled"]] == [(child.pid, "would signal")]
    assert result["removed_shm"] == [str(tmp_path / "nccl-stale")]
    assert (tmp_path / "nccl-stale").exists()


def test_nothing_running_is_not_a_change(tmp_path, capsys):
    result = run_main(stop, {"pattern": "no-such-title-" + uuid.uuid4().hex, "pid_file": str(tmp_path / "x.pid"),
                             "shm_dir": str(tmp_path)}, capsys)
    assert result["changed"] is False and result["signalled"] == []


def test_module_never_signals_itself_or_its_ancestors(tmp_path, capsys):
    # The pattern is this very process's command line: the module (running in this process) must skip
    # itself and its ancestors (the shell/ssh chain that started it).
    own = stop.cmdline_text(os.getpid())
    result = run_main(stop, {"pattern": "^" + re.escape(own) + "$", "shm_dir": str(tmp_path)}, capsys)
    assert result["signalled"] == []
    assert os.getpid() in stop.protected_pids() and os.getppid() in stop.protected_pids()
