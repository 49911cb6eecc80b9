"""Turn ansible-runner job events into per-host progress and the fleet report (no I/O but reading files).

Events are ansible-runner's dicts (the same AWX stores): ``event`` (``runner_on_start``, ``runner_on_ok``,
``runner_on_failed``, ``runner_on_unreachable``, ``runner_retry``, ``playbook_on_play_start``,
``playbook_on_stats`` ...) and ``event_data`` (``host``, ``task``, ``role``, ``play``, ``res``,
``ignore_errors``; the stats event carries ``ok``/``failures``/``dark``/``changed``/``skipped`` per host and
``artifact_data``, what the playbooks published with ``set_stats``).
"""
from __future__ import annotations

import json
import os
import re
import time

from gpufleet_cli import core

# Ansible's own name of the task that validates an include_role entry point's arguments (tasks_from: rollback).
_ARG_SPEC_ENTRY = re.compile(r"^Validating arguments against arg spec '(\w+)'")
# The first play of every playbook checks the command line on the controller (playbooks/tasks/guards.yml).
GUARD_PLAY_PREFIX = "Check the command line"
# set_stats keys the playbooks publish: command → key.
STATS_KEY = {"restart": "gpufleet_restart", "check": "gpufleet_check"}
# Row results that count as a failed host.
BAD_RESULTS = frozenset(("failed", "rolled_back", "refused", "unreachable", "not_reached", "canceled", "cancelled",
                         "interrupted"))
CHECK_VERDICTS = ("OK", "WARN", "CRIT")
# Commands whose host result is Ansible's own final count (playbook_on_stats): tune.yml rescues a failed round by
# design (the round shows in the tune table as ok: false) and the run goes on, so a failed task event there does not
# make the host failed; only stats failures (or unreachable) do. restart and check keep their own rows.
STATS_JUDGED = frozenset(("tune", "history"))


def cut_short(phase, host, word="cancelled", seen=None, lock=None, run=None):
    """What a restart of ``host`` cut short in ``phase`` really did and what to do (the core's ``cut_short`` with
    the results ``seen`` and the restart ``lock`` left; a new server seen ready makes it the verify phase:
    ``cut_phase``). ``run``: the core's run module (default: :func:`gpufleet_cli.core.load`)."""
    run = run or core.load("run")
    return run.cut_short(run.cut_phase(phase, seen), host, word, seen, lock)


def phase_of(event_data, default=None):
    """The phase a task belongs to (str), else ``default``: the core's phase table (``phases.phase_of_task``)
    read from the event's structured data: the provisional row restart.yml's phase mark publishes for the host
    (``set_stats`` of ``gpufleet_restart``: its ``phase``), else its role, its task file (``task_path``:
    sglang_launch's ``tasks/rollback.yml`` is the ``rollback`` phase, its ``record``/``prepare``/``checks`` files
    belong to no phase of their own, playbooks/tasks/restart_lock_take.yml is the ``lock`` phase).
    """
    phases = core.load("phases")
    # The phase mark says its phase outright; its result event can carry the role of the task before it (the
    # stop's mark came as sglang_launch: the lines read "patch, launch, stop, wait, launch").
    phase = phases.phase_of_row(event_data.get("res"), event_data.get("host"))
    if phase is None:
        entry = _ARG_SPEC_ENTRY.match(event_data.get("task") or "")  # include_role tasks_from's validation task
        phase = phases.phase_of_task(role=event_data.get("role"), task_path=event_data.get("task_path"),
                                     entry_point=entry.group(1) if entry else None, default=None)
    return phase or default


def _short_task(event_data):
    task = (event_data.get("task") or "").strip()
    role = (event_data.get("role") or "").rsplit(".", 1)[-1]
    return "%s : %s" % (role, task) if role else task


def _message(res):
    """One-line cause of a failed result (``msg``, else stderr, else the first line of the result)."""
    if not isinstance(res, dict):
        return str(res)
    for key in ("msg", "stderr", "reason"):
        value = res.get(key)
        if value:
            text = value if isinstance(value, str) else json.dumps(value)
            return " ".join(text.split())
    return " ".join(json.dumps(res, default=str).split())[:300]


