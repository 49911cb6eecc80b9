#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: append one verified launch to the host's launch history (issue 34).
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: gpufleet_launch_history
short_description: Append one verified SGLang launch to the host's launch history
description:
  - "Adds O(entry) as one JSON line to O(path) (the host's launch history, oldest first) and keeps the
    O(max_entries) newest. The file is rewritten atomically (temporary file in the same directory, fsync,
    rename): a reader never sees half a line, a crash never loses the older entries."
  - The file is created by the user the module runs as, with mode C(0600) (it holds argv and environment).
  - An O(entry) holding a key that names a secret (C(api_key), C(--api-key), C(HF_TOKEN), C(password),
    C(secret), C(authorization) ...) with a value other than null, empty, a boolean or C(********) is refused and
    nothing is written; the history records only whether an API key was set.
  - Role C(sglang_launch) calls it (entry point C(history)) after every verified launch; C(gpufleet history HOST)
    and C(playbooks/history.yml) show it (module M(gpufleet.fleet.gpufleet_launch_history_info)).
version_added: "0.3.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  path:
    description:
      - The history file (JSON Lines). Its directory must exist.
    type: path
    required: true
  state:
    description:
      - V(present) appends O(entry).
    type: str
    choices: [present]
    default: present
  entry:
    description:
      - One launch, a mapping (time, run id, playbook, argv without secrets, environment, the workers' NCCL
        values, SGLang release, model paths, figures, host; docs/history.md lists the fields).
    type: dict
    required: true
  max_entries:
    description:
      - How many of the newest entries the file keeps; older ones are dropped in the same rewrite.
    type: int
    default: 200
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Checks the entry and reads the file; writes nothing and reports C(changed).
  diff_mode:
    support: none
    details: The new line is in RV(line_bytes) only by its size; the entry itself is the task's argument.
  platform:
    support: full
    platforms: posix
seealso:
  - module: gpufleet.fleet.gpufleet_launch_history_info
"""

EXAMPLES = r"""
- name: Remember this launch
  gpufleet.fleet.gpufleet_launch_history:
    path: /var/lib/gpufleet/history.jsonl
    entry:
      time: "2026-12-05T11:00:00Z"
      run_id: "20261205T110000Z-1"
      playbook: restart
      argv: [/opt/sglang/bin/python, -m, sglang.launch_server, --model-path, /models/k2]
      nccl_env: {NCCL_PROTO: LL}
    max_entries: 200
"""

RETURN = r"""
path:
  description: The history file.
  returned: always
  type: str
  sample: /var/lib/gpufleet/history.jsonl
entries:
  description: Entries the file holds after this call (in check mode, would hold).
  returned: always
  type: int
  sample: 12
dropped:
  description: Older entries dropped to keep O(max_entries).
  returned: always
  type: int
  sample: 0
mode:
  description: The file's mode.
  returned: always
  type: str
  sample: "0600"
line_bytes:
  description: Size of the appended line in bytes.
  returned: always
  type: int
  sample: 1830
"""

import gc

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_launch_history import (
    HistoryError, append_entry, check_entry, mask_secrets)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            state=dict(type="str", choices=["present"], default="present"),
            entry=dict(type="dict", required=True),
            max_entries=dict(type="int", default=200),
        ),
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    params = module.params
    # What the result echoes of the task's arguments: never a secret the entry should not have held.
    invocation = {"module_args": dict(params, entry=mask_secrets(params["entry"]))}
    try:
        line = check_entry(params["entry"])
        result = append_entry(params["path"], params["entry"], params["max_entries"], module.check_mode)
    except HistoryError as exc:
        module.fail_json(msg="%s: %s" % (params["path"], exc), invocation=invocation)
    except OSError as exc:
        module.fail_json(msg="%s: cannot write the launch history: %s" % (params["path"], exc), invocation=invocation)
    result["line_bytes"] = len(line.encode("utf-8"))
    module.exit_json(invocation=invocation, **result)


if __name__ == "__main__":
    gc.freeze()
    main()
