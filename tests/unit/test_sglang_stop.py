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
    spec = importlib.util.spec_from_file_location(name, ROOT / "plugins" / "modules" / (name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


stop = load("sglang_stop")
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_stop_plan as stop_plan  # noqa: E402
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_pid_file import read_pid_file  # noqa: E402


def run_main(module, args, capsys):
    """Drive module.main() with ``args``; return the parsed JSON result."""
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            module.main()
    return json.loads(capsys.readouterr().out)


def registered(result):
    """A module result as a registered variable holds it: the controller consumes the warnings/deprecations
    (ansible-core 2.19 emits them as tagged Event objects, which module arguments cannot carry back)."""
    return {k: v for k, v in result.items() if k not in ("warnings", "deprecations", "invocation")}


def P(pid, cmdline, user="sglang", ppid=100, pgid=None, sid=None, create_time=1000.0, argv=None):
    return stop.Proc(pid, ppid, pgid or pid, sid or pid, 1000, user, cmdline, create_time, argv=argv)


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
        P(16, "grep --line-buffered sglang.launch_server"),           # root's grep (issue 10, finding 7)
        P(17, "x", argv=["bash", "-c", "while :; do pgrep -af sglang::scheduler; sleep 1; done"]),
    ]
    kept = []
    chosen = stop.select_leftovers(procs, PATTERN, {"sglang"}, set(), PROTECT, kept=kept)
    assert sorted(p.pid for p, _ in chosen) == [10, 11, 13]
    assert {reason for _, reason in chosen} == {"pattern"}
    # a client of the server, not a process of it (issue 30)
    assert kept == [{"pid": 12, "cmdline": "python3 -m sglang.bench_serving --num-prompts 10", "user": "sglang",
                     "kind": "client"}]


# Titles and command lines as SGLang, sglang-router and smg write them (setproctitle calls: SGLang 0.5.23
# srt/managers/scheduler.py, detokenizer_manager.py, data_parallel_controller.py, multi_tokenizer_mixin.py;
# sgl-router py_src/sglang_router/launch_router.py and launch_server.py; smg bindings/python/src/smg/).
ROUTER_OR_CLIENT = [
    (["sglang::router"], "router"),
    (["smg::router"], "router"),
    (["python3", "-m", "sglang_router.launch_router", "--worker-urls", "http://10.0.0.1:30000"], "router"),
    (["/venv/bin/python", "-m", "sglang_router.launch_server", "--model-path", "/m", "--dp-size", "2"], "router"),
    (["/venv/bin/python", "/venv/bin/smg", "launch", "--worker-urls", "http://10.0.0.1:30000"], "router"),
    (["/venv/bin/smg", "serve", "--backend", "sglang", "--model-path", "/m"], "router"),
    (["python3", "-m", "smg.launch_router", "--port", "30080"], "router"),
    (["python3", "-m", "sglang.bench_serving", "--backend", "sglang", "--num-prompts", "10"], "client"),
    (["python3", "-m", "sglang.bench_one_batch_server", "--base-url", "http://127.0.0.1:30000"], "client"),
    (["python", "-m", "sglang.check_env"], "client"),
    (["python3", "-m", "sglang.profiler", "--url", "http://127.0.0.1:30000"], "client"),
]
SERVER_PROCESSES = [
    ["sglang::scheduler_TP0"], ["sglang::scheduler_DP1_TP3"], ["sglang::scheduler_PP0_TP7"], ["sglang::detokenizer"],
    ["sglang::detokenizer_router"], ["sglang::tokenizer_worker:4242"], ["sglang::data_parallel_controller"],
    ["sglang::server"],  # sglang_router.launch_server's server process: an SGLang server
    ["python3", "-m", "sglang.launch_server", "--model-path", "/m"],
    ["python3", "-m", "sglang.srt.entrypoints.http_server"],
    ["python3", "-m", "sglang.bench_one_batch", "--model-path", "/m"],  # runs the model in its own process
    ["/venv/bin/sglang", "serve", "--model-path", "/m"],
]


@pytest.mark.parametrize("argv,kind", ROUTER_OR_CLIENT, ids=[" ".join(a) for a, _ in ROUTER_OR_CLIENT])
def test_routers_and_clients_are_never_leftovers_whatever_the_pattern(argv, kind):
    everything = re.compile(r".*")  # a user pattern that matches every program name
    for pattern in (PATTERN, everything):
        kept = []
        chosen = stop.select_leftovers([P(50, " ".join(argv), argv=argv)], pattern, {"sglang"}, set(), PROTECT,
                                       kept=kept)
        if stop.runs_sglang(argv, pattern):
            assert chosen == [] and [(k["pid"], k["kind"]) for k in kept] == [(50, kind)], pattern.pattern
    assert stop.kept_note([{"pid": 50, "kind": kind}]) == "kept: %s pid 50" % kind


@pytest.mark.parametrize("argv", SERVER_PROCESSES, ids=[" ".join(a) for a in SERVER_PROCESSES])
def test_server_processes_stay_leftovers_detokenizer_router_included(argv):
    kept = []
    chosen = stop.select_leftovers([P(60, " ".join(argv), argv=argv)], PATTERN, {"sglang"}, set(), PROTECT, kept=kept)
    assert [(p.pid, r) for p, r in chosen] == [(60, "pattern")] and kept == []


def test_a_router_in_the_servers_own_process_group_is_the_servers_and_is_stopped():
    # gpufleet launched sglang_router.launch_server itself (sglang_launcher): its pid file names the router.
    procs = [P(70, "sglang::router"), P(71, "sglang::server", ppid=70, pgid=71), P(72, "sglang::scheduler_TP0", ppid=71,
                                                                                  pgid=71)]
    chosen = stop.select_server(procs, 70, {"sglang"}, set(), PROTECT)
    assert [(p.pid, r) for p, r in chosen] == [(70, "pid_file"), (71, "process_tree"), (72, "process_tree")]


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
        P(35, "helper that called setsid", pgid=35, sid=35, ppid=31),  # left the group, still the server's tree
        P(36, "its child", pgid=35, sid=35, ppid=35),
        P(37, "unrelated", pgid=37, sid=37, ppid=1),
    ]
    chosen = stop.select_server(procs, 30, {"sglang"}, set(), PROTECT)
    assert [(p.pid, r) for p, r in chosen] == [(30, "pid_file"), (31, "process_group"), (32, "process_group"),
                                               (35, "process_tree"), (36, "process_tree")]


