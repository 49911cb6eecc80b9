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
    type: float
  started_at:
    description:
      - When the whole wait began, seconds since the epoch on the target (the C(started_at) a previous slice
        returned). I(timeout_s), C(elapsed_ms) and C(progress) then count from it. Unset means now.
    type: float
  expected_count:
    description:
      - Number of GPUs this host must have; fewer fails at once (C(error_class=fewer_gpus)). Zero GPUs
        always fails (C(no_devices)); a host with no GPU never reads as free.
      - Playbooks pass the inventory variable C(gpufleet_expected_gpus) (unset by default).
    type: int
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
  - A GPU whose C(memory.used) or C(memory.total) cannot be read (C([N/A]), C([Unknown Error]); NVML
    NotSupported/Unknown) fails at the first poll with C(error_class=field_unavailable), naming the GPU, the
    field and the raw text, instead of waiting out the timeout.
  - Failures carry C(error_class), the same values as M(nvidia_gpu_info) plus C(not_released) (memory
    still in use at the end of I(timeout_s)) and C(field_unavailable). The message starts with the
    driver's own text.
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

- name: One 10 s slice of a 120 s wait (the gpu_memory_wait role loops over these and prints progress)
  nvidia_gpu_wait:
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
  description: On not_released, every process with a /dev/nvidia* file open, as in M(nvidia_gpu_info)
    (C(kind) C(gpu), C(shared_only) or C(monitor)).
  returned: on not_released
  type: list
  elements: dict
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
        kind: {description: "C(gpu), or C(monitor) for a known GPU watcher.", type: str}
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu import (
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


def timeout_message(outcome, gpus, max_used_mib, timeout_s, require_no_processes=False, device_holders=None):
    """Operator message for a timeout: each busy GPU, its MiB and its processes (pid, cmdline).

    Processes the backend lists on that GPU (they own its memory) come first; processes that only have
    its /dev/nvidia<N> open follow separately -- every CUDA process opens the node of every visible GPU,
    and monitors hold them too, so they are candidates, not proven memory owners. When no GPU has a listed
    compute process, the fd holders are named instead (per-GPU holders, then holders of only the shared
    nodes nvidiactl / nvidia-uvm), so the operator always has pids to look at.
    """
    parts = []
    any_owner = False
    for gpu in gpus:
        if gpu["free"]:
            continue
        procs = gpu.get("processes") or []
        owners = [p for p in procs if any(s != "proc_fd" for s in p.get("source", ()))]
        others = [p for p in procs if p not in owners and p.get("kind") != "monitor"]
        monitors = [p for p in procs if p not in owners and p.get("kind") == "monitor"]
        if owners:
            any_owner = True
            held = "held by " + "; ".join(_proc_text(p) for p in owners)
        else:
            held = ("no compute process listed by %s (from a container without the host PID namespace, "
                    "look on the host; or the driver has not finished releasing the memory)"
                    % outcome.get("backend", "the backend"))
        if others:
            held += "; device also open in " + "; ".join(_proc_text(p) for p in others)
        if monitors:
            held += "; monitors with it open (they hold no memory, leave them): " + "; ".join(
                _proc_text(p) for p in monitors)
        parts.append("GPU %d (%s): %s MiB used, %s" % (gpu["index"], gpu["uuid"], gpu["memory_used_mib"], held))
    condition = "at most %d MiB used%s per GPU" % (
        max_used_mib, " and no compute process" if require_no_processes else "")
    if any_owner:
        todo = ("Stop these processes (role sglang_stop, or kill the pids listed) and run again; "
                "raise timeout_s if the release is just slow.")
    else:
        holders = [h for h in device_holders or () if h.get("kind") != "monitor"]
        per_gpu = [h for h in holders if h.get("kind") == "gpu"]
        shared = [h for h in holders if h.get("kind") == "shared_only"]
        named = []
        if per_gpu:
            named.append("processes with a GPU device open: " + "; ".join(_proc_text(h) for h in per_gpu))
        if shared:
            named.append("processes holding only the shared nodes (nvidiactl, nvidia-uvm): "
                         + "; ".join(_proc_text(h) for h in shared))
        if named:
            todo = ("No compute process is listed; the candidates are the %s. Stop those that belong to the "
                    "old server (role sglang_stop) and run again; raise timeout_s if the release is just slow."
                    % " | ".join(named))
        else:
            todo = ("No process with /dev/nvidia* open is visible from here either: look on the host "
                    "(`nvidia-smi`, `fuser -v /dev/nvidia*` as root); raise timeout_s if the release is just slow.")
    return ("GPU memory not released after %s s (wanted %s; %d polls). %s. %s"
            % (timeout_s, condition, outcome["polls"], " | ".join(parts), todo))


def run_wait(backend, params, fallback_reason=None, exclude_pids=None, started_at=None, now=time.time):
    """Run the wait (or one slice of it) with module-shaped ``params``; returns ``(ok, result, msg)``.

    ``ok`` is False only when the whole wait (``timeout_s`` from ``started_at``) ran out; a slice that ends
    with time left returns ok with ``ready`` False. Plain function (no Ansible needed).
    """
    indices = resolve_selectors(params["gpus"], backend.inventory())
    started_at = now() if started_at is None else float(started_at)
    before = max(0.0, now() - started_at)
    outcome = wait_for_memory(backend, indices, params["max_used_mib"], params["require_no_processes"],
                              params["poll_interval_ms"], params["timeout_s"], slice_s=params.get("slice_s"),
                              elapsed_before_s=before)
    busy = set(outcome["busy"])
    gpus = []
    for m in outcome["memory"]:
        row = dict(m)
        row["free"] = m["index"] not in busy
        row["processes"] = []
        gpus.append(row)
    holders = None
    final_timeout = bool(busy) and not outcome["slice_ended"]
    if final_timeout or (outcome["processes"] and not busy):
        # Name the holders: on timeout for the operator, and when the process list was read anyway.
        per_gpu, holders = gpu_processes(backend, indices, exclude_pids=exclude_pids)
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
        "ready": outcome["ready"],
        "started_at": round(started_at, 3),
        "progress": outcome["progress"],
    }
    if not final_timeout:
        return True, result, None
    outcome["backend"] = backend.name
    result["device_holders"] = holders or []
    result["error_class"] = "not_released"
    return False, result, timeout_message(outcome, gpus, params["max_used_mib"], params["timeout_s"],
                                          params["require_no_processes"], holders)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="list", elements="raw", default=[]),
            max_used_mib=dict(type="int", default=1024),
            require_no_processes=dict(type="bool", default=False),
            poll_interval_ms=dict(type="int", default=50),
            timeout_s=dict(type="float", default=120),
            slice_s=dict(type="float"),
            started_at=dict(type="float"),
            expected_count=dict(type="int"),
            backend=dict(type="str", choices=list(BACKEND_CHOICES), default="auto"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["poll_interval_ms"] < 1:
        module.fail_json(msg="poll_interval_ms must be at least 1 (got %d)" % params["poll_interval_ms"],
                         error_class="bad_option")
    for key in ("timeout_s", "max_used_mib", "slice_s", "expected_count"):
        if params[key] is not None and params[key] < 0:
            module.fail_json(msg="%s must be 0 or more (got %s)" % (key, params[key]), error_class="bad_option")

    started_at = params["started_at"] if params["started_at"] is not None else time.time()
    left = max(0.0, params["timeout_s"] - max(0.0, time.time() - started_at))
    budget = left if params["slice_s"] is None else min(left, params["slice_s"])
    ok, result, msg = run_on_backend(module, lambda backend, reason: run_wait(
        backend, params, reason, exclude_pids={os.getpid()}, started_at=started_at),
        timeout_s=budget, expected_count=params["expected_count"])
    if not ok:
        module.fail_json(msg=msg, **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
