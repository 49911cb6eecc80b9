#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: host facts the preflight needs before an SGLang server is stopped.
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_host_info
short_description: What a restart will meet on a host (disk, /dev/shm, port, GPU holders, write access)
description:
  - Reports free space (MiB) on the filesystems holding O(paths) (C(os.statvfs); a path that does not exist yet
    is measured on its nearest existing parent), the size and free space of O(shm_path) and the stale
    SGLang/NCCL segments in it (C(nccl-*), C(cuda.shm.*), C(sgl_shm_*); listed, never removed).
  - Reports who listens on TCP O(port) (C(psutil.net_connections(kind="tcp")), status C(LISTEN)) with pid and
    command line, and whether that process is the managed server or one of its descendants, where the managed
    server is the pid in O(pid_file) or the C(MainPID) of O(systemd_unit).
  - "With O(stop_preview) (the result of the C(sglang_stop) module run in check mode) and O(gpu_info) (the result
    of C(nvidia_gpu_info) with C(processes=true)), foresees what the wait for free GPU memory will see after the
    stop: per GPU the memory left once the stop set (the pids the stop would signal, plus the members of
    O(systemd_unit)'s cgroup, which C(systemctl stop) ends) has gone, and the processes outside the stop set that
    hold GPU memory (RV(gpu_after_stop))."
  - "With O(stop_preview), /dev/shm space that the stop frees counts as free: segments the stop would remove now
    and segments held only by stop-set processes (removed as stale after they die) (RV(shm.free_after_stop_mib))."
  - "Write access (C(os.access) as the user the module runs as, so run it with the same C(become) as the task that
    will write): O(replace_files) need a writable directory (a temporary file is renamed over them) and must not be
    mount points of their own (a file bind-mounted there: the rename fails with EBUSY; from C(/proc/self/mountinfo));
    O(write_dirs) must be writable, or creatable under their nearest existing parent (RV(write_access))."
  - Local model directories (O(model_dirs)) must hold one of their marker files, e.g. C(config.json); an empty
    directory (an unmounted mount point) does not (RV(model_dirs)).
  - Never changes anything.
version_added: "1.0.0"
author: gpufleet maintainers (!UNKNOWN)
requirements:
  - psutil (on the managed host, in the interpreter Ansible runs there) when O(port) is given