def test_pid_file_naming_a_reused_pid_is_stale(tmp_path):
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("40\n")
    read = read_pid_file(str(pid_file))
    pid, mtime = read.pid, read.mtime
    assert pid == 40
    old = P(40, "python3 -m sglang.launch_server", create_time=mtime - 30)
    new = P(40, "bash", create_time=mtime + 600)
    assert stop.pid_file_process([old], pid, mtime) is old
    assert stop.pid_file_process([new], pid, mtime) is None


def test_pid_file_with_garbage_is_an_error(tmp_path):
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("not a pid")
    result = stop_plan.new_result(["nobody"])
    with pytest.raises(stop_plan.StopPlanError, match="does not hold a pid"):
        stop.choose(str(pid_file), ["nobody"], r"\Anever\Z", stop_plan.PROTECT_PATTERN, result)
    stop.choose(str(tmp_path / "absent"), ["nobody"], r"\Anever\Z", stop_plan.PROTECT_PATTERN, result)
    assert result["main_pid"] is None


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
    # Only this process and its ancestors are offered, with a pattern matching any program: none is chosen.
    # (Never run the module itself with a pattern this process matches: other runs of the same program on the
    # machine would match too.)
    protected = stop.protected_pids()
    assert os.getpid() in protected and os.getppid() in protected
    mine = [p for p in stop.snapshot() if p.pid in (os.getpid(), os.getppid())]
    assert len(mine) == 2
    import pwd
    me = {pwd.getpwuid(os.geteuid()).pw_name}
    assert stop.select_leftovers(mine, re.compile(".*"), me, protected, PROTECT) == []
    assert stop.select_server(mine, os.getpid(), me, protected, PROTECT) == []
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("%d\n" % os.getpid())
    result = run_main(stop, {"pid_file": str(pid_file), "pattern": "no-such-title-" + uuid.uuid4().hex,
                             "shm_dir": str(tmp_path)}, capsys)
    assert result["failed"] and "may not signal" in result["msg"] and result["signalled"] == []


