#!/usr/bin/env python3
"""On a lent GPU machine: does NCCL treat the values gpufleet refuses (module_utils gpufleet_nccl) as the module
says, and does nvidia_gpu_info's ``fields`` answer on real NVML and nvidia-smi?

For each case one process (torch's bundled NCCL, world size 1, TCP store on 127.0.0.1) runs an all_reduce with
the case's variables and NCCL_DEBUG=INFO; the report keeps its exit status, the NCCL version and NCCL's own
lines about the variable (set by environment / Invalid / Unrecognized / ncclInvalidUsage), beside gpufleet's
verdict for the same value. Then nvidia_gpu_info runs with ``fields`` through both backends.

    python3 tests/gpu/nccl_values.py --out $OUT      # after installing the carried ansible-core (PYTHONPATH)

Writes ``$OUT/nccl_values.json`` and prints a table. Exit status 0 when every run produced a report.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "plugins", "module_utils"))
import gpufleet_nccl  # noqa: E402

CHILD = r"""
import os, sys, torch, torch.distributed as dist
print("nccl_version", ".".join(map(str, torch.cuda.nccl.version())), flush=True)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]), rank=0, world_size=1)
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("all_reduce_ok", float(t[0]), flush=True)
dist.destroy_process_group()
"""

CASES = [
    ("baseline", {}),
    ("NCCL_PROTO", {"NCCL_PROTO": "LL128,Simple"}),
    ("NCCL_PROTO", {"NCCL_PROTO": "5"}),
    ("NCCL_PROTO", {"NCCL_PROTO": "AllReduce:LL;Simple"}),
    ("NCCL_PROTO", {"NCCL_PROTO": "^"}),
    ("NCCL_ALGO", {"NCCL_ALGO": "Ring"}),
    ("NCCL_ALGO", {"NCCL_ALGO": "ring,CollNet"}),
    ("NCCL_P2P_LEVEL", {"NCCL_P2P_LEVEL": "nvl"}),
    ("NCCL_P2P_LEVEL", {"NCCL_P2P_LEVEL": "NVL"}),
    ("NCCL_BUFFSIZE", {"NCCL_BUFFSIZE": "4M"}),
    ("NCCL_BUFFSIZE", {"NCCL_BUFFSIZE": "4194304"}),
    ("NCCL_MAX_NCHANNELS", {"NCCL_MAX_NCHANNELS": "abc"}),
    ("NCCL_NTHREADS", {"NCCL_NTHREADS": "500"}),
    ("NCCL_DEBUG", {"NCCL_DEBUG": "verbose"}),
]


def nccl_case(label, env, port):
    child_env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV,TUNING,GRAPH")
    child_env.update(env)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(port)], env=child_env, capture_output=True,
                              text=True, timeout=180)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = (exc.stdout or "") + (exc.stderr or ""), "timeout"
        out = out if isinstance(out, str) else out.decode(errors="replace")
    names = list(env) or ["NCCL_PROTO"]
    pattern = re.compile("|".join(re.escape(n) for n in names) + r"|Invalid|Unrecognized|InvalidUsage|invalid usage"
                         r"|no algorithm|WARN")
    lines = [ln.strip() for ln in out.splitlines() if pattern.search(ln) and "NCCL" in ln][:8]
    version = next((ln.split()[1] for ln in out.splitlines() if ln.startswith("nccl_version")), None)
    verdicts = {name: gpufleet_nccl.value_problem(name, value) for name, value in env.items()}
    return {"label": label, "env": env, "rc": rc, "all_reduce_ok": "all_reduce_ok" in out, "nccl": version,
            "nccl_lines": lines, "gpufleet": verdicts, "wall_s": round(time.monotonic() - t0, 2),
            "tail": out.splitlines()[-3:] if rc not in (0,) else []}


def info_fields():
    sys.path.insert(0, HERE)
    import real_gpu_check as rgc
    rgc.install_module_utils()
    out = {}
    for backend in ("nvml", "nvidia-smi"):
        res = rgc.run_module_file("nvidia_gpu_info", {"backend": backend, "xid_window_min": 0, "detail": "full",
                                                      "fields": ["memory.used", "utilization.gpu", "power.draw",
                                                                 "retired_pages_pending"]})
        out[backend] = {k: res.get(k) for k in ("failed", "msg", "backend", "gpus", "device_holders", "_rc",
                                                "_wall_ms")}
        full = rgc.run_module_file("nvidia_gpu_info", {"backend": backend, "xid_window_min": 0, "detail": "full"})
        out[backend]["full_wall_ms"] = full.get("_wall_ms")
        out[backend]["full_bytes"] = len(json.dumps(full.get("gpus")))
        out[backend]["fields_bytes"] = len(json.dumps(res.get("gpus")))
    bad = rgc.run_module_file("nvidia_gpu_info", {"fields": ["memory.free_gb"]})
    out["bad_field"] = {k: bad.get(k) for k in ("failed", "error_class", "msg", "_rc")}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    opts = ap.parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    report = {"cases": [], "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for i, (label, env) in enumerate(CASES):
        case = nccl_case(label, env, 29500 + i)
        report["cases"].append(case)
        print("%-20s %-28s rc=%-7s ok=%-5s nccl=%s gpufleet=%s | %s" % (
            label, json.dumps(env), case["rc"], case["all_reduce_ok"], case["nccl"],
            "refuse" if any(case["gpufleet"].values()) else "accept", " / ".join(case["nccl_lines"][:3])[:300]),
            flush=True)
    try:
        report["info_fields"] = info_fields()
    except Exception as exc:  # report what went wrong, keep the NCCL cases
        report["info_fields"] = {"error": repr(exc)}
    print(json.dumps(report["info_fields"], indent=1)[:4000], flush=True)
    with open(os.path.join(opts.out, "nccl_values.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
