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
author: gpufleet maintainers (!UNKNOWN)
options:
  fields:
    description:
      - GPU fields to return per GPU, each by its key in RV(gpus) (V(memory_used_mib)) or by its nvidia-smi
        C(--query-gpu) name (V(memory.used), V(utilization.gpu), V(temperature.gpu), V(power.draw)); V(nvlinks)
        and V(processes) name those lists. C(index) is always returned, and C(unsupported) holds only the fields
        asked for. Empty (the default) returns every field.
      - With O(fields) set, NVLink links are read only when V(nvlinks) is among them, and processes (and
        RV(device_holders)) only when V(processes) is, whatever O(nvlink) and O(processes) say, so a short answer
        also costs less (on the nvidia-smi backend two runs instead of five).
      - A name that is not a field fails the task before any GPU is read (C(error_class=bad_option)), listing
        the names there are.
    type: list
    elements: str
    default: []
  detail:
    description:
      - V(short) (the default) says once what is the same on every GPU read (RV(gpus_same)) and groups the GPUs
        by the values that differ (RV(gpu_groups)), so an ad-hoc answer of 8 GPUs reads in a few lines. Nothing
        is left out; it is only said once.
      - V(full) returns one whole entry per GPU in RV(gpus) (and neither RV(gpus_same) nor RV(gpu_groups)). Use it
        where a task reads the answer per GPU (a C(map) or C(selectattr) over RV(gpus)).
    type: str
    choices: [short, full]
    default: short
    version_added: "0.2.0"
  processes:
    description:
      - Discover the processes on each GPU and the holders of C(/dev/nvidia*). Needs C(psutil) on the target.
      - Set to C(false) for a faster answer with GPU fields only.
    type: bool
    default: true
  timeout_s:
    description:
      - Time limit for the whole call, s. Each C(nvidia-smi) run and C(nvmlInit) gets the time left (at least
        3 s); one that does not answer is abandoned, not waited for (a wedged GPU leaves C(nvidia-smi) in D
        state for minutes), and the task fails with C(error_class=timeout), naming the command, the
        seconds and where to look (Xid in the kernel log, processes in D state).
    type: float
    default: 30
  nvlink:
    description:
      - Report NVLink links per GPU (C(nvlinks)). NVML C(nvmlDeviceGetNvLinkState) and
        C(nvmlDeviceGetNvLinkErrorCounter), or C(nvidia-smi nvlink -s) and C(nvidia-smi nvlink -e)
        (two more runs).
    type: bool
    default: true
  xid_window_min:
    description:
      - Read NVIDIA Xid events of the last this many minutes from the kernel log into C(xid_events).
        C(0) skips the read (C(xid_status=skipped)).
      - The log is C(/dev/kmsg), read record by record without blocking, or C(journalctl -k) when
        C(/dev/kmsg) cannot be opened. With C(kernel.dmesg_restrict=1) that needs root or CAP_SYSLOG. This
        module does not escalate by itself; run the task with C(become) where allowed. Without access the
        result is C(xid_events=null) with C(xid_status=unknown) and the reason, never an empty list.
    type: int
    default: 60
  kmsg_path:
    description:
      - Kernel log in C(/dev/kmsg) record format (C(<prio>,<seq>,<usec>,<flags>;<text>)). The lab points this
        at its simulated log; keep the default on real hosts. Falls back to the environment variable
        C(GPUFLEET_KMSG_PATH) on the target, then C(/dev/kmsg).
    type: path
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - gpufleet.fleet.nvidia_gpu
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
    details: Changes nothing, so there is nothing to diff.
  platform:
    support: full
    platforms: linux
requirements:
  - psutil (when I(processes=true))