class FleetProgress:
    """Per-host state while a playbook runs, fed one event at a time (``handle``).

    ``hosts()`` → list of dicts ``host``, ``phase`` (str or None), ``task`` (str), ``state``
    (running|ok|failed|unreachable), ``elapsed_s`` (float, s since the host's first task), ``cause`` (str or
    None; the message of its last failed task). The guard play's events (controller-side checks of the command
    line) are kept apart in ``run_errors`` (list of str). ``clock`` is a monotonic time source in seconds.
    """

    def __init__(self, default_phase=None, clock=time.monotonic, wall=time.time, run=None):
        self._run = run  # the core's run module (plugin_utils/run.py); loaded at the first result when None
        self._clock = clock
        self._wall = wall
        self._default_phase = default_phase
        self._hosts = {}
        self._order = []
        self.run_errors = []
        self.stats = None
        self.artifact_data = {}
        self.check_reports = {}
        self.changes = []  # (host, phase) in the order phases began: what a non-terminal display prints
        # beside each change: {host, phase, began_s (s since the run began), previous, previous_s (how long the
        # host's phase before it took; None for its first)}
        self.phase_log = []
        self.started = clock()
        # Ansible's own messages outside any task (ansible-playbook's [WARNING]/[ERROR] lines: a --limit that
        # matches no host, an inventory or playbook it cannot parse), from the run's verbose events
        self.ansible_errors = []
        self.ansible_warnings = []
        self._error_open = False
        self.playbook_pid = None  # ansible-playbook's main process (every event names it): the one a cancel signals

    def _host(self, name):
        if name not in self._hosts:
            now = self._clock()
            self._hosts[name] = {"host": name, "phase": None, "task": "", "state": "running", "cause": None,
                                 "started": now, "ended": None, "changed": 0, "phase_started": now,
                                 "seen": {}, "lock": None}
            self._order.append(name)
        return self._hosts[name]

    def handle(self, event):
        """Update from one ansible-runner event dict; returns True when something shown may have changed."""
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        if self.playbook_pid is None and isinstance(event.get("pid"), int) and event["pid"] > 0:
            self.playbook_pid = event["pid"]
        if kind == "playbook_on_stats":
            self.stats = {key: data.get(key) or {} for key in ("ok", "failures", "dark", "changed", "skipped",
                                                                  "rescued", "ignored", "processed")}
            self.artifact_data = data.get("artifact_data") or {}
            return True
        if kind == "verbose":
            return self._note_ansible_message(event.get("stdout"))
        host = data.get("host")
        if not host or not kind.startswith("runner_"):
            return False
        if (data.get("play") or "").startswith(GUARD_PLAY_PREFIX):
            if kind == "runner_on_failed" and not data.get("ignore_errors"):
                cause = _message(data.get("res"))
                if cause not in self.run_errors:
                    self.run_errors.append(cause)
            return False
        row = self._host(host)
        # A skipped task does not move the host (and its event may carry another task's role: an include_role skipped
        # in the stop phase came as sglang_launch)
        phase = None if kind == "runner_on_skipped" else phase_of(data, self._default_phase)
        if phase and phase != row["phase"]:
            now = self._clock()
            self.phase_log.append({"host": host, "phase": phase, "began_s": round(now - self.started, 1),
                                   "previous": row["phase"],
                                   "previous_s": round(now - row["phase_started"], 1) if row["phase"] else None})
            row["phase"], row["phase_started"] = phase, now
            self.changes.append((host, phase))
        row["task"] = _short_task(data)
        res = data.get("res") if isinstance(data.get("res"), dict) else {}
        if kind == "runner_on_failed" and not data.get("ignore_errors"):
            row["state"], row["cause"] = "failed", _message(res)
        elif kind == "runner_on_unreachable":
            row["state"], row["cause"] = "unreachable", _message(res)
        if kind in ("runner_on_ok", "runner_on_failed"):
            self._note_server(row, res)
        if kind == "runner_on_ok":
            if res.get("changed"):
                row["changed"] += 1
            report = _check_report_of(data, res)
            if report is not None:
                self.check_reports[host] = report
        elif kind == "runner_retry" and res.get("progress"):
            row["task"] = "%s — %s" % (row["task"], res["progress"])
        return True

    def _note_ansible_message(self, text):
        """Keep a line ansible-playbook printed outside any task: ``[ERROR]: ...`` (``ERROR! ...`` before
        ansible-core 2.19) opens an error, the lines after it (its file, line and hint) belong to it until a blank
        line or another message; ``[WARNING]: ...`` is a warning. Returns True when it kept something."""
        line = str(text or "").rstrip()
        if not line.strip():
            self._error_open = False
            return False
        if line.startswith(("[ERROR]", "ERROR!")):
            self.ansible_errors.append(line)
            self._error_open = True
            return True
        if line.startswith("[WARNING]"):
            self._error_open = False
            if line not in self.ansible_warnings:
                self.ansible_warnings.append(line)
            return True
        if line.startswith("[") or not self._error_open or len(self.ansible_errors[-1]) > 2000:
            self._error_open = False
            return False
        self.ansible_errors[-1] += " " + " ".join(line.split())
        return True

    def _note_server(self, row, res):
        """The old and new server's pids and when the stop and readiness happened (the core's ``server_seen``), and
        the restart lock the run holds (``lock_seen``)."""
        self.run.server_seen(row["seen"], res, self._wall())
        row["lock"] = self.run.lock_seen(row["lock"], res)

    @property
    def run(self):
        """The core's run module (plugins/plugin_utils/run.py of the collection the CLI runs)."""
        if self._run is None:
            self._run = core.load("run")
        return self._run

    def finish(self, status="successful"):
        """End the run: hosts still running are ``ok`` after a run that ended (ansible-runner status
        successful/failed), ``cancelled`` (the summary callback's word) after one that was cancelled, timed out or did not finish; a cancelled
        restart host gets a cause saying what its phase leaves behind (the core's ``cut_short``)."""
        now = self._clock()
        for row in self._hosts.values():
            if row["ended"] is None:
                row["ended"] = now
            if row["state"] == "running":
                row["state"] = "ok" if status in ("successful", "failed") else "cancelled"
                if row["state"] == "cancelled" and row["phase"] and not row["cause"]:
                    row["cause"] = cut_short(row["phase"], row["host"], seen=row["seen"], lock=row["lock"],
                                             run=self.run)

    def wall(self):
        """The wall clock (epoch s) this progress reads."""
        return self._wall()

    def hosts(self):
        now = self._clock()
        out = []
        for name in self._order:
            row = dict(self._hosts[name])
            row["elapsed_s"] = round((row["ended"] or now) - row["started"], 1)
            row["in_phase_s"] = round((row["ended"] or now) - row["phase_started"], 1)
            out.append(row)
        return out


