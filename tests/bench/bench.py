#!/usr/bin/env python3
"""gpufleet lab benchmarks (issue 14): ``make bench`` → docs/benchmarks.json, docs/benchmarks.md (generated
section), docs/img/bench-*.png.

    bench.py [--only KEY[,KEY]] [--runs N] [--lab-dir DIR] [--hosts N] [--keep-lab] [--no-write]

Brings up its own lab (tests/lab/lab.py, ``--lab-dir`` default .lab-bench, 64 hosts unless ``--hosts``), runs the
measurements the selected keys need, takes the lab down, and merges the results into docs/benchmarks.json
(keys not measured this time keep their last value) and the Markdown section between BEGIN_MARK and END_MARK.

Definitions (all times Unix s on the controller clock unless noted):

- downtime (client view): an independent prober (one thread per host, in its own process) GETs
  ``http://sglang_host:sglang_port/health`` every ``--probe-ms``; a sample is good when the answer is HTTP 200.
  downtime = first good sample after the interruption − last good sample before it (``downtime_from_samples``).
- start-to-ready: the stand-in's log (tests/lab/standin): its first line gives the process's exec time (Unix s,
  /proc/self/stat starttime) and the wall clock, "The server is fired up and ready to roll!" the ready time
  (``parse_standin_log``).
- downtime_overhead_s: downtime − start-to-ready of the same restart (single host, ``-e target=HOST``).
- batch_overhead_s: play 3's wall (gpufleet_task_times callback: first task start → last task end of the play
  whose name starts with "Restart SGLang") − start-to-ready, one-host batch.
- check_s_64 / raw_s_64: ``ansible gpu_hosts -m gpufleet.fleet.nvidia_gpu_info`` vs a raw ssh fan-out of
  ``nvidia-smi --query-gpu=...`` with the very ssh command lines Ansible used (taken from ``-vvv`` of a warm-up
  ping, so ControlPath, ControlPersist, known_hosts and user are the same), ``forks`` at a time; alternating,
  warm connections. controller CPU = user+sys of the waited-for children (getrusage RUSAGE_CHILDREN).
- check_floor_*: the same fan-out through Ansible without gpufleet's module (``-m raw`` with the same query, and
  ``-m ping``), to separate Ansible's own per-host cost from the module's.
- mitogen group: the ad-hoc ``nvidia_gpu_info`` with mitogen's ``mitogen_linear`` strategy (mitogen from
  .cache/bench-site, requirements/bench.txt) against the default strategy, alternating, warm.
- prefetch group (issue 35; one host, a lab of 1 unless others need more): a real safetensors checkpoint of
  PREFETCH_SIZE_MIB MiB in PREFETCH_SHARDS shards in the host's target model dir (``lab.py weights``), the
  stand-in's ``slow_load_s`` 0 so its start is its own work plus reading them. Each run stops the server
  (``restart.yml --tags stop,wait``: a serving stand-in maps its shards, and DONTNEED leaves mapped pages), evicts
  the model files (``lab.py evict``: DONTNEED, never a machine-wide drop) and restarts with the prefetch off (cold)
  or on (prefetched); start-to-ready as for start_to_ready_s_1, the read itself from ``/get_server_info``
  (``weights_load_s``, ``weights_resident_before_pct``). One cold run before the pairs is not counted (the first
  read after writing is the slowest: a virtual disk's host caches what was read). Cold and prefetched runs then
  alternate (ABBA): drift in the machine's speed lands on both. Every lab host shares one page cache: one host,
  nothing else of the bench running. The checkpoint is removed at the end.
- module_exit group (no lab): a gpufleet module's process end, from its ``sys.exit`` (after the result is
  printed) to the parent seeing the process gone, as run directly (``python3 plugins/modules/M.py ARGS.json``),
  with the ``gc.freeze()`` of its ``__main__`` guard and, alternating, with gc.freeze made a no-op by a
  sitecustomize (what every module call cost before).
"""
import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAB_PY = os.path.join(ROOT, "tests", "lab", "lab.py")
JSON_PATH = os.path.join(ROOT, "docs", "benchmarks.json")
MD_PATH = os.path.join(ROOT, "docs", "benchmarks.md")
IMG_DIR = os.path.join(ROOT, "docs", "img")
BEGIN_MARK = "<!-- BEGIN bench.py generated: do not edit by hand, run `make bench` -->"
END_MARK = "<!-- END bench.py generated -->"
RESTART_PLAY_PREFIX = "Restart SGLang"
SMI_QUERY = "index,uuid,memory.used,memory.total,memory.reserved"
FIRED_UP = "The server is fired up and ready to roll!"

# key → (unit, description, target text or None)
KEYS = {
    "downtime_s_1": ("s", "single-host restart: client-seen downtime (prober)", None),
    "summary_downtime_s_1": ("s", "single-host restart: the summary's own downtime_s (set_stats gpufleet_restart)",
                             None),
    "start_to_ready_s_1": ("s", "single-host restart: stand-in exec → 'fired up' (its log)", None),
    "downtime_overhead_s_median": ("s", "downtime − start-to-ready, single host", "≤ 1.0"),
    "batch_overhead_s_median": ("s", "play 3 wall (one-host batch) − start-to-ready", "≤ 5"),
    "check_s_64": ("s", "`ansible gpu_hosts -m gpufleet.fleet.nvidia_gpu_info`, 64 hosts, warm ssh", None),
    "raw_s_64": ("s", "raw ssh fan-out of `nvidia-smi --query-gpu=...`, 64 hosts, forks at a time", None),
    "check_vs_raw_ratio_64": ("×", "check_s_64 / raw_s_64, paired runs", "≤ 1.5"),
    "controller_cpu_ms_per_host_check": ("ms", "controller CPU (children user+sys) per host, ad-hoc info", None),
    "controller_cpu_ms_per_host_raw": ("ms", "controller CPU (children user+sys) per host, raw ssh", None),
    "check_floor_raw_module_s_64": ("s", "Ansible's floor: `ansible gpu_hosts -m ansible.builtin.raw -a 'nvidia-smi "
                                    "--query-gpu=...'` (no Python on the target), 64 hosts, warm ssh", None),
    "check_floor_ping_s_64": ("s", "Ansible's floor for a Python module: `ansible gpu_hosts -m ansible.builtin.ping`, "
                              "64 hosts, warm ssh", None),
    "check_fields_s_64": ("s", "`nvidia_gpu_info` asked only what the raw query asks (fields=index,uuid,memory.used,"
                          "memory.total,memory.reserved xid_window_min=0: 2 nvidia-smi runs), 64 hosts, warm ssh", None),
    "check_fields_vs_raw_ratio_64": ("×", "check_fields_s_64 / raw_s_64, medians of the same session (like for like: "
                                     "the same question)", None),
    "check_s_64_mitogen": ("s", "the ad-hoc `nvidia_gpu_info` of check_s_64 under ANSIBLE_STRATEGY=mitogen_linear "
                           "(mitogen from requirements/bench.txt), 64 hosts", None),
    "check_mitogen_vs_default_ratio_64": ("×", "check_s_64_mitogen / the same command under the default strategy, "
                                          "paired runs", None),
    "checkplay_s_64": ("s", "`ansible-playbook playbooks/check.yml`, 64 hosts (reported, no target)", None),
    "checkplay_vs_ping_ratio_64": ("×", "`ansible-playbook playbooks/check.yml` (no textfile dir) / `ansible gpu_hosts "
                                   "-m ansible.builtin.ping`, the same 64 hosts and forks, paired runs, warm ssh",
                                   "≤ 1.5"),
    "preflight_vs_ping_ratio_1": ("×", "`ansible-playbook playbooks/restart.yml --tags preflight -e target=H` / "
                                  "`ansible H -m ansible.builtin.ping`, the same host, paired runs, warm ssh, the "
                                  "host serving", "≤ 2"),
    "restart_all_at_once_64_vs_1_ratio": ("×", "median per-host downtime, -e gpufleet_serial=64 on 64 hosts, "
                                          "over single-host downtime (one paired run)", None),
    "module_exit_ms": ("ms", "module process end: its sys.exit (result printed) → the parent sees it gone; "
                       "nvidia_gpu_wait run directly, gc.freeze() in its __main__ guard", None),
    "module_exit_ms_no_freeze": ("ms", "the same with gc.freeze made a no-op (the modules before the freeze), "
                                 "alternating runs", None),
    "batch8_fast_host_downtime_ratio": ("×", "gpufleet_serial=8 on 8 hosts, one with slow_load_s=20: median "
                                        "downtime of the 7 others / single-host downtime", "≤ 1.2"),
    "batch8_fast_vs_even_batch_ratio": ("×", "the same 7 hosts' median downtime / the median downtime of the same "
                                        "batch of 8 without a slow host, run right before it: what the slow "
                                        "host costs the others, apart from 8 hosts sharing this machine", None),
}
# The prefetch group's checkpoint (lab.py weights): a few GiB, so the read is most of a cold start.
PREFETCH_SIZE_MIB = 3072
PREFETCH_SHARDS = 4
# A cold run's files must really be out of the page cache when the stand-in starts reading (its own mincore).
PREFETCH_COLD_MAX_PCT = 1.0
_CHECKPOINT = "%d MiB checkpoint in %d shards (lab.py weights --size-mib %d --shards %d), slow_load_s=0" % (
    PREFETCH_SIZE_MIB, PREFETCH_SHARDS, PREFETCH_SIZE_MIB, PREFETCH_SHARDS)
