# -*- coding: utf-8 -*-
# gpufleet: what a restart needs of a host, measured: disk, /dev/shm, the port, GPU memory after the stop, write
# access, ownership, model files, the launch record and the restart lock. Plain functions: sglang_host_info and
# sglang_preflight_info call measure() (moved here from sglang_host_info, unchanged).
from __future__ import absolute_import, division, print_function

import fnmatch
import os
import pwd
import re
import stat
import sys

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import KNOWN_MONITORS
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_ports import (  # noqa: F401 pylint: disable=unused-import
    WILDCARDS, addresses_overlap, tcp_listeners)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_argv
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_lock
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_launch_record
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_managed_server
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_trust
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_trust import root_code_check
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_memory import (
    foreign_memory,
    tp_balance_problem,
    unreadable_wait_fields,
)

try:
    import psutil
    HAS_PSUTIL = True
    PSUTIL_IMPORT_ERROR = None
except ImportError as exc:  # reported only when a port is asked for
    psutil = None
    HAS_PSUTIL = False
    PSUTIL_IMPORT_ERROR = exc

MIB = 1024 * 1024
# Left behind in /dev/shm by NCCL (nccl-*), CUDA IPC (cuda.shm.*) and SGLang (sgl_shm_*) when processes die
# by SIGKILL (FIELD-NOTES: a full /dev/shm makes the next start die with SIGBUS).
SEGMENT_PATTERNS = ("nccl-*", "cuda.shm.*", "sgl_shm_*")


def nearest_existing(path):
    """``path`` or its nearest existing parent (str)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def disk_free(path):
    """Free/total MiB of the filesystem holding ``path`` (os.statvfs: f_bavail and f_blocks × f_frsize)."""
    measured = nearest_existing(path)
    st = os.statvfs(measured)
    return {"path": path, "measured_path": measured, "exists": os.path.exists(path),
            "free_mib": st.f_bavail * st.f_frsize // MIB, "total_mib": st.f_blocks * st.f_frsize // MIB}


def _allocated_mib(st):
    """Space a file takes (allocated blocks, not its apparent size: tmpfs counts blocks), MiB."""
    return round(getattr(st, "st_blocks", 0) * 512 / float(MIB), 1)


def shm_info(shm_path, stop_preview=None, stop_pids=()):
    """Size/free/used MiB of the shared-memory filesystem and the SGLang/NCCL segments in it.

    With ``stop_preview`` (the sglang_stop check-mode result: ``removed_shm`` paths, ``kept_shm`` [{path,
    holders, reason}]) and ``stop_pids`` (set of int), a segment counts as freed by the stop when the stop would
    remove it now, or when the stop kept it only because stop-set processes hold it (after they die the stop
    removes it as stale). Adds ``freed_by_stop_mib``, ``free_after_stop_mib`` and ``kept_segments``.
    """
    out = {"path": shm_path, "exists": os.path.isdir(shm_path), "size_mib": 0, "free_mib": 0, "used_mib": 0,
           "stale_segments": [], "freed_by_stop_mib": 0.0, "free_after_stop_mib": 0, "kept_segments": []}
    if not out["exists"]:
        return out
    st = os.statvfs(shm_path)
    out["size_mib"] = st.f_blocks * st.f_frsize // MIB
    out["free_mib"] = st.f_bavail * st.f_frsize // MIB
    out["used_mib"] = (st.f_blocks - st.f_bfree) * st.f_frsize // MIB
    preview = stop_preview or {}
    removed = set(preview.get("removed_shm") or [])
    kept_by_stop = dict((k.get("path"), k) for k in preview.get("kept_shm") or [] if isinstance(k, dict))
    stop_pids = set(stop_pids)
    freed = 0.0
    for name in sorted(os.listdir(shm_path)):
        if any(fnmatch.fnmatch(name, pattern) for pattern in SEGMENT_PATTERNS):
            path = os.path.join(shm_path, name)
            try:
                seg = os.lstat(path)
            except OSError:
                continue
            out["stale_segments"].append({"name": name, "size_mib": round(seg.st_size / float(MIB), 1)})
            kept = kept_by_stop.get(path) or {}
            holders = set(kept.get("holders") or [])
            if path in removed or (kept.get("reason") == "held" and holders and holders <= stop_pids):
                freed += _allocated_mib(seg)
            else:
                reason = kept.get("reason") or ("not removed by the stop" if stop_preview else "no stop preview")
                if holders:
                    reason += " by pids " + ", ".join(str(pid) for pid in sorted(holders))
                out["kept_segments"].append({
                    "name": name, "size_mib": _allocated_mib(seg), "holders": sorted(holders), "reason": reason,
                    "text": "%s (%s MiB, %s)" % (name, _allocated_mib(seg), reason)})
    out["freed_by_stop_mib"] = round(freed, 1)
    out["free_after_stop_mib"] = int(out["free_mib"] + freed)
    return out


# ---------------------------------------------------------------------------------------------------------
# The stop set and what the GPUs would hold after the stop

def cgroup_of(pid, proc_root="/proc"):
    """The cgroup path of ``pid`` (cgroup v2 ``0::`` line, else v1 ``name=systemd``), or None."""
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup")) as handle:
            lines = handle.read().splitlines()
    except (IOError, OSError):
        return None
    found = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            return parts[2]
        if parts[1] == "name=systemd":
            found = parts[2]
    return found


def unit_members(main_pid, proc_root="/proc"):
    """Pids in the cgroup of ``main_pid`` or below it: what ``systemctl stop`` ends with KillMode=control-group.

    Only ``{main_pid}`` when its cgroup is unknown or the root cgroup (set of int).
    """
    group = cgroup_of(main_pid, proc_root)
    if not group or group == "/":
        return {main_pid}
    members = {main_pid}
    for name in os.listdir(proc_root):
        if name.isdigit():
            other = cgroup_of(int(name), proc_root)
            if other and (other == group or other.startswith(group.rstrip("/") + "/")):
                members.add(int(name))
    return members


def stop_set(stop_preview, unit_pids=()):
    """Pids the stop would end: ``signalled[].pid`` of the sglang_stop check-mode result plus ``unit_pids``."""
    pids = set(unit_pids)
    for entry in (stop_preview or {}).get("signalled") or []:
        if isinstance(entry, dict) and entry.get("pid") is not None:
            pids.add(int(entry["pid"]))
    return pids


def is_monitor(name, cmdline):
    """Known GPU watcher (gpufleet_procs.KNOWN_MONITORS) by process name or by argv[0]'s base name."""
    first = os.path.basename((cmdline or "").split(" ", 1)[0])
    return any(n and (n in KNOWN_MONITORS or n[:15] in KNOWN_MONITORS) for n in (name, first))


