#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: prove that the NCCL variables reached every SGLang GPU worker (/proc/<pid>/environ).
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_worker_env_info
short_description: Read selected environment variables of every SGLang GPU worker process
description:
  - Finds SGLang's GPU worker processes (title matching O(title_pattern), C(sglang::scheduler_TP<n>) by default)
    among the descendants of O(pid) (or the process named in O(pid_file)); without either, among all processes.
  - Reads each worker's C(/proc/<pid>/environ) (NUL-separated bytes; values that are not UTF-8 are shown with
    backslash escapes and never match) and compares the variables in O(expected).
  - "This is the only proof that a variable reached a worker: SGLang's C(_set_envs_and_config) can overwrite
    variables set before launch, and launchers (sudo, docker exec) can drop them."
  - Never changes anything.
  - "SGLang sets worker titles with setproctitle, which overwrites C(/proc/<pid>/environ) unless C(SPT_NOENV) is
    set in the server's environment; a worker whose environ reads empty is reported with an C(error) saying so."
version_added: "1.0.0"
author: gpufleet
options:
  pid:
    description: Pid of the SGLang server's main process; workers are searched among its descendants.
    type: int
  pid_file:
    description: File holding the server pid (C(<sglang_state_dir>/sglang.pid)); used when O(pid) is not given.
    type: path
  expected:
    description: Variable name → expected value (compared as strings; booleans as C(1)/C(0)).
    type: dict
    default: {}
  names:
    description: Extra variable names to report (no comparison).
    type: list
    elements: str
    default: []
  title_pattern:
    description: Regular expression (C(re.search)) for worker titles/command lines.
    type: str
    default: '^sglang::scheduler(_DP\d+)?_TP\d+'
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
requirements:
  - psutil
notes:
  - Reading another user's environ needs root (or the same user); an unreadable worker is reported with
    C(error) and counts as not matching.
"""

EXAMPLES = r"""
- name: NCCL variables in every TP worker
  sglang_worker_env_info:
    pid_file: /var/lib/gpufleet/sglang.pid
    expected: {NCCL_PROTO: LL, NCCL_ALGO: Ring}
  register: worker_env

- ansible.builtin.assert:
    that: worker_env.all_match
    fail_msg: "{{ worker_env.workers | rejectattr('match') | map(attribute='pid') | list }} miss NCCL values"
"""

RETURN = r"""
workers:
  description: One entry per worker process found, sorted by title.
  returned: always
  type: list
  elements: dict
  contains:
    pid: {description: Worker pid., type: int}
    title: {description: Title/command line from /proc/<pid>/cmdline (e.g. C(sglang::scheduler_TP3))., type: str}
    env: {description: "Requested variables present in the worker (name → value).", type: dict}
    missing: {description: Expected names absent from the worker's environment., type: list, elements: str}
    mismatched: {description: "name → {expected, actual} for values that differ.", type: dict}
    match: {description: True when nothing is missing or mismatched and environ was readable., type: bool}
    error: {description: Why environ could not be read (only when it could not)., type: str}
  sample:
    - {pid: 812, title: "sglang::scheduler_TP0", env: {NCCL_PROTO: LL}, missing: [], mismatched: {}, match: true}
worker_count:
  description: Number of workers found.
  returned: always
  type: int
all_match:
  description: True when at least one worker was found and every worker matches.
  returned: always
  type: bool
server_pid:
  description: The server pid the search started from, or null when all processes were searched.
  returned: always
  type: int
"""

import gc
import os
import re
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import cmdline_text

try:
    import psutil
except ImportError:
    psutil = None
    PSUTIL_IMPORT_ERROR = traceback.format_exc()
else:
    PSUTIL_IMPORT_ERROR = None


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
    """Worker report entries (see RETURN) for those of ``pids`` whose title matches ``title_re``."""
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


def main():
    module = AnsibleModule(
        argument_spec=dict(
            pid=dict(type="int"),
            pid_file=dict(type="path"),
            expected=dict(type="dict", default={}),
            names=dict(type="list", elements="str", default=[]),
            title_pattern=dict(type="str", default=r"^sglang::scheduler(_DP\d+)?_TP\d+"),
        ),
        mutually_exclusive=[("pid", "pid_file")],
        supports_check_mode=True,
    )
    if psutil is None:
        module.fail_json(msg=missing_required_lib("psutil"), exception=PSUTIL_IMPORT_ERROR)
    p = module.params
    try:
        title_re = re.compile(p["title_pattern"])
    except re.error as exc:
        module.fail_json(msg="invalid title_pattern: %s" % exc)
    server_pid = p["pid"]
    if server_pid is None and p["pid_file"]:
        try:
            with open(p["pid_file"]) as handle:
                text = handle.read().strip()
        except OSError as exc:
            module.fail_json(msg="cannot read pid file %s: %s (is the server running?)" % (p["pid_file"], exc))
        if not text.isdigit():
            module.fail_json(msg="pid file %s does not hold a pid: %r" % (p["pid_file"], text[:80]))
        server_pid = int(text)
    if server_pid is not None and not psutil.pid_exists(server_pid):
        module.fail_json(msg="server pid %d is not running" % server_pid, server_pid=server_pid,
                         workers=[], worker_count=0, all_match=False)
    workers = inspect_workers(candidate_pids(server_pid), title_re, p["expected"], p["names"])
    module.exit_json(changed=False, workers=workers, worker_count=len(workers), server_pid=server_pid,
                     all_match=bool(workers) and all(w["match"] for w in workers))


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
