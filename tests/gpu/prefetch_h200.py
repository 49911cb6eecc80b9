"""Helpers for tests/gpu/prefetch_h200.sh (issue 35: restart.yml's downtime with the weight prefetch vs without, on
the lent GPU machine, with the lab stand-in loading a real safetensors checkpoint onto the GPU).

Subcommands (each prints one line for the log and, where it says so, writes JSON):
  runtime OUT.json                  kernel, Python, torch (CUDA, the GPU's name), safetensors, fincore; memory
  mem NEED_GIB OUT.json [--grow]    the prefetch's memory bound now (MemFree - watermarks - the role's default
                                    reserve, gpufleet_prefetch.memory_bound) against NEED_GIB; --grow: when short,
                                    touch the missing anonymous memory once and free it (a VM whose RAM is
                                    hot-plugged as it is used shows little MemTotal at first), then measure again
  write MODEL_DIR GIB OUT.json      a GIB GiB checkpoint (tests/lab/weights.py) in shards of --shard-gib, --jobs
                                    processes writing at once; seconds and GiB/s
  dontneed-check MODEL_DIR OUT.json does DONTNEED empty the page cache here? The first shard evicted, read whole
                                    (timed: the disk's cold sequential read), measured, evicted, measured; exit 1
                                    when the read left < 90 % resident or the evict > 1 %
  cold MODEL_DIR OUT.json           evict the model dir's files and measure what is left (exit 1 above 1 %)
  sample SAMPLES.jsonl ...          one restart's record: its summary row (the run's set_stats, written by
                                    tests/gpu/callback_plugins), the stand-in's start-to-ready (its log) and
                                    /get_server_info (weights_load_s, ...)
  report OUT_DIR                    OUT_DIR/prefetch_h200.json and a short text summary from the files above

Residency: util-linux fincore where installed, else mincore through mmap (plugins/module_utils/gpufleet_prefetch.py
FileMap, the module's own measure); the JSON says which ("method").
"""
import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "lab"))
sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
sys.path.insert(0, os.path.join(ROOT, "plugins", "module_utils"))
import bench  # noqa: E402  (parse_standin_log, stats)
import gpufleet_prefetch  # noqa: E402
import weights  # noqa: E402

GIB = 1 << 30
# A cold run counts only when at most this share of the checkpoint was resident as it began (bench.py's limit).
COLD_MAX_PCT = 1.0
# The dontneed check: a whole read leaves at least this share resident, and DONTNEED at most COLD_MAX_PCT.
READ_MIN_PCT = 90.0
READ_CHUNK = 16 << 20
RESERVE_MIB = 4096  # roles/sglang_prefetch/defaults/main.yml sglang_prefetch_reserve_mib
RATIO_KEY = "downtime_with_prefetch_vs_cold_ratio_h200"


def write_json(path, obj):
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.write("\n")


def read_json(path, default=None):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def gib(nbytes):
    return round(nbytes / float(GIB), 3) if nbytes is not None else None


def pct(part, total):
    return round(100.0 * part / total, 2) if total else 0.0


# --- residency -------------------------------------------------------------------------------------------------
def _mincore_residency(files):
    got = {}
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            with gpufleet_prefetch.FileMap(fd, size) as fmap:
                got[f] = (fmap.resident(), size)
        finally:
            os.close(fd)
    return got


def residency(paths):
    """``(method, {file: (resident bytes, size)})`` for every file under ``paths``: fincore where installed, else
    mincore (this runs as root, so mincore sees the page cache of any file)."""
    files = [f for p in paths for f in weights.model_files(p)]
    try:
        return "fincore", weights.residency(paths)
    except weights.WeightsError as exc:
        if "not installed" not in str(exc):
            raise
    return "mincore", _mincore_residency(files)


def resident_summary(paths):
    method, got = residency(paths)
    res, size = sum(r for r, _ in got.values()), sum(s for _, s in got.values())
    return {"method": method, "resident_bytes": res, "total_bytes": size, "resident_pct": pct(res, size),
            "files": len(got)}


# --- runtime, memory -------------------------------------------------------------------------------------------
def _version(module):
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "?")
    except ImportError as exc:
        return "missing (%s)" % exc