options:
  paths:
    description: Paths whose filesystem's free space is reported.
    type: list
    elements: path
    default: []
  shm_path:
    description: The shared-memory filesystem NCCL and SGLang use.
    type: path
    default: /dev/shm
  port:
    description: TCP port whose listeners are reported (the SGLang HTTP port).
    type: int
  host:
    description:
      - Address the server will bind (C(--host)); decides which listeners conflict. A listener on the same
        address, or either side on a wildcard address (C(0.0.0.0), C(::)), conflicts.
    type: str
    default: 127.0.0.1
  pid_file:
    description: Pid file of the managed server (C(launch_method=process)); a missing file means no managed server.
    type: path
  systemd_unit:
    description: Unit whose C(MainPID) is the managed server (C(launch_method=systemd)), read with C(systemctl show).
    type: str
  stop_preview:
    description:
      - "The registered result of the C(sglang_stop) module run with C(check_mode=true) and the stop's own options.
        Keys read: C(signalled[].pid) (the stop set), C(removed_shm), C(kept_shm[]) (C(path), C(holders), C(reason))."
      - Omitted means nothing would be stopped.
    type: dict
  gpu_info:
    description:
      - "The registered result of C(nvidia_gpu_info) with C(processes=true). Keys read: C(gpus[]) (C(index),
        C(memory_used_mib), C(processes[]) with C(pid), C(used_memory_mib), C(user), C(cmdline), C(name),
        C(source)) and C(device_holders[]) (C(pid), C(gpu_indices), C(name))."
      - Omitted means no GPU foresight (RV(gpu_after_stop) absent).
    type: dict
  max_used_mib:
    description:
      - Used memory per GPU, MiB, at or below which the wait counts a GPU as free (C(gpu_memory_wait_max_used_mib)).
    type: int
    default: 1024
  world_size:
    description:
      - tp-size x pp-size of the server to start (sglang_launch_args). Above 1, RV(gpu_after_stop.tp_balance) says
        whether SGLang's TP memory-balance check would refuse to start beside memory the stop leaves.
    type: int
    default: 1
  server_env:
    description:
      - The server's extra environment (C(sglang_launch_extra_env)); C(SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false)
        there switches SGLang's balance check off.
    type: dict
    default: {}
  replace_files:
    description:
      - Files that will be replaced (temporary file in the same directory, then rename), e.g. SGLang's C(engine.py).
    type: list
    elements: path
    default: []
  write_dirs:
    description: Directories that will be written into, created when missing (e.g. the state directory).
    type: list
    elements: path
    default: []
  model_dirs:
    description:
      - "Local model directories to check: SGLang flag (dashes or the underscore dest name) to path. Each must be a
        directory holding one of the flag's O(model_markers)."
    type: dict
    default: {}
  model_markers:
    description:
      - Flag (with dashes) to the file names one of which its directory must hold; unlisted flags need C(config.json).
    type: dict
    default: {}
  lock_dir:
    description:
      - "The restart lock directory (C(gpufleet_lock)) to read, not take: RV(restart_lock) names who holds it. A
        preflight asks so that a host another run is restarting is refused for that reason, not for the GPU
        memory, port and C(/dev/shm) that run's stop and launch hold at that moment."
    type: path
  lock_lease_s:
    description:
      - With O(lock_dir), the lease (s) assumed for a lock written by an earlier release without lease fields
        (judged by its mtime, as C(gpufleet_lock) judges it with the lease asked for). Locks with a lease carry
        their own.
    type: int
    default: 300
  owned_paths:
    description:
      - "Files and directories gpufleet trusts (variable name to path: C(sglang_state_dir), C(launch.json), the key
        file). Each one that exists, and every directory above it, must belong to root or to the user the module
        runs as, and be writable by nobody else (a directory with the sticky bit above it may be): the module
        C(gpufleet_trust) (StrictModes' rule, sticky directories excepted) says why in its docstring. A missing
        one is fine, unless another user could create it first (RV(ownership))."
    type: dict
    default: {}
  root_interpreters:
    description:
      - "Interpreters root runs (a label, e.g. the variable naming it, to its path): each one, its virtualenv
        (C(pyvenv.cfg), C(site-packages) and what its C(.pth) files add) and its standard library must belong to
        root and be writable by nobody else, or a C(.pth) file another user drops there runs as root (RV(root_code)).
        Judged from the files alone: the interpreter is never run to find out."
    type: dict
    default: {}
  root_interpreter_self:
    description:
      - "The interpreter running this module (C(ansible_python_interpreter), or the one Ansible discovered) is also
        run as root by other tasks (become, or a root login): judge it as O(root_interpreters) does, labelled
        C(ansible_python_interpreter). Run this check without become, so it is judged before root runs it."
    type: bool
    default: false
  launch_record:
    description:
      - "A launch record (C(sglang_launch_record_file)) to read for a rollback: its ownership as O(owned_paths)
        judges it, then its content against gpufleet's schema (module_utils C(gpufleet_launch_record)); returned
        only when both pass (RV(launch_record))."
    type: path
  launch_unit_dir:
    description: Where the rollback writes the recorded unit (C(sglang_launch_unit_dir)); the C(unit_path) of RV(launch_record.record) is always in it.
    type: path
    default: /etc/systemd/system
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Only reads; identical in check mode.
  diff_mode:
    support: none
    details: Nothing is changed.
  platform:
    support: full
    platforms: linux
notes:
  - Known GPU monitors (C(nvidia-persistenced), C(nvidia-smi), DCGM, exporters; by process name) hold device files but
    no memory and are never reported as holders.
  - "Where the driver's per-process accounting is incomplete (inside a container without the host PID namespace the
    compute-process list is empty or names pids not visible here; per-process memory can be N/A), a GPU still over
    O(max_used_mib) counts as released by the stop when a stop-set process holds its C(/dev/nvidia<N>), and as
    blocking otherwise."
  - Without root, C(psutil) cannot see the pid of sockets owned by other users; such a listener is reported with
    RV(port.listeners[].pid) null and counts as not managed. Run the module with become to see it.
"""

EXAMPLES = r"""
- name: Read disk, /dev/shm and port facts
  gpufleet.fleet.sglang_host_info:
    paths: [/var/lib/gpufleet, /models/target]
    port: 30000
    host: 127.0.0.1
    pid_file: /var/lib/gpufleet/sglang.pid
  register: host_facts

- name: The port must be free or held by the server being replaced
  ansible.builtin.assert:
    that: host_facts.port.free or host_facts.port.held_by_managed

- name: What the stop would end (signals nothing)
  gpufleet.fleet.sglang_stop:
    pid_file: /var/lib/gpufleet/sglang.pid
  check_mode: true
  register: stop_preview

