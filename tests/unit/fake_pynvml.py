"""A stand-in for the ``pynvml`` module (nvidia-ml-py 13.x) built from a real H200 recording.

It models only the API surface gpufleet_gpu calls: nvmlInit/Shutdown, the NVMLError hierarchy (one subclass
per code, ``NVMLError(code)`` returning the subclass, ``.value``), the NVML_* constants, device handles and
getters. Values come from ``tests/data/recordings/h200x2-driver580/loaded-nvml.txt`` (copied from shared/recordings) (memory v1/v2,
compute processes, remapped rows, ECC, power limit, compute mode, retired pages NotSupported) and
``loaded-query-gpu-noheader-nounits.csv`` (uuid, bus id, temperature, power draw, persistence).

Tests change ``FakeNvml`` state (``gpus[i]``, ``init_error``, ``lost``) to model idle/loaded/lost GPUs.
"""
import ast
import os
import re
import types

# A copy of the files used here from shared/recordings/h200x2-driver580/ (recorded 2026-11-29 by
# RECORDED-WITH.sh on an H200 x2, driver 580.159.04), so the tests run from a clean clone.
RECORDINGS = os.environ.get("GPUFLEET_RECORDINGS") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "recordings", "h200x2-driver580")
HEALTH_RECORDINGS = os.path.join(os.path.dirname(RECORDINGS), "h200x1-health-driver580")
MIB = 1 << 20

# Codes as in nvidia-ml-py 13.615 (pynvml.py).
CODES = {
    "UNINITIALIZED": 1, "INVALID_ARGUMENT": 2, "NOT_SUPPORTED": 3, "NO_PERMISSION": 4,
    "ALREADY_INITIALIZED": 5, "NOT_FOUND": 6, "INSUFFICIENT_SIZE": 7, "DRIVER_NOT_LOADED": 9,
    "TIMEOUT": 10, "LIBRARY_NOT_FOUND": 12, "FUNCTION_NOT_FOUND": 13, "GPU_IS_LOST": 15,
    "LIB_RM_VERSION_MISMATCH": 18, "ARGUMENT_VERSION_MISMATCH": 25, "UNKNOWN": 999,
}
STRINGS = {3: "Not Supported", 9: "Driver Not Loaded", 12: "NVML Shared Library Not Found",
           13: "Function Not Found", 15: "GPU is lost", 1: "Uninitialized", 4: "Insufficient Permissions"}


def recording(name):
    """Text of one recorded file."""
    with open(os.path.join(RECORDINGS, name), encoding="utf-8") as fh:
        return fh.read()


def parse_loaded_nvml():
    """Per-GPU dicts from loaded-nvml.txt: v1/v2 memory (MiB), processes [(pid, MiB)], remapped rows, ..."""
    gpus = []
    header = {}
    for line in recording("loaded-nvml.txt").splitlines():
        m = re.match(r"^nvml (\S+) driver (\S+) cuda (\d+)$", line)
        if m:
            header = {"nvml": m.group(1), "driver": m.group(2), "cuda": int(m.group(3))}
            continue
        m = re.match(r"^(\d+) v1 MiB (\{.*?\}) v2 MiB (\{.*\})$", line)
        if m:
            gpus.append({"v1": ast.literal_eval(m.group(2)), "v2": ast.literal_eval(m.group(3))})
            continue
        m = re.match(r"^\s+(nvml\w+) (ERR (\w+) .*|.*)$", line)
        if m and gpus:
            if m.group(3):
                gpus[-1][m.group(1)] = ("ERR", m.group(3))
            else:
                gpus[-1][m.group(1)] = ast.literal_eval(m.group(2))
    return header, gpus


def parse_query_gpu(name="loaded-query-gpu-noheader-nounits.csv"):
    """Rows of a recorded ``--query-gpu`` CSV keyed by the field names of RECORDED-WITH.sh."""
    fields = re.search(r"^F=(\S+)$", recording("RECORDED-WITH.sh"), re.M).group(1).split(",")
    rows = []
    for line in recording(name).splitlines():
        if line.strip():
            rows.append(dict(zip(fields, [p.strip() for p in line.split(",")])))
    return rows