def _pid_visible(pid):
    return psutil.pid_exists(pid) if HAS_PSUTIL else os.path.exists("/proc/%d" % pid)


def _on_gpus(indices):
    return ("GPU %d" % indices[0]) if len(indices) == 1 else ("GPUs " + ", ".join(str(i) for i in indices))


def _describe(proc):
    return "pid %s (user %s)%s" % (proc.get("pid"), proc.get("user") or "?",
                                   ": " + proc["cmdline"] if proc.get("cmdline") else "")


def gpu_after_stop(gpu_info, stop_pids, max_used_mib, visible=_pid_visible):
    """What the wait for free GPU memory would see once the stop set has gone.

    ``gpu_info``: nvidia_gpu_info's result (``gpus[].processes``, ``device_holders``); ``stop_pids``: set of int;
    ``max_used_mib``: the wait's threshold (MiB); ``visible(pid)``: whether the pid exists in this PID namespace.
    A compute process (listed by NVML / nvidia-smi, not only found by the fd scan) outside the stop set is a
    holder: the wait would see its memory and the process. A GPU over the threshold after subtracting the stop
    set's memory with no such holder is unexplained, unless the accounting is incomplete (a compute process not
    visible here or without MiB, or no compute process at all) and a stop-set process holds the GPU's device
    file: then the stop is expected to free it. Known monitors never count.
    Returns ``{"blocked": bool, "gpus": [...], "holders": [...], "unexplained": [...]}`` (see RETURN).
    """
    stop_pids = set(stop_pids)
    device_holders = gpu_info.get("device_holders") or []
    holders = {}
    gpus, unexplained = [], []
    for gpu in gpu_info.get("gpus") or []:
        index = gpu.get("index")
        procs = gpu.get("processes") or []
        compute = [p for p in procs if any(src != "proc_fd" for src in p.get("source") or [])]
        hidden = [p["pid"] for p in compute if not visible(p["pid"])]
        used = gpu.get("memory_used_mib")
        stop_mib = sum(p.get("used_memory_mib") or 0 for p in compute if p["pid"] in stop_pids)
        remaining = None if used is None else max(int(used) - stop_mib, 0)
        complete = bool(compute) and not hidden and all(p.get("used_memory_mib") is not None for p in compute)
        held_by_stop = any(p["pid"] in stop_pids for p in procs) or any(
            h.get("pid") in stop_pids and index in (h.get("gpu_indices") or []) for h in device_holders)
        foreign_here = False
        for proc in compute:
            if proc["pid"] in stop_pids or proc["pid"] in hidden or is_monitor(proc.get("name"), proc.get("cmdline")):
                continue
            foreign_here = True
            entry = holders.setdefault(proc["pid"], {"pid": proc["pid"], "user": proc.get("user"),
                                                     "cmdline": proc.get("cmdline"), "used_memory_mib": 0,
                                                     "gpu_indices": []})
            entry["gpu_indices"].append(index)
            if proc.get("used_memory_mib") is None or entry["used_memory_mib"] is None:
                entry["used_memory_mib"] = None
            else:
                entry["used_memory_mib"] += proc["used_memory_mib"]
        gpus.append({"index": index, "memory_used_mib": used, "stop_set_mib": stop_mib, "remaining_mib": remaining,
                     "held_by_stop_set": held_by_stop, "accounting": "complete" if complete else "incomplete",
                     "foreign_listed": foreign_here, "memory_total_mib": gpu.get("memory_total_mib"),
                     "memory_reserved_mib": gpu.get("memory_reserved_mib")})
        if remaining is None or remaining <= max_used_mib or foreign_here:
            continue
        if not complete and held_by_stop:
            continue
        others = [h for h in device_holders if h.get("pid") not in stop_pids and index in (h.get("gpu_indices") or [])
                  and not is_monitor(h.get("name"), h.get("cmdline"))]
        text = ("GPU %s: %d MiB stay in use after the stop (wait limit %d MiB) and no process the stop ends "
                "accounts for it" % (index, remaining, max_used_mib))
        if others:
            text += "; other processes holding /dev/nvidia for it: " + "; ".join(_describe(h) for h in others)
        if hidden:
            text += "; compute processes not visible in this PID namespace (another container?): pids " + \
                ", ".join(str(pid) for pid in hidden)
        if not others and not hidden:
            text += " (no GPU list names its holder: a process in another container or PID namespace, a zombie, " \
                    "or memory of a process that just died)"
        shared = [h for h in device_holders if h.get("kind") == "shared_only" and h.get("pid") not in stop_pids
                  and not is_monitor(h.get("name"), h.get("cmdline"))]
        if shared:
            text += "; processes holding only /dev/nvidiactl and /dev/nvidia-uvm (candidates): " + "; ".join(
                _describe(h) for h in shared)
        unexplained.append({"index": index, "remaining_mib": remaining, "other_holders": [h.get("pid") for h in others],
                            "text": text})
    out_holders = []
    for pid in sorted(holders):
        entry = holders[pid]
        mib = entry["used_memory_mib"]
        entry["text"] = "pid %d (user %s) holds %s on %s%s" % (
            pid, entry["user"] or "?", "%d MiB" % mib if mib is not None else "GPU memory (MiB not reported)",
            _on_gpus(entry["gpu_indices"]), ": " + entry["cmdline"] if entry["cmdline"] else "")
        out_holders.append(entry)
    # Memory no listed process accounts for is foreign: the old server runs beside it, so the wait after the stop
    # waits for the server's own memory (baseline_mib), and only SGLang's own start rule refuses (tp_balance).
    return {"blocked": bool(out_holders), "gpus": gpus, "holders": out_holders, "unexplained": unexplained,
            "baseline_mib": foreign_memory(gpus, max_used_mib),
            "unreadable": unreadable_wait_fields(gpu_info)}


