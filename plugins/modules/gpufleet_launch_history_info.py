#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: read the host's launch history (issue 34).
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: gpufleet_launch_history_info
short_description: Read the host's launch history
description:
  - Reads the launch history that module M(gpufleet.fleet.gpufleet_launch_history) writes (JSON Lines, oldest
    first) and returns its O(last) newest entries. Lines that are not JSON objects are skipped and counted.
  - "A missing file is no error (no launch verified yet on this host): RV(entries) is empty and RV(exists) false."
  - Never changes anything.
version_added: "0.3.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  path:
    description:
      - The history file.
    type: path
    required: true
  last:
    description:
      - How many of the newest entries to return; V(0) returns all.
    type: int
    default: 20
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reads only; the same in check mode.
  diff_mode:
    support: none
    details: Nothing is changed, so there is no diff.
  platform:
    support: full
    platforms: posix
seealso:
  - module: gpufleet.fleet.gpufleet_launch_history
"""

EXAMPLES = r"""
- name: The five newest launches
  gpufleet.fleet.gpufleet_launch_history_info:
    path: /var/lib/gpufleet/history.jsonl
    last: 5
  register: history
"""

RETURN = r"""
entries:
  description: The O(last) newest entries, oldest first, as written.
  returned: always
  type: list
  elements: dict
  sample:
    - {time: "2026-12-05T11:00:00Z", run_id: "20261205T110000Z-1", playbook: restart, nccl_env: {NCCL_PROTO: LL}}
total:
  description: Entries in the file.
  returned: always
  type: int
  sample: 12
bad_lines:
  description: Lines that are not JSON objects (skipped).
  returned: always
  type: int
  sample: 0
exists:
  description: Whether the file exists.
  returned: always
  type: bool
  sample: true
path:
  description: The history file.
  returned: always
  type: str
  sample: /var/lib/gpufleet/history.jsonl
"""

import gc
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_launch_history import last, read_entries
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            last=dict(type="int", default=20),
        ),
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    path = module.params["path"]
    try:
        entries, bad = read_entries(path)
    except OSError as exc:
        module.fail_json(msg="%s: cannot read the launch history: %s (it is mode 0600, owned by the user that "
                             "wrote it: read it as that user, become: true for root)" % (path, exc))
    module.exit_json(changed=False, path=path, exists=os.path.exists(path), total=len(entries), bad_lines=bad,
                     entries=last(entries, module.params["last"]))


if __name__ == "__main__":
    gc.freeze()
    main()
