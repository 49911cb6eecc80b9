#!/usr/bin/env python3
"""Seeded trials of playbooks/tune.yml on a lab canary (issue 34, ``make tune-trials``; not part of ``make test``).

    tune_trials.py [--trials 10] [--repeats 3] [--noise 0.05] [--seed-base 1] [--candidates FILE]
                   [--parallel N] [--lab-dir DIR | --reuse-lab DIR] [--out FILE] [-e KEY=VALUE ...]

Brings up a lab (tests/lab/lab.py up, ``--parallel`` hosts; ``--reuse-lab`` uses a running one and leaves it up),
gives the canaries SGLang's benchmark client (lab.py bench-deps), starts every canary on its own values
(restart.yml), then runs ``--trials`` trials (measurement settings: DEFAULT_EXTRA, overridable with -e). Trial i runs on canary
``i % parallel`` (trials on one canary run in sequence), with the fault knobs ``perf_seed = seed-base + i`` and
``perf_noise``, the canary's start counter reset (``<host dir>/perf_starts``: the noise of each start is then a
function of the trial's seed alone), and runs

    ansible-playbook -i <lab inventory> playbooks/tune.yml -e target=<canary> -e @<candidates>
        -e gpufleet_tune_report=<trial json> -e gpufleet_tune_repeats=<repeats> ...

Each trial passes when (1) the playbook succeeded, (2) the report's winner is the candidate with the best table
speed (perf.decode_tok_s of the canary's own values overridden by the candidate: the stand-in's documented table,
docs/lab.md "Decode speed"), and (3) the canary serves afterwards (GET /health 200) at a table speed not below its
baseline's (the last "decode speed" line of the stand-in's log: the row its workers' environment gave). Prints one
line per trial, a summary (best picked k of n, never worse: yes/no) and the total time; writes ``--out``
(default tests/bench/results/tune_trials.json). Exit status 0 when at least ``--need`` trials (default 9 of 10)
picked the best and no trial left a canary worse than its baseline.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAB_PY = os.path.join(ROOT, "tests", "lab", "lab.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "lab", "standin"))
import perf  # noqa: E402

DEFAULT_CANDIDATES = os.path.join(HERE, "tune_candidates.yml")
DEFAULT_OUT = os.path.join(HERE, "results", "tune_trials.json")
# Before the user's -e (a later -e wins): the lab restarts faster (as the lab tests do), the benchmark client
# reads the lab tokenizer offline (no network in the lab), and measurements short enough for 150 rounds.
DEFAULT_EXTRA = [
    json.dumps({"sglang_stop_grace_s": 10, "sglang_launch_ready_slice_s": 5,
                "gpufleet_tune_bench_env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                "gpufleet_tune_num_prompts": 8, "gpufleet_tune_input_len": 32, "gpufleet_tune_output_len": 64,
                "gpufleet_tune_concurrency": 8, "gpufleet_tune_warmup_requests": 1}),
]
SPEED_LINE = re.compile(r"lab stand-in decode speed: row (\S+), base ([0-9.]+) tok/s, factor ([0-9.]+)")


# The decision code's own merge (the repository is the collection gpufleet.fleet through collections/).
sys.path.insert(0, os.path.join(ROOT, "collections"))
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.tune import apply_overrides  # noqa: E402


def load_yaml(path):
    import yaml
    with open(path) as fh:
        return yaml.safe_load(fh)


def expected_speeds(candidates, own_env, own_args):
    """{name: (row, table tok/s)} for the baseline and each candidate (no noise)."""
    out = {"baseline": perf.decode_tok_s({k: str(v) for k, v in (own_env or {}).items()}, own_args)}
    for cand in candidates:
        env = apply_overrides(own_env, cand.get("sglang_nccl_env"))
        args = apply_overrides(own_args, cand.get("sglang_launch_args"))
        out[cand["name"]] = perf.decode_tok_s({k: str(v) for k, v in env.items()}, args)
    return out


def table_best(speeds):
    """Name of the candidate (baseline excluded) with the best table speed; ties: the first."""
    names = [n for n in speeds if n != "baseline"]
    return max(names, key=lambda n: (speeds[n][1], -names.index(n)))


def last_speed(log_text):
    """(row, base, factor) of the last start in a stand-in log, None when it logged none."""
    found = SPEED_LINE.findall(log_text or "")
    if not found:
        return None
    row, base, factor = found[-1]
    return row, float(base), float(factor)


def judge(trial, speeds, report, final, health):
    """The trial's verdict: picked the table's best, and the canary left no worse than its baseline."""
    best = table_best(speeds)
    winner = (report or {}).get("winner")
    base_tok_s = speeds["baseline"][1]
    final_base = final[1] if final else None
    trial.update({
        "expected_best": best, "winner": winner, "picked_best": winner == best,
        "reason": (report or {}).get("reason"),
        "final_row": final[0] if final else None, "final_table_tok_s": final_base,
        "final_factor": final[2] if final else None, "serving": health == 200,
        "never_worse": bool(health == 200 and final_base is not None and final_base >= base_tok_s),
    })
    return trial


def medians(report):
    out = {}
    for entry in (report or {}).get("candidates", []):
        metric = entry.get("single_stream_tok_s") or {}
        out[entry.get("name")] = {"median": metric.get("median"), "min": metric.get("min"),
                                  "max": metric.get("max"), "ok": entry.get("ok")}
    return out


class Lab:
    def __init__(self, lab_dir):
        self.lab_dir = os.path.realpath(lab_dir)
        self.inventory = os.path.join(self.lab_dir, "inventory")
        doc = load_yaml(os.path.join(self.inventory, "hosts.yml"))
        self.host_vars = doc["all"]["children"]["gpu_hosts"]["hosts"]
        self.group_vars = load_yaml(os.path.join(self.inventory, "group_vars", "gpu_hosts.yml"))
        self.hosts = list(self.host_vars)

    def vars(self, host):
        merged = dict(self.group_vars)
        merged.update(self.host_vars[host])
        return merged

    def fault(self, host, *knobs):
        subprocess.run([sys.executable, LAB_PY, "fault", "--lab-dir", self.lab_dir, host] + list(knobs),
                       check=True, capture_output=True)

    def health(self, host):
        hv = self.vars(host)
        code = ("import urllib.request as u\ntry:\n    print(u.urlopen('http://%s:%s/health', timeout=5).status)\n"
                "except Exception as e:\n    print(getattr(e, 'code', 0))\n" % (hv["sglang_host"], hv["sglang_port"]))
        res = subprocess.run([sys.executable, LAB_PY, "exec", "--lab-dir", self.lab_dir, host, "--",
                              hv["sglang_python"], "-c", code], capture_output=True, text=True)
        out = res.stdout.strip()
        return int(out) if out.isdigit() else None

    def standin_log(self, host):
        path = os.path.join(self.vars(host)["sglang_state_dir"], "sglang.log")
        try:
            with open(path, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""


def playbook(lab, name, extra, log_path):
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", lab.inventory,
            os.path.join(ROOT, "playbooks", name)]
    for e in extra:
        argv += ["-e", e]
    t0 = time.time()
    with open(log_path, "w") as fh:
        fh.write("$ %s\n" % " ".join(argv))
        fh.flush()
        rc = subprocess.call(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return rc, time.time() - t0, argv


def run_trial(lab, host, index, args, speeds, work):
    seed = args.seed_base + index
    report_path = os.path.join(work, "trial%02d-report.json" % index)
    log_path = os.path.join(work, "trial%02d.log" % index)
    lab.fault(host, "perf_seed=%d" % seed, "perf_noise=%s" % args.noise)
    try:
        os.unlink(os.path.join(lab.vars(host)["lab_host_dir"], perf.STARTS_FILE))
    except FileNotFoundError:
        pass
    extra = ["target=%s" % host, "@%s" % os.path.abspath(args.candidates), "gpufleet_tune_report=%s" % report_path,
             "gpufleet_tune_repeats=%d" % args.repeats, "gpufleet_tune_profile=tune-trial%02d" % index,
             "gpufleet_profile_dir=%s" % os.path.join(work, "profiles"), "gpufleet_profile_overwrite=true"]
    extra = DEFAULT_EXTRA + extra + args.extra
    rc, wall, argv = playbook(lab, "tune.yml", extra, log_path)
    try:
        with open(report_path) as fh:
            report = json.load(fh)
    except (OSError, ValueError):
        report = None
    trial = {"trial": index, "host": host, "perf_seed": seed, "rc": rc, "wall_s": round(wall, 1), "log": log_path,
             "single_stream_tok_s": medians(report)}
    return judge(trial, speeds, report, last_speed(lab.standin_log(host)), lab.health(host))


def summarize(trials, speeds, args, total_s):
    picked = sum(1 for t in trials if t["picked_best"] and t["rc"] == 0)
    never_worse = all(t["never_worse"] for t in trials)
    return {"trials": len(trials), "picked_best": picked, "need": args.need, "never_worse": never_worse,
            "passed": picked >= args.need and never_worse, "total_s": round(total_s, 1),
            "repeats": args.repeats, "noise": args.noise, "seed_base": args.seed_base,
            "parallel": args.parallel}


def print_summary(trials, speeds, summary):
    print("table speeds (docs/lab.md \"Decode speed\"): " + ", ".join(
        "%s %s %.1f" % (n, row, tok_s) for n, (row, tok_s) in speeds.items()))
    print("%-5s %-12s %-5s %-4s %-18s %-18s %-6s %-8s %s" % (
        "trial", "host", "seed", "rc", "winner", "table best", "best?", "final", "wall_s"))
    for t in trials:
        print("%-5d %-12s %-5d %-4d %-18s %-18s %-6s %-8s %.0f" % (
            t["trial"], t["host"], t["perf_seed"], t["rc"], t["winner"], t["expected_best"],
            "yes" if t["picked_best"] else "NO", ("%.1f" % t["final_table_tok_s"]) if t["final_table_tok_s"]
            else "-", t["wall_s"]))
    print("best picked in %d of %d trials (need %d); canary never worse than its baseline: %s; total %.0f s "
          "(%s)" % (summary["picked_best"], summary["trials"], summary["need"],
                    "yes" if summary["never_worse"] else "NO", summary["total_s"],
                    str(datetime.timedelta(seconds=int(summary["total_s"])))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--seed-base", type=int, default=1)
    p.add_argument("--need", type=int, default=None, help="trials that must pick the best (default 9 of 10)")
    p.add_argument("--candidates", default=DEFAULT_CANDIDATES)
    p.add_argument("--parallel", type=int, default=1, help="canaries (lab hosts) running trials at once")
    p.add_argument("--lab-dir", default=os.path.join(ROOT, ".lab-tune"))
    p.add_argument("--reuse-lab", default=None, help="a running lab's dir (left running)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--work", default=None, help="directory for playbook logs and reports (default: a new temp dir)")
    p.add_argument("-e", dest="extra", action="append", default=[], help="extra var for tune.yml (repeatable)")
    args = p.parse_args(argv)
    if args.need is None:
        args.need = max(1, (args.trials * 9 + 9) // 10)
    t0 = time.time()
    lab_dir = args.reuse_lab or args.lab_dir
    if not args.reuse_lab:
        subprocess.run([sys.executable, LAB_PY, "up", "--hosts", str(args.parallel), "--lab-dir", lab_dir],
                       check=True)
    # outside the lab dir: lab.py down empties it
    work = args.work or tempfile.mkdtemp(prefix="gpufleet-tune-trials-")
    os.makedirs(work, exist_ok=True)
    print("tune-trials: playbook logs and reports in %s" % work, flush=True)
    try:
        lab = Lab(lab_dir)
        canaries = lab.hosts[:args.parallel]
        # SGLang's benchmark client on the canaries: its dependencies and the lab tokenizer (tests/lab/bench_deps.py)
        for host in canaries:
            subprocess.run([sys.executable, LAB_PY, "bench-deps", "--lab-dir", lab_dir, host], check=True)
        first = lab.vars(canaries[0])
        candidates = load_yaml(args.candidates)["gpufleet_tune_candidates"]
        speeds = expected_speeds(candidates, first.get("sglang_nccl_env"), first.get("sglang_launch_args"))
        # Every canary serving its own values before the first trial (tune.yml tunes a serving host).
        rc, wall, _ = playbook(lab, "restart.yml", DEFAULT_EXTRA[:1] + ["target=%s" % ",".join(canaries)],
                               os.path.join(work, "restart-start.log"))
        if rc != 0:
            print("restart.yml on %s failed (rc %d, %.0f s): see %s" % (", ".join(canaries), rc, wall,
                                                                      os.path.join(work, "restart-start.log")))
            return 2

        def lane(k):
            return [run_trial(lab, canaries[k], i, args, speeds, work)
                    for i in range(args.trials) if i % len(canaries) == k]
        with concurrent.futures.ThreadPoolExecutor(len(canaries)) as pool:
            trials = sorted((t for lane_trials in pool.map(lane, range(len(canaries))) for t in lane_trials),
                            key=lambda t: t["trial"])
        for host in canaries:
            lab.fault(host, "perf_seed=", "perf_noise=")
    finally:
        if not args.reuse_lab:
            subprocess.run([sys.executable, LAB_PY, "down", "--lab-dir", lab_dir], capture_output=True)
    total = time.time() - t0
    summary = summarize(trials, speeds, args, total)
    print_summary(trials, speeds, summary)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    doc = {"summary": summary, "table": {n: {"row": r, "tok_s": v} for n, (r, v) in speeds.items()},
           "candidates_file": os.path.relpath(os.path.abspath(args.candidates), ROOT),
           "extra_vars": DEFAULT_EXTRA + args.extra, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "work_dir": work, "trials": trials}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print("wrote %s" % args.out)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
