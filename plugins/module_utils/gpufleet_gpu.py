# -*- coding: utf-8 -*-
# gpufleet: GPU backends (NVML | nvidia-smi) behind one schema, and the wait loop of nvidia_gpu_wait.
"""Read NVIDIA GPU state through NVML (nvidia-ml-py, ``import pynvml``) or the ``nvidia-smi`` CLI.

Both backends return the same dictionaries, so a module never cares which one answered:

* :meth:`Backend.system` -> ``{"driver_version": str, "cuda_version": str|None}``
* :meth:`Backend.inventory` -> ``[{"index", "uuid", "name", "pci_bus_id", "minor_number"}]``
* :meth:`Backend.details` -> one dict per GPU with every key of :data:`GPU_FIELDS` (None = the GPU cannot
  report it; the driver's raw answer is then in the GPU's ``unsupported`` map, ``{key: raw text}``)
* :meth:`Backend.memory` -> ``[{"index", "uuid", "memory_used_mib", "memory_total_mib",
  "memory_reserved_mib"}]`` (the cheap call the wait loop polls; a GPU whose memory.used / memory.total
  cannot be read raises :class:`FieldUnavailableError`)
* :meth:`Backend.compute_processes` -> ``[{"gpu_index", "gpu_uuid", "pid", "used_memory_mib",
  "process_name"}]``; afterwards ``backend.apps_unreadable`` is ``{index: {"compute_apps" |
  "compute_apps.pid" | "compute_apps.used_memory": raw text}}`` for what the last call could not read
* :meth:`Backend.nvlinks` -> ``{index: [link]}`` (see :data:`NVLINK_COUNTERS`); ``[]`` on a GPU without
  NVLink peers (recordings/h200x1-health-driver580: NVML NotSupported, ``nvidia-smi nvlink -s`` empty)

Memory is MiB (2**20 bytes). ``memory_used_mib`` excludes the driver's reserved memory on both backends:
NVML v2 ``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2).used`` equals nvidia-smi ``memory.used``,
while NVML v1 ``used`` adds ``memory.reserved`` (615 MiB on an idle H200, driver 580.159; see
shared/recordings/h200x2-driver580/loaded-nvml.txt).

Failures are :mod:`gpufleet_gpu_errors` classes with an ``error_class``; every nvidia-smi run and
``nvmlInit`` is bounded in time (:class:`Deadline`), and a run that does not end is abandoned, not waited
for (a wedged GPU leaves nvidia-smi in D state for minutes).

Nothing here imports Ansible at import time: the nvidia-smi backend takes a ``runner(argv, timeout_s) ->
(rc, stdout, stderr)`` callable (:func:`subprocess_runner`, which raises CallTimedOut on expiry).
"""
from __future__ import annotations

import os
import re
import time

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_errors import (  # noqa: F401 -- re-exported for the modules; pylint: disable=unused-import
    DRIVER_HINT,
    FIELD_HINT,
    HANDLE_HINT,
    HANG_HINT,
    LOST_HINT,
    MISMATCH_HINT,
    MIN_CALL_TIMEOUT_S,
    BackendUnavailableError,
    CallTimedOut,
    Deadline,
    DeviceHandleError,
    DriverMismatchError,
    DriverNotLoadedError,
    FewerGpusError,
    FieldUnavailableError,
    GpuError,
    GpuLostError,
    GpuTimeoutError,
    NoDevicesError,
    SelectorError,
    bounded_run,
    call_in_thread,
    classify_smi_failure,
    first_lines,
    lost_message,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_memory import baseline_text, wait_limit
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import (
    MissingLibraryError,
    clean_text,
    describe_pids,
    find_device_holders,
    gpu_minor_of_path,
    holder_kind,
)

try:
    import pynvml
    HAS_PYNVML = True
    PYNVML_IMPORT_ERROR = None
except ImportError as _exc:  # auto falls back to nvidia-smi; backend=nvml reports missing_required_lib
    pynvml = None
    HAS_PYNVML = False
    PYNVML_IMPORT_ERROR = _exc

BACKEND_CHOICES = ("auto", "nvml", "nvidia-smi")
MIB = 1 << 20

#: Keys of a GPU dict from :meth:`Backend.details`, with units in the names. The nvidia-smi field and the
#: NVML call behind each: :data:`SMI_GPU_QUERY` and :meth:`NvmlBackend.details`.
GPU_FIELDS = (
    "index", "uuid", "name", "pci_bus_id", "minor_number", "serial", "vbios_version",
    "memory_used_mib", "memory_total_mib", "memory_reserved_mib",
    "utilization_gpu_pct", "temperature_gpu_c", "temperature_memory_c", "power_draw_w", "power_limit_w",
    "pstate", "clocks_sm_mhz", "clocks_max_sm_mhz", "clocks_event_reasons_mask", "clocks_event_reasons",
    "pcie_link_gen_current", "pcie_link_gen_max", "pcie_link_width_current", "pcie_link_width_max",
    "persistence_mode", "compute_mode", "mig_mode_current", "mig_mode_pending", "ecc_mode_current",
    "ecc_errors_corrected_volatile_total", "ecc_errors_uncorrected_volatile_total",
    "ecc_errors_corrected_aggregate_total", "ecc_errors_uncorrected_aggregate_total",
    "remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending",
    "remapped_rows_failure", "retired_pages_single_bit_ecc_count", "retired_pages_double_bit_ecc_count",
    "retired_pages_pending", "unsupported",
)

# NVML nvmlComputeMode_t values -> the words nvidia-smi prints for compute_mode.
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}

#: Clock event (throttle) reason bits (nvml.h nvmlClocksEventReason*, nvidia-smi clocks_event_reasons.*)
#: -> the names of ``clocks_event_reasons``, in bit order.
CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"),
)

#: NVLink error counters per link: (NVML nvmlNvLinkErrorCounter_t value, our key). nvidia-smi nvlink -e
#: names them "Replay Errors", "Recovery Errors", "CRC Errors" (flit) and "Data CRC Errors".
NVLINK_COUNTERS = ((0, "replay_errors"), (1, "recovery_errors"), (2, "crc_flit_errors"), (3, "crc_data_errors"))
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS (H100/H200: 18 links)

#: Fields the wait cannot do without: [N/A] there fails at once (error_class field_unavailable).
REQUIRED_MEMORY_FIELDS = (("memory_used_mib", "memory.used"), ("memory_total_mib", "memory.total"))


def clock_event_reason_names(mask):
    """Names of the set bits of a clocks-event-reasons mask (int), in bit order; None for None."""
    if mask is None:
        return None
    return [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]


