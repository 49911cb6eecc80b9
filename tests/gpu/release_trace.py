#!/usr/bin/env python3
"""Where the release-detection time goes on a real GPU (issue 14): each poll of gpufleet's wait, stamped, next
to an independent 1 ms NVML poller, without Ansible in between.

    python3 tests/gpu/release_trace.py --out DIR [--reps 7] [--gib 20] [--poll-ms 20]   # on the GPU machine

Per rep: a holder process (torch) takes ``--gib`` GiB on GPU 0 and sleeps; the poller (``real_restart.py poll`` at
1 ms: its own process, pynvml only, a line per change with each call's start and return) runs throughout. Then two ways of waiting, each
with the holder SIGKILLed 1 s after the wait began:

- ``traced``: gpufleet_gpu.wait_for_memory (the loop nvidia_gpu_wait and sglang_stop's gpu_wait run) in this
  process on an NVML backend whose memory() and compute_processes() calls are stamped before and after.
- ``module``: ``python3 plugins/modules/nvidia_gpu_wait.py ARGS.json`` (the module process, as Ansible would run it
  on the target, minus AnsiballZ); its ``started_at + elapsed_ms`` is the poll that saw the memory free, and the
  process's exit is stamped too.

For each, relative to the poller's first sample at or under the limit (``free``): the first poll that read memory
at or under it, the poll that found every condition met (memory and no compute process), the wait's return, and
for ``module`` the process exit. Also the poller's view of the release: the holder's kill → the first sample under
the limit → the process list empty, and each distinct used-MiB value on the way down. Writes DIR/release_trace.json
and prints a table. Times are Unix time (one clock: everything runs on this machine).
"""
import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
import bench  # noqa: E402  (stdlib only: the sys.exit stamp)
LIMIT_MIB = 1024


def holder(gib, ready):
    import torch
    x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    ready.set()
    time.sleep(3600)


class Stamped:
    """Wraps a backend; logs (call, t_before, t_after, value) for memory() and compute_processes()."""

    def __init__(self, backend):
        self._b = backend
        self.log = []

    def __getattr__(self, name):
        return getattr(self._b, name)

    def memory(self, indices=None):
        t = time.time()
        out = self._b.memory(indices)
        self.log.append({"call": "memory", "t": t, "t_end": time.time(), "used_mib": [m["memory_used_mib"] for m in out]})
        return out

    def compute_processes(self, indices=None):
        t = time.time()
        out = self._b.compute_processes(indices)
        self.log.append({"call": "compute_processes", "t": t, "t_end": time.time(), "n": len(out)})
        return out


def start_holder(gib):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=holder, args=(gib, ready), daemon=True)
    p.start()
    if not ready.wait(120):
        raise RuntimeError("holder did not allocate within 120 s")
    return p


def kill_later(pid, delay_s, box):
    time.sleep(delay_s)
    box["t_kill"] = time.time()
    os.kill(pid, signal.SIGKILL)


def rep_traced(G, gib, poll_ms):
    hp = start_holder(gib)
    backend, _ = G.open_backend("nvml")
    st = Stamped(backend)
    box = {}
    k = threading.Thread(target=kill_later, args=(hp.pid, 1.0, box))
    t0 = time.time()
    k.start()
    out = G.wait_for_memory(st, [0], LIMIT_MIB, True, poll_ms, 30.0)
    t_ret = time.time()
    backend.close()  # nvmlShutdown, as backend_session does before the module reports
    t_closed = time.time()
    k.join()
    hp.join(10)
    mem_free = next((e for e in st.log if e["call"] == "memory" and max(e["used_mib"]) <= LIMIT_MIB), None)
    return {"t_wait_start": t0, "t_kill": box.get("t_kill"), "ready": out["ready"], "polls": out["polls"],
            "first_memory_read_free_t": mem_free and mem_free["t"], "first_memory_read_free_t_end": mem_free and mem_free["t_end"],
            "seen_t": t0 + out["elapsed_ms"] / 1000.0, "return_t": t_ret, "closed_t": t_closed,
            "log_tail": [e for e in st.log if e["t"] >= (box.get("t_kill") or 0) - 0.05]}


# Loaded into the module process (PYTHONPATH): stamps sys.exit's call (bench.py's EXIT_STAMP) and the last atexit
# handler, on stderr, so the module's end splits into result/exit_json, atexit handlers, and the interpreter's
# finalization.
_STAMPS = bench.EXIT_STAMP + """import atexit
atexit.register(lambda: (sys.stderr.write("T_ATEXIT_DONE %.6f\\n" % time.time()), sys.stderr.flush()))
"""