def _check_report_of(data, res):
    """check.yml's per-host report from today's "Report the host" debug task (msg mapping), else None."""
    msg = res.get("msg")
    if (data.get("task") or "").strip() == "Report the host" and isinstance(msg, dict):
        return msg
    return None


def _read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _check_rows(progress, report_dir):
    """Check verdicts per host: DIR/check.json, else set_stats ``gpufleet_check``, else today's check.yml."""
    doc = _read_json(os.path.join(report_dir, "check.json")) if report_dir else None
    if isinstance(doc, dict):
        doc = doc.get("hosts", doc)
    if not isinstance(doc, dict) or not doc:
        doc = progress.artifact_data.get(STATS_KEY["check"])
    rows = {}
    if isinstance(doc, dict) and doc:
        for host, entry in doc.items():
            if not isinstance(entry, dict):
                continue
            verdict = str(entry.get("verdict") or "CRIT").upper()
            reasons = entry.get("reasons") or []
            rows[host] = {"host": host, "verdict": verdict if verdict in CHECK_VERDICTS else "CRIT",
                          "gpus_ok": entry.get("gpus_ok"), "gpus_total": entry.get("gpus_total"),
                          "reasons": reasons}
    # Today's check.yml: a host is OK when it answered and every task passed; else CRIT with the failure.
    for row in progress.hosts():
        host = row["host"]
        if host in rows:
            continue
        seen = progress.check_reports.get(host) or {}
        gpus = seen.get("gpus") if isinstance(seen.get("gpus"), list) else []
        if row["state"] == "ok" and host not in rows:
            rows[host] = {"host": host, "verdict": "OK", "gpus_ok": len(gpus) or None,
                          "gpus_total": len(gpus) or None, "reasons": []}
        else:
            rows[host] = {"host": host, "verdict": "CRIT", "gpus_ok": None, "gpus_total": len(gpus) or None,
                          "reasons": [{"severity": "CRIT", "gpu": None, "code": row["state"],
                                       "text": row["cause"] or row["state"]}]}
    return rows


