#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: wait on the target until GPU memory is really released (one module call, no retry loop).
from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_gpu_wait
short_description: Wait on the target until NVIDIA GPU memory is free
description:
  - Polls the selected GPUs from the target itself until every one has
    C(memory_used_mib <= max_used_mib), and with I(require_no_processes) no compute process either.
    It fails after I(timeout_s).
  - One module call holds one backend session for the whole wait. NVML C(nvmlInit) runs once (about
    11 ms), then each poll is an C(nvmlDeviceGetMemoryInfo) call (about 5 us per GPU). With nvidia-smi,
    each poll is one C(nvidia-smi --query-gpu) run (about 30 ms). Ansible's C(until)/C(retries) loop
    would instead pay a full module round trip per poll.
  - On timeout the task fails with a message naming each GPU still over the limit. The message gives the
    memory in use and the processes on it (pid and command line) from the backend's compute process list
    and the C(/proc/*/fd) scan, so an operator knows what to stop.
  - Memory released never means literally 0 MiB. C(memory_used_mib) excludes the reserved memory (NVML
    v2), but a GPU with a live CUDA context still shows a few hundred MiB.
  - Never changes anything, so it also waits in check mode. C(changed) is always false.
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  max_used_mib:
    description:
      - A GPU counts as free when its used memory (MiB, reserved memory excluded) is at most this.
      - The default 1024 sits between idle and loaded on an H200 (driver 580.159). Idle, nvidia-smi and NVML
        v2 show 0 MiB used, and NVML v1 (the fallback for drivers without v2) shows 615 MiB because it
        counts the reserved memory. A worker holding 20 GiB shows 21099 MiB and the recorded 30 GiB worker
        31339 MiB. So an idle GPU passes through either memory API and a loaded model fails.
      - A process that keeps only a CUDA context (torch 2.11, nothing allocated) shows 529 MiB and passes
        this test. Add I(require_no_processes=true) to demand that no compute process is left at all.
    type: int
    default: 1024
  baseline_mib:
    description:
      - "Memory others held on a GPU while the old server ran, C({GPU index: MiB}) (the C(sglang_preflight) role
        measures it: C(gpu_after_stop.baseline_mib) of M(gpufleet.fleet.sglang_host_info)). Such a GPU counts as free at that
        memory plus O(max_used_mib): the wait is for the server's own memory, not for memory of a process no GPU
        list names (a container's job) that will not go."
      - Empty (the default) means every GPU must come down to O(max_used_mib).
    type: dict
    default: {}
  require_no_processes:
    description:
      - Also require that no compute process remains on the selected GPUs. The compute process list comes
        from NVML C(nvmlDeviceGetComputeRunningProcesses) or C(nvidia-smi --query-compute-apps). It is
        read only once memory is below the limit.
      - The C(/proc/*/fd) holders are not counted, because monitors and C(nvidia-persistenced) hold
        C(/dev/nvidia*) for ever. They are named in the timeout message.
    type: bool
    default: false
  poll_interval_ms:
    description:
      - Time between the starts of two polls, in ms. A poll slower than this (nvidia-smi on many GPUs) is
        followed at once.
    type: int
    default: 50
  timeout_s:
    description:
      - Give up after this many seconds and fail (C(error_class=not_released)), naming the GPUs and
        processes still holding memory. Counted from I(started_at) when given.
      - Each C(nvidia-smi) run and C(nvmlInit) gets the time left of this call (at least 3 s). One that does
        not answer is abandoned, not waited for, and the task fails at once with C(error_class=timeout),
        naming the command, the seconds and where to look (Xid in the kernel log, processes in D state).
    type: float
    default: 120
  slice_s:
    description:
      - Return after at most this many seconds even if the wait is not over, with C(ready=false) and
        C(failed=false) while time of I(timeout_s) is left, so a role can print C(progress) between
        calls (modules cannot stream output). Unset (the default) waits the whole I(timeout_s) in one call.
      - Release detection is unchanged inside a slice (one poll every I(poll_interval_ms)).
      - At least I(timeout_s) / 100, so a whole wait takes at most about 100 calls (the gpu_memory_wait role
        chains them by a recursive include, which ansible-core cannot take a few hundred levels deep).
    type: float
  started_at:
    description:
      - When the whole wait began, seconds since the epoch on the target (the C(started_at) a previous slice
        returned). I(timeout_s), C(elapsed_ms) and C(progress) then count from it. Unset means now.
    type: float
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpufleet.fleet.nvidia_gpu
attributes:
  check_mode:
    support: full
    details: Waiting changes nothing, so the module waits in check mode too (an AWX Check job
      still proves the GPUs are free).
  diff_mode:
    support: none
    details: Changes nothing.
  platform:
    support: full
    platforms: linux
requirements:
  - psutil (to name the holders' command lines in the timeout message; without it only pids and the
    nvidia-smi process names are given)