def _stamp(err, name):
    for line in err.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def rep_module(gib, poll_ms):
    hp = start_holder(gib)
    stamps = tempfile.mkdtemp(prefix="release-trace-")
    with open(os.path.join(stamps, "sitecustomize.py"), "w") as fh:
        fh.write(_STAMPS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (stamps, os.environ.get("PYTHONPATH")) if p))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"ANSIBLE_MODULE_ARGS": {"max_used_mib": LIMIT_MIB, "require_no_processes": True,
                                           "poll_interval_ms": poll_ms, "timeout_s": 30, "backend": "nvml"}}, fh)
        args = fh.name
    box = {}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "plugins", "modules", "nvidia_gpu_wait.py"), args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    k = threading.Thread(target=kill_later, args=(hp.pid, 1.0, box))
    k.start()
    out, err = proc.communicate(60)
    t_exit = time.time()
    k.join()
    hp.join(10)
    os.unlink(args)
    try:
        res = json.loads(out.decode())
    except ValueError:
        return {"error": (out + err).decode(errors="replace")[-1500:]}
    return {"t_spawn": t0, "t_kill": box.get("t_kill"), "ready": res.get("ready"), "polls": res.get("polls"),
            "started_at": res.get("started_at"), "elapsed_ms": res.get("elapsed_ms"),
            "seen_t": (res.get("started_at") or 0) + (res.get("elapsed_ms") or 0) / 1000.0, "exit_t": t_exit,
            "sys_exit_t": _stamp(err.decode(errors="replace"), "T_SYS_EXIT"),
            "atexit_done_t": _stamp(err.decode(errors="replace"), "T_ATEXIT_DONE"), "msg": res.get("msg")}


EXIT_CASES = {
    "bare": "pass",
    "ansible basic imported": "import ansible.module_utils.basic",
    "pynvml init+shutdown": "import pynvml; pynvml.nvmlInit(); pynvml.nvmlShutdown()",
    "both": "import ansible.module_utils.basic, pynvml; pynvml.nvmlInit(); pynvml.nvmlShutdown()",
    # what gpufleet's modules do since their __main__ guard calls gc.freeze() (docs/benchmarks.md, module exit)
    "both, gc.freeze()": "import gc, ansible.module_utils.basic, pynvml; gc.freeze(); pynvml.nvmlInit(); "
                         "pynvml.nvmlShutdown()",
}