notes:
  - The return value RV(backend_fallback_reason) says why O(backend=auto) did not use NVML. With
    O(backend=nvidia-smi) one call runs C(nvidia-smi) 5 times (about 30 ms each on an H200), one after the
    other - the details query, the banner (for the CUDA version), C(nvlink -s), C(nvlink -e) and
    C(--query-compute-apps) - and 2 times with O(nvlink=false) and O(processes=false).
  - Health fields a GPU does not support (C([N/A]), C([Not Supported]), C(NVMLError_NotSupported)) are
    returned as C(null) with the driver's raw answer in the GPU's C(unsupported) map, rather than failing.
    An H200 prints C([N/A]) for the retired-page fields (it uses row remapping instead).
  - Failures carry C(error_class) and a message whose first line is the driver's own text, then what to do.
    The classes are C(driver_not_loaded) (nvidia-smi rc 9), C(driver_mismatch) (rc 18, reboot or reload
    the kernel module after a driver upgrade), C(no_devices) (rc 6), C(fewer_gpus), C(gpu_lost) (rc 15,
    Xid 79), C(device_handle_error) (rc 255 "Unable to determine the device handle"), C(timeout),
    C(backend_unavailable), C(missing_library), C(bad_selector) and C(backend_error). A failure due to the
    driver or a GPU also lists the Xid events found in the kernel log.
seealso:
  - module: gpufleet.fleet.nvidia_gpu_wait
"""

EXAMPLES = r"""
- name: Report all GPUs with their processes, one entry per GPU
  gpufleet.fleet.nvidia_gpu_info:
    detail: full
  register: gpu

- name: Show memory per GPU
  ansible.builtin.debug:
    msg: "{{ gpu.gpus | map(attribute='memory_used_mib') | list }}"

- name: Memory and utilization only, as nvidia-smi names them (short; values the same on every GPU said once)
  # ad hoc: ansible gpu_hosts -m gpufleet.fleet.nvidia_gpu_info -a 'fields=memory.used,utilization.gpu xid_window_min=0'
  gpufleet.fleet.nvidia_gpu_info:
    fields: [memory.used, memory.total, utilization.gpu]
    xid_window_min: 0
  register: mem

- name: Memory used, per group of GPUs with the same value (gpus_same holds it when all GPUs agree)
  ansible.builtin.debug:
    msg: "{{ mem.gpu_groups | map('combine', mem.gpus_same) | map(attribute='memory_used_mib') | list }}"

- name: Two GPUs by index and one by UUID, no process discovery, force nvidia-smi
  gpufleet.fleet.nvidia_gpu_info:
    gpus: [0, 1, GPU-8b76e503-d849-6334-acea-f57e29736cb3]
    processes: false
    backend: nvidia-smi
    detail: full

- name: Fail when a GPU has pending row remaps (needs a GPU reset)
  ansible.builtin.assert:
    that: gpu.gpus | selectattr('remapped_rows_pending') | list | length == 0

- name: Require 8 GPUs, read Xid events of the last 30 minutes as root (dmesg_restrict)
  gpufleet.fleet.nvidia_gpu_info:
    expected_count: 8
    xid_window_min: 30
    processes: false
    detail: full
  become: true
  register: health