KEYS.update({
    "start_to_ready_cold_s": ("s", "one host, %s: stand-in exec → 'fired up' (its log) after the server was stopped "
                              "and its model files evicted (DONTNEED), restart.yml -e sglang_prefetch_enabled=false"
                              % _CHECKPOINT, None),
    "start_to_ready_prefetched_s": ("s", "the same with the prefetch on (restart.yml's default): it reads the evicted "
                                    "files into the page cache before the launch", None),
    "prefetch_start_ratio": ("×", "start_to_ready_prefetched_s ÷ start_to_ready_cold_s: value median ÷ median, "
                             "samples the ratio of each interleaved pair", "≤ 0.7"),
    "prefetch_s": ("s", "the prefetch phase of the prefetched runs (their summary row's prefetch_s, 0.1 s steps), "
                   "reading the %d MiB from cold" % PREFETCH_SIZE_MIB, None),
    "weights_cold_read_mib_s": ("MiB/s", "the disk's cold read speed in the cold runs: the stand-in's weights_bytes "
                                "÷ weights_load_s (/get_server_info)", None),
})
# What each measurement group produces (--only takes keys or group names).
GROUPS = {
    "single": ["downtime_s_1", "summary_downtime_s_1", "start_to_ready_s_1", "downtime_overhead_s_median",
               "batch_overhead_s_median"],
    "check": ["check_s_64", "raw_s_64", "check_vs_raw_ratio_64", "controller_cpu_ms_per_host_check",
              "controller_cpu_ms_per_host_raw", "check_floor_raw_module_s_64", "check_floor_ping_s_64",
              "check_fields_s_64", "check_fields_vs_raw_ratio_64"],
    "scaling_info": [],
    "checkplay": ["checkplay_s_64"],
    "checkplay_ratio": ["checkplay_vs_ping_ratio_64"],
    "preflight_ratio": ["preflight_vs_ping_ratio_1"],
    "mitogen": ["check_s_64_mitogen", "check_mitogen_vs_default_ratio_64"],
    "batch8": ["batch8_fast_host_downtime_ratio", "batch8_fast_vs_even_batch_ratio"],
    "restart64": ["restart_all_at_once_64_vs_1_ratio"],
    "module_exit": ["module_exit_ms", "module_exit_ms_no_freeze"],
    "prefetch": ["start_to_ready_cold_s", "start_to_ready_prefetched_s", "prefetch_start_ratio", "prefetch_s",
                 "weights_cold_read_mib_s"],
}
# Groups that need no lab.
NO_LAB = {"module_exit"}
# Groups that need 64 hosts; the others 8, but for those named here.
NEEDS_64 = {"check", "scaling_info", "checkplay", "checkplay_ratio", "restart64", "mitogen"}
GROUP_HOSTS = {"prefetch": 1}
# checkplay last: after restart64 every host serves, as in a real fleet. prefetch before the groups that bring up
# many servers: its reads are timed, and the machine is quietest early.
ORDER = ["module_exit", "single", "prefetch", "preflight_ratio", "check", "scaling_info", "mitogen", "batch8",
         "restart64", "checkplay", "checkplay_ratio"]
# Groups whose ratio needs the single-host downtime of the same session (paired).
NEEDS_SINGLE = {"batch8", "restart64"}


def progress(msg):
    sys.stderr.write("[bench %s] %s\n" % (time.strftime("%H:%M:%S"), msg))
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------------------
# pure parts (unit-tested in tests/unit/test_bench.py)

def downtime_from_samples(samples, t_from=None, t_to=None):
    """Client-seen interruption in prober samples.

    ``samples``: list of (t, ok) in time order (t Unix s, ok bool). Only failures at or after ``t_from`` (and at
    or before ``t_to``) count. Returns a dict: ``downtime_s`` (first good sample after the last failure − last
    good sample before the first failure), ``last_ok``, ``first_ok_after``, ``gaps`` (number of separate runs
    of failures), ``failed_samples``; or None when no failure falls in the window. ``downtime_s`` is None when
    the server never answered before the first failure or never again after the last one (``open`` says which).
    """
    idx = [i for i, (t, ok) in enumerate(samples) if not ok and (t_from is None or t >= t_from)
           and (t_to is None or t <= t_to)]
    if not idx:
        return None
    first, last = idx[0], idx[-1]
    gaps = sum(1 for a, b in zip(idx, idx[1:]) if any(samples[k][1] for k in range(a + 1, b))) + 1
    before = next((samples[k][0] for k in range(first - 1, -1, -1) if samples[k][1]), None)
    after = next((samples[k][0] for k in range(last + 1, len(samples)) if samples[k][1]), None)
    res = {"last_ok": before, "first_ok_after": after, "gaps": gaps, "failed_samples": len(idx),
           "downtime_s": None, "open": None}
    if before is None:
        res["open"] = "no good sample before the interruption"
    elif after is None:
        res["open"] = "no good sample after the interruption"
    else:
        res["downtime_s"] = after - before
    return res


_LOG_RE = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?)\] (.*)$")
_EXEC_RE = re.compile(r"lab stand-in: process exec at unix ([\d.]+|unknown); now unix ([\d.]+)")