def parse_health_query_gpu():
    """The recorded single-H200 health row (health-query-gpu.csv, ``--format=csv`` with units) as
    ``{field: value without unit}``, keyed by the field names of its RECORDED-WITH.sh."""
    with open(os.path.join(HEALTH_RECORDINGS, "RECORDED-WITH.sh"), encoding="utf-8") as fh:
        fields = re.search(r"^F=(\S+)$", fh.read(), re.M).group(1).split(",")
    with open(os.path.join(HEALTH_RECORDINGS, "health-query-gpu.csv"), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    values = [v.strip() for v in lines[1].split(",")]
    return {f: re.sub(r" (W|MHz|MiB|%)$", "", v) for f, v in zip(fields, values)}


def parse_nvml_health():
    """``{name: value}`` of nvml-health.txt (``name = value`` lines; ``!`` errors as ("ERR", text))."""
    out = {}
    with open(os.path.join(HEALTH_RECORDINGS, "nvml-health.txt"), encoding="utf-8") as fh:
        for line in fh:
            m = re.match(r"^(\w+) (=|!) (.*)$", line.rstrip("\n"))
            if not m:
                continue
            if m.group(2) == "!":
                out[m.group(1)] = ("ERR", m.group(3))
                continue
            try:
                out[m.group(1)] = ast.literal_eval(m.group(3))
            except (ValueError, SyntaxError):
                out[m.group(1)] = m.group(3)  # text such as the VBIOS version
    return out


class _Struct(types.SimpleNamespace):
    pass


def make_fake_nvml(state="loaded"):
    """Return a fresh module-like fake. ``state``: "loaded" (recorded worker per GPU) or "idle"."""
    header, rec = parse_loaded_nvml()
    csv = parse_query_gpu()
    mod = types.ModuleType("pynvml")

    class NVMLError(Exception):
        _valClassMapping = {}

        def __new__(cls, value):
            if cls is NVMLError:
                cls = NVMLError._valClassMapping.get(value, cls)
            obj = Exception.__new__(cls)
            obj.value = value
            return obj

        def __init__(self, value):
            super().__init__(value)

        def __str__(self):
            return STRINGS.get(self.value, "NVML Error with code %d" % self.value)

    mod.NVMLError = NVMLError
    for name, code in CODES.items():
        setattr(mod, "NVML_ERROR_" + name, code)
        cls_name = "NVMLError_" + "".join(w.capitalize() for w in name.split("_"))

        def _new(cls, *args, _code=code):
            return NVMLError.__new__(cls, _code)

        sub = type(cls_name, (NVMLError,), {"__new__": _new})
        NVMLError._valClassMapping[code] = sub
        setattr(mod, cls_name, sub)
    mod.NVML_TEMPERATURE_GPU = 0
    mod.NVML_VOLATILE_ECC = 0
    mod.NVML_AGGREGATE_ECC = 1
    mod.NVML_CLOCK_SM = 1
    mod.NVML_FI_DEV_MEMORY_TEMP = 82
    mod.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    mod.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    mod.NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    mod.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    mod.nvmlMemory_v2 = 0x02000028

    fake = _Struct(initialized=0, init_error=None, lost=set(), unsupported=set(), no_v2=False,
                   init_calls=0, memory_calls=0, gpus=[], header=header, count_override=None,
                   handle_error=None, init_delay_s=0.0, memory_error=None)
    health = parse_nvml_health()
    mod.fake = fake
    for i, r in enumerate(rec):
        row = csv[i]
        v2 = dict(r["v2"])
        procs = [(pid, mib) for pid, mib in r["nvmlDeviceGetComputeRunningProcesses"]]
        if state == "idle":
            v2["used"] = 0
            v2["free"] = v2["total"] - v2["reserved"]
            procs = []
        fake.gpus.append({
            "uuid": row["uuid"], "name": row["name"], "bus": row["pci.bus_id"], "minor": i,
            # bytes: the recording is in MiB (floored); add 0.6 MiB so rounding is exercised.
            "total": v2["total"] * MIB, "reserved": v2["reserved"] * MIB + int(0.6 * MIB),
            "used": v2["used"] * MIB + (int(0.6 * MIB) if v2["used"] else 0),
            "procs": [(pid, mib * MIB) for pid, mib in procs],
            "temp": int(row["temperature.gpu"]), "power_mw": int(float(row["power.draw"]) * 1000),
            "limit_mw": r["nvmlDeviceGetPowerManagementLimit"], "compute_mode": r["nvmlDeviceGetComputeMode"],
            "persistence": 1 if row["persistence_mode"] == "Enabled" else 0,
            "ecc_unc": r["nvmlDeviceGetTotalEccErrors"], "ecc_corr": 0,
            "remapped": tuple(r["nvmlDeviceGetRemappedRows"]), "util": int(row["utilization.gpu"]),
            # health: the loaded 2-GPU recording where it has the fact, else the 1-GPU health recording
            "serial": str(int(health["serial"]) + i), "vbios": health["vbios"],
            "pstate": int(row["pstate"][1:]), "clock_sm": int(row["clocks.sm"]),
            "clock_max_sm": int(parse_health_query_gpu()["clocks.max.sm"]),
            "reasons": r["nvmlDeviceGetCurrentClocksEventReasons"], "mem_temp": health["mem_temp_field"],
            "pcie_gen": r["nvmlDeviceGetCurrPcieLinkGeneration"], "pcie_gen_max": health["pcie_gen_max"],
            "pcie_width": r["nvmlDeviceGetCurrPcieLinkWidth"], "pcie_width_max": health["pcie_width_max"],
            "mig": list(health["mig_mode"]), "ecc_mode": [1, 1], "ecc_corr_agg": 0,
            "ecc_unc_agg": health["ecc_unc_agg"], "nvlinks": None,
        })

    def _check(handle=None, field=None):
        if not fake.initialized:
            raise NVMLError(CODES["UNINITIALIZED"])
        if handle is not None and handle in fake.lost:
            raise NVMLError(CODES["GPU_IS_LOST"])
        if field is not None and (field in fake.unsupported or (handle, field) in fake.unsupported):
            raise NVMLError(CODES["NOT_SUPPORTED"])

    def nvmlInit():
        fake.init_calls += 1
        if fake.init_delay_s:
            import time
            time.sleep(fake.init_delay_s)
        if fake.init_error is not None:
            raise NVMLError(CODES[fake.init_error])
        fake.initialized += 1

    def nvmlShutdown():
        _check()
        fake.initialized -= 1

    def nvmlSystemGetDriverVersion():
        _check()
        return header["driver"]

    def nvmlSystemGetCudaDriverVersion_v2():
        _check()
        return header["cuda"]

    def nvmlDeviceGetCount():
        _check()
        return len(fake.gpus) if fake.count_override is None else fake.count_override

    def nvmlDeviceGetHandleByIndex(i):
        _check()
        if fake.handle_error and fake.handle_error[0] == i:
            raise NVMLError(CODES[fake.handle_error[1]])
        if not 0 <= i < len(fake.gpus):
            raise NVMLError(CODES["INVALID_ARGUMENT"])
        return i

    def g(h, field=None):
        _check(h, field)
        return fake.gpus[h]

    mod.nvmlDeviceGetUUID = lambda h: g(h)["uuid"]
    mod.nvmlDeviceGetName = lambda h: g(h, "name")["name"]
    mod.nvmlDeviceGetPciInfo = lambda h: _Struct(busId=g(h, "pci")["bus"])
    mod.nvmlDeviceGetMinorNumber = lambda h: g(h, "minor")["minor"]

    def nvmlDeviceGetMemoryInfo(h, version=None):
        fake.memory_calls += 1
        d = g(h, "memory")
        if version is None:
            used = d["used"] + d["reserved"]
            return _Struct(total=d["total"], used=used, free=d["total"] - used)
        if fake.no_v2:
            raise NVMLError(CODES["FUNCTION_NOT_FOUND"])
        if version != mod.nvmlMemory_v2:
            raise NVMLError(CODES["ARGUMENT_VERSION_MISMATCH"])
        return _Struct(version=version, total=d["total"], reserved=d["reserved"], used=d["used"],
                       free=d["total"] - d["reserved"] - d["used"])

    mod.nvmlDeviceGetMemoryInfo = nvmlDeviceGetMemoryInfo
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        _Struct(pid=pid, usedGpuMemory=b, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        for pid, b in g(h, "procs")["procs"]]
    mod.nvmlDeviceGetUtilizationRates = lambda h: _Struct(gpu=g(h, "util")["util"], memory=0)
    mod.nvmlDeviceGetTemperature = lambda h, sensor: g(h, "temp")["temp"]
    mod.nvmlDeviceGetPowerUsage = lambda h: g(h, "power")["power_mw"]
    mod.nvmlDeviceGetPowerManagementLimit = lambda h: g(h, "limit")["limit_mw"]
    mod.nvmlDeviceGetPersistenceMode = lambda h: g(h, "persistence")["persistence"]
    mod.nvmlDeviceGetComputeMode = lambda h: g(h, "compute_mode")["compute_mode"]
    def nvmlDeviceGetTotalEccErrors(h, etype, ctype):
        d = g(h, "ecc")
        if ctype == mod.NVML_AGGREGATE_ECC:
            return d["ecc_corr_agg"] if etype == 0 else d["ecc_unc_agg"]
        return d["ecc_corr"] if etype == 0 else d["ecc_unc"]

    mod.nvmlDeviceGetTotalEccErrors = nvmlDeviceGetTotalEccErrors
    mod.nvmlDeviceGetSerial = lambda h: g(h, "serial")["serial"]
    mod.nvmlDeviceGetVbiosVersion = lambda h: g(h, "vbios")["vbios"]
    mod.nvmlDeviceGetPerformanceState = lambda h: g(h, "pstate")["pstate"]
    mod.nvmlDeviceGetClockInfo = lambda h, clock: g(h, "clocks")["clock_sm"]
    mod.nvmlDeviceGetMaxClockInfo = lambda h, clock: g(h, "clocks")["clock_max_sm"]
    mod.nvmlDeviceGetCurrentClocksEventReasons = lambda h: g(h, "reasons")["reasons"]
    mod.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: g(h, "pcie")["pcie_gen"]
    mod.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: g(h, "pcie")["pcie_gen_max"]
    mod.nvmlDeviceGetCurrPcieLinkWidth = lambda h: g(h, "pcie")["pcie_width"]
    mod.nvmlDeviceGetMaxPcieLinkWidth = lambda h: g(h, "pcie")["pcie_width_max"]
    mod.nvmlDeviceGetMigMode = lambda h: list(g(h, "mig")["mig"])
    mod.nvmlDeviceGetEccMode = lambda h: list(g(h, "ecc_mode")["ecc_mode"])

    def nvmlDeviceGetFieldValues(h, ids):
        d = g(h, "field_values")
        return [_Struct(fieldId=i, nvmlReturn=0 if i == 82 else CODES["NOT_SUPPORTED"],
                        value=_Struct(uiVal=d["mem_temp"] if i == 82 else 0)) for i in ids]

    mod.nvmlDeviceGetFieldValues = nvmlDeviceGetFieldValues

    def nvmlDeviceGetRetiredPagesPendingStatus(h):
        _check(h)
        raise NVMLError(CODES["NOT_SUPPORTED"])  # H200: nvidia-smi retired_pages.pending [N/A]

    mod.nvmlDeviceGetRetiredPagesPendingStatus = nvmlDeviceGetRetiredPagesPendingStatus

    def nvmlDeviceGetNvLinkState(h, link):
        links = g(h)["nvlinks"]
        if links is None:  # recorded single-GPU H200: NotSupported on link 0
            raise NVMLError(CODES["NOT_SUPPORTED"])
        if link >= len(links):
            raise NVMLError(CODES["INVALID_ARGUMENT"])
        return links[link][0]

    def nvmlDeviceGetNvLinkErrorCounter(h, link, counter):
        return g(h)["nvlinks"][link][1][counter]

    mod.nvmlDeviceGetNvLinkState = nvmlDeviceGetNvLinkState
    mod.nvmlDeviceGetNvLinkErrorCounter = nvmlDeviceGetNvLinkErrorCounter
    mod.nvmlDeviceGetRemappedRows = lambda h: g(h, "remapped")["remapped"]

    def nvmlDeviceGetRetiredPages(h, cause):
        _check(h)
        raise NVMLError(CODES["NOT_SUPPORTED"])  # H200: loaded-nvml.txt

    mod.nvmlDeviceGetRetiredPages = nvmlDeviceGetRetiredPages
    for fn in (nvmlInit, nvmlShutdown, nvmlSystemGetDriverVersion, nvmlSystemGetCudaDriverVersion_v2,
               nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex):
        setattr(mod, fn.__name__, fn)

    def nvmlSystemGetCudaDriverVersion():
        _check()
        return header["cuda"]

    mod.nvmlSystemGetCudaDriverVersion = nvmlSystemGetCudaDriverVersion
    return mod


# ------------------------------------------------------------------------------------------------------
# nvidia-smi replayed from the recordings

DRIVER_NOT_LOADED_TEXT = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                          "Make sure that the latest NVIDIA driver is installed and running.\n\n")
GPU_LOST_TEXT = ("Unable to determine the device handle for GPU0000:00:07.0: GPU is lost.  "
                 "Reboot the system to recover this GPU\n")


