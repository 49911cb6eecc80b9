"""module_utils/gpufleet_pid_file.py: the one pid-file reader, and what each of its callers makes of each case."""
import os

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_environ as environ
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_managed_server as managed
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_pid_file as P
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_process_states as proc_states
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_stop_plan as stop_plan


ME = os.getpid()


class _Me(object):
    """Stands for this test process's pid in the tables (a literal pid would differ between xdist workers)."""

    def __repr__(self):
        return "ME"


THIS_PID = _Me()


def want(expected):
    return ME if expected is THIS_PID else expected


def pid_file(tmp_path, case):
    """The path of a pid file in state ``case``."""
    path = tmp_path / "sglang.pid"
    if case == "missing":
        return str(path)
    if case == "not_a_dir":
        (tmp_path / "file").write_text("x")
        return str(tmp_path / "file" / "sglang.pid")
    if case == "unreadable":  # a directory: open() fails with EISDIR, also for root
        path.mkdir()
        return str(path)
    path.write_bytes({"empty": b"", "blank": b" \n\t\n", "garbage": b"not a pid", "negative": b"-5\n",
                      "zero": b"0\n", "two": b"12 34\n", "plus": b"+12\n", "binary": b"\xff\xfe\x00",
                      "digits_unicode": "\u00b2\n".encode(), "newline": b"%d\n" % ME,
                      "spaces": b"  %d \t\n\n" % ME, "bare": b"%d" % ME}[case])
    return str(path)


@pytest.mark.parametrize("case,problem,pid", [
    ("missing", P.MISSING, None),
    ("not_a_dir", P.MISSING, None),
    ("unreadable", P.UNREADABLE, None),
    ("empty", P.EMPTY, None),
    ("blank", P.EMPTY, None),
    ("garbage", P.GARBAGE, None),
    ("negative", P.GARBAGE, None),
    ("zero", P.GARBAGE, None),
    ("two", P.GARBAGE, None),
    ("plus", P.GARBAGE, None),
    ("binary", P.GARBAGE, None),
    ("digits_unicode", P.GARBAGE, None),
    ("newline", None, THIS_PID),
    ("spaces", None, THIS_PID),
    ("bare", None, THIS_PID),
])
def test_reader_says_what_the_file_holds(tmp_path, case, problem, pid):
    read = P.read_pid_file(pid_file(tmp_path, case))
    assert (read.problem, read.pid, read.ok) == (problem, want(pid), problem is None)
    assert (read.error is None) == (problem is None)
    if problem in (P.EMPTY, P.GARBAGE) and case != "binary":
        assert read.error.startswith("pid file %s does not hold a pid: " % read.path)
    if problem in (None, P.EMPTY, P.GARBAGE) and case != "binary":
        assert abs(read.mtime - os.stat(read.path).st_mtime) < 1e-6
    else:
        assert read.mtime is None


def test_reader_quotes_the_garbage_and_the_os_error(tmp_path):
    assert P.read_pid_file(pid_file(tmp_path, "negative")).error.endswith("does not hold a pid: '-5'")
    assert "No such file or directory" in P.read_pid_file(str(tmp_path / "absent")).error
    (tmp_path / "sub").mkdir()
    assert "Is a directory" in P.read_pid_file(pid_file(tmp_path / "sub", "unreadable")).error


# What each caller does with each case: None = nothing special (no pid), an int = that pid, a string = the
# message (part) it fails with.
MANAGED = {"missing": None, "empty": None, "garbage": None, "zero": None, "negative": None, "newline": THIS_PID,
           "spaces": THIS_PID, "unreadable": "cannot read pid file "}
STOP = {"missing": None, "empty": "does not hold a pid: ''; remove it after checking",
        "garbage": "does not hold a pid: 'not a pid'; remove it after checking", "zero": "does not hold a pid: '0'",
        "negative": "does not hold a pid: '-5'", "unreadable": "cannot read pid file "}
WORKERS = {"missing": "(is the server running?)", "empty": "does not hold a pid: ''",
           "garbage": "does not hold a pid: 'not a pid'", "zero": "does not hold a pid: '0'",
           "negative": "does not hold a pid: '-5'", "newline": THIS_PID, "spaces": THIS_PID,
           "unreadable": "(is the server running?)"}
FIND_PID = {"missing": "was the server started?", "empty": "does not hold a pid: ''",
            "garbage": "does not hold a pid: 'not a pid'", "zero": "does not hold a pid: '0'",
            "negative": "does not hold a pid: '-5'", "newline": THIS_PID, "spaces": THIS_PID,
            "unreadable": "was the server started?"}
RUNNING = {"missing": None, "empty": None, "garbage": None, "zero": None, "negative": None, "newline": THIS_PID,
           "spaces": THIS_PID, "unreadable": "Is a directory"}


def outcome(call, exceptions):
    try:
        return call()
    except exceptions as exc:
        return getattr(exc, "msg", None) or str(exc)


def check(expected, got):
    expected = want(expected)
    if isinstance(expected, str):
        assert isinstance(got, str) and expected in got, got
    else:
        assert got == expected


@pytest.mark.parametrize("case", sorted(MANAGED))
def test_host_read_takes_a_bad_pid_file_as_no_server(tmp_path, case):
    got = outcome(lambda: managed.find_managed_server(pid_file=pid_file(tmp_path, case))["managed_pid"],
                  managed.ServerFindError)
    check(MANAGED[case], got)


@pytest.mark.parametrize("case", sorted(STOP))
def test_stop_refuses_a_pid_file_it_cannot_trust(tmp_path, case):
    result = stop_plan.new_result(["nobody"])
    got = outcome(lambda: stop_plan.choose(pid_file(tmp_path, case), ["nobody"], r"\Anever-matches-%d\Z" % ME,
                                           stop_plan.PROTECT_PATTERN, result) or None,
                  stop_plan.StopPlanError)
    check(STOP[case], got)
    if STOP[case] is None:
        assert result["main_pid"] is None


@pytest.mark.parametrize("case", sorted(WORKERS))
def test_worker_read_needs_a_pid(tmp_path, case):
    pytest.importorskip("psutil")
    got = outcome(lambda: environ.read_workers(pid_file=pid_file(tmp_path, case))["server_pid"],
                  environ.WorkerEnvError)
    check(WORKERS[case], got)


@pytest.mark.parametrize("case", sorted(FIND_PID))
def test_ready_and_verified_need_a_pid(tmp_path, case):
    got = outcome(lambda: proc_states.find_pid({"pid": None, "pid_file": pid_file(tmp_path, case)}, None),
                  proc_states.PidError)
    check(FIND_PID[case], got)


@pytest.mark.parametrize("case", sorted(RUNNING))
def test_launch_counts_only_a_live_pid_as_running(tmp_path, case):
    got = outcome(lambda: proc_states.running_pid(pid_file(tmp_path, case)), OSError)
    check(RUNNING[case], got)