- name: No Xid in the window (unknown is not "none")
  ansible.builtin.assert:
    that:
      - health.xid_status == 'ok'
      - health.xid_events | length == 0
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
gpus_same:
  description:
    - With O(detail=short) (the default), the keys of RV(gpus) whose value is the same on every GPU read (an
      idle host's C(memory_used_mib), the product C(name), the C(unsupported) answers an H200 gives on every GPU),
      said once.
  returned: success and O(detail=short)
  type: dict
  sample: {memory_used_mib: 0, name: NVIDIA H200}
gpu_groups:
  description:
    - With O(detail=short) (the default), the GPUs read, grouped by the values of the keys not in RV(gpus_same),
      in the order of their first GPU. Each group holds C(gpus) (its GPU indices as ranges, C(0-7), C(0-2,5))
      and those keys with the group's values. When every value is the same there is one group holding only
      C(gpus). A GPU's whole entry is C(gpus_same) combined with its group.
  returned: success and O(detail=short)
  type: list
  elements: dict
  sample: [{gpus: "0-5", memory_used_mib: 0}, {gpus: "6,7", memory_used_mib: 31339}]
gpus:
  description: One entry per selected GPU, in index order (with O(detail=full); the short form says the same in
    RV(gpus_same) and RV(gpu_groups)).
  returned: success and O(detail=full)
  type: list
  elements: dict
  contains:
    index:
      description: >-
        Zero-based GPU index (NVML enumeration order, nvidia-smi index).
      type: int
    uuid:
      description: >-
        GPU UUID (nvmlDeviceGetUUID, nvidia-smi uuid).
      type: str
      sample: GPU-8b76e503-d849-6334-acea-f57e29736cb3
    name:
      description: >-
        Product name.
      type: str
      sample: NVIDIA H200
    pci_bus_id:
      description: >-
        PCI bus id.
      type: str
      sample: "00000000:00:06.0"
    minor_number:
      description: >-
        N of /dev/nvidia<N> (nvmlDeviceGetMinorNumber, or /proc/driver/nvidia/gpus/<bus>/information); null when
        unknown.
      type: int
    memory_used_mib:
      description: >-
        Used memory in MiB, without reserved memory (NVML v2 used, nvidia-smi memory.used).
      type: int
      sample: 31339
    memory_total_mib:
      description: >-
        Total memory in MiB.
      type: int
      sample: 143771
    memory_reserved_mib:
      description: >-
        Memory the driver reserves, MiB (NVML v2 reserved, nvidia-smi memory.reserved); null when the driver does
        not report it.
      type: int
      sample: 616
    utilization_gpu_pct:
      description: >-
        GPU utilisation over the last sample period, percent.
      type: int
    temperature_gpu_c:
      description: >-
        GPU core temperature, degrees C.
      type: int
      sample: 35
    power_draw_w:
      description: >-
        Power draw in W (nvmlDeviceGetPowerUsage / 1000, nvidia-smi power.draw).
      type: float
      sample: 78.94
    power_limit_w:
      description: >-
        Power management limit in W (nvmlDeviceGetPowerManagementLimit, nvidia-smi power.limit).
      type: float
      sample: 700.0
    persistence_mode:
      description: >-
        C(Enabled) or C(Disabled).
      type: str
    compute_mode:
      description: >-
        C(Default), C(Exclusive_Process) or C(Prohibited).
      type: str
    ecc_errors_corrected_volatile_total:
      description: >-
        Corrected ECC errors since the driver loaded (nvmlDeviceGetTotalEccErrors, volatile); null without ECC.
      type: int
    ecc_errors_uncorrected_volatile_total:
      description: >-
        Uncorrected ECC errors since the driver loaded.
      type: int
    remapped_rows_correctable:
      description: >-
        Rows remapped for correctable errors (nvmlDeviceGetRemappedRows).
      type: int
    remapped_rows_uncorrectable:
      description: >-
        Rows remapped for uncorrectable errors.
      type: int
    remapped_rows_pending:
      description: >-
        True when a remap waits for a GPU reset (remapped_rows.pending).
      type: bool
    remapped_rows_failure:
      description: >-
        True when a remap failed, GPU needs service (remapped_rows.failure).
      type: bool
    serial:
      description: >-
        Board serial number (nvmlDeviceGetSerial, nvidia-smi serial).
      type: str
      sample: "1650000000001"
    vbios_version:
      description: >-
        VBIOS version (nvmlDeviceGetVbiosVersion, vbios_version).
      type: str
      sample: 96.00.A5.00.1A
    temperature_memory_c:
      description: >-
        HBM temperature, degrees C (nvmlDeviceGetFieldValues NVML_FI_DEV_MEMORY_TEMP, temperature.memory); null
        where not reported.
      type: int
      sample: 34
    pstate:
      description: >-
        Performance state C(P0) (max) .. C(P12) (min) (nvmlDeviceGetPerformanceState, pstate).
      type: str
      sample: P0
    clocks_sm_mhz:
      description: >-
        Current SM clock, MHz (nvmlDeviceGetClockInfo NVML_CLOCK_SM, clocks.sm).
      type: int
      sample: 1980
    clocks_max_sm_mhz:
      description: >-
        Maximum SM clock, MHz (nvmlDeviceGetMaxClockInfo, clocks.max.sm).
      type: int
      sample: 1980
    clocks_event_reasons_mask:
      description: "Active clock event (throttle) reasons as a bit mask (nvmlDeviceGetCurrentClocksEventReasons,
        clocks_event_reasons.active). 1 = GPU idle, 0 = not throttled."
      type: int
      sample: 1
    clocks_event_reasons:
      description: "Names of the active reasons: gpu_idle, applications_clocks_setting, sw_power_cap,
        hw_slowdown, sync_boost, sw_thermal_slowdown, hw_thermal_slowdown, hw_power_brake_slowdown,
        display_clock_setting. Anything but gpu_idle and applications_clocks_setting slows the GPU."
      type: list
      elements: str
      sample: [gpu_idle]
    pcie_link_gen_current:
      description: >-
        Current PCIe generation (nvmlDeviceGetCurrPcieLinkGeneration, pcie.link.gen.current); idle GPUs may train
        down.
      type: int
      sample: 5
    pcie_link_gen_max:
      description: >-
        Maximum PCIe generation of GPU and system (nvmlDeviceGetMaxPcieLinkGeneration, pcie.link.gen.max).
      type: int
      sample: 5
    pcie_link_width_current:
      description: >-
        Current PCIe lanes (nvmlDeviceGetCurrPcieLinkWidth, pcie.link.width.current).
      type: int
      sample: 16
    pcie_link_width_max:
      description: >-
        Maximum PCIe lanes (nvmlDeviceGetMaxPcieLinkWidth, pcie.link.width.max).
      type: int
      sample: 16
    mig_mode_current:
      description: >-
        C(Enabled) or C(Disabled) (nvmlDeviceGetMigMode, mig.mode.current).
      type: str
    mig_mode_pending:
      description: >-
        MIG mode after the next GPU reset (mig.mode.pending).
      type: str
    ecc_mode_current:
      description: >-
        C(Enabled) or C(Disabled) (nvmlDeviceGetEccMode, ecc.mode.current).
      type: str
    ecc_errors_corrected_aggregate_total:
      description: >-
        Corrected ECC errors over the GPU's life (nvmlDeviceGetTotalEccErrors NVML_AGGREGATE_ECC,
        ecc.errors.corrected.aggregate.total).
      type: int
    ecc_errors_uncorrected_aggregate_total:
      description: >-
        Uncorrected ECC errors over the GPU's life.
      type: int
    retired_pages_single_bit_ecc_count:
      description: >-
        Pages retired for repeated single-bit errors (nvmlDeviceGetRetiredPages,
        retired_pages.single_bit_ecc.count); null on GPUs with row remapping (H100, H200).
      type: int
    retired_pages_double_bit_ecc_count:
      description: >-
        Pages retired for double-bit errors (retired_pages.double_bit.count); null on H100/H200.
      type: int
    retired_pages_pending:
      description: >-
        True when a page retirement waits for a reboot (nvmlDeviceGetRetiredPagesPendingStatus,
        retired_pages.pending); null on H200.
      type: bool
    unsupported:
      description: "Fields of this GPU that read null, each with the driver's raw answer: nvidia-smi's text
        (C([N/A]), C([Not Supported]), C([Unknown Error])) or the NVML error and call. With processes, also
        C(compute_apps) (the list could not be read), C(compute_apps.pid) and C(compute_apps.used_memory) (a row's
        field read no number)."
      type: dict
      sample: {retired_pages_pending: "[N/A]"}
    nvlinks:
      description: "NVLink links of this GPU (only with I(nvlink=true)); an empty list on a GPU without
        NVLink peers; null when nvidia-smi has no C(nvlink) command (reason in C(unsupported.nvlinks))."
      type: list
      elements: dict
      contains:
        link:
          description: >-
            Link number.
          type: int
        state:
          description: >-
            C(active) or C(inactive) (nvmlDeviceGetNvLinkState; nvidia-smi nvlink -s C(<inactive>)).
          type: str
        replay_errors:
          description: >-
            Data-link replay errors (nvmlDeviceGetNvLinkErrorCounter NVML_NVLINK_ERROR_DL_REPLAY, nvidia-smi nvlink
            -e).
          type: int
        recovery_errors:
          description: >-
            Data-link recovery errors (NVML_NVLINK_ERROR_DL_RECOVERY).
          type: int
        crc_flit_errors:
          description: >-
            Flit CRC errors (NVML_NVLINK_ERROR_DL_CRC_FLIT).
          type: int
        crc_data_errors:
          description: >-
            Data CRC errors (NVML_NVLINK_ERROR_DL_CRC_DATA); null where not counted.
          type: int
    processes:
      description: Processes on this GPU (only with I(processes=true)).
      type: list
      elements: dict
      contains:
        pid:
          description: >-
            Process id (in the target's PID namespace).
          type: int
        used_memory_mib:
          description: >-
            GPU memory of this process, MiB; null when only the fd scan found it or the driver cannot tell.
          type: int
        name:
          description: >-
            Process name (psutil; nvidia-smi process_name when psutil cannot see it).
          type: str
        cmdline:
          description: >-
            Command line joined with spaces; null when unreadable.
          type: str
        user:
          description: >-
            Owner user name.
          type: str
        source:
          description: >-
            Where it was found: C(nvml) or C(nvidia-smi), and/or C(proc_fd).
          type: list
          elements: str
        kind:
          description: >-
            C(monitor) for a known GPU watcher (nvidia-smi, nvidia-persistenced, DCGM, exporters), else C(gpu).
          type: str
device_holders:
  description: Every process with a /dev/nvidia* file open (read from every thread's fd table, so a
    C(<defunct>) process whose other thread still holds the GPU is found), including those that hold only
    /dev/nvidiactl or /dev/nvidia-uvm (no specific GPU). Per-GPU holders first, then shared-only, then
    monitors. With O(gpus), only the holders of those GPUs and those that hold no specific GPU. Null when
    processes were not read (O(processes=false), or O(fields) without V(processes)), so "none" (an empty list)
    is never said without looking.
  returned: success
  type: list
  elements: dict
  contains:
    pid:
      description: >-
        Process id.
      type: int
    name:
      description: >-
        Process name.
      type: str
    cmdline:
      description: >-
        Command line joined with spaces.
      type: str
    user:
      description: >-
        Owner user name.
      type: str
    devices:
      description: >-
        Open device paths.
      type: list
      elements: str
      sample: ["/dev/nvidia0", "/dev/nvidiactl"]
    gpu_indices:
      description: >-
        GPUs whose /dev/nvidia<N> it holds (empty when none).
      type: list
      elements: int
    kind:
      description: "C(gpu) (holds a /dev/nvidia<N>), C(shared_only) (only nvidiactl / nvidia-uvm: a CUDA or
        NVML client that may still hold memory through the driver) or C(monitor) (known watcher by name)."
      type: str
      sample: gpu