- name: GPUs and their processes
  gpufleet.fleet.nvidia_gpu_info:
  register: gpu

- name: Foresee GPU memory and /dev/shm after the stop, and write access for the NCCL patch
  gpufleet.fleet.sglang_host_info:
    stop_preview: "{{ stop_preview }}"
    gpu_info: "{{ gpu }}"
    replace_files: [/opt/sglang/.venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py]
    write_dirs: [/var/lib/gpufleet]
    model_dirs: {model-path: /models/Llama-3.1-8B-Instruct}
    model_markers: {model-path: [config.json]}
  register: foresight
"""

RETURN = r"""
disk:
  description: One entry per O(paths) item, in order.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The path asked for.
      type: str
    measured_path:
      description: The existing path measured (the path or its nearest existing parent).
      type: str
    exists:
      description: Whether the path itself exists.
      type: bool
    free_mib:
      description: Space available to unprivileged users (f_bavail), MiB.
      type: int
    total_mib:
      description: Filesystem size, MiB.
      type: int
shm:
  description: The shared-memory filesystem.
  returned: always
  type: dict
  contains:
    path:
      description: "O(shm_path)."
      type: str
    exists:
      description: Whether it exists.
      type: bool
    size_mib:
      description: Size, MiB.
      type: int
    free_mib:
      description: Free space (f_bavail), MiB.
      type: int
    used_mib:
      description: Used space, MiB.
      type: int
    stale_segments:
      description: Entries named like SGLang/NCCL segments (C(nccl-*), C(cuda.shm.*), C(sgl_shm_*)), with size in MiB.
      type: list
      elements: dict
      sample: [{"name": "nccl-a1b2c3", "size_mib": 9.0}]
    freed_by_stop_mib:
      description: Space (allocated blocks, MiB) of the segments the stop frees (see O(stop_preview)); 0 without it.
      type: float
    free_after_stop_mib:
      description: RV(shm.free_mib) plus RV(shm.freed_by_stop_mib), MiB.
      type: int
    kept_segments:
      description: Matching segments the stop leaves in place, with size (MiB) and why (holders and the stop's reason).
      type: list
      elements: dict
      sample: [{"name": "nccl-x", "size_mib": 600.0, "holders": [77], "reason": "held by pids 77",
                "text": "nccl-x (600.0 MiB, held by pids 77)"}]
port:
  description: Listeners on O(port); absent when O(port) is not given.
  returned: when O(port) is given
  type: dict
  contains:
    port:
      description: The port.
      type: int
    free:
      description: No listener conflicts with O(host).
      type: bool
    held_by_managed:
      description: Every conflicting listener is the managed server or its descendant (false when free).
      type: bool
    listeners:
      description: Every TCP listener on the port.
      type: list
      elements: dict
      contains:
        address:
          description: Bound address.
          type: str
        pid:
          description: Owning process, null when not visible.
          type: int
        cmdline:
          description: Its command line (argv).
          type: list
        conflicts:
          description: Whether it blocks binding O(host).
          type: bool
        managed:
          description: It is the managed server or a descendant of it.
          type: bool
managed_pid:
  description: Pid of the managed server from O(pid_file) or O(systemd_unit); null when none.
  returned: always
  type: int
managed_running:
  description: Whether RV(managed_pid) is a live process.
  returned: always
  type: bool
stop_pids:
  description: "The stop set: pids in O(stop_preview) plus the live members of O(systemd_unit)'s cgroup."
  returned: always
  type: list
  elements: int
gpu_after_stop:
  description: What the wait for free GPU memory would see once the stop set has gone.
  returned: when O(gpu_info) is given
  type: dict
  contains:
    blocked:
      description: True when RV(gpu_after_stop.holders) is not empty.
      type: bool
    gpus:
      description: Per GPU C(index), C(memory_used_mib), C(memory_total_mib), C(memory_reserved_mib), C(stop_set_mib)
        (memory of stop-set compute processes), C(remaining_mib) (used minus that, MiB), C(held_by_stop_set) (a
        stop-set process uses or holds it), C(foreign_listed) (a listed process outside the stop set uses it) and
        C(accounting) (C(complete) when every compute process is visible here with its MiB, else C(incomplete)).
      type: list
      elements: dict
    holders:
      description: "Processes outside the stop set that hold GPU memory (the driver lists them as compute processes):
        C(pid), C(user), C(cmdline), C(used_memory_mib) (sum over GPUs, null when unknown), C(gpu_indices), C(text)
        (one line naming them)."
      type: list
      elements: dict
      sample: [{"pid": 5150, "user": "bob", "cmdline": "python train.py", "used_memory_mib": 20009,
                "gpu_indices": [3], "text": "pid 5150 (user bob) holds 20009 MiB on GPU 3: python train.py"}]
    unexplained:
      description: GPUs whose memory left after the stop exceeds O(max_used_mib) with no process outside the stop
        set to blame (a process in another PID namespace, a zombie, memory not yet released); C(index),
        C(remaining_mib), C(other_holders) (non-monitor pids holding its device file), C(text). The old server
        runs beside that memory, so it is RV(gpu_after_stop.baseline_mib), not a reason to refuse.
      type: list
      elements: dict
    baseline_mib:
      description: "C({GPU index (str): MiB}) held by others while the server runs, for the GPUs of
        RV(gpu_after_stop.unexplained): the wait after the stop (option C(baseline_mib) of C(nvidia_gpu_wait)) counts
        such a GPU free at that memory plus O(max_used_mib)."
      type: dict
      sample: {"3": 20018}
    tp_balance:
      description: Why SGLang would refuse to start beside RV(gpu_after_stop.baseline_mib) (its TP memory-balance
        check), with what to do; empty when it would start.
      type: str
    unreadable:
      description: "Fields the wait reads that a GPU cannot report: C(index), C(uuid), C(field) (C(memory.used),
        C(memory.total), C(compute-apps pid), C(compute-apps used_memory), C(the compute-apps list)) and C(raw) (what
        was read: C([N/A]), C([Unknown Error]), an NVML error)."
      type: list
      elements: dict
