#!/usr/bin/env python3
"""Where a single-host restart's downtime goes (issue 14): per-task times and the target-clock stamps the modules
return, for restarts of gpu-lab-01 in a lab of 2 hosts.

    .venv/bin/python tests/bench/profile_single.py [--lab-dir DIR] [--runs N] [--keep-lab] [--start-with-stop false]
        [--whole-play]

Brings up its own lab (default .lab-profile), starts a server on gpu-lab-01 (not measured), then restarts it N
times with the gpufleet_task_times callback. Per run it prints, on the target's clock, the stop module's SIGTERM
→ processes gone → GPU memory seen free, the start module's spawn, the stand-in's exec and "fired up" (its log),
the moment readiness was seen (sglang_process ready_epoch, from the start itself or ready.yml), and the overhead
= SIGTERM → ready − the stand-in's own start-to-ready; then every task of play 3 from the stop task's start to
the task that saw the server ready, with its duration (controller clock; lab and controller share the clock).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = "gpu-lab-01"
PLAY = "Restart SGLang host by host"


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def first_ok(runner, prefix):
    for ev in runner.events:
        d = ev.get("event_data", {})
        if (ev.get("event") == "runner_on_ok" and d.get("host") == HOST and (d.get("task") or "").startswith(prefix)
                and not d.get("play", "").startswith("Preflight")):
            return d.get("res", {})
    return None


def one_run(lab, bench, n, extravars, whole_play=False):
    times = os.path.join(tempfile.mkdtemp(prefix="gpufleet-profile-"), "times.jsonl")
    env = {"ANSIBLE_CALLBACK_PLUGINS": "%s:%s" % (os.path.join(ROOT, "plugins", "callback"),
                                                  os.path.join(ROOT, "tests", "gpu", "callback_plugins")),
           "GPUFLEET_TASK_TIMES_FILE": times}
    runner = lab.run_playbook("playbooks/restart.yml", extravars=dict(extravars, target=HOST), envvars=env)
    print("run %d: %s" % (n, runner.status))
    if runner.status != "successful":
        return
    rows = sorted((json.loads(x) for x in open(times) if x.strip()), key=lambda r: r["start"])
    rows = [r for r in rows if r["host"] == HOST and (r.get("play") or "").startswith(PLAY) and r.get("start")]
    stop = first_ok(runner, "Stop the server and SGLang leftovers")
    ready = first_ok(runner, "Wait until the launched server answers")
    # The stop's own call starts the new server (sglang_stop start_after) unless gpufleet_start_with_stop=false
    # or it could not; then the launch role's start task does.
    by_stop = (stop.get("start") or {}).get("started")
    start = stop["start"] if by_stop else first_ok(runner, "Start SGLang in its own session")
    start_task = "Stop the server and SGLang leftovers" if by_stop else "Start SGLang in its own session"
    ready_epoch, seen_by = start.get("ready_epoch"), "the start task (sglang_process wait_ready)"
    if not ready_epoch and ready:
        ready_epoch, seen_by = ready.get("ready_epoch"), "ready.yml (the start's window ended first)"
    gpu = stop.get("gpu_wait") or {}
    log = lab.exec(HOST, ["cat", "%s/sglang.log" % lab.host_vars(HOST)["sglang_state_dir"]]).stdout
    s2r = bench.parse_standin_log(log)[-1]
    task = {r["task"].split(" : ")[-1]: r for r in rows}
    t_stop = next(r for k, r in task.items() if k.startswith("Stop the server and SGLang leftovers"))
    t_start = next(r for k, r in task.items() if k.startswith(start_task))
    print("  stop task: task start -> SIGTERM %.3f s; SIGTERM -> processes gone %.3f s; GPU memory seen free after "
          "%s ms (%s polls, backend %s)" % (stop["started_at"] - t_stop["start"],
                                            (gpu.get("started_at") or stop["started_at"]) - stop["started_at"],
                                            gpu.get("elapsed_ms"), gpu.get("polls"), gpu.get("backend")))
    print("  start (%s): task start -> spawn %.3f s; spawn -> stand-in exec %.3f s; exec -> 'fired up' %.3f s; "
          "'fired up' -> ready seen %.3f s (by %s)" % ("the stop's call, start_after" if by_stop else "the launch's start task",
                                                      start["started_at"] - t_start["start"],
                                                      s2r["exec"] - start["started_at"], s2r["start_to_ready_s"],
                                                      (ready_epoch or 0) - s2r["ready"], seen_by))
    down = ready_epoch - stop["started_at"]
    print("  SIGTERM -> ready (target clock) %.3f s = stand-in start-to-ready %.3f s + overhead %.3f s"
          % (down, s2r["start_to_ready_s"], down - s2r["start_to_ready_s"]))
    last = max(i for i, r in enumerate(rows) if any(k in r["task"] for k in (
        "Start SGLang in its own session", "Wait until the launched server answers", "Note when the server became ready")))
    first = next(i for i, r in enumerate(rows) if "Stop the server and SGLang leftovers" in r["task"])
    if whole_play:
        first, last = 0, len(rows) - 1
    t0 = rows[first]["start"]
    print("  %7s %6s  %-8s %s" % ("at s", "took s", "status", "task"))
    for r in rows[first:last + 1]:
        print("  %7.3f %6.3f  %-8s %s %s" % (r["start"] - t0, r["end"] - r["start"], r["status"], r["task"][:100],
                                            ("[%s]" % r.get("action")) if whole_play else ""))
    if whole_play:
        # controller-only actions run no module on the target (no round trip)
        local = ("set_fact", "set_stats", "debug", "include_tasks", "include_role", "import_tasks", "assert", "fail",
                 "meta", "include_vars")
        kinds = {}
        for r in rows:
            name = (r.get("action") or "?").split(".")[-1]
            kind = "controller" if name in local else "module"
            n, took = kinds.get(kind, (0, 0.0))
            kinds[kind] = (n + 1, took + r["end"] - r["start"])
        print("  play wall %.3f s; %s" % (rows[-1]["end"] - rows[0]["start"], "; ".join(
            "%s tasks: %d, %.3f s" % (k, n, t) for k, (n, t) in sorted(kinds.items()))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab-dir", default=os.path.join(ROOT, ".lab-profile"))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--keep-lab", action="store_true")
    ap.add_argument("--whole-play", action="store_true", help="every task of play 3, with its action, and the split "
                    "between module tasks and controller-only tasks")
    ap.add_argument("--start-with-stop", choices=["true", "false"], default="true",
                    help="gpufleet_start_with_stop: the stop's call starts the new server (default) or the launch does")
    opts = ap.parse_args()
    lab_py = os.path.join(ROOT, "tests", "lab", "lab.py")
    if not os.path.exists(os.path.join(opts.lab_dir, "inventory")):
        subprocess.run([sys.executable, lab_py, "up", "--hosts", "2", "--lab-dir", opts.lab_dir], check=True)
    try:
        lab = load("gpufleet_profile_conftest", os.path.join(ROOT, "tests", "integration", "conftest.py")).Lab(opts.lab_dir)
        bench = load("gpufleet_profile_bench", os.path.join(ROOT, "tests", "bench", "bench.py"))
        warm = lab.run_playbook("playbooks/restart.yml", extravars={"target": HOST})
        print("warm-up (not measured): %s; load %s" % (warm.status, " ".join(open("/proc/loadavg").read().split()[:3])))
        for n in range(1, opts.runs + 1):
            one_run(lab, bench, n, {"gpufleet_start_with_stop": opts.start_with_stop == "true"}, opts.whole_play)
        print("load %s" % " ".join(open("/proc/loadavg").read().split()[:3]))
    finally:
        if not opts.keep_lab:
            subprocess.run([sys.executable, lab_py, "down", "--lab-dir", opts.lab_dir], capture_output=True)


if __name__ == "__main__":
    main()
