"""The restart's run and summary decisions: what a host's results say happened, and its summary row.

Controller-side core, imported as ``ansible_collections.gpufleet.fleet.plugins.plugin_utils.run`` by the filters
of plugins/filter/gpufleet_run.py (their names in the playbooks: ``gpufleet_<function>``), the summary callback
(plugins/callback/gpufleet_summary.py, for a run cut short before its rows) and the gpufleet CLI
(src/gpufleet_cli/events.py). Plain functions, unit-tested in tests/unit/plugins/plugin_utils/test_run.py.

- ``server_seen(seen, res, now)``, ``lock_seen(current, res)``: what a run's task results said about the servers
  and the restart lock of one host, one result at a time.
- ``cut_phase(phase, seen)``, ``cut_short(phase, host, word, seen, lock)``, ``lock_left(lock, host)``,
  ``outage_so_far(seen, now)``: what a run cancelled or interrupted in a phase left on the host.
- ``summary_rows(hosts, result, cause, phase, advice)``, ``restart_row(facts)``, ``preflight_rows(...)``,
  ``not_started_rows(...)``: summary rows (``ROW_KEYS``).
"""
from __future__ import annotations

from collections.abc import Mapping

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.phases import (
    CUT_SHORT_IN, RERUN_AFTER_CUT, unreachable_advice)
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.prefetch import cell as prefetch_cell


def cut_short(phase, host, word="cancelled", seen=None, lock=None):
    """What a restart of ``host`` cut short in ``phase`` (preflight|lock|patch|stop|wait|launch|verify|rollback)
    really did and what to do, one line starting with ``word`` (cancelled, interrupted); None for another phase.

    ``seen`` (:func:`server_seen`'s record of the results that came in) makes it exact: the old server's
    stop was seen (its pid), the stop started the new server (process method: its pid), a new server was seen
    ready. ``lock``: None when not known, False when the run held no restart lock on the host, else the lock
    record it held (``run_id``, ``lease_s``): the line then says the lock is left and how it is cleared
    (:func:`lock_left`)."""
    seen = seen or {}
    old, new, ready = seen.get("old_pid"), seen.get("new_pid"), seen.get("ready_at") is not None
    stopped = seen.get("stopped_at") is not None or bool(seen.get("stop_done"))
    what = " (old server pid %s)" % old if old and seen.get("stopped_at") is not None else \
        " (no server was running)" if stopped else ""
    rerun = RERUN_AFTER_CUT.format(host=host)
    if phase in ("stop", "wait", "launch", "verify") and ready and new:
        text = ("%s after the new server (pid %s) answered, before verify ended: it serves but was not verified "
                "(no NCCL values read, no generate checked) and not recorded as the launch to roll back to; %s"
                % (word, new, rerun))
    elif phase in ("stop", "wait", "launch", "verify") and stopped and new:
        text = ("%s after the stop%s: the new server (pid %s) was started but not verified and not recorded "
                "(it may still be loading, or have failed); %s" % (word, what, new, rerun))
    elif phase in ("stop", "wait") and stopped:
        text = ("%s after the stop%s, before a new server was started: this host serves nothing now; %s"
                % (word, what, rerun))
    elif phase == "launch" and stopped:
        text = ("%s in the launch, after the stop%s: the new server may have been started and be loading, or not; "
                "nothing was verified or recorded; %s" % (word, what, rerun))
    else:
        text = CUT_SHORT_IN.get(phase)
        if not text:
            return None
        text = text.format(word=word, host=host)
    left = lock_left(lock, host)
    return text + ". " + left if left and phase != "preflight" else text


def lock_seen(current, res):
    """The restart lock a run holds on one host after one more task result ``res``: the owner record (dict) once
    the gpufleet_lock module took or renewed it for this run, False once it released it (or the launch record's
    call did: ``lock_release``), else ``current`` (None: not known yet)."""
    if not isinstance(res, Mapping):
        return current
    if "acquired" in res and "lease_s" in res and isinstance(res.get("result"), str):
        if res.get("acquired") and isinstance(res.get("lock"), Mapping):
            return dict(res["lock"])
        if res.get("result") in ("released", "removed", "absent", "not_owner"):
            return False
    release = res.get("lock_release")
    if isinstance(release, Mapping) and release.get("result") in ("released", "absent", "not_owner"):
        return False
    return current