# --- which processes run SGLang: program name, never a substring (issue 10, finding 7) ----------------------
RUNS_SGLANG = [
    (["sglang::scheduler_TP3"], "sglang::scheduler_TP3"),
    (["sglang::scheduler_DP1_TP3"], "sglang::scheduler_DP1_TP3"),
    (["sglang::detokenizer"], "sglang::detokenizer"),
    (["/venv/bin/python3", "-m", "sglang.launch_server", "--model-path", "/m"], "sglang.launch_server"),
    (["python", "-u", "-X", "faulthandler", "-m", "sglang.launch_server"], "sglang.launch_server"),
    (["python3.11", "-Wignore", "-msglang.launch_server", "--port", "1"], "sglang.launch_server"),
    (["python3", "-um", "sglang.bench_serving"], "sglang.bench_serving"),
    (["python3", "-m", "sglang.srt.entrypoints.http_server"], "sglang.srt.entrypoints.http_server"),
    (["/usr/local/bin/sglang", "serve", "--model-path", "/m"], "/usr/local/bin/sglang serve"),
    (["sglang", "serve"], "sglang serve"),
    (["/venv/bin/python3", "/venv/bin/sglang", "serve", "--port", "1"], "/venv/bin/sglang serve"),
    (["python3", "/opt/sglang/python/sglang/launch_server.py", "--model-path", "/m"],
     "/opt/sglang/python/sglang/launch_server.py"),
]
NOT_SGLANG = [
    ["grep", "--line-buffered", "sglang.launch_server"],
    ["grep", "sglang.launch_server", "/var/log/syslog"],
    ["pgrep", "-af", "sglang::scheduler"],
    ["bash", "-c", "while :; do pgrep -af sglang::scheduler; sleep 1; done"],
    ["sh", "-c", "python3 -m sglang.launch_server --model-path /m"],
    ["vim", "/opt/sglang/python/sglang/launch_server.py"],
    ["tail", "-f", "/var/lib/gpufleet/sglang.log"],
    ["python3", "-c", "import sglang.launch_server"],
    ["python3", "train.py", "--out", "sglang.launch_server"],
    ["python3", "-m", "pytest", "tests/sglang.launch_server"],
    ["python3", "-X", "sglang.launch_server", "-m", "mymod"],
    ["/usr/bin/sglang-router", "--worker-urls", "http://x"],
    ["sglang", "version"],
    ["python3", "-c", "from multiprocessing.resource_tracker import main;main(5)"],
    ["less", "sglang::scheduler_TP0.log"],
    [],
]


@pytest.mark.parametrize("argv,name", RUNS_SGLANG, ids=[" ".join(a) for a, _ in RUNS_SGLANG])
def test_runs_sglang_by_title_module_script_or_sglang_serve(argv, name):
    assert stop.runs_sglang(argv, PATTERN) == name


@pytest.mark.parametrize("argv", NOT_SGLANG, ids=[" ".join(a) or "empty" for a in NOT_SGLANG])
def test_runs_sglang_never_matches_a_word_elsewhere_in_the_command_line(argv):
    assert stop.runs_sglang(argv, PATTERN) is None


def test_pattern_override_applies_to_the_program_name_only():
    custom = re.compile(r"my-sglang-fork::.*|myfork\.server")
    assert stop.runs_sglang(["my-sglang-fork::worker0"], custom) == "my-sglang-fork::worker0"
    assert stop.runs_sglang(["python3", "-m", "myfork.server"], custom) == "myfork.server"
    assert stop.runs_sglang(["grep", "myfork.server"], custom) is None


def test_read_argv_splits_a_setproctitle_title_and_keeps_real_argv(tmp_path):
    title = "/venv/bin/python3 -m sglang.launch_server --port 30000"
    titled = _start_titled(title)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "an arg with spaces"])
    try:
        assert stop.read_argv(titled.pid) == title.split()
        assert stop.runs_sglang(stop.read_argv(titled.pid), PATTERN) == "sglang.launch_server"
        time.sleep(0.1)
        assert stop.read_argv(plain.pid) == [sys.executable, "-c", "import time; time.sleep(30)", "an arg with spaces"]
    finally:
        for child in (titled, plain):
            child.kill()
            child.wait()
    assert stop.read_argv(plain.pid) == []


# --- defunct leaders with live threads (issue 10, finding 5) -----------------------------------------------
DEFUNCT = ("import ctypes, setproctitle, sys, threading, time\n"
           "setproctitle.setproctitle(sys.argv[1])\n"
           "threading.Thread(target=time.sleep, args=(120,)).start()\n"
           "print('ready', flush=True)\n"
           "ctypes.CDLL(None).pthread_exit(None)\n")


def _start_defunct(title):
    """A child whose main thread exited while another (non-daemon) thread sleeps: `<defunct>`, state Z."""
    child = subprocess.Popen([sys.executable, "-c", DEFUNCT, title], stdout=subprocess.PIPE, start_new_session=True)
    assert child.stdout.readline().strip() == b"ready"
    deadline = time.time() + 5
    while stop.read_stat("/proc/%d/stat" % child.pid)[0] != "Z":
        assert time.time() < deadline, "main thread did not exit"
        time.sleep(0.02)
    return child