# ---------------------------------------------------------------------------------------------------------
# Write access and model directories

def _user_name(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _can_write_dir(path):
    """os.access W_OK|X_OK with the effective ids (what a write under become will use)."""
    kwargs = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK, **kwargs)


def _why_not(path):
    """Why ``path`` (a directory) refuses writes: read-only filesystem, or owner and mode."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return "%s: %s" % (path, exc.strerror)
    try:
        if os.statvfs(path).f_flag & getattr(os, "ST_RDONLY", 1):
            return "%s is on a read-only filesystem" % path
    except OSError:
        pass
    if not stat.S_ISDIR(st.st_mode):
        return "%s is not a directory" % path
    return "%s belongs to %s:%s with mode %04o" % (path, _user_name(st.st_uid), st.st_gid, stat.S_IMODE(st.st_mode))


def mount_points(mountinfo="/proc/self/mountinfo"):
    """The mount points of this mount namespace (set of str), from the 5th field of ``mountinfo`` (octal escapes
    such as ``\\040`` decoded); empty when it cannot be read."""
    points = set()
    try:
        with open(mountinfo, "rb") as fh:
            for line in fh:
                fields = line.split(b" ")
                if len(fields) > 4:
                    points.add(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
                               .decode("utf-8", "surrogateescape"))
    except OSError:
        pass
    return points


def replace_access(path, mounts=None):
    """Whether ``path`` can be replaced the way sglang_nccl_patch writes (temporary file in its directory, then
    rename): the directory must be writable and searchable, and the file must not be a mount point of its own (a
    file bind-mounted over, e.g. read-only into a container: the rename fails with EBUSY whoever runs it).
    ``mounts``: the mount points (default :func:`mount_points`). Returns a write_access entry (see RETURN)."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    user = _user_name(os.geteuid())
    kwargs = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    file_writable = os.access(path, os.W_OK, **kwargs) if os.path.exists(path) else None
    ok = _can_write_dir(directory)
    reason = None if ok else "user %s cannot create files in %s (%s)" % (user, directory, _why_not(directory))
    if ok and path in (mount_points() if mounts is None else mounts):
        ok = False
        reason = ("%s is a mount point of its own (a file bind-mounted there%s): renaming the patched file over it "
                  "fails with EBUSY for any user" % (path, "" if file_writable else ", read-only"))
    return {"path": path, "purpose": "replace", "user": user, "ok": ok, "checked_path": directory,
            "file_writable": file_writable, "reason": reason}