class RecordedSmi:
    """A ``runner(argv)`` that answers nvidia-smi queries with recorded values.

    ``--query-gpu`` answers any subset of the fields of RECORDED-WITH.sh in the order asked, from
    ``<state>-query-gpu-noheader-nounits.csv``; ``--query-compute-apps`` from
    ``loaded-compute-apps-noheader-nounits.csv`` (idle: empty); no switch prints ``<state>-table.txt``.
    ``invalid_fields`` are rejected like error-bad-field.txt (rc 2); ``fail`` = (rc, stdout) answers every call;
    ``apps_extra`` appends raw compute-apps lines; ``states`` is a list of states consumed per --query-gpu
    call (the last one repeats), to model memory being released over time.
    """

    def __init__(self, state="loaded", invalid_fields=(), fail=None, apps_extra=(), states=None):
        self.state = state
        self.states = list(states or [])
        self.invalid_fields = set(invalid_fields)
        self.fail = fail
        self.apps_extra = list(apps_extra)
        self.calls = []
        self._apps_fields = ["pid", "process_name", "used_memory", "gpu_uuid", "gpu_bus_id"]
        self.timeouts = []
        self.overrides = {}  # field -> raw value printed for every GPU (e.g. {"memory.used": "[N/A]"})
        self.nvlink = {"-s": "", "-e": ""}  # recorded single-GPU H200: both print nothing, rc 0

    def _rows(self):
        if self.states:
            self.state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        rows = parse_query_gpu("%s-query-gpu-noheader-nounits.csv" % self.state)
        health = parse_health_query_gpu()
        for i, row in enumerate(rows):
            for field, value in health.items():
                row.setdefault(field, value)
            row["serial"] = str(int(health["serial"]) + i)
            row.setdefault("retired_pages.single_bit_ecc.count", "[N/A]")
            row.setdefault("retired_pages.double_bit.count", "[N/A]")
            row.update(self.overrides)
        return rows

    def __call__(self, argv, timeout_s=None):
        self.calls.append(list(argv))
        self.timeouts.append(timeout_s)
        if self.fail is not None:
            rc, out = self.fail
            return rc, out, ""
        args = argv[1:]
        if not args:
            return 0, recording("%s-table.txt" % self.state), ""
        if args[0] == "nvlink":
            return 0, self.nvlink[args[1]], ""
        switch, _, fields = args[0].partition("=")
        fields = fields.split(",")
        for f in fields:
            if f in self.invalid_fields:
                return 2, recording("error-bad-field.txt").split("rc=")[0].replace("bogus.field", f), ""
        if switch == "--query-gpu":
            lines = [", ".join(row[f] for f in fields) for row in self._rows()]
            return 0, "".join(line + "\n" for line in lines), ""
        if switch == "--query-compute-apps":
            out = []
            if self.state == "loaded":
                for line in recording("loaded-compute-apps-noheader-nounits.csv").splitlines():
                    row = dict(zip(self._apps_fields, [p.strip() for p in line.split(",")]))
                    out.append(", ".join(row[f] for f in fields))
            out.extend(self.apps_extra)
            return 0, "".join(line + "\n" for line in out), ""
        return 2, "Unknown switch %s\n" % switch, ""