xid_events:
  description: "NVIDIA Xid events of the last I(xid_window_min) minutes, oldest first; null when the kernel
    log could not be read (see C(xid_status), C(xid_reason)) or the read was skipped."
  returned: success
  type: list
  elements: dict
  contains:
    xid:
      description: >-
        Xid number (79 = fell off the bus, 48 = double-bit ECC, 94/95 = contained / uncontained ECC, 63/64 = row
        remap).
      type: int
      sample: 79
    pci_bus_id:
      description: >-
        PCI bus id of the GPU, in nvidia-smi's form.
      type: str
      sample: "00000000:1B:00.0"
    gpu_index:
      description: >-
        Index of that GPU on this host; null when no present GPU has that bus id.
      type: int
    time:
      description: >-
        When the kernel logged it, ISO 8601 UTC (boot time + record time).
      type: str
    uptime_s:
      description: >-
        Seconds since boot of the record.
      type: float
    text:
      description: >-
        The kernel log line.
      type: str
      sample: "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
xid_status:
  description: "C(ok) (log read; an empty C(xid_events) means none), C(unknown) (not readable) or C(skipped)."
  returned: success and on driver/GPU failures
  type: str
xid_source:
  description: Log that was read (the I(kmsg_path) or C(journalctl)); null when none.
  returned: success
  type: str