def dir_access(path):
    """Whether ``path`` is a writable directory, or can be created (nearest existing parent writable)."""
    path = os.path.abspath(path)
    user = _user_name(os.geteuid())
    if os.path.exists(path) and not os.path.isdir(path):
        return {"path": path, "purpose": "write", "user": user, "ok": False, "checked_path": path,
                "file_writable": None, "reason": "%s exists and is not a directory" % path}
    checked = path if os.path.isdir(path) else nearest_existing(path)
    ok = _can_write_dir(checked)
    reason = None
    if not ok:
        what = "write in %s" % path if checked == path else "create %s under %s" % (path, checked)
        reason = "user %s cannot %s (%s)" % (user, what, _why_not(checked))
    return {"path": path, "purpose": "write", "user": user, "ok": ok, "checked_path": checked,
            "file_writable": None, "reason": reason}


def model_dir_check(flag, path, markers_by_flag):
    """``{flag, path, is_dir, markers, found}`` for one model directory; ``flag`` is given with dashes in the
    result; ``found`` is the first marker file present (None when none: an empty directory, e.g. a mount point
    whose filesystem is not mounted). ``markers_by_flag``: {flag: [file name]}, default ``["config.json"]``."""
    flag = str(flag).replace("_", "-")
    markers = list(markers_by_flag.get(flag) or ["config.json"])
    path = str(path or "")
    is_dir = os.path.isdir(path)
    found = None
    if is_dir:
        found = next((m for m in markers if os.path.isfile(os.path.join(path, m))), None)
    return {"flag": flag, "path": path, "is_dir": is_dir, "markers": markers, "found": found}