def test_defunct_leader_with_a_live_thread_counts_as_alive_until_its_last_thread_ends(unique_title):
    child = _start_defunct(unique_title)
    try:
        ticks = stop.read_stat("/proc/%d/stat" % child.pid)[1]
        assert stop.live_threads(child.pid) and child.pid not in stop.live_threads(child.pid)
        assert stop.process_alive(child.pid, ticks)
        assert not stop.process_alive(child.pid, ticks + 1), "a different start time is another process"
        [snap] = [p for p in stop.snapshot() if p.pid == child.pid]
        assert snap.defunct and snap.argv == [unique_title] and snap.cmdline == unique_title
    finally:
        child.kill()
    deadline = time.time() + 5
    while stop.live_threads(child.pid) and time.time() < deadline:
        time.sleep(0.02)
    # Killed but not yet reaped by us: a plain zombie, which holds nothing.
    assert not stop.process_alive(child.pid)
    assert child.pid not in {p.pid for p in stop.snapshot()}
    child.wait()


def test_module_sigkills_a_defunct_worker_at_once_and_waits_for_its_threads(unique_title, tmp_path, capsys):
    child = _start_defunct(unique_title)
    try:
        result = run_main(stop, {"pattern": re.escape(unique_title), "grace_s": 30, "kill_timeout_s": 5,
                                 "shm_dir": str(tmp_path)}, capsys)
        assert not stop.live_threads(child.pid)
    finally:
        child.kill()
        child.wait()
    [entry] = result["signalled"]
    assert (entry["pid"], entry["defunct"], entry["signals"], entry["ended"]) == (
        child.pid, True, ["SIGKILL"], "after SIGKILL")
    assert result["done"] and result["stop_ms"] < 5000, "a defunct process must not cost the grace"


def test_check_mode_lists_a_defunct_worker_with_cmdline_and_user(unique_title, tmp_path, capsys):
    child = _start_defunct(unique_title)
    try:
        result = run_main(stop, {"pattern": re.escape(unique_title), "shm_dir": str(tmp_path),
                                 "_ansible_check_mode": True}, capsys)
        assert stop.live_threads(child.pid), "check mode must not signal"
    finally:
        child.kill()
        child.wait()
    [entry] = result["signalled"]
    import pwd
    assert entry["cmdline"] == unique_title and entry["user"] == pwd.getpwuid(os.geteuid()).pw_name
    assert entry["ended"] == "would signal" and entry["signals"] == [] and result["done"]


# --- one grace period for the server and its leftovers (issue 10, finding 6) --------------------------------
# A server (pid file) with a resource-tracker-like child (ignores SIGTERM, exits when its pipe reaches EOF),
# and an orphaned worker in another session holding the pipe's write end, as multiprocessing's spawn does.
TRACKER_SERVER = r"""
import os, signal, subprocess, sys, time
r, w = os.pipe()
tracker = subprocess.Popen([sys.executable, "-c",
    "import os, signal, sys\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "while os.read(int(sys.argv[1]), 1): pass\n", str(r)], pass_fds=(r,))
orphan = subprocess.Popen([sys.executable, "-c",
    "import setproctitle, sys, time\nsetproctitle.setproctitle(sys.argv[1])\ntime.sleep(120)\n", sys.argv[1]],
    pass_fds=(w,), start_new_session=True)
os.close(r); os.close(w)
print(tracker.pid, orphan.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
time.sleep(120)
"""


