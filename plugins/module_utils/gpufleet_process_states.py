# -*- coding: utf-8 -*-
# gpufleet: the states of the sglang_process module, one function each (run_started, run_ready, run_verified,
# run_port_free, run_recorded; STATES maps a state to its function), with what they share: the pid, the exit
# record, the log tail, the readiness Waiter. sglang_process's main() parses the options and dispatches here.
"""The body of each ``sglang_process`` state (see that module's DOCUMENTATION for what each one does).

Each ``run_<state>(module, p, result)`` ends the task itself (``module.exit_json``/``fail_json``), as the module's
main() did before the move; ``p`` is ``module.params``, ``result`` the common result keys main() prepared.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
import traceback

try:
    import psutil
    HAS_PSUTIL = True
    PSUTIL_ERROR = None
except ImportError:
    HAS_PSUTIL = False
    PSUTIL_ERROR = traceback.format_exc()

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_burst
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_lock
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_environ import (
    candidate_pids, inspect_workers, worker_report)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_pid_file import (
    MISSING, UNREADABLE, read_pid_file)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_text
# The start and the port check are shared with sglang_stop's start_after (module_utils gpufleet_spawn).
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_spawn import (
    WILDCARDS, describe_listeners, log_size, port_listeners, start_server, write_file_atomic)

PID_REUSE_SLACK_S = 5.0


def running_pid(pid_file):
    """Pid named by ``pid_file`` if that process is alive and not a reused pid, else None.

    Liveness: /proc/<pid> exists and is not a zombie; its start time (field 22 of /proc/<pid>/stat, in clock
    ticks since boot, proc(5)) is no later than the pid file's mtime plus a few seconds.
    A missing, empty or garbage file names no process; an unreadable one raises OSError.
    """
    read = read_pid_file(pid_file)
    if read.problem == UNREADABLE:
        raise OSError(read.error)
    if not read.ok:
        return None
    started = process_start_epoch(read.pid)
    if started is None or started > read.mtime + PID_REUSE_SLACK_S:
        return None
    return read.pid


def process_start_epoch(pid):
    """Start time of ``pid`` in seconds since the epoch, None if gone or a zombie (from /proc/<pid>/stat)."""
    try:
        with open("/proc/%d/stat" % pid) as handle:
            stat = handle.read()
        with open("/proc/stat") as handle:
            btime = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def log_tail(path, lines, offset=0):
    """Last ``lines`` lines of ``path`` after byte ``offset`` (this launch's part), undecodable bytes replaced.

    Reads at most the last 64 KiB; "" if unreadable. An offset past the end (the log was truncated or
    rotated since) reads from the start. Secrets are redacted (SGLang logs its API keys in ``server_args``);
    a line the 64 KiB window cuts is left out, so no key is shown without the name that marks it.
    """
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            if offset > size:
                offset = 0
            start = max(offset, size - 64 * 1024)
            handle.seek(start)
            data = handle.read()
    except OSError:
        return ""
    if start > offset:
        data = data.partition(b"\n")[2]
    return redact_text("\n".join(data.decode("utf-8", "replace").splitlines()[-lines:]))


def read_exit_record(exit_file, pid):
    """The reaper's record for ``pid`` in ``exit_file``: {"pid", "returncode", "started_at", "ended_at"} (epoch s).

    None when the file is absent, unreadable or about another pid.
    """
    try:
        with open(exit_file) as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("pid") == pid else None


def read_exit_file(exit_file, pid):
    """Exit status (int, negative = killed by that signal) the reaper recorded for ``pid``; None when unknown."""
    record = read_exit_record(exit_file, pid)
    return record.get("returncode") if record else None


def await_exit_file(exit_file, pid, timeout_s=2.0, poll_s=0.05):
    """:func:`read_exit_file` for a ``pid`` already seen dead: the reaper writes the record right after its
    ``wait()`` returns, which on a loaded host can come a moment after the pid is gone. None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        rc = read_exit_file(exit_file, pid)
        if rc is not None or time.monotonic() >= deadline:
            return rc
        time.sleep(poll_s)


UNIT_PROPS = ("MainPID", "ExecMainPID", "ExecMainStatus", "ExecMainCode", "ExecMainStartTimestampMonotonic",
              "ExecMainExitTimestampMonotonic", "ActiveState")


def unit_show(run_command, unit):
    """``systemctl show`` of ``unit``'s UNIT_PROPS as a dict of str (timestamps in µs of CLOCK_MONOTONIC)."""
    argv = ["systemctl", "show"]
    for name in UNIT_PROPS:
        argv += ["-p", name]
    rc, out, dummy = run_command(argv + [unit], environ_update={"LC_ALL": "C"})
    props = {}
    for line in out.splitlines():
        key, dummy, value = line.partition("=")
        props[key] = value
    return props


def unit_exit(props, dead_pid):
    """How ``dead_pid``, the unit's main process, ended, from unit_show() ``props``: a dict with ``rc`` (exit status,
    -signal for a kill or core dump, None when not known), ``elapsed_s`` (its run time, s, or None) and ``note``.

    systemd keeps ExecMainStatus/ExecMainCode of the last main process only (ExecMainPID): after Restart= ran the
    unit again they describe a later process, so they count only while ExecMainPID is ``dead_pid``.
    """
    exec_pid = int(props.get("ExecMainPID") or 0)
    exited = int(props.get("ExecMainExitTimestampMonotonic") or 0) > 0
    if exec_pid == dead_pid and not exited:
        # systemd has not processed the exit yet: ExecMainStatus still reads 0.
        return {"rc": None, "elapsed_s": None, "note": ""}
    if exec_pid != dead_pid:
        return {"rc": None, "elapsed_s": None,
                "note": ("systemd has run the unit again since, as pid %d (Restart= after a crash)" % exec_pid)
                if exec_pid > 0 else ""}
    status = props.get("ExecMainStatus", "")
    rc = int(status) if status.lstrip("-").isdigit() else None
    if rc is not None and props.get("ExecMainCode") in ("2", "3"):  # CLD_KILLED, CLD_DUMPED: status is the signal
        rc = -rc
    start, end = (int(props.get(name) or 0) for name in ("ExecMainStartTimestampMonotonic",
                                                         "ExecMainExitTimestampMonotonic"))
    return {"rc": rc, "elapsed_s": (end - start) / 1e6 if start > 0 and end >= start else None, "note": ""}


def tree_listens(pid, port):
    """True when ``pid`` or a descendant has a LISTEN socket on TCP ``port``; None when that cannot be read.

    Source: psutil.Process.net_connections / connections (per process, so only the server's tree is scanned).
    """
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    denied = False
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            denied = True
            continue
        for conn in conns:
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return True
    return None if denied else False


def pid_alive(pid):
    """True while ``pid`` runs (a zombie counts as dead: it only waits for its parent)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def probe_port(host, port, timeout_s=1.0):
    """"open" when ``host:port`` accepts a TCP connection, else the error text (e.g. "connection refused")."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "open"
    except ConnectionRefusedError:
        return "connection refused"
    except OSError as exc:
        return str(exc.strerror or exc)


def probe_url(url, timeout_s):
    """(status int or None, text): 200 when GET ``url`` answered 200, else the status or error text."""
    # Imported where HTTP is spoken: ansible.module_utils.urls (with the cryptography it pulls in) costs about
    # 0.1 s of every module start, and state=recorded and port_free never use it.
    from ansible.module_utils.urls import open_url
    try:
        # The server is on this host: never through an http_proxy from the environment.
        resp = open_url(url, method="GET", timeout=timeout_s, validate_certs=True, use_proxy=False)
        return resp.getcode(), "HTTP %s" % resp.getcode()
    except Exception as exc:  # urllib HTTPError carries a code (503 while warming up); others are text
        code = getattr(exc, "code", None)
        return code, ("HTTP %s" % code) if code else str(getattr(exc, "reason", None) or exc)


def last_log_line(path, offset, width=100):
    """The last non-empty line of this launch's log, shortened to ``width`` characters ("" if none)."""
    for line in reversed(log_tail(path, 5, offset).splitlines()) if path else []:
        line = line.strip()
        if line:
            return line if len(line) <= width else line[:width - 3] + "..."
    return ""


def renew_lock(lock_dir, lock_owner):
    """Renew the restart lock's lease (gpufleet_lock.renew_lease); None when ``lock_dir`` is not set.

    Returns True when renewed. Raises gpufleet_lock.LockLost when the lock is gone or another run holds it
    (the wait must stop: another run may be restarting this host), gpufleet_lock.LockError on I/O errors.
    """
    if not lock_dir:
        return None
    gpufleet_lock.renew_lease(lock_dir, lock_owner)
    return True


class Waiter(object):
    """One readiness slice for the server ``pid``; see the module's state=ready."""

    def __init__(self, params, pid, exit_info_of, now=time.time, monotonic=time.monotonic, sleep=time.sleep):
        self.p = params
        self.pid = pid
        self.exit_info_of = exit_info_of
        self.now, self.monotonic, self.sleep = now, monotonic, sleep
        host = params["host"] or "127.0.0.1"
        self.probe_host = "127.0.0.1" if host in WILDCARDS else host.strip("[]")
        self.what = "%s on %s:%d" % (self._path(), self.probe_host, params["port"])
        self.last = "not probed yet"

    def _path(self):
        if not self.p["url"]:
            return "port"
        rest = self.p["url"].split("://", 1)[-1]
        return "/" + rest.split("/", 1)[1] if "/" in rest else "/"

    def progress(self, elapsed_s):
        line = last_log_line(self.p["log_file"], self.p["log_offset"])
        return "waiting for %s (pid %d): %.0f s of %.0f s, last: %s%s" % (
            self.what, self.pid, elapsed_s, self.p["timeout_s"], self.last,
            ("; log: '%s'" % line) if line else "")

    def died(self, elapsed_s):
        """(msg, extra result) for a server that is gone; ``elapsed_s`` None: it was gone at the first look.

        ``exit_info_of(pid)`` gives a dict: ``rc`` (exit status, -signal, None when not known), optionally
        ``elapsed_s`` (its run time, s) and ``note`` (text after the status).
        """
        info = self.exit_info_of(self.pid)
        rc = info.get("rc")
        record = read_exit_record(self.p["exit_file"], self.pid) if self.p["exit_file"] else None
        if record and record.get("started_at") and record.get("ended_at"):
            elapsed_s = record["ended_at"] - record["started_at"]  # it may have died before this call began
        elif info.get("elapsed_s") is not None:
            elapsed_s = info["elapsed_s"]
        when = (" %.1f s after it started" % elapsed_s) if elapsed_s is not None else ""
        tail = log_tail(self.p["log_file"], self.p["log_tail_lines"], self.p["log_offset"]) if self.p["log_file"] else ""
        listeners = [item for item in port_listeners(self.p["port"], self.p["host"]) if item["pid"] != self.pid]
        holder = (" Port %d is held by %s: that is why it could not serve (SGLang exits on EADDRINUSE)."
                  % (self.p["port"], describe_listeners(listeners))) if listeners else ""
        status = ("with status %d" % rc) if rc is not None and rc >= 0 else (
            "killed by signal %d" % -rc if rc is not None else "(exit status unknown%s)" % (
                ": " + info["note"] if info.get("note") else ""))
        # The first line stands alone (callers quote only it: the launch role's failure, restart.yml's summary
        # row), so it carries the log's last line; the lines after it are for a person reading the whole message.
        last = last_log_line(self.p["log_file"], self.p["log_offset"], width=160) if self.p["log_file"] else ""
        ends = (" Its log ends: '%s'." % last) if last else (" Its log is empty." if self.p["log_file"] else "")
        msg = ("the server (pid %d) exited %s%s, before %s answered.%s%s\nLast lines of this "
               "launch's log:\n%s\nFull log: %s" % (self.pid, status, when, self.what, holder, ends,
                                                    tail or "(empty)", self.p["log_file"] or "-"))
        return msg, dict(rc=rc, log_tail=tail, listeners=listeners,
                         elapsed_s=None if elapsed_s is None else round(elapsed_s, 1))

    def run(self):
        """Returns (state, elapsed_s, extra): state in ready, waiting, died, stranger, timeout."""
        created = process_start_epoch(self.pid)
        if created is None:
            return "died", None, {}
        p = self.p
        slice_end = self.monotonic() + max(p["slice_s"], 0)
        interval = max(p["poll_interval_ms"], 10) / 1000.0
        while True:
            elapsed = self.now() - created
            if not pid_alive(self.pid):
                return "died", elapsed, {}
            port_state = probe_port(self.probe_host, p["port"], timeout_s=min(1.0, interval * 5))
            if port_state != "open":
                self.last = port_state
            else:
                ours = tree_listens(self.pid, p["port"])
                if ours is False and pid_alive(self.pid):
                    listeners = port_listeners(p["port"], p["host"])
                    return "stranger", elapsed, {"listeners": listeners}
                if ours is None:
                    return "unknown_owner", elapsed, {}
                if not p["url"]:
                    return "ready", elapsed, {"ready_epoch": self.now()}
                code, text = probe_url(p["url"], max(1.0, min(p["request_timeout_s"], p["timeout_s"] - elapsed)))
                self.last = text
                if code == 200:
                    # The answer counts only if the socket is still ours and the server still runs.
                    if tree_listens(self.pid, p["port"]) and pid_alive(self.pid):
                        ready_at = self.now()
                        return "ready", ready_at - created, {"ready_epoch": ready_at}
            elapsed = self.now() - created
            if elapsed >= p["timeout_s"]:
                return "timeout", elapsed, {}
            if self.monotonic() + interval > slice_end:
                return "waiting", elapsed, {}
            self.sleep(interval)


def resolve_pid(module, p):
    """The server pid for state=ready (see find_pid); fails the task clearly when there is none."""
    try:
        return find_pid(p, module.run_command)
    except PidError as exc:
        module.fail_json(msg=str(exc), **({"rc": exc.rc} if exc.rc is not None else {}))


def exit_info_reader(module, p):
    """The Waiter's ``exit_info_of(pid)`` for this call: the unit's exit status (O(unit)), else the reaper's exit
    file (O(exit_file)), else an unknown status."""
    def exit_info_of(dead_pid):
        if p["unit"]:
            return unit_exit(unit_show(module.run_command, p["unit"]), dead_pid)
        return {"rc": await_exit_file(p["exit_file"], dead_pid) if p["exit_file"] else None}
    return exit_info_of


def run_ready(module, p, result):
    pid = resolve_pid(module, p)
    exit_info_of = exit_info_reader(module, p)
    result.update(pid=pid, ready=False, ready_epoch=None, ready_wait_ms=None, lock_renewed=None,
                  lock_renewed_at_ready=None)
    try:
        result["lock_renewed"] = renew_lock(p["lock_dir"], p["lock_owner"])
    except gpufleet_lock.LockError as exc:
        module.fail_json(msg="stopped waiting for the server (pid %d, left running): %s" % (pid, exc), **result)
    waiter = Waiter(p, pid, exit_info_of)
    state, elapsed, extra = waiter.run()
    result.update(elapsed_s=None if elapsed is None else round(elapsed, 1), last=waiter.last)
    if elapsed is not None:  # None: the server was gone before the first look (state died)
        result["progress"] = waiter.progress(elapsed)
    if state == "ready":
        ready_result(result, waiter, pid, elapsed, extra)
        if p["lock_dir"]:
            # A whole lease from here: the next phase needs no renewal of its own. The server serves either way,
            # so a lost lock here is the caller's to see (its own renewal fails and says so), not a failed wait.
            try:
                result["lock_renewed_at_ready"] = bool(renew_lock(p["lock_dir"], p["lock_owner"]))
            except gpufleet_lock.LockError as exc:
                result.update(lock_renewed_at_ready=False, lock_renewed_at_ready_error=str(exc))
        module.exit_json(msg=result["progress"], **result)
    if state == "waiting":
        module.exit_json(msg=result["progress"], running=True, **result)
    if state == "died":
        msg, more = waiter.died(elapsed)
        result.update(more)
        module.fail_json(msg=msg, **result)
    fail_not_ready(module, p, result, waiter, pid, state, extra)


def ready_result(result, waiter, pid, elapsed, extra):
    """Fill ``result`` for a server seen ready (Waiter state ``ready``)."""
    result.update(ready=True, ready_wait_ms=int(elapsed * 1000), ready_epoch=round(extra["ready_epoch"], 3),
                  progress="%s answered on pid %d's socket after %.1f s" % (waiter.what, pid, elapsed))


def not_ready_message(p, waiter, pid, state, extra):
    """(msg, extra result) for the Waiter states ``stranger``, ``unknown_owner`` and ``timeout``."""
    if state == "stranger":
        return ("port %d is answered by %s, not by the launched server (pid %d, still loading): "
                "that process took the port, so the server cannot bind it; stop it, then rerun"
                % (p["port"], describe_listeners(extra["listeners"]) or "another process", pid),
                {"listeners": extra["listeners"]})
    if state == "unknown_owner":
        return ("port %d answers, but this user cannot see whether pid %d owns the listening socket "
                "(another user's process): run this task as root (become)" % (p["port"], pid), {})
    tail = log_tail(p["log_file"], p["log_tail_lines"], p["log_offset"]) if p["log_file"] else ""
    # Only here: the server may still come up (restart.yml's rollback says "still loading" from this).
    # Past tense: by the time a summary quotes this line, the rollback may have stopped that pid.
    return ("the server (pid %d) was running but did not answer %s within %.0f s of starting (last: %s). "
            "The model may still be loading: raise sglang_launch_ready_timeout_s, or read the log "
            "%s.\nLast lines of this launch's log:\n%s" % (pid, waiter.what, p["timeout_s"], waiter.last,
                                                           p["log_file"] or "-", tail or "(empty)"),
            {"running": pid_alive(pid), "log_tail": tail})


def fail_not_ready(module, p, result, waiter, pid, state, extra):
    """fail_json for the Waiter states ``stranger``, ``unknown_owner`` and ``timeout``."""
    msg, more = not_ready_message(p, waiter, pid, state, extra)
    result.update(more)
    module.fail_json(msg=msg, **result)


def post_generate(url, text, max_new_tokens, api_key, timeout_s):
    """One generation through SGLang's native API: POST ``url`` (``.../generate``) with
    ``{"text": text, "sampling_params": {"max_new_tokens": N, "temperature": 0}}`` and, with ``api_key``, the
    header ``Authorization: Bearer <key>`` (SGLang's --api-key). Never through an http_proxy (the server is on
    this host). Never raises.

    Returns ``{"status": int or None (no HTTP answer), "json": the parsed body or None, "msg": str,
    "elapsed_ms": int}``; the generated text is ``json["text"]`` on success (SGLang, all releases).
    """
    from ansible.module_utils.urls import open_url  # see probe_url
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    started = time.monotonic()
    status, raw, msg = None, b"", ""
    try:
        resp = open_url(url, data=body, method="POST", headers=headers, timeout=timeout_s, validate_certs=True,
                        use_proxy=False)
        status, raw = resp.getcode(), resp.read()
        msg = "OK (%d bytes)" % len(raw)
    except Exception as exc:  # urllib HTTPError carries a code and a body (401 without the key); others are text
        status = getattr(exc, "code", None)
        msg = ("HTTP Error %s: %s" % (status, getattr(exc, "reason", "") or exc)) if status else (
            "Request failed: %s" % (getattr(exc, "reason", None) or exc))
        try:
            raw = exc.read() if status else b""
        except Exception:
            raw = b""
    try:
        parsed = json.loads(raw.decode("utf-8", "replace")) if raw else None
    except ValueError:
        parsed = None
        if raw:
            msg = "%s; the body is not JSON: %r" % (msg, raw[:200])
    return {"status": status, "json": parsed, "msg": msg, "elapsed_ms": int((time.monotonic() - started) * 1000)}


def find_pid(p, run_command):
    """The server pid: O(pid), else O(pid_file), else the unit's MainPID. Raises PidError saying why not."""
    if p["pid"]:
        return p["pid"]
    if p["pid_file"]:
        read = read_pid_file(p["pid_file"])
        if read.problem in (MISSING, UNREADABLE):
            raise PidError("cannot read the pid file %s (%s): was the server started?" % (p["pid_file"], read.error))
        if not read.ok:
            raise PidError(read.error)
        return read.pid
    props = unit_show(run_command, p["unit"])
    main_pid = int(props.get("MainPID") or 0)
    if main_pid <= 0:
        raise PidError("systemd unit %s has no main process (ActiveState=%s, ExecMainStatus=%s): the server "
                       "is not running; see journalctl -u %s and %s" % (
                           p["unit"], props.get("ActiveState", "?"), props.get("ExecMainStatus", "?"), p["unit"],
                           p["log_file"] or "the server log"),
                       rc=int(props.get("ExecMainStatus") or 0) or None)
    return main_pid


class PidError(Exception):
    """The server pid cannot be found (message says why; ``rc`` the unit's exit status when known)."""

    def __init__(self, msg, rc=None):
        Exception.__init__(self, msg)
        self.rc = rc


def run_verified(module, p, result):
    """O(state=verified): one generation, every worker's environment, then one look at the server and its socket.

    Never fails for what it finds (the caller asserts, with its own messages); fails only for bad input.
    """
    try:
        pid, pid_error = find_pid(p, module.run_command), None
    except PidError as exc:
        pid, pid_error = None, str(exc)
    result.update(pid=pid)
    if p["generate"] is not None:
        g = p["generate"]
        result["generate"] = post_generate(g["url"], g["text"], g["max_new_tokens"], p["api_key"], g["timeout_s"])
    b = p["burst"]
    if b is not None and b["requests"] > 0:
        problems = gpufleet_burst.burst_errors(b["requests"], b["concurrency"], b["max_new_tokens"], b["timeout_s"])
        if problems:
            module.fail_json(msg="; ".join(problems), **result)
        if p["generate"] is not None and result["generate"]["status"] != 200:
            result["burst"] = {"skipped": True, "ok": None, "msg": "not sent: the single generation failed first"}
        else:
            result["burst"] = gpufleet_burst.run_burst(b["url"], b["requests"], b["concurrency"], b["max_new_tokens"],
                                                       b["timeout_s"], p["api_key"], b["text"])
    if p["worker_env"] is not None:
        w = p["worker_env"]
        try:
            title_re = re.compile(w["title_pattern"])
        except re.error as exc:
            module.fail_json(msg="invalid worker_env.title_pattern: %s" % exc, **result)
        if pid is None:
            result["workers"] = dict(worker_report([]), server_pid=None, msg=pid_error)
        elif not psutil.pid_exists(pid):
            result["workers"] = dict(worker_report([]), server_pid=pid, msg="server pid %d is not running" % pid)
        else:
            result["workers"] = dict(worker_report(inspect_workers(candidate_pids(pid), title_re, w["expected"],
                                                                   w["names"])), server_pid=pid)
    if p["owner"]:
        owner = {"ready": False, "pid": pid}
        if pid is None:
            owner["msg"] = pid_error
        else:
            # One look (slice 0); the server's age does not matter here.
            look = dict(p, slice_s=0, timeout_s=31536000.0)
            waiter = Waiter(look, pid, exit_info_reader(module, p))
            state, elapsed, extra = waiter.run()
            if state == "ready":
                owner.update(ready=True, msg="pid %d runs and answered %s on its own socket" % (pid, waiter.what))
            elif state == "waiting":
                owner["msg"] = "pid %d runs but %s did not answer (last: %s)" % (pid, waiter.what, waiter.last)
            elif state == "died":
                owner["msg"], more = waiter.died(elapsed)
                owner.update(rc=more["rc"], listeners=more["listeners"])
            else:
                owner["msg"], more = not_ready_message(look, waiter, pid, state, extra)
                owner.update((k, v) for k, v in more.items() if k == "listeners")
        result["owner"] = owner
    module.exit_json(**result)


def run_started(module, p, result):
    argv = p["argv"]
    if not argv or not argv[0]:
        module.fail_json(msg="argv must name a command as its first element", **result)
    result["argv"] = argv
    result["created_dirs"] = []
    if p["wait_ready"]:
        result.update(ready=False, ready_epoch=None, ready_wait_ms=None)
    for path_key in ("log_file", "pid_file", "exit_file"):
        parent = os.path.dirname(os.path.abspath(p[path_key]))
        if os.path.isdir(parent) or parent in result["created_dirs"]:
            continue
        if not p["create_dirs"]:
            module.fail_json(msg="directory %s for %s does not exist (create sglang_state_dir first, or set "
                             "create_dirs)" % (parent, path_key), **result)
        result["created_dirs"].append(parent)
        if not module.check_mode:
            try:
                os.makedirs(parent, mode=0o755, exist_ok=True)
            except OSError as exc:
                module.fail_json(msg="could not create directory %s for %s: %s" % (parent, path_key, exc), **result)
    if result["created_dirs"]:
        result["changed"] = True

    try:
        existing = running_pid(p["pid_file"])
    except OSError as exc:
        module.fail_json(msg="cannot read the pid file %s (%s): nothing was started; check its owner and mode"
                         % (p["pid_file"], exc), **result)
    if existing is not None:
        result["pid"] = existing
        module.exit_json(msg="already running (pid %d from %s)" % (existing, p["pid_file"]), **result)
    if p["port"]:
        listeners = port_listeners(p["port"], p["host"])
        if listeners and module.check_mode:
            # In check mode nothing was stopped: the server about to be replaced may well hold the port.
            result["listeners"] = listeners
            module.warn("port %d is held now by %s; a real run stops the old server first"
                        % (p["port"], describe_listeners(listeners)))
        elif listeners:
            result["listeners"] = listeners
            module.fail_json(msg="port %d taken by %s before launch: nothing was started; stop that process or "
                             "set another sglang_port" % (p["port"], describe_listeners(listeners)), **result)
    if module.check_mode:
        result.update(changed=True, started=True)
        module.exit_json(msg="would start %s" % argv[0], **result)

    result["log_offset"] = log_size(p["log_file"])
    try:
        started = start_server(argv, p["env"], p["inherit_env"], p["chdir"], p["log_file"], p["pid_file"],
                               p["exit_file"], api_key=p["api_key"])
    except OSError as exc:
        module.fail_json(msg="could not start %s: %s" % (argv[0], exc), **result)
    pid, started_at, offset = started["pid"], started["started_at"], started["log_offset"]
    result.update(changed=True, started=True, pid=pid, started_at=started_at, log_offset=offset)

    def died():
        rc = await_exit_file(p["exit_file"], pid)
        os.unlink(p["pid_file"])
        module.fail_json(msg="%s exited with status %s %.1f s after it started; full log: %s"
                         % (argv[0], "?" if rc is None else rc, time.time() - started_at, p["log_file"]),
                         rc=rc, log_tail=log_tail(p["log_file"], p["log_tail_lines"], offset), **result)

    if p["wait_ready"]:
        # The readiness test of state=ready, in a slice as long as the startup window, probing at least every
        # 100 ms: the caller skips its own readiness wait when this one saw the server serve.
        params = dict(p, log_offset=offset, slice_s=max(p["startup_check_s"], 0),
                      poll_interval_ms=min(p["poll_interval_ms"], 100))
        waiter = Waiter(params, pid, lambda dead: {"rc": await_exit_file(p["exit_file"], dead)})
        state, elapsed, extra = waiter.run()
        result.update(elapsed_s=None if elapsed is None else round(elapsed, 1), last=waiter.last)
        if state == "died":
            died()
        if state == "ready":
            ready_result(result, waiter, pid, elapsed, extra)
            module.exit_json(msg="started pid %d; %s" % (pid, result["progress"]), **result)
        if state in ("stranger", "unknown_owner"):
            result["progress"] = waiter.progress(elapsed)
            fail_not_ready(module, params, result, waiter, pid, state, extra)
        result["progress"] = waiter.progress(elapsed)
        module.exit_json(msg="started pid %d; %s" % (pid, result["progress"]), **result)

    deadline = time.monotonic() + max(p["startup_check_s"], 0)
    while time.monotonic() < deadline:
        if process_start_epoch(pid) is None:
            died()
        time.sleep(0.1)
    module.exit_json(msg="started pid %d" % pid, **result)


def run_port_free(module, p, result):
    listeners = port_listeners(p["port"], p["host"])
    result["listeners"] = listeners
    if listeners:
        module.fail_json(msg="port %d taken by %s before launch: nothing was started; stop that process or set "
                         "another sglang_port" % (p["port"], describe_listeners(listeners)), **result)
    module.exit_json(msg="nothing listens on port %d" % p["port"], **result)


def run_recorded(module, p):
    """state=recorded: O(record) as JSON to O(record_file), atomically; changed when the text differs."""
    path = p["record_file"]
    try:
        with open(path) as handle:
            before = handle.read()
    except FileNotFoundError:
        before = None
    except (OSError, UnicodeDecodeError) as exc:
        module.fail_json(msg="cannot read the launch record %s (%s): fix its permissions or remove it" % (path, exc),
                         record_file=path)
    record = dict(p["record"])
    if module.check_mode and before and p["check_mode_keep"]:
        try:
            old = json.loads(before)
        except ValueError:
            old = None
        if isinstance(old, dict):
            record.update((key, old[key]) for key in p["check_mode_keep"] if key in old)
    text = json.dumps(record, indent=4, sort_keys=True) + "\n"
    result = dict(changed=before != text, record_file=path)
    if module._diff:
        result["diff"] = dict(before=before or "", after=text, before_header=path, after_header=path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        if module.check_mode:
            # A first restart in check mode: the real run creates the state directory (the start's create_dirs)
            # before it gets here.
            module.warn("directory %s for record_file does not exist yet: a real run creates it before it writes "
                        "the record" % directory)
            module.exit_json(**result)
        module.fail_json(msg="directory %s for record_file does not exist (create sglang_state_dir first)" % directory,
                         **result)
    if result["changed"] and not module.check_mode:
        try:
            write_file_atomic(path, text)
        except OSError as exc:
            module.fail_json(msg="could not write the launch record %s: %s (the previous record, if any, is "
                             "unchanged)" % (path, exc), **result)
    result["lock_release"] = None
    if p["lock_dir"] and not module.check_mode:
        # The record was written (or was already right): release the restart lock in the same call. A failure
        # here is not the record's: the server serves and is recorded; the caller's own release runs instead.
        try:
            released, holder = gpufleet_lock.release_lease(p["lock_dir"], p["lock_owner"])
        except (gpufleet_lock.LockError, OSError) as exc:
            result["lock_release_error"] = "could not release the restart lock %s: %s" % (p["lock_dir"], exc)
        else:
            result["lock_release"] = released
            result["changed"] = result["changed"] or released == "released"
            if released == "not_owner":
                # What gpufleet_lock state=absent says: another run took the lock over after this run's lease
                # ended (it may be restarting this host now).
                result["lock_holder"] = holder
                module.warn("restart lock %s left alone: it is held by %s (taken over after this run's lease "
                            "ended)" % (p["lock_dir"], gpufleet_lock.describe(holder)))
    module.exit_json(**result)


# state -> its function; main() runs "recorded" before the psutil and port checks, which the others need.
STATES = {
    "started": run_started,
    "ready": run_ready,
    "verified": run_verified,
    "port_free": run_port_free,
}
