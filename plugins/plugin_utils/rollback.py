"""The rollback's decisions after a failed restart (roles/sglang_launch/tasks/rollback.yml): its plan and its report.

Plain functions over the role's inputs and the registered results of its steps; they return structured data and
touch no host. The filters in plugins/filter/gpufleet_rollback.py are thin wrappers; unit tests:
tests/unit/test_plugin_utils_rollback.py.

- ``plan(record_read, ...)`` -> dict: the launch record, why it is refused, whether the previous server is
  relaunched (``no_relaunch``: the reason not to, '' when it is), which steps run (stop what this run launched,
  wait for GPU memory, check the port) and the wording of the GPU wait step.
- ``wait_outcome(wait_result, server)`` -> {relaunch, note}: whether a relaunch follows the GPU memory wait, and
  the sentence the note adds (memory unreadable, or the previous server fits beside memory others took).
- ``relaunched(method, process, unit, unit_after, log_stat)`` -> {pid, started, log_offset}: what the relaunch
  started.
- ``step_of(task_name, plan)`` -> str: the rollback step a failed task belongs to.
- ``report(facts, failure=None)`` -> {state, pid, detail}: ``sglang_launch_rollback``.
- ``serves(workers, recorded)`` -> str, ``restore(stat_results)`` -> {restore, note}, ``unreadable_note(wait)``
  -> str: the note's parts (also behind the older filters gpufleet_rollback_serves, gpufleet_patch_restore,
  gpufleet_rollback_unreadable).
"""
from __future__ import annotations

import os

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.check import worker_difference
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_memory import rollback_fit

NOT_CHANGED = "no file changed by this run's NCCL patch"

# The steps, in the order rollback.yml runs them; a failure names the step it happened in.
READ = "reading the launch record"
STOP = "stopping the server this run launched"
RESTORE = "restoring engine.py"
WAIT_AFTER_FAILED_STOP = "waiting for GPU memory after the failed stop"
WAIT_REREAD = "reading GPU memory once more (the wait after the stop could not read it)"
WAIT_AGAIN = "waiting once more for the GPU memory the wait found held"
WAIT = "waiting for GPU memory after stopping the new server"
PORT = "checking the port before relaunching"
RELAUNCH = "relaunching the previous server"
READY = "waiting for the relaunched server to answer"
WAIT_STEPS = (WAIT_AFTER_FAILED_STOP, WAIT_REREAD, WAIT_AGAIN, WAIT)
_ORDER = {READ: 0, STOP: 1, RESTORE: 2, PORT: 4, RELAUNCH: 5, READY: 6, **{s: 3 for s in WAIT_STEPS}}

# rollback.yml's task names (after "Rollback - ") -> step. The GPU wait's step is the plan's wait_step; a task not
# named "Rollback - ..." belongs to ready.yml, the relaunched server's readiness wait.
TASK_STEPS = {
    "read and check the launch record": READ,
    "stop the unit this run started": STOP,
    "stop the server this run launched and its leftovers": STOP,
    "checksum the patched files now": RESTORE,
    "put back the bytes from before this run": RESTORE,
    "wait until GPU memory is released": None,
    "check that nothing listens on the port": PORT,
    "start the previous argv and environment (process method)": RELAUNCH,
    "put back the previous unit (systemd method)": RELAUNCH,
    "note where the relaunch's log lines begin (systemd method)": RELAUNCH,
    "clear a failed state of the unit left by crash restarts (systemd method)": RELAUNCH,
    "start the previous unit (systemd method)": RELAUNCH,
    "read the relaunched unit's main pid (systemd method)": RELAUNCH,
    "wait until the previous server serves": READY,
    "read the NCCL values of the relaunched server's workers": READY,
    "report the outcome": READY,
}
TASK_PREFIX = "Rollback - "

# What a failure at each step leaves on the host (the report's last words before what to do).
HOST_STATE = {
    READ: "The host is not serving.",
    STOP: "The new server may still run (its stop failed): look at the processes and the log before anything else.",
    WAIT: ("The new server is stopped but GPU memory is still held (the holders are named above), so the previous "
           "server was not relaunched. The host is not serving."),
    WAIT_REREAD: ("GPU memory could not be read during the wait after the stop; read again, it is held (the holders "
                  "are named above), so the previous server was not relaunched: beside it, it would run out of "
                  "memory. End what holds the memory, then rerun. The host is not serving."),
    WAIT_AGAIN: ("GPU memory is still held after a second wait as long as the first (the holders are named above), "
                 "so the previous server was not relaunched: beside it, it would run out of memory. End what holds "
                 "the memory (a process in state D ends only with the driver: reset the GPUs with nvidia-smi -r, or "
                 "reboot). The host is not serving."),
    WAIT_AFTER_FAILED_STOP: ("The old server was signalled but GPU memory is still held (the holders are named above: "
                             "a process in state D is stuck in the kernel or driver, and only its end or a reboot "
                             "frees it), so the previous server was not relaunched. The host is not serving."),
    PORT: "The previous server was not relaunched: it could not bind a taken port. The host is not serving.",
    RELAUNCH: "The previous server did not start. The host is not serving.",
}


