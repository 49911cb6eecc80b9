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
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
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
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
  platform:
    support: full
    platforms: linux
requirements:
  - psutil
notes:
  - Reading another user's environ needs root (or the same user); an unreadable worker is reported with
    C(error) and counts as not matching.
"""

EXAMPLES = r"""
- name: NCCL variables in every TP worker
  gpufleet.fleet.sglang_worker_env_info:
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
    pid:
      description: >-
        Worker pid.
      type: int
    title:
      description: >-
        Title/command line from /proc/<pid>/cmdline (e.g. C(sglang::scheduler_TP3)).
      type: str
    env:
      description: >-
        Requested variables present in the worker (name → value).
      type: dict
    missing:
      description: >-
        Expected names absent from the worker's environment.
      type: list
      elements: str
    mismatched:
      description: >-
        name → {expected, actual} for values that differ.
      type: dict
    match:
      description: >-
        True when nothing is missing or mismatched and environ was readable.
      type: bool
    error:
      description: >-
        Why environ could not be read (only when it could not).
      type: str
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
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_environ import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    CLOBBERED_HINT, WorkerEnvError, worker_env_options, candidate_pids, compare_env, inspect_workers, parse_environ,
    read_environ, read_workers, worker_report)

try:
    import psutil
except ImportError:
    psutil = None
    PSUTIL_IMPORT_ERROR = traceback.format_exc()
else:
    PSUTIL_IMPORT_ERROR = None


def main():
    module = AnsibleModule(
        argument_spec=dict(
            pid=dict(type="int"),
            pid_file=dict(type="path"),
            **worker_env_options()
        ),
        mutually_exclusive=[("pid", "pid_file")],
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    if psutil is None:
        module.fail_json(msg=missing_required_lib("psutil"), exception=PSUTIL_IMPORT_ERROR)
    p = module.params
    try:
        result = read_workers(p["pid"], p["pid_file"], p["title_pattern"], p["expected"], p["names"])
    except WorkerEnvError as exc:
        module.fail_json(msg=exc.msg, **exc.kwargs)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
