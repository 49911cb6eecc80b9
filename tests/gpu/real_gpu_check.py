#!/usr/bin/env python3
"""Real-GPU proof for nvidia_gpu_info / nvidia_gpu_wait (run on a machine with NVIDIA GPUs, torch, pynvml,
psutil and ansible-core importable).

What it does, writing everything to ``--out`` (results.json, log.txt):

1. Costs: nvmlInit, one NVML v2 memory query, one ``nvidia-smi --query-gpu`` memory call.
2. Agreement idle and loaded: the NVML and nvidia-smi backends give the same UUIDs, memory within 1 MiB,
   the same compute pids; raw NVML bytes beside nvidia-smi MiB (which rounding nvidia-smi uses).
3. Workers: one process per GPU (forkserver with torch preloaded, like SGLang's spawned TP workers) holding
   ``--gib`` GiB each; the fd links they hold; what a bare CUDA context costs, and that
   ``require_no_processes`` refuses a GPU whose only user keeps a bare context (under the MiB limit).
4. The modules run as Ansible runs them (``python3 plugins/modules/<module>.py args.json``): nvidia_gpu_info with
   both backends, nvidia_gpu_wait timing out while workers hold memory (message must name pid + cmdline).
5. Release latency, ``--reps`` times per backend: start the module's wait logic (in-process, its
   ``run_wait``), SIGKILL the workers, and compare when the wait returned with when an independent
   NVML poller (own process, 10 ms period) first saw every GPU at or under the limit.
   Also ``--module-reps`` times with the module file as a subprocess (time = its exit).

   ``--role-interval-reps`` more in-process reps at 100 ms, the roles/gpu_memory_wait default.
6. ``checks`` in results.json: each claim above as a boolean.

Usage (device): ``python3 tests/gpu/real_gpu_check.py --out $OUT --reps 10 --module-reps 4 --gib 20``.
"""
import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
LOG = []


def log(*args):
    line = " ".join(str(a) for a in args)
    LOG.append(line)
    print(line, flush=True)


def install_module_utils():
    """Make plugins/module_utils importable as ansible_collections.gpufleet.fleet.plugins.module_utils.* for
    this process and children (the repository resolves itself as the collection through collections/)."""
    base = os.path.join(ROOT, "collections")
    if base not in sys.path:
        sys.path.insert(0, base)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (base, os.environ.get("PYTHONPATH")) if p)


def load_module_file(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "plugins", "modules", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------------
# processes: workers (forkserver, torch preloaded) and the independent poller (spawn, pynvml only)

def worker(gpu, gib, ready_q):
    import torch
    torch.cuda.set_device(gpu)
    x = torch.empty(int(gib * (1 << 30)) if gib else 1, dtype=torch.uint8, device="cuda")
    if gib:
        x.fill_(1)
    torch.cuda.synchronize()
    ready_q.put((gpu, os.getpid()))
    while True:
        time.sleep(3600)


def poller(conn, indices, limit_mib, period_s):
    import pynvml as n
    n.nvmlInit()
    handles = [n.nvmlDeviceGetHandleByIndex(i) for i in indices]
    conn.send("up")
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        deadline = time.monotonic() + msg
        seen = None
        while time.monotonic() < deadline:
            t = time.monotonic()
            used = [n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used for h in handles]
            if all(u <= limit_mib * MIB for u in used):
                seen = t
                break
            time.sleep(period_s)
        conn.send(seen)
    n.nvmlShutdown()


class Workers:
    def __init__(self, ctx):
        self.ctx = ctx
        self.procs = []

    def start(self, gpus, gib):
        q = self.ctx.Queue()
        self.procs = [self.ctx.Process(target=worker, args=(g, gib, q)) for g in gpus]
        for p in self.procs:
            p.start()
        got = {}
        for _ in gpus:
            g, pid = q.get(timeout=120)
            got[g] = pid
        return got

    def kill(self):
        t = time.monotonic()
        for p in self.procs:
            os.kill(p.pid, signal.SIGKILL)
        return t

    def reap(self):
        for p in self.procs:
            p.join(timeout=10)
        self.procs = []


# ------------------------------------------------------------------------------------------------------

def pct(values, q):
    s = sorted(values)
    if not s:
        return None
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


def summary(values):
    if not values:
        return None
    return {"n": len(values), "median": round(statistics.median(values), 1), "p95": round(pct(values, 95), 1),
            "min": round(min(values), 1), "max": round(max(values), 1)}


def run_module_file(name, args, timeout=120):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"ANSIBLE_MODULE_ARGS": args}, fh)
        path = fh.name
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "plugins", "modules", name + ".py"), path],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    t1 = time.monotonic()
    os.unlink(path)
    try:
        out = json.loads(proc.stdout.decode())
    except ValueError:
        out = {"unparsed_stdout": proc.stdout.decode(errors="replace")[-3000:]}
    out["_stderr"] = proc.stderr.decode(errors="replace")[-2000:]
    out["_rc"] = proc.returncode
    out["_wall_ms"] = round((t1 - t0) * 1000, 1)
    return out


