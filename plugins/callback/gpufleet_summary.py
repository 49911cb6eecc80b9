# gpufleet: print the restart summary (one row per targeted host) at the end of a run, whatever happened on
# the way, and the progress lines of long waits.
from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_summary
type: aggregate
short_description: Print gpufleet's per-host restart summary at the end of the run, and progress lines of long waits
description:
  - "Summary: prints one row per host targeted by playbooks/restart.yml at the end of the run, on every exit path
    (a guard or preflight refusal, a failed host that stopped the rolling restart, an unreachable host). Rows come
    from the same data the playbook publishes for AWX with C(set_stats) under C(gpufleet_restart) (host → row);
    hosts without a row get one from what the run saw: C(unreachable) with the phase it was in and what the host
    may be doing, C(failed) with the failing task's message, C(not_started) when the run stopped before their
    turn, C(not_reached) when no task ran for them."
  - "Columns: host, result (ok|check|skipped|failed|rolled_back|refused|not_started|not_reached|unreachable;
    skipped = left untouched after a fleet check, C(gpufleet_check)), downtime_s (s, stop start → a server
    answered again; C(down:N) = still down, N s so far; 0.0 = no server ran before), release_wait_ms (ms),
    tokens_per_s, nccl (ok|fail), old_pid, new_pid (after a rollback: the relaunched previous server). Below the
    table, hosts that are ok with a note (no server ran before the run: a first launch, or a host that was down; a
    launch that the verify phase did not check) get one line per note, and each host that
    is not ok gets its phase, cause, rollback and what to do next. Hosts whose lines say the same share them
    (a guard failure or a fleet-wide refusal is said once, with the hosts it concerns; more than six are named by
    their first three, the last and the count); the host's own name in such a shared line reads C(<host>)."
  - "Cancels: SIGTERM (an AWX cancel, kill, a job timeout) ends ansible-playbook the way Ctrl-C does (ansible-core
    alone killed itself at once, rc 143, printing nothing): the running tasks are stopped, no rescue, rollback or
    always: section runs, it exits 99 and prints C(GPUFLEET SUMMARY (cancelled: SIGTERM)) (C((interrupted)) after
    Ctrl-C) with a row per host saying what the cancel did there, from the results seen (untouched; the old server
    stopped; the new server started but not verified and not recorded; ...) and the restart lock it left. Should
    ansible-core's cleanup block (a worker killed while it held the result queue's lock), the summary is printed 30 s
    after the signal, the workers are told to end and the process exits all the same."
  - "History: for playbooks/history.yml (it publishes C(gpufleet_history) with C(set_stats)) prints the launch
    history of every host as one table (time, host, run id, playbook, profile/candidate, release, NCCL values,
    figures)."
  - "Check: for playbooks/check.yml (it publishes C(gpufleet_check) with C(set_stats)) prints the fleet table
    instead: host, verdict (OK|WARN|CRIT), GPUs ok/total, the first reasons (severity, code, GPU), and a count line."
  - "Progress: for a task retried with C(until)/C(retries) whose result carries a C(progress) string (the readiness
    wait, the GPU memory wait), prints C(  <host>: <progress>) at each retry."
  - "It writes only while a human-readable stdout callback is active (default, minimal, oneline, debug, dense, yaml,
    unixy, ...; under ansible-runner/AWX the one named by ORIGINAL_STDOUT_CALLBACK, default C(default)), so a JSON
    stdout callback (C(json), C(ansible.posix.json), C(ansible.posix.jsonl)) stays valid JSON; the rows still reach
    it through C(set_stats) (C(gpufleet_restart) in the JSON's C(global_custom_stats))."
  - "Needs no enabling (it is always on). Ansible loads it from C(playbooks/callback_plugins/) next to the
    playbooks (a link, also inside the installed collection, so C(ansible-playbook gpufleet.fleet.restart) from
    any directory prints the summary), or from ansible.cfg C(callback_plugins). Enabling it as well
    (C(callbacks_enabled = gpufleet.fleet.gpufleet_summary)) still prints one summary."
"""

import atexit
import os
import re
import signal
import sys
import threading
import time

from ansible import constants as C
from ansible.plugins.callback import CallbackBase

# The controller-side core (plugins/plugin_utils) and the tables' filters, imported by their collection path: the
# collection loader finds them in the checkout (ansible.cfg's collections_path) or in the installed collection.
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.run import gpufleet_summary_table
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.check import gpufleet_check_table
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import phases, run, tune

# stdout callbacks that print for people; anything else (json, jsonl, junit, tree, unknown) gets no line from us.
HUMAN_STDOUT_CALLBACKS = frozenset((
    "default", "minimal", "oneline", "debug", "dense", "yaml", "unixy", "selective", "skippy", "actionable",
    "counter_enabled", "diy", "null_progress", "full_skip", "stderr", "awx_display_default", "gpufleet_default",
))
HUMAN_PREFIXES = ("ansible.builtin.", "community.general.", "ansible.posix.", "gpufleet.fleet.")

# The first play of every playbook (playbooks/tasks/guards.yml): its failures concern the run, not a host.
GUARD_PLAY_PREFIX = "Check the command line"


def _first_copy(callback, kind, event):
    """False when another loaded copy of this callback already handled ``event`` (the same object reaches every
    callback). Ansible loads this file twice when it is both adjacent to the playbook (playbooks/callback_plugins,
    also inside the installed collection) and enabled by FQCN (callbacks_enabled = gpufleet.fleet.gpufleet_summary):
    two summaries would print. The marker lives on a module both copies share. A task result reaches each callback
    as its own copy (ansible-core 2.19+): pass ``_result_event(result)``, which names the result by the Task
    object all copies share."""
    if event is None:
        return True
    import ansible.plugins.callback as shared
    marks = shared.__dict__.setdefault("_gpufleet_summary_handled", {})
    if _same_event(marks.get(kind), event) and marks.get(kind + "_by") is not callback:
        return False
    marks[kind], marks[kind + "_by"] = event, callback
    return True


def _result_event(result):
    """One task result as every callback copy of it reads: its Task object (shared), host name and attempt."""
    return ("result", result.task, result.host.get_name(), result.result.get("attempts"))


def _same_event(seen, event):
    if seen is event:
        return True
    return (isinstance(seen, tuple) and isinstance(event, tuple) and len(seen) == len(event) == 4
            and seen[0] == event[0] == "result" and seen[1] is event[1] and seen[2:] == event[2:])


def _plain(value):
    """Native Python value (ansible-core 2.19+ hands tagged str/int subclasses to callbacks)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    text = str(value).strip()
    if text in ("", "None", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _first_line(text, limit=300):
    line = " ".join(str(text or "").strip().split("\n", maxsplit=1)[0].split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def stdout_callback_name(environ=None):
    """The stdout callback that prints for the user: ansible-runner's awx_display wraps the one named by
    ORIGINAL_STDOUT_CALLBACK (default ``default``); otherwise Ansible's configured stdout_callback."""
    environ = os.environ if environ is None else environ
    name = str(C.config.get_config_value("DEFAULT_STDOUT_CALLBACK") or "default")
    if name.endswith("awx_display"):
        name = environ.get("ORIGINAL_STDOUT_CALLBACK") or "default"
    return name


def is_human_stdout(name):
    """True for stdout callbacks that print for people (see HUMAN_STDOUT_CALLBACKS), False for the rest."""
    short = name
    for prefix in HUMAN_PREFIXES:
        if name.startswith(prefix):
            short = name[len(prefix):]
    return short in HUMAN_STDOUT_CALLBACKS


def _phase_of(task, play_name=""):
    """The phase ``task`` belongs to (phases.phase_of_task: its role, its task file, the ``gpufleet_phase`` it was
    imported with), else preflight in restart.yml's preflight play, else None (the host stays in its phase)."""
    role = getattr(task, "_role", None)
    phase_var = None
    if hasattr(task, "get_vars"):
        try:
            phase_var = task.get_vars().get("gpufleet_phase")
        except Exception:  # noqa: BLE001 - a task whose vars cannot be read names no phase
            phase_var = None
    path = task.get_path() or "" if hasattr(task, "get_path") else ""
    phase = phases.phase_of_task(role=role.get_name() if role is not None else None, task_path=path,
                                 phase_var=phase_var)
    if phase is None and not (path and "/playbooks/tasks/restart_lock" in path) and \
            (play_name or "").startswith("Preflight"):
        return "preflight"
    return phase


def build_rows(targets, rows, fact_rows, unreachable, failed):
    """Final rows, one per targeted host, in target order (hosts with a row but not in ``targets`` follow).

    ``rows``: host → row from the playbook's set_stats (last one wins: a provisional ``unreachable`` row is
    replaced by the always: section's final row); ``fact_rows``: host → ``gpufleet_summary_row`` facts (a
    fallback); ``unreachable``: host → (phase, message); ``failed``: host → (phase, task name, message).
    """
    order = list(targets or [])
    # Without the guard's target list (an older playbook), every host the run saw; with it, failures of
    # hosts outside the targets (the guard play runs on all hosts) are not rows.
    extra = list(rows) + list(fact_rows) + ([] if targets is not None else list(unreachable) + list(failed))
    for host in extra:
        if host not in order:
            order.append(host)
    stopped = any(h in failed or h in unreachable for h in order) or any(
        (r or {}).get("result") not in ("ok", "check", "skipped", None) for r in rows.values())
    out = []
    for host in order:
        row = dict(rows.get(host) or fact_rows.get(host) or {})
        if host in unreachable and (not row or row.get("result") == "unreachable"):
            phase, message = unreachable[host]
            phase = row.get("phase") or phase
            row = dict(row, host=host, result="unreachable", phase=phase,
                       cause=row.get("cause") or _first_line(message) or "connection lost",
                       advice=row.get("advice") or phases.unreachable_advice(phase))
        elif not row and host in failed:
            phase, task, message = failed[host]
            row = {"host": host, "result": "refused" if phase == "preflight" else "failed", "phase": phase,
                   "cause": _first_line(message) or task}
        elif not row:
            row = {"host": host, "result": "not_started" if stopped else "not_reached",
                   "cause": "the run stopped before this host's turn" if stopped else "no task ran for this host",
                   "advice": "nothing was changed on this host"}
        row.setdefault("host", host)
        out.append(row)
    return out


def _said_by_a_row(message, rows):
    """True when a row's cause already says ``message`` (a guard's failure: its errors joined by " | " and
    ". Nothing was changed." where the rows the guard publishes join them by "; ")."""
    def norm(text):
        return " ".join(str(text).replace(" | ", "; ").split())
    said = norm(message)
    return any(row.get("cause") and said.startswith(norm(row["cause"])) for row in rows)


HOST_PLACEHOLDER = "<host>"
# A group longer than this is named by its first hosts, its last and its size (the table lists every host).
GROUP_NAMES_SHOWN = 6


def _without_host(text, host):
    """``text`` with the host's own name (a whole name: not inside a longer one) replaced by ``<host>``, so rows
    that differ only in the host they name (``-e target=HOST``) read alike. None stays None."""
    if text is None or not host:
        return text
    return re.sub(r"(?<![\w.-])%s(?![\w.-])" % re.escape(str(host)), HOST_PLACEHOLDER, str(text))


def _hosts_label(hosts):
    """``h1, h2`` for a few hosts; ``h1, h2, h3, ..., h64 (64 hosts)`` for many."""
    if len(hosts) <= GROUP_NAMES_SHOWN:
        return ", ".join(hosts)
    return "%s, ..., %s (%d hosts)" % (", ".join(hosts[:GROUP_NAMES_SHOWN - 3]), hosts[-1], len(hosts))


def _grouped(rows, fields):
    """Rows that say the same (``fields``, the host's own name read as ``<host>``) as ``[(hosts, texts)]`` in
    the order of their first host; ``texts`` are one host's own texts when the group has one host."""
    groups = {}
    for row in rows:
        host = str(row.get("host"))
        key = tuple(_without_host(row.get(f), host) for f in fields)
        if key in groups:
            groups[key][0].append(host)
        else:
            groups[key] = ([host], tuple(row.get(f) for f in fields))
    return [(hosts, texts if len(hosts) == 1 else key) for key, (hosts, texts) in groups.items()]


def render(rows, table):
    """The summary text: the table (``table`` = gpufleet_summary_table), then the notes of hosts that are ok (a
    first launch, a launch not verified) and the phase, cause, rollback and advice of hosts that are not ok.
    Hosts whose lines would say the same (apart from naming the host itself, written ``<host>`` then) share one
    line: a guard failure or a fleet-wide refusal is said once, not once per host."""
    shown = []
    for row in rows:
        cell = dict(row)
        if row.get("still_down"):
            down = row.get("downtime_s")
            cell["downtime_s"] = "down" if down is None else "down:%.1f" % float(down)
        shown.append(cell)
    lines = [table(shown)]
    ok_rows = [r for r in rows if r.get("result") in ("ok", "check") and r.get("advice")]
    for hosts, (result, note) in _grouped(ok_rows, ("result", "advice")):
        lines.append("%s: %s: %s" % (_hosts_label(hosts), result, note))
    bad_rows = [r for r in rows if r.get("result") not in ("ok", "check")]
    for hosts, (result, phase, cause, rollback, advice) in _grouped(
            bad_rows, ("result", "phase", "cause", "rollback", "advice")):
        head = "%s: %s" % (_hosts_label(hosts), result)
        if phase:
            head += " in %s" % phase
        if cause:
            head += ": %s" % cause
        lines.append(head)
        if rollback:
            lines.append("    rollback: %s" % rollback)
        if advice:
            lines.append("    next: %s" % advice)
    return "\n".join(lines)


# A cancelled or interrupted run must end even when ansible-core's own cleanup blocks: a worker that dies on the
# signal while it holds the result queue's write lock (WorkerProcess._term: os._exit inside FinalQueue.put) leaves
# the main process's put of the strategy's sentinel (StrategyBase.cleanup) waiting for ever. After this many
# seconds the summary is printed from a watchdog thread and the process exits (rc 99, as on Ctrl-C).
CANCEL_CLEANUP_S = 30.0
INTERRUPTED_RC = 99  # ansible-playbook's "User interrupted execution"
# What the cancel is called in rows and notes, per signal.
CANCEL_WORD = {signal.SIGTERM: "cancelled", signal.SIGINT: "interrupted"}


def cancel_cause(signum):
    """The summary row's cause for a run ended by ``signum`` (SIGTERM: an AWX cancel, kill, a CI timeout; SIGINT:
    Ctrl-C)."""
    if signum == signal.SIGTERM:
        return ("ansible-playbook was cancelled (SIGTERM: an AWX cancel, kill or a job timeout): no rescue, "
                "rollback or summary task ran")
    return "ansible-playbook was interrupted: no rescue, rollback or summary task ran"


def bounded_exit(limit_s, last_words, exit_now=os._exit, rc=INTERRUPTED_RC, sleep=time.sleep):
    """Start a daemon thread that, ``limit_s`` seconds from now, calls ``last_words()`` (print the summary; its
    exceptions are swallowed), flushes stdout and stderr and ends the process with ``exit_now(rc)``: a bound on a
    cancelled run's cleanup. A process that exits before never sees it fire. Returns the thread."""
    def fire():
        sleep(limit_s)
        try:
            last_words()
        except Exception:  # noqa: BLE001 - the exit must come whatever the summary does
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        exit_now(rc)

    thread = threading.Thread(target=fire, name="gpufleet-cancel-bound", daemon=True)
    thread.start()
    return thread


def end_workers(workers, kill=os.kill):
    """SIGTERM to each live worker process of the run (ansible-core's WorkerProcess: its handler kills the module's
    process group, then exits): nothing the run started keeps running after the bound's exit."""
    for worker in workers or []:
        try:
            if worker is not None and worker.is_alive() and worker.pid:
                kill(worker.pid, signal.SIGTERM)
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass


def forget_closed_workers(workers):
    """Put None in place of each closed process object in ``workers`` (the TaskQueueManager's list, shared with the
    strategy), in place. ansible-core's strategy closes a finished worker and only then puts the next one in its
    slot; a signal that lands between the two leaves the closed one there, and ansible-core's own signal handler
    and cleanup call ``is_alive()`` on it, which raises ValueError: the run ended rc 250, "Unexpected Exception"
    (seen in CI), not 99. A closed process has nothing left to tell or wait for. Returns how many were put aside."""
    forgotten = 0
    for index, worker in enumerate(workers):
        if worker is None:
            continue
        try:
            worker.is_alive()
        except ValueError:  # "process object is closed"
            workers[index] = None
            forgotten += 1
    return forgotten


def _is_tqm_handler(handler):
    """True for ansible-core's TaskQueueManager._signal_handler (a bound method of the run's TaskQueueManager)."""
    return getattr(getattr(handler, "__func__", None), "__name__", "") == "_signal_handler" and \
        type(getattr(handler, "__self__", None)).__name__ == "TaskQueueManager"


def install_cancel_handlers(on_signal, signals=(signal.SIGTERM, signal.SIGINT)):
    """Make SIGTERM end ansible-playbook the way Ctrl-C does, and bound both.

    ansible-core's TaskQueueManager handles SIGTERM by passing it to its workers and killing itself with it at once
    (rc 143: no summary, no atexit); SIGINT it passes on and turns into KeyboardInterrupt, which ends the run through
    the CLI's "User interrupted execution" (rc 99) and the interpreter's exit (atexit runs). Here each signal first
    calls ``on_signal(signum)`` (note the cancel, start the bound), then runs ansible-core's handler as for SIGINT
    (workers are told with SIGINT, which they handle as SIGTERM: kill the module's process group, exit; a second
    Ctrl-C or SIGTERM then kills at once). Only in the main thread of the process that installs it; a forked worker
    that gets the signal before it set its own handlers dies of it as before. Returns the previous handlers
    (signum → handler), empty when it installed nothing: outside ansible-core's run (no TaskQueueManager handler)
    or outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    if not all(_is_tqm_handler(signal.getsignal(signum)) for signum in signals):
        return {}  # not inside ansible-playbook's run (a unit test, an embedding program): leave them alone
    owner = os.getpid()
    previous = {}

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
        forget_closed_workers(getattr(getattr(previous[signal.SIGINT], "__self__", None), "_workers", None) or [])
        on_signal(signum)
        previous[signal.SIGINT](signal.SIGINT, frame)  # tells the workers; raises KeyboardInterrupt
        raise KeyboardInterrupt()

    for signum in signals:
        previous[signum] = signal.getsignal(signum)
        signal.signal(signum, handler)
    return previous


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "gpufleet_summary"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self):
        super().__init__()
        self._targets = None
        self._rows = {}
        self._fact_rows = {}
        self._unreachable = {}
        self._failed = {}
        self._play_name = ""
        self._guard_failures = []
        self._history = None  # history.yml's entries (set_stats gpufleet_history): printed as a table instead
        self._seen_restart = False
        self._human = None
        self._check = None
        self._tune = None  # tune.yml's report (set_stats gpufleet_tune): its table follows the summary
        # For a run interrupted before its stats (Ctrl-C: ansible-core then skips v2_playbook_on_stats and every
        # always: section): the phase each host was in, and what its stop and launch results said.
        self._phase = {}
        self._seen = {}
        self._stats_done = False
        # The restart lock each host's run holds (its owner record), False once released; what ended the run.
        self._lock = {}
        self._signal = None
        self._printed = False
        atexit.register(self._on_exit)
        import ansible.plugins.callback as shared
        if not shared.__dict__.get("_gpufleet_cancel_handlers"):  # once, when this file is loaded twice
            shared.__dict__["_gpufleet_cancel_handlers"] = install_cancel_handlers(self._on_cancel) or None

    def _on_cancel(self, signum):
        """SIGTERM or SIGINT reached ansible-playbook: note which (every loaded copy of this callback reads it) and
        bound the cleanup (:data:`CANCEL_CLEANUP_S`): then the summary, the workers told to end, the exit."""
        import ansible.plugins.callback as shared
        shared.__dict__.setdefault("_gpufleet_cancel_signal", signum)
        tqm = (shared.__dict__.get("_gpufleet_cancel_handlers") or {}).get(signal.SIGINT)
        workers = getattr(getattr(tqm, "__self__", None), "get_workers", lambda: [])

        def last_words():
            self._on_exit()
            end_workers(workers())

        bounded_exit(CANCEL_CLEANUP_S, last_words)

    def _cancel_checkpoint(self):
        """Raise the cancel's KeyboardInterrupt again, in the main thread, while the run goes on after it: the
        signal handler's own raise is lost when the signal lands where Python ignores exceptions (seen in the lab:
        inside logging's fork hook, _releaseLock, as a worker was forked: "Exception ignored in ..."; the run
        then went on to its end). Every task start and result passes here in the main thread."""
        if self._cancel_signal() is not None and not self._stats_done and \
                threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt()

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._cancel_checkpoint()

    def _cancel_signal(self):
        import ansible.plugins.callback as shared
        return shared.__dict__.get("_gpufleet_cancel_signal")

    def _prints(self):
        if self._human is None:
            self._human = is_human_stdout(stdout_callback_name())
        return self._human

    def v2_playbook_on_start(self, playbook):
        # An ad-hoc run (ansible.cfg bin_ansible_callbacks = True loads this callback there too) has no summary:
        # the callback steps aside for the rest of the run.
        if getattr(playbook, "_file_name", None) == "__adhoc_playbook__":
            self.disabled = True

    def v2_playbook_on_play_start(self, play):
        self._play_name = play.get_name() or ""
        if "host by host" in self._play_name:
            self._seen_restart = True
            # Preflight is over for every host: one the rolling play has not begun is not started, not cut short.
            self._phase = {h: p for h, p in self._phase.items() if p != "preflight"}

    def _is_restart(self):
        # restart.yml: its guard names the targets (gpufleet_restart_targets) before preflight; its rolling play
        # is "... host by host ...".
        return self._seen_restart or self._targets is not None

    def v2_runner_on_start(self, host, task):
        self._cancel_checkpoint()
        if not self._is_restart():
            return
        phase = _phase_of(task, self._play_name)
        if phase:
            self._phase[host.get_name()] = phase

    def _note_server(self, result):
        # Every result of the run passes here: only the stop's and the launch's, and only the keys read, are copied.
        res = result.result
        if self._is_restart() and ("signalled" in res or "ready" in res):
            seen = self._seen.setdefault(result.host.get_name(), {})
            keys = ("signalled", "main_pid", "stop_ms", "start", "ready", "pid")
            run.server_seen(seen, _plain({k: res[k] for k in keys if k in res}), time.time())

    def _note_lock(self, result):
        """The restart lock this run holds per host (``run.lock_seen``: taken, renewed, released)."""
        if self._is_restart() and ("acquired" in result.result or "lock_release" in result.result):
            host = result.host.get_name()
            self._lock[host] = run.lock_seen(self._lock.get(host), _plain(dict(result.result)))

    def v2_runner_on_ok(self, result):
        try:
            self._v2_runner_on_ok(result)
        finally:
            self._cancel_checkpoint()  # after the result is noted

    def _v2_runner_on_ok(self, result):
        self._note_server(result)
        self._note_lock(result)
        res = result.result
        facts = res.get("ansible_facts") or {}
        if "gpufleet_restart_targets" in facts:
            self._targets = [str(h) for h in (facts["gpufleet_restart_targets"] or [])]
        row = facts.get("gpufleet_summary_row")
        if row:
            self._fact_rows[result.host.get_name()] = _plain(dict(row))
        stats = res.get("ansible_stats") or {}
        history = (stats.get("data") or {}).get("gpufleet_history")
        if isinstance(history, dict):  # aggregated host by host, as set_stats does
            self._history = dict(self._history or {}, **_plain(dict(history)))
        check = (stats.get("data") or {}).get("gpufleet_check")
        if isinstance(check, dict):
            self._check = _plain(dict(check))
        tune_report = (stats.get("data") or {}).get("gpufleet_tune")
        if isinstance(tune_report, dict):
            self._tune = _plain(dict(tune_report))
        data = (stats.get("data") or {}).get("gpufleet_restart")
        if isinstance(data, dict):
            for host, published in _plain(dict(data)).items():
                self._rows[host] = published

    def v2_runner_on_failed(self, result, ignore_errors=False):
        try:
            self._v2_runner_on_failed(result, ignore_errors=ignore_errors)
        finally:
            self._cancel_checkpoint()  # after the result is noted

    def _v2_runner_on_failed(self, result, ignore_errors=False):
        self._note_server(result)
        if ignore_errors:
            return
        host = result.host.get_name()
        msg = result.result.get("msg") or ""
        if self._play_name.startswith(GUARD_PLAY_PREFIX):
            self._guard_failures.append(str(msg))
            return
        self._failed[host] = (_phase_of(result.task, self._play_name), result.task.get_name(), str(msg))

    def v2_runner_on_unreachable(self, result):
        try:
            self._v2_runner_on_unreachable(result)
        finally:
            self._cancel_checkpoint()  # after the result is noted

    def _v2_runner_on_unreachable(self, result):
        host = result.host.get_name()
        phase = _phase_of(result.task, self._play_name)
        self._unreachable[host] = (phase, str(result.result.get("msg") or "unreachable"))

    def v2_runner_retry(self, result):
        progress = result.result.get("progress")
        if progress and self._prints() and _first_copy(self, "retry", _result_event(result)):
            self._display.display("  %s: %s" % (result.host.get_name(), _first_line(progress, 400)))

    def interrupted_rows(self, now=None, signum=None):
        """Rows for the hosts a run cancelled (SIGTERM) or interrupted (Ctrl-C) before their own row: host → row
        with result ``cancelled``/``interrupted``, the phase, what the cancel really did there and what to do
        (``run.cut_short`` from the phase and the stop's and launch's results seen, with the restart lock it
        left) and the outage so far (``run.outage_so_far``). A host's provisional ``unreachable`` row
        (published at each phase start) is such a host too, unless the host really went unreachable. Targeted hosts
        no task of the rolling play reached get ``not_started`` (untouched)."""
        now = time.time() if now is None else now
        signum = signum or self._cancel_signal() or signal.SIGINT
        word = CANCEL_WORD.get(signum, "interrupted")
        out = {}
        for host, phase in self._phase.items():
            row = self._rows.get(host)
            if host in self._unreachable or host in self._failed or (row and row.get("result") != "unreachable"):
                continue
            seen = self._seen.get(host) or {}
            phase = run.cut_phase(phase, seen)
            line = dict(host=host, result=word, phase=phase, cause=cancel_cause(signum),
                        advice=run.cut_short(phase, host, word, seen, self._lock.get(host)))
            line.update(run.outage_so_far(seen, now))
            out[host] = line
        for host in self._targets or []:
            if host not in out and host not in self._phase and host not in self._rows and host not in self._failed \
                    and host not in self._unreachable:
                out[host] = {"host": host, "result": "not_started",
                             "cause": "the run was %s before this host's turn" % word,
                             "advice": "nothing was changed on this host (untouched)"}
        return out

    def _on_exit(self):
        """At the interpreter's exit (or from the cancel's watchdog) after a run cancelled or interrupted before
        its stats: the summary of what is known, with a row per host cut short (see :meth:`interrupted_rows`).
        Printed once."""
        if self._printed or self._stats_done or not self._is_restart():
            return
        signum = self._cancel_signal()
        if not self._phase and signum is None:
            return
        import ansible.plugins.callback as shared
        if not self._prints() or not _first_copy(self, "exit", shared):
            return
        self._printed = True
        rows = dict(self._rows)
        rows.update(self.interrupted_rows(signum=signum))
        if signum is None and not any(r.get("result") == "interrupted" for r in rows.values()):
            return
        rows = build_rows(self._targets, rows, self._fact_rows, self._unreachable, self._failed)
        self._display.banner("GPUFLEET SUMMARY (%s)" % (
            "cancelled: SIGTERM" if signum == signal.SIGTERM else "interrupted"))
        self._display.display(render(rows, gpufleet_summary_table))
        sys.stdout.flush()

    def v2_playbook_on_stats(self, stats):
        self._stats_done = True
        if self._history is not None:
            # playbooks/history.yml: the launch history of every host as one table (plugin_utils/history.py)
            from ansible_collections.gpufleet.fleet.plugins.plugin_utils import history
            if self._prints() and _first_copy(self, "stats", stats):
                self._display.banner("GPUFLEET HISTORY")
                self._display.display(history.history_table(history.fleet_entries(self._history)))
            return
        if self._check is not None:
            # one table even when the callback is both adjacent to the playbooks and enabled by name
            if self._prints() and _first_copy(self, "stats", stats):
                self._display.banner("GPUFLEET CHECK")
                self._display.display(gpufleet_check_table(self._check))
            return
        if self._targets is None and not self._rows and not self._fact_rows and not self._seen_restart:
            return  # not restart.yml
        if not self._prints() or not _first_copy(self, "stats", stats):
            return
        rows = build_rows(self._targets, self._rows, self._fact_rows, self._unreachable, self._failed)
        self._display.banner("GPUFLEET SUMMARY")
        if rows:
            self._display.display(render(rows, gpufleet_summary_table))
        else:
            self._display.display("no host was restarted")
        for message in self._guard_failures:
            if _said_by_a_row(message, rows):
                self._display.display("refused before touching any host (the cause is in the rows above)")
            else:
                self._display.display("refused before touching any host: %s" % _first_line(message, 600))
        if self._tune is not None:
            # tune.yml: the canary's last restart is the row above; its report's table follows (plugin_utils/tune.py)
            self._display.banner("GPUFLEET TUNE")
            self._display.display(tune.table(self._tune))
