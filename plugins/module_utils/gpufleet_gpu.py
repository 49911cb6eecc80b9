# -*- coding: utf-8 -*-
# gpufleet: GPU backends (NVML | nvidia-smi) behind one schema, and the wait loop of nvidia_gpu_wait.
"""Read NVIDIA GPU state through NVML (nvidia-ml-py, ``import pynvml``) or the ``nvidia-smi`` CLI.

Both backends return the same dictionaries, so a module never cares which one answered:

* :meth:`Backend.system` -> ``{"driver_version": str, "cuda_version": str|None}``
* :meth:`Backend.inventory` -> ``[{"index", "uuid", "name", "pci_bus_id", "minor_number"}]``
* :meth:`Backend.details` -> one dict per GPU with every key of :data:`GPU_FIELDS` (None = not supported)
* :meth:`Backend.memory` -> ``[{"index", "uuid", "memory_used_mib", "memory_total_mib",
  "memory_reserved_mib"}]`` (the cheap call the wait loop polls)
* :meth:`Backend.compute_processes` -> ``[{"gpu_index", "gpu_uuid", "pid", "used_memory_mib",
  "process_name"}]``

Memory is MiB (2**20 bytes). ``memory_used_mib`` excludes the driver's reserved memory on both backends:
NVML v2 ``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2).used`` equals nvidia-smi ``memory.used``,
while NVML v1 ``used`` adds ``memory.reserved`` (615 MiB on an idle H200, driver 580.159; see
shared/recordings/h200x2-driver580/loaded-nvml.txt).

Nothing here imports Ansible: the nvidia-smi backend takes a ``runner(argv) -> (rc, stdout, stderr)``
callable (modules pass ``AnsibleModule.run_command``; :func:`subprocess_runner` works elsewhere).
"""
from __future__ import annotations

import os
import re
import subprocess
import time

