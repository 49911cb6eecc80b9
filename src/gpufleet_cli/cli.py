"""``gpufleet check|restart|patch|unlock|history|tune``: gpufleet's playbooks through ansible-runner, with live progress.

The playbook runs as AWX runs it (ansible-runner, job events, artifacts on disk); this prints a line or a
live table per host (phase, elapsed, task), then the fleet table, and exits non-zero when a host failed, was
unreachable or is CRIT. ``--json`` prints only the report (see ``events.build_report``).

Playbooks come from the gpufleet checkout the command runs in (or was installed from: ``pip install -e``),
else from the installed ``gpufleet.fleet`` collection (``ansible-playbook gpufleet.fleet.<name>``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

from gpufleet_cli import __version__, core
from gpufleet_cli.events import FleetProgress, build_report

COMMANDS = {
    "check": "read-only fleet check (GPUs, processes, whether SGLang serves); exit 1 when a host is CRIT",
    "restart": "rolling restart: preflight, then per host patch, stop, wait, launch, verify",
    "patch": "the NCCL patch alone (no restart)",
    "unlock": "show who holds a host's restart lock and remove it (--check only shows)",
    "history": "a host's launch history: every verified launch with its NCCL values, release and figures",
    "tune": "try NCCL/speculative candidates on one canary host, keep the fastest as a profile",
}
DEFAULT_PHASE = {"check": "check", "patch": "patch", "unlock": "unlock", "restart": None, "history": "history",
                 "tune": None}
# set_stats keys whose table the command prints (history.yml, tune.yml).
TABLE_STATS = {"history": "gpufleet_history", "tune": "gpufleet_tune"}
RESTART_COLUMNS = ("result", "downtime_s", "release_wait_ms", "tokens_per_s", "nccl", "old_pid", "new_pid")


class UsageError(Exception):
    """A command-line value the command cannot use; main() prints it and exits 2, running nothing."""


def find_project(start=None):
    """The gpufleet checkout (str) holding ``start`` (default: cwd) or this package, else None.

    A checkout is a directory with ``ansible.cfg``, ``galaxy.yml`` and ``playbooks/restart.yml``.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for base in (os.path.abspath(start or os.getcwd()), here):
        path = base
        while True:
            if all(os.path.exists(os.path.join(path, p)) for p in ("ansible.cfg", "galaxy.yml",
                                                                   os.path.join("playbooks", "restart.yml"))):
                return path
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return None


def parse_extra(values):
    """``-e KEY=VALUE`` (VALUE as YAML/JSON when it parses, else a string) and ``-e @file.yml`` → dict."""
    import yaml
    out = {}
    for item in values or []:
        if item.startswith("@"):
            with open(item[1:]) as fh:
                data = yaml.safe_load(fh) or {}
            if not isinstance(data, dict):
                raise SystemExit("gpufleet: -e %s: the file must hold a mapping of variables" % item)
            out.update(data)
            continue
        if item.lstrip().startswith("{"):
            data = yaml.safe_load(item)
            if not isinstance(data, dict):
                raise SystemExit("gpufleet: -e %r: not a mapping" % item)
            out.update(data)
            continue
        if "=" not in item:
            raise SystemExit("gpufleet: -e %r: write KEY=VALUE, a JSON/YAML mapping or @FILE" % item)
        key, value = item.split("=", 1)
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            parsed = value
        out[key.strip()] = parsed if isinstance(parsed, (int, float, bool, list, dict)) and value else value
    return out


def secrets_on_command_line(values):
    """Names of secret variables (``*api_key``) given a value inline in ``-e`` (``KEY=VALUE`` or a JSON/YAML
    mapping), sorted. Such a value sits in this command's own argv, which every user of the controller reads
    with ``ps``; ``-e @FILE`` (mode 0600) or the vaulted inventory keep it out. Unparsable items are skipped:
    :func:`parse_extra` reports them."""
    import yaml
    names = set()
    for item in values or []:
        if item.startswith("@"):
            continue
        if item.lstrip().startswith("{"):
            try:
                data = yaml.safe_load(item)
            except yaml.YAMLError:
                continue
            pairs = data.items() if isinstance(data, dict) else []
        else:
            key, eq, value = item.partition("=")
            pairs = [(key.strip(), value)] if eq else []
        names.update(str(k) for k, v in pairs if str(k).lower().endswith("api_key") and v not in (None, ""))
    return sorted(names)