def _dict(value):
    return value if isinstance(value, dict) else {}


def _truthy(value, default):
    """A boolean input as Ansible's ``bool`` filter reads it; None/'' -> ``default``."""
    if value is None or value == "":
        return default
    if isinstance(value, str):
        return value.strip().lower() in ("yes", "on", "1", "true", "t", "y")
    return bool(value)


def truncate(text, length):
    """Jinja's ``truncate(length)`` (leeway 5, cut at a word, "..."), as the notes always cut a failure's line."""
    text = str(text)
    if len(text) <= length + 5:
        return text
    return text[:length - 3].rsplit(" ", 1)[0] + "..."


def first_line(msg):
    """The first line of a failure's ``msg``; '?' when there is none."""
    lines = str(msg or "?").splitlines()
    return lines[0] if lines else "?"


def plan(record_read, phase="launch", stopped=True, enabled=True, error_class=None, host_wide_classes=(),
         record_file="", old_pid=None, stop_signalled=False, engine=None):
    """What the rollback does, decided before it touches anything.

    ``record_read``: the registered sglang_host_info result (``launch_record``: {record, reason}; a failed call's
    ``msg`` is the reason it is refused). ``phase``: the phase that failed (stop|wait|patch|launch|verify);
    ``stopped``: whether the run began to stop the old server (sglang_launch_rollback_stopped); ``enabled``:
    gpufleet_rollback; ``error_class``: the failed task's; ``old_pid``: the server the run stopped (none: no server
    gpufleet started ran); ``stop_signalled``: a failed stop had signalled; ``engine``:
    sglang_launch_rollback_engine ({files, become}).

    The previous server is relaunched from the last verified launch (the record) also when the stopped server's pid
    is not the recorded one: it may be one an earlier rollback relaunched, or one a killed run started and never
    verified; requiring the recorded pid left such hosts dark on the next failure.
    """
    read = _dict(record_read)
    launch_record = _dict(read.get("launch_record"))
    record = _dict(launch_record.get("record"))
    refused = str(launch_record.get("reason") or read.get("msg") or "")
    phase = phase or "launch"
    error_class = error_class or ""
    if not _truthy(stopped, True):
        no_relaunch = "the old server was never stopped"
    elif not _truthy(enabled, True):
        no_relaunch = "gpufleet_rollback is false"
    elif phase == "wait" and error_class in list(host_wide_classes or []):
        no_relaunch = ("the cause is host-wide (GPU layer: %s): a relaunch would fail the same way" % error_class)
    elif refused:
        no_relaunch = ("the launch record %s was refused (%s), so nothing in it was written or started: remove or "
                       "fix that file" % (record_file, refused))
    elif not record:
        no_relaunch = ("there is no launch record (%s): gpufleet never launched a server that passed verification "
                       "on this host" % record_file)
    elif not old_pid:
        no_relaunch = "no server gpufleet started was running when this run began (no pid in its pid file or unit)"
    else:
        no_relaunch = ""
    # Also after a stop that failed once it had signalled, and after a wait that ran out: the previous server is
    # relaunched only once what held the GPUs is gone (relaunched into full GPUs it runs out of memory).
    wait = (phase in ("launch", "verify", "wait") or (phase == "stop" and _truthy(stop_signalled, False)))
    if phase == "stop":
        wait_step = WAIT_AFTER_FAILED_STOP
    elif phase == "wait" and error_class == "field_unavailable":
        wait_step = WAIT_REREAD
    elif phase == "wait":
        wait_step = WAIT_AGAIN
    else:
        wait_step = WAIT
    return {
        "record": record,
        "refused": refused,
        "phase": phase,
        "no_relaunch": no_relaunch,
        "relaunch": not no_relaunch,
        "method": record.get("method"),
        # What this run launched is stopped after a failed launch or verify (also the server the stop's own
        # call started: restart.yml passes those as phase launch).
        "stop_new": phase in ("launch", "verify"),
        "wait": wait and not no_relaunch,
        "wait_step": wait_step,
        # After a failed stop the old server may still hold the port; the start then finds it running.
        "check_port": phase != "stop",
        "engine": _dict(engine),
    }