def _fincore_version():
    try:
        out = subprocess.run(["fincore", "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip()
    except (OSError, subprocess.SubprocessError):
        return None


def runtime():
    info = {"kernel": platform.release(), "machine": platform.machine(), "python": platform.python_version(),
            "python_exe": sys.executable, "cpus": os.cpu_count(), "torch": _version("torch"),
            "safetensors": _version("safetensors"), "fincore": _fincore_version(), "gpus": []}
    try:
        import torch
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    info["memory"] = memory()
    return info


def memory():
    with open("/proc/meminfo") as fh:
        meminfo = fh.read()
    with open("/proc/zoneinfo") as fh:
        zoneinfo = fh.read()
    m = gpufleet_prefetch.parse_meminfo(meminfo)
    bound = gpufleet_prefetch.memory_bound(meminfo, zoneinfo, RESERVE_MIB << 20)
    return {"mem_total_gib": gib(m.get("MemTotal")), "mem_free_gib": gib(m.get("MemFree")),
            "mem_available_gib": gib(m.get("MemAvailable")), "cached_gib": gib(m.get("Cached")),
            "watermarks_gib": gib(bound["watermark_bytes"]), "reserve_gib": gib(bound["reserve_bytes"]),
            "prefetch_headroom_gib": gib(bound["headroom_bytes"])}


def touch_anonymous(nbytes):
    """Write one byte per page of ``nbytes`` of anonymous memory, then free it: the kernel must back every page."""
    m = mmap.mmap(-1, nbytes)
    try:
        block = b"\1" * (64 << 20)
        done = 0
        while done < nbytes:
            n = min(len(block), nbytes - done)
            m.write(block[:n])
            done += n
    finally:
        m.close()


def mem_check(need_gib, grow):
    before = memory()
    out = {"need_gib": need_gib, "before": before, "grown_gib": 0}
    short = need_gib - before["prefetch_headroom_gib"]
    if short > 0 and grow:
        # one round: touching asks the VM for memory; what it gives shows in the second reading
        want = short + 2.0
        t0 = time.monotonic()
        touch_anonymous(int(want * GIB))
        out.update(grown_gib=round(want, 1), grow_s=round(time.monotonic() - t0, 1))
    out["after"] = memory() if out["grown_gib"] else before
    out["enough"] = out["after"]["prefetch_headroom_gib"] >= need_gib
    return out


# --- the checkpoint --------------------------------------------------------------------------------------------
def disk_short(model_dir, size_gib):
    """A message when the filesystem of ``model_dir`` cannot take a ``size_gib`` checkpoint and 2 GiB more (what
    the dir's shards hold now counts as free: they are rewritten), else None."""
    st = os.statvfs(model_dir)
    free = st.f_bavail * st.f_frsize + sum(os.path.getsize(f) for f in weights.weight_files(model_dir))
    if free < (size_gib + 2) * GIB:
        return ("%s has %.1f GiB free for a %s GiB checkpoint (and 2 GiB to spare): give a smaller GIB or PF_MODELS on "
                "a larger filesystem" % (model_dir, free / float(GIB), size_gib))
    return None


def write(model_dir, size_gib, shard_gib, jobs):
    shards = max(1, int(-(-size_gib // shard_gib)))
    os.makedirs(model_dir, exist_ok=True)
    jobs = max(1, min(jobs, shards))
    got = weights.write_checkpoint(model_dir, int(round(size_gib * 1024)), shards=shards, jobs=jobs)
    return {"model_dir": model_dir, "size_gib": size_gib, "shards": shards, "jobs": jobs, "changed": got["changed"],
            "file_bytes": got["file_bytes"], "seconds": got["seconds"],
            "write_gib_s": round(got["file_bytes"] / float(GIB) / got["seconds"], 2) if got["changed"] else None}


def _read_whole(path):
    """Read ``path`` sequentially with plain read(2); seconds."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    t0 = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [view]) > 0:
            pass
    finally:
        os.close(fd)
    return time.monotonic() - t0


def dontneed_check(model_dir):
    shard = weights.weight_files(model_dir)[0]
    weights.evict([shard])
    start = resident_summary([shard])
    seconds = _read_whole(shard)
    after_read = resident_summary([shard])
    weights.evict([shard])
    after_evict = resident_summary([shard])
    size = after_read["total_bytes"]
    ok = after_read["resident_pct"] >= READ_MIN_PCT and after_evict["resident_pct"] <= COLD_MAX_PCT
    return {"file": shard, "size_gib": gib(size), "method": after_read["method"],
            "resident_pct_before": start["resident_pct"], "read_s": round(seconds, 3),
            "cold_seq_read_gib_s": round(size / float(GIB) / seconds, 2) if seconds else None,
            "resident_pct_after_read": after_read["resident_pct"],
            "resident_pct_after_dontneed": after_evict["resident_pct"], "ok": ok}


def cold(model_dir):
    weights.evict([model_dir])
    got = resident_summary([model_dir])
    got["cold"] = got["resident_pct"] <= COLD_MAX_PCT
    return got


# --- one restart -----------------------------------------------------------------------------------------------
def summary_row(stats_path, run, host="localhost"):
    """The summary row of ``run`` from the JSON lines the callback wrote (its set_stats ``gpufleet_restart``)."""
    row = None
    try:
        with open(stats_path) as fh:
            for line in fh:
                rec = json.loads(line)
                if rec.get("run") == run:
                    custom = rec.get("custom_stats") or {}
                    rows = (custom.get("_run") or {}).get("gpufleet_restart") or {}
                    row = rows.get(host, row)
    except (OSError, ValueError):
        pass
    return row


def server_info(port, host="127.0.0.1"):
    try:
        with urllib.request.urlopen("http://%s:%s/get_server_info" % (host, port), timeout=10) as r:
            return json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def sample(args):
    row = summary_row(args.stats, args.run) or {}
    try:
        with open(args.log) as fh:
            starts = bench.parse_standin_log(fh.read(), after=args.after)
    except OSError:
        starts = []
    info = server_info(args.port)
    before = read_json(args.cold_json, {}) if args.cold_json else {}
    rec = {"run": args.run, "mode": args.mode, "pair": args.pair, "rc": args.rc, "result": row.get("result"),
           "downtime_s": row.get("downtime_s"), "prefetch_s": row.get("prefetch_s"),
           "prefetch_gib": row.get("prefetch_gib"), "resident_pct": row.get("resident_pct"),
           "start_to_ready_s": round(starts[-1]["start_to_ready_s"], 3) if starts and
           starts[-1]["start_to_ready_s"] is not None else None,
           "weights_load_s": info.get("weights_load_s"), "weights_bytes": info.get("weights_bytes"),
           "weights_reader": info.get("weights_reader"),
           "weights_resident_before_pct": info.get("weights_resident_before_pct"),
           "weights_device_init_s": info.get("weights_device_init_s"),
           "weights_file_maps": info.get("weights_file_maps"),
           "resident_pct_after_evict": before.get("resident_pct"), "wall_s": args.wall}
    with open(args.samples, "a") as fh:
        fh.write(json.dumps(rec, sort_keys=True) + "\n")
    return rec


def _problem(rec):
    """Why a sample does not count, or None."""
    if rec.get("rc") != 0 or rec.get("result") != "ok":
        return "restart.yml rc %s, result %s" % (rec.get("rc"), rec.get("result"))
    if rec.get("downtime_s") is None:
        return "no downtime_s in the summary row"
    if rec["mode"] == "cold":
        left = rec.get("resident_pct_after_evict")
        began = rec.get("weights_resident_before_pct")
        if left is None or left > COLD_MAX_PCT or (began is not None and began > COLD_MAX_PCT):
            return "not cold: %s %% resident after the evict, %s %% as the stand-in began" % (left, began)
    if rec.get("weights_file_maps"):
        return "the server kept %s mapping(s) of the shards (the evict cannot empty them)" % rec["weights_file_maps"]
    return None


def _median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(num, den):
    return round(num / den, 3) if num is not None and den else None


def report(out_dir):
    samples = []
    try:
        with open(os.path.join(out_dir, "samples.jsonl")) as fh:
            samples = [json.loads(line) for line in fh if line.strip()]
    except OSError:
        pass
    runtime_info = read_json(os.path.join(out_dir, "runtime.json"), {})
    checkpoint = read_json(os.path.join(out_dir, "write.json"), {})
    check = read_json(os.path.join(out_dir, "dontneed.json"), {})
    mem = read_json(os.path.join(out_dir, "mem.json"), {})
    left_out, good = [], {"cold": [], "prefetched": []}
    for rec in samples:
        if rec["mode"] not in good:
            continue
        why = _problem(rec)
        if why:
            left_out.append("pair %s %s: %s" % (rec.get("pair"), rec["mode"], why))
        else:
            good[rec["mode"]].append(rec)
    cold_runs, pref_runs = good["cold"], good["prefetched"]

    def med(rows, key):
        return _median([r.get(key) for r in rows])

    def pair_ratios(key):
        by_pair = {}
        for rec in cold_runs + pref_runs:
            by_pair.setdefault(rec["pair"], {})[rec["mode"]] = rec.get(key)
        return [_ratio(p.get("prefetched"), p.get("cold")) for _, p in sorted(by_pair.items())
                if p.get("prefetched") is not None and p.get("cold")]

    size_gib = gib(med(cold_runs + pref_runs, "weights_bytes"))
    cold_load = [r["weights_load_s"] for r in cold_runs if r.get("weights_load_s")]
    speeds = [round(size_gib / s, 2) for s in cold_load] if size_gib else []
    gpus = runtime_info.get("gpus") or []
    result = {
        RATIO_KEY: _ratio(med(pref_runs, "downtime_s"), med(cold_runs, "downtime_s")),
        "downtime_ratio_pairs": pair_ratios("downtime_s"),
        "downtime_cold_s": {"median": med(cold_runs, "downtime_s"), "samples": [r["downtime_s"] for r in cold_runs]},
        "downtime_prefetched_s": {"median": med(pref_runs, "downtime_s"),
                                  "samples": [r["downtime_s"] for r in pref_runs]},
        "weights_load_ratio": _ratio(med(pref_runs, "weights_load_s"), med(cold_runs, "weights_load_s")),
        "weights_load_cold_s": {"median": med(cold_runs, "weights_load_s"), "samples": cold_load},
        "weights_load_prefetched_s": {"median": med(pref_runs, "weights_load_s"),
                                      "samples": [r.get("weights_load_s") for r in pref_runs]},
        "start_to_ready_ratio": _ratio(med(pref_runs, "start_to_ready_s"), med(cold_runs, "start_to_ready_s")),
        "start_to_ready_cold_s": [r.get("start_to_ready_s") for r in cold_runs],
        "start_to_ready_prefetched_s": [r.get("start_to_ready_s") for r in pref_runs],
        "cold_read_gib_s": {"median": _median(speeds), "samples": speeds,
                            "what": "checkpoint GiB / the stand-in's weights_load_s in the cold runs (read + copy "
                                    "to the device)"},
        "cold_seq_read_gib_s": check.get("cold_seq_read_gib_s"),
        "prefetch_s": [r.get("prefetch_s") for r in pref_runs],
        "prefetch_gib": [r.get("prefetch_gib") for r in pref_runs],
        "resident_pct_at_stop": [r.get("resident_pct") for r in pref_runs],
        "checkpoint_gib": size_gib, "checkpoint": checkpoint, "dontneed_check": check, "memory": mem,
        "runtime": runtime_info, "card": gpus[0] if gpus else "no GPU (dry run)",
        "counted": {"cold": len(cold_runs), "prefetched": len(pref_runs)}, "left_out": left_out,
        "samples": samples,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(os.path.join(out_dir, "prefetch_h200.json"), result)
    return result


def summary_text(res):
    def fmt(v, unit=""):
        return "-" if v is None else ("%.3g%s" % (v, unit))
    lines = [
        "card: %s; kernel %s; torch %s; safetensors %s; residency by %s" % (
            res["card"], res["runtime"].get("kernel"), res["runtime"].get("torch"), res["runtime"].get("safetensors"),
            res["dontneed_check"].get("method")),
        "checkpoint: %s GiB in %s shards, written in %s s (%s GiB/s)" % (
            res["checkpoint_gib"], res["checkpoint"].get("shards"), res["checkpoint"].get("seconds"),
            res["checkpoint"].get("write_gib_s")),
        "DONTNEED check: %s %% resident after a whole read, %s %% after DONTNEED (%s); cold sequential read %s GiB/s"
        % (res["dontneed_check"].get("resident_pct_after_read"), res["dontneed_check"].get("resident_pct_after_dontneed"),
           "ok" if res["dontneed_check"].get("ok") else "NOT OK", res["cold_seq_read_gib_s"]),
        "downtime_s cold %s (median %s), prefetched %s (median %s)" % (
            res["downtime_cold_s"]["samples"], fmt(res["downtime_cold_s"]["median"]),
            res["downtime_prefetched_s"]["samples"], fmt(res["downtime_prefetched_s"]["median"])),
        "%s = %s (pairs %s)" % (RATIO_KEY, fmt(res[RATIO_KEY]), res["downtime_ratio_pairs"]),
        "read part: weights_load_s cold %s, prefetched %s; ratio %s; cold read %s GiB/s (read + copy)" % (
            res["weights_load_cold_s"]["samples"], res["weights_load_prefetched_s"]["samples"],
            fmt(res["weights_load_ratio"]), fmt(res["cold_read_gib_s"]["median"])),
        "start-to-ready cold %s, prefetched %s; ratio %s" % (
            res["start_to_ready_cold_s"], res["start_to_ready_prefetched_s"], fmt(res["start_to_ready_ratio"])),
        "prefetch: %s s, %s GiB, resident at the stop %s %%" % (
            res["prefetch_s"], res["prefetch_gib"], res["resident_pct_at_stop"]),
        "counted: %d cold, %d prefetched%s" % (res["counted"]["cold"], res["counted"]["prefetched"],
                                               "; left out: " + "; ".join(res["left_out"]) if res["left_out"] else ""),
    ]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("runtime")
    p.add_argument("out")
    p = sub.add_parser("mem")
    p.add_argument("need_gib", type=float)
    p.add_argument("out")
    p.add_argument("--grow", action="store_true")
    p = sub.add_parser("write")
    p.add_argument("model_dir")
    p.add_argument("gib", type=float)
    p.add_argument("out")
    p.add_argument("--shard-gib", type=float, default=4.0)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p = sub.add_parser("dontneed-check")
    p.add_argument("model_dir")
    p.add_argument("out")
    p = sub.add_parser("cold")
    p.add_argument("model_dir")
    p.add_argument("out")
    p = sub.add_parser("sample")
    p.add_argument("samples")
    for name in ("--run", "--mode", "--stats", "--log"):
        p.add_argument(name, required=True)
    p.add_argument("--pair", type=int, default=0)
    p.add_argument("--after", type=float, required=True)
    p.add_argument("--wall", type=float)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--cold-json")
    p = sub.add_parser("report")
    p.add_argument("out_dir")
    args = ap.parse_args(argv)

    if args.cmd == "runtime":
        info = runtime()
        write_json(args.out, info)
        print("runtime: kernel %s, python %s, torch %s (CUDA %s), safetensors %s, fincore %s, GPUs %s; memory %s" % (
            info["kernel"], info["python"], info["torch"], info.get("torch_cuda"), info["safetensors"],
            info["fincore"] or "not installed (mincore instead)", info["gpus"] or "none", info["memory"]))
        return 0
    if args.cmd == "mem":
        got = mem_check(args.need_gib, args.grow)
        write_json(args.out, got)
        print("memory: prefetch headroom %s GiB (need %s)%s; %s" % (
            got["after"]["prefetch_headroom_gib"], args.need_gib,
            ", after touching %s GiB in %s s (headroom before: %s GiB)" % (
                got["grown_gib"], got.get("grow_s"), got["before"]["prefetch_headroom_gib"]) if got["grown_gib"] else "",
            "enough" if got["enough"] else "SHORT: the prefetch will stop at its memory bound and say so"))
        return 0
    if args.cmd == "write":
        os.makedirs(args.model_dir, exist_ok=True)
        short = disk_short(args.model_dir, args.gib)
        if short:
            print("checkpoint: not written: " + short)
            return 1
        got = write(args.model_dir, args.gib, args.shard_gib, args.jobs)
        write_json(args.out, got)
        print("checkpoint: %.2f GiB in %d shards, %s in %s s (%s GiB/s, %d writing process(es))" % (
            got["file_bytes"] / float(GIB), got["shards"], "written" if got["changed"] else "kept", got["seconds"],
            got["write_gib_s"], got["jobs"]))
        return 0
    if args.cmd == "dontneed-check":
        got = dontneed_check(args.model_dir)
        write_json(args.out, got)
        print("DONTNEED check (%s, %s): %s GiB read in %s s (%s GiB/s cold); resident %s %% before, %s %% after the "
              "read, %s %% after DONTNEED: %s" % (
                  got["method"], os.path.basename(got["file"]), got["size_gib"], got["read_s"],
                  got["cold_seq_read_gib_s"], got["resident_pct_before"], got["resident_pct_after_read"],
                  got["resident_pct_after_dontneed"], "ok" if got["ok"] else "NOT OK: the page cache here cannot be "
                  "emptied per file, so a cold run cannot be told from a warm one"))
        return 0 if got["ok"] else 1
    if args.cmd == "cold":
        got = cold(args.model_dir)
        write_json(args.out, got)
        print("evicted: %s of %s GiB still resident (%s %%, %s)%s" % (
            gib(got["resident_bytes"]), gib(got["total_bytes"]), got["resident_pct"], got["method"],
            "" if got["cold"] else ": NOT cold"))
        return 0 if got["cold"] else 1
    if args.cmd == "sample":
        rec = sample(args)
        print("sample %s (%s): rc %s, %s, downtime %s s, prefetch %s s / %s GiB / %s %%, start-to-ready %s s, "
              "weights read in %s s (%s; %s %% resident as it began, %s shard mapping(s) kept)" % (
                  rec["run"], rec["mode"], rec["rc"], rec["result"], rec["downtime_s"], rec["prefetch_s"],
                  rec["prefetch_gib"], rec["resident_pct"], rec["start_to_ready_s"], rec["weights_load_s"],
                  rec["weights_reader"], rec["weights_resident_before_pct"], rec["weights_file_maps"]))
        return 0
    res = report(args.out_dir)
    print(summary_text(res))
    return 0 if res[RATIO_KEY] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
