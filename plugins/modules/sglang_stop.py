#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: stop the SGLang server gpufleet launched and SGLang leftovers in one grace period; clean stale shm.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_stop
short_description: Stop an SGLang server and its leftover processes, scoped so nothing else is signalled
description:
  - Stops the SGLang server started by gpufleet and SGLang processes left over from earlier servers, all in one
    grace period, then removes stale shared-memory segments.
  - "What is stopped: the process named by O(pid_file) (written by the C(sglang_process) module), every
    process of its session/process group and its other descendants (reason C(pid_file), C(process_group),
    C(process_tree)), and every other process that
    runs SGLang (reason C(pattern)), orphaned workers re-parented to PID 1 included. For the systemd method the
    role stops the unit first (C(KillMode=control-group)) and this module then ends what is left outside it."
  - "How: all of them get SIGTERM at the same moment; the module waits once, up to O(grace_s) seconds from that
    moment, for all of them together (polling every O(poll_interval_ms)), then sends SIGKILL to the survivors
    and waits up to O(kill_timeout_s). Signalling orphans together with the server matters: an orphaned worker
    keeps multiprocessing's resource tracker (a child of the server, which ignores SIGTERM and exits when its
    pipe closes) alive, so waiting for the server's group before signalling the orphan cost the whole grace."
  - "Defunct processes with live threads: a process whose main thread exited while another thread lives shows
    as C(<defunct>) (state Z) but still holds its GPU memory (its fds, its mm). It counts as alive: it gets
    SIGKILL at once (a Python signal handler would never run without the main thread) and is gone only when
    its last thread is (C(/proc/<pid>/task/*/stat)). Its command line is read from a live thread
    (C(/proc/<pid>/task/<tid>/cmdline)); a defunct process whose threads all ended holds nothing and is skipped."
  - "Which processes run SGLang: decided from the argument vector, never from a substring of the whole command
    line. A process's I(program name) is its title when it starts with C(sglang::) (setproctitle writes the
    whole title into argv[0]: C(sglang::scheduler_TP0), C(sglang::detokenizer)); the module after C(-m) when
    argv[0] is a Python interpreter (C(python3 -m sglang.launch_server)); the script when an interpreter runs a
    file (C(python3 /x/sglang/launch_server.py)); argv[0] otherwise. When the argument after the program is
    not an option it is the I(subcommand) (C(sglang serve)). A process runs SGLang when O(pattern) matches the
    whole program name, or the program name, a space and the subcommand. So C(grep sglang.launch_server),
    C(pgrep -af sglang::scheduler), C(bash -c '... sglang ...'), C(vim .../sglang/launch_server.py) and
    C(tail -f sglang.log) are never chosen."
  - "Never taken for a leftover, whatever O(pattern) matches: an SGLang router (C(sglang::router),
    C(smg::router), C(python -m sglang_router.launch_router), C(sglang_router.launch_server)'s router process,
    C(smg)) or client (C(python -m sglang.bench_serving), C(sglang.bench_one_batch_server), C(sglang.check_env),
    C(sglang.profiler)); they are listed in RV(kept) and named in RV(progress) (C(kept: router pid N)). A process
    of the server's own process group or tree (reasons C(pid_file), C(process_group), C(process_tree)) is the
    server's and is stopped whatever its title."
  - "Never signalled, whatever they hold open (C(/dev/nvidia*) included): processes of users not in O(users),
    processes whose command line matches O(protect_pattern) (nvidia-persistenced, DCGM, exporters, nvidia-smi),
    and this module's own process and its ancestors. Processes are never chosen because they hold a GPU device."
  - "Exit status 137 of a server that received SIGTERM is a normal stop: SGLang up to 0.5.18 SIGKILLs its own
    process tree at the end of shutdown."
  - "Progress (modules cannot stream output): with O(slice_s) the call returns after at most that many seconds
    with C(done=false) and a C(progress) line while the grace runs; call again with O(resume) set to the first
    call's result until C(done) (the C(sglang_stop) role loops with C(until)/C(retries)). Detection stays as fast
    as in one long call (O(poll_interval_ms)); the grace counts from the first call's signals."
  - Stale segments in O(shm_dir) matching O(shm_patterns) are removed only when no live process maps or holds
    them open and they belong to one of O(users).
  - "Check mode: signals nothing and removes nothing; C(signalled) lists every process the stop would end
    (server, its whole process group, leftovers, defunct processes with live threads), each with pid, cmdline,
    user and C(ended=would signal); the preflight uses this to learn which GPU holders the stop will end."
  - Requires psutil on the target (the SGLang virtualenv has it).
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  pid_file:
    description:
      - Pid file written when the server was launched (C(<sglang_state_dir>/sglang.pid)). Optional; a missing
        file means only leftovers are looked for. A pid file whose process is gone or started after the file
        was written (pid reuse) is stale and is removed without signalling anything.
    type: path
  users:
    description:
      - Only processes owned by these users are signalled (and only their shm segments removed).
      - Empty (default) means the user this module runs as.
    type: list
    elements: str
    default: []
  grace_s:
    description: Seconds after the SIGTERM (the server drains in-flight requests) before SIGKILL, one period
      for the server and all leftovers together.
    type: float
    default: 60
  kill_timeout_s:
    description: Seconds to wait after SIGKILL before failing with the processes still alive.
    type: float
    default: 15
  poll_interval_ms:
    description: Milliseconds between checks whether the signalled processes are gone (1 to 100).
    type: int
    default: 100
  slice_s:
    description:
      - Return after at most this many seconds while the grace period runs, with C(done=false) and
        C(progress); the next call passes this result as O(resume). Unset means one call does the whole stop.
      - The SIGKILL wait (O(kill_timeout_s)) is not sliced.
    type: float
  resume:
    description:
      - The registered result of the call that sent the signals (or of a later slice), to go on waiting for the
        same processes (identified by pid and start time, so a reused pid is never signalled). Uses its
        C(started_at), C(signalled) and C(main_pid); nothing new is selected or signalled with SIGTERM.
      - A result with C(done=true) is returned unchanged.
    type: dict
  pattern:
    description:
      - Regular expression that must match a process's whole program name (Python C(re.fullmatch); see the
        description for what the program name is) for the process to count as SGLang. It is never searched
        in the whole command line.
      - "The default accepts a C(sglang::) title, a module C(sglang) or C(sglang.<name>) (C(-m sglang.launch_server),
        C(-m sglang.srt...)), a program C(sglang) with subcommand C(serve)
        (C(sglang serve), the launcher from 0.5.6), and a script path ending in C(sglang/launch_server.py)."
    type: str
    default: 'sglang::.*|sglang\.[\w.]+|([^ ]*/)?sglang serve|([^ ]*/)?sglang/launch_server\.py'
  protect_pattern:
    description:
      - Regular expression (searched in the whole command line) for processes never signalled even when they
        run SGLang or sit in the server's process group (GPU monitors and exporters).
    type: str
    default: 'nvidia-persistenced|nv-hostengine|dcgm|exporter|nvidia-smi|nvidia-fabricmanager'
  remove_stale_shm:
    description: Remove stale shared-memory segments after the processes are gone.
    type: bool
    default: true
  shm_dir:
    description: Directory of POSIX shared-memory segments.
    type: path
    default: /dev/shm
  shm_patterns:
    description: Shell-style name patterns of SGLang/NCCL/CUDA segments.
    type: list
    elements: str
    default: ['nccl-*', 'cuda.shm.*', 'sgl_shm_*']
  gpu_wait:
    description:
      - "When set, after every signalled process is gone (and the shm clean-up), wait on the target until GPU
        memory is released, with the same loop, backends and messages as the M(gpufleet.fleet.nvidia_gpu_wait) module
        (C(gpufleet_gpu_wait) module_utils): one round trip less than a separate wait task."
      - "This call waits at most O(gpu_wait.slice_s) seconds (all of O(gpu_wait.timeout_s) when unset) and never
        fails because of the wait: RV(gpu_wait) says whether the memory was seen released (C(ready)), since
        when the wait runs (C(started_at)), and on a timeout or a GPU layer error its C(error_class) and message.
        The C(gpu_memory_wait) role skips its own wait when C(ready) is true and otherwise goes on from
        C(started_at), so a failure is reported by the wait phase (the old server is stopped; rollback
        relaunches it)."
      - Not used in check mode (nothing was stopped) nor when the stop fails.
    type: dict
    suboptions:
      gpus:
        description: GPUs to wait for, each an index or a UUID; empty means every GPU.
        type: list
        elements: raw
        default: []
      max_used_mib:
        description: A GPU counts as free at or below this used memory, MiB (reserved memory excluded).
        type: int
        default: 1024
      require_no_processes:
        description: Also require that no compute process is left on the GPUs (monitors do not count).
        type: bool
        default: false
      poll_interval_ms:
        description: Milliseconds between the starts of two polls (at least 1).
        type: int
        default: 50
      timeout_s:
        description: Seconds the whole wait may take, counted from its start (C(started_at)), in this call and the caller's later ones.
        type: float
        default: 120
      slice_s:
        description: Seconds this call waits at most; unset means up to O(gpu_wait.timeout_s).
        type: float
      expected_count:
        description: GPUs the host must have; fewer is recorded as C(error_class=fewer_gpus).
        type: int
      backend:
        description: C(auto) (NVML, else nvidia-smi), C(nvml) or C(nvidia-smi).
        type: str
        choices: [auto, nvml, nvidia-smi]
        default: auto
      baseline_mib:
        description: "C({GPU index: MiB}) others held while the old server ran (sglang_host_info's
          C(gpu_after_stop.baseline_mib)): such a GPU counts as free at that plus O(gpu_wait.max_used_mib)."
        type: dict
        default: {}
  start_after:
    description:
      - "The new server to start in this same call, as soon as the stop is done and O(gpu_wait) saw the GPU memory
        released: the outage then ends when the new server serves, with no module start or controller task in
        between (each costs 0.1-1 s). It is started exactly as the M(gpufleet.fleet.sglang_process) module starts one
        (C(gpufleet_spawn) module_utils: own session under the C(gpufleet-reaper), pid file, exit record, log
        appended), as the user this module runs as."
      - "Right before the start, nothing may listen on O(start_after.port) at an address overlapping
        O(start_after.host); when something does, or the memory was not seen released, or the start itself
        fails, nothing is started and RV(start) says why (C(started=false), C(reason)): this call never fails
        because of O(start_after). The caller then starts the server itself (the C(sglang_launch) role runs
        M(gpufleet.fleet.sglang_process), whose port check fails naming the holder), so every failure keeps its usual message
        and rollback."
      - "Needs O(gpu_wait). Not used in check mode nor when the stop fails. The server's readiness is not
        awaited here: wait for it with M(gpufleet.fleet.sglang_process)
        O(gpufleet.fleet.sglang_process#module:state=ready) and RV(start.pid)/RV(start.log_offset)."
    type: dict
extends_documentation_fragment:
  - gpufleet.fleet.sglang_start.start_after
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reports C(signalled) and C(removed_shm) as what would happen; sends no signal, removes nothing, starts nothing.
  diff_mode:
    support: none
  platform:
    support: full
    platforms: linux
requirements:
  - psutil
notes:
  - "Sources: worker titles C(sglang::scheduler_TP<n>), C(sglang::detokenizer) are set with setproctitle
    (SGLang 0.4+); SGLang's own clean-up matches C(sglang::|sglang\\.launch_server|sglang\\.bench|sglang\\.data_parallel|sglang\\.srt)
    as a substring, which also hits a C(grep) or C(pgrep) looking for those words (gpufleet issue 10, finding 7):
    the program-name rule here replaces it. multiprocessing's resource tracker ignoring SIGTERM: CPython
    C(Lib/multiprocessing/resource_tracker.py) C(main())."
  - Fails when a process survives SIGKILL for O(kill_timeout_s) (for example stuck in uninterruptible I/O),
    listing pid, state and command line; the host then needs an operator.
  - Fails with a message on an invalid O(pattern)/O(protect_pattern), a pid file that does not hold a pid, a
    pid file naming a process the module may not signal, and a O(resume) that is not a result of this module.
"""

EXAMPLES = r"""
- name: Stop the server launched as a detached process, then leftovers, in one call
  gpufleet.fleet.sglang_stop:
    pid_file: /var/lib/gpufleet/sglang.pid
    users: [sglang]
    grace_s: 60

- name: The same in 10 s slices, printing progress between them
  gpufleet.fleet.sglang_stop:
    pid_file: /var/lib/gpufleet/sglang.pid
    users: [sglang]
    grace_s: 60
    slice_s: 10
  register: stop

- name: Go on waiting until everything is gone (SIGKILL after the grace)
  gpufleet.fleet.sglang_stop:
    pid_file: /var/lib/gpufleet/sglang.pid
    users: [sglang]
    grace_s: 60
    slice_s: 10
    resume: "{{ stop }}"
  register: stop_rest
  until: stop_rest.done | default(false) or stop_rest.failed | default(false)
  retries: 8
  delay: 0
  when: not stop.done

- name: What would be signalled (preflight), in check mode
  gpufleet.fleet.sglang_stop:
    users: [sglang]
  check_mode: true
  register: stop_preview
"""

RETURN = r"""
signalled:
  description: Every process signalled (or, in check mode, that would be), in the order they were signalled.
  returned: always
  type: list
  elements: dict
  contains:
    pid:
      description: >-
        Process id.
      type: int
    cmdline:
      description: >-
        Command line or title (/proc/<pid>/cmdline; of a live thread for a defunct process).
      type: str
    user:
      description: >-
        Owner.
      type: str
    reason:
      description: >-
        Why it was chosen: C(pid_file), C(process_group) (the server's session or process group), C(process_tree)
        (another descendant of the server) or C(pattern) (it runs SGLang).
      type: str
    defunct:
      description: >-
        True for a C(<defunct>) process whose other threads still live (gets SIGKILL at once).
      type: bool
    start_ticks:
      description: >-
        Start time in clock ticks after boot (/proc/<pid>/stat field 22); with the pid it identifies the process
        across slices.
      type: int
    signals:
      description: >-
        Signals sent in order (C(SIGTERM), C(SIGKILL)); empty in check mode.
      type: list
      elements: str
    ended:
      description: >-
        C(after SIGTERM), C(after SIGKILL), C(would signal) (check mode), C(waiting) (the grace still runs:
        C(done=false)) or C(still running) (survived SIGKILL).
      type: str
    wait_ms:
      description: >-
        Milliseconds from the signals until it was seen gone (with O(slice_s), a process that ended between two
        calls is seen at the next call's first check); null while it runs.
      type: int
  sample:
    - {pid: 4242, cmdline: "python -m sglang.launch_server --model-path /models/x", user: sglang,
       reason: pid_file, defunct: false, start_ticks: 881234, signals: [SIGTERM], ended: after SIGTERM, wait_ms: 5210}
kept:
  description:
    - "Routers and clients O(pattern) matched but that are never leftovers (see the description), left alone:
      C(pid), C(cmdline), C(user), C(kind) (V(router) or V(client)). RV(progress) ends with C(kept: router pid N, ...)
      when there are any."
  returned: always
  type: list
  elements: dict
  sample: [{pid: 3120, cmdline: "sglang::router", user: sglang, kind: router}]
done:
  description: True when the stop is over (everything gone, or check mode); false after a slice that ended
    while the grace still runs (call again with O(resume)).
  returned: always
  type: bool
started_at:
  description: When the signals were sent (seconds since the epoch, target clock); C(stop_ms) counts from it.
  returned: always
  type: float
progress:
  description: "One line on where the stop stands, for example: waiting for 3 of 12 processes to exit after
    SIGTERM: pid 4242 C(sglang::scheduler_TP3), ...; 20 s of 60 s grace, then SIGKILL."
  returned: always
  type: str
removed_shm:
  description: Paths of stale shared-memory segments removed (or that would be, in check mode); empty until C(done).
  returned: always
  type: list
  elements: str
  sample: [/dev/shm/nccl-Ab12Cd]
kept_shm:
  description: Matching segments kept, with the pids that still hold them or why they were kept.
  returned: always
  type: list
  elements: dict
  sample: [{path: /dev/shm/nccl-Zz, holders: [77], reason: held}]
main_pid:
  description: Pid read from O(pid_file) when it named a live server process, else null.
  returned: always
  type: int
pid_file_removed:
  description: Whether the pid file was removed (server gone or file stale); in check mode, whether it would be.
  returned: always
  type: bool
users:
  description: The users whose processes may be signalled (O(users) or the module's own user).
  returned: always
  type: list
  elements: str
stop_ms:
  description: Milliseconds from the signals (C(started_at)) to the end of this call.
  returned: always
  type: int
gpu_wait:
  description:
    - "The GPU memory wait after the stop (O(gpu_wait)): C(ready) (bool: every selected GPU was seen at or below
      C(max_used_mib) MiB), C(started_at) (epoch s, target clock, when the wait began), C(elapsed_ms) (ms from
      C(started_at) to the poll that saw the memory free, or to the end of this call), C(polls), C(progress)
      (one line), C(backend), C(gpus) (per GPU C(index), C(uuid), C(memory_used_mib), C(free), ...), and when it
      did not end well C(error_class) (C(not_released) when O(gpu_wait.timeout_s) ran out, or the GPU layer's
      class as in M(gpufleet.fleet.nvidia_gpu_wait): C(driver_not_loaded), C(timeout), ...) and C(msg) (the same message
      M(gpufleet.fleet.nvidia_gpu_wait) gives). C(error_class) and C(msg) are null after a release."
  returned: when O(gpu_wait) is set, the stop is done and not in check mode
  type: dict
  sample: {ready: true, started_at: 1796000000.25, elapsed_ms: 180, polls: 3, backend: nvml, error_class: null,
           progress: "GPU memory: all 8 GPUs at or below 1024 MiB with no compute process, after 0.18 s of 120 s"}
start:
  description: The start of O(start_after).
  returned: when O(start_after) is set, the stop is done and not in check mode
  type: dict
  sample: {started: true, pid: 51234, started_at: 1796000000.43, log_offset: 1048576, log_file: /var/lib/gpufleet/sglang.log}
  contains:
    started:
      description: Whether the new server was started.
      type: bool
    pid:
      description: The new server's pid.
      returned: when started
      type: int
    started_at:
      description: When it was started (epoch s, target clock).
      returned: when started
      type: float
    log_offset:
      description: Bytes of the log before this start; the new server's lines begin there.
      returned: when started
      type: int
    log_file:
      description: The server's log file.
      type: str
    pid_file:
      description: The pid file written for it.
      type: str
    exit_file:
      description: The file its exit status is written to.
      type: str
    argv:
      description: The command line, without the API key.
      type: list
      elements: str
    reason:
      description: >-
        Why nothing was started: memory not seen released, C(port 30000 taken by pid 4242 (...)), or the start's
        error.
      returned: when not started
      type: str
    listeners:
      description: The listeners that held the port.
      returned: when not started because the port was held
      type: list
      elements: dict
"""

import gc
import os
import time

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_wait
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_spawn

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_stop_plan import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    PID_REUSE_SLACK_S,
    PROGRESS_NAMES,
    PROTECT_PATTERN,
    PSUTIL_IMPORT_ERROR,
    Proc,
    SGLANG_PATTERN,
    StopPlanError,
    _INTERPRETER_RE,
    _PY_LONG_VALUE_OPTS,
    _PY_VALUE_OPTS,
    _allowed,
    _subcommand,
    _user_uids,
    choose,
    default_users,
    entry_for,
    kept_note,
    kill_survivors,
    live_threads,
    new_result,
    pid_file_process,
    plan_stop,
    poll_gone,
    process_alive,
    program_name,
    progress_line,
    protected_pids,
    psutil,
    read_argv,
    read_stat,
    runs_sglang,
    select_leftovers,
    select_server,
    send,
    shm_holders,
    shm_plan,
    signal_all,
    snapshot,
    stale_segments,
)


# ---------------------------------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------------------------------
def _resume_state(resume):
    """(started_at, entries, main_pid) from a previous result; ValueError naming what is missing."""
    started_at = resume.get("started_at")
    entries = resume.get("signalled")
    if not isinstance(started_at, (int, float)) or not isinstance(entries, list):
        raise ValueError("resume must be the registered result of an sglang_stop call (with started_at and "
                         "signalled); got keys %s" % sorted(resume)[:12])
    out = []
    for item in entries:
        if not isinstance(item, dict) or not isinstance(item.get("pid"), int):
            raise ValueError("resume.signalled holds an entry without an integer pid: %r" % (item,))
        entry = dict(item)
        entry["signals"] = list(entry.get("signals") or [])
        out.append(entry)
    return float(started_at), out, resume.get("main_pid")


def run(module, now=time.time):
    params = module.params
    check = module.check_mode
    users = default_users(params["users"])
    poll_s = params["poll_interval_ms"] / 1000.0
    grace_s, kill_timeout_s = params["grace_s"], params["kill_timeout_s"]
    result = new_result(users)
    pid_file = params["pid_file"]
    resume = params["resume"]

    if resume:
        if resume.get("done"):
            return dict(resume)
        try:
            started_at, entries, main_pid = _resume_state(resume)
        except ValueError as exc:
            module.fail_json(msg=str(exc), **result)
        result["main_pid"] = main_pid
        result["kept"] = list(resume.get("kept") or [])
    else:
        started_at = now()
        try:
            chosen = choose(pid_file, users, params["pattern"], params["protect_pattern"], result)
        except StopPlanError as exc:
            module.fail_json(msg=exc.msg, **exc.result)
        if check:
            entries = [entry_for(p, reason, "would signal") for p, reason in chosen]
        else:
            entries = signal_all(chosen)
    result["signalled"] = entries
    result["started_at"] = round(started_at, 3)

    if not check:
        slice_end = now() + params["slice_s"] if params["slice_s"] is not None else float("inf")
        grace_end = started_at + grace_s
        alive = poll_gone(entries, min(slice_end, grace_end), started_at, poll_s, now=now)
        if alive and now() < grace_end:
            # A slice ended while the grace runs: report where it stands; the caller resumes.
            result.update(changed=bool(entries), progress=progress_line(entries, started_at, grace_s, now()),
                          stop_ms=int((now() - started_at) * 1000))
            return result
        survivors = kill_survivors(entries, kill_timeout_s, started_at, poll_s, now=now) if alive else []
        if survivors:
            result.update(changed=True, done=True, stop_ms=int((now() - started_at) * 1000),
                          progress="%d process(es) survived SIGKILL" % len(survivors))
            module.fail_json(msg="%d process(es) survived SIGKILL for %.0f s (uninterruptible sleep?): %s; "
                             "the GPUs are not free, an operator must look at this host"
                             % (len(survivors), kill_timeout_s,
                                "; ".join("pid %d state %s %s" % (e["pid"], _state(e["pid"]), e["cmdline"])
                                          for e in survivors)), **result)

    if pid_file and os.path.exists(pid_file):
        if not check:
            os.unlink(pid_file)
        result["pid_file_removed"] = True

    if params["remove_stale_shm"]:
        removable, kept = shm_plan(params["shm_dir"], params["shm_patterns"], users)
        result["kept_shm"] = kept
        for path in removable:
            if not check:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    # A directory or an undeletable entry under the pattern: kept, named; the processes are
                    # already gone, so the stop itself has succeeded and must say so.
                    kept.append({"path": path, "holders": [], "reason": "could not remove: %s" % exc.strerror})
                    continue
            result["removed_shm"].append(path)

    if params["gpu_wait"] and not check:
        # After the processes are gone: the wait never fails the stop (see the gpu_wait option).
        result["gpu_wait"] = gpufleet_gpu_wait.wait_recorded(params["gpu_wait"], module.get_bin_path("nvidia-smi"))

    if params["start_after"] and not check:
        result["start"] = start_after(params["start_after"], result.get("gpu_wait") or {})

    result["done"] = True
    result["changed"] = bool(result["signalled"] or result["removed_shm"] or result["pid_file_removed"]
                             or (result.get("start") or {}).get("started"))
    result["stop_ms"] = 0 if check else int((now() - started_at) * 1000)
    result["progress"] = (("would signal %d process(es)" % len(entries)) if check
                          else progress_line(entries, started_at, grace_s, now()))
    if result["kept"]:
        result["progress"] += "; " + kept_note(result["kept"])
    return result


def start_after(spec, gpu_wait):
    """Start the server of ``spec`` (the O(start_after) suboptions) when ``gpu_wait`` (this call's RV(gpu_wait))
    saw the memory released and nothing listens on its port. Never raises for a refusal or a failed start:
    returns RV(start), ``{"started": False, "reason": str}`` then, so the caller starts it the usual way."""
    out = {"started": False, "log_file": spec["log_file"], "pid_file": spec["pid_file"],
           "exit_file": spec["exit_file"] or spec["pid_file"] + ".exit", "argv": list(spec["argv"])}
    if not gpu_wait.get("ready"):
        out["reason"] = "GPU memory not seen released by this call (%s)" % (
            gpu_wait.get("msg") or gpu_wait.get("progress") or "no gpu_wait result")
        return out
    try:
        listeners = gpufleet_spawn.port_listeners(spec["port"], spec["host"])
    except (OSError, psutil.Error) as exc:
        out["reason"] = "could not read who listens on port %d: %s" % (spec["port"], exc)
        return out
    if listeners:
        out["listeners"] = listeners
        out["reason"] = "port %d taken by %s" % (spec["port"], gpufleet_spawn.describe_listeners(listeners))
        return out
    for key in ("log_file", "pid_file"):
        if not os.path.isdir(os.path.dirname(os.path.abspath(spec[key]))):
            out["reason"] = "the directory of %s does not exist" % spec[key]
            return out
    try:
        started = gpufleet_spawn.start_server(spec["argv"], spec["env"], spec["inherit_env"], spec["chdir"],
                                              spec["log_file"], spec["pid_file"], out["exit_file"],
                                              api_key=spec["api_key"])
    except OSError as exc:
        out["reason"] = "could not start %s: %s" % (spec["argv"][0] if spec["argv"] else "?", exc)
        return out
    out.update(started=True, pid=started["pid"], started_at=round(started["started_at"], 3),
               log_offset=started["log_offset"])
    return out


def _state(pid):
    st = read_stat("/proc/%d/stat" % pid)
    return st[0] if st else "?"


def main():
    module = AnsibleModule(
        argument_spec=dict(
            pid_file=dict(type="path"),
            users=dict(type="list", elements="str", default=[]),
            grace_s=dict(type="float", default=60),
            kill_timeout_s=dict(type="float", default=15),
            poll_interval_ms=dict(type="int", default=100),
            slice_s=dict(type="float"),
            resume=dict(type="dict"),
            pattern=dict(type="str", default=SGLANG_PATTERN),
            protect_pattern=dict(type="str", default=PROTECT_PATTERN),
            remove_stale_shm=dict(type="bool", default=True),
            shm_dir=dict(type="path", default="/dev/shm"),
            shm_patterns=dict(type="list", elements="str", default=["nccl-*", "cuda.shm.*", "sgl_shm_*"]),
            gpu_wait=dict(type="dict", options={k: v for k, v in gpufleet_gpu_wait.WAIT_OPTIONS.items()
                                                if k != "started_at"}),
            # the suboptions are sglang_process's start options (gpufleet_spawn.START_OPTIONS)
            start_after=dict(type="dict", options=gpufleet_spawn.start_options(gpufleet_spawn.START_REQUIRED)),
        ),
        required_by={"start_after": "gpu_wait"},
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    if psutil is None:
        module.fail_json(msg=missing_required_lib("psutil"), exception=PSUTIL_IMPORT_ERROR)
    params = module.params
    if params["grace_s"] < 0 or params["kill_timeout_s"] < 0:
        module.fail_json(msg="grace_s and kill_timeout_s must be >= 0 seconds, got %s and %s"
                         % (params["grace_s"], params["kill_timeout_s"]))
    if not 1 <= params["poll_interval_ms"] <= 100:
        module.fail_json(msg="poll_interval_ms must be 1 to 100 (ms), got %d" % params["poll_interval_ms"])
    start = params["start_after"]
    if start and (not start["argv"] or not start["argv"][0]):
        module.fail_json(msg="start_after.argv must name a command as its first element")
    if start and not 0 < start["port"] < 65536:
        module.fail_json(msg="start_after.port must be 1-65535, got %d" % start["port"])
    if params["slice_s"] is not None and params["slice_s"] <= 0:
        module.fail_json(msg="slice_s must be > 0 seconds (or unset for one call), got %s" % params["slice_s"])
    module.exit_json(**run(module))


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
