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
version_added: "0.1.0"
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
      - "Address the server will bind (C(--host)); decides which listeners conflict, as the launch decides
        (C(gpufleet_ports) module_utils): the same address conflicts; C(0.0.0.0) with every IPv4 address;
        C(::) with every address, IPv4 too (taken as dual-stack); an IPv4-mapped C(::ffff:a.b.c.d) as its IPv4
        address; C(::1) and C(127.0.0.1) do not."
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


import gc

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_host_measure import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    HAS_PSUTIL,
    MEASURE_OPTIONS,
    MIB,
    SEGMENT_PATTERNS,
    WILDCARDS,
    MeasureError,
    _why_not,
    cgroup_of,
    dir_access,
    disk_free,
    gpu_after_stop,
    is_monitor,
    is_same_or_descendant,
    listeners_on,
    measure,
    model_dir_check,
    mount_points,
    nearest_existing,
    ownership_check,
    port_info,
    read_launch_record,
    replace_access,
    shm_info,
    stop_set,
    unit_members,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_managed_server import (  # noqa: F401 pylint: disable=unused-import
    pid_running,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_trust import root_code_check  # noqa: F401 pylint: disable=unused-import


def run_command(module):
    """run_command for measure(): the module's, in the C locale (systemctl's output is parsed)."""
    return lambda argv: module.run_command(argv, environ_update={"LC_ALL": "C"})


def main():
    module = AnsibleModule(
        argument_spec=dict(MEASURE_OPTIONS),
        mutually_exclusive=[["pid_file", "systemd_unit"]],
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    try:
        result = measure(module.params, run_command=run_command(module), get_bin_path=module.get_bin_path)
    except MeasureError as exc:
        module.fail_json(msg=exc.msg, **exc.kwargs)
    module.exit_json(**result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