notes:
  - A host with no GPU never reads as free (C(error_class=no_devices)).
  - I(poll_interval_ms) must be at least 1 and I(timeout_s) at least 0. A C(timeout_s=0) checks once.
  - A GPU whose C(memory.used) or C(memory.total) cannot be read (C([N/A]), C([Unknown Error]); NVML
    NotSupported/Unknown) fails at the first poll with C(error_class=field_unavailable), naming the GPU, the
    field and the raw text, instead of waiting out the timeout.
  - Failures carry C(error_class), the same values as M(gpufleet.fleet.nvidia_gpu_info) plus C(not_released) (memory
    still in use at the end of I(timeout_s)) and C(field_unavailable). The message starts with the
    driver's own text.
seealso:
  - module: gpufleet.fleet.nvidia_gpu_info
"""

EXAMPLES = r"""
- name: Wait up to 2 minutes until every GPU is free
  gpufleet.fleet.nvidia_gpu_wait:
    timeout_s: 120

- name: Wait for GPUs 0-3, also requiring that no compute process is left, with nvidia-smi
  gpufleet.fleet.nvidia_gpu_wait:
    gpus: [0, 1, 2, 3]
    require_no_processes: true
    backend: nvidia-smi
    poll_interval_ms: 100
    timeout_s: 60
  register: waited

- name: Report how long the release took
  ansible.builtin.debug:
    msg: "GPU memory free after {{ waited.elapsed_ms }} ms ({{ waited.polls }} polls)"

- name: One 10 s slice of a 120 s wait (the gpu_memory_wait role loops over these and prints progress)
  gpufleet.fleet.nvidia_gpu_wait:
    timeout_s: 120
    slice_s: 10
    expected_count: 8
  register: waited

- name: Show where the wait stands
  ansible.builtin.debug:
    msg: "{{ waited.progress }}"
  when: not waited.ready
"""

RETURN = r"""
elapsed_ms:
  description: Time from the start of the wait (I(started_at), else the first poll) to the poll that found
    every GPU free (or to giving up), ms.
  returned: always (also on timeout)
  type: int
  sample: 180
ready:
  description: True when every selected GPU met the condition.
  returned: success and on not_released
  type: bool
started_at:
  description: Start of the whole wait, seconds since the epoch on the target; pass it to the next slice.
  returned: success and on not_released
  type: float
  sample: 1796000000.25
progress:
  description: "One line on where the wait stands, e.g. C(GPU memory: 3 of 8 GPUs above 1024 MiB (max 30012
    MiB on GPU 2), 20 s of 120 s)."
  returned: success and on not_released
  type: str
error_class:
  description: "On failure: C(not_released) (timeout_s ran out), C(field_unavailable), C(timeout),
    C(driver_not_loaded), C(driver_mismatch), C(no_devices), C(fewer_gpus), C(gpu_lost),
    C(device_handle_error), C(backend_unavailable), C(missing_library), C(bad_selector), C(bad_option),
    C(backend_error)."
  returned: failure
  type: str
  sample: not_released
device_holders:
  description: On not_released, every process with a /dev/nvidia* file open, as in M(gpufleet.fleet.nvidia_gpu_info)
    (C(kind) C(gpu), C(shared_only) or C(monitor)).
  returned: on not_released
  type: list
  elements: dict
baseline_mib:
  description: "The O(baseline_mib) the wait allowed for, C({GPU index: MiB})."
  returned: when the wait ran
  type: dict
  sample: {"3": 20018}
polls:
  description: Number of polls made.
  returned: always (also on timeout)
  type: int
  sample: 4
backend:
  description: Backend used, C(nvml) or C(nvidia-smi).
  returned: always
  type: str
backend_fallback_reason:
  description: Why C(auto) did not use NVML; null when it did.
  returned: always
  type: str
max_used_mib:
  description: The limit applied, MiB.
  returned: always
  type: int
gpus:
  description: Final state of each selected GPU.
  returned: always (on timeout with the holders)
  type: list
  elements: dict
  contains:
    index:
      description: >-
        GPU index.
      type: int
    uuid:
      description: >-
        GPU UUID.
      type: str
    memory_used_mib:
      description: >-
        Used memory, MiB (reserved excluded).
      type: int
    memory_total_mib:
      description: >-
        Total memory, MiB.
      type: int
    memory_reserved_mib:
      description: >-
        Reserved memory, MiB; null when unknown.
      type: int
    free:
      description: >-
        True when this GPU met the condition at the last poll.
      type: bool
    processes:
      description: Compute processes and fd holders on this GPU (filled on timeout, or when
        I(require_no_processes) read them).
      type: list
      elements: dict
      contains:
        pid:
          description: >-
            Process id.
          type: int
        used_memory_mib:
          description: >-
            MiB held; null when unknown.
          type: int
        name:
          description: >-
            Process name.
          type: str
        cmdline:
          description: >-
            Command line.
          type: str
        user:
          description: >-
            Owner.
          type: str
        source:
          description: >-
            C(nvml)/C(nvidia-smi) and/or C(proc_fd).
          type: list
          elements: str
        kind:
          description: >-
            C(gpu), or C(monitor) for a known GPU watcher.
          type: str
"""

import gc

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_wait import (  # noqa: F401 -- re-exported; pylint: disable=unused-import
    WAIT_OPTIONS,
    run_wait,
    timeout_message,
    wait_or_fail,
)


def main():
    module = AnsibleModule(argument_spec=dict(WAIT_OPTIONS), supports_check_mode=True)
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    wait_or_fail(module, module.params)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