def unreadable_note(wait_result):
    """The note's sentence when the rollback's nvidia_gpu_wait failed because a GPU's memory could not be read
    (error_class field_unavailable): the previous server is relaunched all the same (it ran on these GPUs a moment
    ago) and its own readiness decides. '' for any other result (skipped, ready, held)."""
    wait_result = _dict(wait_result)
    if wait_result.get("error_class") != "field_unavailable":
        return ""
    lines = str(wait_result.get("msg") or "").strip().splitlines() or ["?"]
    first = " ".join(lines[:2]) if lines[0].startswith("NVML: ") else lines[0]  # NVML's line is the call
    cut = first.split(" What to do:", 1)[0].rstrip(". ")
    return ("GPU memory could not be read (%s), so the previous server was relaunched without a memory check "
            "(it ran on these GPUs a moment ago); its own readiness check decided" % cut)


def fit(wait_result, server):
    """Whether the previous server is relaunched although the wait ran out (error_class not_released) because others
    took memory after preflight (module_utils gpufleet_gpu_memory ``rollback_fit``). Any other result:
    ``{fits: False, text: ''}``."""
    wait_result = _dict(wait_result)
    if wait_result.get("error_class") != "not_released":
        return {"fits": False, "text": ""}
    return rollback_fit(wait_result.get("gpus") or [], _dict(server))


def wait_outcome(wait_result, server):
    """``{relaunch, note}`` after the rollback's nvidia_gpu_wait (registered; skipped counts as passed).

    ``relaunch`` is False only when the wait failed with memory held that the previous server would not fit beside;
    a GPU whose memory cannot be read does not hold the relaunch back (the previous server ran on these GPUs a
    moment ago, its own readiness decides). ``note``: the sentence the rollback's note adds ('' none)."""
    wait_result = _dict(wait_result)
    unreadable = unreadable_note(wait_result)
    fitting = fit(wait_result, server)
    relaunch = not wait_result.get("failed") or bool(unreadable) or fitting["fits"]
    note = unreadable or (fitting["text"] if fitting["fits"] else "")
    return {"relaunch": relaunch, "note": note}


def _labels(paths):
    """Short names for ``paths``: base names when those are unique, else the paths themselves."""
    names = [os.path.basename(p) for p in paths]
    return names if len(set(names)) == len(names) else list(paths)


def _join(words):
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def restore(stat_results):
    """What the rollback puts back and says, from its ``stat`` loop (sha256) over the patch's kept files.

    Each result carries its ``item`` (path, previous_file, sha256 of the copy). Returns ``{restore: [items to copy
    back], note: str}``: a file is put back when its bytes differ from the copy (missing counts as differing); one
    that equals it was not written by this run's patch."""
    back, unchanged = [], []
    for result in stat_results or []:
        item = _dict(_dict(result).get("item"))
        if not item.get("path") or not item.get("previous_file"):
            continue
        now = _dict(result.get("stat")).get("checksum") or ""
        (back if now != item.get("sha256") else unchanged).append(item)
    if not back and not unchanged:
        return {"restore": [], "note": NOT_CHANGED}
    labels = dict(zip([i["path"] for i in back + unchanged], _labels([i["path"] for i in back + unchanged])))
    parts = []
    if back:
        parts.append("%s restored to %s bytes from before this run (sha256 %s)" % (
            _join([labels[i["path"]] for i in back]), "its" if len(back) == 1 else "their",
            ", ".join(str(i.get("sha256") or "?")[:12] for i in back)))
    if unchanged:
        parts.append("%s unchanged (the patch had not written %s)" % (
            _join([labels[i["path"]] for i in unchanged]), "it" if len(unchanged) == 1 else "them"))
    return {"restore": back, "note": "; ".join(parts)}


