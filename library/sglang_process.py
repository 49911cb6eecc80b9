#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: start SGLang as a detached process (own session, pid file, log file) on hosts without systemd.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_process
short_description: Start a server (SGLang) as a detached process with a pid file and a log file
description:
  - Starts O(argv) (a list, never through a shell) in its own session (C(setsid)), stdin from C(/dev/null),
    stdout and stderr appended to O(log_file), and writes its pid to O(pid_file) atomically.
  - The process outlives the Ansible task and the SSH session; stop it with the C(sglang_stop) module, which
    signals the process group recorded here.
  - Idempotent; when O(pid_file) names a live process started before the file was written, nothing is
    started and RV(changed) is false.
  - After starting it watches the process for O(startup_check_s) seconds and fails with the log tail if it
    already exited (bad flag, missing file, port in use).
  - For hosts with systemd the C(sglang_launch) role uses a unit instead.
version_added: "1.0.0"
author: gpufleet
options:
  state:
    description: Only C(started) is supported; stopping is the C(sglang_stop) module's job.
    type: str
    choices: [started]
    default: started
  argv:
    description: Command and arguments, one element each (C(sglang_launcher) + rendered flags).
    type: list
    elements: str
    required: true
  api_key:
    description:
      - SGLang's C(--api-key). Appended to O(argv) as C(--api-key KEY) only when the process is started; it
        is a no_log option, so Ansible masks the value in this task's arguments and result (RV(argv) never
        holds it, and a log tail quoting it shows C(********)).
      - It still is in the server's command line, which C(ps) shows to every user of the host (SGLang 0.5.23
        reads the key only from its arguments).
    type: str
  env:
    description: Variables added to (and overriding) the inherited environment, e.g. the NCCL set.
    type: dict
    default: {}
  inherit_env:
    description: Start from this module's environment (PATH, HOME, …); false starts from an empty one.
    type: bool
    default: true
  chdir:
    description: Working directory of the process.
    type: path
  log_file:
    description: File that receives stdout and stderr (appended; created with mode 0640).
    type: path
    required: true
  pid_file:
    description: File that receives the pid (written atomically through a temporary file and rename).
    type: path
    required: true
  startup_check_s:
    description: Seconds to watch the new process; if it exits within them the task fails with the log tail.
    type: float
    default: 2
  log_tail_lines:
    description: Lines of O(log_file) included in a failure message.
    type: int
    default: 40
  wait_port:
    description:
      - After starting, wait until this TCP port accepts connections on O(wait_host), failing at once with the
        log tail if the process exits first (SGLang opens its HTTP port only after loading the model, and a
        load that crashes would otherwise be noticed only when a plain port wait times out).
      - Not set (default) means no wait.
    type: int
  wait_host:
    description: Address to connect to for O(wait_port).
    type: str
    default: 127.0.0.1
  wait_url:
    description:
      - After the port opened, poll this URL (GET) until it answers 200, failing at once with the log tail if the
        process exits first. Use a generate-based readiness URL (SGLang C(/health_generate)).
      - Not set (default) means no readiness wait; requires O(wait_port).
    type: str
  wait_timeout_s:
    description: Seconds to wait for O(wait_port) and O(wait_url) together; on timeout the task fails and the
      process is left running.
    type: float
    default: 900
attributes:
  check_mode:
    support: full
    details: Reports whether it would start the process (RV(changed)) and the argv; starts nothing.
  diff_mode:
    support: none
notes:
  - "Why a new session: the process must not receive the SIGHUP of the closing SSH session, and its process
    group id equals its pid, so C(sglang_stop) can signal the whole tree SGLang spawns."
"""

EXAMPLES = r"""
- name: Start SGLang detached
  sglang_process:
    argv: ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/m", "--port", "30000"]
    env: {NCCL_PROTO: LL, NCCL_ALGO: Ring}
    log_file: /var/lib/gpufleet/sglang.log
    pid_file: /var/lib/gpufleet/sglang.pid
"""

RETURN = r"""
pid:
  description: Pid of the started (or already running) process; null in check mode when it would start.
  returned: always
  type: int
  sample: 31337
started:
  description: Whether a new process was started (or, in check mode, would be).
  returned: always
  type: bool
started_at:
  description: Start time, seconds since the epoch (target clock); null when nothing was started.
  returned: always
  type: float
