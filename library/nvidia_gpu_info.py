#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: read-only report of the NVIDIA GPUs of a host, with the processes that use them.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_gpu_info
short_description: Report NVIDIA GPUs, their memory, health counters and the processes using them
description:
  - Reads every (or each selected) NVIDIA GPU of the target through NVML (the C(nvidia-ml-py) package,
    imported as C(pynvml)) or the C(nvidia-smi) command, and returns the same fields from both.
  - Never changes anything; runs in check mode.
  - C(memory_used_mib) excludes the memory the driver reserves (NVML C(nvmlDeviceGetMemoryInfo) with
    C(nvmlMemory_v2), equal to nvidia-smi C(memory.used)). An idle H200 shows 0 MiB used and 616 MiB reserved.
  - Processes are found from two sources, recorded per process in C(source). The backend's compute process
    list (NVML C(nvmlDeviceGetComputeRunningProcesses) or C(nvidia-smi --query-compute-apps)) is empty inside
    containers without the host PID namespace. So the module also scans C(/proc/*/fd) for open
    C(/dev/nvidia*) files (C(proc_fd)). That scan also finds processes that only query the GPU
    (C(nvidia-smi), DCGM, C(nvidia-persistenced), monitors), so a holder is not necessarily a memory user.
  - The module's own process is left out of the process lists.
version_added: "0.1.0"
author: gpufleet
options:
  gpus:
    description:
      - GPUs to report, each a zero-based index (C(0), C("3")) or a UUID (C(GPU-8b76e503-...)).
      - Empty (the default) means every GPU. An index or UUID that does not exist fails the task and
        lists the GPUs present.
    type: list
    elements: raw
    default: []
  processes:
    description:
      - Discover the processes on each GPU and the holders of C(/dev/nvidia*). Needs C(psutil) on the target.
      - Set to C(false) for a faster answer with GPU fields only.
    type: bool
    default: true
  backend:
    description:
      - C(auto) uses NVML when C(nvidia-ml-py) imports and C(nvmlInit) succeeds, else C(nvidia-smi).
        The return value C(backend_fallback_reason) says why NVML was not used.
      - C(nvml) requires C(nvidia-ml-py) and a working C(libnvidia-ml.so.1).
      - C(nvidia-smi) runs C(nvidia-smi --query-gpu=... --format=csv,noheader,nounits) with C(LC_ALL=C).
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
attributes:
  check_mode:
    support: full
    description: Read-only; runs the same in check mode.
  diff_mode:
    support: none
    description: Changes nothing, so there is nothing to diff.
requirements:
  - nvidia-ml-py (for the NVML backend; C(auto) falls back to nvidia-smi without it)
  - psutil (when I(processes=true))
  - An NVIDIA driver; C(nvidia-smi) on PATH for the nvidia-smi backend
notes:
  - Fields a GPU does not support (C([N/A]), C([Not Supported]), C(NVMLError_NotSupported)) are returned
    as C(null) rather than failing.
  - Failures say what to do. These are a driver that is not loaded, no C(libnvidia-ml.so.1) and no
    C(nvidia-smi), or a GPU that is lost (Xid 79, needs a reset or reboot).
seealso:
  - module: nvidia_gpu_wait
"""

EXAMPLES = r"""
- name: Report all GPUs with their processes
  nvidia_gpu_info:
  register: gpu

- name: Show memory per GPU
  ansible.builtin.debug:
    msg: "{{ gpu.gpus | map(attribute='memory_used_mib') | list }}"

- name: Two GPUs by index and one by UUID, no process discovery, force nvidia-smi
  nvidia_gpu_info:
    gpus: [0, 1, GPU-8b76e503-d849-6334-acea-f57e29736cb3]
    processes: false
    backend: nvidia-smi

- name: Fail when a GPU has pending row remaps (needs a GPU reset)
  ansible.builtin.assert:
    that: gpu.gpus | selectattr('remapped_rows_pending') | list | length == 0
"""

RETURN = r"""
backend:
  description: Backend that answered, C(nvml) or C(nvidia-smi).
  returned: success
  type: str
  sample: nvml
backend_fallback_reason:
  description: Why C(auto) did not use NVML (null when it did, or when a backend was chosen).
  returned: success
  type: str
  sample: "NVML: libnvidia-ml.so.1 was not found (NVML Shared Library Not Found). ..."
driver_version:
  description: NVIDIA driver version (NVML nvmlSystemGetDriverVersion, nvidia-smi driver_version).
  returned: success
  type: str
  sample: "580.159.04"
cuda_version:
  description: Highest CUDA version the driver supports (nvmlSystemGetCudaDriverVersion_v2, or the
    nvidia-smi banner); null when unknown.
  returned: success
  type: str
  sample: "13.0"
gpu_count:
  description: Number of GPUs on the host (all of them, not only the selected ones).
  returned: success
  type: int
  sample: 8
gpus:
  description: One entry per selected GPU, in index order.
  returned: success
  type: list
  elements: dict
  contains:
    index: {description: "Zero-based GPU index (NVML enumeration order, nvidia-smi index).", type: int}
    uuid: {description: GPU UUID (nvmlDeviceGetUUID, nvidia-smi uuid)., type: str,
           sample: GPU-8b76e503-d849-6334-acea-f57e29736cb3}
    name: {description: Product name., type: str, sample: NVIDIA H200}
    pci_bus_id: {description: PCI bus id., type: str, sample: "00000000:00:06.0"}
    minor_number: {description: "N of /dev/nvidia<N> (nvmlDeviceGetMinorNumber, or
                   /proc/driver/nvidia/gpus/<bus>/information); null when unknown.", type: int}
    memory_used_mib: {description: "Used memory in MiB, without reserved memory (NVML v2 used,
                      nvidia-smi memory.used).", type: int, sample: 31339}
    memory_total_mib: {description: Total memory in MiB., type: int, sample: 143771}
    memory_reserved_mib: {description: "Memory the driver reserves, MiB (NVML v2 reserved, nvidia-smi
                          memory.reserved); null when the driver does not report it.", type: int, sample: 616}
    utilization_gpu_pct: {description: "GPU utilisation over the last sample period, percent.", type: int}
    temperature_gpu_c: {description: "GPU core temperature, degrees C.", type: int, sample: 35}
    power_draw_w: {description: "Power draw in W (nvmlDeviceGetPowerUsage / 1000, nvidia-smi power.draw).",
                   type: float, sample: 78.94}
    power_limit_w: {description: "Power management limit in W (nvmlDeviceGetPowerManagementLimit,
                    nvidia-smi power.limit).", type: float, sample: 700.0}
    persistence_mode: {description: "C(Enabled) or C(Disabled).", type: str}
    compute_mode: {description: "C(Default), C(Exclusive_Process) or C(Prohibited).", type: str}
    ecc_errors_corrected_volatile_total: {description: "Corrected ECC errors since the driver loaded
                                          (nvmlDeviceGetTotalEccErrors, volatile); null without ECC.",
                                          type: int}
    ecc_errors_uncorrected_volatile_total: {description: Uncorrected ECC errors since the driver loaded.,
                                            type: int}
    remapped_rows_correctable: {description: Rows remapped for correctable errors (nvmlDeviceGetRemappedRows).,
                                type: int}
    remapped_rows_uncorrectable: {description: Rows remapped for uncorrectable errors., type: int}
    remapped_rows_pending: {description: "True when a remap waits for a GPU reset.", type: bool}
    remapped_rows_failure: {description: "True when a remap failed (GPU needs service).", type: bool}
    processes:
      description: Processes on this GPU (only with I(processes=true)).
      type: list
      elements: dict
      contains:
        pid: {description: Process id (in the target's PID namespace)., type: int}
        used_memory_mib: {description: "GPU memory of this process, MiB; null when only the fd scan found
                          it or the driver cannot tell.", type: int}
        name: {description: Process name (psutil; nvidia-smi process_name when psutil cannot see it)., type: str}
        cmdline: {description: "Command line joined with spaces; null when unreadable.", type: str}
        user: {description: Owner user name., type: str}
        source: {description: "Where it was found: C(nvml) or C(nvidia-smi), and/or C(proc_fd).",
                 type: list, elements: str}
device_holders:
  description: Every process with a /dev/nvidia* file open, including those that hold only
    /dev/nvidiactl or /dev/nvidia-uvm (no specific GPU). Empty with I(processes=false).
  returned: success
  type: list
  elements: dict
  contains:
    pid: {description: Process id., type: int}
    name: {description: Process name., type: str}
    cmdline: {description: Command line joined with spaces., type: str}
    user: {description: Owner user name., type: str}
    devices: {description: Open device paths., type: list, elements: str, sample: ["/dev/nvidia0", "/dev/nvidiactl"]}
    gpu_indices: {description: GPUs whose /dev/nvidia<N> it holds (empty when none)., type: list, elements: int}
"""

import os

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible.module_utils.gpufleet_gpu import (
    BACKEND_CHOICES,
    gpu_processes,
    resolve_selectors,
    run_on_backend,
)
from ansible.module_utils.gpufleet_procs import HAS_PSUTIL, PSUTIL_IMPORT_ERROR


def gather(backend, selectors, processes=True, fallback_reason=None, exclude_pids=None):
    """Build the module's result from an open backend (plain function, no Ansible needed)."""
    inventory = backend.inventory()
    indices = resolve_selectors(selectors, inventory)
    system = backend.system()
    gpus = backend.details(indices)
    holders = []
    if processes:
        per_gpu, holders = gpu_processes(backend, indices, exclude_pids=exclude_pids)
        for gpu in gpus:
            gpu["processes"] = per_gpu.get(gpu["index"], [])
    return {
        "changed": False,
        "backend": backend.name,
        "backend_fallback_reason": fallback_reason,
        "driver_version": system.get("driver_version"),
        "cuda_version": system.get("cuda_version"),
        "gpu_count": len(inventory),
        "gpus": gpus,
        "device_holders": holders,
    }


def main():
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="list", elements="raw", default=[]),
            processes=dict(type="bool", default=True),
            backend=dict(type="str", choices=list(BACKEND_CHOICES), default="auto"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["processes"] and not HAS_PSUTIL:
        module.fail_json(msg=missing_required_lib("psutil") + " (or set processes: false)",
                         exception=str(PSUTIL_IMPORT_ERROR))

    result = run_on_backend(module, lambda backend, reason: gather(
        backend, params["gpus"], params["processes"], reason, exclude_pids={os.getpid()}))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
