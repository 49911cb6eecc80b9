# -*- coding: utf-8 -*-
# gpufleet: read the environment of SGLang's GPU workers (/proc/<pid>/environ), shared by sglang_worker_env_info
# and sglang_process state=verified.
"""Find SGLang's GPU worker processes and compare their environment with what gpufleet configured.

The source of every fact is ``/proc/<pid>/environ`` (the environment the process was started with, NUL-separated
bytes) and ``/proc/<pid>/cmdline`` (the title SGLang sets with setproctitle, e.g. ``sglang::scheduler_TP3``).
Needs ``psutil`` for the process tree (:func:`candidate_pids`); the rest is plain ``/proc`` reading.
"""
from __future__ import annotations

import os
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_pid_file import (
    MISSING, UNREADABLE, read_pid_file)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import cmdline_text

try:
    import psutil
except ImportError:  # the calling module reports it with missing_required_lib("psutil")
    psutil = None

DEFAULT_TITLE_PATTERN = r"^sglang::scheduler(_DP\d+)?_TP\d+"


# setproctitle (SGLang titles its workers with it) reuses the environ memory area for long titles, so
# /proc/<pid>/environ reads as NUL bytes unless SPT_NOENV is set (setproctitle docs, issue #16).
CLOBBERED_HINT = ("/proc/%d/environ is empty: setproctitle overwrote it; launch SGLang with SPT_NOENV=1 in its "
                  "environment (gpufleet's sglang_launch role adds it) so the environment stays readable")


def parse_environ(raw):
    """Parse /proc/<pid>/environ bytes into {name bytes: value bytes}.

    Entries are NUL-terminated ``NAME=value``; entries without ``=`` are ignored; bytes are kept as bytes so
    non-UTF-8 values survive.
    """
    env = {}
    for entry in raw.split(b"\x00"):
        if not entry:
            continue
        name, sep, value = entry.partition(b"=")
        if sep:
            env[name] = value
    return env


def read_environ(pid, proc_root="/proc"):
    """Raw environ bytes of ``pid``; raises OSError (PermissionError; FileNotFoundError or ProcessLookupError when
    the process ends before or while it is read)."""
    with open(os.path.join(proc_root, str(pid), "environ"), "rb") as handle:
        return handle.read()


def _text(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    return "" if value is None else str(value)


def compare_env(env, expected, names=()):
    """Compare parsed environ (bytes dict) with ``expected`` (name → value).

    Returns (present {name: str value}, missing [names], mismatched {name: {expected, actual}}).
    A value matches when its bytes equal the UTF-8 encoding of the expected text.
    """
    present, missing, mismatched = {}, [], {}
    wanted = list(expected) + [n for n in names if n not in expected]
    for name in wanted:
        raw = env.get(name.encode("utf-8"))
        if raw is None:
            if name in expected:
                missing.append(name)
            continue
        shown = raw.decode("utf-8", "backslashreplace")
        present[name] = shown
        if name in expected and raw != _text(expected[name]).encode("utf-8"):
            mismatched[name] = {"expected": _text(expected[name]), "actual": shown}
    return present, missing, mismatched


def candidate_pids(server_pid):
    """Descendant pids of ``server_pid`` (psutil children, recursive), or every pid when it is None."""
    if server_pid is None:
        return psutil.pids()
    try:
        return [child.pid for child in psutil.Process(server_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def inspect_workers(pids, title_re, expected, names, proc_root="/proc"):
    """Worker report entries for those of ``pids`` whose title matches ``title_re`` (compiled regex).

    Each entry: ``pid``, ``title``, ``env`` (name → value, str), ``missing`` (names), ``mismatched`` (name →
    {expected, actual}), ``match`` (bool) and, when environ could not be read or reads empty, ``error`` (str).
    Sorted by title. A process that ends between listing and reading is left out.
    """
    workers = []
    for pid in pids:
        title = cmdline_text(pid, proc_root)
        if not title or not title_re.search(title):
            continue
        entry = {"pid": pid, "title": title}
        try:
            env = parse_environ(read_environ(pid, proc_root))
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited between listing and reading (ENOENT at open, ESRCH while reading)
        except OSError as exc:
            entry.update(env={}, missing=sorted(expected), mismatched={}, match=False,
                         error="cannot read /proc/%d/environ: %s (run as root or the server's user)"
                         % (pid, exc.strerror))
            workers.append(entry)
            continue
        present, missing, mismatched = compare_env(env, expected, names)
        entry.update(env=present, missing=missing, mismatched=mismatched, match=not missing and not mismatched)
        if not env:
            entry["match"] = False
            entry["error"] = CLOBBERED_HINT % pid
        workers.append(entry)
    workers.sort(key=lambda w: (w["title"], w["pid"]))
    return workers


def worker_env_options():
    """Argument spec (a fresh dict each call) of the worker environ options ``expected``, ``names`` and
    ``title_pattern``: the sglang_worker_env_info module's options and sglang_process's ``worker_env``
    suboptions."""
    return dict(expected=dict(type="dict", default={}),
                names=dict(type="list", elements="str", default=[]),
                title_pattern=dict(type="str", default=DEFAULT_TITLE_PATTERN))


def worker_report(workers):
    """``{"workers", "worker_count", "all_match"}`` for :func:`inspect_workers` entries: all_match needs at least
    one worker and every one matching."""
    return {"workers": workers, "worker_count": len(workers),
            "all_match": bool(workers) and all(w["match"] for w in workers)}


class WorkerEnvError(Exception):
    """The workers cannot be read; ``kwargs`` are the fail_json arguments besides ``msg``."""

    def __init__(self, msg, **kwargs):
        super(WorkerEnvError, self).__init__(msg)
        self.msg = msg
        self.kwargs = kwargs


def read_workers(pid=None, pid_file=None, title_pattern=DEFAULT_TITLE_PATTERN, expected=None, names=()):
    """sglang_worker_env_info's result (without ``changed``): ``server_pid`` and :func:`worker_report` of the
    workers of server ``pid`` (or the pid in ``pid_file``; neither: every process titled like a worker). Raises
    :class:`WorkerEnvError` (a bad title_pattern, an unreadable pid file, a server that is not running)."""
    if psutil is None:
        raise WorkerEnvError("psutil is required (pip install psutil)")
    try:
        title_re = re.compile(title_pattern)
    except re.error as exc:
        raise WorkerEnvError("invalid title_pattern: %s" % exc)
    server_pid = pid
    if server_pid is None and pid_file:
        read = read_pid_file(pid_file)
        if read.problem in (MISSING, UNREADABLE):
            raise WorkerEnvError("cannot read pid file %s: %s (is the server running?)" % (pid_file, read.error))
        if not read.ok:
            raise WorkerEnvError(read.error)
        server_pid = read.pid
    if server_pid is not None and not psutil.pid_exists(server_pid):
        raise WorkerEnvError("server pid %d is not running" % server_pid, server_pid=server_pid, workers=[],
                             worker_count=0, all_match=False)
    workers = inspect_workers(candidate_pids(server_pid), title_re, expected or {}, names)
    out = {"server_pid": server_pid}
    out.update(worker_report(workers))
    return out