def test_one_grace_for_server_and_orphans_the_tracker_exits_when_the_orphan_does(unique_title, tmp_path, capsys):
    server = subprocess.Popen([sys.executable, "-c", TRACKER_SERVER, unique_title], stdout=subprocess.PIPE,
                              start_new_session=True)
    tracker, orphan = (int(x) for x in server.stdout.readline().split())
    deadline = time.time() + 10
    while stop.read_argv(orphan) != [unique_title]:  # retitled: only then does it run "SGLang"
        assert time.time() < deadline
        time.sleep(0.02)
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("%d\n" % server.pid)
    try:
        result = run_main(stop, {"pid_file": str(pid_file), "pattern": re.escape(unique_title), "grace_s": 20,
                                 "kill_timeout_s": 5, "shm_dir": str(tmp_path)}, capsys)
    finally:
        for pid in (tracker, orphan, server.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.wait()
    by_pid = {e["pid"]: e for e in result["signalled"]}
    assert by_pid[server.pid]["reason"] == "pid_file"
    assert by_pid[tracker]["reason"] == "process_group"
    assert by_pid[orphan]["reason"] == "process_tree"  # the server's child in another session (the lab's is re-parented)
    assert all(e["signals"] == ["SIGTERM"] and e["ended"] == "after SIGTERM" for e in by_pid.values()), by_pid
    assert result["stop_ms"] < 5000, "the tracker must not cost the grace: %d ms" % result["stop_ms"]


# --- slices with progress, resumed by the role --------------------------------------------------------------
def test_slices_report_progress_then_resume_sigkills_after_the_grace(unique_title, tmp_path, capsys):
    child = _start_titled(unique_title, ignore_term=True)
    # A grace of many slices, so the test holds on a loaded machine (a slice ends at its own deadline).
    args = {"pattern": re.escape(unique_title), "grace_s": 3.0, "kill_timeout_s": 5, "slice_s": 0.4,
            "shm_dir": str(tmp_path)}
    try:
        first = run_main(stop, args, capsys)
        assert first["done"] is False and not first.get("failed")
        [entry] = first["signalled"]
        assert entry["ended"] == "waiting" and entry["signals"] == ["SIGTERM"]
        assert first["progress"].startswith("waiting for 1 of 1 processes to exit after SIGTERM: pid %d %s"
                                            % (child.pid, unique_title))
        assert "of 3 s grace, then SIGKILL" in first["progress"]
        assert 300 <= first["stop_ms"] < 3000
        rounds = 0
        result = first
        while not result["done"]:
            rounds += 1
            assert rounds < 30
            result = run_main(stop, dict(args, resume=registered(first)), capsys)  # the role's until loop: same resume
        child.wait(timeout=5)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    [entry] = result["signalled"]
    assert entry["signals"] == ["SIGTERM", "SIGKILL"] and entry["ended"] == "after SIGKILL"
    assert entry["wait_ms"] >= 3000 and result["stop_ms"] >= 3000
    assert rounds >= 2, "the grace (3 s) spans several 0.4 s slices"
    again = run_main(stop, dict(args, resume=registered(result)), capsys)
    assert again["signalled"] == result["signalled"] and again["done"]


def test_resume_never_signals_a_process_that_reused_the_pid(unique_title, tmp_path, capsys):
    child = _start_titled(unique_title, ignore_term=True)
    try:
        ticks = stop.read_stat("/proc/%d/stat" % child.pid)[1]
        stale = {"started_at": time.time() - 100, "main_pid": None, "done": False, "signalled": [
            {"pid": child.pid, "cmdline": "old", "user": "x", "reason": "pattern", "defunct": False,
             "start_ticks": ticks - 1, "signals": ["SIGTERM"], "ended": "waiting", "wait_ms": None}]}
        result = run_main(stop, {"pattern": re.escape(unique_title), "grace_s": 1, "resume": stale,
                                 "shm_dir": str(tmp_path)}, capsys)
        time.sleep(0.2)
        assert child.poll() is None, "a process with another start time must not be signalled"
    finally:
        child.kill()
        child.wait()
    [entry] = result["signalled"]
    assert entry["signals"] == ["SIGTERM"] and entry["ended"] == "after SIGTERM" and result["done"]


def test_resume_that_is_not_a_stop_result_is_refused(tmp_path, capsys):
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args({"resume": {"rc": 0}, "shm_dir": str(tmp_path)}):
        with pytest.raises(SystemExit):
            stop.main()
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] and "resume must be the registered result of an sglang_stop call" in out["msg"]


@pytest.mark.parametrize("args,words", [
    ({"poll_interval_ms": 500}, "poll_interval_ms must be 1 to 100"),
    ({"slice_s": 0}, "slice_s must be > 0"),
    ({"grace_s": -1}, "grace_s and kill_timeout_s must be >= 0"),
    ({"pattern": "("}, "invalid regular expression"),
])
def test_bad_options_fail_naming_the_option(args, words, tmp_path, capsys):
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args(dict(args, shm_dir=str(tmp_path))):
        with pytest.raises(SystemExit):
            stop.main()
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] and words in out["msg"]


def test_progress_line_names_waiting_processes_and_the_grace():
    entries = [{"pid": 100 + i, "cmdline": "sglang::scheduler_TP%d" % i, "ended": "waiting"} for i in range(7)]
    entries.append({"pid": 99, "cmdline": "python -m sglang.launch_server", "ended": "after SIGTERM"})
    line = stop.progress_line(entries, 1000.0, 60, 1020.4)
    assert line == ("waiting for 7 of 8 processes to exit after SIGTERM: pid 100 sglang::scheduler_TP0, "
                    "pid 101 sglang::scheduler_TP1, pid 102 sglang::scheduler_TP2, pid 103 sglang::scheduler_TP3, "
                    "pid 104 sglang::scheduler_TP4 and 2 more; 20 s of 60 s grace, then SIGKILL")