def _restart_rows(progress):
    rows = progress.artifact_data.get(STATS_KEY["restart"])
    out = {}
    if isinstance(rows, dict):
        for host, row in rows.items():
            if isinstance(row, dict):
                out[host] = dict(row, host=host)
    now = progress.wall()
    for row in progress.hosts():
        if row["host"] not in out:
            line = {"host": row["host"], "result": row["state"], "phase": row["phase"], "cause": row["cause"]}
            # A run cut short after the stop (no summary row came): the outage so far, until a server was seen
            # ready; the rerun will not know a server ran (it finds none), so this report is where it is counted.
            line.update(progress.run.outage_so_far(row["seen"], now))
            out[row["host"]] = line
    return out


def _plain_rows(progress):
    return {row["host"]: {"host": row["host"], "result": row["state"], "changed": row["changed"],
                          "cause": row["cause"]} for row in progress.hosts()}


def settle_by_stats(hosts, stats):
    """``hosts`` (plain rows, host → row) with each ``failed`` row that Ansible's final stats count as not failed
    (``failures`` 0 and not unreachable: every failure was rescued, e.g. a tune round) made ``ok``; the rescued
    failure's message stays as ``rescued_cause``, with ``rescued`` (stats' count). No stats (a run cut short): the
    rows as they are. Returns ``hosts`` (changed in place)."""
    if not stats:
        return hosts
    failures, dark, rescued = (stats.get(key) or {} for key in ("failures", "dark", "rescued"))
    for host, row in hosts.items():
        if row.get("result") == "failed" and not failures.get(host) and not dark.get(host):
            row.update(result="ok", rescued=rescued.get(host) or 0, rescued_cause=row.get("cause"), cause=None)
    return hosts


def host_is_bad(command, row):
    """True when the host's row means the run did not do its job there (failed, unreachable, CRIT ...)."""
    if command == "check":
        return row.get("verdict") != "OK" and row.get("verdict") != "WARN"
    result = str(row.get("result") or "")
    return result in BAD_RESULTS


def build_report(command, progress, status, rc, artifacts_dir, report_dir=None, check_mode=False):
    """The run's report (dict, what ``--json`` prints).

    Keys: ``command``, ``status`` (ansible-runner's: successful|failed|canceled|timeout), ``rc`` (int,
    ansible-playbook's exit code), ``check_mode`` (bool), ``artifacts_dir`` (str), ``run_errors`` (list of str:
    command-line checks that refused the run, and Ansible's own errors outside any task, as it printed them, with the
    warnings before them when it printed an error: ``[WARNING]: Could not match supplied host pattern, ignoring:
    nosuchhost``, ``[ERROR]: Specified inventory, host pattern and/or --limit leaves us with no hosts to target.``),
    ``warnings`` (list of str: Ansible's ``[WARNING]`` lines outside any task), ``hosts`` (host → row: restart rows as restart.yml publishes
    them; check rows ``verdict``/``gpus_ok``/``gpus_total``/``reasons``; patch/unlock/history/tune ``result``/
    ``changed``/``cause``; for history and tune the result follows Ansible's final stats:
    :func:`settle_by_stats`), ``failed_hosts`` (sorted list), ``stats`` (Ansible's per-host counters), ``exit_code`` (int).
    """
    progress.finish(status)
    if command == "restart":
        hosts = _restart_rows(progress)
    elif command == "check":
        hosts = _check_rows(progress, report_dir)
    else:
        hosts = _plain_rows(progress)
        if command in STATS_JUDGED:
            settle_by_stats(hosts, progress.stats)
    failed = sorted(h for h, row in hosts.items() if host_is_bad(command, row))
    run_errors = list(progress.run_errors)
    if progress.ansible_errors:
        # the warnings say what the error is about (the pattern that matched no host)
        run_errors += [w for w in progress.ansible_warnings if w not in run_errors]
        run_errors += [e for e in progress.ansible_errors if e not in run_errors]
    if rc:
        exit_code = rc
    elif failed or run_errors or status not in ("successful",):
        exit_code = 1
    else:
        exit_code = 0
    return {"command": command, "status": status, "rc": rc, "check_mode": bool(check_mode),
            "artifacts_dir": artifacts_dir, "run_errors": run_errors,
            "warnings": list(progress.ansible_warnings), "hosts": hosts,
            "failed_hosts": failed, "stats": progress.stats or {}, "exit_code": exit_code}
