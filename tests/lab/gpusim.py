"""Simulated NVIDIA H200 GPUs for the lab: identities, memory state and the ``nvidia-smi`` front end.

Stdlib only (it runs under every host's interpreter and the simulated ``nvidia-smi`` starts once per call).
A call should cost about what the real nvidia-smi costs (median 30.8-33.5 ms on H200, docs/benchmarks.md),
so the lab measures gpufleet and not this simulator (issue 14): the front end runs ``python -IS`` and the
query paths import nothing beyond os, sys, time and the C halves of json and sha256 (``json`` and ``re``
pull in enum, functools and collections, ``socket`` and ``hashlib`` more: together ~3x the interpreter's own
start). ``json``, ``re`` and ``socket`` are imported where the daemon, the holders and ``-q -x`` need them.

Model (facts from ../../shared/recordings/h200x2-driver580/, an H200 with driver 580.159.04, CUDA 13.0):
- 8 GPUs per host, 143771 MiB each, 616 MiB ``memory.reserved``; an idle GPU reports ``memory.used`` 0 MiB
  and ``memory.free`` = total - reserved - used.
- Memory is held by processes registered with the host's ``gpusimd`` (see ``host_init.py``) over the
  abstract unix socket ``GPUSIMD_SOCKET`` (abstract names are per network namespace, so each lab host has
  its own). A holder connects, sends one JSON line ``{"op": "hold", "gpu": N, "mib": M}`` and keeps the
  connection open; when it dies the daemon sees EOF and keeps the memory for ``release_delay_ms``. A hold that
  does not fit beside what is held or not yet released (total - reserved) is refused with CUDA's "out of
  memory", as on a real GPU; the stand-in's worker then dies and the server exits 1.
- ``gpusimd`` writes ``<host dir>/gpu/state.json`` atomically; this module only reads it.

``nvidia-smi`` output forms follow the recordings byte for byte (values aside): ``--query-gpu``,
``--query-compute-apps`` with ``--format=csv[,noheader][,nounits]``, ``-i``, ``-L``, the default table,
the error texts and exit codes (bad field: rc 2; bad index: rc 6). Health fields follow
recordings/h200x1-health-driver580 (an idle H200: ``[N/A]`` retired pages, ``0x...01`` idle clock reason).

GPU and driver faults come from ``<host dir>/faults.json`` (``lab.py fault``), read on every call; see
:data:`SMI_FAULT_KNOBS` and tests/lab/README.md. The simulated kernel log for Xid lines is
``<host dir>/kmsg`` in /dev/kmsg record format (:func:`sync_kmsg`); lab hosts share the real machine's
kernel, so modules are pointed at this file (``kmsg_path``) instead of /dev/kmsg.
"""
import os
import sys
import time

GPU_COUNT = 8
GPU_NAME = "NVIDIA H200"
MEMORY_TOTAL_MIB = 143771
MEMORY_RESERVED_MIB = 616
DRIVER_VERSION = "580.159.04"  # recordings/h200x2-driver580/README.md
CUDA_VERSION = "13.0"
POWER_LIMIT_W = 700.0
#: Least age of one simulated nvidia-smi process, ms (:func:`process_age_s`). The real call's median on H200
#: is 30.8-33.5 ms as a Python caller sees it (docs/benchmarks.md "Costs of one call"), fork, exec and reap
#: included; those happen outside the child and cost a few ms on an idle machine, so the child itself lives
#: at least 28 ms. Made up by sleeping: it costs the machine no CPU, as the real call mostly waits on the
#: driver. A busy machine makes the call longer anyway (the interpreter's own start is ~20 ms there). Knob
#: ``smi_cost_ms`` (0: as fast as the simulator can).
SMI_COST_MS = 28.0
# Per-context overhead seen in loaded-query-gpu.csv (31339 MiB used for a 31330 MiB process).
CONTEXT_OVERHEAD_MIB = 9
GPUSIMD_SOCKET = "\0gpufleet-lab-gpusimd"
HOST_DIR_ENV = "GPUFLEET_LAB_HOST_DIR"

# Real H200 recordings (a copy of shared/recordings/h200x2-driver580, one copy for all tests).
_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "recordings",
                     "h200x2-driver580")

NA = "[N/A]"
NOT_SUPPORTED = "[Not Supported]"
NVLINKS_PER_GPU = 18  # H200 SXM: 18 NVLink 4 links to the NVSwitches of an HGX board
NVLINK_SPEED = "26.562 GB/s"

# Texts real drivers print (nvidia-smi writes them to stdout), by exit code. FIELD-NOTES "Seen 2026-11-30";
# rc 15 as fake_pynvml.GPU_LOST_TEXT; rc 18 as driver 5xx prints it (the NVML library version line after).
SMI_FAULT_TEXTS = {
    6: "No devices were found\n",
    9: ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n\n"),
    15: "Unable to determine the device handle for GPU%s: GPU is lost.  Reboot the system to recover this GPU\n",
    18: "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: %s\n" % DRIVER_VERSION[:7],
    255: "Unable to determine the device handle for GPU %s: Unknown Error\n",
}
#: Faults the simulated nvidia-smi honours (the rest of lab.FAULT_KNOBS concern gpusimd and the stand-in).
SMI_FAULT_KNOBS = ("smi_rc", "smi_hang_s", "smi_cost_ms", "smi_field_values", "smi_field_values_when_free", "ecc_errors",
                   "remap_pending", "throttle", "mig_on", "nvlink_down", "gpus_visible", "xid")
