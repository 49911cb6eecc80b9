#!/usr/bin/env python3
"""Cost of one ``nvidia-smi`` call, per command nvidia_gpu_info runs: median and p95 of N calls.

Run it where the calls happen: inside a lab host (``tests/lab/lab.py exec gpu-lab-01 -- python3
tests/lab/smi_cost.py``: PATH there finds the simulated nvidia-smi), on the bare machine against a lab
host's front end (``--smi <lab dir>/hosts/gpu-lab-01/bin/nvidia-smi``), or on a GPU host against the real
one. Each ``--smi`` is measured interleaved with the others (call by call), so a busy machine loads each the
same. ``--floor PYTHON`` adds ``PYTHON -IS -c pass`` (the interpreter's own start, the least a Python
simulator can cost). Stdlib only; the commands are the ones gpufleet_gpu's nvidia-smi backend builds.

    python3 tests/lab/smi_cost.py [--runs 20] [--smi [LABEL=]PATH ...] [--floor PYTHON] [--json]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def module_commands():
    """{name: argv tail} of the runs of one nvidia_gpu_info call (the nvidia-smi backend's own queries)."""
    sys.path.insert(0, os.path.join(ROOT, "collections"))
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
    fmt = "--format=csv,noheader,nounits"
    return {
        "details": ["--query-gpu=" + ",".join(f for f, _, _ in G.SMI_GPU_QUERY), fmt],
        "banner": [],
        "nvlink -s": ["nvlink", "-s"],
        "nvlink -e": ["nvlink", "-e"],
        "compute-apps": ["--query-compute-apps=" + ",".join(f for f, _, _ in G.SMI_APPS_QUERY), fmt],
    }


def p95(values):
    """Nearest-rank 95th percentile (the 19th of 20)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def timed(argv):
    t = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, LC_ALL="C"))
    ms = (time.perf_counter() - t) * 1000.0
    if done.returncode != 0:
        raise SystemExit("%s exited %d" % (" ".join(argv)[:120], done.returncode))
    return ms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--smi", action="append", default=[], metavar="[LABEL=]PATH",
                   help="an nvidia-smi to measure (repeatable; default: nvidia-smi on PATH)")
    p.add_argument("--floor", metavar="PYTHON", help="also time PYTHON -IS -c pass")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    smis = []
    for spec in args.smi or ["nvidia-smi"]:
        label, _, path = spec.rpartition("=")
        smis.append((label or path, path))
    commands = module_commands()
    samples = {(label, name): [] for label, _ in smis for name in commands}
    if args.floor:
        samples[("floor", "python -IS -c pass")] = []
    for _ in range(args.runs):
        for name, tail in commands.items():
            for label, path in smis:
                samples[(label, name)].append(timed([path] + tail))
        if args.floor:
            samples[("floor", "python -IS -c pass")].append(timed([args.floor, "-IS", "-c", "pass"]))
    load = os.getloadavg()[0]
    rows = [{"smi": label, "command": name, "runs": len(v), "median_ms": round(statistics.median(v), 1),
             "p95_ms": round(p95(v), 1)} for (label, name), v in samples.items()]
    # One module call's runs together: the sum of the per-command medians.
    for label, _ in smis:
        rows.append({"smi": label, "command": "one nvidia_gpu_info call (%d runs)" % len(commands),
                     "median_ms": round(sum(statistics.median(samples[(label, n)]) for n in commands), 1)})
    if args.json:
        print(json.dumps({"loadavg_1m": load, "cpus": os.cpu_count(), "rows": rows}, indent=1))
        return 0
    print("load average (1 min) %.2f on %d CPUs, %d runs each, interleaved" % (load, os.cpu_count(), args.runs))
    for r in rows:
        print("%-28s %-40s median %7.1f ms%s" % (r["smi"][-28:], r["command"], r["median_ms"],
                                                 "  p95 %7.1f ms" % r["p95_ms"] if "p95_ms" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
