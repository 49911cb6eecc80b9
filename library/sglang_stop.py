#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: stop the SGLang server gpufleet launched, then only SGLang leftovers; clean stale shm.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_stop
short_description: Stop an SGLang server and its leftover processes, scoped so nothing else is signalled
description:
  - Stops the SGLang server started by gpufleet, in two scoped phases, then removes stale shared-memory segments.
  - "Phase 1 (the server itself): when O(pid_file) names a live process (written by the C(sglang_process)
    module), that process and every process of its session/process group are sent SIGTERM; after
    O(grace_s) seconds whatever is left gets SIGKILL. For the systemd method the unit is stopped first by
    the role (C(KillMode=control-group)) and this module only handles phase 2."
  - "Phase 2 (leftovers): every remaining process whose command line or title matches O(pattern)
    (SGLang's own clean-up pattern C(sglang::|sglang\\.launch_server|sglang\\.bench|sglang\\.data_parallel|sglang\\.srt)),
    including workers orphaned to PID 1, gets SIGTERM, then SIGKILL after O(grace_s)."
  - "Never signalled, whatever they hold open (C(/dev/nvidia*) included): processes of users not in O(users),
    processes matching O(protect_pattern) (nvidia-persistenced, DCGM, exporters, nvidia-smi), and this
    module's own process and its ancestors. Processes are never chosen because they hold a GPU device."
  - "Exit status 137 of a server that received SIGTERM is a normal stop: SGLang up to 0.5.18 SIGKILLs its own
    process tree at the end of shutdown."
  - Stale segments in O(shm_dir) matching O(shm_patterns) are removed only when no live process maps or holds
    them open and they belong to one of O(users).
  - In check mode it reports what it would signal and remove, and signals nothing.
  - Requires psutil on the target (the SGLang virtualenv has it).
version_added: "1.0.0"
author: gpufleet
options:
  pid_file:
    description:
      - Pid file written when the server was launched (C(<sglang_state_dir>/sglang.pid)). Optional; a missing
        file means there is no phase 1. A pid file whose process is gone or started after the file was written
        (pid reuse) is stale and is removed without signalling anything.
    type: path
  users:
    description:
      - Only processes owned by these users are signalled (and only their shm segments removed).
      - Empty (default) means the user this module runs as.
    type: list
    elements: str
    default: []
  grace_s:
    description: Seconds to wait after SIGTERM (the server drains in-flight requests) before SIGKILL.
    type: float
    default: 60
  kill_timeout_s:
    description: Seconds to wait after SIGKILL before failing with the processes still alive.
    type: float
    default: 15
  pattern:
    description: Regular expression (Python C(re.search)) matched against a process's command line/title.
    type: str
    default: 'sglang::|sglang\.launch_server|sglang\.bench|sglang\.data_parallel|sglang\.srt'
  protect_pattern:
    description:
      - Regular expression for processes never signalled even when they match O(pattern) or sit in the
        server's process group (GPU monitors and exporters).
    type: str
    default: 'nvidia-persistenced|nv-hostengine|dcgm|exporter|nvidia-smi|nvidia-fabricmanager'
  remove_stale_shm:
    description: Remove stale shared-memory segments after the processes are gone.
    type: bool
    default: true
  shm_dir:
    description: Directory of POSIX shared-memory segments.
    type: path
    default: /dev/shm
  shm_patterns:
    description: Shell-style name patterns of SGLang/NCCL/CUDA segments.
    type: list
    elements: str
    default: ['nccl-*', 'cuda.shm.*', 'sgl_shm_*']
attributes:
  check_mode:
    support: full
    details: Reports C(signalled) and C(removed_shm) as what would happen; sends no signal, removes nothing.
  diff_mode:
    support: none
requirements:
  - psutil
notes:
  - "Source of the pattern: SGLang's C(kill_process_tree)/clean-up scripts; worker titles C(sglang::scheduler_TP<n>)
    are set with setproctitle (SGLang 0.4+)."
  - Fails when a process survives SIGKILL for O(kill_timeout_s) (for example stuck in uninterruptible I/O),
    listing pid, state and command line; the host then needs an operator.
"""

EXAMPLES = r"""
- name: Stop the server launched as a detached process, then leftovers
  sglang_stop:
    pid_file: /var/lib/gpufleet/sglang.pid
    users: [sglang]
    grace_s: 60

- name: After systemctl stop, clean up orphans only (what would be signalled, in check mode)
  sglang_stop:
    users: [sglang]
  check_mode: true
  register: stop_preview
"""

RETURN = r"""
signalled:
  description: Every process signalled (or, in check mode, that would be).
  returned: always
  type: list
  elements: dict
  contains:
    pid: {description: Process id., type: int}
    cmdline: {description: Command line or title as shown in /proc/<pid>/cmdline., type: str}
    user: {description: Owner., type: str}
    reason: {description: "Why it was chosen: C(pid_file), C(process_group) or C(pattern).", type: str}
    signals: {description: Signals sent in order (C(SIGTERM), C(SIGKILL))., type: list, elements: str}
    ended: {description: "C(after SIGTERM), C(after SIGKILL), C(would signal) (check mode) or C(still running).", type: str}
    wait_ms: {description: Milliseconds from the first signal until it was gone., type: int}
  sample:
    - {pid: 4242, cmdline: "python -m sglang.launch_server --model-path /models/x", user: sglang,
       reason: pid_file, signals: [SIGTERM], ended: after SIGTERM, wait_ms: 5210}
removed_shm:
  description: Paths of stale shared-memory segments removed (or that would be, in check mode).
  returned: always
  type: list
  elements: str
  sample: [/dev/shm/nccl-Ab12Cd]
kept_shm:
  description: Matching segments kept, with the pids that still hold them or why they were kept.
  returned: always
  type: list
  elements: dict
  sample: [{path: /dev/shm/nccl-Zz, holders: [77], reason: held}]
main_pid:
  description: Pid read from O(pid_file) when it named a live server process, else null.
  returned: always
  type: int
pid_file_removed:
  description: Whether the pid file was removed (server gone or file stale).
  returned: always
  type: bool
stop_ms:
  description: Milliseconds the module spent signalling and waiting.
  returned: always
  type: int
"""

import fnmatch
import os
import re
import signal
import time
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible.module_utils.gpufleet_procs import cmdline_text

try:
    import psutil
except ImportError:  # reported through missing_required_lib in main()
    psutil = None
    PSUTIL_IMPORT_ERROR = traceback.format_exc()
else:
    PSUTIL_IMPORT_ERROR = None

SGLANG_PATTERN = r"sglang::|sglang\.launch_server|sglang\.bench|sglang\.data_parallel|sglang\.srt"
PROTECT_PATTERN = r"nvidia-persistenced|nv-hostengine|dcgm|exporter|nvidia-smi|nvidia-fabricmanager"
# A pid file is written right after the process started (sglang_process); a process created noticeably
# later than the file is a different process that reused the pid.
PID_REUSE_SLACK_S = 5.0


class Proc(object):
    """Snapshot of one process: pid, ppid, pgid, sid, uid, user, cmdline (str), create_time (epoch s)."""

    __slots__ = ("pid", "ppid", "pgid", "sid", "uid", "user", "cmdline", "create_time", "handle")

    def __init__(self, pid, ppid, pgid, sid, uid, user, cmdline, create_time, handle=None):
        self.pid, self.ppid, self.pgid, self.sid = pid, ppid, pgid, sid
        self.uid, self.user, self.cmdline, self.create_time = uid, user, cmdline, create_time
        self.handle = handle

    def __repr__(self):
        return "Proc(pid=%d, user=%s, cmdline=%r)" % (self.pid, self.user, self.cmdline)


def snapshot():
    """List of Proc for every process visible now (psutil.process_iter)."""
    procs = []
    for handle in psutil.process_iter(["pid", "ppid", "uids", "username", "create_time", "name", "status"]):
        info = handle.info
        if info.get("status") == psutil.STATUS_ZOMBIE:
            continue  # already dead; holds no memory, devices or segments, only awaits its parent's wait()
        try:
            pgid = os.getpgid(info["pid"])
            sid = os.getsid(info["pid"])
        except OSError:
            continue
        cmdline = cmdline_text(info["pid"]) or "[%s]" % (info.get("name") or "")
        uids = info.get("uids")
        procs.append(Proc(info["pid"], info.get("ppid") or 0, pgid, sid, uids.real if uids else -1,
                          info.get("username") or "", cmdline, info.get("create_time") or 0.0, handle))
    return procs


def protected_pids(self_pid=None):
    """This module's pid and all its ancestors (never signalled)."""
    me = psutil.Process(self_pid or os.getpid())
    pids = {me.pid}
    for parent in me.parents():
        pids.add(parent.pid)
    return pids


def select_server(procs, main_pid, user_set, protected, protect_re):
    """Phase 1 targets: the pid-file process plus its session/process-group members.

    Returns a list of (Proc, reason). Filters: owner in ``user_set`` (set of user names), pid not in
    ``protected``, command line not matching ``protect_re``.
    """
    chosen = []
    for proc in procs:
        if proc.pid == main_pid:
            reason = "pid_file"
        elif main_pid and (proc.pgid == main_pid or proc.sid == main_pid):
            reason = "process_group"
        else:
            continue
        if _allowed(proc, user_set, protected, protect_re):
            chosen.append((proc, reason))
    return chosen


def select_leftovers(procs, pattern_re, user_set, protected, protect_re, skip=()):
    """Phase 2 targets: processes whose cmdline/title matches ``pattern_re`` (orphans included).

    Same filters as select_server; pids in ``skip`` (already handled) are left out.
    """
    return [(proc, "pattern") for proc in procs
            if proc.pid not in skip and pattern_re.search(proc.cmdline)
            and _allowed(proc, user_set, protected, protect_re)]


def _allowed(proc, user_set, protected, protect_re):
    if proc.pid in protected or proc.pid <= 1:
        return False
    if proc.user not in user_set:
        return False
    if protect_re.search(proc.cmdline):
        return False
    return True


def read_pid_file(path):
    """(pid, mtime) from a pid file holding a decimal pid; (None, None) when missing; ValueError if garbage."""
    try:
        with open(path) as handle:
            text = handle.read().strip()
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        return None, None
    if not text.isdigit():
        raise ValueError("pid file %s does not hold a pid: %r" % (path, text[:80]))
    return int(text), mtime


def pid_file_process(procs, pid, mtime):
    """The Proc the pid file names, or None if gone or created after the file (pid reused)."""
    for proc in procs:
        if proc.pid == pid:
            if proc.create_time > mtime + PID_REUSE_SLACK_S:
                return None
            return proc
    return None


def _is_gone(handle):
    try:
        return not handle.is_running() or handle.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(handles, timeout_s):
    """Wait up to ``timeout_s`` for processes to exit (psutil.wait_procs); zombies count as gone.

    Returns (gone, alive) lists of psutil.Process.
    """
    alive = list(handles)
    gone = []
    deadline = time.monotonic() + max(timeout_s, 0)
    while alive:
        remaining = deadline - time.monotonic()
        done, alive = psutil.wait_procs(alive, timeout=max(min(0.2, remaining), 0.01))
        gone.extend(done)
        still = []
        for handle in alive:
            (gone if _is_gone(handle) else still).append(handle)
        alive = still
        if remaining <= 0:
            break
    return gone, alive


def stop_group(chosen, grace_s, kill_timeout_s, report):
    """SIGTERM every chosen process, SIGKILL what is left after ``grace_s``; append to ``report``.

    ``chosen``: list of (Proc, reason). Returns list of report entries still running after SIGKILL.
    """
    entries = {}
    started = time.monotonic()
    for proc, reason in chosen:
        entry = {"pid": proc.pid, "cmdline": proc.cmdline, "user": proc.user, "reason": reason,
                 "signals": [], "ended": "still running", "wait_ms": None}
        report.append(entry)
        entries[proc.pid] = (proc.handle, entry)
        _send(proc.handle, signal.SIGTERM, entry)
    gone, alive = wait_gone([h for h, _ in entries.values()], grace_s)
    for handle in gone:
        _mark(entries, handle, "after SIGTERM", started)
    if alive:
        for handle in alive:
            _send(handle, signal.SIGKILL, entries[handle.pid][1])
        gone, alive = wait_gone(alive, kill_timeout_s)
        for handle in gone:
            _mark(entries, handle, "after SIGKILL", started)
    return [entries[h.pid][1] for h in alive]


def _send(handle, signum, entry):
    try:
        handle.send_signal(signum)
    except psutil.NoSuchProcess:
        pass
    entry["signals"].append(signal.Signals(signum).name)


def _mark(entries, handle, how, started):
    entry = entries[handle.pid][1]
    entry["ended"] = how
    entry["wait_ms"] = int((time.monotonic() - started) * 1000)


def shm_holders(shm_dir, pids=None, proc_root="/proc"):
    """Map path under ``shm_dir`` → set of pids that map it (/proc/<pid>/maps) or hold it open (/proc/<pid>/fd).

    Also returns the set of pids whose maps/fds could not be read (other users without privilege), so callers
    can keep segments such processes might hold. Returns (holders dict, unreadable set of (pid, uid)).
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
        except FileNotFoundError:
            continue
        except PermissionError:
            if pid == 1:
                # An init never maps NCCL/CUDA segments; in containers its maps are often unreadable even to
                # root, which would otherwise keep every segment forever.
                continue
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


def run(module):
    params = module.params
    check = module.check_mode
    import pwd
    users = params["users"] or [pwd.getpwuid(os.geteuid()).pw_name]
    user_set = set(users)
    try:
        pattern_re = re.compile(params["pattern"])
        protect_re = re.compile(params["protect_pattern"])
    except re.error as exc:
        module.fail_json(msg="invalid regular expression in pattern/protect_pattern: %s" % exc)
    protected = protected_pids()
    result = {"changed": False, "signalled": [], "removed_shm": [], "kept_shm": [], "main_pid": None,
              "pid_file_removed": False, "users": users}
    started = time.monotonic()

    main = None
    pid_file = params["pid_file"]
    procs = snapshot()
    if pid_file:
        try:
            pid, mtime = read_pid_file(pid_file)
        except ValueError as exc:
            module.fail_json(msg="%s; remove it after checking no SGLang server runs" % exc, **result)
        if pid is not None:
            main = pid_file_process(procs, pid, mtime)
            if main is not None and not _allowed(main, user_set, protected, protect_re):
                module.fail_json(msg="pid file %s names pid %d (%s, user %s), which this module may not signal "
                                 "(user not in %s or protected); check the pid file and the users option"
                                 % (pid_file, pid, main.cmdline, main.user, users), **result)
            result["main_pid"] = main.pid if main else None

    failed_alive = []
    handled = set()
    if main is not None:
        chosen = select_server(procs, main.pid, user_set, protected, protect_re)
        handled.update(p.pid for p, _ in chosen)
        if check:
            result["signalled"].extend(_would(chosen))
        else:
            failed_alive += stop_group(chosen, params["grace_s"], params["kill_timeout_s"], result["signalled"])
        procs = snapshot() if not check else procs

    leftovers = select_leftovers(procs, pattern_re, user_set, protected, protect_re, skip=handled)
    if check:
        result["signalled"].extend(_would(leftovers))
    elif leftovers:
        failed_alive += stop_group(leftovers, params["grace_s"], params["kill_timeout_s"], result["signalled"])

    if pid_file and os.path.exists(pid_file) and not failed_alive:
        if not check:
            os.unlink(pid_file)
        result["pid_file_removed"] = True

    if failed_alive:
        result["changed"] = True
        result["stop_ms"] = int((time.monotonic() - started) * 1000)
        module.fail_json(msg="%d process(es) survived SIGKILL for %.0f s (uninterruptible sleep?): %s; "
                         "the GPUs are not free, an operator must look at this host"
                         % (len(failed_alive), params["kill_timeout_s"],
                            "; ".join("pid %d %s" % (e["pid"], e["cmdline"]) for e in failed_alive)), **result)

    if params["remove_stale_shm"]:
        holders, unreadable = shm_holders(params["shm_dir"])
        removable, kept = stale_segments(params["shm_dir"], params["shm_patterns"], _user_uids(users),
                                         holders, unreadable)
        result["kept_shm"] = kept
        for path in removable:
            if not check:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
            result["removed_shm"].append(path)

    result["changed"] = bool(result["signalled"] or result["removed_shm"] or result["pid_file_removed"])
    result["stop_ms"] = int((time.monotonic() - started) * 1000)
    return result


def _would(chosen):
    return [{"pid": p.pid, "cmdline": p.cmdline, "user": p.user, "reason": reason, "signals": [],
             "ended": "would signal", "wait_ms": None} for p, reason in chosen]


def main():
    module = AnsibleModule(
        argument_spec=dict(
            pid_file=dict(type="path"),
            users=dict(type="list", elements="str", default=[]),
            grace_s=dict(type="float", default=60),
            kill_timeout_s=dict(type="float", default=15),
            pattern=dict(type="str", default=SGLANG_PATTERN),
            protect_pattern=dict(type="str", default=PROTECT_PATTERN),
            remove_stale_shm=dict(type="bool", default=True),
            shm_dir=dict(type="path", default="/dev/shm"),
            shm_patterns=dict(type="list", elements="str", default=["nccl-*", "cuda.shm.*", "sgl_shm_*"]),
        ),
        supports_check_mode=True,
    )
    if psutil is None:
        module.fail_json(msg=missing_required_lib("psutil"), exception=PSUTIL_IMPORT_ERROR)
    if module.params["grace_s"] < 0 or module.params["kill_timeout_s"] < 0:
        module.fail_json(msg="grace_s and kill_timeout_s must be >= 0 seconds")
    module.exit_json(**run(module))


if __name__ == "__main__":
    main()