write_access:
  description: One entry per O(replace_files) then O(write_dirs) item.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: >-
        The path asked for.
      type: str
    purpose:
      description: >-
        C(replace) (O(replace_files)) or C(write) (O(write_dirs))
      type: str
    user:
      description: >-
        The user the check ran as (effective uid).
      type: str
    ok:
      description: >-
        Whether the write will work.
      type: bool
    checked_path:
      description: >-
        The directory whose permissions decide (the file's directory, the directory, or its nearest existing
        parent).
      type: str
    file_writable:
      description: >-
        For C(replace): whether the file itself is writable (null when missing).
      type: bool
    reason:
      description: >-
        Why not (null when RV(write_access[].ok)): owner, mode, read-only filesystem, or (for C(replace)) the file
        being a mount point of its own.
      type: str
ownership:
  description: One entry per O(owned_paths) item that cannot be trusted (empty when every one can).
  returned: always
  type: list
  elements: dict
  contains:
    variable:
      description: >-
        The name it was given under.
      type: str
    path:
      description: >-
        The path asked for.
      type: str
    problems:
      description: "Each path at fault: C(path), C(owner), C(uid), C(mode) (octal text), C(reason)."
      type: list
      elements: dict
    text:
      description: >-
        One sentence naming the file, its owner and mode, and what to do.
      type: str
root_code:
  description: One entry per interpreter of O(root_interpreters) (and O(root_interpreter_self)) root must not run.
  returned: always
  type: list
  elements: dict
  contains:
    variable:
      description: >-
        The label it was given under.
      type: str
    interpreter:
      description: >-
        The interpreter's path.
      type: str
    problems:
      description: "Each path at fault: C(path), C(owner), C(uid), C(mode), C(reason)."
      type: list
      elements: dict
    text:
      description: >-
        One sentence naming the interpreter, the paths and their owners, and what to do.
      type: str
