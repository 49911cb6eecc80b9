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
    returned to be registered (C(playbooks/check.yml) registers it as C(fleet_check_result) and says
    C(msg), its one-line summary, per host), with what is left to do on the host (C(pending)).
  - A read the connection failed for makes the host CRIT C(unreachable); a skipped read adds nothing.
  - Runs on the controller only; never connects to the host and changes nothing.
version_added: "0.1.0"
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
  become_reads:
    description:
      - The parts a call with become is still to read (C(fleet_check_become)); returned in RV(pending.become) unless
        the host could not be reached or root would run code another user can change.
    type: list
    elements: str
    default: []
  textfile_dir:
    description:
      - The directory of the node_exporter textfile to write (empty for none); returned in RV(pending.textfile) on
        the same terms, and not in check mode. Without the Python package prometheus-client on the controller
        nothing is to be written and the verdict gets the WARN reason C(textfile_write_failed) saying so.
    type: str
    default: ""
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.conn
  - ansible.builtin.action_common_attributes.flow
attributes:
  check_mode:
    support: full
    details: Changes nothing; the same in check mode (it then leaves no textfile to write).
  diff_mode:
    support: none
    details: Changes nothing, so there is nothing to diff.
  platform:
    platforms: all
  action:
    support: full
  async:
    support: none
  bypass_host_loop:
    support: none
  become:
    support: none
  connection:
    support: none
    details: Runs on the controller; the host is not contacted.
  delegation:
    support: none
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
pending:
  description:
    - What is left to do on the host; C(playbooks/check.yml) runs each step in a play of the hosts left with it
      (filter C(gpufleet.fleet.gpufleet_check_pending)).
  returned: always
  type: dict
  contains:
    become:
      description: The parts to read with become (empty for none).
      type: list
      elements: str
    textfile:
      description: The directory of gpufleet.prom to write (empty for none).
      type: str
msg:
  description: The verdict in one line (verdict, GPUs ok/total, the reasons).
  returned: always
  type: str
  sample: "WARN, GPUs 7/8: WARN throttle clocks slowed: hw_slowdown"
"""