from ansible.module_utils.gpufleet_procs import (
    MissingLibraryError,
    clean_text,
    describe_pids,
    find_device_holders,
    gpu_minor_of_path,
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

#: Keys of a GPU dict from :meth:`Backend.details`, with units in the names.
GPU_FIELDS = (
    "index", "uuid", "name", "pci_bus_id", "minor_number",
    "memory_used_mib", "memory_total_mib", "memory_reserved_mib",
    "utilization_gpu_pct", "temperature_gpu_c", "power_draw_w", "power_limit_w",
    "persistence_mode", "compute_mode",
    "ecc_errors_corrected_volatile_total", "ecc_errors_uncorrected_volatile_total",
    "remapped_rows_correctable", "remapped_rows_uncorrectable", "remapped_rows_pending",
    "remapped_rows_failure",
)

# NVML nvmlComputeMode_t values -> the words nvidia-smi prints for compute_mode.
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


class GpuError(Exception):
    """A failure the module reports with fail_json; ``msg`` says what happened and what to do.

    ``rc``/``stdout``/``stderr`` are set when an nvidia-smi call failed.
    """

    def __init__(self, msg, rc=None, stdout=None, stderr=None):
        super().__init__(msg)
        self.msg = msg
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr

    def fail_kwargs(self):
        """Keyword arguments for ``AnsibleModule.fail_json``."""
        kw = {"msg": self.msg}
        for key in ("rc", "stdout", "stderr"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        return kw


class DriverNotLoadedError(GpuError):
    """The NVIDIA kernel driver does not answer (NVML_ERROR_DRIVER_NOT_LOADED / nvidia-smi rc 9)."""


class BackendUnavailableError(GpuError):
    """This backend cannot run here (no libnvidia-ml.so.1, no nvidia-smi binary)."""


class GpuLostError(GpuError):
    """A GPU fell off the bus (NVML_ERROR_GPU_IS_LOST / nvidia-smi "GPU is lost")."""


class SelectorError(GpuError):
    """A ``gpus`` selector is malformed or names no GPU on this host."""


DRIVER_HINT = ("Check that the NVIDIA kernel module is loaded (`lsmod | grep nvidia`, `dmesg | grep NVRM`), "
               "reinstall or reload the driver, and inside a container start it with GPU access "
               "(NVIDIA Container Toolkit, --gpus).")
LOST_HINT = ("Look for Xid 79 in the kernel log (`dmesg | grep -i xid`); the GPU needs a reset "
             "(`nvidia-smi -r` once nothing uses it) or, usually, a reboot of the host.")


def _lost_message(where):
    return "GPU %s is lost (fell off the bus). %s" % (where, LOST_HINT)


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

class NvmlBackend:
    """GPU state through NVML (nvidia-ml-py). One ``nvmlInit`` per session (10.9 ms on 2x H200), then
    every query is a library call (``nvmlDeviceGetMemoryInfo`` v2: 5 us) -- cheap enough to poll.
    Figures: docs/benchmarks.md."""

    name = "nvml"

    def __init__(self, nvml=None):
        self._n = nvml if nvml is not None else pynvml
        if self._n is None:
            raise MissingLibraryError("nvidia-ml-py", PYNVML_IMPORT_ERROR)
        self._handles = None
        self._inventory = None
        self._open = False
        self._memory_v2 = True

    # -- session --
    def open(self):
        """``nvmlInit``; maps its errors to :class:`BackendUnavailableError` / :class:`DriverNotLoadedError`."""
        n = self._n
        try:
            n.nvmlInit()
        except n.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == n.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise BackendUnavailableError(
                    "NVML: libnvidia-ml.so.1 was not found (%s). The NVIDIA driver's user-space libraries are "
                    "not installed on this host or not mounted into this container; install the driver "
                    "(or the NVIDIA Container Toolkit) or use backend: nvidia-smi." % exc)
            if code == n.NVML_ERROR_DRIVER_NOT_LOADED:
                raise DriverNotLoadedError("NVML: the NVIDIA driver is not loaded (%s). %s" % (exc, DRIVER_HINT))
            if code == getattr(n, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", -1):
                raise DriverNotLoadedError(
                    "NVML: driver/library version mismatch (%s): the kernel module and libnvidia-ml differ, "
                    "usually after a driver upgrade without reboot; reboot or reload the nvidia modules." % exc)
            if code == n.NVML_ERROR_NO_PERMISSION:
                raise BackendUnavailableError(
                    "NVML: no permission to open the NVIDIA devices (%s); run as a user that may open "
                    "/dev/nvidia*." % exc)
            raise BackendUnavailableError("NVML: nvmlInit failed: %s. %s" % (exc, DRIVER_HINT))
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
    def _raise(self, exc, what, index=None):
        n = self._n
        code = getattr(exc, "value", None)
        where = "%s" % index if index is not None else "?"
        if code == n.NVML_ERROR_GPU_IS_LOST:
            bus = None
            if self._inventory and index is not None:
                bus = next((g["pci_bus_id"] for g in self._inventory if g["index"] == index), None)
            raise GpuLostError(_lost_message("%s%s" % (where, " (%s)" % bus if bus else "")))
        if code == n.NVML_ERROR_DRIVER_NOT_LOADED:
            raise DriverNotLoadedError("NVML: the NVIDIA driver is not loaded (%s). %s" % (exc, DRIVER_HINT))
        raise GpuError("NVML: %s failed for GPU %s: %s" % (what, where, exc))

    def _optional(self, index, fn, *args):
        """Call an NVML getter for an optional field: None when unsupported, GpuLostError when lost."""
        n = self._n
        try:
            return fn(*args)
        except n.NVMLError as exc:
            if getattr(exc, "value", None) in (n.NVML_ERROR_GPU_IS_LOST, n.NVML_ERROR_DRIVER_NOT_LOADED):
                self._raise(exc, getattr(fn, "__name__", "query"), index)
            # NotSupported (H200 retired pages), NoPermission, FunctionNotFound (older driver), Unknown:
            # the field is null rather than the whole answer failing.
            return None

    def _handle_list(self):
        if self._handles is None:
            n = self._n
            try:
                count = n.nvmlDeviceGetCount()
            except n.NVMLError as exc:
                self._raise(exc, "nvmlDeviceGetCount")
            handles = []
            for i in range(count):
                try:
                    handles.append(n.nvmlDeviceGetHandleByIndex(i))
                except n.NVMLError as exc:
                    self._raise(exc, "nvmlDeviceGetHandleByIndex", i)
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
                    self._raise(exc, "nvmlDeviceGetMemoryInfo(v2)", index)
                # Drivers before the v2 struct: v1 "used" includes the reserved memory, reserved unknown.
                self._memory_v2 = False
        try:
            m = n.nvmlDeviceGetMemoryInfo(handle)
        except n.NVMLError as exc:
            self._raise(exc, "nvmlDeviceGetMemoryInfo", index)
        return bytes_to_mib(m.used), bytes_to_mib(m.total), None

    def memory(self, indices=None):
        """Memory of the GPUs ``indices`` (all when None) via nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2)."""
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

    def details(self, indices=None):
        """Every :data:`GPU_FIELDS` key per GPU. NVML calls: nvmlDeviceGetUtilizationRates().gpu,
        nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU), nvmlDeviceGetPowerUsage and
        nvmlDeviceGetPowerManagementLimit (mW -> W), nvmlDeviceGetPersistenceMode, nvmlDeviceGetComputeMode,
        nvmlDeviceGetTotalEccErrors(CORRECTED|UNCORRECTED, NVML_VOLATILE_ECC), nvmlDeviceGetRemappedRows."""
        n = self._n
        handles = self._handle_list()
        mem = {m["index"]: m for m in self.memory(indices)}
        out = []
        for g in self.inventory():
            if g["index"] not in mem:
                continue
            i, h = g["index"], handles[g["index"]]
            util = self._optional(i, n.nvmlDeviceGetUtilizationRates, h)
            power = self._optional(i, n.nvmlDeviceGetPowerUsage, h)
            limit = self._optional(i, n.nvmlDeviceGetPowerManagementLimit, h)
            persistence = self._optional(i, n.nvmlDeviceGetPersistenceMode, h)
            compute = self._optional(i, n.nvmlDeviceGetComputeMode, h)
            rows = self._optional(i, n.nvmlDeviceGetRemappedRows, h)
            gpu = dict(g)
            gpu.update(mem[i])
            gpu.update({
                "utilization_gpu_pct": getattr(util, "gpu", None) if util is not None else None,
                "temperature_gpu_c": self._optional(i, n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
                "power_draw_w": round(power / 1000.0, 2) if power is not None else None,
                "power_limit_w": round(limit / 1000.0, 2) if limit is not None else None,
                "persistence_mode": None if persistence is None else ("Enabled" if persistence else "Disabled"),
                "compute_mode": None if compute is None else COMPUTE_MODES.get(compute, str(compute)),
                "ecc_errors_corrected_volatile_total": self._optional(
                    i, n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC),
                "ecc_errors_uncorrected_volatile_total": self._optional(
                    i, n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
                "remapped_rows_correctable": rows[0] if rows else None,
                "remapped_rows_uncorrectable": rows[1] if rows else None,
                "remapped_rows_pending": bool(rows[2]) if rows else None,
                "remapped_rows_failure": bool(rows[3]) if rows else None,
            })
            out.append(gpu)
        return out

    def compute_processes(self, indices=None):
        """nvmlDeviceGetComputeRunningProcesses per GPU; ``used_memory_mib`` None when NVML cannot tell
        (usedGpuMemory None). ``process_name`` is None (NVML has only the pid)."""
        n = self._n
        handles = self._handle_list()
        out = []
        for g in self.inventory():
            if indices is not None and g["index"] not in indices:
                continue
            try:
                procs = n.nvmlDeviceGetComputeRunningProcesses(handles[g["index"]])
            except n.NVMLError as exc:
                if getattr(exc, "value", None) in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_NO_PERMISSION):
                    continue
                self._raise(exc, "nvmlDeviceGetComputeRunningProcesses", g["index"])
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                out.append({"gpu_index": g["index"], "gpu_uuid": g["uuid"], "pid": int(p.pid),
                            "used_memory_mib": bytes_to_mib(used) if used is not None else None,
                            "process_name": None})
        return out


# --------------------------------------------------------------------------------------------------------
# nvidia-smi backend

_NA_VALUES = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", "[Insufficient Permissions]",
              "[GPU is lost]", "[Requested functionality has been deprecated]", ""}
_INVALID_FIELD_RE = re.compile(r'Field "([^"]+)" is not a valid field to query')
_LOST_RE = re.compile(r"Unable to determine the device handle for GPU\s*([0-9A-Fa-f:.]*)\s*:\s*GPU is lost", re.I)
_DRIVER_RE = re.compile(r"couldn't communicate with the NVIDIA driver|NVIDIA driver is not loaded|"
                        r"Driver/library version mismatch", re.I)
_CUDA_RE = re.compile(r"CUDA Version:\s*([0-9][0-9.]*)")


def _na(value):
    return value is None or value.strip() in _NA_VALUES


def _int(value):
    if _na(value):
        return None
    try:
        return int(float(value))
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
    if v in ("yes", "enabled", "1", "true"):
        return True
    if v in ("no", "disabled", "0", "false"):
        return False
    return None


def _enabled(value):
    b = _yes_no(value)
    return None if b is None else ("Enabled" if b else "Disabled")


# (nvidia-smi --query-gpu field, our key, converter). "name" stays last: a free-text value may hold commas,
# so the line is split with maxsplit and the tail kept whole.
SMI_GPU_QUERY = (
    ("index", "index", _int),
    ("uuid", "uuid", _text),
    ("pci.bus_id", "pci_bus_id", _text),
    ("memory.used", "memory_used_mib", _int),
    ("memory.total", "memory_total_mib", _int),
    ("memory.reserved", "memory_reserved_mib", _int),
    ("utilization.gpu", "utilization_gpu_pct", _int),
    ("temperature.gpu", "temperature_gpu_c", _int),
    ("power.draw", "power_draw_w", _float),
    ("power.limit", "power_limit_w", _float),
    ("persistence_mode", "persistence_mode", _enabled),
    ("compute_mode", "compute_mode", _text),
    ("ecc.errors.corrected.volatile.total", "ecc_errors_corrected_volatile_total", _int),
    ("ecc.errors.uncorrected.volatile.total", "ecc_errors_uncorrected_volatile_total", _int),
    ("remapped_rows.correctable", "remapped_rows_correctable", _int),
    ("remapped_rows.uncorrectable", "remapped_rows_uncorrectable", _int),
    ("remapped_rows.pending", "remapped_rows_pending", _yes_no),
    ("remapped_rows.failure", "remapped_rows_failure", _yes_no),
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


def subprocess_runner(argv):
    """``runner`` for :class:`SmiBackend` outside Ansible: argv list, LC_ALL=C, text decoded with 'replace'."""
    env = dict(os.environ, LC_ALL="C", LANG="C")
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, check=False)
    except OSError as exc:
        return 127, "", str(exc)
    return proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")


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
    on 2x H200, median; the cost of each poll). ``runner(argv) -> (rc, stdout, stderr)`` runs it with LC_ALL=C."""

    name = "nvidia-smi"

    def __init__(self, runner=None, smi_path="nvidia-smi", driver_root="/proc/driver/nvidia/gpus"):
        if not smi_path:
            raise BackendUnavailableError(
                "nvidia-smi was not found on PATH: install the NVIDIA driver utilities (nvidia-utils-<ver>) "
                "or, in a container, start it with GPU access (NVIDIA Container Toolkit, --gpus).")
        self._run = runner or subprocess_runner
        self._smi = smi_path
        self._driver_root = driver_root
        self._dropped = set()
        self._inventory = None
        self._system = None

    def open(self):
        """Probe with an inventory query so a missing driver fails here, before any real work."""
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
        rc, out, err = self._run(argv)
        out = out or ""
        err = err or ""
        both = out + "\n" + err
        lost = _LOST_RE.search(both)
        if lost:
            raise GpuLostError(_lost_message(lost.group(1) or "?"), rc=rc, stdout=out, stderr=err)
        if _DRIVER_RE.search(both):
            raise DriverNotLoadedError("nvidia-smi could not talk to the NVIDIA driver. %s" % DRIVER_HINT,
                                       rc=rc, stdout=out, stderr=err)
        if rc == 127 or (rc != 0 and "No such file" in err and not out):
            raise BackendUnavailableError("nvidia-smi could not be run (%s): install the NVIDIA driver utilities."
                                          % (err.strip() or "rc 127"), rc=rc, stdout=out, stderr=err)
        return rc, out, err

    def _query(self, switch, spec):
        """Run a CSV query; drop optional fields this driver rejects (rc 2, 'Field "x" is not a valid field
        to query'), remembering them for the session. Returns a list of dicts keyed by our names."""
        while True:
            fields = [f for f in spec if f[0] not in self._dropped]
            rc, out, err = self._call(["--%s=%s" % (switch, ",".join(f[0] for f in fields)),
                                       "--format=csv,noheader,nounits"])
            if rc == 0:
                break
            bad = _INVALID_FIELD_RE.search(out + err)
            if bad and bad.group(1) not in _SMI_REQUIRED and bad.group(1) not in self._dropped:
                self._dropped.add(bad.group(1))
                continue
            if "No devices were found" in out + err:
                return []
            raise GpuError("nvidia-smi %s failed (rc %s): %s" % (switch, rc, (err.strip() or out.strip())[:500]),
                           rc=rc, stdout=out, stderr=err)
        rows = []
        for line in out.splitlines():
            if not line.strip():
                continue
            parts = [p.strip() for p in line.split(",", len(fields) - 1)]
            if len(parts) != len(fields):
                raise GpuError("nvidia-smi printed a line that does not match the query (%d fields expected): %r"
                               % (len(fields), line), rc=rc, stdout=out, stderr=err)
            row = {key: None for _, key, _ in spec}
            for (_, key, conv), raw in zip(fields, parts):
                row[key] = conv(raw)
            rows.append(row)
        return rows

    def system(self):
        """Driver from ``--query-gpu=driver_version``; CUDA from the ``nvidia-smi`` banner ("CUDA Version:
        13.0"), which no query field carries; None when the banner lacks it."""
        if self._system is None:
            rows = self._query("query-gpu", (("driver_version", "driver_version", _text),))
            driver = rows[0]["driver_version"] if rows else None
            cuda = None
            rc, out, _ = self._call([])
            m = _CUDA_RE.search(out or "")
            if rc == 0 and m:
                cuda = m.group(1)
            self._system = {"driver_version": driver, "cuda_version": cuda}
        return self._system

    def inventory(self):
        """Identity of every GPU from ``--query-gpu=index,uuid,pci.bus_id,name``; ``minor_number`` from
        /proc/driver/nvidia/gpus/<bus id>/information (None where that file is missing). Cached."""
        if self._inventory is None:
            rows = self._query("query-gpu", (("index", "index", _int), ("uuid", "uuid", _text),
                                             ("pci.bus_id", "pci_bus_id", _text), ("name", "name", _text)))
            for r in rows:
                r["minor_number"] = _sysfs_minor(r["pci_bus_id"], self._driver_root)
            self._inventory = sorted(rows, key=lambda r: r["index"])
        return self._inventory

    def memory(self, indices=None):
        """``--query-gpu=index,uuid,memory.used,memory.total,memory.reserved`` (MiB): one nvidia-smi run."""
        rows = self._query("query-gpu", SMI_MEMORY_QUERY)
        return [r for r in sorted(rows, key=lambda r: r["index"]) if indices is None or r["index"] in indices]

    def details(self, indices=None):
        """Every :data:`GPU_FIELDS` key from one ``--query-gpu`` run; the field behind each key is in
        :data:`SMI_GPU_QUERY` ("[N/A]", "[Not Supported]" and fields this driver rejects -> None)."""
        minors = {g["index"]: g["minor_number"] for g in self.inventory()}
        out = []
        for r in sorted(self._query("query-gpu", SMI_GPU_QUERY), key=lambda r: r["index"]):
            if indices is not None and r["index"] not in indices:
                continue
            r.pop("driver_version", None)
            r["minor_number"] = minors.get(r["index"])
            out.append({k: r.get(k) for k in GPU_FIELDS})
        return out

    def compute_processes(self, indices=None):
        """``--query-compute-apps=pid,used_memory,gpu_uuid,gpu_bus_id,process_name``; rows are matched to a
        GPU by UUID (bus id as fallback). ``process_name`` is what the driver reports (the executable path,
        or a setproctitle title)."""
        by_uuid = {g["uuid"]: g["index"] for g in self.inventory()}
        by_bus = {(g["pci_bus_id"] or "").lower(): g["index"] for g in self.inventory()}
        out = []
        for r in self._query("query-compute-apps", SMI_APPS_QUERY):
            idx = by_uuid.get(r["gpu_uuid"])
            if idx is None:
                idx = by_bus.get((r["gpu_bus_id"] or "").lower())
            if indices is not None and idx not in indices:
                continue
            out.append({"gpu_index": idx, "gpu_uuid": r["gpu_uuid"], "pid": r["pid"],
                        "used_memory_mib": r["used_memory_mib"], "process_name": r["process_name"]})
        return out


# --------------------------------------------------------------------------------------------------------
# choosing a backend

def open_backend(choice="auto", runner=None, smi_path="nvidia-smi", nvml=None):
    """Open and return ``(backend, fallback_reason)``.

    ``choice``: ``nvml`` (fails if nvidia-ml-py is missing: :class:`MissingLibraryError`, or nvmlInit fails),
    ``nvidia-smi``, or ``auto``: NVML when the library imports and nvmlInit succeeds, else nvidia-smi;
    ``fallback_reason`` then says why NVML was not used (None when it was). ``nvml`` injects a pynvml
    module (tests). Raises :class:`GpuError` subclasses with what to do.
    """
    if choice not in BACKEND_CHOICES:
        raise GpuError("backend must be one of %s, got %r" % (", ".join(BACKEND_CHOICES), choice))
    lib = nvml if nvml is not None else pynvml
    if choice == "nvml":
        if lib is None:
            raise MissingLibraryError("nvidia-ml-py", PYNVML_IMPORT_ERROR)
        return NvmlBackend(lib).open(), None
    reason = None
    if choice == "auto":
        if lib is None:
            reason = "nvidia-ml-py (pynvml) is not installed for this Python"
        else:
            try:
                return NvmlBackend(lib).open(), None
            except GpuError as exc:
                reason = exc.msg
    try:
        return SmiBackend(runner, smi_path).open(), reason
    except GpuError as exc:
        if reason:
            exc.msg = "No GPU backend works here. NVML: %s nvidia-smi: %s" % (reason, exc.msg)
        raise


def run_on_backend(module, work):
    """For an AnsibleModule: open the backend ``module.params["backend"]`` names, return
    ``work(backend, fallback_reason)`` and always close the backend again.

    nvidia-smi runs through ``module.run_command`` (argv list, ``LC_ALL=C``, undecodable bytes replaced).
    Failures end the module with ``fail_json``: a missing nvidia-ml-py with Ansible's standard
    ``missing_required_lib`` message, a :class:`GpuError` with its what-to-do message, rc, stdout, stderr.
    """
    from ansible.module_utils.basic import missing_required_lib

    def runner(argv):
        return module.run_command(argv, environ_update={"LC_ALL": "C", "LANG": "C"},
                                  errors="surrogate_then_replace")

    backend = None
    try:
        backend, reason = open_backend(module.params["backend"], runner=runner,
                                       smi_path=module.get_bin_path("nvidia-smi"))
        return work(backend, reason)
    except MissingLibraryError as exc:
        module.fail_json(msg=missing_required_lib(exc.library), exception=str(exc.exc or PYNVML_IMPORT_ERROR))
    except GpuError as exc:
        module.fail_json(**exc.fail_kwargs())
    finally:
        if backend is not None:
            backend.close()


# --------------------------------------------------------------------------------------------------------
# processes per GPU

def gpu_processes(backend, indices, scan_fds=True, proc_root="/proc", exclude_pids=None):
    """Processes on each GPU in ``indices``, merged from the backend's compute-process list and the
    ``/proc/*/fd`` scan, plus the holders of shared device files.

    Returns ``(per_gpu, device_holders)``: ``per_gpu`` is ``{index: [proc]}`` with proc = ``{"pid",
    "used_memory_mib" (MiB or None), "name", "cmdline" (str), "user", "source": ["nvml"|"nvidia-smi",
    "proc_fd"]}``; ``device_holders`` is ``[{"pid", "name", "cmdline", "user", "devices": [path],
    "gpu_indices": [int]}]`` for every process with any /dev/nvidia* open (``gpu_indices`` empty when it
    holds only nvidiactl / nvidia-uvm). The calling process is left out (it holds the devices itself when
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
            rows.append(row)
        per_gpu[idx] = rows
    device_holders = []
    for pid in sorted(holders):
        row = {"pid": pid}
        row.update(_describe(pid))
        row["devices"] = holders[pid]
        row["gpu_indices"] = holder_gpus[pid]
        device_holders.append(row)
    return per_gpu, device_holders


# --------------------------------------------------------------------------------------------------------
# waiting

def gpus_ready(memory_rows, max_used_mib, processes=None):
    """Indices (from ``memory_rows``) that still fail: used > max_used_mib, or, when ``processes`` (a
    compute-process list) is given, still running a compute process."""
    busy_pids = {}
    for p in processes or ():
        busy_pids.setdefault(p["gpu_index"], []).append(p["pid"])
    return [m["index"] for m in memory_rows
            if (m["memory_used_mib"] is None or m["memory_used_mib"] > max_used_mib) or busy_pids.get(m["index"])]


def wait_for_memory(backend, indices, max_used_mib, require_no_processes=False, poll_interval_ms=50,
                    timeout_s=120.0, clock=time.monotonic, sleep=time.sleep):
    """Poll ``backend`` until every GPU in ``indices`` has memory_used_mib <= max_used_mib (and, with
    ``require_no_processes``, no compute process), or ``timeout_s`` passes.

    One backend session serves all polls. Polls are spaced ``poll_interval_ms`` apart from their start, so
    a slow nvidia-smi call does not stretch the period. The compute-process list is read only once memory
    is below the limit (it costs a second nvidia-smi call). Returns ``{"ready": bool, "elapsed_ms": int,
    "polls": int, "memory": [memory row], "processes": [compute process] | None, "busy": [index]}``.
    """
    start = clock()
    deadline = start + float(timeout_s)
    period = max(poll_interval_ms, 1) / 1000.0
    next_poll = start
    polls = 0
    while True:
        polls += 1
        mem = backend.memory(indices)
        busy = gpus_ready(mem, max_used_mib)
        procs = None
        if not busy and require_no_processes:
            procs = backend.compute_processes(indices)
            busy = gpus_ready(mem, max_used_mib, procs)
        now = clock()
        if not busy or now >= deadline - 1e-6:  # tolerance: float sums of the period must not add a poll
            return {"ready": not busy, "elapsed_ms": int(round((now - start) * 1000)), "polls": polls,
                    "memory": mem, "processes": procs, "busy": busy}
        # Fixed cadence from each poll's start; a poll slower than the period is followed at once.
        next_poll = max(next_poll + period, now)
        sleep(max(0.0, min(next_poll, deadline) - now))
