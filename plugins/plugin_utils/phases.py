"""The restart's phase table: names and order, which role and task file is which phase, what a host lost or cut
short in a phase may be doing, and when the restart lock's lease is renewed.

One definition for the playbooks (through the thin filters of plugins/filter/gpufleet_run.py), the summary
callback (plugins/callback/gpufleet_summary.py) and the gpufleet CLI (src/gpufleet_cli/events.py). Plain Python,
imported as ``ansible_collections.gpufleet.fleet.plugins.plugin_utils.phases``; unit-tested in
tests/unit/plugins/plugin_utils/test_phases.py without Ansible.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

# restart.yml's phases of one host, in the order it goes through them: preflight (its own play, before any host
# is touched), the weight prefetch (read-only: the new launch's files into the page cache, before the lock), the
# restart lock, the NCCL patch of engine.py (before the stop), the stop, the GPU memory wait, the
# launch, the verification. ``rollback`` is no step of that order: the failure path of stop..verify.
RESTART_PHASES = ("preflight", "prefetch", "lock", "patch", "stop", "wait", "launch", "verify")
PHASES = RESTART_PHASES + ("rollback",)
# The phases a host is out of service in (from the stop until verify passes or a rollback served again).
OUTAGE_PHASES = ("stop", "wait", "launch", "verify")

# Role → phase (the roles of restart.yml's steps).
PHASE_OF_ROLE = {
    "sglang_preflight": "preflight", "sglang_prefetch": "prefetch", "sglang_stop": "stop", "gpu_memory_wait": "wait",
    "sglang_nccl_patch": "patch", "sglang_launch": "launch", "sglang_verify": "verify",
}
# Task files of sglang_launch that are no launch: the rollback is its own phase; the launch record and the launch
# history entry (written after verify) and the argv rendered in the stop phase for the stop to start the server (prepare, with the checks it
# imports) belong to no phase of their own: the host stays in the phase it is in.
_LAUNCH_FILE_PHASE = {"rollback": "rollback", "record": None, "history": None, "prepare": None, "checks": None}
# playbooks/tasks/*.yml files with a phase of their own, or none (the release after verify: the host stays in
# its phase). restart_phase.yml and restart_lock_renew.yml are the phase they are imported with (gpufleet_phase).
_PLAYBOOK_FILE_PHASE = {"restart_lock_take": "lock", "restart_lock_release": None}


def _file_stem(task_path):
    """``(directory, stem)`` of a task's file from Ansible's ``task_path`` (``/x/roles/r/tasks/main.yml:12``)."""
    path = str(task_path or "").rsplit(":", 1)[0] if ":" in str(task_path or "") else str(task_path or "")
    directory, dummy, name = path.rpartition("/")
    return directory, name[:-4] if name.endswith(".yml") else name[:-5] if name.endswith(".yaml") else name


def phase_of_task(role=None, task_path=None, entry_point=None, phase_var=None, default=None):
    """The phase a task belongs to, from structured data only; ``default`` where it belongs to none of its own.

    ``role``: the task's role (``sglang_stop`` or ``gpufleet.fleet.sglang_stop``); ``task_path``: its file and line
    as Ansible reports it; ``entry_point``: the sglang_launch entry point whose argument validation the task is
    (``include_role: tasks_from: rollback``); ``phase_var``: the ``gpufleet_phase`` the task was imported with
    (restart.yml's tasks/restart_phase.yml and restart_lock_renew.yml; the phase mark publishes it in its row).
    Returns a name of :data:`PHASES` or ``default``.
    """
    role = str(role or "").rsplit(".", 1)[-1]
    directory, stem = _file_stem(task_path)
    if role == "sglang_launch" or directory.endswith("/sglang_launch/tasks"):
        if entry_point in _LAUNCH_FILE_PHASE:
            return _LAUNCH_FILE_PHASE[entry_point] or default
        if directory.endswith("/sglang_launch/tasks") and stem in _LAUNCH_FILE_PHASE:
            return _LAUNCH_FILE_PHASE[stem] or default
    if role in PHASE_OF_ROLE:
        return PHASE_OF_ROLE[role]
    if stem in _PLAYBOOK_FILE_PHASE and directory.endswith("playbooks/tasks"):
        return _PLAYBOOK_FILE_PHASE[stem] or default
    if phase_var in PHASES:
        return phase_var
    return default


def phase_of_row(res, host):
    """The phase a task result publishes for ``host``: the provisional summary row of restart.yml's phase mark
    (tasks/restart_phase.yml: ``set_stats`` of ``gpufleet_restart`` with the host's ``phase``), else None."""
    if not isinstance(res, Mapping):
        return None
    stats = res.get("ansible_stats")
    data = stats.get("data") if isinstance(stats, Mapping) else None
    rows = data.get("gpufleet_restart") if isinstance(data, Mapping) else None
    row = rows.get(host) if isinstance(rows, Mapping) else None
    phase = row.get("phase") if isinstance(row, Mapping) else None
    return phase if phase in PHASES else None


# -- a host lost (unreachable) in a phase ---------------------------------------------------------------------

def unreachable_advice(phase, host=None, state_dir=None, lease_s=None, start_with_stop=None, stop_result=None):
    """What a host may be doing when the connection to it was lost in ``phase``, and what to do (one line).

    restart.yml publishes it as the provisional row at each phase start (tasks/restart_phase.yml, with every
    argument known); the summary callback uses it for a host lost before its first phase mark (preflight, the
    lock) or with no row. Unknown arguments (None) give the words that hold either way: ``host`` (the inventory
    name: "-e target=HOST", else "for this host"), ``state_dir`` (sglang_state_dir, where the patch keeps
    engine.py's previous bytes), ``lease_s`` (the restart lock's lease, s), ``start_with_stop`` (whether the stop
    starts the new server: the process method's start_after), ``stop_result`` (sglang_stop's result: its
    ``start.started``/``start.pid`` say whether it started the new server).
    """
    target = "-e target=%s" % host if host else "for this host"
    check = "run playbooks/check.yml %s" % target
    started = None
    if isinstance(stop_result, Mapping) and isinstance(stop_result.get("start"), Mapping):
        start = stop_result["start"]
        started = start.get("pid") if _true(start.get("started")) else None
    if phase == "preflight":
        return "nothing was changed on this host: check ssh, then rerun"
    if phase == "prefetch":
        return ("nothing was changed on this host (the prefetch only reads the new launch's weight files): check ssh, "
                "then rerun")
    if phase == "lock":
        return "nothing was stopped; a lock taken frees itself when its lease ends: check ssh, then rerun"
    if phase == "patch":
        return ("the old server still serves; engine.py may be patched (its previous bytes are in "
                "%s/nccl-patch-prev): rerun restart.yml %s once the lock's lease ended"
                % (state_dir or "<sglang_state_dir>", target))
    if phase == "stop":
        if start_with_stop is None:
            return ("the old server may be stopped or still draining, engine.py patched, the new one may have been "
                    "started by the stop (process method): %s, then rerun restart.yml once the lock's lease ended"
                    % check)
        return ("the old server may be stopped or still draining%s, engine.py patched: %s; rerun restart.yml for it "
                "once the lock's lease ended%s"
                % (", the new one may have been started by the stop" if _true(start_with_stop) else "", check,
                   " (%s s or more)" % _whole(lease_s) if lease_s not in (None, "") else ""))
    if phase == "wait":
        if started:
            return "the old server is stopped and the stop started the new one (pid %s): %s" % (started, check)
        if stop_result is None:
            return ("the old server is stopped; the stop may have started the new one (process method): %s, then "
                    "rerun restart.yml once the lock's lease ended" % check)
        return ("the old server is stopped and no new one was started: rerun restart.yml %s once the lock's lease "
                "ended" % target)
    if phase == "launch":
        return "ssh lost during launch: the server may have come up; %s%s" % (
            check, " (the lock frees itself when its lease ends)" if host else "")
    if phase == "verify":
        return "the new server was up when the connection was lost: %s" % check
    return check


def _true(value):
    return value is True or str(value).strip().lower() in ("true", "yes", "1", "on")


def _whole(value):
    """``300`` for 300, 300.0 or "300"; the text as given otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "%d" % number if number.is_integer() else "%s" % number


# -- a host cut short (cancelled, interrupted) in a phase ------------------------------------------------------

# What a restart cut short in each phase leaves on the host, and what to do, when nothing more is known than the
# phase. A cancelled or interrupted run (Ctrl-C, SIGTERM, an AWX cancel) runs no rescue, no rollback and no
# always: section. plugin_utils/run.py's cut_short says more from the results seen.
RERUN_AFTER_CUT = ("rerun playbooks/restart.yml -e target={host} (playbooks/check.yml -e target={host} shows the "
                   "host now)")
CUT_SHORT_IN = {
    "preflight": "{word} in preflight: nothing was changed on this host (untouched)",
    "prefetch": ("{word} in the weight prefetch, before the lock: nothing was changed on this host (untouched; the "
                 "prefetch only reads); " + RERUN_AFTER_CUT),
    "lock": "{word} before the patch: nothing was stopped, the old server still serves; " + RERUN_AFTER_CUT,
    "patch": ("{word} in the patch, before the stop: the old server still serves (engine.py may already carry "
              "the new NCCL block, used from the next start); " + RERUN_AFTER_CUT),
    "stop": ("{word} after the stop began, before a new server was seen serving: this host may serve nothing "
             "now; " + RERUN_AFTER_CUT),
    "wait": ("{word} after the stop, in the wait for GPU memory: this host most likely serves nothing now; "
             + RERUN_AFTER_CUT),
    "launch": ("{word} in the launch: the old server is stopped and the new one may still be loading or gone; "
               + RERUN_AFTER_CUT),
    "verify": "{word} in verify: the new server runs but was not verified; " + RERUN_AFTER_CUT,
    "rollback": "{word} during the rollback: this host may serve nothing now; " + RERUN_AFTER_CUT,
}


# -- the restart lock's lease --------------------------------------------------------------------------------

def lock_plan(stop_s, wait_s, slice_s, verify_s, margin_s, lease_s, start_wait_s=0, startup_check_s=0):
    """When restart.yml renews the restart lock's lease, from the worst case of each stretch (s).

    ``stop_s``: the stop (SIGTERM grace for the server and again for leftovers, the SIGKILL wait, one GPU memory
    slice); ``wait_s``: the GPU memory wait; ``slice_s``: the launch up to its first readiness slice and each
    slice (sglang_process renews at every slice); ``verify_s``: verify; ``margin_s``: task overhead
    (gpufleet_lock_margin_s); ``lease_s``: the lease asked for (gpufleet_lock_lease_s).

    Returns ``min_lease_s`` (int: the lease must outlast the longest stretch plus the margin, rounded up; the
    lock module never takes less), ``budget_s`` (the lease in force, max(lease, min_lease), less the margin) and
    ``renew_phases`` (the phases whose start renews the lease, in order: only where the stretch since the last
    renewal — the take, a phase start, a readiness slice — plus the phase ahead would not fit in the budget. A
    renewal is a round trip, and wait and launch start inside the outage, so each one skipped shortens every
    host's downtime). The patch, before the stop, counts in the margin.

    ``wait_renews_when_memory_free``: whether the wait's renewal is still needed when the stop saw the GPU memory
    free already (no GPU memory wait follows): only when the lease from the last renewal would not cover the stop,
    the start's readiness window (the longer of ``start_wait_s`` and ``startup_check_s``, sglang_launch's) and
    one readiness slice.
    """
    stop_s, wait_s, slice_s, verify_s, margin_s, lease_s, start_wait_s, startup_check_s = (
        float(v) for v in (stop_s, wait_s, slice_s, verify_s, margin_s, lease_s, start_wait_s, startup_check_s))
    min_lease_s = int(math.ceil(max(stop_s, wait_s, slice_s, verify_s) + margin_s))
    budget_s = max(lease_s, min_lease_s) - margin_s
    renew = []
    # Since the take: the stop, then the wait.
    wait_renews = stop_s + wait_s > budget_s
    if wait_renews:
        renew.append("wait")
    # Since the last renewal: the wait (and the stop before it when the wait did not renew), then a slice.
    if wait_s + (0.0 if wait_renews else stop_s) + slice_s > budget_s:
        renew.append("launch")
    # Since the last readiness slice: verify.
    if slice_s + verify_s > budget_s:
        renew.append("verify")
    return {"min_lease_s": min_lease_s, "budget_s": budget_s, "renew_phases": renew,
            "wait_renews_when_memory_free": stop_s + max(start_wait_s, startup_check_s) + slice_s > budget_s}
