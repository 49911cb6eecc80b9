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
author: gpufleet
options:
  gpus:
    description:
      - GPUs to wait for, each a zero-based index or a UUID. Empty (the default) means every GPU.
    type: list
    elements: raw
    default: []
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
      - Give up after this many seconds and fail, naming the GPUs and processes still holding memory.
    type: float
    default: 120
  backend:
    description:
      - C(auto) uses NVML when C(nvidia-ml-py) imports and C(nvmlInit) succeeds, else C(nvidia-smi).
      - C(nvml) requires C(nvidia-ml-py); C(nvidia-smi) runs the CLI with C(LC_ALL=C).
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
attributes:
  check_mode:
    support: full
    description: Waiting changes nothing, so the module waits in check mode too (an AWX Check job
      still proves the GPUs are free).
  diff_mode:
    support: none
    description: Changes nothing.
requirements:
  - nvidia-ml-py (for the NVML backend; C(auto) falls back to nvidia-smi without it)
  - psutil (to name the holders' command lines in the timeout message; without it only pids and the
    nvidia-smi process names are given)
notes:
  - I(poll_interval_ms) must be at least 1 and I(timeout_s) at least 0. A C(timeout_s=0) checks once.
seealso:
  - module: nvidia_gpu_info
"""

EXAMPLES = r"""
- name: Wait up to 2 minutes until every GPU is free
  nvidia_gpu_wait:
    timeout_s: 120

- name: Wait for GPUs 0-3, also requiring that no compute process is left, with nvidia-smi
  nvidia_gpu_wait:
    gpus: [0, 1, 2, 3]
    require_no_processes: true
    backend: nvidia-smi
    poll_interval_ms: 100
    timeout_s: 60
  register: waited

- name: Report how long the release took
  ansible.builtin.debug:
    msg: "GPU memory free after {{ waited.elapsed_ms }} ms ({{ waited.polls }} polls)"
"""

RETURN = r"""
elapsed_ms:
  description: Time from the first poll to the poll that found every GPU free (or to giving up), ms.
  returned: always (also on timeout)
  type: int
  sample: 180
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
    index: {description: GPU index., type: int}
    uuid: {description: GPU UUID., type: str}
    memory_used_mib: {description: "Used memory, MiB (reserved excluded).", type: int}
    memory_total_mib: {description: "Total memory, MiB.", type: int}
    memory_reserved_mib: {description: "Reserved memory, MiB; null when unknown.", type: int}
    free: {description: "True when this GPU met the condition at the last poll.", type: bool}
    processes:
      description: Compute processes and fd holders on this GPU (filled on timeout, or when
        I(require_no_processes) read them).
      type: list
      elements: dict
      contains:
        pid: {description: Process id., type: int}
        used_memory_mib: {description: "MiB held; null when unknown.", type: int}
        name: {description: Process name., type: str}
        cmdline: {description: Command line., type: str}
        user: {description: Owner., type: str}
        source: {description: "C(nvml)/C(nvidia-smi) and/or C(proc_fd).", type: list, elements: str}
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.gpufleet_gpu import (
    BACKEND_CHOICES,
    gpu_processes,
    resolve_selectors,
    run_on_backend,
    wait_for_memory,
)

_CMDLINE_MAX = 160


def _short(text, limit=_CMDLINE_MAX):
    if text is None:
        return "(command line not readable: process gone or outside this PID namespace)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _proc_text(p):
    mem = " (%s MiB)" % p["used_memory_mib"] if p.get("used_memory_mib") is not None else ""
    return "pid %d%s: %s" % (p["pid"], mem, _short(p.get("cmdline") or p.get("name")))


def timeout_message(outcome, gpus, max_used_mib, timeout_s, require_no_processes=False):
    """Operator message for a timeout: each busy GPU, its MiB and its processes (pid, cmdline).

    Processes the backend lists on that GPU (they own its memory) come first; processes that only have
    its /dev/nvidia<N> open follow separately -- every CUDA process opens the node of every visible GPU,
    and monitors hold them too, so they are candidates, not proven memory owners.
    """
    parts = []
    for gpu in gpus:
        if gpu["free"]:
            continue
        procs = gpu.get("processes") or []
        owners = [p for p in procs if any(s != "proc_fd" for s in p.get("source", ()))]
        others = [p for p in procs if p not in owners]
        if owners:
            held = "held by " + "; ".join(_proc_text(p) for p in owners)
        else:
            held = ("no compute process listed by %s (from a container without the host PID namespace, "
                    "look on the host; or the driver has not finished releasing the memory)"
                    % outcome.get("backend", "the backend"))
        if others:
            held += "; device also open in " + "; ".join(_proc_text(p) for p in others)
        parts.append("GPU %d (%s): %s MiB used, %s" % (gpu["index"], gpu["uuid"], gpu["memory_used_mib"], held))
    condition = "at most %d MiB used%s per GPU" % (
        max_used_mib, " and no compute process" if require_no_processes else "")
    return ("GPU memory not released after %s s (wanted %s; %d polls). %s. "
            "Stop these processes (role sglang_stop, or kill the pids listed) and run again; "
            "raise timeout_s if the release is just slow."
            % (timeout_s, condition, outcome["polls"], " | ".join(parts)))


def run_wait(backend, params, fallback_reason=None, exclude_pids=None):
    """Run the wait with module-shaped ``params``; returns ``(ok, result, msg)`` (plain function)."""
    indices = resolve_selectors(params["gpus"], backend.inventory())
    outcome = wait_for_memory(backend, indices, params["max_used_mib"], params["require_no_processes"],
                              params["poll_interval_ms"], params["timeout_s"])
    busy = set(outcome["busy"])
    gpus = []
    for m in outcome["memory"]:
        row = dict(m)
        row["free"] = m["index"] not in busy
        row["processes"] = []
        gpus.append(row)
    if busy or outcome["processes"]:
        # Name the holders: on timeout for the operator, and when the process list was read anyway.
        per_gpu, _ = gpu_processes(backend, indices, exclude_pids=exclude_pids)
        for row in gpus:
            row["processes"] = per_gpu.get(row["index"], [])
    result = {
        "changed": False,
        "backend": backend.name,
        "backend_fallback_reason": fallback_reason,
        "elapsed_ms": outcome["elapsed_ms"],
        "polls": outcome["polls"],
        "max_used_mib": params["max_used_mib"],
        "gpus": gpus,
    }
    if outcome["ready"]:
        return True, result, None
    outcome["backend"] = backend.name
    return False, result, timeout_message(outcome, gpus, params["max_used_mib"], params["timeout_s"],
                                          params["require_no_processes"])


def main():
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="list", elements="raw", default=[]),
            max_used_mib=dict(type="int", default=1024),
            require_no_processes=dict(type="bool", default=False),
            poll_interval_ms=dict(type="int", default=50),
            timeout_s=dict(type="float", default=120),
            backend=dict(type="str", choices=list(BACKEND_CHOICES), default="auto"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["poll_interval_ms"] < 1:
        module.fail_json(msg="poll_interval_ms must be at least 1 (got %d)" % params["poll_interval_ms"])
    if params["timeout_s"] < 0:
        module.fail_json(msg="timeout_s must be 0 or more (got %s)" % params["timeout_s"])
    if params["max_used_mib"] < 0:
        module.fail_json(msg="max_used_mib must be 0 or more (got %d)" % params["max_used_mib"])

    ok, result, msg = run_on_backend(module, lambda backend, reason: run_wait(
        backend, params, reason, exclude_pids={os.getpid()}))
    if not ok:
        module.fail_json(msg=msg, **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
