# -*- coding: utf-8 -*-
# gpufleet: process discovery shared by nvidia_gpu_info, nvidia_gpu_wait, sglang_stop and sglang_verify.
"""Find processes that hold NVIDIA device files, and describe processes.

Why an fd scan: NVML's ``nvmlDeviceGetComputeRunningProcesses`` and ``nvidia-smi --query-compute-apps``
list nothing (or host pids) inside a container without the host PID namespace, so they cannot be the only
source. Every CUDA process keeps ``/dev/nvidia<N>`` (and ``/dev/nvidiactl``, ``/dev/nvidia-uvm``) open, so
reading the ``/proc/<pid>/fd`` links finds them. ``psutil.Process.open_files()`` lists regular files only,
not character devices, hence the links are read here directly.

Caution (FIELD-NOTES): processes that only query NVML (nvidia-smi, DCGM, nvidia-persistenced, monitoring
agents, this module itself) hold the same device files. A holder is not necessarily a memory user.

Everything here works without Ansible; ``psutil`` is needed only by :func:`process_info`.
"""
from __future__ import annotations

import fnmatch
import os
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_argv, redact_text

try:
    import psutil
    HAS_PSUTIL = True
    PSUTIL_IMPORT_ERROR = None
except ImportError as _exc:  # reported by the calling module with missing_required_lib("psutil")
    psutil = None
    HAS_PSUTIL = False
    PSUTIL_IMPORT_ERROR = _exc

DEFAULT_DEVICE_GLOB = "/dev/nvidia*"

# /dev/nvidia<N> is the per-GPU node; its minor number is N (the driver creates it with major 195, minor N,
# and NVML's nvmlDeviceGetMinorNumber returns that N). nvidiactl, nvidia-uvm, nvidia-uvm-tools,
# nvidia-modeset and nvidia-caps/* are shared by all GPUs.
_GPU_NODE_RE = re.compile(r"nvidia(\d+)$")


class MissingLibraryError(Exception):
    """A third-party Python package is not importable; ``.library`` is its distribution name."""

    def __init__(self, library, exc=None):
        super().__init__("the Python package %s is required" % library)
        self.library = library
        self.exc = exc