def _local_seconds(stamp):
    """'YYYY-MM-DD HH:MM:SS[.fff]' → seconds since 1970-01-01 of that wall-clock reading taken as UTC."""
    day, clock = stamp.split(" ")
    frac = 0.0
    if "." in clock:
        clock, f = clock.split(".")
        frac = float("0." + f)
    d = datetime.datetime.strptime(day + " " + clock, "%Y-%m-%d %H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return d.timestamp() + frac


def parse_standin_log(text, after=None):
    """Starts of the lab stand-in in its log (appended across restarts).

    Returns a list, one dict per start (a line "lab stand-in: process exec at unix X; now unix Y"): ``exec``
    (Unix s), ``ready`` (Unix s of its "fired up" line, None if it never got there), ``start_to_ready_s``.
    The prefixes are local time with ms; the exec line's "now unix Y" printed next to its own prefix gives the
    zone offset. ``after``: only starts whose exec time is later (Unix s).
    """
    starts = []
    offset = None
    for line in text.splitlines():
        m = _LOG_RE.match(line)
        if not m:
            continue
        stamp, msg = m.groups()
        e = _EXEC_RE.search(msg)
        if e:
            offset = _local_seconds(stamp) - float(e.group(2))
            # the offset is a whole number of minutes; the prefix was taken just after "now unix"
            offset = round(offset / 60.0) * 60.0
            exec_t = float(e.group(1)) if e.group(1) != "unknown" else None
            starts.append({"exec": exec_t, "ready": None, "start_to_ready_s": None})
        elif msg.startswith(FIRED_UP) and starts and offset is not None and starts[-1]["ready"] is None:
            ready = _local_seconds(stamp) - offset
            starts[-1]["ready"] = ready
            if starts[-1]["exec"] is not None:
                starts[-1]["start_to_ready_s"] = ready - starts[-1]["exec"]
    if after is not None:
        starts = [s for s in starts if s["exec"] is not None and s["exec"] > after]
    return starts


def stats(values, unit, command, reason=None, digits=3):
    """JSON entry for one key: ``value`` (median), ``runs``, ``median``, ``min``, ``max``, ``samples``, ``unit``,
    ``command``; ``value`` None with ``reason`` when there is no number (values empty or all None)."""
    vals = [float(v) for v in values if v is not None]
    entry = {"unit": unit, "command": command}
    if not vals:
        entry.update(value=None, reason=reason or "no sample", runs=0, median=None, min=None, max=None,
                     samples=[])
        return entry
    med = statistics.median(vals)
    entry.update(value=round(med, digits), runs=len(vals), median=round(med, digits), min=round(min(vals), digits),
                 max=round(max(vals), digits), samples=[round(v, digits) for v in vals])
    if reason:
        entry["note"] = reason
    return entry


def batch_pair_ratio(fast, even, res, command):
    """Entry for ``batch8_fast_vs_even_batch_ratio``: median of ``fast`` (downtimes in s of the batch's hosts other
    than the slow one) over the median downtime of every host of ``even`` (the same batch restarted right before,
    without a slow host). ``res``/``even``: restart results (``status``, ``hosts`` → ``downtime_s``). One paired run;
    null with the reason when either run failed or measured nothing."""
    f = [x for x in fast if x is not None]
    e = [v["downtime_s"] for v in even["hosts"].values() if v["downtime_s"] is not None]
    if res["status"] != "successful" or even["status"] != "successful" or not f or not e:
        return stats([], "×", command, "restart runs %s (slow host) and %s (no slow host), %d and %d downtimes"
                     % (res["status"], even["status"], len(f), len(e)))
    return stats([statistics.median(f) / statistics.median(e)], "×", command,
                 "one paired run: the 7 fast hosts' median %.2f s with a slow host in the batch, the batch's median "
                 "%.2f s without one" % (statistics.median(f), statistics.median(e)))


def lab_hosts(groups):
    """Lab size for ``groups``: 0 when none needs a lab, 64 when one needs 64 hosts, else the most any needs
    (GROUP_HOSTS, 8 by default)."""
    lab = [g for g in groups if g not in NO_LAB]
    if not lab:
        return 0
    if NEEDS_64 & set(lab):
        return 64
    return max(GROUP_HOSTS.get(g, 8) for g in lab)


def _prefetch_run_problem(run):
    """Why a prefetch-group run gives no sample, or None."""
    if run.get("status") != "successful":
        return "restart.yml %s" % run.get("status")
    if run.get("start_to_ready_s") is None:
        return "no stand-in start reached 'fired up' in its log"
    if run["mode"] in ("cold", "first_read"):
        before = run.get("resident_before_pct")
        if before is None:
            return "the stand-in reported no weights_resident_before_pct"
        if before > PREFETCH_COLD_MAX_PCT:
            return "not cold: %.1f %% resident when the stand-in began to read" % before
    return None


def _with_note(entry, note):
    if entry["value"] is not None and note:
        entry["note"] = note
    return entry


def prefetch_keys(runs, commands):
    """The prefetch group's entries from its runs: dicts with ``mode`` ("cold" or "prefetched"), ``pair`` (the
    interleaved pair's number), ``status`` (restart.yml's), ``start_to_ready_s``, ``weights_load_s``,
    ``weights_bytes``, ``resident_before_pct`` (the stand-in's own, /get_server_info), ``prefetch_s``,
    ``prefetch_gib``, ``resident_pct`` (the summary row's). ``mode`` "first_read": a cold run before the pairs,
    only in the read speed's note. ``commands``: {"cold": text, "prefetched": text, optional "ratio": text}.

    A run counts when restart.yml succeeded and the stand-in became ready; a cold run only when its files were at
    most PREFETCH_COLD_MAX_PCT % resident as the stand-in began (else "cold" would be a warm start). The ratio's
    value is median ÷ median of the runs that count; its samples are the ratios of the pairs where both count.
    """
    good = {"cold": [], "prefetched": []}
    left_out = []
    first = [r for r in runs if r["mode"] == "first_read"]
    for run in runs:
        if run["mode"] == "first_read":
            continue
        why = _prefetch_run_problem(run)
        if why:
            left_out.append("pair %s %s: %s" % (run.get("pair"), run["mode"], why))
        else:
            good[run["mode"]].append(run)
    excluded = "; left out: %s" % "; ".join(left_out) if left_out else ""
    cold, pref = good["cold"], good["prefetched"]
    cold_s = [r["start_to_ready_s"] for r in cold]
    pref_s = [r["start_to_ready_s"] for r in pref]

    def median_of(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def null(mode):
        return "no %s run counted (%d run(s)%s)" % (mode, sum(1 for r in runs if r["mode"] == mode), excluded)

    keys = {}
    file_mib = median_of(cold + pref, "weights_bytes")
    size = "%.0f MiB of weight files" % (file_mib / float(1 << 20)) if file_mib else "weight files of unknown size"
    keys["start_to_ready_cold_s"] = _with_note(stats(cold_s, "s", commands["cold"], null("cold")), (
        "%s; the stand-in read them in %s s (median), at most %s %% resident as it began%s" % (
            size, _fmt(median_of(cold, "weights_load_s")),
            _fmt(max([r["resident_before_pct"] for r in cold] or [0])), excluded)))
    keys["start_to_ready_prefetched_s"] = _with_note(stats(pref_s, "s", commands["prefetched"], null("prefetched")), (
        "%s %% of them resident as the stand-in began (median), read in %s s (median)%s" % (
            _fmt(median_of(pref, "resident_before_pct")), _fmt(median_of(pref, "weights_load_s")), excluded)))
    by_pair = {}
    for run in cold + pref:
        by_pair.setdefault(run["pair"], {})[run["mode"]] = run["start_to_ready_s"]
    ratios = [p["prefetched"] / p["cold"] for _, p in sorted(by_pair.items()) if len(p) == 2 and p["cold"]]
    ratio = stats(ratios, "×", commands.get("ratio") or "%s vs %s" % (commands["prefetched"], commands["cold"]),
                  "no pair where both runs counted%s" % excluded)
    if ratio["value"] is not None and cold_s and pref_s:
        ratio["value"] = round(statistics.median(pref_s) / statistics.median(cold_s), 3)
        ratio["note"] = ("value: median %.3f s ÷ median %.3f s; samples and median: the %d pairs' own ratios%s" % (
            statistics.median(pref_s), statistics.median(cold_s), len(ratios), excluded))
    keys["prefetch_start_ratio"] = ratio
    keys["prefetch_s"] = _with_note(
        stats([r.get("prefetch_s") for r in pref], "s", commands["prefetched"],
              "no prefetched run counted with a prefetch_s in its summary row%s" % excluded),
        "GiB read per run %s, resident at the stop %s %%" % (
            [r.get("prefetch_gib") for r in pref], [r.get("resident_pct") for r in pref]))
    def speed(run):
        if run.get("weights_bytes") and run.get("weights_load_s"):
            return run["weights_bytes"] / float(1 << 20) / run["weights_load_s"]
        return None
    first_speed = [speed(r) for r in first if speed(r) is not None and not _prefetch_run_problem(r)]
    keys["weights_cold_read_mib_s"] = _with_note(
        stats([speed(r) for r in cold], "MiB/s", commands["cold"],
              "no cold run counted with weights_load_s%s" % excluded, digits=0),
        "%s; cold in this kernel's page cache, while a virtual disk's host may cache it: the first read after "
        "the files were written (a cold run before the pairs, not counted) read %s MiB/s" % (
            size, _fmt(first_speed[0]) if first_speed else "—"))
    return keys


def replace_section(text, body, begin=BEGIN_MARK, end=END_MARK):
    """``text`` with everything between the ``begin`` and ``end`` marker lines replaced by ``body``; the section
    (with markers) is appended when the markers are absent. Raises ValueError when only one marker is there or
    they are out of order."""
    b, e = text.find(begin), text.find(end)
    block = "%s\n%s\n%s" % (begin, body.strip("\n"), end)
    if b < 0 and e < 0:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    if b < 0 or e < 0 or e < b:
        raise ValueError("%s: markers %r and %r must both be present, in that order" % (MD_PATH, begin, end))
    return text[:b] + block + text[e + len(end):]


def _fmt(v, unit=""):
    if v is None:
        return "—"
    return ("%.3g" % v if abs(v) < 100 else "%.0f" % v) + ("" if not unit or unit == "×" else " " + unit)


def render_markdown(doc):
    """The generated section of docs/benchmarks.md from the benchmarks.json document ``doc``."""
    m = doc.get("machine", {})
    out = ["## Generated figures (`make bench`)", "",
           "Written by `tests/bench/bench.py` (%s). Machine: %s." % (
               doc.get("generated", "?"),
               ", ".join("%s %s" % (k, v) for k, v in m.items())), "",
           "Command: `%s`" % doc.get("command", "make bench"), "",
           "| key | value | runs | median | min | max | unit | target | command |", "|---|---|---|---|---|---|---|---|---|"]
    for key, e in doc.get("keys", {}).items():
        target = e.get("target") or ""
        if e.get("value") is None:
            val = "null: %s" % e.get("reason", "not measured")
        else:
            val = _fmt(e["value"])
        out.append("| `%s` | %s | %s | %s | %s | %s | %s | %s | `%s` |" % (
            key, val, e.get("runs", ""), _fmt(e.get("median")), _fmt(e.get("min")), _fmt(e.get("max")),
            e.get("unit", ""), target, (e.get("command") or "").replace("|", "\\|")))
    out.append("")
    for key, e in doc.get("keys", {}).items():
        if e.get("note"):
            out.append("- `%s`: %s" % (key, e["note"]))
    series = doc.get("series", {})
    if series:
        out += ["", "### Scaling series", ""]
        for name, s in series.items():
            out.append("**%s** (%s): " % (name, s.get("what", "")) + "; ".join(
                "%s → %s" % (x, ", ".join("%s %s" % (k, _fmt(v, s.get("unit", ""))) for k, v in ys.items()))
                for x, ys in s.get("points", {}).items()))
            if s.get("png"):
                out += ["", "![%s](%s)" % (name, s["png"]), ""]
    return "\n".join(out) + "\n"


def merge_doc(old, new_keys, command, machine, series=None, generated=None):
    """benchmarks.json document: ``old`` with ``new_keys`` (key → entry) and ``series`` replacing theirs; every
    entry keeps its own ``command`` and ``measured`` date, so a partial rerun (--only) leaves the rest."""
    doc = dict(old or {})
    doc.setdefault("keys", {})
    doc["keys"] = dict(doc["keys"])
    stamp = generated or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for k, e in new_keys.items():
        e = dict(e)
        e.setdefault("measured", stamp)
        e.setdefault("machine", machine)
        if k in KEYS and KEYS[k][2]:
            e.setdefault("target", KEYS[k][2])
        doc["keys"][k] = e
    doc["keys"] = {k: doc["keys"][k] for k in sorted(doc["keys"], key=lambda k: (
        list(KEYS).index(k) if k in KEYS else len(KEYS), k))}
    if series:
        doc["series"] = dict(doc.get("series") or {}, **series)
    doc["generated"] = stamp
    doc["command"] = command
    doc["machine"] = machine
    return doc


def write_outputs(doc, json_path=JSON_PATH, md_path=MD_PATH):
    with open(json_path, "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=False)
        fh.write("\n")
    text = open(md_path).read() if os.path.exists(md_path) else "# Benchmarks\n"
    with open(md_path, "w") as fh:
        fh.write(replace_section(text, render_markdown(doc)))


def machine_info():
    try:
        import ansible
        ansible_version = ansible.__version__ if hasattr(ansible, "__version__") else None
        if ansible_version is None:
            from ansible.release import __version__ as ansible_version
    except ImportError:
        ansible_version = None
    mem = None
    try:
        with open("/proc/meminfo") as fh:
            mem = "%.1f GiB" % (int(fh.readline().split()[1]) / 1048576)
    except OSError:
        pass
    return {"cores": os.cpu_count(), "load at start": "%.2f %.2f %.2f" % os.getloadavg(), "memory": mem,
            "ansible-core": ansible_version, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def plot_series(name, series, path):
    """One PNG: x = the series' points, one line per y key. Returns the path relative to docs/, or None (reason
    printed) when matplotlib is missing (``make bench`` installs it: requirements/bench.txt)."""
    site = os.environ.get("GPUFLEET_BENCH_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        progress("no plot for %s: %s (make bench installs requirements/bench.txt)" % (name, exc))
        return None
    xs = [float(x) for x in series["points"]]
    ykeys = sorted({k for ys in series["points"].values() for k in ys})
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in ykeys:
        ax.plot(xs, [series["points"][x].get(k) for x in series["points"]], marker="o", label=k)
    ax.set_xlabel(series.get("x", "x"))
    ax.set_ylabel(series.get("unit", ""))
    ax.set_title(series.get("what", name))
    ax.grid(True, alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return os.path.relpath(path, os.path.dirname(MD_PATH))


# ---------------------------------------------------------------------------------------------------------
# prober

def _probe_host(url, period_s, stop, samples, timeout_s):
    while not stop.is_set():
        t0 = time.time()
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                ok = r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            ok = False
        samples.append((t0, ok))
        rest = period_s - (time.time() - t0)
        if rest > 0:
            stop.wait(rest)


def _prober_main(urls, period_s, stop, ready, q):
    # The prober is its own process (no GIL shared with the controller); one thread per URL. ``ready`` is set
    # once every URL has its first sample.
    result = {u: [] for u in urls}
    threads = [threading.Thread(target=_probe_host, args=(u, period_s, stop, result[u], max(period_s * 5, 0.5)),
                                daemon=True) for u in urls]
    for t in threads:
        t.start()
    while not all(result.values()) and not stop.is_set():
        time.sleep(0.01)
    ready.set()
    for t in threads:
        t.join()
    q.put(result)


class Prober:
    """Independent /health poller for a set of hosts: ``with Prober({host: url}, period_ms) as p: ...``, then
    ``p.samples[host]`` = [(t, ok)]."""

    def __init__(self, urls, period_ms):
        self.urls = urls
        self.period_s = period_ms / 1000.0
        self.samples = {}

    def __enter__(self):
        # spawn: a forked child would inherit the controller's descriptors (listening sockets, pipes)
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._ready = ctx.Event()
        self._q = ctx.Queue()
        self._proc = ctx.Process(target=_prober_main, args=(list(self.urls.values()), self.period_s, self._stop,
                                                            self._ready, self._q), daemon=True)
        self._proc.start()
        if not self._ready.wait(60):
            self._stop.set()
            raise RuntimeError("prober did not start within 60 s")
        time.sleep(max(0.3, self.period_s * 3))  # good samples before the restart starts
        return self

    def __exit__(self, *exc):
        time.sleep(max(0.3, self.period_s * 3))  # good samples after readiness
        self._stop.set()
        by_url = self._q.get(timeout=60)
        self._proc.join(10)
        self.samples = {h: by_url.get(u, []) for h, u in self.urls.items()}
        return False


# ---------------------------------------------------------------------------------------------------------
# the lab session

def _load_lab_class():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpufleet_bench_conftest",
                                                  os.path.join(ROOT, "tests", "integration", "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Lab


class Bench:
    def __init__(self, opts):
        self.opts = opts
        self.lab = None
        self.keys = {}
        self.series = {}
        self.single = None  # list of single-host downtimes this session (for the paired ratios)
        self.work = tempfile.mkdtemp(prefix="gpufleet-bench-")
        self.env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                        PATH=os.path.dirname(sys.executable) + ":" + os.environ.get("PATH", "/usr/bin:/bin"))

    # -- lab ------------------------------------------------------------------------------------------------
    def lab_up(self, hosts):
        progress("lab up: %d hosts in %s" % (hosts, self.opts.lab_dir))
        t = time.time()
        version = ["--sglang-version", self.opts.sglang_version] if self.opts.sglang_version else []
        subprocess.run([sys.executable, LAB_PY, "up", "--hosts", str(hosts), "--lab-dir", self.opts.lab_dir] + version,
                       check=True, capture_output=True, text=True)
        self.lab = _load_lab_class()(self.opts.lab_dir)
        progress("lab up in %.1f s" % (time.time() - t))

    def lab_down(self):
        if self.opts.keep_lab:
            progress("lab left running in %s (--keep-lab)" % self.opts.lab_dir)
            return
        subprocess.run([sys.executable, LAB_PY, "down", "--lab-dir", self.opts.lab_dir], capture_output=True)
        progress("lab down")

    def url(self, host):
        hv = self.lab.host_vars(host)
        return "http://%s:%s/health" % (hv.get("sglang_host", hv.get("ansible_host")), hv.get("sglang_port", 30000))

    def serving(self, hosts):
        """Make sure gpufleet's server serves on each host: hosts without one get a warm-up restart.yml (all in
        one batch; not measured). A server started any other way would be refused by preflight (no pid file)."""
        need = [h for h in hosts if not self._health_ok(h)]
        if not need:
            return
        progress("warm-up: restart.yml starts servers on %d hosts (not measured)" % len(need))
        t = time.time()
        runner = self.lab.run_playbook("playbooks/restart.yml", extravars={
            "target": ",".join(need), "gpufleet_serial": len(need)})
        bad = [h for h in need if not self._health_ok(h)]
        if runner.status != "successful" or bad:
            raise RuntimeError("warm-up restart.yml %s; not serving: %s\n%s" % (
                runner.status, bad, "\n".join(runner.stdout.read().splitlines()[-25:])))
        progress("warm-up done in %.0f s" % (time.time() - t))

    def _health_ok(self, host):
        try:
            with urllib.request.urlopen(self.url(host), timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def standin_log(self, host):
        path = "%s/sglang.log" % self.lab.host_vars(host)["sglang_state_dir"]
        return self.lab.exec(host, ["cat", path]).stdout

    # -- one restart ----------------------------------------------------------------------------------------
    def restart(self, hosts, serial=None, limit_target=True, probe_ms=None):
        """restart.yml on ``hosts`` with a prober on each; returns a dict with per-host downtime (prober),
        summary downtime, start-to-ready (log), play 3 wall, runner status."""
        times = os.path.join(self.work, "times-%d.jsonl" % time.time_ns())
        extravars = {"target": ",".join(hosts) if len(hosts) > 1 else hosts[0]}
        if serial:
            extravars["gpufleet_serial"] = serial
        envvars = {"ANSIBLE_CALLBACK_PLUGINS": "%s:%s" % (os.path.join(ROOT, "plugins", "callback"),
                                                          os.path.join(ROOT, "tests", "gpu", "callback_plugins")),
                   "GPUFLEET_TASK_TIMES_FILE": times}
        period = probe_ms or (self.opts.probe_ms if len(hosts) <= 8 else max(self.opts.probe_ms, 100))
        t0 = time.time()
        with Prober({h: self.url(h) for h in hosts}, period) as p:
            t_play = time.time()
            runner = self.lab.run_playbook("playbooks/restart.yml", extravars=extravars, envvars=envvars)
            t_end = time.time()
        if runner.status != "successful":
            progress("restart.yml %s (rc %s); end of its output:\n%s" % (
                runner.status, runner.rc, "\n".join(runner.stdout.read().splitlines()[-25:])))
        rows = []
        if os.path.exists(times):
            with open(times) as fh:
                rows = [json.loads(x) for x in fh if x.strip()]
        play3 = [r for r in rows if (r.get("play") or "").startswith(RESTART_PLAY_PREFIX) and r.get("start")]
        summary = {}
        for ev in runner.events:
            if ev.get("event") == "playbook_on_stats":
                summary = (ev.get("event_data", {}).get("artifact_data") or {}).get("gpufleet_restart") or {}
        res = {"status": runner.status, "wall_s": t_end - t_play, "probe_ms": period, "hosts": {},
               "play3_wall_s": (max(r["end"] for r in play3) - min(r["start"] for r in play3)) if play3 else None}
        for h in hosts:
            d = downtime_from_samples(p.samples.get(h, []), t_from=t_play, t_to=t_end)
            starts = parse_standin_log(self.standin_log(h), after=t0)
            row = summary.get(h) or {}
            res["hosts"][h] = {"downtime_s": d and d["downtime_s"], "gaps": d and d["gaps"],
                               "open": d and d["open"], "summary_downtime_s": row.get("downtime_s"),
                               "result": row.get("result"),
                               "start_to_ready_s": starts[-1]["start_to_ready_s"] if starts else None,
                               "starts": len(starts)}
        return res

    # -- groups -------------------------------------------------------------------------------------------
    def g_single(self):
        host = self.lab.hosts[0]
        self.serving([host])
        rows = []
        cmd = "ansible-playbook -i <lab> playbooks/restart.yml -e target=%s (prober %d ms)" % (host, self.opts.probe_ms)
        for i in range(self.opts.runs):
            r = self.restart([host])
            h = r["hosts"][host]
            progress("single %d/%d: %s, downtime %s s (summary %s), start-to-ready %s s, play3 %s s" % (
                i + 1, self.opts.runs, r["status"], _fmt(h["downtime_s"]), h["summary_downtime_s"],
                _fmt(h["start_to_ready_s"]), _fmt(r["play3_wall_s"])))
            rows.append((r, h))
        ok = [(r, h) for r, h in rows if r["status"] == "successful" and h["downtime_s"] is not None
              and h["start_to_ready_s"] is not None]
        why = None if ok else "no successful run with a prober gap and a stand-in start in its log (%s)" % (
            [(r["status"], h["open"], h["starts"]) for r, h in rows])
        self.single = [h["downtime_s"] for _, h in ok]
        self.keys["downtime_s_1"] = stats(self.single, "s", cmd, why)
        self.keys["summary_downtime_s_1"] = stats([h["summary_downtime_s"] for _, h in ok], "s", cmd, why)
        self.keys["start_to_ready_s_1"] = stats([h["start_to_ready_s"] for _, h in ok], "s", cmd, why)
        self.keys["downtime_overhead_s_median"] = stats([h["downtime_s"] - h["start_to_ready_s"] for _, h in ok],
                                                        "s", cmd, why)
        self.keys["batch_overhead_s_median"] = stats(
            [r["play3_wall_s"] - h["start_to_ready_s"] for r, h in ok if r["play3_wall_s"] is not None], "s", cmd,
            why)

    def _lab_py(self, *argv):
        proc = subprocess.run([sys.executable, LAB_PY] + list(argv) + ["--lab-dir", self.opts.lab_dir],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError("lab.py %s: rc %d: %s" % (" ".join(argv), proc.returncode, proc.stderr.strip()[-500:]))
        return proc.stdout

    def server_info(self, host):
        hv = self.lab.host_vars(host)
        url = "http://%s:%s/get_server_info" % (hv.get("sglang_host", hv.get("ansible_host")),
                                                 hv.get("sglang_port", 30000))
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read().decode())

    def _prefetch_run(self, host, mode, pair):
        """Stop, evict, restart with the prefetch off (cold) or on; one run's record for prefetch_keys."""
        stop = self.lab.run_playbook("playbooks/restart.yml", extravars={"target": host}, tags="stop,wait")
        if stop.status != "successful":
            raise RuntimeError("restart.yml --tags stop,wait %s on %s" % (stop.status, host))
        # the stopped server's mappings are gone, so DONTNEED can drop every page
        self._lab_py("evict", "--host", host)
        model = os.path.basename(self.lab.host_vars(host)["sglang_launch_args"]["model-path"])
        left = json.loads(self._lab_py("resident", "--host", host))[host][model]
        extravars = {"target": host}
        if mode == "cold":
            extravars["sglang_prefetch_enabled"] = False
        t0 = time.time()
        runner = self.lab.run_playbook("playbooks/restart.yml", extravars=extravars)
        row = {}
        for ev in runner.events:
            if ev.get("event") == "playbook_on_stats":
                rows = (ev.get("event_data", {}).get("artifact_data") or {}).get("gpufleet_restart") or {}
                row = rows.get(host) or {}
        starts = parse_standin_log(self.standin_log(host), after=t0)
        try:
            info = self.server_info(host) if runner.status == "successful" else {}
        except (urllib.error.URLError, OSError, ValueError) as exc:
            progress("no /get_server_info from %s: %s" % (host, exc))
            info = {}
        run = {"mode": mode, "pair": pair, "status": runner.status,
               "start_to_ready_s": starts[-1]["start_to_ready_s"] if starts else None,
               "weights_load_s": info.get("weights_load_s"), "weights_bytes": info.get("weights_bytes"),
               "resident_before_pct": info.get("weights_resident_before_pct"),
               "evicted_left_bytes": left["resident_bytes"], "prefetch_s": row.get("prefetch_s"),
               "prefetch_gib": row.get("prefetch_gib"), "resident_pct": row.get("resident_pct")}
        progress("prefetch pair %d %s: %s, start-to-ready %s s, weights read in %s s (%s %% resident as it began; "
                 "%d bytes left after evict), prefetch %s s / %s GiB" % (
                     pair, mode, runner.status, _fmt(run["start_to_ready_s"]), _fmt(run["weights_load_s"]),
                     run["resident_before_pct"], left["resident_bytes"], run["prefetch_s"], run["prefetch_gib"]))
        if runner.status != "successful":
            progress("restart.yml %s; end of its output:\n%s" % (
                runner.status, "\n".join(runner.stdout.read().splitlines()[-25:])))
        return run

    def g_prefetch(self):
        """Cold vs prefetched start of the stand-in on one host with a real checkpoint; see the module docstring."""
        host = self.lab.hosts[0]
        self.serving([host])
        self.lab.fault(host, slow_load_s=0)
        base = "ansible-playbook -i <lab> playbooks/restart.yml -e target=%s" % host
        prep = ("lab.py weights --host %s --size-mib %d --shards %d; lab.py fault %s slow_load_s=0; per run: %s "
                "--tags stop,wait; lab.py evict --host %s; " % (host, PREFETCH_SIZE_MIB, PREFETCH_SHARDS, host, base,
                                                                host))
        commands = {"cold": prep + base + " -e sglang_prefetch_enabled=false", "prefetched": prep + base,
                    "ratio": prep + base + " (prefetch on) vs the same with -e sglang_prefetch_enabled=false, "
                                           "pairs in ABBA order"}
        runs = []
        try:
            self._lab_py("weights", "--host", host, "--size-mib", str(PREFETCH_SIZE_MIB), "--shards",
                         str(PREFETCH_SHARDS))
            # Not counted: the first read after writing is slower than every later one (a virtual disk's host
            # caches what was read; docs/lab.md), and would land on the first pair's cold run alone.
            first = self._prefetch_run(host, "cold", 0)
            runs.append(dict(first, mode="first_read"))
            for i in range(self.opts.runs):
                # ABBA: each mode goes first in half the pairs
                for mode in (("cold", "prefetched") if i % 2 == 0 else ("prefetched", "cold")):
                    runs.append(self._prefetch_run(host, mode, i + 1))
        finally:
            # the server maps the shards: stop it before they go, then bring it back on the config-only dir
            self.lab.clear_faults(host)
            self.lab.run_playbook("playbooks/restart.yml", extravars={"target": host}, tags="stop,wait")
            self._lab_py("weights", "--host", host, "--size-mib", "0")
            self.serving([host])
        self.keys.update(prefetch_keys(runs, commands))
        self.prefetch_runs = runs

    def _ansible_info(self, hosts, module="gpufleet.fleet.nvidia_gpu_info", args=None, ok_text="SUCCESS"):
        pattern = ",".join(hosts) if len(hosts) < len(self.lab.hosts) else "gpu_hosts"
        argv = [os.path.join(os.path.dirname(sys.executable), "ansible"), "-i", self.lab.inventory, pattern,
                "-m", module, "-o"] + (["-a", args] if args else [])
        return self._timed(argv, expect=len(hosts), ok_text=ok_text)

    def _floors(self, hosts, runs):
        """Ansible's own cost for the same fan-out without gpufleet's module: the raw module (one ssh exec of the
        same nvidia-smi query, no Python on the target) and ping (the smallest Python module). Same forks, warm
        connections; returns {key: [wall_s, ...]} of the successful runs."""
        out = {"check_floor_raw_module_s_64": [], "check_floor_ping_s_64": [], "check_fields_s_64": []}
        for i in range(runs):
            raw = self._ansible_info(hosts, "ansible.builtin.raw",
                                     "nvidia-smi --query-gpu=%s --format=csv" % SMI_QUERY, ok_text="CHANGED")
            ping = self._ansible_info(hosts, "ansible.builtin.ping")
            fields = self._ansible_info(hosts, args="fields=%s xid_window_min=0" % SMI_QUERY)
            progress("%d hosts floor %d/%d: -m raw %.2f s (cpu %.2f s), -m ping %.2f s (cpu %.2f s), "
                     "nvidia_gpu_info fields %.2f s (cpu %.2f s)" % (
                         len(hosts), i + 1, runs, raw["wall_s"], raw["cpu_s"], ping["wall_s"], ping["cpu_s"],
                         fields["wall_s"], fields["cpu_s"]))
            for key, res in (("check_floor_raw_module_s_64", raw), ("check_floor_ping_s_64", ping),
                             ("check_fields_s_64", fields)):
                if res["ok"]:
                    out[key].append(res["wall_s"])
        return out

    def _timed(self, argv, expect=None, ok_text=None):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.time()
        proc = subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=ROOT)
        wall = time.time() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        good = proc.returncode == 0 and (ok_text is None or proc.stdout.count(ok_text) >= (expect or 0))
        if not good:
            progress("FAILED rc %d: %s\n%s\n%s" % (proc.returncode, " ".join(argv[:6]), proc.stdout[-1500:],
                                                    proc.stderr[-1500:]))
        return {"wall_s": wall, "cpu_s": cpu, "ok": good}

    def ssh_commands(self):
        """Per host: the ssh argv Ansible itself ran (from -vvv of a ping, which also warms the connections),
        without its remote command."""
        if getattr(self, "_ssh", None):
            return self._ssh
        argv = [os.path.join(os.path.dirname(sys.executable), "ansible"), "-i", self.lab.inventory, "gpu_hosts",
                "-m", "ansible.builtin.ping", "-vvv"]
        # linear: the ssh connection plugin prints its argv (a mitogen strategy default would not)
        proc = subprocess.run(argv, capture_output=True, text=True, env=dict(self.env, ANSIBLE_STRATEGY="linear"),
                              cwd=ROOT)
        cmds = {}
        for line in proc.stdout.splitlines():
            m = re.search(r"<([^>]+)> SSH: EXEC (ssh .*)$", line)
            if not m:
                continue
            words = shlex.split(m.group(2))
            ip = m.group(1)
            if ip in words:
                cmds.setdefault(ip, words[:words.index(ip) + 1])
        ips = {h: str(self.lab.host_vars(h).get("ansible_host", h)) for h in self.lab.hosts}
        self._ssh = {h: cmds[ip] for h, ip in ips.items() if ip in cmds}
        missing = sorted(set(self.lab.hosts) - set(self._ssh))
        if missing:
            raise RuntimeError("no ssh command line seen in ansible -vvv for %s (rc %d)" % (missing[:5], proc.returncode))
        return self._ssh

    def _raw(self, hosts):
        cmds = self.ssh_commands()
        forks = int(self.opts.forks)
        remote = "nvidia-smi --query-gpu=%s --format=csv" % SMI_QUERY
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.time()

        def one(h):
            p = subprocess.run(cmds[h] + [remote], capture_output=True, text=True)
            return p.returncode == 0 and p.stdout.count("\n") >= 2
        with concurrent.futures.ThreadPoolExecutor(max_workers=forks) as ex:
            oks = list(ex.map(one, hosts))
        wall = time.time() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if not all(oks):
            progress("raw ssh failed on %d of %d hosts" % (oks.count(False), len(hosts)))
        return {"wall_s": wall, "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "ok": all(oks)}

    def _pairs(self, hosts, runs):
        self.ssh_commands()
        self._ansible_info(hosts)  # warm: connections and module caches
        pairs = []
        for i in range(runs):
            a = self._ansible_info(hosts) if i % 2 == 0 else None
            r = self._raw(hosts)
            if a is None:
                a = self._ansible_info(hosts)
            pairs.append((a, r))
            progress("%d hosts pair %d/%d: ansible %.2f s (cpu %.2f s) vs raw %.2f s (cpu %.2f s)%s" % (
                len(hosts), i + 1, runs, a["wall_s"], a["cpu_s"], r["wall_s"], r["cpu_s"],
                "" if a["ok"] and r["ok"] else " FAILED"))
        return [(a, r) for a, r in pairs if a["ok"] and r["ok"]]

    def g_check(self):
        hosts = self.lab.hosts[:64]
        n = len(hosts)
        pairs = self._pairs(hosts, self.opts.runs)
        why = None if n == 64 else "lab has %d hosts, not 64" % n
        cmd_a = "ansible -i <lab> gpu_hosts -m gpufleet.fleet.nvidia_gpu_info -o (forks %s)" % self.opts.forks
        cmd_r = "ssh <ansible's argv> HOST 'nvidia-smi --query-gpu=%s --format=csv', %s at a time" % (
            SMI_QUERY, self.opts.forks)
        if not pairs:
            why = "no pair where both sides succeeded"
        if why:
            pairs_used = []
        else:
            pairs_used = pairs
        self.keys["check_s_64"] = stats([a["wall_s"] for a, _ in pairs_used], "s", cmd_a, why)
        self.keys["raw_s_64"] = stats([r["wall_s"] for _, r in pairs_used], "s", cmd_r, why)
        self.keys["check_vs_raw_ratio_64"] = stats([a["wall_s"] / r["wall_s"] for a, r in pairs_used], "×",
                                                   cmd_a + " vs " + cmd_r, why)
        self.keys["controller_cpu_ms_per_host_check"] = stats([a["cpu_s"] * 1000 / n for a, _ in pairs_used], "ms",
                                                              cmd_a, why, digits=1)
        self.keys["controller_cpu_ms_per_host_raw"] = stats([r["cpu_s"] * 1000 / n for _, r in pairs_used], "ms",
                                                            cmd_r, why, digits=1)
        floors = self._floors(hosts, self.opts.runs)
        for key, walls in floors.items():
            cmd = {"check_floor_raw_module_s_64": "ansible -i <lab> gpu_hosts -m ansible.builtin.raw -a 'nvidia-smi "
                                                  "--query-gpu=%s --format=csv' -o" % SMI_QUERY,
                   "check_floor_ping_s_64": "ansible -i <lab> gpu_hosts -m ansible.builtin.ping -o",
                   "check_fields_s_64": "ansible -i <lab> gpu_hosts -m gpufleet.fleet.nvidia_gpu_info -a 'fields=%s "
                                        "xid_window_min=0' -o" % SMI_QUERY}[key]
            e = stats(walls if why is None else [], "s", cmd + " (forks %s)" % self.opts.forks,
                      why or (None if walls else "every run failed"))
            if e["value"] is not None and self.keys["raw_s_64"]["value"]:
                e["note"] = "%.1f× the raw ssh fan-out's median" % (e["value"] / self.keys["raw_s_64"]["value"])
            self.keys[key] = e
        fields, raw = self.keys["check_fields_s_64"]["value"], self.keys["raw_s_64"]["value"]
        self.keys["check_fields_vs_raw_ratio_64"] = stats(
            [fields / raw] if fields and raw else [], "×", self.keys["check_fields_s_64"]["command"] + " vs " + cmd_r,
            why or (None if fields and raw else "no successful run of one side"))
        self._scale_points = {n: pairs}

    def g_scaling_info(self):
        points = {}
        prev = getattr(self, "_scale_points", {})
        for n in self.opts.scale_hosts:
            if n > len(self.lab.hosts):
                continue
            pairs = prev.get(n) or self._pairs(self.lab.hosts[:n], max(1, min(self.opts.runs, 2)))
            if pairs:
                points[str(n)] = {"ansible nvidia_gpu_info": round(statistics.median(a["wall_s"] for a, _ in pairs), 3),
                                  "raw ssh nvidia-smi": round(statistics.median(r["wall_s"] for _, r in pairs), 3)}
        self.series["info_vs_raw_ssh"] = {"what": "ad-hoc nvidia_gpu_info vs raw ssh nvidia-smi, warm, median wall",
                                          "x": "hosts", "unit": "s", "points": points}

    def _mitogen_env(self):
        """ANSIBLE_STRATEGY(_PLUGINS) for mitogen_linear from the bench site; RuntimeError when it is missing."""
        site = os.environ.get("GPUFLEET_BENCH_SITE") or os.path.join(ROOT, ".cache", "bench-site")
        plugins = os.path.join(site, "ansible_mitogen", "plugins", "strategy")
        if not os.path.isdir(plugins):
            raise RuntimeError("mitogen is not installed in %s (make bench-site)" % site)
        return dict(self.env, ANSIBLE_STRATEGY_PLUGINS=plugins, ANSIBLE_STRATEGY="mitogen_linear",
                    PYTHONPATH=os.pathsep.join(p for p in (site, self.env.get("PYTHONPATH")) if p))

    def g_mitogen(self):
        hosts = self.lab.hosts[:64]
        menv = self._mitogen_env()
        plain_env = self.env
        cmd = "ansible -i <lab> gpu_hosts -m gpufleet.fleet.nvidia_gpu_info -o (forks %s)" % self.opts.forks
        pairs = []
        try:
            self.env = menv
            self._ansible_info(hosts)  # warm: mitogen's own connections
        finally:
            self.env = plain_env
        self._ansible_info(hosts)
        for i in range(self.opts.runs):
            order = ("mitogen", "default") if i % 2 == 0 else ("default", "mitogen")
            res = {}
            for which in order:
                self.env = menv if which == "mitogen" else plain_env
                try:
                    res[which] = self._ansible_info(hosts)
                finally:
                    self.env = plain_env
            progress("%d hosts mitogen pair %d/%d: mitogen_linear %.2f s (cpu %.2f s) vs default %.2f s (cpu %.2f s)%s"
                     % (len(hosts), i + 1, self.opts.runs, res["mitogen"]["wall_s"], res["mitogen"]["cpu_s"],
                        res["default"]["wall_s"], res["default"]["cpu_s"],
                        "" if res["mitogen"]["ok"] and res["default"]["ok"] else " FAILED"))
            if res["mitogen"]["ok"] and res["default"]["ok"]:
                pairs.append((res["mitogen"], res["default"]))
        why = None if len(hosts) == 64 else "lab has %d hosts, not 64" % len(hosts)
        if not pairs and why is None:
            why = "no pair where both runs succeeded"
        used = [] if why else pairs
        self.keys["check_s_64_mitogen"] = stats([m["wall_s"] for m, _ in used], "s",
                                                "ANSIBLE_STRATEGY=mitogen_linear " + cmd, why)
        self.keys["check_mitogen_vs_default_ratio_64"] = stats(
            [m["wall_s"] / d["wall_s"] for m, d in used], "×",
            "ANSIBLE_STRATEGY=mitogen_linear vs default strategy: " + cmd, why)

    def g_checkplay(self):
        hosts = self.lab.hosts[:64]
        serving = sum(1 for h in hosts if self._health_ok(h))
        argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", self.lab.inventory,
                "playbooks/check.yml", "-e", "gpufleet_check_fail_on=never"]
        runs = [self._timed(argv) for _ in range(max(1, min(self.opts.runs, 2)))]
        for i, r in enumerate(runs):
            progress("check.yml run %d: %.1f s%s" % (i + 1, r["wall_s"], "" if r["ok"] else " FAILED"))
        why = None if any(r["ok"] for r in runs) else "check.yml failed"
        if len(hosts) != 64:
            why = "lab has %d hosts, not 64" % len(hosts)
        e = stats([r["wall_s"] for r in runs if r["ok"]] if why is None else [], "s",
                  " ".join(["ansible-playbook -i <lab>"] + argv[3:]), why)
        if e["value"] is not None:
            e["note"] = "%d of %d hosts serving during the runs" % (serving, len(hosts))
        self.keys["checkplay_s_64"] = e

    def g_checkplay_ratio(self):
        """check.yml over ``ansible -m ping`` on the same hosts and forks (no textfile dir: the play's only write is
        left out), paired runs after a warm-up ping; every host serving (warm-up restart.yml when not), so the
        play reads everything it reads on a real fleet."""
        hosts = self.lab.hosts[:64]
        try:
            self.serving(hosts)
        except RuntimeError as exc:  # the ratio is still measured; the note says how many served
            progress("warm-up failed, measuring anyway: %s" % str(exc)[:300])
        serving = sum(1 for h in hosts if self._health_ok(h))
        bindir = os.path.dirname(sys.executable)
        play = [os.path.join(bindir, "ansible-playbook"), "-i", self.lab.inventory, "playbooks/check.yml",
                "-e", "gpufleet_check_fail_on=never", "-e", "gpufleet_textfile_dir="]
        ping = [os.path.join(bindir, "ansible"), "-i", self.lab.inventory, "gpu_hosts", "-m", "ansible.builtin.ping",
                "-o"]
        self._timed(ping, expect=len(hosts), ok_text="SUCCESS")  # warm the ssh connections
        pairs = []
        for i in range(max(1, min(self.opts.runs, 3))):
            p = self._timed(play)
            q = self._timed(ping, expect=len(hosts), ok_text="SUCCESS")
            progress("%d hosts pair %d: check.yml %.1f s%s, -m ping %.1f s%s" % (
                len(hosts), i + 1, p["wall_s"], "" if p["ok"] else " FAILED", q["wall_s"], "" if q["ok"] else " FAILED"))
            if p["ok"] and q["ok"]:
                pairs.append((p["wall_s"], q["wall_s"]))
        cmd = "%s / %s (forks %s)" % (" ".join(["ansible-playbook -i <lab>"] + play[3:]),
                                       " ".join(["ansible -i <lab>"] + ping[3:]), self.opts.forks)
        why = None if pairs else "no pair where both runs succeeded"
        if pairs and len(hosts) != 64:
            why = "lab has %d hosts, not 64: ratio %s (check.yml %s s, ping %s s)" % (
                len(hosts), _fmt(statistics.median([a / b for a, b in pairs])),
                _fmt(statistics.median([a for a, _ in pairs])), _fmt(statistics.median([b for _, b in pairs])))
            pairs = []
        e = stats([a / b for a, b in pairs], "×", cmd, why)
        if e["value"] is not None:
            e["note"] = "check.yml median %.2f s, ping median %.2f s; %d of %d hosts serving" % (
                statistics.median([a for a, _ in pairs]), statistics.median([b for _, b in pairs]), serving, len(hosts))
        self.keys["checkplay_vs_ping_ratio_64"] = e

    def g_preflight_ratio(self):
        """restart.yml's preflight alone (--tags preflight: play 1's guards and play 2) on one serving host over
        ``ansible H -m ping`` on the same host, paired runs after a warm-up ping: what preflight costs each restart
        beyond Ansible's own floor for one module call."""
        host = self.lab.hosts[0]
        try:
            self.serving([host])
        except RuntimeError as exc:
            progress("warm-up failed, measuring anyway: %s" % str(exc)[:300])
        bindir = os.path.dirname(sys.executable)
        play = [os.path.join(bindir, "ansible-playbook"), "-i", self.lab.inventory, "playbooks/restart.yml",
                "--tags", "preflight", "-e", "target=" + host]
        ping = [os.path.join(bindir, "ansible"), "-i", self.lab.inventory, host, "-m", "ansible.builtin.ping", "-o"]
        self._timed(ping, expect=1, ok_text="SUCCESS")  # warm the ssh connection
        pairs = []
        for i in range(self.opts.runs):
            p = self._timed(play)
            q = self._timed(ping, expect=1, ok_text="SUCCESS")
            progress("pair %d: preflight %.2f s%s, -m ping %.2f s%s" % (
                i + 1, p["wall_s"], "" if p["ok"] else " FAILED", q["wall_s"], "" if q["ok"] else " FAILED"))
            if p["ok"] and q["ok"]:
                pairs.append((p["wall_s"], q["wall_s"]))
        cmd = "%s / %s" % (" ".join(["ansible-playbook -i <lab>"] + play[3:]), " ".join(["ansible -i <lab>"] + ping[3:]))
        e = stats([a / b for a, b in pairs], "×", cmd, None if pairs else "no pair where both runs succeeded")
        if e["value"] is not None:
            e["note"] = "preflight median %.2f s, ping median %.2f s" % (
                statistics.median([a for a, _ in pairs]), statistics.median([b for _, b in pairs]))
        self.keys["preflight_vs_ping_ratio_1"] = e

    def _batch_point(self, n, res):
        d = [v["downtime_s"] for v in res["hosts"].values() if v["downtime_s"] is not None]
        if d:
            self.series.setdefault("downtime_vs_batch", {
                "what": "per-host client-seen downtime vs batch size (gpufleet_serial = hosts)", "x": "batch size",
                "unit": "s", "points": {}})["points"][str(n)] = {"median": round(statistics.median(d), 3),
                                                                 "max": round(max(d), 3)}

    def g_batch8(self):
        hosts = self.lab.hosts[:8]
        if len(hosts) < 8:
            self.keys["batch8_fast_host_downtime_ratio"] = stats([], "×", "", "lab has fewer than 8 hosts")
            self.keys["batch8_fast_vs_even_batch_ratio"] = stats([], "×", "", "lab has fewer than 8 hosts")
            return
        self.serving(hosts)
        # the series point: a batch of 8, no fault
        even = self.restart(hosts, serial=8)
        progress("batch 8 (no fault): %s, downtimes %s" % (even["status"], [_fmt(v["downtime_s"]) for v in even["hosts"].values()]))
        self._batch_point(8, even)
        slow = hosts[-1]
        self.lab.fault(slow, slow_load_s=20)
        try:
            res = self.restart(hosts, serial=8)
        finally:
            self.lab.clear_faults(slow)
        fast = [res["hosts"][h]["downtime_s"] for h in hosts if h != slow]
        progress("batch 8 (%s slow_load_s=20): %s, fast hosts %s, slow %s" % (
            slow, res["status"], [_fmt(x) for x in fast], _fmt(res["hosts"][slow]["downtime_s"])))
        cmd = ("lab.py fault %s slow_load_s=20; ansible-playbook -i <lab> playbooks/restart.yml -e target=%s "
               "-e gpufleet_serial=8" % (slow, ",".join(hosts)))
        self.keys["batch8_fast_host_downtime_ratio"] = self._ratio(fast, cmd, res)
        self.keys["batch8_fast_vs_even_batch_ratio"] = batch_pair_ratio(fast, even, res, cmd)

    def _ratio(self, downtimes, cmd, res):
        """median(downtimes) / median single-host downtime of this session, as a one-run entry."""
        d = [x for x in downtimes if x is not None]
        if not self.single:
            return stats([], "×", cmd, "no single-host downtime measured in this session (run with 'single')")
        if res["status"] != "successful" or not d:
            return stats([], "×", cmd, "restart run %s, %d downtimes measured" % (res["status"], len(d)))
        base = statistics.median(self.single)
        e = stats([statistics.median(d) / base], "×", cmd,
                  "one paired run: median per-host downtime %.2f s over single-host median %.2f s" % (
                      statistics.median(d), base))
        return e

    def g_restart64(self):
        hosts = self.lab.hosts[:64]
        cmd = "ansible-playbook -i <lab> playbooks/restart.yml -e gpufleet_serial=%d (all hosts)" % len(hosts)
        if len(hosts) < 64:
            self.keys["restart_all_at_once_64_vs_1_ratio"] = stats([], "×", cmd, "lab has %d hosts, not 64" % len(hosts))
            return
        self.serving(hosts)
        res = self.restart(hosts, serial=64)
        d = [v["downtime_s"] for v in res["hosts"].values()]
        progress("all 64 at once: %s, wall %.0f s, downtime median %s" % (
            res["status"], res["wall_s"], _fmt(statistics.median([x for x in d if x is not None]) if any(
                x is not None for x in d) else None)))
        self._batch_point(64, res)
        self.keys["restart_all_at_once_64_vs_1_ratio"] = self._ratio(d, cmd, res)

    def g_module_exit(self):
        n = max(self.opts.runs, 15)
        with_freeze, without = module_exit_costs(n)
        cmd = ("python3 plugins/modules/nvidia_gpu_wait.py ARGS.json, %d alternating pairs "
               "(stamp: sitecustomize wrapping sys.exit)" % n)
        self.keys["module_exit_ms"] = stats(with_freeze, "ms", cmd, None if with_freeze else "no run stamped its exit",
                                            digits=1)
        self.keys["module_exit_ms_no_freeze"] = stats(without, "ms", cmd + "; gc.freeze a no-op",
                                                      None if without else "no run stamped its exit", digits=1)
        progress("module exit: %s ms with gc.freeze, %s ms without" % (
            _fmt(self.keys["module_exit_ms"].get("value")), _fmt(self.keys["module_exit_ms_no_freeze"].get("value"))))

    def run(self, groups):
        if "single" not in groups and NEEDS_SINGLE & set(groups):
            groups = ["single"] + groups
        need_hosts = lab_hosts(groups)
        if need_hosts:
            self.lab_up(self.opts.hosts or need_hosts)
        try:
            for g in ORDER:
                if g in groups:
                    progress("== %s" % g)
                    t = time.time()
                    try:
                        getattr(self, "g_" + g)()
                    except Exception as exc:  # one group's failure leaves the others' figures; keys say why
                        progress("== %s FAILED: %s" % (g, exc))
                        for k in GROUPS[g]:
                            if k not in self.keys or self.keys[k].get("value") is None:
                                self.keys[k] = stats([], KEYS[k][0], g, "%s failed: %s" % (g, str(exc)[:300]))
                    progress("== %s done in %.0f s" % (g, time.time() - t))
            if self.single:
                self._batch_point(1, {"hosts": {"h": {"downtime_s": statistics.median(self.single)}}})
        finally:
            if need_hosts:
                self.lab_down()


# Loaded into a module process (a sitecustomize on PYTHONPATH): stamps sys.exit's call on stderr. Shared with
# tests/gpu/release_trace.py.
EXIT_STAMP = """import sys, time
_exit = sys.exit
def _stamped_exit(code=0):
    sys.stderr.write("T_SYS_EXIT %.6f\\n" % time.time())
    sys.stderr.flush()
    _exit(code)
sys.exit = _stamped_exit
"""


def module_exit_costs(n, module="nvidia_gpu_wait"):
    """``n`` alternating pairs of a gpufleet module run as a process (``python3 plugins/modules/<module>.py
    ARGS.json``, the collection on PYTHONPATH): ms from its sys.exit to the parent seeing it end, with the module's
    ``gc.freeze()`` and with it made a no-op. Returns (with_freeze_ms, without_ms), lists of floats. On a machine
    without nvidia-smi the wait fails at once: fail_json's exit is the same sys.exit path."""
    stamps = tempfile.mkdtemp(prefix="gpufleet-bench-exit-")
    with open(os.path.join(stamps, "sitecustomize.py"), "w") as fh:
        fh.write(EXIT_STAMP)
    off = os.path.join(stamps, "nofreeze")
    os.mkdir(off)
    with open(os.path.join(off, "sitecustomize.py"), "w") as fh:
        fh.write(EXIT_STAMP + "import gc\ngc.freeze = lambda: None\n")
    args = os.path.join(stamps, "args.json")
    with open(args, "w") as fh:
        json.dump({"ANSIBLE_MODULE_ARGS": {"max_used_mib": 1024, "timeout_s": 1, "backend": "nvidia-smi"}}, fh)
    path = os.path.join(ROOT, "plugins", "modules", module + ".py")
    out = ([], [])
    for _ in range(n):
        for i, site in enumerate((stamps, off)):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.path.join(ROOT, "collections")]))
            proc = subprocess.Popen([sys.executable, path, args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            _, err = proc.communicate(60)
            t_end = time.time()
            stamp = [line.split()[1] for line in err.decode(errors="replace").splitlines() if line.startswith("T_SYS_EXIT ")]
            if stamp:
                out[i].append((t_end - float(stamp[-1])) * 1000)
    return out


def select_groups(only):
    """--only value → list of group names (keys map to the group that measures them). Raises ValueError."""
    if not only:
        return list(ORDER)
    out = []
    for word in [w.strip() for w in only.split(",") if w.strip()]:
        if word in GROUPS:
            g = word
        else:
            g = next((name for name, keys in GROUPS.items() if word in keys), None)
            if g is None:
                raise ValueError("--only: unknown key or group %r (known: %s)" % (
                    word, ", ".join(list(GROUPS) + [k for ks in GROUPS.values() for k in ks])))
        if g not in out:
            out.append(g)
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated keys or groups (%s)" % ", ".join(ORDER))
    ap.add_argument("--runs", type=int, default=5, help="runs per measurement (default 5; check: pairs; check.yml and the scaling points: at most 2)")
    ap.add_argument("--lab-dir", default=os.path.join(ROOT, ".lab-bench"))
    ap.add_argument("--hosts", type=int, help="lab size (default: 64 when a 64-host key is selected, else 8)")
    ap.add_argument("--probe-ms", type=int, default=15, help="prober period for ≤ 8 hosts (64 hosts: ≥ 100)")
    ap.add_argument("--scale-hosts", default="1,8,16,32,64")
    ap.add_argument("--keep-lab", action="store_true", help="leave the lab running")
    ap.add_argument("--sglang-version", help="the lab's SGLang release (default: lab.py's); a machine without PyPI "
                                             "needs its wheel in <GPUFLEET_CACHE>/sglang-wheels")
    ap.add_argument("--no-write", action="store_true", help="print the results, write nothing under docs/")
    opts = ap.parse_args(argv)
    if opts.runs < 1:
        ap.error("--runs must be ≥ 1")
    try:
        opts.groups = select_groups(opts.only)
        opts.scale_hosts = [int(x) for x in opts.scale_hosts.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    opts.lab_dir = os.path.abspath(opts.lab_dir)
    opts.forks = _ansible_forks()
    return opts


def _ansible_forks():
    import configparser
    cp = configparser.ConfigParser()
    cp.read(os.path.join(ROOT, "ansible.cfg"))
    return int(os.environ.get("ANSIBLE_FORKS") or cp.get("defaults", "forks", fallback="5"))


def main(argv=None):
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    command = "make bench" + (" BENCH_ARGS='%s'" % " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
                              if (argv or sys.argv[1:]) else "")
    b = Bench(opts)
    t = time.time()
    machine = machine_info()
    try:
        b.run(opts.groups)
    except KeyboardInterrupt:
        progress("interrupted: writing what was measured so far")
    finally:
        progress("measured in %.0f s" % (time.time() - t))
    machine["load at end"] = "%.2f %.2f %.2f" % os.getloadavg()
    for s in b.series.values():  # points in numeric order of x
        s["points"] = {k: s["points"][k] for k in sorted(s["points"], key=float)}
    for name, s in b.series.items():
        if not opts.no_write and s["points"]:
            s["png"] = plot_series(name, s, os.path.join(IMG_DIR, "bench-%s.png" % name))
    old = json.load(open(JSON_PATH)) if os.path.exists(JSON_PATH) else {}
    doc = merge_doc(old, b.keys, command, machine, b.series)
    print(json.dumps({k: doc["keys"][k] for k in b.keys}, indent=1))
    if not opts.no_write:
        write_outputs(doc)
        progress("wrote %s, %s" % (os.path.relpath(JSON_PATH, ROOT), os.path.relpath(MD_PATH, ROOT)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
