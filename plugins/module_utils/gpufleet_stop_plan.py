# -*- coding: utf-8 -*-
# gpufleet: what the stop ends (the server from its pid file, its process tree, leftovers by pattern) and which
# /dev/shm segments it removes, read from /proc; and the signalling itself. Plain functions (moved here from
# sglang_stop, unchanged): sglang_stop stops with them, and plan_stop() is its check-mode preview, which
# sglang_preflight_info returns as its stop preview: one implementation for both.
from __future__ import annotations

import fnmatch
import os
import re
import signal
import time
import traceback

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_pid_file import (
    EMPTY, GARBAGE, UNREADABLE, read_pid_file)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import sglang_bystander
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_argv

try:
    import psutil
except ImportError:  # reported through missing_required_lib in main()
    psutil = None
    PSUTIL_IMPORT_ERROR = traceback.format_exc()
else:
    PSUTIL_IMPORT_ERROR = None

SGLANG_PATTERN = r"sglang::.*|sglang\.[\w.]+|([^ ]*/)?sglang serve|([^ ]*/)?sglang/launch_server\.py"
PROTECT_PATTERN = r"nvidia-persistenced|nv-hostengine|dcgm|exporter|nvidia-smi|nvidia-fabricmanager"
# A pid file is written right after the process started (sglang_process); a process created noticeably
# later than the file is a different process that reused the pid.
PID_REUSE_SLACK_S = 5.0
# Interpreters whose argv is parsed for -m / a script (python, python3, python3.11, pypy3, ...).
_INTERPRETER_RE = re.compile(r"^(python|pypy)[0-9.]*[a-z]*$")
# Python options that take a value (the value may be glued on: -Xdev, -Wignore); -m and -c end the options.
_PY_VALUE_OPTS = "XW"
_PY_LONG_VALUE_OPTS = ("--check-hash-based-pycs",)
PROGRESS_NAMES = 5  # processes named in a progress line