FAULT_GPU = 1  # the GPU that smi_rc 15/255, ecc_errors, remap_pending, throttle, nvlink_down and xid hit
CLOCK_REASON_BITS = {"gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4,
                     "hw_slowdown": 0x8, "sync_boost": 0x10, "sw_thermal_slowdown": 0x20,
                     "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80, "display_clock_setting": 0x100}
XID_TEXTS = {79: "GPU has fallen off the bus.", 48: "An uncorrectable double bit error (DBE) has been detected on GPU "
             "in the framebuffer at partition 0, subpartition 0.", 94: "Contained: SM (0x1). RST: No, D-RST: No",
             95: "Uncontained: FBHUB. RST: Yes, D-RST: No", 63: "Row Remapper: New row marked for remapping, "
             "reset gpu to activate.", 13: "Graphics Exception: ESR 0x405848=0x0"}


class SmiError(Exception):
    """An nvidia-smi failure: ``text`` printed on stdout, process exits with ``rc``."""

    def __init__(self, text, rc):
        super().__init__(text)
        self.text = text
        self.rc = rc


# ---------------------------------------------------------------------------------------------------
# GPU identities and state
# ---------------------------------------------------------------------------------------------------
def gpu_identities(host_name):
    """List of dicts (index, uuid, pci_bus_id, serial) for a host: stable per host name, distinct."""
    try:  # the builtin sha256 (no OpenSSL start-up); same digest as hashlib's
        from _sha256 import sha256  # Python <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256  # Python >= 3.12
        except ImportError:
            from hashlib import sha256
    out = []
    for i in range(GPU_COUNT):
        h = sha256(("%s/%d" % (host_name, i)).encode()).hexdigest()
        uuid = "GPU-%s-%s-%s-%s-%s" % (h[0:8], h[8:12], h[12:16], h[16:20], h[20:32])
        # H200 HGX boards sit on separate PCIe buses; keep the recorded "domain:bus:device.function" form.
        bus = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB][i]
        out.append({
            "index": i,
            "uuid": uuid,
            "pci_bus_id": "00000000:%02X:00.0" % bus,
            "serial": str(1653824016000 + int(h[32:38], 16) % 1000),
            "minor_number": i,
        })
    return out


class _ScanContext:
    """What ``_json.make_scanner`` reads from a JSONDecoder: json.loads' defaults."""
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__
    memo = None


def loads(text):
    """``json.loads`` for a JSON document, through the C scanner json itself uses (``_json``) so that a
    simulated nvidia-smi call does not import json (and with it re): see the module docstring."""
    try:
        from _json import make_scanner
    except ImportError:  # an interpreter without the C accelerator
        import json
        return json.loads(text)
    start = len(text) - len(text.lstrip(" \t\n\r"))
    try:
        value, end = make_scanner(_ScanContext())(text, start)
    except StopIteration as exc:
        raise ValueError("not a JSON document (at character %s)" % exc.value)
    if text[end:].strip(" \t\n\r"):
        raise ValueError("extra data after the JSON document (at character %d)" % end)
    return value


def read_json(path, default):
    try:
        with open(path) as fh:
            return loads(fh.read())
    except (OSError, ValueError):
        return default