xid_reason:
  description: Why the Xid events are unknown or skipped, and what to do (C(become)).
  returned: success
  type: str
error_class:
  description: "On failure: C(driver_not_loaded), C(driver_mismatch), C(no_devices), C(fewer_gpus),
    C(gpu_lost), C(device_handle_error), C(timeout), C(backend_unavailable), C(missing_library),
    C(bad_selector), C(bad_option) or C(backend_error)."
  returned: failure
  type: str
  sample: driver_mismatch
"""

import gc

from ansible.module_utils.basic import AnsibleModule, env_fallback, missing_required_lib
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu import (
    BACKEND_CHOICES,
    MissingLibraryError,
    PYNVML_IMPORT_ERROR,
    GpuError,
    failure_kwargs,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_info import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    LIST_FIELDS,
    SMI_NAMES,
    attach_xid,
    gather,
    only_fields,
    read_gpu_info,
    resolve_fields,
    short_form,
    xid_on_fail,
    xid_text,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import HAS_PSUTIL, PSUTIL_IMPORT_ERROR
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module


def main():
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="list", elements="raw", default=[]),
            fields=dict(type="list", elements="str", default=[]),
            detail=dict(type="str", choices=["short", "full"], default="short"),
            processes=dict(type="bool", default=True),
            backend=dict(type="str", choices=list(BACKEND_CHOICES), default="auto"),
            expected_count=dict(type="int"),
            timeout_s=dict(type="float", default=30),
            nvlink=dict(type="bool", default=True),
            xid_window_min=dict(type="int", default=60),
            kmsg_path=dict(type="path", fallback=(env_fallback, ["GPUFLEET_KMSG_PATH"])),
        ),
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    params = module.params
    try:
        fields = resolve_fields(params["fields"])
    except ValueError as exc:
        module.fail_json(msg=str(exc), error_class="bad_option")
    if (params["processes"] if fields is None else "processes" in fields) and not HAS_PSUTIL:
        module.fail_json(msg=missing_required_lib("psutil") + " (or set processes: false)",
                         exception=str(PSUTIL_IMPORT_ERROR), error_class="missing_library")
    for key in ("timeout_s", "xid_window_min", "expected_count"):
        if params[key] is not None and params[key] < 0:
            module.fail_json(msg="%s must be 0 or more (got %s)" % (key, params[key]), error_class="bad_option")
    try:
        result = read_gpu_info(params["backend"], module.get_bin_path("nvidia-smi"), params["gpus"],
                               params["processes"], params["nvlink"], params["xid_window_min"], params["kmsg_path"],
                               fields, params["timeout_s"], params["expected_count"])
    except MissingLibraryError as exc:
        module.fail_json(msg=missing_required_lib(exc.library), exception=str(exc.exc or PYNVML_IMPORT_ERROR),
                         error_class="missing_library")
    except GpuError as exc:
        module.fail_json(**failure_kwargs(exc, xid_on_fail(params["xid_window_min"], params["kmsg_path"])))
    if params["detail"] == "short":
        result.update(short_form(result.pop("gpus")))
    module.exit_json(**result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