def build_parser():
    parser = argparse.ArgumentParser(prog="gpufleet", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version="gpufleet " + __version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{%s}" % ",".join(COMMANDS))
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("-i", "--inventory", action="append", metavar="PATH",
                       help="inventory file or directory (repeatable; default: ansible.cfg's, else inventory/lab "
                            "of the checkout when it exists)")
        p.add_argument("-l", "--limit", metavar="PATTERN", help="Ansible's --limit (host, group or pattern)")
        p.add_argument("--serial", metavar="N|PCT", help="hosts restarted at a time: a number or a percentage "
                                                        "(-e gpufleet_serial=...)")
        p.add_argument("-C", "--check", action="store_true", help="Ansible's check mode: change nothing")
        p.add_argument("--json", action="store_true", help="print only the report as JSON (no progress)")
        p.add_argument("-e", "--extra-vars", action="append", metavar="KEY=VALUE",
                       help="extra variable (repeatable): KEY=VALUE, a JSON/YAML mapping, or @FILE")
        p.add_argument("-v", "--verbose", action="count", default=0,
                       help="more detail in the run's stdout (artifacts) and the task column")
        p.add_argument("--artifacts-dir", metavar="DIR",
                       help="where runs are kept (default: <checkout>/artifacts, else ~/.local/state/gpufleet)")
        p.add_argument("--project-dir", metavar="DIR",
                       help="gpufleet checkout to run from (default: the one around the current directory)")
        if name in ("history", "tune"):
            p.add_argument("host", help="the host (history: a host, group or pattern; tune: one canary host)")
        if name == "history":
            p.add_argument("--last", type=int, metavar="N", help="the N newest launches per host (0 = all; "
                                                                 "default 20)")
        if name == "tune":
            p.add_argument("-c", "--candidates", required=True, metavar="FILE",
                           help="YAML file holding gpufleet_tune_candidates (a list of {name, sglang_nccl_env, "
                                "sglang_launch_args})")
            p.add_argument("--repeats", type=int, metavar="N", help="rounds per candidate (default 3)")
            p.add_argument("--report", metavar="PATH", help="write the report as JSON to PATH (on this machine)")
            p.add_argument("--profile", metavar="NAME", help="save the winner as this profile (default tune-HOST)")
    return parser


def tune_candidates(path):
    """The candidates of ``gpufleet tune -c FILE`` (list): the file's ``gpufleet_tune_candidates``, or the file
    itself when it holds a list. Raises :class:`UsageError` for a file that cannot be read or holds neither, and
    for candidates whose structure the core refuses (tune.check_candidates with every NCCL variable the file names
    unchecked: their values are judged by tune.yml's first play with the inventory's sglang_nccl_env_unchecked),
    naming every problem: nothing runs then."""
    import yaml
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError("-c %s: %s" % (path, str(exc).splitlines()[0] if str(exc) else exc)) from None
    candidates = data.get("gpufleet_tune_candidates") if isinstance(data, dict) else data
    if not isinstance(candidates, list):
        raise UsageError("-c %s: the file must hold gpufleet_tune_candidates, a list of candidates "
                         "({name, sglang_nccl_env, sglang_launch_args})" % path)
    # Structure only: the NCCL values are judged by tune.yml's first play against the canary's own
    # sglang_nccl_env_unchecked (the inventory's, which this machine does not read), so every variable the file
    # names is passed as unchecked here.
    names = set()
    for entry in candidates:
        env = entry.get("sglang_nccl_env") if isinstance(entry, dict) else None
        if isinstance(env, dict):
            names.update(name for name in env if isinstance(name, str))
    try:
        problems = core.load("tune").check_candidates(candidates, sorted(names))
    except (ImportError, AttributeError):  # an older collection: tune.yml checks them itself
        problems = []
    if problems:
        raise UsageError("-c %s: %s" % (path, "; ".join(problems)))
    return candidates


def run_spec(args, project, now=None):
    """What ansible_runner.run_async gets (dict) plus ``run_dir`` and ``report_dir``; no side effects."""
    now = now or datetime.datetime.now()
    ident = "%s-%s-%d" % (now.strftime("%Y%m%dT%H%M%S"), args.command, os.getpid())
    base = args.artifacts_dir or (os.path.join(project, "artifacts") if project else
                                  os.path.join(os.path.expanduser("~"), ".local", "state", "gpufleet"))
    run_dir = os.path.join(os.path.abspath(base), ident)
    report_dir = os.path.join(run_dir, "report")
    extravars = parse_extra(args.extra_vars)
    if args.serial is not None:
        extravars["gpufleet_serial"] = args.serial
    if args.command == "unlock" and args.limit and "target" not in extravars:
        extravars["target"] = args.limit
    if args.command == "check":
        extravars.setdefault("gpufleet_report_dir", report_dir)
    if args.command in ("history", "tune"):
        extravars["target"] = args.host
    if args.command == "history" and args.last is not None:
        extravars["gpufleet_history_last"] = args.last
    if args.command == "tune":
        extravars["gpufleet_tune_candidates"] = tune_candidates(args.candidates)
        for option, name in (("repeats", "gpufleet_tune_repeats"), ("profile", "gpufleet_tune_profile")):
            if getattr(args, option) is not None:
                extravars[name] = getattr(args, option)
        if args.report:
            extravars["gpufleet_tune_report"] = os.path.abspath(args.report)
    envvars = {"ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    bindir = os.path.dirname(sys.executable)
    envvars["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
    # One directory per run: ansible-runner writes its artifacts (stdout, job_events/) to <artifact_dir>/<ident>,
    # which is the run's own directory (its default, <private_data_dir>/artifacts/<ident>, doubled the path).
    spec = {"private_data_dir": run_dir, "artifact_dir": os.path.dirname(run_dir), "ident": ident,
            "extravars": extravars, "quiet": True, "envvars": envvars}
    if project:
        spec["project_dir"] = project
        spec["playbook"] = os.path.join(project, "playbooks", args.command + ".yml")
        envvars["ANSIBLE_CONFIG"] = os.path.join(project, "ansible.cfg")
    else:
        spec["playbook"] = "gpufleet.fleet." + args.command
    inventories = []
    for inv in args.inventory or []:
        if "," in inv:  # Ansible's host list: "gpu-01,gpu-02,"
            inventories.append(inv)
        elif not os.path.exists(inv):
            raise UsageError("-i %s: no such inventory file or directory (give the path of an inventory, e.g. "
                             "inventory/example, or a host list ending in a comma: -i gpu-01,)" % inv)
        else:
            inventories.append(os.path.abspath(inv))
    if not inventories and project and os.path.exists(os.path.join(project, "inventory", "lab", "hosts.yml")):
        inventories = [os.path.join(project, "inventory", "lab")]
    if inventories:
        spec["inventory"] = inventories
    if args.limit:
        spec["limit"] = args.limit
    if args.check:
        spec["cmdline"] = "--check"
    if args.verbose:
        spec["verbosity"] = args.verbose
    return spec, run_dir, report_dir


def write_extravars(run_dir, extravars):
    """Write ``extravars`` (dict) to ``<run_dir>/env/extravars`` as JSON, mode 0600 in a 0700 directory.

    ansible-runner passes that file as ``-e @<path>``, so the values (API keys, survey answers) never appear on
    ``ansible-playbook``'s command line, where ``ps`` shows them to every user of the controller. ansible-runner
    would put an ``extravars=`` dict there verbatim. Returns the path. Raises OSError when the file cannot be
    written.
    """
    env_dir = os.path.join(run_dir, "env")
    os.makedirs(env_dir, mode=0o700, exist_ok=True)
    os.chmod(env_dir, 0o700)
    path = os.path.join(env_dir, "extravars")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(extravars or {}, fh)
    os.chmod(path, 0o600)
    return path


def _cell(value, fmt=None):
    if value is None or value == "":
        return "-"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt % value
    return str(value)


def fleet_table(report):
    """rich Table of the report's hosts (columns per command)."""
    from rich.table import Table
    command = report["command"]
    table = Table(title="gpufleet %s%s" % (command, " (check mode)" if report["check_mode"] else ""),
                  title_justify="left")
    table.add_column("host", no_wrap=True)
    rows = [report["hosts"][h] for h in sorted(report["hosts"])]
    if command == "restart":
        for col in RESTART_COLUMNS:
            table.add_column(col, justify="right" if col not in ("result", "nccl") else "left")
        for row in rows:
            cells = [_cell(row.get(c), {"downtime_s": "%.1f", "release_wait_ms": "%d",
                                        "tokens_per_s": "%.1f"}.get(c)) for c in RESTART_COLUMNS]
            if row.get("still_down"):  # as the summary callback writes it: down, N s so far
                i = RESTART_COLUMNS.index("downtime_s")
                cells[i] = "down" if cells[i] == "-" else "down:" + cells[i]
            table.add_row(row["host"], *cells)
    elif command == "check":
        table.add_column("verdict")
        table.add_column("gpus_ok", justify="right")
        table.add_column("reasons")
        group_reasons = core.load("check").group_reasons
        for row in rows:
            # the same reason on several GPUs once, with its GPUs ("WARN GPU 0–7: GPU temperature 87 C >= 85 C")
            reasons = "; ".join("%s %s" % (g["severity"] or "", g["label"] or g["code"] or "")
                                for g in group_reasons(row.get("reasons") or []))
            total = row.get("gpus_total")
            gpus = "-" if total is None else "%s/%s" % (_cell(row.get("gpus_ok")), total)
            table.add_row(row["host"], row["verdict"], gpus, reasons or "-")
    else:
        table.add_column("result")
        table.add_column("changed", justify="right")
        table.add_column("cause")
        for row in rows:
            table.add_row(row["host"], row["result"], str(row.get("changed", 0)), row.get("cause") or "-")
    return table


def tune_fallback_table(report):
    """The tune report in a few lines, for a collection whose core has no ``tune.table``."""
    lines = ["winner: %s (baseline: %s)%s" % (report.get("winner"), report.get("baseline"),
                                              "; " + report["reason"] if report.get("reason") else "")]
    metric = report.get("metric") or "single_stream_tok_s"
    for cand in report.get("candidates") or []:
        figure = cand.get(metric) or {}
        lines.append("  %-24s %s median %s (min %s, max %s)%s" % (
            cand.get("name"), metric, _cell(figure.get("median"), "%.1f"), _cell(figure.get("min"), "%.1f"),
            _cell(figure.get("max"), "%.1f"), "" if cand.get("ok") else "  not ok: %s" % (cand.get("note") or "?")))
    return "\n".join(lines)


def command_table(command, artifact_data, project=None):
    """The table ``gpufleet history`` or ``gpufleet tune`` prints (str), from what the playbook published with
    set_stats (:data:`TABLE_STATS`), with the core's own functions (history.history_table, tune.table; a core
    without tune.table gets :func:`tune_fallback_table`); None when the playbook published nothing."""
    data = (artifact_data or {}).get(TABLE_STATS.get(command, ""))
    if not data:
        return None
    if command == "history":
        history = core.load("history", project=project)
        return history.history_table(history.fleet_entries(data))
    table = getattr(core.load("tune", project=project), "table", None)
    return table(data) if table else tune_fallback_table(data)


def _why_lines(report):
    """Below the table: what went wrong per host (restart rows' phase/cause/next), the notes of restart rows that
    went well (a first launch: no server ran before), one line per note, and run-wide refusals."""
    # Ansible's own messages as it printed them ("[ERROR]: ..."); the guard play's refusals as refusals
    lines = [err if err.startswith(("[", "ERROR!")) else "run refused: %s" % err for err in report["run_errors"]]
    notes = {}
    for host in sorted(report["hosts"]) if report["command"] == "restart" else []:
        row = report["hosts"][host]
        advice = row.get("advice")
        # only the notes of rows that went well; a not_started row's advice belongs to the failed host's line
        if advice and row.get("result") in ("ok", "check") and host not in report["failed_hosts"]:
            notes.setdefault(advice, []).append(host)
    lines += ["%s: %s" % (", ".join(hosts), note) for note, hosts in notes.items()]
    for host in report["failed_hosts"]:
        row = report["hosts"][host]
        if report["command"] == "check":
            continue
        parts = [str(row[k]) for k in ("phase", "cause", "advice") if row.get(k)]
        if parts:
            lines.append("%s: %s" % (host, " — ".join(parts)))
    return lines


# The progress lines printed when a phase begins (stderr not a terminal: a CI log, a pipe): when it began, counted
# from the start of the run (one clock for every host, so a rolling restart's hosts line up), and how long the
# host's phase before it took: where the time went, read off one line.
PHASE_HEADER = "  %-20s %-10s %11s  %s" % ("host", "phase", "since start", "phase before")


def phase_line(entry):
    """``  gpu-01               wait            +12.3 s  stop 3.1 s`` for one :attr:`FleetProgress.phase_log` entry
    (its column heads: :data:`PHASE_HEADER`)."""
    before = "%s %.1f s" % (entry["previous"], entry["previous_s"]) if entry.get("previous") else "-"
    return "  %-20s %-10s %9s s  %s" % (entry["host"], entry["phase"], "+%.1f" % entry["began_s"], before)


def _progress_table(progress, verbose):
    """The live table (stderr a terminal): per host its phase, how long it has been in it, how long since its first
    task, its state and task."""
    from rich.table import Table
    table = Table(box=None, show_header=True, pad_edge=False)
    for col in ("host", "phase", "in phase", "host total", "state", "task"):
        table.add_column(col, no_wrap=col != "task", overflow="ellipsis",
                         justify="right" if col in ("in phase", "host total") else "left")
    for row in progress.hosts():
        style = {"failed": "red", "unreachable": "red", "ok": "green"}.get(row["state"])
        table.add_row(row["host"], row["phase"] or "-", "%.0f s" % row["in_phase_s"], "%.0f s" % row["elapsed_s"],
                      row["state"], row["task"][:80] if not verbose else row["task"], style=style)
    return table


def _print_phase_lines(err, progress, shown):
    """Print the phase changes not printed yet (``shown["n"]`` of them were), the column heads before the first."""
    for entry in progress.phase_log[shown["n"]:]:
        if not shown.get("header"):
            err.print(PHASE_HEADER, highlight=False, soft_wrap=True)
            shown["header"] = True
        err.print(phase_line(entry), highlight=False, soft_wrap=True)
    shown["n"] = len(progress.phase_log)


# After SIGTERM reached ansible-playbook, how long it gets to stop its tasks and print its summary before
# ansible-runner kills its process group (its own bound on a blocked cleanup is 30 s: gpufleet_summary).
PLAYBOOK_CANCEL_GRACE_S = 45.0


class CancelRequest(threading.Event):
    """Set by the first Ctrl-C or SIGTERM; ``count`` counts them (a second one kills the playbook at once)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def request(self):
        self.count += 1
        self.set()


def _say_cancelling(err, playbook_pid):
    """The first line after Ctrl-C or SIGTERM: what happens to the playbook now."""
    if playbook_pid:
        text = ("gpufleet: cancelling: ansible-playbook (pid %d) got SIGTERM, as from an AWX cancel: it stops its "
                "running tasks now (no rescue, rollback or always: section runs), prints its summary with what each "
                "host was left in, and the report follows; it is killed if it has not ended within %.0f s. Ctrl-C "
                "or SIGTERM again kills it at once" % (playbook_pid, PLAYBOOK_CANCEL_GRACE_S))
    else:
        text = ("gpufleet: cancelling: ansible-playbook has not started a task yet; ansible-runner kills it now "
                "(nothing was changed on any host); the report follows")
    err.print(text, highlight=False, soft_wrap=True)


def _send_sigterm(pid):
    """SIGTERM to ``pid`` (ansible-playbook's main process; its workers are told by it). False when it is gone."""
    import signal
    try:
        os.kill(pid, signal.SIGTERM)
        return True
    except OSError:
        return False


def cancel_step(cancel, cancelled_at, now, playbook_pid, grace_s=PLAYBOOK_CANCEL_GRACE_S):
    """What the run loop does about a cancel at ``now`` (monotonic s): ``(action, cancelled_at)`` with action
    ``None`` (nothing to do), ``"term"`` (say so and send SIGTERM to ``playbook_pid``), ``"kill"`` (ansible-runner
    kills the playbook: no pid known yet, a second Ctrl-C/SIGTERM, or ``grace_s`` passed since the SIGTERM)."""
    if not cancel.is_set():
        return None, cancelled_at
    if cancelled_at is None:
        return ("term" if playbook_pid else "kill"), now
    if getattr(cancel, "count", 1) > 1 or now - cancelled_at > grace_s:
        return "kill", cancelled_at
    return None, cancelled_at


def _cancel_on_signals(cancel):
    """Make SIGTERM (kill, systemd, a CI job's timeout) cancel the run as Ctrl-C does: ``cancel`` is set (a
    :class:`CancelRequest` counts the signals), the playbook gets SIGTERM and the report is still written. Before, SIGTERM ended this process at
    once, leaving ansible-playbook without its reader and no report. SIGINT keeps Python's handler (Ctrl-C raises
    KeyboardInterrupt, handled in :func:`run`); where SIGINT is ignored (a background job of a shell script),
    it stays ignored, as a background job's should: send SIGTERM. Only in the main thread (signal handlers
    cannot be set elsewhere). Returns a function that puts the previous handlers back."""
    import signal
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        getattr(cancel, "request", cancel.set)()

    signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, previous)


def run(args, out=None, err=None):
    """Run the command; returns the report dict (``exit_code`` inside). ``out``/``err``: rich Consoles."""
    import ansible_runner
    from rich.console import Console
    # a pipe or a file gets wide lines (paths and the table stay whole); a terminal its own width
    out = out or Console(width=None if sys.stdout.isatty() else 200)
    err = err or Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    project = os.path.abspath(args.project_dir) if args.project_dir else find_project()
    if args.project_dir and not project:
        raise SystemExit("gpufleet: --project-dir %s is not a gpufleet checkout" % args.project_dir)
    try:
        # The core (plugins/plugin_utils) of the collection whose playbooks run: the checkout's, else the installed one.
        core_run = core.load("run", project=project)
    except core.CoreMissing as exc:
        raise UsageError(str(exc)) from None
    spec, run_dir, report_dir = run_spec(args, project)
    os.makedirs(report_dir, exist_ok=True)
    write_extravars(run_dir, spec.pop("extravars"))
    progress = FleetProgress(default_phase=DEFAULT_PHASE[args.command], run=core_run)
    lock = threading.Lock()
    shown = {"n": 0}

    def on_event(event):
        with lock:
            progress.handle(event)
        return True

    if not args.json:
        err.print("gpufleet %s: %s%s" % (args.command, spec["playbook"],
                                         " (check mode)" if args.check else ""), highlight=False)
    # Ctrl-C or SIGTERM: ansible-playbook gets SIGTERM (as from an AWX cancel: it stops its tasks and prints its
    # summary); ``kill`` makes ansible-runner kill its process group (SIGKILL): at once when no task started yet,
    # on a second Ctrl-C/SIGTERM, or PLAYBOOK_CANCEL_GRACE_S after the SIGTERM.
    cancel = CancelRequest()
    kill = threading.Event()
    restore = _cancel_on_signals(cancel)
    thread, runner = ansible_runner.run_async(event_handler=on_event, cancel_callback=kill.is_set, **spec)
    live = None
    if not args.json and err.is_terminal:
        from rich.live import Live
        live = Live(_progress_table(progress, args.verbose), console=err, refresh_per_second=4, transient=False)
        live.start()
    cancelled_at = None
    try:
        while thread.is_alive():
            try:
                thread.join(0.25)
                with lock:
                    pid = progress.playbook_pid
                action, cancelled_at = cancel_step(cancel, cancelled_at, time.monotonic(), pid)
                if action == "term":
                    _say_cancelling(err, pid)
                    if not _send_sigterm(pid):
                        kill.set()
                elif action == "kill":
                    if not kill.is_set() and not pid:
                        _say_cancelling(err, None)
                    kill.set()
                with lock:
                    if live is not None:
                        live.update(_progress_table(progress, args.verbose))
                    elif not args.json:
                        _print_phase_lines(err, progress, shown)
            except KeyboardInterrupt:  # Ctrl-C: the first cancels, a second kills
                cancel.request()
    finally:
        if thread.is_alive():  # an error of our own: do not leave the playbook running unread
            kill.set()
            thread.join(30)
        restore()
        if live is not None:
            with lock:
                live.update(_progress_table(progress, args.verbose))
            live.stop()
    artifacts = runner.config.artifact_dir if getattr(runner, "config", None) else run_dir
    status = runner.status
    # A playbook ended by the cancel (rc 99 after its SIGTERM, or killed) is cancelled; one that finished anyway
    # (the cancel came as it ended) is not.
    if cancel.is_set() and not (status == "successful" and runner.rc == 0 and progress.stats is not None):
        status = "canceled"
    report = build_report(args.command, progress, status, runner.rc, artifacts, report_dir,
                          check_mode=args.check)
    if args.command in TABLE_STATS:  # history: {host: entries}; tune: the report
        report[args.command] = progress.artifact_data.get(TABLE_STATS[args.command])
    with open(os.path.join(run_dir, "report.json"), "w") as fh:
        json.dump(report, fh, indent=2, sort_keys=True, default=str)
    if args.json:
        out.print_json(json.dumps(report, default=str)) if out.is_terminal else \
            print(json.dumps(report, indent=2, sort_keys=True, default=str))
        return report
    if live is None:
        _print_phase_lines(err, progress, shown)
    table = command_table(args.command, progress.artifact_data, project) if args.command in TABLE_STATS else None
    if table:
        out.print(table, highlight=False, markup=False, soft_wrap=True)
    if report["hosts"] and (table is None or report["failed_hosts"]):
        out.print(fleet_table(report))
    for line in _why_lines(report):
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    err.print("status %s, rc %s; artifacts: %s (stdout, job_events/); report: %s" % (
        report["status"], "-" if report["rc"] is None else report["rc"], artifacts,
        os.path.join(run_dir, "report.json")), highlight=False, soft_wrap=True)
    return report


def main(argv=None):
    args = build_parser().parse_args(argv)
    start = time.monotonic()
    inline = secrets_on_command_line(getattr(args, "extra_vars", None))
    if inline:
        print("gpufleet %s: WARNING: %s given inline with -e is in this command's argv, which every user of this "
              "machine can read (ps); pass it as -e @FILE (a 0600 file) or keep it vaulted in the inventory"
              % (args.command, ", ".join(inline)), file=sys.stderr)
    try:
        report = run(args)
    except UsageError as exc:
        print("gpufleet %s: %s. Nothing was run." % (args.command, exc), file=sys.stderr)
        return 2
    if not args.json:
        from rich.console import Console
        Console(stderr=True).print("%s: %s, %.0f s" % (verdict(report), count_line(report), time.monotonic() - start),
                                   highlight=False)
    return report["exit_code"]


def verdict(report):
    """The last line's first word: ``CANCELLED`` for a run cancelled before it finished (Ctrl-C, SIGTERM), else
    ``FAILED`` when the exit code is not 0, else ``ok``: a cancel that came as the playbook finished is no
    failure, and a cancelled run is not called FAILED beside hosts that are ok."""
    if report.get("status") == "canceled":
        return "CANCELLED"
    return "FAILED" if report["exit_code"] else "ok"


# Restart results after which the host is as it was before the run.
UNTOUCHED_RESULTS = ("refused", "not_started", "not_reached")


def count_line(report):
    """``4 host(s): 2 ok, 1 rolled_back, 1 not_started (untouched)`` for a restart (results in first-seen order;
    refused, not_started and not_reached say that nothing was changed), ``... : 3 OK, 1 CRIT`` for a check, and
    ``N host(s), M failed`` for the other commands."""
    hosts = report["hosts"]
    if report["command"] not in ("restart", "check"):
        return "%d host(s), %d failed" % (len(hosts), len(report["failed_hosts"]))
    key = "result" if report["command"] == "restart" else "verdict"
    counts = {}
    for host in sorted(hosts):
        value = str(hosts[host].get(key) or "?")
        counts[value] = counts.get(value, 0) + 1
    parts = ["%d %s%s" % (n, value, " (untouched)" if value in UNTOUCHED_RESULTS else "")
             for value, n in counts.items()]
    return "%d host(s)%s" % (len(hosts), (": " + ", ".join(parts)) if parts else "")


if __name__ == "__main__":
    sys.exit(main())