def write_json_atomic(path, data):
    import json
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def process_name(pid):
    """What NVML reports as the process name: argv[0] of /proc/<pid>/cmdline (setproctitle changes it)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    first = raw.split(b"\0", 1)[0].decode(errors="replace")
    if " " in first and b"\0" not in raw.rstrip(b"\0"):
        # setproctitle writes the whole title into argv[0]; NVML shows it whole too.
        return first
    return first


def gpu_snapshot(host_dir, now=None):
    """Current view of every GPU of a host.

    Returns a list of GPU_COUNT dicts: identity fields plus ``used_mib`` (held memory incl. memory kept
    for ``release_delay_ms`` after a holder died), ``apps`` (live holders: pid, name, used_mib), ``util``.
    """
    now = time.time() if now is None else now
    host_name = os.path.basename(os.path.normpath(host_dir))
    state = read_json(os.path.join(host_dir, "gpu", "state.json"), {})
    gpus = gpu_identities(host_name)
    allocs = state.get("allocs", [])
    # pids are those of the host's PID namespace: /proc only resolves them from inside the host
    inside = os.path.normpath(find_host_dir() or "") == os.path.normpath(host_dir)
    utils = state.get("util", {})
    for g in gpus:
        g["used_mib"] = 0
        g["apps"] = []
        g["util"] = int(utils.get(str(g["index"]), 0))
    for a in allocs:
        if not 0 <= a.get("gpu", -1) < GPU_COUNT:
            continue
        rel = a.get("released_at")
        if rel == "never" or rel is None or (isinstance(rel, (int, float)) and rel > now):
            g = gpus[a["gpu"]]
            g["used_mib"] += int(a["mib"]) + CONTEXT_OVERHEAD_MIB
            # released_at is None exactly while the holder's connection to gpusimd is open (it is alive); a
            # hidden holder (knob hidden_holder: a process of another PID namespace) is never listed
            if rel is None and not a.get("hidden"):
                name = (inside and process_name(a["pid"])) or a.get("name") or "python3"
                g["apps"].append({"pid": a["pid"], "name": name, "used_mib": int(a["mib"])})
    for g in gpus:
        g["used_mib"] = min(g["used_mib"], MEMORY_TOTAL_MIB - MEMORY_RESERVED_MIB)
        g["apps"].sort(key=lambda x: x["pid"])
    return gpus


# ---------------------------------------------------------------------------------------------------
# Holder client (used by the stand-in workers and tests)
# ---------------------------------------------------------------------------------------------------
def hold(gpu, mib, name=None, pid=None, hidden=False):
    """Register ``mib`` MiB on GPU ``gpu`` for this process; returns the socket (keep it open to hold).
    ``hidden``: the memory counts, but ``--query-compute-apps`` never lists the holder (knob hidden_holder).

    Raises OSError when the host has no gpusimd (not inside a lab host's network namespace).
    """
    import json
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(GPUSIMD_SOCKET)
    msg = {"op": "hold", "gpu": int(gpu), "mib": int(mib)}
    if name:
        msg["name"] = name
    if pid:
        msg["pid"] = int(pid)
    if hidden:
        msg["hidden"] = True
    s.sendall((json.dumps(msg) + "\n").encode())
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            raise OSError("gpusimd closed the connection")
        reply += chunk
    data = json.loads(reply)
    if not data.get("ok"):
        raise OSError("gpusimd refused: %s" % data.get("error"))
    return s


def report_util(sock, gpus, pct):
    """Tell gpusimd the utilization (%) of ``gpus`` over an open connection (load from /generate)."""
    import json
    sock.sendall((json.dumps({"op": "util", "gpus": list(gpus), "pct": int(pct)}) + "\n").encode())


# ---------------------------------------------------------------------------------------------------
# Field table for --query-gpu / --query-compute-apps
# ---------------------------------------------------------------------------------------------------
def _help_fields(fname):
    """{name or alias: canonical (first) name} parsed from the recorded --help-query-* text: the lines
    ``"name"`` or ``"name" or "alias"`` (string operations, not re: see the module docstring)."""
    names = {}
    with open(os.path.join(_DATA, fname)) as fh:
        for line in fh:
            if line[:1] != '"':
                continue
            parts = line.rstrip().split('"')
            first = parts[1]
            if not first or not first[0].isascii() or not (first[0].isalpha() or first[0] == "_"):
                continue
            if len(parts) == 3 and parts[2] == "":
                names[first] = first
            elif len(parts) == 5 and parts[2] == " or " and parts[3] and parts[4] == "":
                names[first] = first
                names[parts[3]] = first
    return names


# canonical name -> unit shown in the header and after values (recordings: idle-query-gpu.csv)
_UNITS = {
    "memory.total": "MiB", "memory.reserved": "MiB", "memory.used": "MiB", "memory.free": "MiB",
    "utilization.gpu": "%", "utilization.memory": "%", "utilization.encoder": "%",
    "utilization.decoder": "%", "utilization.jpeg": "%", "utilization.ofa": "%",
    "fan.speed": "%",
    "power.draw": "W", "power.draw.average": "W", "power.draw.instant": "W", "power.limit": "W",
    "enforced.power.limit": "W", "power.default_limit": "W", "power.min_limit": "W",
    "power.max_limit": "W",
    "protected_memory.total": "MiB", "protected_memory.used": "MiB", "protected_memory.free": "MiB",
}
_APP_UNITS = {"used_gpu_memory": "MiB"}


def _unit_for(name):
    if name in _UNITS:
        return _UNITS[name]
    if name.startswith("clocks.") and not name.startswith("clocks_"):
        return "MHz"
    return None


def _gpu_value(name, g, host_dir, now):
    """(value, unit or None) for one canonical field of one GPU snapshot."""
    fixed = g.get("_fixed")
    if fixed is None:  # built once per GPU and call: a details query asks 39 fields of 8 GPUs
        fixed = g["_fixed"] = _gpu_fixed(g, now)
    faults = g.get("faults") or {}
    hit = g["index"] == FAULT_GPU
    overrides = faults.get("smi_field_values") or {}
    # smi_field_values_when_free: only GPUs with no memory in use read the overrides (a field that turns
    # unreadable once the stop released the server's memory, after preflight read it fine).
    if name in overrides and (not faults.get("smi_field_values_when_free") or g["used_mib"] == 0):
        return overrides[name], None
    if name.startswith("ecc.errors."):
        ecc = faults.get("ecc_errors") if hit else None
        if ecc and name.endswith(".total") and (".volatile." in name or ".aggregate." in name):
            return str(int(ecc)), None
        return "0", None
    if name.startswith("clocks_event_reasons.") and name not in fixed:
        return "Not Active", None
    if name.startswith("clocks_event_reasons_counters."):
        return "0", None
    value = fixed.get(name, NA)
    return value, _unit_for(name)


def _gpu_fixed(g, now):
    """{canonical field: value} of one GPU snapshot, faults applied (but smi_field_values, ecc_errors)."""
    used = g["used_mib"]
    busy = used > 0
    util = g["util"]
    temp = 35 + g["index"] % 3 + (2 if busy else 0) + util // 5
    power = 78.4 + 0.55 * g["index"] + (0.0014 * used) + 4.5 * util
    power = min(power, POWER_LIMIT_W)
    ts = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + ".%03d" % int((now % 1) * 1000)
    fixed = {
        "timestamp": ts,
        "driver_version": DRIVER_VERSION,
        "count": str(GPU_COUNT),
        "name": GPU_NAME,
        "serial": g["serial"],
        "uuid": g["uuid"],
        "pci.bus_id": g["pci_bus_id"],
        "pci.domain": "0x0000",
        "pci.bus": "0x" + g["pci_bus_id"][9:11],
        "pci.device": "0x00",
        "pci.baseClass": "0x3",
        "pci.subClass": "0x2",
        "pci.device_id": "0x233510DE",
        "pci.sub_device_id": "0x18BF10DE",
        "pcie.link.gen.current": "5", "pcie.link.gen.gpucurrent": "5", "pcie.link.gen.max": "5",
        "pcie.link.gen.gpumax": "5", "pcie.link.gen.hostmax": "5",
        "pcie.link.width.current": "16", "pcie.link.width.max": "16",
        "index": str(g["index"]),
        "display_attached": "Yes", "display_active": "Disabled",
        "persistence_mode": "Enabled", "addressing_mode": "None",
        "accounting.mode": "Disabled", "accounting.buffer_size": "4000",
        "driver_model.current": NA, "driver_model.pending": NA,
        "vbios_version": "96.00.A5.00.1A",
        "inforom.img": "G520.0282.02.02", "inforom.oem": "2.1", "inforom.ecc": "7.16", "inforom.pwr": NA,
        "gpu_recovery_action": "None",
        "gom.current": NA, "gom.pending": NA,
        "fan.speed": NA,
        "pstate": "P0",
        "clocks_event_reasons.supported": "0x00000000000001FF",
        "clocks_event_reasons.active": "0x0000000000000000" if busy else "0x0000000000000001",
        "clocks_event_reasons.gpu_idle": "Not Active" if busy else "Active",
        "memory.total": str(MEMORY_TOTAL_MIB),
        "memory.reserved": str(MEMORY_RESERVED_MIB),
        "memory.used": str(used),
        "memory.free": str(MEMORY_TOTAL_MIB - MEMORY_RESERVED_MIB - used),
        "compute_mode": "Default",
        "compute_cap": "9.0",
        "utilization.gpu": str(util),
        "utilization.memory": str(util // 3),
        "utilization.encoder": "0", "utilization.decoder": "0", "utilization.jpeg": "0",
        "utilization.ofa": "0",
        "ecc.mode.current": "Enabled", "ecc.mode.pending": "Enabled",
        # H200: retired pages are not supported (NVML NotSupported; nvidia-smi prints [N/A]).
        "retired_pages.single_bit_ecc.count": NA, "retired_pages.double_bit.count": NA,
        "retired_pages.pending": NA,
        "remapped_rows.correctable": "0", "remapped_rows.uncorrectable": "0",
        "remapped_rows.pending": "No", "remapped_rows.failure": "No",
        "temperature.gpu": str(temp), "temperature.gpu.tlimit": str(87 - temp), "temperature.memory": str(temp + 8),
        "power.management": "Enabled",
        "power.draw": "%.2f" % power, "power.draw.average": "%.2f" % power,
        "power.draw.instant": "%.2f" % power,
        "power.limit": "%.2f" % POWER_LIMIT_W, "enforced.power.limit": "%.2f" % POWER_LIMIT_W,
        "power.default_limit": "%.2f" % POWER_LIMIT_W, "power.min_limit": "200.00",
        "power.max_limit": "%.2f" % POWER_LIMIT_W,
        "clocks.current.graphics": "1980" if busy else "345", "clocks.current.sm": "1980" if busy else "345",
        "clocks.current.memory": "3201", "clocks.current.video": "1545" if busy else "765",
        "clocks.applications.graphics": "1980", "clocks.applications.memory": "3201",
        "clocks.default_applications.graphics": "1980", "clocks.default_applications.memory": "3201",
        "clocks.max.graphics": "1980", "clocks.max.sm": "1980", "clocks.max.memory": "3201",
        "mig.mode.current": "Disabled", "mig.mode.pending": "Disabled",
        "gsp.mode.current": "Enabled", "gsp.mode.default": "Enabled",
        "c2c.mode": "Disabled",
        # recordings/h200x1-health-driver580: no NVSwitch fabric seen from one GPU -> "N/A" without brackets
        "fabric.state": "N/A", "fabric.status": "N/A",
        "hostname": os.uname().nodename,  # what socket.gethostname() returns, without importing socket
    }
    faults = g.get("faults") or {}
    hit = g["index"] == FAULT_GPU
    if faults.get("mig_on"):
        fixed["mig.mode.current"] = fixed["mig.mode.pending"] = "Enabled"
    if hit and faults.get("remap_pending"):
        fixed["remapped_rows.pending"] = "Yes"
        fixed["remapped_rows.uncorrectable"] = "1"
    reasons = faults.get("throttle") if hit else None
    if reasons:
        names = [reasons] if isinstance(reasons, str) else list(reasons)
        mask = int(fixed["clocks_event_reasons.active"], 16) & ~0x1  # a throttled GPU is not idle
        for reason in names:
            mask |= CLOCK_REASON_BITS.get(reason, 0)
        fixed["clocks_event_reasons.active"] = "0x%016X" % mask
        fixed["clocks_event_reasons.gpu_idle"] = "Not Active"
        for reason in names:
            fixed["clocks_event_reasons." + reason] = "Active"
    return fixed


def _app_value(name, app, g, now):
    fixed = {
        "timestamp": time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + ".%03d" % int((now % 1) * 1000),
        "gpu_name": GPU_NAME,
        "gpu_bus_id": g["pci_bus_id"],
        "gpu_serial": g["serial"],
        "gpu_uuid": g["uuid"],
        "pid": str(app["pid"]),
        "process_name": app["name"],
        "used_gpu_memory": str(app["used_mib"]),
    }
    overrides = (g.get("faults") or {}).get("smi_field_values") or {}
    if name in overrides:  # smi_field_values names compute-apps fields too (canonical: used_gpu_memory)
        return overrides[name], None
    return fixed.get(name, NA), _APP_UNITS.get(name)


def _fmt(value, unit, units):
    if unit and units and value not in (NA, NOT_SUPPORTED):
        return "%s %s" % (value, unit)
    return value


def _parse_format(spec):
    opts = [o.strip() for o in spec.split(",") if o.strip()]
    if not opts or opts[0] != "csv" or any(o not in ("csv", "noheader", "nounits") for o in opts):
        raise SmiError('"%s" is not a valid format.\n\n' % spec, 2)
    return "noheader" not in opts, "nounits" not in opts


def _resolve_fields(spec, table):
    fields = []
    for raw in spec.split(","):
        f = raw.strip()
        if f not in table:
            raise SmiError('Field "%s" is not a valid field to query.\n\n' % f, 2)
        fields.append(table[f])
    return fields


def _select(gpus, ids):
    if ids is None:
        return gpus
    chosen = []
    for ident in ids.split(","):
        ident = ident.strip()
        match = [g for g in gpus if (ident.isdigit() and int(ident) == g["index"])
                 or ident == g["uuid"] or ident.upper() == g["pci_bus_id"]]
        if not match:
            raise SmiError("No devices were found\n", 6)
        chosen.extend(m for m in match if m not in chosen)
    return chosen


def query_gpu(gpus, fields_spec, format_spec, host_dir, now, bad_gpu=None):
    """``--query-gpu``; ``bad_gpu`` (smi_rc 255) replaces that GPU's row with the device-handle error line."""
    header, units = _parse_format(format_spec)
    fields = _resolve_fields(fields_spec, _help_fields("help-query-gpu.txt"))
    lines = []
    if header:
        lines.append(", ".join(f + (" [%s]" % _unit_for(f) if _unit_for(f) else "") for f in fields))
    for g in gpus:
        if bad_gpu is not None and g["index"] == bad_gpu:
            lines.append((SMI_FAULT_TEXTS[255] % g["pci_bus_id"][4:]).rstrip("\n"))
            continue
        lines.append(", ".join(_fmt(*_gpu_value(f, g, host_dir, now), units) for f in fields))
    return "".join(line + "\n" for line in lines)


def nvlink(gpus, flag, faults):
    """``nvidia-smi nvlink -s`` (per link speed or ``<inactive>``) / ``-e`` (error counters), 18 links per GPU.

    Layout as NVIDIA's documentation shows it (a GPU header, then tab-indented link lines). Not from a
    recording: the recorded single-GPU H200 has no NVLink peers and prints nothing (rc 0), which
    ``faults.gpus_visible=1``-style setups do not model; the lab simulates an 8-GPU HGX board.
    """
    down = faults.get("nvlink_down")
    out = []
    for g in gpus:
        out.append("GPU %d: %s (UUID: %s)" % (g["index"], GPU_NAME, g["uuid"]))
        for link in range(NVLINKS_PER_GPU):
            inactive = down is not None and down is not False and g["index"] == FAULT_GPU and int(down) == link
            if flag == "-s":
                out.append("\t Link %d: %s" % (link, "<inactive>" if inactive else NVLINK_SPEED))
            else:
                errs = 0 if not inactive else 3
                out.append("\t Link %d: Replay Errors: 0" % link)
                out.append("\t Link %d: Recovery Errors: %d" % (link, errs))
                out.append("\t Link %d: CRC Errors: 0" % link)
    return "".join(line + "\n" for line in out)


def kmsg_path(host_dir):
    """The simulated kernel log of a lab host (``kmsg_path`` option of nvidia_gpu_info)."""
    return os.path.join(host_dir, "kmsg")


def sync_kmsg(host_dir, faults, now_mono=None):
    """Write ``<host dir>/kmsg``: a few ordinary NVRM records, plus one Xid record per value of the ``xid``
    knob (int or list) for GPU FAULT_GPU, stamped now (CLOCK_MONOTONIC, the clock printk uses: lab hosts
    share the kernel). Format: ``<prio>,<seq>,<usec>,-;<text>`` as /dev/kmsg gives it."""
    now_mono = time.monotonic() if now_mono is None else now_mono
    records = [(6, 1.256227, "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  %s  Release Build"
                % DRIVER_VERSION)]
    xids = faults.get("xid")
    if xids not in (None, False):
        bus = gpu_identities(os.path.basename(os.path.normpath(host_dir)))[FAULT_GPU]["pci_bus_id"]
        short = "%s:%s" % (bus[4:8], bus[9:14].lower())  # the driver prints 0000:2a:00
        for k, code in enumerate([xids] if isinstance(xids, int) else list(xids)):
            records.append((4, now_mono - 1.0 + k * 0.001, "NVRM: Xid (PCI:%s): %d, pid=%d, name=python3, %s"
                            % (short, int(code), 4242 + k, XID_TEXTS.get(int(code), "Unknown Xid."))))
    text = "".join("%d,%d,%d,-;%s\n" % (prio, seq + 100, int(ts * 1e6), msg)
                   for seq, (prio, ts, msg) in enumerate(records))
    tmp = kmsg_path(host_dir) + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, kmsg_path(host_dir))