def serves(workers, recorded):
    """What the host serves once the relaunch answers, in the note's words (no final stop).

    ``workers``: sglang_worker_env_info's result for the relaunched server (expected: the record's ``nccl_env``),
    or a skipped/failed one. "The previous configuration" only when every worker carries those values: the argv
    and environment come back from the record, but the NCCL block comes from the patched files, which a reinstall
    or upgrade of sglang since the record replaces."""
    recorded = _dict(recorded)
    workers = _dict(workers)
    if "nccl_env" not in recorded:
        return ("the host serves the previous argv and environment (the launch record predates its NCCL values, so "
                "its workers were not checked against them)")
    if not recorded["nccl_env"]:
        return "the host serves the previous configuration"
    listed = workers.get("workers")
    if workers.get("skipped") or not isinstance(listed, list) or workers.get("msg") and not listed:
        return ("the host serves the previous argv and environment; its workers' NCCL values could not be read%s"
                % ((" (%s)" % str(workers.get("msg")).splitlines()[0][:200]) if workers.get("msg") else ""))
    bad = [w for w in listed if isinstance(w, dict) and not w.get("match")]
    if not bad and listed:
        return ("the host serves the previous configuration (its %d workers carry the recorded NCCL values)"
                % len(listed))
    if not listed:
        return "the host serves the previous argv and environment; no GPU worker was found to check"
    return ("the host serves the previous argv and environment, but not the previous NCCL values: %d of %d workers "
            "lack them (%s). A file of the NCCL patch changed since that launch was recorded (a reinstall or upgrade "
            "of sglang?): run playbooks/patch.yml, then playbooks/restart.yml"
            % (len(bad), len(listed), "; ".join("%s: %s" % (w.get("title"), worker_difference(w)) for w in bad[:2])))


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def relaunched(method, process=None, unit=None, unit_after=None, log_stat=None):
    """What the relaunch started: ``{pid, started, log_offset}`` from sglang_process's result (process method) or
    the systemd_service start, the unit read after it and the log's stat (systemd method). pid 0: none yet."""
    if method == "process":
        process = _dict(process)
        return {"pid": _int(process.get("pid")), "started": bool(process.get("started")),
                "log_offset": _int(process.get("log_offset"))}
    return {"pid": _int(_dict(_dict(unit_after).get("status")).get("MainPID")),
            "started": bool(_dict(unit).get("changed")),
            "log_offset": _int(_dict(_dict(log_stat).get("stat")).get("size"))}


def step_of(task_name, plan_=None):
    """The step a failed task of rollback.yml belongs to (``ansible_failed_task.name``): a task of ready.yml (not
    named "Rollback - ...") is the relaunched server's readiness wait; the GPU wait's step is worded by the plan."""
    name = str(task_name or "")
    if not name.startswith(TASK_PREFIX):
        return READY
    step = TASK_STEPS.get(name[len(TASK_PREFIX):], READ)
    return step or _dict(plan_).get("wait_step") or WAIT


def _file_note(facts, step):
    """The note's first part: what happened to the patched files, and what the GPU wait let through. Before the
    files were put back it says no file changed (a failed copy is reported by its step's words)."""
    if step is not None and _ORDER[step] <= _ORDER[RESTORE]:
        return NOT_CHANGED
    note = restore(_dict(facts.get("stat")).get("results") or [])["note"]
    if step is None or _ORDER[step] > _ORDER[WAIT]:
        extra = wait_outcome(facts.get("wait"), facts.get("server_gpus"))["note"]
        if extra:
            note = "%s; %s" % (note, extra)
    return note


def _engine_state(facts):
    """What a failure while putting the patched files back leaves."""
    files = [f for f in _dict(facts["plan"].get("engine")).get("files") or [] if isinstance(f, dict)]
    names = " and ".join(os.path.basename(str(f.get("path"))) for f in files) or "engine.py"
    copies = ", ".join(str(f.get("previous_file")) for f in files) or "?"
    tail = ("the old server was never stopped and still serves (it loaded engine.py when it started)."
            if not _truthy(facts.get("stopped"), True)
            else "the previous server was not relaunched. The host is not serving.")
    return "%s may still hold this run's patch (the pre-run bytes are in %s); %s" % (names, copies, tail)