launch_record:
  description: With O(launch_record), what was found there.
  returned: when O(launch_record) is given
  type: dict
  contains:
    path:
      description: >-
        The record file.
      type: str
    exists:
      description: >-
        Whether it exists.
      type: bool
    valid:
      description: >-
        Whether it may be used (trusted owner and modes, and gpufleet's schema).
      type: bool
    reason:
      description: >-
        Why not (null when valid or missing).
      type: str
    record:
      description: "The checked record (only the keys the rollback reads; C(unit_path) is O(launch_unit_dir)/C(unit_name)),
        or null."
      type: dict
restart_lock:
  description:
    - With O(lock_dir), the lock's holder as C(gpufleet_lock) module_utils C(read_holder) reads owner.json - run_id,
      controller, pid, user, started, renewed, lease_s, expires (host clock), remaining_s (s, negative once the
      lease ended), expired (bool); null when there is no lock.
  returned: when lock_dir is set
  type: dict
  sample: {run_id: "20261203T101500Z-123456", controller: awx-1, pid: 4242, user: awx, lease_s: 300,
           expires: "2026-12-03T10:20:00Z", remaining_s: 211.4, expired: false}
restart_lock_error:
  description: Why the lock in O(lock_dir) could not be read (permissions, a damaged owner.json).
  returned: when that read failed
  type: str
model_dirs:
  description: One entry per O(model_dirs) item, C(flag) (with dashes), C(path), C(is_dir), C(markers), C(found)
    (the marker file present, null when none).
  returned: always
  type: list
  elements: dict
"""

import fnmatch
import gc
import os
import pwd
import re
import stat
import sys

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import KNOWN_MONITORS
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_argv, redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_lock
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_launch_record
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_managed_server
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_managed_server import (  # noqa: F401 pylint: disable=unused-import
    pid_running,
    read_pid_file,
)
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
WILDCARDS = ("0.0.0.0", "::", "")


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


def _conflicts(bound, wanted):
    """Whether a listener bound to ``bound`` blocks binding ``wanted`` on the same port (no SO_REUSEPORT)."""
    bound, wanted = bound or "", wanted or ""
    if bound in WILDCARDS or wanted in WILDCARDS:
        return True
    return bound == wanted or (bound.startswith("::ffff:") and bound[7:] == wanted)


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
    """TCP listeners on ``port`` (psutil.net_connections(kind="tcp"), status LISTEN), with conflict/managed flags."""
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr[1] != port:
            continue
        cmdline = None
        if conn.pid is not None:
            try:
                cmdline = redact_argv(psutil.Process(conn.pid).cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                cmdline = None
        out.append({"address": conn.laddr[0], "pid": conn.pid, "cmdline": cmdline,
                    "conflicts": _conflicts(conn.laddr[0], host),
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


def main():
    module = AnsibleModule(
        argument_spec=dict(
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
        ),
        mutually_exclusive=[["pid_file", "systemd_unit"]],
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    p = module.params
    if p["port"] is not None and not 0 < p["port"] < 65536:
        module.fail_json(msg="port must be between 1 and 65535, got %d" % p["port"])
    try:
        server = gpufleet_managed_server.find_managed_server(
            p["pid_file"], p["systemd_unit"], run_command=lambda argv: module.run_command(
                argv, environ_update={"LC_ALL": "C"}),
            systemctl=module.get_bin_path("systemctl", required=True) if p["systemd_unit"] else None)
    except gpufleet_managed_server.ServerFindError as exc:
        module.fail_json(msg=exc.msg, **exc.kwargs)
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
        module.fail_json(msg="cannot measure free space: %s" % exc)
    if p["gpu_info"] is not None:
        after = gpu_after_stop(p["gpu_info"], stop_pids, p["max_used_mib"])
        after["tp_balance"] = tp_balance_problem(after["gpus"], after["baseline_mib"], p["world_size"],
                                                 p["server_env"])
        result["gpu_after_stop"] = after
    if p["port"] is not None:
        if not HAS_PSUTIL:
            module.fail_json(msg=missing_required_lib("psutil", reason="to find the process listening on the port"),
                             exception=str(PSUTIL_IMPORT_ERROR))
        try:
            result["port"] = port_info(p["port"], p["host"], managed_pid if result["managed_running"] else None)
        except psutil.AccessDenied as exc:
            module.fail_json(msg="not allowed to list TCP sockets (%s); run with become" % exc)
    result["ownership"] = [entry for entry in (ownership_check(name, path)
                                               for name, path in sorted(p["owned_paths"].items())) if entry]
    interpreters = sorted(p["root_interpreters"].items())
    if p["root_interpreter_self"]:
        interpreters.insert(0, ("ansible_python_interpreter", sys.executable))
    seen = set()
    result["root_code"] = []
    for name, python in interpreters:
        if python and python not in seen:
            seen.add(python)
            entry = root_code_check(name, python)
            if entry:
                result["root_code"].append(entry)
    if p["launch_record"]:
        result["launch_record"] = read_launch_record(p["launch_record"], p["launch_unit_dir"])
    if p["lock_dir"]:
        try:
            result["restart_lock"] = gpufleet_lock.read_holder(p["lock_dir"].rstrip("/"), max(p["lock_lease_s"], 1))
        except gpufleet_lock.LockError as exc:
            result.update(restart_lock=None, restart_lock_error=str(exc))
    module.exit_json(**result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
