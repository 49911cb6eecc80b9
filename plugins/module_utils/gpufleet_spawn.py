# -*- coding: utf-8 -*-
# gpufleet: start a detached server under a reaper, and find what listens on its port; shared by sglang_process
# (the launch) and sglang_stop (its start_after option: the new server starts in the stop's own call).
"""Start SGLang detached (own session, log file, pid file, exit record) and read who listens on a TCP port.

Used by the ``sglang_process`` module (``state=started``) and by ``sglang_stop`` (``start_after``), so both
start a server the same way: the server leads its own session (``sglang_stop`` signals that), its parent is a
small reaper (comm ``gpufleet-reaper``) that records the exit status, stdout and stderr append to the log
file, the pid file is written atomically.

Everything here works without Ansible; psutil is needed by :func:`port_listeners` only.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import tempfile
import time

try:
    import psutil
except ImportError:  # reported by the calling module with missing_required_lib("psutil")
    psutil = None

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_ports import (  # noqa: F401 pylint: disable=unused-import
    WILDCARDS, addresses_overlap, tcp_listeners)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_argv

REAPER_COMM = b"gpufleet-reaper"

# The options of one server start: sglang_process's top-level options and sglang_stop's start_after suboptions
# (argument_spec; their documentation is the doc fragment gpufleet.fleet.sglang_start). Use start_options().
START_OPTIONS = dict(
    argv=dict(type="list", elements="str"),
    api_key=dict(type="str", no_log=True),
    env=dict(type="dict", default={}),
    inherit_env=dict(type="bool", default=True),
    chdir=dict(type="path"),
    log_file=dict(type="path"),
    pid_file=dict(type="path"),
    exit_file=dict(type="path"),
    port=dict(type="int"),
    host=dict(type="str", default="127.0.0.1"),
)
# Required where the start is the option's only purpose (start_after); sglang_process requires them per state.
START_REQUIRED = ("argv", "log_file", "pid_file", "port")


def start_options(required=()):
    """A fresh copy of :data:`START_OPTIONS` (an argument_spec) with the options named in ``required`` required."""
    spec = copy.deepcopy(START_OPTIONS)
    for name in required:
        spec[name]["required"] = True
    return spec


def build_env(env, inherit, base=None):
    """Environment for the child: ``base`` (default os.environ) if ``inherit``, updated with ``env`` (str values).

    Booleans become "1"/"0"; None removes a variable.
    """
    result = dict(base if base is not None else os.environ) if inherit else {}
    for key, value in (env or {}).items():
        if value is None:
            result.pop(str(key), None)
        elif isinstance(value, bool):
            result[str(key)] = "1" if value else "0"
        else:
            result[str(key)] = str(value)
    return result


# gpufleet's state files (pid file, exit file, launch.json) are for the user who runs the server and its group only
# (issue 31): they name the server's argv and environment.
STATE_FILE_MODE = 0o640
# SGLang logs its API keys (server_args, 0.5.23 entrypoints/engine.py): the server log is owner (and group) only.
LOG_FILE_MODE = 0o640


def write_file_atomic(path, text, mode=STATE_FILE_MODE):
    """Write ``text`` to ``path`` atomically (temporary file in the same directory, fsync, rename), ``mode`` 0640."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".sglang-", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_pid_file(path, pid):
    """Write ``pid`` to ``path`` atomically."""
    write_file_atomic(path, "%d\n" % pid)