# ---------------------------------------------------------------------------------------------------
# /proc readers (no psutil: they must work on defunct processes and per thread)
# ---------------------------------------------------------------------------------------------------
def read_stat(path):
    """(state letter, start time in clock ticks) from a /proc/<pid>[/task/<tid>]/stat file, None if unreadable.

    Fields after the ``comm`` in parentheses: state is field 3, starttime field 22 (proc(5)).
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        rest = data.rsplit(b") ", 1)[1].split()
        return rest[0].decode(), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def live_threads(pid, proc_root="/proc"):
    """Thread ids of ``pid`` that have not exited (``/proc/<pid>/task/<tid>/stat`` state not Z, X or x)."""
    base = os.path.join(proc_root, str(pid), "task")
    try:
        tids = [t for t in os.listdir(base) if t.isdigit()]
    except OSError:
        return []
    out = []
    for tid in sorted(tids, key=int):
        st = read_stat(os.path.join(base, tid, "stat"))
        if st and st[0] not in "ZXx":
            out.append(int(tid))
    return out


def process_alive(pid, start_ticks=None, proc_root="/proc"):
    """Whether ``pid`` (the same process: ``start_ticks`` equal, when given) still exists and can hold anything.

    A defunct thread-group leader (state Z) whose other threads still run is alive: it keeps its memory, fds and
    GPU contexts until the last thread exits. A plain zombie (all threads ended) only awaits its parent's wait().
    """
    st = read_stat(os.path.join(proc_root, str(pid), "stat"))
    if st is None:
        return False
    state, ticks = st
    if start_ticks is not None and ticks != int(start_ticks):
        return False  # the pid was reused
    if state not in "ZXx":
        return True
    return bool(live_threads(pid, proc_root))


def read_argv(pid, proc_root="/proc", tid=None):
    """Argument vector of ``pid`` (of thread ``tid``'s view when given) as a list of str.

    ``/proc/<pid>/cmdline`` holds argv NUL-separated. setproctitle (SGLang's titles) writes the whole title into
    argv[0] and NULs after it: a single element holding spaces is split on whitespace, so a retitled
    ``/venv/bin/python -m sglang.launch_server --port 1`` reads like the original argv. Invalid UTF-8 becomes
    ``\\xNN``. [] when gone or unreadable, or for a defunct leader (its own mm is gone: read a thread's).
    """
    path = (os.path.join(proc_root, str(pid), "cmdline") if tid is None
            else os.path.join(proc_root, str(pid), "task", str(tid), "cmdline"))
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError:
        return []
    parts = [p.decode("utf-8", "backslashreplace") for p in raw.rstrip(b"\0").split(b"\0")] if raw.strip(b"\0") else []
    if len(parts) == 1 and " " in parts[0].strip():
        parts = parts[0].split()
    return parts


def program_name(argv):
    """(program, subcommand) of an argument vector, as used to decide whether a process runs SGLang.

    program: argv[0] when it is a ``sglang::`` title; for a Python interpreter the module after ``-m``, None for
    ``-c`` or code from stdin, else the script path (the first argument that is not an interpreter option);
    otherwise argv[0]. subcommand: the argument after the program (after the module or script for
    interpreters) when it does not start with ``-``, else None. ``(None, None)`` for an empty argv.
    """
    if not argv:
        return None, None
    first = argv[0]
    if first.startswith("sglang::"):
        return first, None
    if not _INTERPRETER_RE.match(os.path.basename(first)):
        return first, _subcommand(argv, 1)
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg == "-":
            return None, None  # program from stdin
        if arg.startswith("--"):
            i += 2 if (arg in _PY_LONG_VALUE_OPTS) else 1
            continue
        if arg.startswith("-"):
            skip_next = False
            for j in range(1, len(arg)):
                letter, glued = arg[j], arg[j + 1:]
                if letter == "m":
                    if glued:
                        return glued, _subcommand(argv, i + 1)
                    return (argv[i + 1] if i + 1 < len(argv) else None), _subcommand(argv, i + 2)
                if letter == "c":
                    return None, None
                if letter in _PY_VALUE_OPTS:
                    skip_next = not glued
                    break
            i += 2 if skip_next else 1
            continue
        break
    if i < len(argv):
        return argv[i], _subcommand(argv, i + 1)
    return first, None  # a bare interpreter (REPL)


def _subcommand(argv, index):
    if index < len(argv) and argv[index] and not argv[index].startswith("-"):
        return argv[index]
    return None


def runs_sglang(argv, pattern_re):
    """The name under which ``argv`` matched ``pattern_re`` (re.fullmatch), or None.

    Tried: the program name, then ``program + " " + subcommand`` (see :func:`program_name`).
    """
    program, sub = program_name(argv)
    if not program:
        return None
    for name in (program, "%s %s" % (program, sub) if sub else None):
        if name and pattern_re.fullmatch(name):
            return name
    return None


# ---------------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------------
class Proc(object):
    """Snapshot of one process.

    pid, ppid, pgid, sid, uid (int), user (str), cmdline (str, arguments joined by spaces), argv (list of str),
    create_time (epoch s), start_ticks (clock ticks after boot, /proc stat field 22), defunct (bool: leader
    exited, other threads live).
    """

    __slots__ = ("pid", "ppid", "pgid", "sid", "uid", "user", "cmdline", "argv", "create_time", "start_ticks",
                 "defunct")

    def __init__(self, pid, ppid, pgid, sid, uid, user, cmdline, create_time, argv=None, start_ticks=None,
                 defunct=False):
        self.pid, self.ppid, self.pgid, self.sid = pid, ppid, pgid, sid
        self.uid, self.user, self.cmdline, self.create_time = uid, user, cmdline, create_time
        self.argv = list(argv) if argv is not None else cmdline.split()
        self.start_ticks = start_ticks
        self.defunct = defunct

    def __repr__(self):
        return "Proc(pid=%d, user=%s, cmdline=%r%s)" % (self.pid, self.user, self.cmdline,
                                                        ", defunct" if self.defunct else "")


def snapshot(proc_root="/proc"):
    """List of Proc for every process visible now that can still hold anything.

    psutil gives owner and create time; /proc gives argv, state and start ticks. Plain zombies are left out
    (they hold no memory, devices or segments); a defunct leader with live threads is kept (``defunct``) with the
    argv of its first live thread.
    """
    procs = []
    for handle in psutil.process_iter(["pid", "ppid", "uids", "username", "create_time", "name"]):
        info = handle.info
        pid = info["pid"]
        st = read_stat(os.path.join(proc_root, str(pid), "stat"))
        if st is None:
            continue
        defunct = False
        argv = read_argv(pid, proc_root)
        if st[0] in "ZXx":
            threads = live_threads(pid, proc_root)
            if not threads:
                continue
            defunct = True
            argv = read_argv(pid, proc_root, tid=threads[0])
        try:
            pgid = os.getpgid(pid)
            sid = os.getsid(pid)
        except OSError:
            continue
        cmdline = " ".join(redact_argv(argv)) if argv else "[%s]" % (info.get("name") or "")
        uids = info.get("uids")
        procs.append(Proc(pid, info.get("ppid") or 0, pgid, sid, uids.real if uids else -1,
                          info.get("username") or "", cmdline, info.get("create_time") or 0.0, argv=argv,
                          start_ticks=st[1], defunct=defunct))
    return procs


def protected_pids(self_pid=None):
    """This module's pid and all its ancestors (never signalled)."""
    me = psutil.Process(self_pid or os.getpid())
    pids = {me.pid}
    for parent in me.parents():
        pids.add(parent.pid)
    return pids


def select_server(procs, main_pid, user_set, protected, protect_re):
    """Targets of the server itself: the pid-file process, its session/process-group members, and its other
    descendants (a child that left the group with setsid, found through the ppid chain).

    Returns a list of (Proc, reason), reason ``pid_file``, ``process_group`` or ``process_tree``. Filters: owner
    in ``user_set`` (set of user names), pid not in ``protected``, command line not matching ``protect_re``.
    """
    parent = {proc.pid: proc.ppid for proc in procs}

    def descends(pid):
        seen = set()
        while pid and pid not in seen:
            seen.add(pid)
            pid = parent.get(pid)
            if pid == main_pid:
                return True
        return False

    chosen = []
    for proc in procs:
        if proc.pid == main_pid:
            reason = "pid_file"
        elif main_pid and (proc.pgid == main_pid or proc.sid == main_pid):
            reason = "process_group"
        elif main_pid and descends(proc.pid):
            reason = "process_tree"
        else:
            continue
        if _allowed(proc, user_set, protected, protect_re):
            chosen.append((proc, reason))
    return chosen


def select_leftovers(procs, pattern_re, user_set, protected, protect_re, skip=(), kept=None):
    """Processes that run SGLang (:func:`runs_sglang` with ``pattern_re``), orphans and defunct ones included.

    Same filters as select_server; pids in ``skip`` (already chosen) are left out. A router or a client that the
    pattern matches (``sglang::router``, ``-m sglang.bench_serving``: gpufleet_procs ``sglang_bystander``) is never
    a leftover, whatever the pattern: it is appended to ``kept`` (a list, when given) as ``{pid, cmdline, user,
    kind}``. Returns [(Proc, "pattern")].
    """
    chosen = []
    for proc in procs:
        if proc.pid in skip or not runs_sglang(proc.argv, pattern_re) or not _allowed(proc, user_set, protected,
                                                                                      protect_re):
            continue
        kind = sglang_bystander(*program_name(proc.argv))
        if kind:
            if kept is not None:
                kept.append({"pid": proc.pid, "cmdline": proc.cmdline, "user": proc.user, "kind": kind})
            continue
        chosen.append((proc, "pattern"))
    return chosen


def kept_note(kept):
    """``kept: router pid 12, client pid 34`` for the routers and clients a stop left alone ('' for none)."""
    return ("kept: " + ", ".join("%s pid %d" % (k["kind"], k["pid"]) for k in kept)) if kept else ""


def _allowed(proc, user_set, protected, protect_re):
    if proc.pid in protected or proc.pid <= 1:
        return False
    if proc.user not in user_set:
        return False
    if protect_re.search(proc.cmdline):
        return False
    return True


def pid_file_process(procs, pid, mtime):
    """The Proc the pid file names, or None if gone or created after the file (pid reused)."""
    for proc in procs:
        if proc.pid == pid:
            if proc.create_time > mtime + PID_REUSE_SLACK_S:
                return None
            return proc
    return None


# ---------------------------------------------------------------------------------------------------
# signalling and waiting
# ---------------------------------------------------------------------------------------------------
def entry_for(proc, reason, ended):
    """The ``signalled`` result entry of a chosen process (see RETURN)."""
    return {"pid": proc.pid, "cmdline": proc.cmdline, "user": proc.user, "reason": reason,
            "defunct": bool(proc.defunct), "start_ticks": proc.start_ticks, "signals": [], "ended": ended,
            "wait_ms": None}


def send(entry, signum, proc_root="/proc"):
    """Send ``signum`` to the entry's process if it is still the same process; record it in ``signals``."""
    if process_alive(entry["pid"], entry.get("start_ticks"), proc_root):
        try:
            os.kill(entry["pid"], signum)
        except ProcessLookupError:
            pass
    entry["signals"].append(signal.Signals(signum).name)


def signal_all(chosen):
    """SIGTERM every chosen process at once; SIGKILL at once a defunct one (no main thread runs its handler).

    ``chosen``: list of (Proc, reason). Returns the ``signalled`` entries, ``ended`` = ``waiting``.
    """
    entries = [entry_for(proc, reason, "waiting") for proc, reason in chosen]
    for entry in entries:
        send(entry, signal.SIGKILL if entry["defunct"] else signal.SIGTERM)
    return entries


def poll_gone(entries, until, started_at, poll_s, now=time.time, sleep=time.sleep, proc_root="/proc"):
    """Poll the ``waiting`` entries every ``poll_s`` until all are gone or the clock passes ``until`` (epoch s).

    Entries seen gone get ``ended`` = ``after SIGKILL`` when SIGKILL was sent, else ``after SIGTERM``, and
    ``wait_ms`` from ``started_at``. Returns the entries still alive.
    """
    while True:
        alive = []
        for entry in entries:
            if entry["ended"] != "waiting":
                continue
            if process_alive(entry["pid"], entry.get("start_ticks"), proc_root):
                alive.append(entry)
            else:
                entry["ended"] = "after SIGKILL" if "SIGKILL" in entry["signals"] else "after SIGTERM"
                entry["wait_ms"] = max(0, int((now() - started_at) * 1000))
        left = until - now()
        if not alive or left <= 0:
            return alive
        sleep(min(poll_s, left))


def progress_line(entries, started_at, grace_s, now):
    """``waiting for N of M processes to exit after SIGTERM: pid P title, ...; E s of G s grace, then SIGKILL``."""
    waiting = [e for e in entries if e["ended"] == "waiting"]
    elapsed = max(0.0, now - started_at)
    if not waiting:
        return "all %d signalled processes exited after %.1f s" % (len(entries), elapsed)
    names = ", ".join("pid %d %s" % (e["pid"], e["cmdline"][:60]) for e in waiting[:PROGRESS_NAMES])
    more = " and %d more" % (len(waiting) - PROGRESS_NAMES) if len(waiting) > PROGRESS_NAMES else ""
    return ("waiting for %d of %d processes to exit after SIGTERM: %s%s; %.0f s of %.0f s grace, then SIGKILL"
            % (len(waiting), len(entries), names, more, elapsed, grace_s))


def kill_survivors(entries, kill_timeout_s, started_at, poll_s, now=time.time, sleep=time.sleep):
    """SIGKILL the ``waiting`` entries, wait up to ``kill_timeout_s``; survivors get ``still running``."""
    alive = [e for e in entries if e["ended"] == "waiting"]
    for entry in alive:
        if "SIGKILL" not in entry["signals"]:
            send(entry, signal.SIGKILL)
    left = poll_gone(alive, now() + kill_timeout_s, started_at, poll_s, now=now, sleep=sleep)
    for entry in left:
        entry["ended"] = "still running"
    return left


# ---------------------------------------------------------------------------------------------------
# shared memory
# ---------------------------------------------------------------------------------------------------
def shm_holders(shm_dir, pids=None, proc_root="/proc"):
    """Map path under ``shm_dir`` → set of pids that map it (/proc/<pid>/maps) or hold it open (/proc/<pid>/fd).

    Also returns the set of pids whose maps/fds could not be read (other users without privilege, any read error
    but the process's end), so callers can keep segments such processes might hold. A process that ends while it
    is read (ENOENT, ESRCH) is left out. Returns (holders dict, unreadable set of (pid, uid)).
    """
    prefix = shm_dir.rstrip("/") + "/"
    holders = {}
    unreadable = set()
    if pids is None:
        pids = [int(p) for p in os.listdir(proc_root) if p.isdigit()]
    for pid in pids:
        base = os.path.join(proc_root, str(pid))
        try:
            with open(os.path.join(base, "maps"), "rb") as handle:
                for line in handle:
                    idx = line.find(prefix.encode())
                    if idx >= 0:
                        path = line[idx:].rstrip(b"\n").decode("utf-8", "surrogateescape")
                        if path.endswith(" (deleted)"):
                            continue
                        holders.setdefault(path, set()).add(pid)
            fd_dir = os.path.join(base, "fd")
            for fd in os.listdir(fd_dir):
                try:
                    target = os.readlink(os.path.join(fd_dir, fd))
                except OSError:
                    continue
                if target.startswith(prefix):
                    holders.setdefault(target, set()).add(pid)
        except (FileNotFoundError, ProcessLookupError):
            # Gone: ENOENT at open, ESRCH when the process exits while its maps are read (a stop in the 64-host
            # lab under load failed on it: "[Errno 3] No such process"). An ended process holds nothing.
            continue
        except OSError as exc:
            if isinstance(exc, PermissionError) and pid == 1:
                # An init never maps NCCL/CUDA segments; in containers its maps are often unreadable even to
                # root, which would otherwise keep every segment forever.
                continue
            # Not readable (no privilege, or another error): the segments its owner might hold are kept.
            try:
                uid = os.stat(base).st_uid
            except OSError:
                continue
            unreadable.add((pid, uid))
    return holders, unreadable


def stale_segments(shm_dir, patterns, uid_set, holders, unreadable):
    """Split matching segments into (removable paths, kept [{path, holders, reason}]).

    A segment is removable when it matches one of ``patterns``, its owner uid is in ``uid_set``, no pid in
    ``holders`` has it, and no unreadable process of the same owner could hold it.
    """
    removable, kept = [], []
    try:
        names = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return removable, kept
    unreadable_uids = {uid for _pid, uid in unreadable}
    for name in names:
        if not any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid not in uid_set:
            kept.append({"path": path, "holders": [], "reason": "owned by uid %d, not a managed user" % st.st_uid})
        elif holders.get(path):
            kept.append({"path": path, "holders": sorted(holders[path]), "reason": "held"})
        elif st.st_uid in unreadable_uids:
            kept.append({"path": path, "holders": [], "reason": "a process of the owner could not be inspected"})
        else:
            removable.append(path)
    return removable, kept


def _user_uids(users):
    import pwd
    uids = set()
    for user in users:
        try:
            uids.add(pwd.getpwnam(user).pw_uid)
        except KeyError:
            pass
    return uids


class StopPlanError(Exception):
    """The stop cannot be planned: ``msg``, and ``result`` the module result so far."""

    def __init__(self, msg, result):
        super(StopPlanError, self).__init__(msg)
        self.msg = msg
        self.result = result


def choose(pid_file, users, pattern, protect_pattern, result):
    """What the stop ends, as [(Proc, reason)]: the pid file's server with its process tree, then leftovers
    matching ``pattern``; fills ``result`` (main_pid, kept). Raises StopPlanError."""
    user_set = set(users)
    try:
        pattern_re = re.compile(pattern)
        protect_re = re.compile(protect_pattern)
    except re.error as exc:
        raise StopPlanError("invalid regular expression in pattern/protect_pattern: %s" % exc, result)
    procs = snapshot()
    protected = protected_pids()
    main = None
    if pid_file:
        read = read_pid_file(pid_file)
        if read.problem in (EMPTY, GARBAGE):
            raise StopPlanError("%s; remove it after checking no SGLang server runs" % read.error, result)
        if read.problem == UNREADABLE:
            raise StopPlanError("cannot read pid file %s: %s" % (pid_file, read.error), result)
        pid, mtime = read.pid, read.mtime
        if pid is not None:
            main = pid_file_process(procs, pid, mtime)
            if main is not None and not _allowed(main, user_set, protected, protect_re):
                raise StopPlanError("pid file %s names pid %d (%s, user %s), which this module may not signal "
                                    "(user not in %s or protected); check the pid file and the users option"
                                    % (pid_file, pid, main.cmdline, main.user, users), result)
            result["main_pid"] = main.pid if main else None
    chosen = select_server(procs, main.pid, user_set, protected, protect_re) if main is not None else []
    chosen += select_leftovers(procs, pattern_re, user_set, protected, protect_re,
                               skip={p.pid for p, dummy in chosen}, kept=result["kept"])
    return chosen


def shm_plan(shm_dir, shm_patterns, users):
    """(removable paths, kept entries) of the segments in ``shm_dir`` once the processes are gone."""
    holders, unreadable = shm_holders(shm_dir)
    return stale_segments(shm_dir, shm_patterns, _user_uids(users), holders, unreadable)


def new_result(users):
    return {"changed": False, "signalled": [], "removed_shm": [], "kept_shm": [], "main_pid": None,
            "pid_file_removed": False, "users": users, "done": False, "kept": []}


def default_users(users):
    import pwd
    return users or [pwd.getpwuid(os.geteuid()).pw_name]


def plan_stop(pid_file=None, users=(), pattern=SGLANG_PATTERN, protect_pattern=PROTECT_PATTERN,
              remove_stale_shm=True, shm_dir="/dev/shm", shm_patterns=("nccl-*", "cuda.shm.*", "sgl_shm_*"),
              now=time.time):
    """sglang_stop's check-mode result (what it would signal and remove; signals nothing).
    Raises StopPlanError where the stop would fail."""
    users = default_users(list(users))
    result = new_result(users)
    started_at = now()
    chosen = choose(pid_file, users, pattern, protect_pattern, result)
    entries = [entry_for(p, reason, "would signal") for p, reason in chosen]
    result["signalled"] = entries
    result["started_at"] = round(started_at, 3)
    result["pid_file_removed"] = bool(pid_file and os.path.exists(pid_file))
    if remove_stale_shm:
        result["removed_shm"], result["kept_shm"] = shm_plan(shm_dir, list(shm_patterns), users)
    result["done"] = True
    result["changed"] = bool(result["signalled"] or result["removed_shm"] or result["pid_file_removed"])
    result["stop_ms"] = 0
    result["progress"] = "would signal %d process(es)" % len(entries)
    if result["kept"]:
        result["progress"] += "; " + kept_note(result["kept"])
    return result
