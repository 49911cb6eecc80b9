#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: documentation of the gpufleet_check_judge action (plugins/action/gpufleet_check_judge.py runs it).
from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: gpufleet_check_judge
short_description: Judge one GPU host from what the fleet check read (OK, WARN or CRIT with reasons)
description:
  - >-
    Makes the fleet check's verdict for one host on the controller, from the results of
    M(gpufleet.fleet.sglang_fleet_check_info) (the call as the login user, then the one with become, if any): GPU
    health, driver, the SGLang server, launch-args drift, NCCL blocks and workers' values. The verdict is
    returned to be registered (C(playbooks/check.yml) registers it as C(fleet_check_result)), and its one-line
    summary as O(ignore:msg), which the C(gpufleet.fleet.gpufleet_default) output prints per host.
  - A read the connection failed for makes the host CRIT C(unreachable); a skipped read adds nothing.
  - Runs on the controller only; never connects to the host and changes nothing.
version_added: "0.3.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  reads:
    description:
      - The registered results of M(gpufleet.fleet.sglang_fleet_check_info), the login user's call first.
    type: list
    elements: raw
    required: true
  config:
    description:
      - >-
        Thresholds and expectations (keys as the fleet_check role's C(fleet_check_*) variables without the
        prefix, e.g. C(expected_gpus), C(gpu_temp_warn_c), C(xid_severity)); a missing key takes the core's
        default.
    type: dict
    default: {}
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.conn
attributes:
  check_mode:
    support: full
    details: Changes nothing; the same in check mode.
  diff_mode:
    support: none
    details: Changes nothing, so there is nothing to diff.
  platform:
    platforms: all
  action:
    support: full
  bypass_host_loop:
    support: none
  connection:
    support: none
    details: Runs on the controller; the host is not contacted.
seealso:
  - module: gpufleet.fleet.sglang_fleet_check_info
"""

EXAMPLES = r"""
- name: Judge the host
  gpufleet.fleet.gpufleet_check_judge:
    reads:
      - "{{ _fleet_check_read }}"
      - "{{ _fleet_check_read_become | default({}) }}"
    config:
      expected_gpus: 8
  register: fleet_check_result
"""

RETURN = r"""
verdict:
  description: The host's verdict.
  returned: always
  type: str
  sample: WARN
reasons:
  description: Why, worst first; each with C(severity) (WARN or CRIT), C(gpu) (index or null), C(code) and C(text).
  returned: always
  type: list
  elements: dict
gpus_ok:
  description: GPUs with no finding.
  returned: always
  type: int
gpus_total:
  description: GPUs expected or found, whichever is more.
  returned: always
  type: int
gpus:
  description: Each GPU's own verdict and reasons.
  returned: always
  type: list
  elements: dict
sglang:
  description: What was found of the SGLang server (running, serving, version, drift).
  returned: always
  type: dict
driver_version:
  description: The NVIDIA driver release the GPU read reported, or null.
  returned: always
  type: str
msg:
  description: The verdict in one line (verdict, GPUs ok/total, the reasons).
  returned: always
  type: str
  sample: "WARN, GPUs 7/8: WARN throttle clocks slowed: hw_slowdown"
"""