argv:
  description: The argv started, without O(api_key).
  returned: always
  type: list
  elements: str
log_file:
  description: Path of the log file.
  returned: always
  type: str
pid_file:
  description: Path of the pid file.
  returned: always
  type: str
log_tail:
  description: Last lines of the log file, on failure only.
  returned: failure
  type: str
port_wait_ms:
  description: Milliseconds from the start until O(wait_port) accepted a connection; null without O(wait_port).
  returned: always
  type: int
ready_wait_ms:
  description: Milliseconds from the start until O(wait_url) answered 200; null without O(wait_url).
  returned: always
  type: int
"""

import os
import socket
import subprocess
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url

PID_REUSE_SLACK_S = 5.0


def running_pid(pid_file):
    """Pid named by ``pid_file`` if that process is alive and not a reused pid, else None.

    Liveness: /proc/<pid> exists and is not a zombie; its start time (field 22 of /proc/<pid>/stat, in clock
    ticks since boot, proc(5)) is no later than the pid file's mtime plus a few seconds.
    """
    try:
        with open(pid_file) as handle:
            text = handle.read().strip()
        mtime = os.stat(pid_file).st_mtime
    except FileNotFoundError:
        return None
    if not text.isdigit():
        return None
    pid = int(text)
    started = process_start_epoch(pid)
    if started is None or started > mtime + PID_REUSE_SLACK_S:
        return None
    return pid


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


def write_pid_file(path, pid):
    """Write ``pid`` to ``path`` atomically (temporary file in the same directory, fsync, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".sglang-pid-", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write("%d\n" % pid)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def log_tail(path, lines):
    """Last ``lines`` lines of ``path`` as text (undecodable bytes replaced); "" if unreadable."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            data = handle.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def with_api_key(argv, api_key):
    """``argv`` (list of str) plus ``["--api-key", api_key]`` when ``api_key`` is non-empty; a new list.

    Kept out of the ``argv`` the module reports, so the key appears only in the started process's argv.
    """
    return list(argv) + (["--api-key", api_key] if api_key else [])


def start_detached(argv, env, chdir, log_file):
    """Start ``argv`` in a new session, stdin /dev/null, stdout+stderr appended to ``log_file``.

    Returns the subprocess.Popen. Raises OSError (missing executable, bad chdir) from Popen.
    """
    log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        with open(os.devnull, "rb") as devnull:
            return subprocess.Popen(argv, stdin=devnull, stdout=log_fd, stderr=subprocess.STDOUT,
                                    cwd=chdir, env=env, close_fds=True, start_new_session=True)
    finally:
        os.close(log_fd)


def wait_port_or_exit(proc, host, port, timeout_s, poll_s=0.25):
    """Wait until ``host:port`` accepts a TCP connection or ``proc`` exits.

    Returns ("open", None), ("exited", returncode) or ("timeout", None).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        rc = proc.poll()
        if rc is not None:
            return "exited", rc
        try:
            with socket.create_connection((host, port), timeout=min(1.0, poll_s * 4)):
                return "open", None
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return "timeout", None
        time.sleep(poll_s)


def wait_url_or_exit(proc, url, deadline_monotonic, poll_s=1.0):
    """Poll GET ``url`` until it answers 200 or ``proc`` exits or the deadline passes.

    Returns ("ready", None), ("exited", returncode) or ("timeout", last error text).
    """
    last = None
    while True:
        rc = proc.poll()
        if rc is not None:
            return "exited", rc
        try:
            resp = open_url(url, method="GET", timeout=60, validate_certs=True)
            if resp.getcode() == 200:
                return "ready", None
            last = "HTTP %s" % resp.getcode()
        except Exception as exc:  # connection refused, 503 while warming up: try again
            last = str(exc)
        if time.monotonic() >= deadline_monotonic:
            return "timeout", last
        time.sleep(poll_s)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", default="started", choices=["started"]),
            argv=dict(type="list", elements="str", required=True),
            api_key=dict(type="str", no_log=True),
            env=dict(type="dict", default={}),
            inherit_env=dict(type="bool", default=True),
            chdir=dict(type="path"),
            log_file=dict(type="path", required=True),
            pid_file=dict(type="path", required=True),
            startup_check_s=dict(type="float", default=2),
            log_tail_lines=dict(type="int", default=40),
            wait_port=dict(type="int"),
            wait_host=dict(type="str", default="127.0.0.1"),
            wait_url=dict(type="str"),
            wait_timeout_s=dict(type="float", default=900),
        ),
        required_by={"wait_url": "wait_port"},
        supports_check_mode=True,
    )
    p = module.params
    argv = p["argv"]
    result = dict(changed=False, started=False, pid=None, started_at=None, argv=argv,
                  log_file=p["log_file"], pid_file=p["pid_file"], port_wait_ms=None, ready_wait_ms=None)
    if not argv or not argv[0]:
        module.fail_json(msg="argv must name a command as its first element", **result)
    for path_key in ("log_file", "pid_file"):
        parent = os.path.dirname(os.path.abspath(p[path_key]))
        if not os.path.isdir(parent):
            module.fail_json(msg="directory %s for %s does not exist (create sglang_state_dir first)"
                             % (parent, path_key), **result)

    existing = running_pid(p["pid_file"])
    if existing is not None:
        result["pid"] = existing
        module.exit_json(msg="already running (pid %d from %s)" % (existing, p["pid_file"]), **result)
    if module.check_mode:
        result.update(changed=True, started=True)
        module.exit_json(msg="would start %s" % argv[0], **result)

    env = build_env(p["env"], p["inherit_env"])
    # Ansible's own variables for the module run must not leak into a long-running server.
    for key in [k for k in env if k.startswith("ANSIBLE_MODULE_")]:
        env.pop(key)
    started_at = time.time()
    try:
        proc = start_detached(with_api_key(argv, p["api_key"]), env, p["chdir"], p["log_file"])
    except OSError as exc:
        module.fail_json(msg="could not start %s: %s" % (argv[0], exc), **result)
    write_pid_file(p["pid_file"], proc.pid)
    result.update(changed=True, started=True, pid=proc.pid, started_at=started_at)

    deadline = time.monotonic() + max(p["startup_check_s"], 0)
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            os.unlink(p["pid_file"])
            module.fail_json(msg="%s exited with status %d within %.1f s of starting; full log: %s"
                             % (argv[0], rc, p["startup_check_s"], p["log_file"]),
                             rc=rc, log_tail=log_tail(p["log_file"], p["log_tail_lines"]), **result)
        time.sleep(0.1)
    if p["wait_port"]:
        deadline = time.monotonic() + p["wait_timeout_s"]
        state, rc = wait_port_or_exit(proc, p["wait_host"], p["wait_port"], p["wait_timeout_s"])
        result["port_wait_ms"] = int((time.time() - started_at) * 1000)
        if state == "exited":
            if os.path.exists(p["pid_file"]):
                os.unlink(p["pid_file"])
            module.fail_json(msg="%s exited with status %d after %.1f s, before port %d opened; full log: %s"
                             % (argv[0], rc, time.time() - started_at, p["wait_port"], p["log_file"]),
                             rc=rc, log_tail=log_tail(p["log_file"], p["log_tail_lines"]), **result)
        if state == "timeout":
            module.fail_json(msg="port %s:%d not open %.0f s after starting pid %d (still running: the model may "
                             "still be loading; raise the timeout or read %s)"
                             % (p["wait_host"], p["wait_port"], p["wait_timeout_s"], proc.pid, p["log_file"]),
                             log_tail=log_tail(p["log_file"], p["log_tail_lines"]), **result)
    if p["wait_url"]:
        state, detail = wait_url_or_exit(proc, p["wait_url"], deadline)
        result["ready_wait_ms"] = int((time.time() - started_at) * 1000)
        if state == "exited":
            if os.path.exists(p["pid_file"]):
                os.unlink(p["pid_file"])
            module.fail_json(msg="%s exited with status %d after %.1f s, before %s answered 200; full log: %s"
                             % (argv[0], detail, time.time() - started_at, p["wait_url"], p["log_file"]),
                             rc=detail, log_tail=log_tail(p["log_file"], p["log_tail_lines"]), **result)
        if state == "timeout":
            module.fail_json(msg="%s did not answer 200 within %.0f s of starting pid %d (last: %s); the process "
                             "still runs; full log: %s" % (p["wait_url"], p["wait_timeout_s"], proc.pid, detail,
                                                          p["log_file"]),
                             log_tail=log_tail(p["log_file"], p["log_tail_lines"]), **result)
    module.exit_json(msg="started pid %d" % proc.pid, **result)


if __name__ == "__main__":
    main()