# ---------------------------------------------------------------------------------------------------
# gpu_wait: the GPU memory wait after the stop (module_utils gpufleet_gpu_wait, shared with nvidia_gpu_wait)
# ---------------------------------------------------------------------------------------------------
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G  # noqa: E402
from fake_pynvml import make_fake_nvml  # noqa: E402
from gpu_module_harness import use_recorded_processes  # noqa: E402


def _nothing_to_stop(tmp_path, **gpu_wait):
    return {"pattern": "no-such-title-" + uuid.uuid4().hex, "pid_file": str(tmp_path / "x.pid"),
            "shm_dir": str(tmp_path), "gpu_wait": gpu_wait}


def test_gpu_wait_after_the_stop_reports_the_release_it_saw(unique_title, tmp_path, capsys, monkeypatch):
    use_recorded_processes(monkeypatch)
    fake = make_fake_nvml("loaded")
    real = fake.nvmlDeviceGetMemoryInfo

    def memory(handle, version=None):
        if fake.fake.memory_calls >= 2 * 3:  # 2 GPUs per poll: free at the 4th poll
            for gpu in fake.fake.gpus:
                gpu["used"] = 0
                gpu["procs"] = []
        return real(handle, version)

    fake.nvmlDeviceGetMemoryInfo = memory
    monkeypatch.setattr(G, "pynvml", fake)
    child = _start_titled(unique_title)
    try:
        result = run_main(stop, {"pattern": re.escape(unique_title), "grace_s": 5, "shm_dir": str(tmp_path),
                                 "gpu_wait": {"poll_interval_ms": 10, "timeout_s": 30,
                                              "require_no_processes": True}}, capsys)
        child.wait(timeout=5)
    finally:
        if child.poll() is None:
            child.kill()
    assert result["done"] and result["signalled"][0]["ended"] == "after SIGTERM"
    waited = result["gpu_wait"]
    assert waited["ready"] is True and waited["error_class"] is None
    assert waited["polls"] == 4 and waited["backend"] == "nvml"
    # The wait starts once the processes are gone: after the signals, on the target's clock.
    assert waited["started_at"] >= result["started_at"]
    assert all(g["free"] for g in waited["gpus"])


def test_gpu_wait_timeout_does_not_fail_the_stop_and_names_the_holders(tmp_path, capsys, monkeypatch):
    use_recorded_processes(monkeypatch)
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    result = run_main(stop, _nothing_to_stop(tmp_path, timeout_s=0.2, poll_interval_ms=20), capsys)
    assert not result.get("failed") and result["done"]
    waited = result["gpu_wait"]
    assert waited["ready"] is False and waited["error_class"] == "not_released"
    # The same operator message nvidia_gpu_wait fails with: GPU, MiB, the owning process.
    assert waited["msg"].startswith("GPU memory not released after 0.2 s")
    assert "held by pid" in waited["msg"]


def test_gpu_wait_slice_with_time_left_is_not_an_error(tmp_path, capsys, monkeypatch):
    use_recorded_processes(monkeypatch)
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    before = time.time()
    result = run_main(stop, _nothing_to_stop(tmp_path, timeout_s=60, slice_s=0.2, poll_interval_ms=50), capsys)
    waited = result["gpu_wait"]
    assert waited["ready"] is False and waited["error_class"] is None
    assert before <= waited["started_at"] <= time.time()
    assert "above 1024 MiB" in waited["progress"]


def test_gpu_wait_records_a_gpu_layer_error_with_its_class(tmp_path, capsys, monkeypatch):
    use_recorded_processes(monkeypatch)
    fake = make_fake_nvml("loaded")
    fake.fake.lost = {0}
    monkeypatch.setattr(G, "pynvml", fake)
    result = run_main(stop, _nothing_to_stop(tmp_path, timeout_s=5, backend="nvml"), capsys)
    assert not result.get("failed")
    waited = result["gpu_wait"]
    assert waited["ready"] is False and waited["error_class"] == "gpu_lost" and waited["msg"]


