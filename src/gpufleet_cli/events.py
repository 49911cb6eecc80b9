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
import sys
import time

# Role → restart phase (the same words as the summary callback's rows).
PHASE_OF_ROLE = {
    "sglang_preflight": "preflight", "sglang_stop": "stop", "gpu_memory_wait": "wait",
    "sglang_nccl_patch": "patch", "sglang_launch": "launch", "sglang_verify": "verify",
}
# restart.yml's own tasks end in "(<phase>)": "Note the phase (patch)", "Renew the restart lock (wait)".
_PHASE_IN_TASK = re.compile(r"\((preflight|lock|stop|wait|patch|launch|verify)\)\s*$")
_ARG_SPEC_ENTRY = re.compile(r"^Validating arguments against arg spec '(\w+)'")
# The first play of every playbook checks the command line on the controller (playbooks/tasks/guards.yml).
GUARD_PLAY_PREFIX = "Check the command line"
# set_stats keys the playbooks publish: command → key.
STATS_KEY = {"restart": "gpufleet_restart", "check": "gpufleet_check"}
# Row results that count as a failed host.
BAD_RESULTS = frozenset(("failed", "rolled_back", "refused", "unreachable", "not_reached", "canceled", "cancelled",
                         "interrupted"))
CHECK_VERDICTS = ("OK", "WARN", "CRIT")


def _load_run_filter():
    """The checkout's plugins/filter/gpufleet_run.py (one implementation for the CLI, the filter and the summary
    callback); None when the CLI runs without the checkout beside it."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "plugins", "filter",
                        "gpufleet_run.py")
    if not os.path.exists(path):
        return None
    # It imports the guard from plugins/plugin_utils by the collection's name (the checkout is the collection).
    collections = os.path.normpath(os.path.join(os.path.dirname(path), "..", "..", "collections"))
    if collections not in sys.path:
        sys.path.append(collections)
    spec = importlib.util.spec_from_file_location("gpufleet_run_for_cli", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_RUN = _load_run_filter()


def cut_short(phase, host, word="cancelled", seen=None, lock=None):
    """What a restart of ``host`` cut short in ``phase`` really did and what to do (``gpufleet_cut_short`` with
    the results ``seen`` and the restart ``lock`` left; a new server seen ready makes it the verify phase:
    ``gpufleet_cut_phase``)."""
    if _RUN is not None:
        return _RUN.gpufleet_cut_short(_RUN.gpufleet_cut_phase(phase, seen), host, word, seen, lock)
    return "%s in %s: playbooks/check.yml -e target=%s shows the host now" % (word, phase, host)


def phase_of(event_data, default=None):
    """The phase a task belongs to (str) from its role or its name's ``(<phase>)`` suffix, else ``default``.

    sglang_launch's ``tasks/rollback.yml`` is the ``rollback`` phase; its ``tasks/record.yml`` (the launch
    record written after verify) and ``tasks/prepare.yml`` with the ``tasks/checks.yml`` it imports (the new argv
    rendered in the stop phase, for the stop to start the server) belong to no phase of their own (``default``):
    the host stays in the phase it is in.
    """
    task_path = event_data.get("task_path") or ""
    entry = _ARG_SPEC_ENTRY.match(event_data.get("task") or "")  # include_role tasks_from's validation task
    if "/sglang_launch/tasks/rollback.yml" in task_path or (entry and entry.group(1) == "rollback"):
        return "rollback"
    if any("/sglang_launch/tasks/%s.yml" % name in task_path for name in ("record", "prepare", "checks")) or (
            entry and entry.group(1) in ("record", "prepare")):
        return default
    role = event_data.get("role") or ""
    role = role.rsplit(".", 1)[-1]
    if role in PHASE_OF_ROLE:
        return PHASE_OF_ROLE[role]
    match = _PHASE_IN_TASK.search(event_data.get("task") or "")
    return match.group(1) if match else default


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

    def __init__(self, default_phase=None, clock=time.monotonic, wall=time.time):
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
        self.playbook_pid = None  # ansible-playbook's main process (every event names it): the one a cancel signals

    def _host(self, name):
        if name not in self._hosts:
            self._hosts[name] = {"host": name, "phase": None, "task": "", "state": "running", "cause": None,
                                 "started": self._clock(), "ended": None, "changed": 0,
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
        phase = phase_of(data, self._default_phase)
        if phase and phase != row["phase"]:
            row["phase"] = phase
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

    def _note_server(self, row, res):
        """The old and new server's pids and when the stop and readiness happened (``gpufleet_server_seen``)."""
        if _RUN is not None:
            _RUN.gpufleet_server_seen(row["seen"], res, self._wall())
            row["lock"] = _RUN.gpufleet_lock_seen(row["lock"], res)

    def finish(self, status="successful"):
        """End the run: hosts still running are ``ok`` after a run that ended (ansible-runner status
        successful/failed), ``cancelled`` (the summary callback's word) after one that was cancelled, timed out or did not finish; a cancelled
        restart host gets a cause saying what its phase leaves behind (``gpufleet_cut_short``)."""
        now = self._clock()
        for row in self._hosts.values():
            if row["ended"] is None:
                row["ended"] = now
            if row["state"] == "running":
                row["state"] = "ok" if status in ("successful", "failed") else "cancelled"
                if row["state"] == "cancelled" and row["phase"] and not row["cause"]:
                    row["cause"] = cut_short(row["phase"], row["host"], seen=row["seen"], lock=row["lock"])

    def wall(self):
        """The wall clock (epoch s) this progress reads."""
        return self._wall()

    def hosts(self):
        now = self._clock()
        out = []
        for name in self._order:
            row = dict(self._hosts[name])
            row["elapsed_s"] = round((row["ended"] or now) - row["started"], 1)
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
            if _RUN is not None:
                line.update(_RUN.gpufleet_outage_so_far(row["seen"], now))
            out[row["host"]] = line
    return out


def _plain_rows(progress):
    return {row["host"]: {"host": row["host"], "result": row["state"], "changed": row["changed"],
                          "cause": row["cause"]} for row in progress.hosts()}


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
    command-line checks that refused the run), ``hosts`` (host → row: restart rows as restart.yml publishes
    them; check rows ``verdict``/``gpus_ok``/``gpus_total``/``reasons``; patch/unlock ``result``/``changed``/
    ``cause``), ``failed_hosts`` (sorted list), ``stats`` (Ansible's per-host counters), ``exit_code`` (int).
    """
    progress.finish(status)
    if command == "restart":
        hosts = _restart_rows(progress)
    elif command == "check":
        hosts = _check_rows(progress, report_dir)
    else:
        hosts = _plain_rows(progress)
    failed = sorted(h for h, row in hosts.items() if host_is_bad(command, row))
    if rc:
        exit_code = rc
    elif failed or progress.run_errors or status not in ("successful",):
        exit_code = 1
    else:
        exit_code = 0
    return {"command": command, "status": status, "rc": rc, "check_mode": bool(check_mode),
            "artifacts_dir": artifacts_dir, "run_errors": list(progress.run_errors), "hosts": hosts,
            "failed_hosts": failed, "stats": progress.stats or {}, "exit_code": exit_code}