def is_same_or_descendant(pid, ancestor):
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (psutil parents chain)."""
    if pid is None or ancestor is None:
        return False
    if pid == ancestor:
        return True
    try:
        return any(parent.pid == ancestor for parent in psutil.Process(pid).parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def listeners_on(port, host, managed_pid):
    """TCP listeners on ``port`` (gpufleet_ports.tcp_listeners), with conflict (gpufleet_ports.addresses_overlap
    with ``host``) and managed flags."""
    out = []
    for conn in tcp_listeners(port):
        cmdline = None
        if conn.pid is not None:
            try:
                cmdline = redact_argv(psutil.Process(conn.pid).cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                cmdline = None
        out.append({"address": conn.laddr[0], "pid": conn.pid, "cmdline": cmdline,
                    "conflicts": addresses_overlap(host, conn.laddr[0]),
                    "managed": is_same_or_descendant(conn.pid, managed_pid)})
    return out


def port_info(port, host, managed_pid):
    listeners = listeners_on(port, host, managed_pid)
    conflicting = [item for item in listeners if item["conflicts"]]
    return {"port": port, "free": not conflicting, "listeners": listeners,
            "held_by_managed": bool(conflicting) and all(item["managed"] for item in conflicting)}


def _trusted_uids():
    return frozenset([0, os.geteuid()])


def _users_text(uids):
    return " or ".join(gpufleet_trust.owner_name(uid) for uid in sorted(uids))


def ownership_check(variable, path, uids=None):
    """An RV(ownership) entry for ``path`` (None when it can be trusted)."""
    uids = _trusted_uids() if uids is None else uids
    problems = gpufleet_trust.path_problems(path, uids)
    if not problems:
        return None
    text = ("%s %s cannot be trusted: %s. Only %s (the user gpufleet reads and writes it as) may own it and the "
            "directories above it, writable by no other user: chown it to %s and chmod go-w, or choose another %s"
            % (variable, path, "; ".join(gpufleet_trust.describe(p) for p in problems), _users_text(uids),
               gpufleet_trust.owner_name(min(uids)), variable))
    return {"variable": variable, "path": path, "problems": problems, "text": text}


def read_launch_record(path, unit_dir):
    """RV(launch_record): the record at ``path`` when its owner, modes and content can be trusted."""
    out = {"path": path, "exists": os.path.lexists(path), "valid": False, "reason": None, "record": None}
    if not out["exists"]:
        return out
    trust = ownership_check("sglang_launch_record_file", path)
    if trust:
        out["reason"] = "; ".join(gpufleet_trust.describe(p) for p in trust["problems"])
        return out
    try:
        with open(path, "rb") as handle:
            data = handle.read(gpufleet_launch_record.MAX_RECORD_BYTES + 1)
        out["record"] = gpufleet_launch_record.check_record(data, unit_dir)
        out["valid"] = True
    except (IOError, OSError) as exc:
        out["reason"] = "cannot be read: %s" % (exc.strerror or exc)
    except gpufleet_launch_record.RecordError as exc:
        out["reason"] = str(exc)
    return out


def root_code(interpreters, self_too=False):
    """What makes root's run of each interpreter unsafe (``root_code_check`` entries): ``interpreters`` name ->
    python, and with ``self_too`` this module's own interpreter first (as ``ansible_python_interpreter``)."""
    interpreters = sorted(interpreters.items())
    if self_too:
        interpreters.insert(0, ("ansible_python_interpreter", sys.executable))
    seen = set()
    out = []
    for name, python in interpreters:
        if python and python not in seen:
            seen.add(python)
            entry = root_code_check(name, python)
            if entry:
                out.append(entry)
    return out


class MeasureError(Exception):
    """A measurement that failed: ``msg`` and the module result's other keys (``kwargs``)."""

    def __init__(self, msg, **kwargs):
        super(MeasureError, self).__init__(msg)
        self.msg = msg
        self.kwargs = kwargs