def cuda_version_text(value):
    """NVML's CUDA driver version integer (13000) as nvidia-smi prints it ("13.0")."""
    if value is None:
        return None
    return "%d.%d" % (value // 1000, (value % 1000) // 10)


def bytes_to_mib(value):
    """Bytes -> MiB rounded up, the rounding nvidia-smi applies to memory.* fields, so both backends agree.

    Measured on 2x H200, driver 580.159.04 (docs/benchmarks.md): NVML v2 reserved 644,939,776 B
    (615.06 MiB) is memory.reserved 616; used 22,123,773,952 B (21098.88 MiB) is memory.used 21099;
    free 127,986,106,368 B (122057.06 MiB) is memory.free 122058. Rounding up also means a GPU with
    any byte in use never reads 0.
    """
    if value is None:
        return None
    return -(-int(value) // MIB)


def require_gpu_count(inventory, expected_count=None, backend_name="the driver"):
    """Raise :class:`NoDevicesError` for zero GPUs, :class:`FewerGpusError` for fewer than
    ``expected_count`` (None: only zero fails). More GPUs than expected is not an error."""
    present = len(inventory)
    listing = ", ".join("%d (%s)" % (g["index"], g.get("pci_bus_id") or g.get("uuid")) for g in inventory)
    if present == 0:
        raise NoDevicesError("%s lists no GPU on this host%s. What to do: check `lspci | grep -i nvidia`, the "
                             "kernel log for Xid errors (`dmesg | grep -i xid`), and in a container that GPUs "
                             "were passed in." % (backend_name, " (expected %d)" % expected_count
                                                  if expected_count else ""))
    if expected_count is not None and present < expected_count:
        raise FewerGpusError(
            "%s lists %d GPU%s, expected %d (expected_count / gpufleet_expected_gpus). Present: %s. "
            "What to do: a GPU missing from the list usually fell off the bus: look for Xid 79 in the kernel "
            "log (`dmesg | grep -i xid`), compare with `lspci | grep -i nvidia`; it needs a reset or a reboot."
            % (backend_name, present, "" if present == 1 else "s", expected_count, listing))


# --------------------------------------------------------------------------------------------------------
# selectors

_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Fa-f-]+$")


def parse_selectors(selectors):
    """Validate ``gpus`` option values: ints or digit strings are indices, ``GPU-...`` strings are UUIDs.

    Returns ``[("index", int) | ("uuid", str)]``. Raises :class:`SelectorError` for anything else
    (negative numbers, booleans, names, bus ids) so a typo never silently selects nothing.
    """
    parsed = []
    for sel in selectors or ():
        if isinstance(sel, bool):
            raise SelectorError("gpus: %r is not a GPU index or UUID" % (sel,))
        if isinstance(sel, int):
            if sel < 0:
                raise SelectorError("gpus: index %d is negative" % sel)
            parsed.append(("index", sel))
            continue
        if isinstance(sel, str):
            text = sel.strip()
            if text.isdigit():
                parsed.append(("index", int(text)))
                continue
            if _UUID_RE.match(text):
                parsed.append(("uuid", text))
                continue
        raise SelectorError("gpus: %r is neither a GPU index (0, 1, ...) nor a UUID (GPU-8b76e503-...); "
                            "list them with the nvidia_gpu_info module or `nvidia-smi -L`" % (sel,))
    return parsed


def resolve_selectors(selectors, inventory):
    """Indices of the GPUs ``selectors`` name, in inventory order; all GPUs when ``selectors`` is empty.

    ``inventory`` is :meth:`Backend.inventory`. Raises :class:`SelectorError` naming the unknown selector
    and the GPUs that exist.
    """
    parsed = parse_selectors(selectors)
    if not parsed:
        return [g["index"] for g in inventory]
    by_index = {g["index"]: g for g in inventory}
    by_uuid = {g["uuid"].lower(): g for g in inventory if g.get("uuid")}
    chosen = set()
    for kind, value in parsed:
        gpu = by_index.get(value) if kind == "index" else by_uuid.get(value.lower())
        if gpu is None:
            available = ", ".join("%d (%s)" % (g["index"], g["uuid"]) for g in inventory) or "none"
            raise SelectorError("gpus: no GPU with %s %s on this host; GPUs present: %s" % (kind, value, available))
        chosen.add(gpu["index"])
    return [g["index"] for g in inventory if g["index"] in chosen]


# --------------------------------------------------------------------------------------------------------
# NVML backend

def _nvml_text(exc, fn_name):
    """Raw form of an NVML failure for an ``unsupported`` map: "Not Supported (nvmlDeviceGetRetiredPages)"."""
    return "%s (%s)" % (exc, fn_name)


class NvmlBackend:
    """GPU state through NVML (nvidia-ml-py). One ``nvmlInit`` per session (10.9 ms on 2x H200), then
    every query is a library call (``nvmlDeviceGetMemoryInfo`` v2: 5 us) -- cheap enough to poll.
    Figures: docs/benchmarks.md. ``nvmlInit`` runs in a daemon thread bounded by ``deadline``."""

    name = "nvml"

    def __init__(self, nvml=None, deadline=None):
        self._n = nvml if nvml is not None else pynvml
        if self._n is None:
            raise MissingLibraryError("nvidia-ml-py", PYNVML_IMPORT_ERROR)
        self._deadline = deadline or Deadline(None)
        self._handles = None
        self._inventory = None
        self._open = False
        self._memory_v2 = True
        self.apps_unreadable = {}

    # -- session --
    def open(self):
        """``nvmlInit`` (bounded: :class:`GpuTimeoutError` when it does not return in the time left);
        maps its errors to the classes of :mod:`gpufleet_gpu_errors`. Messages start with NVML's text."""
        n = self._n
        try:
            call_in_thread(n.nvmlInit, self._deadline.call_timeout(), "nvmlInit (NVML initialisation)")
        except n.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == n.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise BackendUnavailableError(
                    "NVML: %s: libnvidia-ml.so.1 was not found. The NVIDIA driver's user-space libraries are "
                    "not installed on this host or not mounted into this container; install the driver "
                    "(or the NVIDIA Container Toolkit) or use backend: nvidia-smi." % exc)
            if code == n.NVML_ERROR_DRIVER_NOT_LOADED:
                raise DriverNotLoadedError("NVML: %s: the NVIDIA driver is not loaded. %s" % (exc, DRIVER_HINT))
            if code == getattr(n, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", -1):
                raise DriverMismatchError("NVML: %s: driver/library version mismatch. %s" % (exc, MISMATCH_HINT))
            if code == n.NVML_ERROR_NO_PERMISSION:
                raise BackendUnavailableError(
                    "NVML: %s: no permission to open the NVIDIA devices; run as a user that may open "
                    "/dev/nvidia*." % exc)
            if code == n.NVML_ERROR_GPU_IS_LOST:
                raise GpuLostError(lost_message("?", "NVML: nvmlInit: %s" % exc))
            raise GpuError("NVML: nvmlInit failed: %s. %s" % (exc, DRIVER_HINT))
        self._open = True
        return self

    def close(self):
        """``nvmlShutdown`` once; safe to call twice."""
        if self._open:
            self._open = False
            try:
                self._n.nvmlShutdown()
            except self._n.NVMLError:
                pass

    def __enter__(self):
        return self if self._open else self.open()

    def __exit__(self, *exc):
        self.close()

    # -- helpers --
    def _bus(self, index):
        if self._inventory and index is not None:
            return next((g["pci_bus_id"] for g in self._inventory if g["index"] == index), None)
        return None

    def _raise(self, exc, what, index=None):
        n = self._n
        code = getattr(exc, "value", None)
        where = "%s" % index if index is not None else "?"
        bus = self._bus(index)
        if code == n.NVML_ERROR_GPU_IS_LOST:
            raise GpuLostError(lost_message("%s%s" % (where, " (%s)" % bus if bus else ""),
                                            "NVML: %s: %s" % (what, exc)))
        if code == n.NVML_ERROR_DRIVER_NOT_LOADED:
            raise DriverNotLoadedError("NVML: %s: %s: the NVIDIA driver is not loaded. %s" % (what, exc, DRIVER_HINT))
        if code == getattr(n, "NVML_ERROR_TIMEOUT", -1):
            raise GpuTimeoutError("NVML: %s: %s for GPU %s. %s" % (what, exc, where, HANG_HINT))
        raise GpuError("NVML: %s failed for GPU %s: %s" % (what, where, exc))

    def _fatal(self, exc):
        n = self._n
        return getattr(exc, "value", None) in (n.NVML_ERROR_GPU_IS_LOST, n.NVML_ERROR_DRIVER_NOT_LOADED)

    def _optional(self, index, fn, *args, unsupported=None, key=None):
        """Call an NVML getter for an optional field: None when the GPU cannot answer (the error text goes
        to ``unsupported[key]``), GpuLostError / DriverNotLoadedError when the GPU or driver is gone."""
        n = self._n
        try:
            return fn(*args)
        except n.NVMLError as exc:
            if self._fatal(exc):
                self._raise(exc, getattr(fn, "__name__", "query"), index)
            # NotSupported (H200 retired pages), NoPermission, FunctionNotFound (older driver), Unknown:
            # the field is null rather than the whole answer failing.
            if unsupported is not None and key:
                unsupported[key] = _nvml_text(exc, getattr(fn, "__name__", "query"))
            return None
        except (AttributeError, TypeError) as exc:  # call missing from an older nvidia-ml-py
            if unsupported is not None and key:
                unsupported[key] = "%s: %s" % (type(exc).__name__, exc)
            return None

    def _handle_list(self):
        if self._handles is None:
            n = self._n
            try:
                count = n.nvmlDeviceGetCount()
            except n.NVMLError as exc:
                self._raise(exc, "nvmlDeviceGetCount")
            if count == 0:
                raise NoDevicesError("NVML: nvmlDeviceGetCount() = 0: the driver lists no GPU. What to do: check "
                                     "`lspci | grep -i nvidia`, `dmesg | grep -i xid`, and in a container that "
                                     "GPUs were passed in (--gpus, NVIDIA_VISIBLE_DEVICES).")
            handles = []
            for i in range(count):
                try:
                    handles.append(n.nvmlDeviceGetHandleByIndex(i))
                except n.NVMLError as exc:
                    if getattr(exc, "value", None) in (n.NVML_ERROR_GPU_IS_LOST, n.NVML_ERROR_DRIVER_NOT_LOADED):
                        self._raise(exc, "nvmlDeviceGetHandleByIndex(%d)" % i, i)
                    raise DeviceHandleError("NVML: nvmlDeviceGetHandleByIndex(%d): %s\nThe driver cannot open "
                                            "GPU %d. %s" % (i, exc, i, HANDLE_HINT))
            self._handles = handles
        return self._handles

    # -- queries --
    def system(self):
        """Driver (nvmlSystemGetDriverVersion) and CUDA version (nvmlSystemGetCudaDriverVersion_v2)."""
        n = self._n
        driver = self._optional(None, n.nvmlSystemGetDriverVersion)
        cuda = self._optional(None, n.nvmlSystemGetCudaDriverVersion_v2)
        if cuda is None:
            cuda = self._optional(None, n.nvmlSystemGetCudaDriverVersion)
        return {"driver_version": clean_text(driver), "cuda_version": cuda_version_text(cuda)}

    def inventory(self):
        """Identity of every GPU: nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetPciInfo().busId,
        nvmlDeviceGetMinorNumber (the N of /dev/nvidia<N>). Cached for the session."""
        if self._inventory is None:
            n = self._n
            inv = []
            for i, h in enumerate(self._handle_list()):
                try:
                    uuid = clean_text(n.nvmlDeviceGetUUID(h))
                except n.NVMLError as exc:
                    self._raise(exc, "nvmlDeviceGetUUID", i)
                pci = self._optional(i, n.nvmlDeviceGetPciInfo, h)
                bus = clean_text(getattr(pci, "busId", None)) if pci is not None else None
                inv.append({
                    "index": i,
                    "uuid": uuid,
                    "name": clean_text(self._optional(i, n.nvmlDeviceGetName, h)),
                    "pci_bus_id": bus,
                    "minor_number": self._optional(i, n.nvmlDeviceGetMinorNumber, h),
                })
            self._inventory = inv
        return self._inventory

    def _memory_one(self, index, handle):
        n = self._n
        if self._memory_v2:
            try:
                m = n.nvmlDeviceGetMemoryInfo(handle, version=n.nvmlMemory_v2)
                return bytes_to_mib(m.used), bytes_to_mib(m.total), bytes_to_mib(m.reserved)
            except n.NVMLError as exc:
                if getattr(exc, "value", None) not in (n.NVML_ERROR_FUNCTION_NOT_FOUND, n.NVML_ERROR_NOT_SUPPORTED,
                                                       getattr(n, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", -1)):
                    self._memory_error(exc, "nvmlDeviceGetMemoryInfo(v2)", index)
                # Drivers before the v2 struct: v1 "used" includes the reserved memory, reserved unknown.
                self._memory_v2 = False
        try:
            m = n.nvmlDeviceGetMemoryInfo(handle)
        except n.NVMLError as exc:
            self._memory_error(exc, "nvmlDeviceGetMemoryInfo", index)
        return bytes_to_mib(m.used), bytes_to_mib(m.total), None

    def _memory_error(self, exc, what, index):
        if self._fatal(exc) or getattr(exc, "value", None) == getattr(self._n, "NVML_ERROR_TIMEOUT", -1):
            self._raise(exc, what, index)
        bus = self._bus(index)
        err = FieldUnavailableError(
            "NVML: %s: %s\nGPU %s%s: memory.used / memory.total unreadable, so whether its memory is free cannot "
            "be told. %s"
            % (what, exc, index, " (%s)" % bus if bus else "", FIELD_HINT))
        err.gpu, err.field, err.raw = index, "memory.used", str(exc)
        raise err

    def memory(self, indices=None):
        """Memory of the GPUs ``indices`` (all when None) via nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2).
        Raises :class:`FieldUnavailableError` when a GPU cannot report it (NotSupported, Unknown)."""
        inv = self.inventory()
        handles = self._handle_list()
        out = []
        for g in inv:
            if indices is not None and g["index"] not in indices:
                continue
            used, total, reserved = self._memory_one(g["index"], handles[g["index"]])
            out.append({"index": g["index"], "uuid": g["uuid"], "memory_used_mib": used,
                        "memory_total_mib": total, "memory_reserved_mib": reserved})
        return out

    def _memory_temp(self, i, h, unsupported):
        """HBM temperature, C: nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_MEMORY_TEMP]) (field 82)."""
        n = self._n
        field_id = getattr(n, "NVML_FI_DEV_MEMORY_TEMP", 82)
        values = self._optional(i, n.nvmlDeviceGetFieldValues, h, [field_id], unsupported=unsupported,
                                key="temperature_memory_c")
        if not values:
            return None
        fv = values[0]
        ret = getattr(fv, "nvmlReturn", 0)
        if ret:
            unsupported["temperature_memory_c"] = "NVML return %s (nvmlDeviceGetFieldValues)" % ret
            return None
        value = getattr(getattr(fv, "value", None), "uiVal", None)
        return int(value) if value is not None else None

    def details(self, indices=None):
        """Every :data:`GPU_FIELDS` key per GPU; fields the GPU cannot report are None with the NVML error in
        ``unsupported``. NVML calls (W from mW, C, MHz): nvmlDeviceGetMemoryInfo(v2),
        nvmlDeviceGetUtilizationRates().gpu, nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU),
        nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP), nvmlDeviceGetPowerUsage,
        nvmlDeviceGetPowerManagementLimit, nvmlDeviceGetPerformanceState, nvmlDeviceGetClockInfo /
        nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM), nvmlDeviceGetCurrentClocksEventReasons,
        nvmlDeviceGetCurrPcieLinkGeneration / MaxPcieLinkGeneration / CurrPcieLinkWidth / MaxPcieLinkWidth,
        nvmlDeviceGetPersistenceMode, nvmlDeviceGetComputeMode, nvmlDeviceGetMigMode, nvmlDeviceGetEccMode,
        nvmlDeviceGetTotalEccErrors(CORRECTED|UNCORRECTED, NVML_VOLATILE_ECC|NVML_AGGREGATE_ECC),
        nvmlDeviceGetRemappedRows, nvmlDeviceGetRetiredPages(MULTIPLE_SINGLE_BIT|DOUBLE_BIT),
        nvmlDeviceGetRetiredPagesPendingStatus, nvmlDeviceGetSerial, nvmlDeviceGetVbiosVersion."""
        n = self._n
        handles = self._handle_list()
        out = []
        for g in self.inventory():
            if indices is not None and g["index"] not in indices:
                continue
            i, h = g["index"], handles[g["index"]]
            un = {}

            def opt(key, fn, *args):
                return self._optional(i, fn, *args, unsupported=un, key=key)

            try:
                used, total, reserved = self._memory_one(i, h)
            except FieldUnavailableError as exc:
                used = total = reserved = None
                un["memory_used_mib"] = un["memory_total_mib"] = exc.raw
            util = opt("utilization_gpu_pct", n.nvmlDeviceGetUtilizationRates, h)
            power = opt("power_draw_w", n.nvmlDeviceGetPowerUsage, h)
            limit = opt("power_limit_w", n.nvmlDeviceGetPowerManagementLimit, h)
            persistence = opt("persistence_mode", n.nvmlDeviceGetPersistenceMode, h)
            compute = opt("compute_mode", n.nvmlDeviceGetComputeMode, h)
            rows = opt("remapped_rows", n.nvmlDeviceGetRemappedRows, h)
            pstate = opt("pstate", n.nvmlDeviceGetPerformanceState, h)
            reasons_fn = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                n, "nvmlDeviceGetCurrentClocksThrottleReasons")
            mask = opt("clocks_event_reasons_mask", reasons_fn, h)
            mig = opt("mig_mode_current", n.nvmlDeviceGetMigMode, h)
            ecc_mode = opt("ecc_mode_current", n.nvmlDeviceGetEccMode, h)
            clock_sm = getattr(n, "NVML_CLOCK_SM", 1)
            vol, agg = getattr(n, "NVML_VOLATILE_ECC", 0), getattr(n, "NVML_AGGREGATE_ECC", 1)
            corr, unc = n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            sbe = opt("retired_pages_single_bit_ecc_count", n.nvmlDeviceGetRetiredPages, h,
                      getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0))
            dbe = opt("retired_pages_double_bit_ecc_count", n.nvmlDeviceGetRetiredPages, h,
                      getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1))
            pending_pages = opt("retired_pages_pending", n.nvmlDeviceGetRetiredPagesPendingStatus, h) \
                if hasattr(n, "nvmlDeviceGetRetiredPagesPendingStatus") else None
            if rows is None and "remapped_rows" in un:
                raw = un.pop("remapped_rows")
                for key in ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending",
                            "remapped_rows_failure"):
                    un[key] = raw
            if mig is None and "mig_mode_current" in un:
                un["mig_mode_pending"] = un["mig_mode_current"]
            gpu = dict(g)
            gpu.update({
                "serial": clean_text(opt("serial", n.nvmlDeviceGetSerial, h)),
                "vbios_version": clean_text(opt("vbios_version", n.nvmlDeviceGetVbiosVersion, h)),
                "memory_used_mib": used, "memory_total_mib": total, "memory_reserved_mib": reserved,
                "utilization_gpu_pct": getattr(util, "gpu", None) if util is not None else None,
                "temperature_gpu_c": opt("temperature_gpu_c", n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                "temperature_memory_c": self._memory_temp(i, h, un),
                "power_draw_w": round(power / 1000.0, 2) if power is not None else None,
                "power_limit_w": round(limit / 1000.0, 2) if limit is not None else None,
                "pstate": None if pstate is None or pstate == 32 else "P%d" % pstate,
                "clocks_sm_mhz": opt("clocks_sm_mhz", n.nvmlDeviceGetClockInfo, h, clock_sm),
                "clocks_max_sm_mhz": opt("clocks_max_sm_mhz", n.nvmlDeviceGetMaxClockInfo, h, clock_sm),
                "clocks_event_reasons_mask": None if mask is None else int(mask),
                "clocks_event_reasons": clock_event_reason_names(None if mask is None else int(mask)),
                "pcie_link_gen_current": opt("pcie_link_gen_current", n.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "pcie_link_gen_max": opt("pcie_link_gen_max", n.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "pcie_link_width_current": opt("pcie_link_width_current", n.nvmlDeviceGetCurrPcieLinkWidth, h),
                "pcie_link_width_max": opt("pcie_link_width_max", n.nvmlDeviceGetMaxPcieLinkWidth, h),
                "persistence_mode": None if persistence is None else ("Enabled" if persistence else "Disabled"),
                "compute_mode": None if compute is None else COMPUTE_MODES.get(compute, str(compute)),
                "mig_mode_current": None if mig is None else ("Enabled" if mig[0] else "Disabled"),
                "mig_mode_pending": None if mig is None else ("Enabled" if mig[1] else "Disabled"),
                "ecc_mode_current": None if ecc_mode is None else ("Enabled" if ecc_mode[0] else "Disabled"),
                "ecc_errors_corrected_volatile_total": opt(
                    "ecc_errors_corrected_volatile_total", n.nvmlDeviceGetTotalEccErrors, h, corr, vol),
                "ecc_errors_uncorrected_volatile_total": opt(
                    "ecc_errors_uncorrected_volatile_total", n.nvmlDeviceGetTotalEccErrors, h, unc, vol),
                "ecc_errors_corrected_aggregate_total": opt(
                    "ecc_errors_corrected_aggregate_total", n.nvmlDeviceGetTotalEccErrors, h, corr, agg),
                "ecc_errors_uncorrected_aggregate_total": opt(
                    "ecc_errors_uncorrected_aggregate_total", n.nvmlDeviceGetTotalEccErrors, h, unc, agg),
                "remapped_rows_correctable": rows[0] if rows else None,
                "remapped_rows_uncorrectable": rows[1] if rows else None,
                "remapped_rows_pending": bool(rows[2]) if rows else None,
                "remapped_rows_failure": bool(rows[3]) if rows else None,
                "retired_pages_single_bit_ecc_count": None if sbe is None else len(sbe),
                "retired_pages_double_bit_ecc_count": None if dbe is None else len(dbe),
                "retired_pages_pending": None if pending_pages is None else bool(pending_pages),
            })
            gpu["unsupported"] = un
            out.append(gpu)
        return out

    def nvlinks(self, indices=None):
        """``{index: [{"link": int, "state": "active"|"inactive", <NVLINK_COUNTERS keys>: int|None}]}`` from
        nvmlDeviceGetNvLinkState(h, link) and nvmlDeviceGetNvLinkErrorCounter(h, link, counter), links 0..17.
        The first NotSupported / InvalidArgument ends a GPU's list: a GPU without NVLink (or without peers:
        the recorded single-GPU H200) gives ``[]``."""
        n = self._n
        handles = self._handle_list()
        out = {}
        for g in self.inventory():
            if indices is not None and g["index"] not in indices:
                continue
            i, h = g["index"], handles[g["index"]]
            links = []
            for link in range(NVLINK_MAX_LINKS):
                try:
                    state = n.nvmlDeviceGetNvLinkState(h, link)
                except n.NVMLError as exc:
                    if self._fatal(exc):
                        self._raise(exc, "nvmlDeviceGetNvLinkState", i)
                    break
                except AttributeError:
                    break
                row = {"link": link, "state": "active" if state else "inactive"}
                for counter, key in NVLINK_COUNTERS:
                    row[key] = self._optional(i, n.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                links.append(row)
            out[i] = links
        return out

    def compute_processes(self, indices=None):
        """nvmlDeviceGetComputeRunningProcesses per GPU; ``used_memory_mib`` None when NVML cannot tell
        (usedGpuMemory None). ``process_name`` is None (NVML has only the pid)."""
        n = self._n
        handles = self._handle_list()
        out = []
        self.apps_unreadable = {}
        for g in self.inventory():
            if indices is not None and g["index"] not in indices:
                continue
            try:
                procs = n.nvmlDeviceGetComputeRunningProcesses(handles[g["index"]])
            except n.NVMLError as exc:
                if getattr(exc, "value", None) in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_NO_PERMISSION):
                    self.apps_unreadable.setdefault(g["index"], {})["compute_apps"] = _nvml_text(
                        exc, "nvmlDeviceGetComputeRunningProcesses")
                    continue
                self._raise(exc, "nvmlDeviceGetComputeRunningProcesses", g["index"])
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                if used is None:
                    self.apps_unreadable.setdefault(g["index"], {})["compute_apps.used_memory"] = (
                        "NVML: usedGpuMemory not available (nvmlDeviceGetComputeRunningProcesses)")
                out.append({"gpu_index": g["index"], "gpu_uuid": g["uuid"], "pid": int(p.pid),
                            "used_memory_mib": bytes_to_mib(used) if used is not None else None,
                            "process_name": None})
        return out


# --------------------------------------------------------------------------------------------------------
# nvidia-smi backend

_NA_VALUES = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", "[Insufficient Permissions]",
              "[GPU is lost]", "[Requested functionality has been deprecated]", ""}
_INVALID_FIELD_RE = re.compile(r'Field "([^"]+)" is not a valid field to query')
_CUDA_RE = re.compile(r"CUDA Version:\s*([0-9][0-9.]*)")
_NVLINK_GPU_RE = re.compile(r"^GPU (\d+): .*\(UUID: ([^)]+)\)\s*$")
_NVLINK_STATE_RE = re.compile(r"^\s*Link (\d+): (.*)$")
_NVLINK_ERR_RE = re.compile(r"^\s*Link (\d+): (.+?) Errors?: (\S+)\s*$")
# `nvidia-smi nvlink -e` counter names -> our keys (NVLINK_COUNTERS).
_NVLINK_ERR_NAMES = {"replay": "replay_errors", "recovery": "recovery_errors", "crc": "crc_flit_errors",
                     "flit crc": "crc_flit_errors", "crc flit": "crc_flit_errors", "data crc": "crc_data_errors",
                     "crc data": "crc_data_errors"}


def _na(value):
    return value is None or value.strip() in _NA_VALUES


def _int(value):
    if _na(value):
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def _hex(value):
    if _na(value):
        return None
    try:
        return int(value.strip(), 16)
    except ValueError:
        return None


def _float(value):
    if _na(value):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _text(value):
    return None if _na(value) else clean_text(value.strip())


def _yes_no(value):
    if _na(value):
        return None
    v = value.strip().lower()
    if v in ("yes", "enabled", "1", "true", "active"):
        return True
    if v in ("no", "disabled", "0", "false", "not active"):
        return False
    return None


def _enabled(value):
    b = _yes_no(value)
    return None if b is None else ("Enabled" if b else "Disabled")


# (nvidia-smi --query-gpu field, our key, converter). "name" stays last: a free-text value may hold commas,
# so the line is split with maxsplit and the tail kept whole. Units: MiB, %, C, W, MHz (nounits).
SMI_GPU_QUERY = (
    ("index", "index", _int),
    ("uuid", "uuid", _text),
    ("pci.bus_id", "pci_bus_id", _text),
    ("serial", "serial", _text),
    ("vbios_version", "vbios_version", _text),
    ("memory.used", "memory_used_mib", _int),
    ("memory.total", "memory_total_mib", _int),
    ("memory.reserved", "memory_reserved_mib", _int),
    ("utilization.gpu", "utilization_gpu_pct", _int),
    ("temperature.gpu", "temperature_gpu_c", _int),
    ("temperature.memory", "temperature_memory_c", _int),
    ("power.draw", "power_draw_w", _float),
    ("power.limit", "power_limit_w", _float),
    ("pstate", "pstate", _text),
    ("clocks.sm", "clocks_sm_mhz", _int),
    ("clocks.max.sm", "clocks_max_sm_mhz", _int),
    ("clocks_event_reasons.active", "clocks_event_reasons_mask", _hex),
    ("pcie.link.gen.current", "pcie_link_gen_current", _int),
    ("pcie.link.gen.max", "pcie_link_gen_max", _int),
    ("pcie.link.width.current", "pcie_link_width_current", _int),
    ("pcie.link.width.max", "pcie_link_width_max", _int),
    ("persistence_mode", "persistence_mode", _enabled),
    ("compute_mode", "compute_mode", _text),
    ("mig.mode.current", "mig_mode_current", _enabled),
    ("mig.mode.pending", "mig_mode_pending", _enabled),
    ("ecc.mode.current", "ecc_mode_current", _enabled),
    ("ecc.errors.corrected.volatile.total", "ecc_errors_corrected_volatile_total", _int),
    ("ecc.errors.uncorrected.volatile.total", "ecc_errors_uncorrected_volatile_total", _int),
    ("ecc.errors.corrected.aggregate.total", "ecc_errors_corrected_aggregate_total", _int),
    ("ecc.errors.uncorrected.aggregate.total", "ecc_errors_uncorrected_aggregate_total", _int),
    ("remapped_rows.correctable", "remapped_rows_correctable", _int),
    ("remapped_rows.uncorrectable", "remapped_rows_uncorrectable", _int),
    ("remapped_rows.pending", "remapped_rows_pending", _yes_no),
    ("remapped_rows.failure", "remapped_rows_failure", _yes_no),
    ("retired_pages.single_bit_ecc.count", "retired_pages_single_bit_ecc_count", _int),
    ("retired_pages.double_bit.count", "retired_pages_double_bit_ecc_count", _int),
    ("retired_pages.pending", "retired_pages_pending", _yes_no),
    ("driver_version", "driver_version", _text),
    ("name", "name", _text),
)
SMI_MEMORY_QUERY = (
    ("index", "index", _int),
    ("uuid", "uuid", _text),
    ("memory.used", "memory_used_mib", _int),
    ("memory.total", "memory_total_mib", _int),
    ("memory.reserved", "memory_reserved_mib", _int),
)
# process_name last for the same reason as "name" above (a path may contain ", ").
SMI_APPS_QUERY = (
    ("pid", "pid", _int),
    ("used_memory", "used_memory_mib", _int),
    ("gpu_uuid", "gpu_uuid", _text),
    ("gpu_bus_id", "gpu_bus_id", _text),
    ("process_name", "process_name", _text),
)
# Fields a driver may not know (memory.reserved, remapped_rows.* are recent); the rest must exist.
_SMI_REQUIRED = {"index", "uuid", "memory.used", "memory.total", "pid", "gpu_uuid", "name"}
_KEY_TO_FIELD = {key: field for field, key, dummy in SMI_GPU_QUERY}


def subprocess_runner(argv, timeout_s=None):
    """``runner`` for :class:`SmiBackend`: argv list, LC_ALL=C, text decoded with 'replace', bounded by
    ``timeout_s`` (None: 60 s) with :func:`bounded_run` (raises CallTimedOut; rc 127 when not runnable)."""
    return bounded_run(list(argv), 60.0 if timeout_s is None else timeout_s)


def _sysfs_minor(bus_id, driver_root="/proc/driver/nvidia/gpus"):
    """Minor number from /proc/driver/nvidia/gpus/<dddd:bb:dd.f>/information ("Device Minor: N")."""
    if not bus_id:
        return None
    m = re.match(r"^([0-9A-Fa-f]+):([0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$", bus_id.strip())
    if not m:
        return None
    name = ("%04x:%s" % (int(m.group(1), 16), m.group(2))).lower()
    try:
        with open(os.path.join(driver_root, name, "information")) as fh:
            for line in fh:
                if line.startswith("Device Minor:"):
                    return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


class SmiBackend:
    """GPU state through ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` (30.8 ms a call
    on 2x H200, median; the cost of each poll). ``runner(argv, timeout_s) -> (rc, stdout, stderr)`` runs it
    with LC_ALL=C; each run gets ``deadline.call_timeout()`` seconds."""

    name = "nvidia-smi"

    def __init__(self, runner=None, smi_path="nvidia-smi", driver_root="/proc/driver/nvidia/gpus", deadline=None,
                 prefetch_details=False):
        if not smi_path:
            raise BackendUnavailableError(
                "nvidia-smi was not found on PATH: install the NVIDIA driver utilities (nvidia-utils-<ver>) "
                "or, in a container, start it with GPU access (NVIDIA Container Toolkit, --gpus).")
        self._run = runner or subprocess_runner
        self._smi = smi_path
        self._driver_root = driver_root
        self._deadline = deadline or Deadline(None)
        self._dropped = set()
        self._inventory = None
        self._system = None
        # prefetch_details: open with the full details query (it carries index, uuid, pci.bus_id, name and
        # driver_version too), so inventory(), system()'s driver and the first details() cost one run
        # instead of three (issue 14: nvidia_gpu_info went from 7 runs to 5). The wait keeps the short probe:
        # it never reads details.
        self._prefetch = prefetch_details
        self._details_rows = None
        self.apps_unreadable = {}

    def open(self):
        """Probe with a query so a missing driver fails here, before any real work: the inventory query, or
        with ``prefetch_details`` the full details query, kept for the first :meth:`details` call."""
        if self._prefetch:
            self._details_rows = self._query("query-gpu", SMI_GPU_QUERY)
        self.inventory()
        return self

    def close(self):
        pass

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()

    def _call(self, args):
        argv = [self._smi] + list(args)
        shown = "nvidia-smi " + " ".join(args)
        limit = self._deadline.call_timeout()
        try:
            rc, out, err = self._run(argv, limit)
        except CallTimedOut as exc:
            raise GpuTimeoutError(
                "`%s` did not answer within %.1f s; stopped waiting for it (sent SIGKILL, not waited for: a "
                "process in D state cannot die until the driver returns). %s" % (shown, exc.seconds, HANG_HINT),
                stdout=exc.out or None, stderr=exc.err or None)
        out = out or ""
        err = err or ""
        failure = classify_smi_failure(shown, rc, out, err)
        if failure is not None:
            raise failure
        if rc == 127 or (rc != 0 and "No such file" in err and not out):
            raise BackendUnavailableError("nvidia-smi could not be run (%s): install the NVIDIA driver utilities."
                                          % (err.strip() or "rc 127"), rc=rc, stdout=out, stderr=err)
        return rc, out, err

    def _query(self, switch, spec):
        """Run a CSV query; drop optional fields this driver rejects (rc 2, 'Field "x" is not a valid field
        to query'), remembering them for the session. Returns a list of dicts keyed by our names, each with
        ``_raw``: ``{key: raw text}`` for values read as None ([N/A], [Unknown Error], ...)."""
        while True:
            fields = [f for f in spec if f[0] not in self._dropped]
            shown = "--%s=%s" % (switch, ",".join(f[0] for f in fields))
            rc, out, err = self._call([shown, "--format=csv,noheader,nounits"])
            if rc == 0:
                break
            bad = _INVALID_FIELD_RE.search(out + err)
            if bad and bad.group(1) not in _SMI_REQUIRED and bad.group(1) not in self._dropped:
                self._dropped.add(bad.group(1))
                continue
            raise GpuError("%s\nnvidia-smi %s failed (rc %s). What to do: run `nvidia-smi` on the host and read "
                           "its error." % (first_lines(err + "\n" + out) or "(no output)", switch, rc),
                           rc=rc, stdout=out, stderr=err)
        rows = []
        for line in out.splitlines():
            if not line.strip():
                continue
            parts = [p.strip() for p in line.split(",", len(fields) - 1)]
            if len(parts) != len(fields):
                raise GpuError("nvidia-smi printed a line that does not match the query (%d fields expected): %r"
                               % (len(fields), line), rc=rc, stdout=out, stderr=err)
            row = {key: None for dummy, key, dummy in spec}
            raw_na = {}
            for (dummy, key, conv), raw in zip(fields, parts):
                row[key] = conv(raw)
                if row[key] is None:
                    raw_na[key] = raw
            row["_raw"] = raw_na
            rows.append(row)
        return rows

    def system(self):
        """Driver from ``--query-gpu=driver_version``; CUDA from the ``nvidia-smi`` banner ("CUDA Version:
        13.0"), which no query field carries; None when the banner lacks it."""
        if self._system is None:
            if self._details_rows is not None:
                rows = self._details_rows
            else:
                rows = self._query("query-gpu", (("driver_version", "driver_version", _text),))
            driver = rows[0]["driver_version"] if rows else None
            cuda = None
            rc, out, dummy = self._call([])
            m = _CUDA_RE.search(out or "")
            if rc == 0 and m:
                cuda = m.group(1)
            self._system = {"driver_version": driver, "cuda_version": cuda}
        return self._system

    def inventory(self):
        """Identity of every GPU from ``--query-gpu=index,uuid,pci.bus_id,name``; ``minor_number`` from
        /proc/driver/nvidia/gpus/<bus id>/information (None where that file is missing). Cached.
        Raises :class:`NoDevicesError` when nvidia-smi lists none."""
        if self._inventory is None:
            if self._details_rows is not None:
                rows = [{key: r[key] for key in ("index", "uuid", "pci_bus_id", "name")} for r in self._details_rows]
            else:
                rows = self._query("query-gpu", (("index", "index", _int), ("uuid", "uuid", _text),
                                                 ("pci.bus_id", "pci_bus_id", _text), ("name", "name", _text)))
            for r in rows:
                r.pop("_raw", None)
                r["minor_number"] = _sysfs_minor(r["pci_bus_id"], self._driver_root)
            if not rows:
                require_gpu_count([], None, "nvidia-smi")
            self._inventory = sorted(rows, key=lambda r: r["index"])
        return self._inventory

    def memory(self, indices=None):
        """``--query-gpu=index,uuid,memory.used,memory.total,memory.reserved`` (MiB): one nvidia-smi run.
        Raises :class:`FieldUnavailableError` naming GPU, field and raw text when memory.used or
        memory.total is not a number ([N/A], [Unknown Error], ...)."""
        rows = self._query("query-gpu", SMI_MEMORY_QUERY)
        out = []
        for r in sorted(rows, key=lambda r: r["index"] if r["index"] is not None else -1):
            if indices is not None and r["index"] not in indices:
                continue
            raw = r.pop("_raw")
            for key, field in REQUIRED_MEMORY_FIELDS:
                if r[key] is None:
                    err = FieldUnavailableError(
                        "GPU %s (%s): %s unreadable (nvidia-smi reads %r), so whether its memory is free cannot be "
                        "told. %s" % (r["index"], r["uuid"], field, raw.get(key, ""), FIELD_HINT))
                    err.gpu, err.field, err.raw = r["index"], field, raw.get(key, "")
                    raise err
            out.append(r)
        return out

    def details(self, indices=None):
        """Every :data:`GPU_FIELDS` key from one ``--query-gpu`` run; the field behind each key is in
        :data:`SMI_GPU_QUERY` ("[N/A]", "[Not Supported]" -> None with the raw text in ``unsupported``;
        fields this driver rejects -> None, "field not known to this nvidia-smi"). The first call after an
        ``open()`` with ``prefetch_details`` uses the rows read there; later calls run the query again."""
        minors = {g["index"]: g["minor_number"] for g in self.inventory()}
        rows, self._details_rows = self._details_rows, None
        if rows is None:
            rows = self._query("query-gpu", SMI_GPU_QUERY)
        out = []
        for r in sorted(rows, key=lambda r: r["index"]):
            if indices is not None and r["index"] not in indices:
                continue
            raw = r.pop("_raw")
            r.pop("driver_version", None)
            raw.pop("driver_version", None)
            r["minor_number"] = minors.get(r["index"])
            r["clocks_event_reasons"] = clock_event_reason_names(r["clocks_event_reasons_mask"])
            for field, key, dummy in SMI_GPU_QUERY:
                if field in self._dropped:
                    raw[key] = "field %s not known to this nvidia-smi" % field
            r["unsupported"] = raw
            out.append({k: r.get(k) for k in GPU_FIELDS})
        return out

    def nvlinks(self, indices=None):
        """``{index: [link]}`` as :meth:`NvmlBackend.nvlinks`, from ``nvidia-smi nvlink -s`` ("Link 0: 26.562
        GB/s" or "Link 1: <inactive>") and ``nvidia-smi nvlink -e`` ("Link 0: Replay Errors: 0"). Both print
        nothing (rc 0) on a GPU without NVLink peers (recordings/h200x1-health-driver580/nvlink.txt): ``[]``.
        Raises GpuError when nvidia-smi has no ``nvlink`` command (the caller reports the links as unknown)."""
        by_uuid = {g["uuid"]: g["index"] for g in self.inventory()}
        out = {g["index"]: [] for g in self.inventory() if indices is None or g["index"] in indices}
        links = {}
        for flag in ("-s", "-e"):
            rc, text, err = self._call(["nvlink", flag])
            if rc != 0:
                raise GpuError("%s\nnvidia-smi nvlink %s failed (rc %s)" % (first_lines(err + "\n" + text) or
                                                                            "(no output)", flag, rc),
                               rc=rc, stdout=text, stderr=err)
            gpu = None
            for line in text.splitlines():
                m = _NVLINK_GPU_RE.match(line)
                if m:
                    gpu = by_uuid.get(m.group(2).strip(), int(m.group(1)))
                    continue
                if gpu is None or gpu not in out:
                    continue
                if flag == "-e":
                    m = _NVLINK_ERR_RE.match(line)
                    if m:
                        row = links.setdefault((gpu, int(m.group(1))), {"link": int(m.group(1)), "state": None})
                        name = m.group(2).strip().lower()
                        key = _NVLINK_ERR_NAMES.get(name, re.sub(r"\W+", "_", name).strip("_") + "_errors")
                        row[key] = _int(m.group(3))
                    continue
                m = _NVLINK_STATE_RE.match(line)
                if m:
                    row = links.setdefault((gpu, int(m.group(1))), {"link": int(m.group(1))})
                    row["state"] = "inactive" if "inactive" in m.group(2).lower() else "active"
        for (gpu, dummy), row in sorted(links.items()):
            for dummy, key in NVLINK_COUNTERS:
                row.setdefault(key, None)
            out[gpu].append(row)
        return out

    def compute_processes(self, indices=None):
        """``--query-compute-apps=pid,used_memory,gpu_uuid,gpu_bus_id,process_name``; rows are matched to a
        GPU by UUID (bus id as fallback). ``process_name`` is what the driver reports (the executable path,
        or a setproctitle title)."""
        by_uuid = {g["uuid"]: g["index"] for g in self.inventory()}
        by_bus = {(g["pci_bus_id"] or "").lower(): g["index"] for g in self.inventory()}
        out = []
        self.apps_unreadable = {}
        for r in self._query("query-compute-apps", SMI_APPS_QUERY):
            idx = by_uuid.get(r["gpu_uuid"])
            if idx is None:
                idx = by_bus.get((r["gpu_bus_id"] or "").lower())
            if indices is not None and idx not in indices:
                continue
            raw = r.get("_raw") or {}
            for key, field in (("pid", "compute_apps.pid"), ("used_memory_mib", "compute_apps.used_memory")):
                if r[key] is None:
                    self.apps_unreadable.setdefault(idx, {})[field] = raw.get(key, "")
            if r["pid"] is None:
                continue  # a row without a pid names no process; the field is reported through apps_unreadable
            out.append({"gpu_index": idx, "gpu_uuid": r["gpu_uuid"], "pid": r["pid"],
                        "used_memory_mib": r["used_memory_mib"], "process_name": r["process_name"]})
        return out


# --------------------------------------------------------------------------------------------------------
# choosing a backend

def _strip_prefix(text, prefix="NVML: "):
    """NVML's reason without its "NVML: " prefix and without its what-to-do (the final message has one)."""
    text = text[len(prefix):] if text.startswith(prefix) else text
    return text.split(" What to do:", 1)[0].strip()


def open_backend(choice="auto", runner=None, smi_path="nvidia-smi", nvml=None, deadline=None,
                 smi_prefetch_details=False):
    """Open and return ``(backend, fallback_reason)``.

    ``choice``: ``nvml`` (fails if nvidia-ml-py is missing: :class:`MissingLibraryError`, or nvmlInit fails),
    ``nvidia-smi``, or ``auto``: NVML when the library imports and nvmlInit succeeds, else nvidia-smi;
    ``fallback_reason`` then says why NVML was not used (None when it was). An nvmlInit that times out is
    not fallen back from (nvidia-smi would hang on the same driver). ``nvml`` injects a pynvml module
    (tests). ``deadline`` (:class:`Deadline`) bounds nvmlInit and every nvidia-smi run.
    ``smi_prefetch_details``: the nvidia-smi backend opens with its full details query (for callers that
    read :meth:`SmiBackend.details`; saves two runs). Raises :class:`GpuError` subclasses whose message
    starts with the driver's text.
    """
    if choice not in BACKEND_CHOICES:
        raise GpuError("backend must be one of %s, got %r" % (", ".join(BACKEND_CHOICES), choice))
    deadline = deadline or Deadline(None)
    lib = nvml if nvml is not None else pynvml
    if choice == "nvml":
        if lib is None:
            raise MissingLibraryError("nvidia-ml-py", PYNVML_IMPORT_ERROR)
        return NvmlBackend(lib, deadline).open(), None
    reason = None
    if choice == "auto":
        if lib is None:
            reason = "nvidia-ml-py (pynvml) is not installed for this Python"
        else:
            try:
                return NvmlBackend(lib, deadline).open(), None
            except GpuTimeoutError:
                raise
            except GpuError as exc:
                reason = exc.msg
    try:
        backend = SmiBackend(runner, smi_path, deadline=deadline, prefetch_details=smi_prefetch_details)
        return backend.open(), reason
    except GpuError as exc:
        if reason:
            # The driver's text (nvidia-smi's) first; NVML's reason once, without a doubled "NVML:" prefix.
            exc.msg = "%s\n(NVML was tried first: %s)" % (exc.msg, _strip_prefix(reason))
        raise


#: Seconds a module's whole GPU session may outlast its ``timeout_s`` before it is abandoned (process scan
#: after the wait, the final nvidia-smi runs); beyond that an NVML call is blocked in the driver.
SESSION_GRACE_S = 10.0


def backend_session(choice, smi_path, work, timeout_s=None, expected_count=None, smi_prefetch_details=False):
    """Open the backend ``choice`` (auto|nvml|nvidia-smi), check the GPU count (:func:`require_gpu_count` with
    ``expected_count``), return ``work(backend, fallback_reason)`` and close the backend again.

    Every nvidia-smi run and nvmlInit gets the time left of ``timeout_s`` (at least MIN_CALL_TIMEOUT_S);
    the whole session runs in a daemon thread abandoned after ``timeout_s + MIN_CALL_TIMEOUT_S +
    SESSION_GRACE_S`` (an NVML call blocked in the driver cannot be interrupted). Raises
    :class:`MissingLibraryError` and :class:`GpuError` (callers that must not fail, such as sglang_stop's
    optional GPU wait, record them; :func:`run_on_backend` turns them into ``fail_json``).
    ``smi_prefetch_details`` is passed to :func:`open_backend` (callers whose ``work`` reads details).
    """
    deadline = Deadline(timeout_s)

    def session():
        backend, reason = open_backend(choice, runner=subprocess_runner, smi_path=smi_path, deadline=deadline,
                                       smi_prefetch_details=smi_prefetch_details)
        try:
            require_gpu_count(backend.inventory(), expected_count, "NVML" if backend.name == "nvml" else "nvidia-smi")
            return work(backend, reason)
        finally:
            backend.close()

    limit = None if timeout_s is None else float(timeout_s) + MIN_CALL_TIMEOUT_S + SESSION_GRACE_S
    if limit is None:
        return session()
    return call_in_thread(session, limit, "The GPU session (backend %s)" % choice)


def run_on_backend(module, work, timeout_s=None, expected_count=None, on_fail=None, smi_prefetch_details=False):
    """For an AnsibleModule: :func:`backend_session` on the backend ``module.params["backend"]`` names.

    nvidia-smi runs with ``LC_ALL=C`` through :func:`bounded_run`. Failures end the module with ``fail_json``:
    a missing nvidia-ml-py with Ansible's standard ``missing_required_lib`` message (error_class
    missing_library), a :class:`GpuError` with its message, ``error_class``, rc, stdout, stderr.
    ``on_fail(exc)`` may return extra keyword arguments for that fail_json (its ``msg`` is appended to the
    message). ``smi_prefetch_details``: see :func:`backend_session`.
    """
    from ansible.module_utils.basic import missing_required_lib

    try:
        return backend_session(module.params["backend"], module.get_bin_path("nvidia-smi"), work,
                               timeout_s=timeout_s, expected_count=expected_count,
                               smi_prefetch_details=smi_prefetch_details)
    except MissingLibraryError as exc:
        module.fail_json(msg=missing_required_lib(exc.library), exception=str(exc.exc or PYNVML_IMPORT_ERROR),
                         error_class="missing_library")
    except GpuError as exc:
        module.fail_json(**failure_kwargs(exc, on_fail))


def failure_kwargs(exc, on_fail=None):
    """The fail_json keyword arguments of a :class:`GpuError` (``msg``, ``error_class``, rc/stdout/stderr), with
    what ``on_fail(exc)`` adds (its ``msg`` appended to the message, its other keys where not set)."""
    kw = exc.fail_kwargs()
    if on_fail is not None:
        extra = dict(on_fail(exc) or {})
        more = extra.pop("msg", None)
        if more:
            kw["msg"] = "%s\n%s" % (kw["msg"], more)
        for key, value in extra.items():
            kw.setdefault(key, value)
    return kw


# --------------------------------------------------------------------------------------------------------
# processes per GPU

def gpu_processes(backend, indices, scan_fds=True, proc_root="/proc", exclude_pids=None):
    """Processes on each GPU in ``indices``, merged from the backend's compute-process list and the
    ``/proc/*/fd`` (and ``/proc/*/task/*/fd``) scan, plus the holders of device files.

    Returns ``(per_gpu, device_holders)``: ``per_gpu`` is ``{index: [proc]}`` with proc = ``{"pid",
    "used_memory_mib" (MiB or None), "name", "cmdline" (str), "user", "source": ["nvml"|"nvidia-smi",
    "proc_fd"], "kind": "gpu"|"monitor"}``; ``device_holders`` is ``[{"pid", "name", "cmdline", "user",
    "devices": [path], "gpu_indices": [int], "kind": "gpu"|"shared_only"|"monitor"}]`` for every process
    with any /dev/nvidia* open, sorted per-GPU holders first, then shared-only, then monitors
    (:func:`gpufleet_procs.holder_kind`). The calling process is left out (it holds the devices itself when
    NVML is open). The fd scan maps /dev/nvidia<N> to the GPU whose minor number is N (index when unknown).
    """
    if exclude_pids is None:
        exclude_pids = {os.getpid()}
    inv = backend.inventory()
    minor_to_index = {}
    for g in inv:
        minor_to_index[g["minor_number"] if g.get("minor_number") is not None else g["index"]] = g["index"]
    wanted = set(indices)
    found = {i: {} for i in indices}

    for p in backend.compute_processes(indices):
        if p["gpu_index"] not in wanted or p["pid"] in exclude_pids:
            continue
        entry = found[p["gpu_index"]].setdefault(p["pid"], {"pid": p["pid"], "used_memory_mib": None,
                                                            "process_name": None, "source": []})
        if p["used_memory_mib"] is not None:
            entry["used_memory_mib"] = (entry["used_memory_mib"] or 0) + p["used_memory_mib"]
        entry["process_name"] = entry["process_name"] or p.get("process_name")
        if backend.name not in entry["source"]:
            entry["source"].append(backend.name)

    holders = find_device_holders(proc_root=proc_root, exclude_pids=exclude_pids) if scan_fds else {}
    holder_gpus = {}
    for pid, paths in holders.items():
        gpus = sorted({minor_to_index[m] for m in (gpu_minor_of_path(p) for p in paths)
                       if m is not None and m in minor_to_index})
        holder_gpus[pid] = gpus
        for idx in gpus:
            if idx not in wanted:
                continue
            entry = found[idx].setdefault(pid, {"pid": pid, "used_memory_mib": None, "process_name": None,
                                                "source": []})
            entry["source"].append("proc_fd")

    all_pids = set(holders)
    for per in found.values():
        all_pids.update(per)
    described = describe_pids(sorted(all_pids))

    def _describe(pid, fallback_name=None):
        info = described.get(pid) or {}
        return {"name": info.get("name") or fallback_name,
                # setproctitle pads argv[0] with spaces (SGLang's sglang::scheduler_TP<n> titles).
                "cmdline": " ".join(info["cmdline"]).strip() if info.get("cmdline") else None,
                "user": info.get("user")}

    per_gpu = {}
    for idx in indices:
        rows = []
        for pid in sorted(found[idx]):
            e = found[idx][pid]
            row = {"pid": pid, "used_memory_mib": e["used_memory_mib"]}
            row.update(_describe(pid, e["process_name"]))
            row["source"] = e["source"]
            row["kind"] = "monitor" if holder_kind([], row["name"], [idx]) == "monitor" else "gpu"
            rows.append(row)
        per_gpu[idx] = rows
    device_holders = []
    for pid in sorted(holders):
        row = {"pid": pid}
        row.update(_describe(pid))
        row["devices"] = holders[pid]
        row["gpu_indices"] = holder_gpus[pid]
        row["kind"] = holder_kind(holders[pid], row["name"], holder_gpus[pid])
        device_holders.append(row)
    order = {"gpu": 0, "shared_only": 1, "monitor": 2}
    device_holders.sort(key=lambda r: (order[r["kind"]], r["pid"]))
    return per_gpu, device_holders


# --------------------------------------------------------------------------------------------------------
# waiting

def _over(m, max_used_mib, baseline_mib):
    return m["memory_used_mib"] is None or m["memory_used_mib"] > wait_limit(m["index"], max_used_mib, baseline_mib)


def gpus_ready(memory_rows, max_used_mib, processes=None, baseline_mib=None):
    """Indices (from ``memory_rows``) that still fail: used > max_used_mib (plus the GPU's ``baseline_mib``: memory
    others held while the old server ran, :func:`gpufleet_gpu_memory.wait_limit`), or, when ``processes`` (a
    compute-process list) is given, still running a compute process."""
    busy_pids = {}
    for p in processes or ():
        busy_pids.setdefault(p["gpu_index"], []).append(p["pid"])
    return [m["index"] for m in memory_rows if _over(m, max_used_mib, baseline_mib) or busy_pids.get(m["index"])]


def progress_text(memory_rows, busy, max_used_mib, elapsed_s, timeout_s, processes=None, baseline_mib=None):
    """One line for the operator: "GPU memory: 3 of 8 GPUs above 1024 MiB (max 30012 MiB on GPU 2),
    20 s of 120 s" (or "all 8 GPUs at or below 1024 MiB ..."); GPUs under the limit that still run a
    compute process are counted apart. With a ``baseline_mib``, the memory others held is named and its GPUs
    count as free at that memory plus ``max_used_mib``."""
    total = len(memory_rows)
    beside = (" (plus what others held while the old server ran: %s)" % baseline_text(baseline_mib)
              if baseline_mib else "")
    over = [m for m in memory_rows if _over(m, max_used_mib, baseline_mib)]
    with_procs = sorted(set(busy) - {m["index"] for m in over})
    clock = "%d s of %g s" % (int(round(elapsed_s)), timeout_s)
    if not busy:
        return "GPU memory: all %d GPUs at or below %d MiB%s%s, after %.2f s of %g s" % (
            total, max_used_mib, beside, " with no compute process" if processes is not None else "", elapsed_s,
            timeout_s)
    parts = []
    if over:
        top = max(over, key=lambda m: m["memory_used_mib"] or 0)
        parts.append("%d of %d GPUs above %d MiB%s (max %s MiB on GPU %d)" % (
            len(over), total, max_used_mib, beside, top["memory_used_mib"], top["index"]))
    if with_procs:
        parts.append("%d GPU%s under the limit still running a compute process (GPU %s)" % (
            len(with_procs), "" if len(with_procs) == 1 else "s", ", ".join(str(i) for i in with_procs)))
    return "GPU memory: %s, %s" % ("; ".join(parts), clock)


def wait_for_memory(backend, indices, max_used_mib, require_no_processes=False, poll_interval_ms=50,
                    timeout_s=120.0, clock=time.monotonic, sleep=time.sleep, slice_s=None, elapsed_before_s=0.0,
                    baseline_mib=None):
    """Poll ``backend`` until every GPU in ``indices`` has memory_used_mib <= max_used_mib (and, with
    ``require_no_processes``, no compute process), or ``timeout_s`` passes.

    ``elapsed_before_s``: seconds of this wait already spent by earlier calls (the role waits in slices);
    the whole wait ends at ``timeout_s`` counted from there. ``slice_s``: return after at most this many
    seconds of this call even if the whole wait has time left (``"slice_ended": True``). ``baseline_mib``
    (``{index: MiB}``, keys str or int): memory others held on a GPU while the old server ran; that GPU counts as
    free at that plus ``max_used_mib`` (the server's own memory released).

    One backend session serves all polls. Polls are spaced ``poll_interval_ms`` apart from their start, so
    a slow nvidia-smi call does not stretch the period. The compute-process list is read only once memory
    is below the limit (it costs a second nvidia-smi call). A field the wait needs that reads [N/A] raises
    :class:`FieldUnavailableError` at the first poll. Returns ``{"ready": bool, "elapsed_ms": int (whole
    wait), "polls": int (this call), "memory": [memory row], "processes": [compute process] | None,
    "busy": [index], "slice_ended": bool, "progress": str}``.
    """
    start = clock()
    left = max(0.0, float(timeout_s) - float(elapsed_before_s))
    total_deadline = start + left
    deadline = total_deadline if slice_s is None else min(total_deadline, start + max(0.0, float(slice_s)))
    period = max(poll_interval_ms, 1) / 1000.0
    next_poll = start
    polls = 0
    while True:
        polls += 1
        mem = backend.memory(indices)
        busy = gpus_ready(mem, max_used_mib, baseline_mib=baseline_mib)
        procs = None
        if not busy and require_no_processes:
            procs = backend.compute_processes(indices)
            busy = gpus_ready(mem, max_used_mib, procs, baseline_mib=baseline_mib)
        now = clock()
        if not busy or now >= deadline - 1e-6:  # tolerance: float sums of the period must not add a poll
            elapsed_s = elapsed_before_s + (now - start)
            return {"ready": not busy, "elapsed_ms": int(round(elapsed_s * 1000)), "polls": polls,
                    "memory": mem, "processes": procs, "busy": busy,
                    "slice_ended": bool(busy) and now < total_deadline - 1e-6,
                    "progress": progress_text(mem, busy, max_used_mib, elapsed_s, timeout_s, procs, baseline_mib)}
        # Fixed cadence from each poll's start; a poll slower than the period is followed at once.
        next_poll = max(next_poll + period, now)
        sleep(max(0.0, min(next_poll, deadline) - now))
