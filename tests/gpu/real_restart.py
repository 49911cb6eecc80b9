"""Helpers for tests/gpu/real_restart.sh (restart.yml on a machine with real NVIDIA GPUs).

Subcommands:
  poll OUT.jsonl [--period-ms 10]        independent NVML poller: one line {"t", "t_call", "t_end", "gpu", "used_mib",
                                         "procs"} per
                                         change of a GPU's used MiB (nvmlDeviceGetMemoryInfo v2, rounded up like
                                         nvidia-smi) or of its compute-process count
                                         (nvmlDeviceGetComputeRunningProcesses), until SIGTERM. Own process: it
                                         holds no CUDA context, only NVML.
  compare NVML.txt SMI.txt OUT.json      compare `ansible -o -m nvidia_gpu_info` output of backend=nvml and
                                         backend=nvidia-smi: UUIDs, MiB (used within 1, total, reserved), compute pids.
  report TIMES.jsonl POLL.jsonl OUT.json per run: per-phase wall times (s) from the gpufleet_task_times callback
                                         and, per GPU, release-detection latency (ms) = end of the nvidia_gpu_wait
                                         task − the moment the poller's NVML call returned the first reading at or
                                         under the limit after the stop began (t_end).
Exit status 1 when a comparison or a check fails.
"""
import json
import math
import os
import signal
import sys
import time

PHASES = [("preflight", None), ("stop", "sglang_stop"), ("wait", "gpu_memory_wait"),
          ("patch", "sglang_nccl_patch"), ("launch", "sglang_launch"), ("verify", "sglang_verify")]


def poll(out, period_s=0.010):
    """Poll NVML every ``period_s`` and append a line per change of used MiB per GPU (Unix time, s)."""
    import pynvml
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    last = [None] * len(handles)

    def procs(h):
        try:
            return len(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        except pynvml.NVMLError:
            return None

    n = 0
    with open(out, "a") as fh:
        while not stop:
            t = time.time()
            for i, h in enumerate(handles):
                t_gpu = time.time()
                used = int(math.ceil(pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used / 1048576.0))
                state = (used, procs(h))
                if state != last[i]:
                    # t: the sample's start; t_call/t_end: this GPU's NVML calls began/returned. At a release the
                    # memory call blocks (35-47 ms on H200, tests/gpu/release_trace.py) and returns the freed state:
                    # t_end is when the poller *saw* it.
                    fh.write(json.dumps({"t": t, "t_call": t_gpu, "t_end": time.time(), "gpu": i, "used_mib": used,
                                         "procs": state[1]}) + "\n")
                    fh.flush()
                    last[i] = state
            n += 1
            time.sleep(max(0.0, period_s - (time.time() - t)))
        fh.write(json.dumps({"t": time.time(), "samples": n, "period_ms": period_s * 1000}) + "\n")
    pynvml.nvmlShutdown()


def _ansible_result(path):
    """The JSON after 'HOST | STATUS =>' in `ansible` ad-hoc output (default callback, one host)."""
    with open(path) as fh:
        text = fh.read()
    try:
        return json.loads(text.split("=>", 1)[1])
    except (IndexError, ValueError):
        return {"failed": True, "msg": text[-2000:]}


def _compute_pids(gpu):
    return sorted(p["pid"] for p in gpu.get("processes", [])
                  if set(p.get("source") or []) & {"nvml", "nvidia-smi"})


def compare(nvml_path, smi_path, out):
    nv, sm = _ansible_result(nvml_path), _ansible_result(smi_path)
    if nv.get("failed") or sm.get("failed") or "gpus" not in nv or "gpus" not in sm:
        res = {"checks": {"both_backends_answered": False}, "msg": [nv.get("msg"), sm.get("msg")]}
        with open(out, "w") as fh:
            json.dump(res, fh, indent=1)
        print(json.dumps(res, indent=1))
        return False
    checks = {"backends": [nv.get("backend"), sm.get("backend")] == ["nvml", "nvidia-smi"],
              "same_gpu_count": len(nv["gpus"]) == len(sm["gpus"]) == nv["gpu_count"]}
    per_gpu = []
    for a, b in zip(nv["gpus"], sm["gpus"]):
        row = {"index": a["index"], "uuid": a["uuid"],
               "memory_used_mib": [a["memory_used_mib"], b["memory_used_mib"]],
               "memory_total_mib": [a["memory_total_mib"], b["memory_total_mib"]],
               "memory_reserved_mib": [a.get("memory_reserved_mib"), b.get("memory_reserved_mib")],
               "compute_pids": [_compute_pids(a), _compute_pids(b)],
               "process_mib": [[p.get("used_memory_mib") for p in a.get("processes", [])],
                               [p.get("used_memory_mib") for p in b.get("processes", [])]]}
        row["ok"] = (a["uuid"] == b["uuid"] and abs(a["memory_used_mib"] - b["memory_used_mib"]) <= 1
                     and a["memory_total_mib"] == b["memory_total_mib"]
                     and row["compute_pids"][0] == row["compute_pids"][1] and len(row["compute_pids"][0]) > 0)
        per_gpu.append(row)
    checks["all_gpus_agree_and_loaded"] = bool(per_gpu) and all(r["ok"] for r in per_gpu)
    res = {"checks": checks, "gpus": per_gpu, "driver_version": [nv.get("driver_version"), sm.get("driver_version")]}
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))
    return all(checks.values())