def query_apps(gpus, fields_spec, format_spec, now):
    header, units = _parse_format(format_spec)
    fields = _resolve_fields(fields_spec, _help_fields("help-query-compute-apps.txt"))
    lines = []
    if header:
        lines.append(", ".join(f + (" [%s]" % _APP_UNITS[f] if f in _APP_UNITS else "") for f in fields))
    for g in gpus:
        for app in g["apps"]:
            lines.append(", ".join(_fmt(*_app_value(f, app, g, now), units) for f in fields))
    return "".join(line + "\n" for line in lines)


def list_gpus(gpus):
    return "".join("GPU %d: %s (UUID: %s)\n" % (g["index"], GPU_NAME, g["uuid"]) for g in gpus)


def table(gpus, now, host_dir):
    """The default ``nvidia-smi`` table, laid out as recordings/idle-table.txt and loaded-table.txt."""
    sep = "+-----------------------------------------+------------------------+----------------------+"
    full = "+" + "-" * 89 + "+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now)) + "       ", full,
           "| NVIDIA-SMI %-23sDriver Version: %-15sCUDA Version: %-9s|" % (DRIVER_VERSION, DRIVER_VERSION,
                                                                          CUDA_VERSION),
           sep,
           "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
           "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
           "|                                         |                        |               MIG M. |",
           "|=========================================+========================+======================|"]
    for g in gpus:
        temp = _gpu_value("temperature.gpu", g, host_dir, now)[0]
        power = int(float(_gpu_value("power.draw", g, host_dir, now)[0]))
        left = "%4d  %s" % (g["index"], GPU_NAME)
        out.append("|" + left + " " * (41 - len(left) - 4) + "On  |" + "%19s Off " % g["pci_bus_id"] +
                   "|" + "%21s " % "0" + "|")
        out.append("| N/A %4sC %5s %14sW / %4dW |%8dMiB / %6dMiB |%7d%%%13s |" % (
            temp, "P0", power, int(POWER_LIMIT_W), g["used_mib"], MEMORY_TOTAL_MIB, g["util"], "Default"))
        out.append("|                                         |                        |%21s |" % "Disabled")
        out.append(sep)
    out += ["", full,
            "| Processes:                                                                              |",
            "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
            "|        ID   ID                                                               Usage      |",
            "|" + "=" * 89 + "|"]
    apps = [(g, a) for g in gpus for a in g["apps"]]
    if not apps:
        out.append("|  No running processes found" + " " * 61 + "|")
    for g, a in apps:
        name = a["name"]
        if len(name) > 37:
            name = "..." + name[-34:]
        out.append("|  %3d   N/A  N/A %15d      C   %-37s%6dMiB |" % (g["index"], a["pid"], name, a["used_mib"]))
    out.append(full)
    return "".join(line + "\n" for line in out)