# The options measure() reads, as sglang_host_info declares them (sglang_preflight_info passes the same keys).
MEASURE_OPTIONS = dict(
    paths=dict(type="list", elements="path", default=[]),
    shm_path=dict(type="path", default="/dev/shm"),
    port=dict(type="int"),
    host=dict(type="str", default="127.0.0.1"),
    pid_file=dict(type="path"),
    systemd_unit=dict(type="str"),
    stop_preview=dict(type="dict"),
    gpu_info=dict(type="dict"),
    max_used_mib=dict(type="int", default=1024),
    world_size=dict(type="int", default=1),
    server_env=dict(type="dict", default={}),
    replace_files=dict(type="list", elements="path", default=[]),
    write_dirs=dict(type="list", elements="path", default=[]),
    model_dirs=dict(type="dict", default={}),
    model_markers=dict(type="dict", default={}),
    lock_dir=dict(type="path"),
    lock_lease_s=dict(type="int", default=300),
    owned_paths=dict(type="dict", default={}),
    root_interpreters=dict(type="dict", default={}),
    root_interpreter_self=dict(type="bool", default=False),
    launch_record=dict(type="path"),
    launch_unit_dir=dict(type="path", default="/etc/systemd/system"),
)


def measure(p, run_command=None, get_bin_path=None):
    """sglang_host_info's result for its options ``p`` (a dict with every key of MEASURE_OPTIONS);
    ``run_command(argv)`` and ``get_bin_path(name, required)`` as AnsibleModule's (systemctl for a unit).
    Raises MeasureError where the module fails."""
    if p["port"] is not None and not 0 < p["port"] < 65536:
        raise MeasureError("port must be between 1 and 65535, got %d" % p["port"])
    try:
        server = gpufleet_managed_server.find_managed_server(
            p["pid_file"], p["systemd_unit"], run_command=run_command,
            systemctl=get_bin_path("systemctl", required=True) if p["systemd_unit"] else None)
    except gpufleet_managed_server.ServerFindError as exc:
        raise MeasureError(exc.msg, **exc.kwargs)
    managed_pid, running = server["managed_pid"], server["managed_running"]
    # systemctl stop ends the unit's whole cgroup (KillMode=control-group); the stop module's check mode only
    # lists what it would signal itself after that.
    unit_pids = unit_members(managed_pid) if (p["systemd_unit"] and running) else set()
    stop_pids = stop_set(p["stop_preview"], unit_pids)
    try:
        result = dict(changed=False, disk=[disk_free(path) for path in p["paths"]],
                      shm=shm_info(p["shm_path"], p["stop_preview"], stop_pids),
                      managed_pid=managed_pid, managed_running=running, stop_pids=sorted(stop_pids),
                      write_access=[replace_access(path) for path in p["replace_files"]]
                      + [dir_access(path) for path in p["write_dirs"]],
                      model_dirs=[model_dir_check(flag, path, p["model_markers"])
                                  for flag, path in p["model_dirs"].items()])
    except OSError as exc:
        raise MeasureError("cannot measure free space: %s" % exc)
    if p["gpu_info"] is not None:
        after = gpu_after_stop(p["gpu_info"], stop_pids, p["max_used_mib"])
        after["tp_balance"] = tp_balance_problem(after["gpus"], after["baseline_mib"], p["world_size"],
                                                 p["server_env"])
        result["gpu_after_stop"] = after
    if p["port"] is not None:
        if not HAS_PSUTIL:
            raise MeasureError(missing_required_lib("psutil", reason="to find the process listening on the port"),
                               exception=str(PSUTIL_IMPORT_ERROR))
        try:
            result["port"] = port_info(p["port"], p["host"], managed_pid if result["managed_running"] else None)
        except psutil.AccessDenied as exc:
            raise MeasureError("not allowed to list TCP sockets (%s); run with become" % exc)
    result["ownership"] = [entry for entry in (ownership_check(name, path)
                                               for name, path in sorted(p["owned_paths"].items())) if entry]
    result["root_code"] = root_code(p["root_interpreters"], p["root_interpreter_self"])
    if p["launch_record"]:
        result["launch_record"] = read_launch_record(p["launch_record"], p["launch_unit_dir"])
    if p["lock_dir"]:
        try:
            result["restart_lock"] = gpufleet_lock.read_holder(p["lock_dir"].rstrip("/"), max(p["lock_lease_s"], 1))
        except gpufleet_lock.LockError as exc:
            result.update(restart_lock=None, restart_lock_error=str(exc))
    return result