def test_gpu_wait_bad_option_is_recorded_not_raised(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    result = run_main(stop, _nothing_to_stop(tmp_path, poll_interval_ms=0), capsys)
    assert result["gpu_wait"]["error_class"] == "bad_option"
    assert "poll_interval_ms" in result["gpu_wait"]["msg"]


def test_gpu_wait_is_skipped_in_check_mode(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    args = dict(_nothing_to_stop(tmp_path, timeout_s=5), _ansible_check_mode=True)
    assert "gpu_wait" not in run_main(stop, args, capsys)


# ---------------------------------------------------------------------------------------------------
# start_after: the new server starts in the stop's own call once GPU memory was seen released
# ---------------------------------------------------------------------------------------------------
def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_spec(tmp_path, code, port=None, **extra):
    return dict({"argv": [sys.executable, "-c", code], "log_file": str(tmp_path / "new.log"),
                 "pid_file": str(tmp_path / "new.pid"), "port": port or _free_port(), "chdir": str(tmp_path)},
                **extra)


def _end(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def test_start_after_starts_the_new_server_once_memory_is_free(unique_title, tmp_path, capsys, monkeypatch):
    use_recorded_processes(monkeypatch)
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    old = _start_titled(unique_title)
    key = "sk-stop-start-after-unit-9d1e"
    # The "new server" records its argv and one NCCL variable, then sleeps like a loading server.
    code = ("import os, sys, time; print('new', sys.argv[-2:], os.environ.get('NCCL_PROTO'), flush=True); "
            "time.sleep(30)")
    with open(tmp_path / "new.log", "w") as fh:
        fh.write("earlier launch\n")
    args = dict(_nothing_to_stop(tmp_path, poll_interval_ms=10, timeout_s=5), pattern=re.escape(unique_title),
                grace_s=5, start_after=_start_spec(tmp_path, code, env={"NCCL_PROTO": "Simple"}, api_key=key))
    try:
        result = run_main(stop, args, capsys)
        old.wait(timeout=5)
        start = result["start"]
        assert result["done"] and result["changed"] and start["started"] is True
        # The old server was gone and the memory free before the new one started (target clock).
        assert start["started_at"] >= result["gpu_wait"]["started_at"] >= result["started_at"]
        assert int((tmp_path / "new.pid").read_text()) == start["pid"]
        assert start["log_offset"] == len("earlier launch\n")
        deadline = time.time() + 10
        while "new" not in (tmp_path / "new.log").read_text() and time.time() < deadline:
            time.sleep(0.05)
        line = (tmp_path / "new.log").read_text().splitlines()[-1]
        assert line == "new ['--api-key', '%s'] Simple" % key
        # The key reaches the process only: never the module's result.
        assert key not in json.dumps(result) and "--api-key" not in start["argv"]
        # The new server leads its own session under the reaper, as sglang_process starts it.
        assert os.getsid(start["pid"]) == start["pid"]
    finally:
        if old.poll() is None:
            old.kill()
        if (tmp_path / "new.pid").exists():
            _end(int((tmp_path / "new.pid").read_text()))


def test_start_after_leaves_a_held_port_to_the_launch(tmp_path, capsys, monkeypatch):
    import socket
    use_recorded_processes(monkeypatch)
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        args = dict(_nothing_to_stop(tmp_path, timeout_s=5),
                    start_after=_start_spec(tmp_path, "import time; time.sleep(30)", port=port))
        result = run_main(stop, args, capsys)
    finally:
        holder.close()
    assert not result.get("failed") and result["done"]
    assert result["start"]["started"] is False
    assert result["start"]["reason"].startswith("port %d taken by pid %d" % (port, os.getpid()))
    assert not (tmp_path / "new.pid").exists() and not (tmp_path / "new.log").exists()


def test_start_after_starts_nothing_while_memory_is_held(tmp_path, capsys, monkeypatch):
    use_recorded_processes(monkeypatch)
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("loaded"))
    args = dict(_nothing_to_stop(tmp_path, timeout_s=60, slice_s=0.2, poll_interval_ms=50),
                start_after=_start_spec(tmp_path, "import time; time.sleep(30)"))
    result = run_main(stop, args, capsys)
    assert not result.get("failed") and result["gpu_wait"]["ready"] is False
    assert result["start"]["started"] is False
    assert result["start"]["reason"].startswith("GPU memory not seen released by this call")
    assert not (tmp_path / "new.pid").exists()


def test_start_after_reports_a_failed_start_without_failing_the_stop(tmp_path, capsys, monkeypatch):
    use_recorded_processes(monkeypatch)
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    spec = _start_spec(tmp_path, "pass")
    spec["argv"] = [str(tmp_path / "no-such-launcher")]
    result = run_main(stop, dict(_nothing_to_stop(tmp_path, timeout_s=5), start_after=spec), capsys)
    assert not result.get("failed") and result["done"]
    assert result["start"]["started"] is False
    assert result["start"]["reason"].startswith("could not start %s" % spec["argv"][0])
    assert not (tmp_path / "new.pid").exists()


def test_start_after_is_not_used_in_check_mode_and_needs_gpu_wait(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    spec = _start_spec(tmp_path, "import time; time.sleep(30)")
    args = dict(_nothing_to_stop(tmp_path, timeout_s=5), start_after=spec, _ansible_check_mode=True)
    assert "start" not in run_main(stop, args, capsys)
    assert not (tmp_path / "new.pid").exists()
    args = {"pattern": "no-such-title-" + uuid.uuid4().hex, "shm_dir": str(tmp_path), "start_after": spec}
    result = run_main(stop, args, capsys)
    assert result["failed"] and "gpu_wait" in result["msg"] and "start_after" in result["msg"]
    assert not (tmp_path / "new.pid").exists()


def test_start_after_starts_the_server_in_the_call_that_ends_a_sliced_stop(unique_title, tmp_path, capsys,
                                                                          monkeypatch):
    use_recorded_processes(monkeypatch)
    monkeypatch.setattr(G, "pynvml", make_fake_nvml("idle"))
    old = _start_titled(unique_title, ignore_term=True)
    args = dict(_nothing_to_stop(tmp_path, poll_interval_ms=10, timeout_s=5), pattern=re.escape(unique_title),
                grace_s=4, kill_timeout_s=5, slice_s=0.2,
                start_after=_start_spec(tmp_path, "import time; time.sleep(30)"))
    try:
        first = run_main(stop, args, capsys)
        # The slice ended while the grace runs: nothing started yet, the old server still holds its place.
        assert first["done"] is False and "start" not in first, first.get("progress")
        assert not (tmp_path / "new.pid").exists()
        result = first
        for _ in range(200):
            result = registered(run_main(stop, dict(args, resume=registered(result)), capsys))
            if result["done"]:
                break
        old.wait(timeout=5)
        assert result["done"] and result["signalled"][0]["ended"] == "after SIGKILL"
        start = result["start"]
        assert start["started"] is True and int((tmp_path / "new.pid").read_text()) == start["pid"]
        assert start["started_at"] >= result["gpu_wait"]["started_at"]
    finally:
        if old.poll() is None:
            old.kill()
        if (tmp_path / "new.pid").exists():
            _end(int((tmp_path / "new.pid").read_text()))


def test_shm_holders_skips_a_process_that_ends_while_read_and_keeps_an_unreadable_ones_segments(tmp_path, monkeypatch):
    """Reading /proc/<pid>/maps of a process that exits meanwhile raises ESRCH (ProcessLookupError): that process
    holds nothing and the stop goes on; any other read error counts the process as unreadable (its owner's
    segments are kept), as a permission error does."""
    import errno
    proc = tmp_path / "proc"
    shm = "/dev/shm-test"
    for pid, line in ((100, shm + "/nccl-a\n"), (101, ""), (102, ""), (103, shm + "/nccl-b\n")):
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "maps").write_text("7f00-7f01 rw-s 0 00:1 1 " + line if line else "")
    real_open = open

    def fake_open(path, *a, **kw):
        if path.endswith("/101/maps"):
            raise ProcessLookupError(errno.ESRCH, "No such process")
        if path.endswith("/102/maps"):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, *a, **kw)
    monkeypatch.setattr(stop_plan, "open", fake_open, raising=False)
    holders, unreadable = stop.shm_holders(shm, proc_root=str(proc))
    assert holders == {shm + "/nccl-a": {100}, shm + "/nccl-b": {103}}
    assert {pid for pid, _uid in unreadable} == {102}


def test_a_segment_that_cannot_be_removed_is_kept_and_named_not_a_failed_stop(tmp_path, capsys):
    """A directory matching a segment pattern in shm_dir (os.unlink: EISDIR) is reported in kept_shm with the
    reason; the stale file next to it is removed and the stop succeeds."""
    (tmp_path / "nccl-dir").mkdir()
    (tmp_path / "nccl-stale").write_bytes(b"x")
    result = run_main(stop, {"pattern": "no-such-title-" + uuid.uuid4().hex, "pid_file": str(tmp_path / "x.pid"),
                             "shm_dir": str(tmp_path)}, capsys)
    assert not result.get("failed"), result
    assert result["removed_shm"] == [str(tmp_path / "nccl-stale")]
    assert [(k["path"], k["reason"].startswith("could not remove: ")) for k in result["kept_shm"]] == [
        (str(tmp_path / "nccl-dir"), True)]
    assert (tmp_path / "nccl-dir").is_dir() and not (tmp_path / "nccl-stale").exists()