def lock_left(lock, host):
    """The sentence for a restart lock a cut-short run left on ``host`` ('' when ``lock`` is None, unknown, or
    False: none held). ``lock``: the owner record the run held (``run_id``, ``lease_s``)."""
    if not isinstance(lock, Mapping):
        return "" if lock is None else "No restart lock was left"
    lease = _num(lock.get("lease_s"))
    return ("The restart lock (run %s) stays on the host: a rerun from this controller takes it over at once (its "
            "pid is gone), one from elsewhere (a new AWX job) once its lease ends (%s after its last renewal), or at "
            "once after playbooks/unlock.yml -e target=%s"
            % (lock.get("run_id") or "?", "%d s" % lease if lease is not None else "gpufleet_lock_lease_s", host))


def cut_phase(phase, seen):
    """The phase to report for a host cut short in ``phase``: ``verify`` once :func:`server_seen`'s
    ``seen`` holds a new server seen ready during the stop, wait or launch (only verify was left), else ``phase``."""
    if (seen or {}).get("ready_at") is not None and phase in ("stop", "wait", "launch"):
        return "verify"
    return phase


def server_seen(seen, res, now):
    """Update ``seen`` (a mapping; keys set here: ``old_pid``, ``stopped_at``, ``new_pid``, ``ready_at``) from one
    task result ``res`` arriving at ``now`` (controller epoch s), for a run that is cut short before its summary
    row: the stop's result (module sglang_stop: ``signalled`` with signals sent, ``main_pid``, ``stop_ms``,
    ``start``) and the launch's (module sglang_process: ``pid``, ``ready``). ``stopped_at`` is ``now`` less the
    call's ``stop_ms``: when the signals went out, on the controller's clock. Returns ``seen``."""
    if not isinstance(res, Mapping):
        return seen
    signalled = res.get("signalled")
    if isinstance(signalled, list) and any(isinstance(p, Mapping) and p.get("signals") for p in signalled):
        if seen.get("stopped_at") is None:
            stop_ms = _num(res.get("stop_ms")) or 0.0
            seen["stopped_at"] = now - stop_ms / 1000.0
            seen["old_pid"] = _pid(res.get("main_pid")) or seen.get("old_pid")
        start = res.get("start") if isinstance(res.get("start"), Mapping) else {}
        if start.get("started") and _pid(start.get("pid")):
            seen["new_pid"] = _pid(start["pid"])
    elif isinstance(signalled, list) and isinstance(res.get("start"), Mapping):
        # restart.yml's own stop (only it passes start_after; preflight's check-mode preview returns no start)
        # found no server to stop; it may have started the new one
        seen["stop_done"] = True
        if res["start"].get("started") and _pid(res["start"].get("pid")):
            seen["new_pid"] = _pid(res["start"]["pid"])
    elif "ready" in res and _pid(res.get("pid")) and "signalled" not in res:
        seen["new_pid"] = _pid(res["pid"])
        if res.get("ready") is True and seen.get("ready_at") is None:
            seen["ready_at"] = now
    return seen


def outage_so_far(seen, now):
    """``{"old_pid", "new_pid", "downtime_s", "still_down"}`` from :func:`server_seen`'s ``seen``:
    the downtime from the stop's signals until a new server was seen ready, or until ``now`` (still down); both
    null when this run stopped no server."""
    out = {"old_pid": seen.get("old_pid"), "new_pid": seen.get("new_pid"), "downtime_s": None, "still_down": None}
    if seen.get("stopped_at") is not None and seen.get("old_pid") is not None:
        ready_at = seen.get("ready_at")
        out["still_down"] = ready_at is None
        out["downtime_s"] = round(max((ready_at if ready_at is not None else now) - seen["stopped_at"], 0.0), 1)
    return out


# The summary row's keys (playbooks/restart.yml, the gpufleet_summary callback, AWX's gpufleet_restart).
ROW_KEYS = ("host", "result", "phase", "cause", "advice", "rollback", "downtime_s", "still_down",
            "release_wait_ms", "tokens_per_s", "nccl", "old_pid", "new_pid", "prefetch_gib", "prefetch_s",
            "resident_pct")


def summary_rows(hosts, result, cause="", phase=None, advice=None):
    """Summary rows for hosts the run did not restart: ``{host: row}`` with every key of ``ROW_KEYS``
    (``result`` e.g. not_reached, not_started, refused; ``cause`` one line; the rest null)."""
    rows = {}
    for host in hosts or []:
        row = dict.fromkeys(ROW_KEYS)
        row.update(host=str(host), result=result, cause=cause or None, phase=phase, advice=advice)
        rows[str(host)] = row
    return rows