def _xml_sub(block, tag, value):
    import re
    return re.sub(r"<%s>[^<]*</%s>" % (tag, tag), "<%s>%s</%s>" % (tag, value, tag), block, count=1)


def query_xml(gpus, host_dir, now):
    """``nvidia-smi -q -x``: the recorded H200 document (tests/data/recordings/h200x2-driver580/idle-q.xml), its first GPU
    block repeated per GPU with this GPU's identity, memory, utilization, temperature, power, processes."""
    with open(os.path.join(_DATA, "idle-q.xml")) as fh:
        doc = fh.read()
    head, rest = doc.split("\t<gpu id=", 1)
    first = "\t<gpu id=" + rest.split("\t</gpu>\n", 1)[0] + "\t</gpu>\n"
    tail = "</nvidia_smi_log>\n"
    head = _xml_sub(head, "timestamp", time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now)))
    head = _xml_sub(head, "driver_version", DRIVER_VERSION)
    head = _xml_sub(head, "attached_gpus", str(len(gpus)))
    blocks = []
    for g in gpus:
        b = first.replace('<gpu id="00000000:00:06.0">', '<gpu id="%s">' % g["pci_bus_id"], 1)
        for tag, value in (("serial", g["serial"]), ("uuid", g["uuid"]), ("minor_number", g["minor_number"]),
                           ("pci_bus", g["pci_bus_id"][9:11]), ("pci_device", g["pci_bus_id"][12:14]),
                           ("pci_bus_id", g["pci_bus_id"]), ("used", "%d MiB" % g["used_mib"]),
                           ("free", "%d MiB" % (MEMORY_TOTAL_MIB - MEMORY_RESERVED_MIB - g["used_mib"])),
                           ("gpu_util", "%d %%" % g["util"]), ("memory_util", "%d %%" % (g["util"] // 3)),
                           ("gpu_temp", "%s C" % _gpu_value("temperature.gpu", g, host_dir, now)[0]),
                           ("average_power_draw", "%s W" % _gpu_value("power.draw", g, host_dir, now)[0]),
                           ("instant_power_draw", "%s W" % _gpu_value("power.draw", g, host_dir, now)[0])):
            b = _xml_sub(b, tag, value)
        procs = "".join(
            "\t\t\t<process_info>\n\t\t\t\t<gpu_instance_id>N/A</gpu_instance_id>\n"
            "\t\t\t\t<compute_instance_id>N/A</compute_instance_id>\n\t\t\t\t<pid>%d</pid>\n"
            "\t\t\t\t<type>C</type>\n\t\t\t\t<process_name>%s</process_name>\n"
            "\t\t\t\t<used_memory>%d MiB</used_memory>\n\t\t\t</process_info>\n"
            % (a["pid"], a["name"].replace("&", "&amp;").replace("<", "&lt;"), a["used_mib"]) for a in g["apps"])
        b = b.replace("\t\t<processes>\n\t\t</processes>\n", "\t\t<processes>\n%s\t\t</processes>\n" % procs, 1)
        blocks.append(b)
    return head + "\n".join(blocks) + "\n" + tail


def _usage():
    return ("NVIDIA System Management Interface -- v%s (gpufleet lab simulator)\n\n"
            "Supported: nvidia-smi [-i ID] [-L] [--query-gpu=F --format=csv[,noheader][,nounits]]\n"
            "           [--query-compute-apps=F --format=...] [--help-query-gpu] [--help-query-compute-apps]\n"
            % DRIVER_VERSION)


def _driver_fault(faults, gpus, argv):
    """(text, rc) of the ``smi_rc`` fault for this call, or None. rc 255 on a --query-gpu call is returned
    by :func:`run` as rows plus the error line (FIELD-NOTES: seven good rows and the handle error)."""
    rc = faults.get("smi_rc")
    if rc in (None, False, 0):
        return None
    rc = int(rc)
    text = SMI_FAULT_TEXTS.get(rc, "Unknown Error\n")
    bus = gpus[FAULT_GPU]["pci_bus_id"][4:] if len(gpus) > FAULT_GPU else "0000:00:00.0"
    if rc in (15, 255):
        text = text % bus
    return text, rc


def run(argv, host_dir, now=None):
    """Run the simulated nvidia-smi; returns (stdout text, rc). Never raises for bad input."""
    now = time.time() if now is None else now
    faults = read_json(os.path.join(host_dir, "faults.json"), {})
    hang = faults.get("smi_hang_s")
    if hang:
        time.sleep(float(hang))  # a wedged GPU: nvidia-smi does not answer (killable here, unlike D state)
    opts = {}
    i = 0
    try:
        if argv[:1] == ["nvlink"]:
            flag = argv[1] if len(argv) > 1 else "-s"
            if flag not in ("-s", "-e", "--status", "--errorcounters"):
                raise SmiError("nvlink %s is not simulated by the gpufleet lab (-s, -e).\n" % flag, 2)
            gpus = _faulted(gpu_snapshot(host_dir, now), faults)
            fault = _driver_fault(faults, gpus, argv)
            if fault:
                return fault
            return nvlink(gpus, {"--status": "-s", "--errorcounters": "-e"}.get(flag, flag), faults), 0
        while i < len(argv):
            a = argv[i]
            if "=" in a and a.startswith("--"):
                k, v = a.split("=", 1)
                opts[k] = v
            elif a in ("-i", "--id", "-f", "--filename"):
                if i + 1 >= len(argv):
                    raise SmiError('Option "%s" requires a value.\n\n%s' % (a, _usage()), 2)
                opts[{"-i": "--id", "-f": "--filename"}.get(a, a)] = argv[i + 1]
                i += 1
            elif a.startswith("-i") and len(a) > 2:
                opts["--id"] = a[2:]
            elif a in ("-L", "--list-gpus", "-q", "--query", "-x", "--xml-format", "--help-query-gpu",
                       "--help-query-compute-apps", "-h", "--help"):
                opts[a] = True
            else:
                raise SmiError('Invalid combination of input arguments. Please run \'nvidia-smi -h\' for help.\n\n', 2)
            i += 1
        if "-h" in opts or "--help" in opts:
            return _usage(), 0
        if "--help-query-gpu" in opts:
            with open(os.path.join(_DATA, "help-query-gpu.txt")) as fh:
                return fh.read(), 0
        if "--help-query-compute-apps" in opts:
            with open(os.path.join(_DATA, "help-query-compute-apps.txt")) as fh:
                return fh.read(), 0
        all_gpus = _faulted(gpu_snapshot(host_dir, now), faults)
        fault = _driver_fault(faults, all_gpus, argv)
        if fault and not (fault[1] == 255 and "--query-gpu" in opts):
            return fault
        gpus = _select(all_gpus, opts.get("--id"))
        if "--query-gpu" in opts or "--query-compute-apps" in opts:
            if "--format" not in opts:
                raise SmiError('"--format" option is required with "--query-*" options.\n\n', 2)
            if "--query-gpu" in opts:
                if fault:
                    return query_gpu(gpus, opts["--query-gpu"], opts["--format"], host_dir, now, FAULT_GPU), 255
                return query_gpu(gpus, opts["--query-gpu"], opts["--format"], host_dir, now), 0
            return query_apps(gpus, opts["--query-compute-apps"], opts["--format"], now), 0
        if "-L" in opts or "--list-gpus" in opts:
            return list_gpus(gpus), 0
        if ("-q" in opts or "--query" in opts) and ("-x" in opts or "--xml-format" in opts):
            return query_xml(gpus, host_dir, now), 0
        if "-q" in opts or "--query" in opts:
            raise SmiError("plain -q is not simulated by the gpufleet lab; use -q -x or --query-gpu.\n", 2)
        return table(gpus, now, host_dir), 0
    except SmiError as exc:
        return exc.text, exc.rc


def _faulted(gpus, faults):
    """The GPU snapshot as the faults show it: ``gpus_visible`` drops GPUs from the end; each GPU carries
    the faults for :func:`_gpu_value`."""
    visible = faults.get("gpus_visible")
    if visible is not None and visible is not False:
        gpus = gpus[:int(visible)]
    for g in gpus:
        g["faults"] = faults
    return gpus


def find_host_dir():
    """The lab host directory of this process: $GPUFLEET_LAB_HOST_DIR, else the marker in /dev."""
    d = os.environ.get(HOST_DIR_ENV)
    if d:
        return d
    try:
        with open("/dev/.gpufleet-lab-host") as fh:
            return fh.read().strip()
    except OSError:
        return None


def main(argv=None, host_dir=None):
    host_dir = host_dir or find_host_dir()
    if not host_dir:
        sys.stdout.write("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                         "Make sure that the latest NVIDIA driver is installed and running.\n\n")
        return 9
    text, rc = run(sys.argv[1:] if argv is None else argv, host_dir)
    sys.stdout.write(text)
    sys.stdout.flush()
    pad_to_real_cost(read_json(os.path.join(host_dir, "faults.json"), {}).get("smi_cost_ms"))
    return rc


def process_age_s():
    """Seconds this process has been running or waiting for a CPU since it was forked: the first two
    fields of /proc/self/schedstat (ns on a CPU, ns runnable in the run queue). Up to the sleep below the
    simulator never blocks but on page-cache reads, so this is its age within a millisecond or two, at
    a 1 ns resolution that /proc/self/stat's start time (10 ms ticks) lacks. Without schedstat: the CPU
    time, which misses the run-queue wait of a busy machine."""
    try:
        with open("/proc/self/schedstat") as fh:
            on_cpu, queued = fh.read().split()[:2]
        return (int(on_cpu) + int(queued)) / 1e9
    except (OSError, ValueError):
        return time.process_time()


def pad_to_real_cost(cost_ms=None):
    """Sleep until this process has lasted ``cost_ms`` (None: SMI_COST_MS): the answer is written already,
    the caller waits for the exit as it waits for the real nvidia-smi's. A busy machine may already have
    made the call longer; nothing is added then."""
    cost_ms = SMI_COST_MS if cost_ms is None or cost_ms is False else float(cost_ms)
    left = cost_ms / 1000.0 - process_age_s()
    if left > 0:
        time.sleep(left)


if __name__ == "__main__":
    sys.exit(main())