def exit_costs(reps=7):
    """Median ms from the last atexit handler to the parent seeing the process end, per EXIT_CASES body: what a
    module process's own end costs (interpreter finalization, shared-library teardown)."""
    stamps = tempfile.mkdtemp(prefix="release-trace-")
    with open(os.path.join(stamps, "sitecustomize.py"), "w") as fh:
        fh.write(_STAMPS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (stamps, os.environ.get("PYTHONPATH")) if p))
    out = {}
    for name, body in EXIT_CASES.items():
        vals = []
        for _ in range(reps):
            p = subprocess.Popen([sys.executable, "-c", body + "\nimport sys; sys.exit(0)"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env)
            _, err = p.communicate(60)
            t_end = time.time()
            done = _stamp(err.decode(errors="replace"), "T_ATEXIT_DONE")
            if p.returncode == 0 and done:
                vals.append((t_end - done) * 1000)
        out[name] = round(statistics.median(vals), 1) if vals else None
        print("exit cost, %s: median %s ms (%d runs)" % (name, out[name], len(vals)), flush=True)
    return out


def start_poller(path):
    """real_restart.py's independent NVML poller (its own process, pynvml only) at 1 ms; stop it with SIGTERM."""
    return subprocess.Popen([sys.executable, os.path.join(HERE, "real_restart.py"), "poll", path, "--period-ms", "1"])


def poller_view(path, t_kill):
    """GPU 0's rows of the poll file after the kill: each call's start (t_call) and return (t_end)."""
    rows = []
    for line in open(path):
        r = json.loads(line) if line.strip() else {}
        if r.get("gpu") == 0:
            r["t"] = r.get("t_call", r["t"])
            rows.append(r)
    after = [r for r in rows if r["t"] >= t_kill - 0.002]
    free = next((r for r in after if r["used_mib"] <= LIMIT_MIB), None)
    empty = next((r for r in after if r["used_mib"] <= LIMIT_MIB and r["procs"] == 0), None)
    return {"free_t": free and free["t"], "free_t_end": free and free["t_end"],
            "free_and_empty_t": empty and empty["t"],
            "steps": [(round((r["t"] - t_kill) * 1000, 1), round((r["t_end"] - r["t"]) * 1000, 1), r["used_mib"],
                       r["procs"]) for r in after[:12]]}


def ms(a, b):
    return None if a is None or b is None else round((a - b) * 1000, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gib", type=float, default=20)
    ap.add_argument("--poll-ms", type=int, default=20)
    ap.add_argument("--kinds", default="traced,module", help="which ways of waiting (default traced,module); 'exit' adds the process-end costs")
    opts = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "collections"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "collections"),
                                                           os.environ.get("PYTHONPATH")) if p)
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
    os.makedirs(opts.out, exist_ok=True)
    reps = []
    exits = exit_costs() if "exit" in opts.kinds.split(",") else None
    for i in range(opts.reps if set(opts.kinds.split(",")) - {"exit"} else 0):
        for kind in [k for k in opts.kinds.split(",") if k != "exit"]:
            path = os.path.join(opts.out, "poll-%s-%d.jsonl" % (kind, i))
            pp = start_poller(path)
            time.sleep(0.5)
            try:
                r = rep_traced(G, opts.gib, opts.poll_ms) if kind == "traced" else rep_module(opts.gib, opts.poll_ms)
                time.sleep(0.3)
            finally:
                pp.send_signal(signal.SIGTERM)
                pp.wait(5)
            if r.get("t_kill"):
                v = poller_view(path, r["t_kill"])
                os.unlink(path)  # its steps are kept in the rep
                r["poller"] = v
                f = v["free_t"]
                r["ms"] = {"kill_to_free": ms(f, r["t_kill"]), "free_to_empty": ms(v["free_and_empty_t"], f),
                           "free_call_took": ms(v["free_t_end"], f), "free_answer_to_seen": ms(r["seen_t"], v["free_t_end"]),
                           "free_to_first_memory_read_free": ms(r.get("first_memory_read_free_t"), f),
                           "free_to_seen": ms(r["seen_t"], f),
                           "free_to_return": ms(r.get("return_t"), f), "free_to_exit": ms(r.get("exit_t"), f),
                           "nvml_shutdown": ms(r.get("closed_t"), r.get("return_t")),
                           "seen_to_sys_exit": ms(r.get("sys_exit_t"), r["seen_t"]),
                           "sys_exit_to_atexit_done": ms(r.get("atexit_done_t"), r.get("sys_exit_t")),
                           "atexit_done_to_exit": ms(r.get("exit_t"), r.get("atexit_done_t"))}
            r["kind"], r["rep"] = kind, i + 1
            reps.append(r)
            print("%s %d: %s polls %s; %s" % (kind, i + 1, "ready" if r.get("ready") else "NOT READY", r.get("polls"),
                                              r.get("ms") or r.get("error")), flush=True)
            f = (r.get("poller") or {}).get("free_t")
            if f and r.get("log_tail"):
                print("   wait's calls, ms from free (start, took): " + "; ".join(
                    "%s %+.1f (%.1f) %s" % ("mem" if e["call"] == "memory" else "procs", (e["t"] - f) * 1000,
                                            (e["t_end"] - e["t"]) * 1000, e.get("used_mib", e.get("n")))
                    for e in r["log_tail"] if -45 <= (e["t"] - f) * 1000 <= 80), flush=True)
                print("   poller steps (ms from kill, call took ms, MiB, procs): %s" % (r["poller"]["steps"][:8],), flush=True)
    summary = {"exit_costs_ms": exits} if exits else {}
    for kind in [k for k in opts.kinds.split(",") if k != "exit"]:
        rows = [r["ms"] for r in reps if r["kind"] == kind and r.get("ms")]
        summary[kind] = {k: statistics.median([x[k] for x in rows if x[k] is not None])
                         for k in (rows[0] if rows else {}) if any(x[k] is not None for x in rows)}
    print(json.dumps(summary, indent=1))
    with open(os.path.join(opts.out, "release_trace.json"), "w") as fh:
        json.dump({"limit_mib": LIMIT_MIB, "poll_ms": opts.poll_ms, "gib": opts.gib, "summary_median_ms": summary,
                   "reps": reps}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