def clean_text(value):
    """Return ``value`` as text that always encodes to UTF-8 (or None when ``value`` is None).

    Process names and command lines are bytes in the kernel; Python decodes them with surrogateescape
    (psutil, os.readlink) and Ansible's run_command does the same. Lone surrogates cannot be serialised
    to JSON for the controller, so invalid bytes become U+FFFD here.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    text = str(value)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def gpu_minor_of_path(path):
    """Minor number N of a per-GPU device path ``.../nvidia<N>``, else None (nvidiactl, nvidia-uvm, ...).

    Matching is by name, as the driver names the nodes; callers map N to a GPU with the GPU's minor
    number (NVML nvmlDeviceGetMinorNumber; /proc/driver/nvidia/gpus/<bus id>/information "Device Minor").
    """
    m = _GPU_NODE_RE.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def _pid_dirs(proc_root):
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return []
    return sorted(int(e) for e in entries if e.isdigit())


def _read_fd_links(fd_dir, glob, names=None):
    """Targets matching ``glob`` among the fds ``names`` (all when None) of one fd directory."""
    found = set()
    if names is None:
        try:
            names = os.listdir(fd_dir)
        except OSError:
            return found
    for fd in names:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # fd closed or process gone between listdir and readlink
            continue
        if fnmatch.fnmatchcase(target, glob):
            found.add(clean_text(target))
    return found


def find_device_holders(glob=DEFAULT_DEVICE_GLOB, proc_root="/proc", exclude_pids=()):
    """Map each pid that has a file descriptor open on a path matching ``glob`` to those paths.

    Returns ``{pid: [path, ...]}`` (paths sorted, each once). Source: ``readlink /proc/<pid>/fd/<n>`` and
    ``/proc/<pid>/task/<tid>/fd/<n>`` for every thread: a process whose main thread exited while another
    thread lives shows as ``<defunct>`` with an empty ``/proc/<pid>/fd``, yet that thread still holds the
    GPU (FIELD-NOTES 2026-11-30). Threads normally share one fd table, so a thread's links are read only
    when its fd list differs from the main thread's (cheap: one listdir per thread).
    ``glob`` is an fnmatch pattern on the link target (``/dev/nvidia*`` matches nvidia0, nvidiactl,
    nvidia-uvm). Processes that exit mid-scan and fd directories we may not read (another user's
    processes without CAP_SYS_PTRACE, hidepid) are skipped silently: the result is best effort and covers
    what this user can see. ``exclude_pids`` are left out (e.g. the calling module's own pid).
    """
    excluded = set(exclude_pids or ())
    holders = {}
    for pid in _pid_dirs(proc_root):
        if pid in excluded:
            continue
        base = os.path.join(proc_root, str(pid))
        try:
            main_fds = set(os.listdir(os.path.join(base, "fd")))
            main_ok = True
        except OSError:  # vanished (ENOENT/ESRCH), not ours (EACCES), or a zombie leader
            main_fds, main_ok = set(), False
        found = _read_fd_links(os.path.join(base, "fd"), glob, main_fds) if main_fds else set()
        try:
            tids = [t for t in os.listdir(os.path.join(base, "task")) if t.isdigit() and t != str(pid)]
        except OSError:
            tids = []
        if not main_ok and not tids:
            continue
        for tid in tids:
            fd_dir = os.path.join(base, "task", tid, "fd")
            try:
                names = set(os.listdir(fd_dir))
            except OSError:
                continue
            if names and names != main_fds:
                found |= _read_fd_links(fd_dir, glob, names)
        if found:
            holders[pid] = sorted(found)
    return holders


#: Process names (``/proc/<pid>/comm``, 15 characters) of programs that hold /dev/nvidia* only to watch
#: the GPUs: they never own GPU memory and must not be stopped.
KNOWN_MONITORS = frozenset((
    "nvidia-smi", "nvidia-persiste", "nvidia-persistenced", "nv-hostengine", "dcgm-exporter", "dcgmi",
    "nvtop", "nvitop", "gpustat", "nvidia_gpu_expo", "nvidia-gpu-expo", "node_exporter", "prometheus-node",
    "telegraf", "datadog-agent", "collectd",
))


def holder_kind(paths, name, gpu_indices):
    """Classify a device holder: ``monitor`` (a known watcher by process name), ``gpu`` (holds a
    per-GPU node /dev/nvidia<N>) or ``shared_only`` (only nvidiactl / nvidia-uvm / nvidia-caps: a CUDA
    or NVML client that has not opened a GPU, or one in a container whose nodes are named otherwise)."""
    if name and (name in KNOWN_MONITORS or name[:15] in KNOWN_MONITORS):
        return "monitor"
    if gpu_indices or any(gpu_minor_of_path(p) is not None for p in paths):
        return "gpu"
    return "shared_only"


def process_info(pid):
    """Describe one process, or return None when it no longer exists (or is not in our PID namespace).

    Returns ``{"pid": int, "ppid": int|None, "pgid": int|None, "name": str|None, "cmdline": [str],
    "user": str|None, "create_time": float|None}`` from psutil (``/proc/<pid>/stat``, ``cmdline``,
    ``status``); ``create_time`` is seconds since the epoch. Fields this user may not read are None
    (``cmdline`` then ``[]``). Invalid UTF-8 becomes U+FFFD. Raises :class:`MissingLibraryError` when
    psutil is not installed.
    """
    if not HAS_PSUTIL:
        raise MissingLibraryError("psutil", PSUTIL_IMPORT_ERROR)
    try:
        proc = psutil.Process(pid)
    except (psutil.NoSuchProcess, ValueError):
        return None
    info = {"pid": pid, "ppid": None, "pgid": None, "name": None, "cmdline": [], "user": None,
            "create_time": None}
    getters = (
        ("ppid", proc.ppid),
        ("name", lambda: clean_text(proc.name())),
        ("cmdline", lambda: redact_argv([clean_text(a) for a in proc.cmdline()])),
        ("user", lambda: clean_text(proc.username())),
        ("create_time", proc.create_time),
    )
    for key, getter in getters:
        try:
            info[key] = getter()
        except psutil.NoSuchProcess:
            return None
        except (psutil.AccessDenied, psutil.ZombieProcess, OSError, KeyError):
            pass
    try:
        info["pgid"] = os.getpgid(pid)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    return info


def cmdline_text(pid, proc_root="/proc"):
    """Command line (or setproctitle title) of ``pid`` as one str, arguments joined by spaces.

    Read from ``/proc/<pid>/cmdline`` directly: SGLang retitles its processes with setproctitle
    (``sglang::scheduler_TP0``), which rewrites that file, and a title is what its clean-up pattern matches.
    Bytes-safe (invalid UTF-8 becomes ``\\xNN``); "" when the process is gone or unreadable.
    """
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as handle:
            raw = handle.read()
    except OSError:
        return ""
    return redact_text(raw.replace(b"\x00", b" ").strip().decode("utf-8", "backslashreplace"))


def describe_pids(pids):
    """``{pid: process_info(pid) or None}`` for each pid; without psutil every value is None."""
    out = {}
    for pid in pids:
        try:
            out[pid] = process_info(pid)
        except MissingLibraryError:
            out[pid] = None
    return out


# A router or a client on a GPU host is never an SGLang server's leftover, whatever the stop's pattern matches
# (sglang_stop). Names as the processes show them (the program name sglang_stop's ``program_name`` reads from argv):
# - sglang-router (PyPI sglang-router, to 0.3.2): ``launch_router`` retitles its process ``sglang::router``
#   (sgl-router/py_src/sglang_router/launch_router.py); ``python -m sglang_router.launch_server`` starts servers
#   (titled ``sglang::server``, SGLang servers) and then becomes that router itself.
# - smg (its successor, PyPI smg 1.x): ``smg::router`` (bindings/python/src/smg/launch_router.py), the console
#   script ``smg`` (``smg launch``, ``smg serve``, ``smg server``) and ``python -m smg.launch_router``.
# - SGLang's own clients: ``-m sglang.bench_serving``, ``sglang.bench_one_batch_server`` (HTTP load against a
#   server), ``sglang.check_env``, ``sglang.profiler`` (POST /start_profile), ``sglang.version``.
# Not routers: SGLang's ``sglang::detokenizer_router`` (multi-tokenizer mode, srt/managers/multi_tokenizer_mixin.py)
# is a process of a server; ``sglang.bench_one_batch`` and ``sglang.bench_offline_throughput`` run the model in
# their own process (they hold the GPUs like a server).
ROUTER_TITLES = frozenset(("sglang::router", "smg::router"))
ROUTER_MODULE_PREFIXES = ("sglang_router", "smg")
ROUTER_PROGRAMS = frozenset(("smg", "sglang-router", "sglang_router"))
CLIENT_MODULES = frozenset(("sglang.bench_serving", "sglang.bench_one_batch_server", "sglang.check_env",
                            "sglang.profiler", "sglang.version", "sglang.multimodal_gen.benchmarks.bench_serving"))


def sglang_bystander(program, subcommand=None):
    """``"router"``, ``"client"`` or None: whether a process whose program name is ``program`` (a ``sglang::``
    title, the module after ``-m``, a script path or argv[0]; ``subcommand`` the word after it) is an SGLang
    router or client, which a stop must never take for a server's leftover (see the names above)."""
    if not program:
        return None
    if program in ROUTER_TITLES or program.startswith("smg::"):
        return "router"
    if program.startswith("sglang::"):
        return None  # every other sglang:: title is a process of a server (scheduler, detokenizer, ...)
    if any(program == m or program.startswith(m + ".") for m in ROUTER_MODULE_PREFIXES):
        return "router"
    if os.path.basename(program) in ROUTER_PROGRAMS:
        return "router"
    if program in CLIENT_MODULES or (os.path.basename(program) == "sglang" and subcommand == "version"):
        return "client"
    return None