def log_size(path):
    """Size of ``path`` in bytes, 0 when it does not exist (the offset where a new launch's lines begin)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def with_api_key(argv, api_key):
    """``argv`` (list of str) plus ``["--api-key", api_key]`` when ``api_key`` is non-empty; a new list.

    Kept out of the ``argv`` the module reports, so the key appears only in the started process's argv.
    """
    return list(argv) + (["--api-key", api_key] if api_key else [])


def tighten_log_mode(fd):
    """Take group write and every bit for others off the open file ``fd`` (a log an earlier release created 0644);
    a file this user does not own is left as it is (os.fchmod: EPERM). Returns the mode the file has now."""
    mode = os.fstat(fd).st_mode & 0o7777
    if mode & ~LOG_FILE_MODE & 0o777:
        try:
            os.fchmod(fd, mode & LOG_FILE_MODE)
            mode &= LOG_FILE_MODE
        except PermissionError:
            pass
    return mode


def start_detached(argv, env, chdir, log_file):
    """Start ``argv`` in a new session, stdin /dev/null, stdout+stderr appended to ``log_file`` (created 0640, an
    existing one tightened to 0640 or stricter: SGLang writes its API keys there).

    Returns the subprocess.Popen. Raises OSError (missing executable, bad chdir) from Popen.
    """
    log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, LOG_FILE_MODE)
    try:
        tighten_log_mode(log_fd)
        with open(os.devnull, "rb") as devnull:
            return subprocess.Popen(argv, stdin=devnull, stdout=log_fd, stderr=subprocess.STDOUT,
                                    cwd=chdir, env=env, close_fds=True, start_new_session=True)
    finally:
        os.close(log_fd)


def _set_comm(name):
    """Name this process (``/proc/self/comm``, prctl PR_SET_NAME) so ``ps`` tells the reaper apart."""
    try:
        with open("/proc/self/comm", "wb") as handle:
            handle.write(name)
    except OSError:
        pass


def start_reaped(argv, env, chdir, log_file, exit_file):
    """Start ``argv`` detached under a reaper that records its exit status in ``exit_file``; return its pid.

    The reaper is forked from this process, leaves its session (setsid), points fds 0-2 at /dev/null and
    closes every other fd (the SSH channel must see EOF when the module ends), starts the server with
    start_detached() (so the server leads its own session: sglang_stop signals that), tells this process the
    server's pid through a pipe, waits for it and writes ``{"pid", "returncode", "ended_at"}`` to
    ``exit_file`` atomically. Raises OSError with the reaper's message when the server could not be started.
    """
    read_fd, write_fd = os.pipe()
    reaper = os.fork()
    if reaper == 0:  # the reaper
        code = 0
        try:
            os.close(read_fd)
            os.setsid()
            _set_comm(REAPER_COMM)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.closerange(3, write_fd)
            os.closerange(write_fd + 1, 65536)
            try:
                proc = start_detached(argv, env, chdir, log_file)
            except OSError as exc:
                os.write(write_fd, json.dumps({"error": str(exc)}).encode())
                os._exit(127)
            started_at = time.time()
            os.write(write_fd, json.dumps({"pid": proc.pid}).encode())
            os.close(write_fd)
            rc = proc.wait()
            write_file_atomic(exit_file, json.dumps({"pid": proc.pid, "returncode": rc, "started_at": started_at,
                                                     "ended_at": time.time()}) + "\n")
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    while True:
        chunk = os.read(read_fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    try:
        answer = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        answer = {}
    if "pid" not in answer:
        os.waitpid(reaper, 0)
        raise OSError(answer.get("error") or "the reaper process failed before starting the server")
    return answer["pid"]


def _describe_pid(pid):
    """(user, cmdline) of ``pid`` via psutil; ("?", "?") when it cannot be read."""
    try:
        proc = psutil.Process(pid)
        # Spaces collapsed: a process that set its title (setproctitle) pads argv with blanks up to its old length.
        cmdline = " ".join(" ".join(redact_argv(proc.cmdline())).split()) or "[%s]" % proc.name()
        return proc.username(), cmdline
    except (psutil.Error, OSError):
        return "?", "?"


def port_listeners(port, bind_host):
    """Processes listening on TCP ``port`` at an address overlapping ``bind_host``.

    Source: gpufleet_ports.tcp_listeners (psutil); overlap: gpufleet_ports.addresses_overlap.
    Returns a list of {"pid" (int or None when the socket's owner is not visible: another user's process and
    no root), "user", "cmdline", "address"}.
    """
    found = []
    seen = set()
    for conn in tcp_listeners(port):
        if not addresses_overlap(bind_host, conn.laddr.ip):
            continue
        key = (conn.pid, conn.laddr.ip)
        if key in seen:
            continue
        seen.add(key)
        user, cmdline = _describe_pid(conn.pid) if conn.pid else ("?", "?")
        found.append({"pid": conn.pid, "user": user, "cmdline": cmdline[:200], "address": conn.laddr.ip})
    return found


def describe_listeners(listeners):
    """'pid 4242 (python3 -m http.server, user root)' for each listener, joined by '; '."""
    parts = []
    for item in listeners:
        if item["pid"] is None:
            parts.append("a process whose owner is not visible to this user (listening on %s; run as root to name it)"
                         % item["address"])
        else:
            parts.append("pid %d (%s, user %s)" % (item["pid"], item["cmdline"][:120], item["user"]))
    return "; ".join(parts)


def start_server(argv, env, inherit_env, chdir, log_file, pid_file, exit_file, api_key=None):
    """Start ``argv`` (+ ``--api-key`` when ``api_key``) detached under the reaper and record it.

    ``env`` is laid over this process's environment (``inherit_env``) as :func:`build_env` does, without
    Ansible's ``ANSIBLE_MODULE_*`` variables; an old ``exit_file`` is removed first; the pid goes to
    ``pid_file`` atomically. Returns ``{"pid": int, "started_at": float (epoch s, this host's clock),
    "log_offset": int (bytes of ``log_file`` before this start)}``. Raises OSError when the server could not be
    started (missing executable, bad ``chdir``, unwritable log or pid file).
    """
    env = build_env(env, inherit_env)
    # Ansible's own variables for the module run must not leak into a long-running server.
    for key in [k for k in env if k.startswith("ANSIBLE_MODULE_")]:
        env.pop(key)
    offset = log_size(log_file)
    if os.path.lexists(exit_file):
        os.unlink(exit_file)
    started_at = time.time()
    pid = start_reaped(with_api_key(argv, api_key), env, chdir, log_file, exit_file)
    try:
        write_pid_file(pid_file, pid)
    except OSError as exc:
        # A server nobody can find by its pid file must not keep the GPUs: end its session again.
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        raise OSError("started pid %d but could not write its pid file %s (%s); killed it again" % (pid, pid_file, exc))
    return {"pid": pid, "started_at": started_at, "log_offset": offset}