def _cut(line, limit):
    """``line`` cut to at most ``limit`` characters at a word's end, with "..." (a command is not cut mid-word)."""
    if len(line) <= limit:
        return line
    cut = line[:limit - 3]
    word_end = cut.rfind(" ")
    return (cut[:word_end] if word_end > limit // 2 else cut) + "..."


def _first_line(text, limit=300):
    if text is None:
        return None
    return _cut(" ".join(str(text).strip().split("\n", maxsplit=1)[0].split()), limit)


def _one_line(text, limit=300):
    """``text`` (a str, or a list of lines as assert's fail_msg gives) as one line of at most ``limit`` chars."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        text = " ".join(str(t) for t in text)
    return _cut(" ".join(str(text).split()), limit)


def _num(value):
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _pid(value):
    try:
        pid = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return pid if pid > 0 else None


def restart_row(facts):
    """The summary row of one host of restart.yml's rolling play, from its facts.

    ``facts`` (mapping; every key optional): ``host``; ``check_mode`` (bool); ``now`` (controller epoch s);
    ``failed_phase`` (stop|wait|patch|launch|verify|lock), ``failed_cause`` (one line in the user's words) and
    ``rollback`` ({state: rolled_back|relaunched_loading|file_only|failed|not_needed, detail, pid}) set by the rescue; ``failed_msg``
    (the failing task's message, used when there is no failed_cause); ``phase`` (last phase started);
    ``lock_refused`` (message when another run holds the lock); ``stop_started_epoch``, ``ready_epoch``
    (controller epoch s); ``stop_signal_epoch``, ``ready_target_epoch`` (the target's clock, epoch s: when the stop
    sent SIGTERM to the server, when the new server was first seen ready; when both are set the downtime is
    measured between them, free of controller task overhead and clock skew); ``stop_old_pid``; ``stop_signalled``
    (number of processes the stop signalled);
    ``release_wait_ms``; ``tokens_per_s``; ``nccl_ok`` (bool); ``new_pid``; ``lease_s`` (s); ``router_out_of_pool``
    (the router's URL when the run took the host out of its pool and did not put it back, else null);
    ``router_worker_url`` (the worker URL that run removed, for the advice to add it back by hand);
    ``ran_before`` (preflight's check-mode stop: whether an SGLang server or leftover ran on the host when the run
    began; false makes a failure before the stop say that none ran instead of "the old server still serves"; null
    when unknown); ``running_pid`` (the server's main pid that preflight's check-mode stop found: the row's
    ``old_pid`` when this run stopped nothing, e.g. a failure before the stop or ``--check``); ``previous_run``
    (the owner record of a restart lock this run took over: a run that did not finish, e.g. interrupted; keys
    run_id, controller, started, started_epoch (host epoch s)): on a host where no server ran, the note says
    that run most likely left it down, and since when at most; ``foreign_gpu_mib`` (``{GPU index: MiB}`` held by
    processes no GPU list names while the old server ran, preflight's baseline): the advice names it when the run
    stopped the server; ``prefetch`` (role sglang_prefetch's outcome, :func:`prefetch.outcome`: ``prefetch_gib``,
    ``prefetch_s``, ``resident_pct``, ``prefetch_note``): its figures go into the row, its note into the advice.

    Returns a mapping with ``ROW_KEYS``: ``result`` ok|check|failed|rolled_back|refused; ``phase``; ``cause``;
    ``advice`` (what to do next; on a row that is ok, only a note: "no server ran before this run ..." when
    this run launched one on a host without: a first launch, or a host that was down); ``rollback``
    ("state: detail"); ``downtime_s`` (s from the start of the stop
    until a server answered again; 0.0 when no server ran before; for a host still down: so far, with
    ``still_down`` true; null when nothing was stopped); ``release_wait_ms`` (null when no server ran before
    this run), ``tokens_per_s``, ``nccl`` (ok|fail|null), ``old_pid``, ``new_pid`` (after a rollback, the relaunched previous server's pid).
    """
    f = dict(facts or {})
    host = str(f.get("host") or "?")
    check = bool(f.get("check_mode"))
    rollback = f.get("rollback") if isinstance(f.get("rollback"), dict) else None
    rb_state = (rollback or {}).get("state")
    failed = bool(f.get("failed_phase") or f.get("failed_cause") or f.get("failed_msg"))
    stop_at = _num(f.get("stop_started_epoch"))
    ready_at = _num(f.get("ready_epoch"))
    target_stop_at, target_ready_at = _num(f.get("stop_signal_epoch")), _num(f.get("ready_target_epoch"))
    now = _num(f.get("now"))
    old_pid = _pid(f.get("stop_old_pid"))
    was_serving = old_pid is not None or bool(_num(f.get("stop_signalled")))
    stopped = stop_at is not None and not check
    # No server ran before this run and it launched one: a first launch or a host that was down, not a restart
    # (its downtime_s 0.0 says that no service was interrupted, not that a restart took no time).
    first_launch = stopped and not was_serving and (ready_at is not None or _pid(f.get("new_pid")) is not None)
    nothing_ran = str(f.get("ran_before")).lower() in ("false", "no", "0")  # None or absent: unknown
    rerun = "rerun playbooks/restart.yml -e target=%s" % host
    row = dict.fromkeys(ROW_KEYS)
    row["host"] = host
    if f.get("lock_refused"):
        row.update(result="refused", phase="lock", cause=_first_line(f["lock_refused"], 400),
                   advice="another run is restarting this host: wait for it, or for its lease to end; if it is "
                          "certainly gone, run playbooks/unlock.yml -e target=%s" % host)
        return row
    # The run stopped a server and started none without failing: only some phases ran (--tags stop).
    stop_only = (stopped and was_serving and not failed and ready_at is None and _pid(f.get("new_pid")) is None)
    if not failed:
        row["result"] = "check" if check else "ok"
        serving = not stop_only
    else:
        row["result"] = "rolled_back" if rb_state == "rolled_back" else "failed"
        row["phase"] = f.get("failed_phase") or f.get("phase")
        cause = _first_line(f.get("failed_cause"))
        if not cause or cause.endswith(":"):
            # A message whose first line only introduces the rest ("Validation of arguments failed:"): all of it.
            cause = _one_line(f.get("failed_msg")) or cause
        row["cause"] = cause
        if rollback:
            # What the host is left in, and what to do: kept whole up to 1000 characters.
            row["rollback"] = "%s: %s" % (rb_state, _first_line(rollback.get("detail") or "", 1000))
        if rb_state == "rolled_back":
            serving = True
        elif rb_state in ("failed", "file_only", "relaunched_loading"):
            serving = False
        else:
            serving = ready_at is not None or not stopped
    if stopped:
        if not was_serving:
            row["downtime_s"] = 0.0  # nothing served before this run: no service was interrupted
        elif target_stop_at is not None and target_ready_at is not None and rb_state not in (
                "rolled_back", "failed", "file_only", "relaunched_loading"):
            row["downtime_s"] = round(max(target_ready_at - target_stop_at, 0.0), 1)
        elif ready_at is not None and rb_state not in ("rolled_back", "failed", "file_only", "relaunched_loading"):
            row["downtime_s"] = round(max(ready_at - stop_at, 0.0), 1)
        elif now is not None:
            row["downtime_s"] = round(max(now - stop_at, 0.0), 1)
        row["still_down"] = bool(was_serving and not serving) or (not serving and failed)
    if failed:
        if not stopped and nothing_ran and not check:
            row["advice"] = ("nothing was stopped, and no SGLang server ran on this host when the run began "
                             "(preflight saw none), so it most likely serves nothing (playbooks/check.yml shows its "
                             "state): fix the cause, then %s" % rerun)
        elif not stopped:
            row["advice"] = ("nothing was stopped%s: fix the cause, then %s"
                             % ("" if check else ": the old server still serves", rerun))
        elif rb_state == "rolled_back":
            row["advice"] = "the previous server serves again (rolled back): fix the cause, then %s" % rerun
        elif rb_state == "relaunched_loading":
            rb_pid = _pid((rollback or {}).get("pid"))
            row["advice"] = ("the previous server was relaunched%s and still loads, not serving yet: "
                             "playbooks/check.yml -e target=%s shows when it serves; fix the cause, then %s"
                             % ((" (pid %s)" % rb_pid) if rb_pid else "", host, rerun))
        elif serving:
            row["advice"] = ("the new server serves but did not pass verification: fix the cause, then %s"
                             % rerun)
        else:
            row["advice"] = ("this host serves nothing now: fix the cause, then %s (playbooks/check.yml shows "
                             "its state)" % rerun)
        if f.get("router_out_of_pool"):
            # Nothing else puts it back: check.yml does not look at the router, and the server coming up later
            # (relaunched_loading) does not either.
            row["advice"] += ("; the host is out of the pool of the router %s until a restart.yml run for it "
                              "succeeds (or add %s back with the router's POST /workers)"
                              % (f["router_out_of_pool"], f.get("router_worker_url") or "the worker URL"))
        if first_launch:
            row["advice"] = "no server ran before this run: " + row["advice"]
    elif first_launch and isinstance(f.get("previous_run"), Mapping):
        # The outage an interrupted run left is counted nowhere else: this run found no server (downtime 0.0).
        prev = f["previous_run"]
        started_at = _num(prev.get("started_epoch"))
        ago = (", %d s before this run's stop" % max(stop_at - started_at, 0)) if (
            started_at is not None and stop_at is not None) else ""
        row["advice"] = ("no server ran before this run: the previous restart of this host (run %s from %s, "
                         "started %s) did not finish (this run took over its restart lock), so the host was most "
                         "likely down since that run's stop, at most since it started%s; downtime_s 0.0 counts "
                         "only this run" % (prev.get("run_id") or "?", prev.get("controller") or "?",
                                            prev.get("started") or "?", ago))
    elif first_launch:
        row["advice"] = ("no server ran before this run (a first launch, or the host was down), so none was "
                         "interrupted (downtime_s 0.0)")
    elif stop_only:
        row["advice"] = ("only the stop ran (tags): the server was stopped and none was started, so this host serves "
                         "nothing now; start, verify and record it with playbooks/restart.yml -e target=%s "
                         "--tags launch,verify, or %s" % (host, rerun))
    # A launch without the verify phase (--tags launch): the server answers health, but nothing checked that it
    # generates, that the NCCL values reached every worker, nor recorded it for a later rollback.
    launched = ready_at is not None or _pid(f.get("new_pid")) is not None
    if not failed and not check and launched and f.get("nccl_ok") is None:
        note = ("launched but not verified (the verify phase did not run): nothing checked generation or the NCCL "
                "values in the workers, and the launch was not recorded for a later rollback: check it with "
                "playbooks/restart.yml -e target=%s --tags verify (a full rerun also records it)" % host)
        row["advice"] = "%s; %s" % (row["advice"], note) if row["advice"] else note
    # Memory others held while the old server ran (preflight's baseline): the wait left it to them; say whose it is.
    foreign = f.get("foreign_gpu_mib")
    if isinstance(foreign, Mapping) and foreign and stopped:
        note = ("GPU memory held by processes no GPU list names was there while the old server ran and was left to "
                "them (%s): the wait after the stop waited for the server's own memory only"
                % ", ".join("GPU %s: %s MiB" % kv for kv in sorted(foreign.items(), key=lambda kv: int(kv[0]))))
        row["advice"] = "%s; %s" % (row["advice"], note) if row["advice"] else note
    # The weight prefetch (before the lock): its figures, and a note when it left part of the weights cold.
    pre = f.get("prefetch") if isinstance(f.get("prefetch"), Mapping) else {}
    for key in ("prefetch_gib", "prefetch_s", "resident_pct"):
        row[key] = _num(pre.get(key))
    if pre.get("prefetch_note"):
        note = _one_line(pre["prefetch_note"], 400)
        row["advice"] = "%s; %s" % (row["advice"], note) if row["advice"] else note
    # Nothing ran before this run: no memory was released, whatever the wait's first poll took.
    row["release_wait_ms"] = _num(f.get("release_wait_ms")) if was_serving else None
    row["tokens_per_s"] = _num(f.get("tokens_per_s"))
    nccl = f.get("nccl_ok")
    row["nccl"] = None if nccl is None or check else ("ok" if str(nccl).lower() in ("true", "1", "yes") else "fail")
    # Nothing stopped (a failure before the stop, --check): the server that still runs is the one preflight found.
    row["old_pid"] = old_pid if old_pid is not None or stopped else _pid(f.get("running_pid"))
    # After a rollback the pid that serves (or loads) is the relaunched previous server's, not the failed one's.
    rb_pid = _pid((rollback or {}).get("pid")) if rb_state in ("rolled_back", "relaunched_loading") else None
    # A failed host that serves nothing shows no new pid: the one this run started is gone (it crashed, or the
    # rollback stopped it), and naming it read as a server that runs. Only a rollback that failed to stop it
    # leaves it maybe running: then its pid is what to look at.
    new_may_run = serving or not failed or "while stopping the server this run launched" in str(
        (rollback or {}).get("detail") or "")
    row["new_pid"] = None if check else (rb_pid or (_pid(f.get("new_pid")) if new_may_run else None))
    return row


def preflight_rows(hostvars, targets, play_hosts_all, play_hosts):
    """Rows for restart.yml's preflight verdict: ``{host: row}`` for every targeted host.

    A host with the fact ``_gpufleet_refused`` (the refusal message) is ``refused``, its advice after
    ``sglang_preflight_server_ran`` (whether a server ran when the run began); one of ``play_hosts_all``
    missing from ``play_hosts`` (it went unreachable) is ``unreachable``; every other host is ``not_started``
    with the refused hosts named. Returns {} when no host was refused or lost.
    """
    refused = {}
    lost = []
    for host in targets or []:
        message = hostvars[host].get("_gpufleet_refused")
        if message:
            refused[host] = _first_line(message, 600)
        elif host in (play_hosts_all or []) and host not in (play_hosts or []):
            lost.append(host)
    if not refused and not lost:
        return {}
    names = list(refused) + lost
    rows = summary_rows([h for h in targets if h not in names], "not_started",
                        cause="preflight stopped the run before any host was touched (%s)" % ", ".join(names),
                        advice="nothing was changed on this host")
    rows.update(summary_rows(lost, "unreachable", phase="preflight",
                             cause="could not be reached during preflight",
                             advice=unreachable_advice("preflight")))
    for host, message in refused.items():
        # sglang_preflight_server_ran: whether preflight's check-mode stop found a server (null: unknown).
        ran = hostvars[host].get("sglang_preflight_server_ran")
        if ran is None or str(ran).lower() in ("", "none"):
            advice = "nothing was changed on this host: fix what the cause names, then rerun"
        elif str(ran).lower() in ("false", "no", "0"):
            advice = ("nothing was changed, and no SGLang server ran on this host when the run began (preflight saw "
                      "none), so it most likely serves nothing: fix what the cause names, then rerun")
        else:
            advice = "the old server still serves: fix what the cause names, then rerun"
        rows.update(summary_rows([host], "refused", phase="preflight", cause=message, advice=advice))
    return rows


def not_started_rows(hostvars, play_hosts_all, batch, stopped_at, result):
    """Rows for the hosts a stopped rolling restart will not start: hosts of ``play_hosts_all`` outside the
    current ``batch`` that have no ``gpufleet_summary_row`` fact yet. ``stopped_at``: the host that failed;
    ``result``: its result."""
    later = [h for h in play_hosts_all or [] if h not in (batch or []) and not hostvars[h].get("gpufleet_summary_row")]
    return summary_rows(later, "not_started", cause="the rolling restart stopped at %s (%s)" % (stopped_at, result),
                        advice="nothing was changed on this host: rerun once %s is fixed" % stopped_at)


def _cell(value, fmt=None):
    if value is None or value == "":
        return "-"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt % value
    return str(value)


def gpufleet_summary_table(rows):
    """Fixed-width summary of a restart run: one line per host.

    ``rows``: list of mappings with ``host``, ``result`` (ok|failed|skipped), ``downtime_s`` (s, stop start →
    ready), ``release_wait_ms`` (ms), ``prefetch`` (from ``prefetch_gib``, ``prefetch_s``, ``resident_pct``:
    ``8.0G/4.3s/100%``), ``tokens_per_s`` (output tokens/s or None), ``nccl`` (ok|fail|-),
    ``old_pid``, ``new_pid``. Missing values print as ``-``.
    """
    header = ("host", "result", "downtime_s", "release_wait_ms", "prefetch", "tokens_per_s", "nccl", "old_pid",
              "new_pid")
    lines = [header]
    for row in rows or []:
        lines.append((
            _cell(row.get("host")),
            _cell(row.get("result")),
            _cell(row.get("downtime_s"), "%.1f"),
            _cell(row.get("release_wait_ms"), "%d"),
            prefetch_cell(row),
            _cell(row.get("tokens_per_s"), "%.1f"),
            _cell(row.get("nccl")),
            _cell(row.get("old_pid")),
            _cell(row.get("new_pid")),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip()
                     for line in lines)