def report(facts, failure=None):
    """``sglang_launch_rollback`` = {state, pid, detail} once the rollback ends.

    ``facts``: ``plan`` (``plan()``), ``stopped``, ``server_ran`` (null: unknown, counts as ran), ``old_pid``,
    ``stat`` / ``wait`` / ``workers`` (the registered results), ``relaunch`` (``relaunched()``), ``server_gpus``,
    ``record_file``, ``ready_path``, ``ready_timeout_s``, ``log_file`` (the server log when the record names none),
    ``host`` (inventory_hostname). ``failure`` (the rescue): ``task`` (ansible_failed_task.name), ``result``
    (ansible_failed_result), ``look`` (one more look at the relaunched server, sglang_process state ready).
    """
    facts = dict(facts)
    facts["plan"] = _dict(facts.get("plan"))
    if failure is not None:
        return _failed_report(facts, _dict(failure))
    p = facts["plan"]
    note = _file_note(facts, None)
    stopped = _truthy(facts.get("stopped"), True)
    ran = facts.get("server_ran")
    ran = True if ran is None else _truthy(ran, True)
    old_pid = facts.get("old_pid") or None
    host = facts.get("host")
    if not stopped:
        if not ran:
            detail = ("%s; nothing was stopped, and no SGLang server ran on this host when the run began (preflight "
                      "saw none): it most likely serves nothing." % note)
        else:
            detail = ("%s; the old server was never stopped%s: it still serves, with the engine.py it loaded when it "
                      "started." % (note, (" (pid %s)" % old_pid) if old_pid is not None else ""))
        return {"state": "not_needed", "pid": old_pid, "detail": detail}
    if p.get("no_relaunch"):
        return {"state": "file_only", "pid": None, "detail": (
            "%s; the previous server was not relaunched: %s. The host is not serving (no SGLang server runs): fix "
            "the cause, then rerun playbooks/restart.yml -e target=%s" % (note, p["no_relaunch"], host))}
    launched = _dict(facts.get("relaunch"))
    pid = _int(launched.get("pid"))
    if launched.get("started"):
        record = _dict(p.get("record"))
        return {"state": "rolled_back", "pid": pid, "detail": (
            "%s; the previous server was relaunched from %s (recorded %s) as pid %s and answers %s: %s." % (
                note, facts.get("record_file"), record.get("recorded_at", "?"), pid, facts.get("ready_path"),
                serves(facts.get("workers"), record)))}
    return {"state": "not_needed", "pid": pid, "detail": (
        "the previous server (pid %s) still runs and answers %s; %s." % (pid, facts.get("ready_path"), note))}


def _failed_report(facts, failure):
    """The rescue's report: the relaunched server serves after all (one more look saw it answer), still loads (its
    process runs), or the rollback failed at a step that says what state the host is in."""
    p = facts["plan"]
    step = step_of(failure.get("task"), p)
    result = _dict(failure.get("result"))
    look = _dict(failure.get("look"))
    why = first_line(result.get("msg"))
    note = _file_note(facts, step)
    pid = _int(_dict(facts.get("relaunch")).get("pid"))
    record = _dict(p.get("record"))
    host = facts.get("host")
    log_file = record["log_file"] if "log_file" in record else facts.get("log_file")
    if step == READY and look.get("ready"):
        return {"state": "rolled_back", "pid": pid, "detail": (
            "%s; the previous server was relaunched from %s as pid %s. Its readiness wait ended without an answer "
            "(%s), but a last look saw it answer %s on its own socket: %s." % (
                note, facts.get("record_file"), pid, truncate(why, 300), facts.get("ready_path"),
                serves({}, record)))}
    if step == READY and (result.get("running") or look.get("running")):
        if result.get("running"):
            until = "within sglang_launch_ready_timeout_s (%s s; last: %s)" % (
                facts.get("ready_timeout_s"), result.get("last") or "?")
        else:
            until = "before its wait ended (%s)" % truncate(why, 300)
        return {"state": "relaunched_loading", "pid": pid, "detail": (
            "%s; the previous server was relaunched from %s as pid %s and still runs, but did not answer %s %s. It "
            "is most likely still loading and not serving yet: playbooks/check.yml -e target=%s shows when it "
            "serves. If it never does, read its log %s. Then fix the cause of the failed restart and rerun "
            "playbooks/restart.yml -e target=%s (a larger sglang_launch_ready_timeout_s if loads take that long)."
            % (note, facts.get("record_file"), pid, facts.get("ready_path"), until, host, log_file, host))}
    if step == RESTORE:
        state = _engine_state(facts)
    elif step == READY:
        state = ("The relaunched server (pid %s) did not answer %s. The host is not serving now."
                 % (pid or "?", facts.get("ready_path")))
    else:
        state = HOST_STATE.get(step, "The host is not serving.")
    return {"state": "failed", "pid": None, "detail": (
        "rollback failed while %s: %s. %s. %s Fix the cause named here, then rerun playbooks/restart.yml -e "
        "target=%s. Server log: %s." % (step, truncate(why, 400), note, state, host, log_file))}