def _load_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(x) for x in fh if x.strip()]


def report(times_path, poll_path, out, limit_mib=1024):
    rows = _load_lines(times_path)
    samples = [s for s in _load_lines(poll_path) if "gpu" in s]
    meta = [s for s in _load_lines(poll_path) if "samples" in s]
    runs = {}
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    result = {"poller": meta[-1] if meta else None, "limit_mib": limit_mib, "runs": {}}
    ok = True
    for run, rs in sorted(runs.items()):
        phases = {}
        for name, role in PHASES:
            sel = [r for r in rs if (r["role"] == role if role else r["play"].startswith("Preflight"))
                   and r["start"] is not None]
            if sel:
                phases[name] = round(max(r["end"] for r in sel) - min(r["start"] for r in sel), 3)
        starts = [r["start"] for r in rs if r["start"] is not None]
        entry = {"phases_s": phases, "total_s": round(max(r["end"] for r in rs) - min(starts), 3),
                 "failed_tasks": [r["task"] for r in rs if r["status"] == "failed"]}
        stop = [r for r in rs if r["action"].endswith("sglang_stop") and r["role"] == "sglang_stop"]
        wait = [r for r in rs if r["action"].endswith("nvidia_gpu_wait")]
        if wait:
            # Reference: the stop's start (full runs), else the wait's start (--tags wait runs).
            w = wait[0]
            t_wait_start, t_wait = w.get("runner_start") or w["start"], w["end"]
            t_ref = stop[0]["start"] if stop else t_wait_start
            entry["wait_elapsed_ms"] = w.get("elapsed_ms")
            entry["wait_polls"] = w.get("polls")
            entry["wait_task_s"] = round(t_wait - t_wait_start, 3)
            if stop:
                entry["stop_task_s"] = round(stop[0]["end"] - stop[0]["start"], 3)
                entry["stop_end_to_wait_end_ms"] = round((t_wait - stop[0]["end"]) * 1000, 1)
            per_gpu = {}
            for gpu in sorted({s["gpu"] for s in samples}):
                seq = [s for s in samples if s["gpu"] == gpu]
                before = [s for s in seq if s["t"] <= t_ref]
                g = {"used_mib_before": before[-1]["used_mib"] if before else None}
                freed = next((s for s in seq if s["t"] > t_ref and s["used_mib"] <= limit_mib), None)
                if freed and g["used_mib_before"] is not None and g["used_mib_before"] > limit_mib:
                    # The poller saw it free when its NVML call returned (t_end; older poll files: the sample's
                    # start t). The call that returns the freed state blocks while the driver tears the killed
                    # context down; its start is not a moment anyone could have known.
                    seen_free = freed.get("t_end", freed["t"])
                    g["poller_free_call_ms"] = round((seen_free - freed.get("t_call", freed["t"])) * 1000, 1)
                    g["free_seen_ms_after_wait_task_start"] = round((seen_free - t_wait_start) * 1000, 1)
                    g["wait_task_end_minus_free_seen_ms"] = round((t_wait - seen_free) * 1000, 1)
                    # Split (inventory/local: the module's clock is the controller's): the poll that saw the
                    # memory free (started_at + elapsed_ms) minus the poller's sample, and the module's exit plus
                    # the result's trip to the callback.
                    if w.get("started_at") is not None and w.get("elapsed_ms") is not None:
                        seen = float(w["started_at"]) + w["elapsed_ms"] / 1000.0
                        g["module_seen_minus_free_seen_ms"] = round((seen - seen_free) * 1000, 1)
                        g["wait_task_end_minus_module_seen_ms"] = round((t_wait - seen) * 1000, 1)
                    # The wait's full condition (require_no_processes): memory free and no compute process.
                    gone = next((s for s in seq if s["t"] > t_ref and s["used_mib"] <= limit_mib
                                 and s.get("procs") == 0), None)
                    if gone:
                        gone_t = gone.get("t_end", gone["t"])
                        g["free_and_no_process_seen_ms_after_free_seen"] = round((gone_t - seen_free) * 1000, 1)
                        g["wait_task_end_minus_free_and_no_process_seen_ms"] = round((t_wait - gone_t) * 1000, 1)
                    if stop:
                        g["free_seen_s_after_stop_start"] = round(seen_free - stop[0]["start"], 3)
                        g["free_seen_ms_after_stop_task_end"] = round((seen_free - stop[0]["end"]) * 1000, 1)
                per_gpu[str(gpu)] = g
            entry["release_per_gpu"] = per_gpu
        result["runs"][run] = entry
        ok = ok and not entry["failed_tasks"]
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))
    return ok


def main(argv):
    cmd = argv[0]
    if cmd == "poll":
        period = float(argv[argv.index("--period-ms") + 1]) / 1000 if "--period-ms" in argv else 0.010
        poll(argv[1], period)
        return 0
    if cmd == "compare":
        return 0 if compare(*argv[1:4]) else 1
    if cmd == "report":
        return 0 if report(*argv[1:4]) else 1
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
