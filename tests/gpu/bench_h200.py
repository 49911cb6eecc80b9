#!/usr/bin/env python3
"""H200 figures for docs/benchmarks.json (issue 14): release detection and nvidia_gpu_info cost on a real GPU.

On the lent GPU machine, from the repository root (as root; .whl/ as for tests/gpu/real_restart.sh):

    bench_h200.py --out $OUT [--reps 5] [--info-reps 10] [--mib 20480]

1. ``release_detect_ms_median_h200``: tests/gpu/real_restart.sh with ``RR_HELD_WAIT_REPS=--reps``: each rep
   runs ``restart.yml --tags wait`` while the stand-in's TP workers hold ``--mib`` MiB per GPU and SIGKILLs them
   5 s in; an independent NVML poller (10 ms, its own process) logs every change of used MiB. Per rep: the end
   of the ``nvidia_gpu_wait`` task (gpufleet_task_times callback, controller clock) − the first poller sample
   at which every GPU was at or under the wait's limit (1024 MiB), ms (tests/gpu/real_restart.py report:
   the smallest ``wait_task_end_minus_free_seen_ms`` over GPUs). Median over the reps.

2. ``info_ms_nvml_h200`` / ``info_ms_smi_h200``: ``python3 plugins/modules/nvidia_gpu_info.py ARGS.json`` (the
   module process as Ansible runs it on the target: interpreter start, every default field, JSON out) with
   backend=nvml and backend=nvidia-smi, alternating, ``--info-reps`` each, idle GPUs; wall of the process, ms,
   median (tests/gpu/real_gpu_check.run_module_file).

Writes ``$OUT/bench_h200.json`` (keys in docs/benchmarks.json's entry shape, the machine, the command) and
copies real_restart.sh's ``report.json`` (as ``restart-report.json``) and its log next to it.

Back on the development machine:

    bench_h200.py --merge RESULT.json     adds those keys (and their command) to docs/benchmarks.json and
                                          regenerates the Markdown section of docs/benchmarks.md.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
import bench  # noqa: E402  (pure helpers: stats, merge_doc, write_outputs)

DEVICE_KEYS = {
    "release_detect_ms_median_h200": ("ms", "nvidia_gpu_wait task end − memory seen free by a 10 ms NVML poller",
                                      "≤ 50"),
    "info_ms_nvml_h200": ("ms", "nvidia_gpu_info module process, backend=nvml, end to end", None),
    "info_ms_smi_h200": ("ms", "nvidia_gpu_info module process, backend=nvidia-smi, end to end", None),
}
for _k, _v in DEVICE_KEYS.items():
    bench.KEYS.setdefault(_k, _v)


def release_samples(report, skipped=None):
    """Release-detection latencies (ms) from real_restart.py's report document: one per ``held*`` run, the
    smallest ``wait_task_end_minus_free_seen_ms`` over its GPUs (= wait end − the moment the last GPU was seen
    free). Runs where no GPU was seen going free (memory never held, poller missed it) give no sample, nor do runs
    whose wait found the memory free on its first poll (``wait_polls`` 1: the release came while the module was
    still starting, so the figure would be its start-up, not a detection); their names go to ``skipped``."""
    out = []
    for name, run in sorted((report.get("runs") or {}).items()):
        if not name.startswith("held"):
            continue
        if run.get("wait_polls") is not None and run["wait_polls"] <= 1:
            if skipped is not None:
                skipped.append(name)
            continue
        per_gpu = [g.get("wait_task_end_minus_free_seen_ms") for g in (run.get("release_per_gpu") or {}).values()]
        if per_gpu and all(v is not None for v in per_gpu) and not run.get("failed_tasks"):
            out.append(min(per_gpu))
    return out


def device_info():
    info = {"cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        info["gpus"] = "%d× %s" % (len(q), q[0].split(",")[0].strip()) if q else None
        info["driver"] = q[0].split(",")[1].strip() if q else None
    except (OSError, subprocess.SubprocessError, IndexError):
        info["gpus"] = None
    try:
        from ansible.release import __version__
        info["ansible-core"] = __version__
    except ImportError:
        info["ansible-core"] = None
    return info


def measure(opts):
    os.makedirs(opts.out, exist_ok=True)
    command = "tests/gpu/bench_h200.py --out $OUT --reps %d --info-reps %d --mib %d" % (
        opts.reps, opts.info_reps, opts.mib)
    keys = {}
    # 1. release detection: real_restart.sh with held-memory wait reps (it also installs the carried wheels)
    work = tempfile.mkdtemp(prefix="bench-h200-")
    env = dict(os.environ, RR_HELD_WAIT_REPS=str(opts.reps), PYTHONUNBUFFERED="1")
    log_path = os.path.join(opts.out, "restart.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([os.path.join(HERE, "real_restart.sh"), work, str(opts.mib)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if line.startswith("==="):
                print(line.rstrip(), flush=True)
        rc = proc.wait()
    report_path = os.path.join(work, "report.json")
    report = json.load(open(report_path)) if os.path.exists(report_path) else {}
    if os.path.exists(report_path):
        shutil.copy(report_path, os.path.join(opts.out, "restart-report.json"))
    skipped = []
    samples = release_samples(report, skipped)
    why = None if samples else "real_restart.sh rc %d: no held-memory wait run with every GPU seen going free" % rc
    keys["release_detect_ms_median_h200"] = bench.stats(
        samples, "ms", "RR_HELD_WAIT_REPS=%d tests/gpu/real_restart.sh DIR %d (%s)" % (opts.reps, opts.mib, command),
        why, digits=1)
    notes = []
    if samples and rc != 0:
        notes.append("real_restart.sh exited %d (see restart.log)" % rc)
    if skipped:
        notes.append("left out %s: the memory was free before the wait's first poll (wait_polls 1)" % ", ".join(skipped))
    if samples and notes:
        keys["release_detect_ms_median_h200"]["note"] = "; ".join(notes)
    # 2. the module process, per backend. After step 1, whose real_restart.sh installed the carried
    # ansible-core into /tmp/site (the module imports ansible.module_utils from there).
    sys.path.insert(0, HERE)
    site = os.environ.get("RR_SITE", "/tmp/site")
    if os.path.isdir(os.path.join(site, "ansible")):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    import real_gpu_check as rgc
    rgc.install_module_utils()
    walls = {"nvml": [], "nvidia-smi": []}
    errors = {}
    for i in range(opts.info_reps):
        for be in ("nvml", "nvidia-smi"):
            res = rgc.run_module_file("nvidia_gpu_info", {"backend": be, "detail": "full"})
            if res["_rc"] == 0 and not res.get("failed"):
                walls[be].append(res["_wall_ms"])
            else:
                errors[be] = (res.get("msg") or res.get("unparsed_stdout") or res["_stderr"])[-300:]
        print("info rep %d: nvml %s ms, nvidia-smi %s ms" % (i + 1, walls["nvml"][-1:], walls["nvidia-smi"][-1:]),
              flush=True)
    cmd_info = "python3 plugins/modules/nvidia_gpu_info.py ARGS.json (backend=%s; " + command + ")"
    keys["info_ms_nvml_h200"] = bench.stats(walls["nvml"], "ms", cmd_info % "nvml", errors.get("nvml"), digits=1)
    keys["info_ms_smi_h200"] = bench.stats(walls["nvidia-smi"], "ms", cmd_info % "nvidia-smi",
                                           errors.get("nvidia-smi"), digits=1)
    doc = {"command": command, "machine": device_info(), "keys": keys,
           "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(os.path.join(opts.out, "bench_h200.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps(keys, indent=1))
    return 0 if samples and walls["nvml"] and walls["nvidia-smi"] else 1


def merge(path, json_path=bench.JSON_PATH, md_path=bench.MD_PATH):
    """Add the device keys of ``path`` (a bench_h200.json) to docs/benchmarks.json and the Markdown. Raises
    ValueError naming the file when it is not a bench_h200.py result."""
    try:
        with open(path) as fh:
            res = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError("--merge %s: cannot read a JSON result (%s)" % (path, exc))
    keys = {k: v for k, v in (res.get("keys") or {}).items() if k in DEVICE_KEYS} if isinstance(res, dict) else {}
    if not keys:
        raise ValueError("--merge %s: no %s in it; pass the bench_h200.json that bench_h200.py --out wrote"
                         % (path, ", ".join(DEVICE_KEYS)))
    for k, e in keys.items():
        e.setdefault("command", res.get("command"))
        e.setdefault("machine", res.get("machine"))
        e.setdefault("measured", res.get("generated"))
    old = json.load(open(json_path)) if os.path.exists(json_path) else {}
    # keep the lab run's own command/machine at the top; the device keys carry theirs
    doc = bench.merge_doc(old, keys, old.get("command", "make bench"), old.get("machine", {}),
                          generated=old.get("generated"))
    bench.write_outputs(doc, json_path, md_path)
    return sorted(keys)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="result directory (on the GPU machine: $OUT)")
    ap.add_argument("--reps", type=int, default=5, help="held-memory wait reps (release detection)")
    ap.add_argument("--info-reps", type=int, default=10, help="module processes per backend")
    ap.add_argument("--mib", type=int, default=20480, help="MiB each stand-in TP worker holds on its GPU")
    ap.add_argument("--merge", metavar="RESULT.json", help="merge a result into docs/benchmarks.json (here)")
    opts = ap.parse_args(argv)
    if bool(opts.out) == bool(opts.merge):
        ap.error("give exactly one of --out DIR (measure, on the GPU machine) or --merge RESULT.json")
    if opts.merge:
        try:
            merged = merge(opts.merge)
        except ValueError as exc:
            ap.exit(2, "bench_h200.py: %s\n" % exc)
        print("merged %s into %s and %s" % (", ".join(merged), os.path.relpath(bench.JSON_PATH, ROOT),
                                            os.path.relpath(bench.MD_PATH, ROOT)))
        return 0
    if opts.reps < 1 or opts.info_reps < 1 or opts.mib < 1024:
        ap.error("--reps and --info-reps must be ≥ 1, --mib > 1024 (above the wait's limit)")
    return measure(opts)


if __name__ == "__main__":
    sys.exit(main())