def compare(nv, sm, label, res):
    """Compare two details() lists; record and log mismatches (ok: within 1 MiB; exact: identical MiB)."""
    ok = True
    exact = len(nv) == len(sm)
    rows = []
    for a, b in zip(nv, sm):
        row = {"index": a["index"], "uuid_equal": a["uuid"] == b["uuid"]}
        for key in ("memory_used_mib", "memory_total_mib", "memory_reserved_mib"):
            row[key] = (a[key], b[key])
            if a[key] is None or b[key] is None or abs(a[key] - b[key]) > 1:
                ok = False
            if a[key] != b[key]:
                exact = False
        ok = ok and row["uuid_equal"]
        for key in ("name", "pci_bus_id", "persistence_mode", "compute_mode", "power_limit_w",
                    "ecc_errors_corrected_volatile_total", "remapped_rows_pending", "minor_number"):
            row[key] = (a.get(key), b.get(key))
        rows.append(row)
    res["agreement_" + label] = {"ok": ok and len(nv) == len(sm), "exact": exact, "rows": rows}
    log("agreement", label, "ok" if ok else "MISMATCH", json.dumps(rows))
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--module-reps", type=int, default=4)
    ap.add_argument("--gib", type=float, default=20)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--poll-interval-ms", type=int, default=50)
    ap.add_argument("--role-interval-reps", type=int, default=0,
                    help="extra in-process reps per backend at 100 ms (roles/gpu_memory_wait default)")
    opts = ap.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    t_start = time.monotonic()
    res = {"argv": sys.argv, "python": sys.version}

    install_module_utils()
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_procs as P
    import pynvml as n
    wait_mod = load_module_file("nvidia_gpu_wait")
    smi = shutil.which("nvidia-smi")

    try:
        res["nvidia_smi_L"] = subprocess.run([smi, "-L"], stdout=subprocess.PIPE).stdout.decode()
        # -- costs
        t = time.perf_counter(); n.nvmlInit(); res["nvml_init_ms"] = round((time.perf_counter() - t) * 1000, 2)
        h0 = n.nvmlDeviceGetHandleByIndex(0)
        t = time.perf_counter()
        for _ in range(1000):
            n.nvmlDeviceGetMemoryInfo(h0, version=n.nvmlMemory_v2)
        res["nvml_memory_query_us"] = round((time.perf_counter() - t) * 1000, 2)
        n.nvmlShutdown()
        sb = G.SmiBackend(G.subprocess_runner, smi).open()
        times = []
        for _ in range(20):
            t = time.perf_counter(); sb.memory(); times.append((time.perf_counter() - t) * 1000)
        res["smi_memory_call_ms"] = summary(times)
        log("costs: nvmlInit %s ms, NVML v2 memory query %s us, nvidia-smi memory call %s ms"
            % (res["nvml_init_ms"], res["nvml_memory_query_us"], res["smi_memory_call_ms"]))

        nb, _ = G.open_backend("nvml")
        indices = [g["index"] for g in nb.inventory()]
        res["gpu_count"] = len(indices)

        def raw_bytes():
            rows = []
            for i in indices:
                m = n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(i), version=n.nvmlMemory_v2)
                rows.append({"index": i, "used_b": m.used, "reserved_b": m.reserved, "free_b": m.free,
                             "total_b": m.total})
            q = G.subprocess_runner([smi, "--query-gpu=index,memory.used,memory.reserved,memory.free,memory.total",
                                     "--format=csv,noheader,nounits"])[1]
            return {"nvml_v2_bytes": rows, "smi_mib": q}

        # -- idle agreement
        res["idle_raw"] = raw_bytes()
        compare(nb.details(), sb.details(), "idle", res)

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])
        ws = Workers(ctx)

        # -- a bare CUDA context: what does "free" look like with a process still alive?
        pids = ws.start(indices, 0)
        time.sleep(0.5)
        res["context_only"] = {"nvml": nb.memory(), "smi": sb.memory(), "pids": pids}
        log("context only:", json.dumps(res["context_only"]))
        # a live CUDA context passes the memory limit; require_no_processes must still refuse it
        res["context_only_wait_memory"] = run_module_file("nvidia_gpu_wait", {"timeout_s": 0})
        res["context_only_wait_noproc"] = run_module_file("nvidia_gpu_wait", {"timeout_s": 0.5,
                                                                              "require_no_processes": True})
        log("context only: wait(memory) failed=%s; wait(require_no_processes) failed=%s msg=%s" % (
            res["context_only_wait_memory"].get("failed", False), res["context_only_wait_noproc"].get("failed"),
            res["context_only_wait_noproc"].get("msg")))
        ws.kill(); ws.reap()

        # -- loaded
        pids = ws.start(indices, opts.gib)
        time.sleep(0.5)
        res["worker_pids"] = pids
        res["loaded_raw"] = raw_bytes()
        compare(nb.details(), sb.details(), "loaded", res)
        np_ = sorted((p["gpu_index"], p["pid"]) for p in nb.compute_processes())
        sp_ = sorted((p["gpu_index"], p["pid"]) for p in sb.compute_processes())
        res["compute_pids"] = {"nvml": np_, "smi": sp_, "equal": np_ == sp_,
                               "smi_detail": sb.compute_processes(), "nvml_detail": nb.compute_processes()}
        log("compute pids equal:", np_ == sp_, np_, sp_)
        res["smi_compute_apps_loaded"] = G.subprocess_runner(
            [smi, "--query-compute-apps=pid,used_memory,gpu_uuid,gpu_bus_id,process_name",
             "--format=csv,noheader,nounits"])[1]
        res["smi_compute_apps_loaded_with_header"] = G.subprocess_runner(
            [smi, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid,gpu_bus_id", "--format=csv"])[1]
        holders = P.find_device_holders(exclude_pids={os.getpid()})
        res["worker_fds"] = {str(pid): holders.get(pid) for pid in pids.values()}
        res["worker_info"] = {str(pid): P.process_info(pid) for pid in pids.values()}
        per_gpu, dev_holders = G.gpu_processes(nb, indices)
        res["gpu_processes_nvml"] = per_gpu
        res["device_holders"] = dev_holders
        log("worker fds:", json.dumps(res["worker_fds"]))

        # -- the modules as Ansible runs them
        for be in ("nvml", "nvidia-smi"):
            res["module_info_" + be] = run_module_file("nvidia_gpu_info", {"backend": be, "detail": "full"})
            log("module info", be, "rc", res["module_info_" + be]["_rc"], "wall ms",
                res["module_info_" + be]["_wall_ms"])
        res["module_wait_timeout"] = run_module_file("nvidia_gpu_wait", {"timeout_s": 1})
        log("module wait timeout msg:", res["module_wait_timeout"].get("msg"))
        ws.kill(); ws.reap()
        nb.close()

        # -- release latency
        pctx = mp.get_context("spawn")
        parent, child = pctx.Pipe()
        pp = pctx.Process(target=poller, args=(child, indices, 1024, 0.010))
        pp.start()
        assert parent.recv() == "up"
        lat = {"inprocess": {"nvml": [], "nvidia-smi": []}, "module": {"nvml": [], "nvidia-smi": []},
               "inprocess_100ms": {"nvml": [], "nvidia-smi": []}}
        release = []
        reps_log = []
        params = {"gpus": [], "max_used_mib": 1024, "require_no_processes": False,
                  "poll_interval_ms": opts.poll_interval_ms, "timeout_s": 30}
        plan = [("inprocess", be) for _ in range(opts.reps) for be in ("nvml", "nvidia-smi")]
        plan += [("module", be) for _ in range(opts.module_reps) for be in ("nvml", "nvidia-smi")]
        plan += [("inprocess_100ms", be) for _ in range(opts.role_interval_reps) for be in ("nvml", "nvidia-smi")]
        for mode, be in plan:
            if time.monotonic() - t_start > opts.budget_s:
                log("budget reached, stopping reps")
                break
            ws.start(indices, opts.gib)
            box = {}
            if mode.startswith("inprocess"):
                backend, _ = G.open_backend(be, runner=G.subprocess_runner, smi_path=smi)
                interval = 100 if mode == "inprocess_100ms" else params["poll_interval_ms"]
                rep_params = dict(params, poll_interval_ms=interval)

                def go():
                    ok, result, msg = wait_mod.run_wait(backend, rep_params)
                    box["t_ret"] = time.monotonic()
                    box["result"] = {"ok": ok, "elapsed_ms": result["elapsed_ms"], "polls": result["polls"]}

                th = threading.Thread(target=go)
                th.start()
                time.sleep(0.3)
            else:
                args = dict(params, backend=be)
                with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
                    json.dump({"ANSIBLE_MODULE_ARGS": args}, fh)
                proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "plugins", "modules", "nvidia_gpu_wait.py"),
                                         fh.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                time.sleep(2.0)  # interpreter start, imports, backend open: let it reach its polling loop
            parent.send(20.0)
            t_kill = ws.kill()
            if mode.startswith("inprocess"):
                th.join(35)
                backend.close()
            else:
                out, err = proc.communicate(timeout=40)
                box["t_ret"] = time.monotonic()
                os.unlink(fh.name)
                try:
                    r = json.loads(out.decode())
                    box["result"] = {"ok": not r.get("failed"), "elapsed_ms": r.get("elapsed_ms"),
                                     "polls": r.get("polls"), "rc": proc.returncode}
                except ValueError:
                    box["result"] = {"ok": False, "stdout": out.decode(errors="replace")[-500:],
                                     "stderr": err.decode(errors="replace")[-500:]}
            t_free = parent.recv()
            ws.reap()
            entry = {"mode": mode, "backend": be, "kill_to_free_ms": None, "latency_ms": None}
            entry.update(box.get("result", {}))
            if t_free is not None and "t_ret" in box:
                entry["kill_to_free_ms"] = round((t_free - t_kill) * 1000, 1)
                entry["latency_ms"] = round((box["t_ret"] - t_free) * 1000, 1)
                lat[mode][be].append(entry["latency_ms"])
                release.append(entry["kill_to_free_ms"])
            reps_log.append(entry)
            log("rep", json.dumps(entry))
        parent.send("stop")
        pp.join(10)
        res["reps"] = reps_log
        res["latency_summary_ms"] = {m: {b: summary(v) for b, v in d.items()} for m, d in lat.items()}
        res["kill_to_free_summary_ms"] = summary(release)
        log("latency (wait returned - memory free) ms:", json.dumps(res["latency_summary_ms"]))
        log("SIGKILL -> memory free ms:", json.dumps(res["kill_to_free_summary_ms"]))
        wait_msg = res["module_wait_timeout"].get("msg") or ""
        res["checks"] = {
            "agreement_idle_exact": res["agreement_idle"]["exact"],
            "agreement_loaded_exact": res["agreement_loaded"]["exact"],
            "compute_pids_equal": res["compute_pids"]["equal"],
            "module_info_ok": all(res["module_info_" + b]["_rc"] == 0 for b in ("nvml", "nvidia-smi")),
            "wait_timeout_names_worker_pids_and_cmdlines": all(
                "pid %d (" % p in wait_msg for p in pids.values()) and "multiprocessing.forkserver" in wait_msg,
            "context_only_passes_memory_limit": not res["context_only_wait_memory"].get("failed", False),
            "context_only_refused_by_require_no_processes": bool(res["context_only_wait_noproc"].get("failed")),
            "median_latency_le_150ms": all(v["median"] <= 150 for d in res["latency_summary_ms"].values()
                                           for v in d.values() if v),
        }
        log("checks:", json.dumps(res["checks"]))
    finally:
        res["total_s"] = round(time.monotonic() - t_start, 1)
        with open(os.path.join(opts.out, "results.json"), "w") as fh:
            json.dump(res, fh, indent=1, default=str)
        with open(os.path.join(opts.out, "log.txt"), "w") as fh:
            fh.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
