#!/usr/bin/env python3
"""Real-GPU proof for the health fields and time limits of nvidia_gpu_info / nvidia_gpu_wait (issue 9).

Needs python3, nvidia-ml-py (``import pynvml``) and nvidia-smi; not Ansible: the repository's
plugins/module_utils/gpufleet_*.py are imported as ``ansible_collections.gpufleet.fleet.plugins.module_utils``
through the repository's collections/ directory (plain namespace packages; the GPU code imports nothing else
from Ansible). psutil is used when present (process names).

What it does, writing ``health.json`` and ``log.txt`` under ``--out``:

1. Raw answers for the record: one ``nvidia-smi --query-gpu`` with every field the backend asks (csv with
   header and units), ``nvidia-smi nvlink -s`` / ``-e``, and the NVML calls behind each field.
2. Both backends read every field of ``GPU_FIELDS`` and the NVLink links, twice, interleaved
   (nvml, smi, nvml, smi). ``compare`` holds per GPU and field: the values, and whether they agree --
   exactly for identities, counters and modes; within drift (the spread of the two readings of one backend
   plus a margin) for temperatures, power, clocks, utilisation, memory used.
3. Timing per backend of a full info call (open, inventory, system, details, nvlinks, process scan, Xid read,
   close), ``--reps`` times: median and max ms.
4. Time limits: a stand-in ``nvidia-smi`` that never answers (sleeps 600 s), called through the backend with
   a 2 s budget (must fail with error_class timeout after ~3 s, the per-call floor, and not wait for the
   process); the real nvidia-smi run with a 0.005 s limit through ``bounded_run`` (must raise CallTimedOut
   within ~0.6 s); an NVML-init stand-in that blocks, through ``call_in_thread`` with 1 s.
5. The Xid reader on this host (``/dev/kmsg`` record by record, journalctl fallback): status, source,
   count, how long it took.
6. ``checks``: each claim as a boolean; ``ok`` is their conjunction.

Usage (device, from the repository root):
    python3 tests/gpu/real_health_check.py --out $OUT --reps 5
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG = []

# Fields compared exactly (identities, counters, modes) vs within drift (sensors that move between reads).
DRIFT = {"temperature_gpu_c": 3, "temperature_memory_c": 3, "power_draw_w": 25.0, "clocks_sm_mhz": 300,
         "utilization_gpu_pct": 20, "memory_used_mib": 4, "pstate": None, "clocks_event_reasons_mask": None,
         "clocks_event_reasons": None, "pcie_link_gen_current": None}
# pstate / clock event reasons / current PCIe gen follow load: compared, but a difference is "drift", not a
# disagreement, when the backend's own two readings differ too.
SKIP = {"unsupported", "processes"}


def log(*args):
    line = " ".join(str(a) for a in args)
    LOG.append(line)
    print(line, flush=True)


def install_shim():
    """Make plugins/module_utils importable as ansible_collections.gpufleet.fleet.plugins.module_utils.*.

    The repository resolves itself as the collection through collections/ansible_collections/gpufleet/fleet
    (a symlink to the repository root); returns that collections directory.
    """
    base = os.path.join(ROOT, "collections")
    if base not in sys.path:
        sys.path.insert(0, base)
    return base


def run(argv, timeout=60):
    t = time.monotonic()
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                       env=dict(os.environ, LC_ALL="C"))
    return {"argv": argv, "rc": p.returncode, "out": p.stdout.decode("utf-8", "replace"),
            "ms": round((time.monotonic() - t) * 1000, 1)}


def nvml_raw(pynvml):
    """The NVML calls behind each field, raw (value or error text), per GPU."""
    out = []
    pynvml.nvmlInit()
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            row = {}

            def t(name, fn, *a):
                try:
                    v = fn(*a)
                    row[name] = v if isinstance(v, (int, float, str, list, tuple, type(None))) else repr(v)
                except Exception as exc:  # noqa: BLE001 -- recorded as text
                    row[name] = "! %s %s" % (type(exc).__name__, exc)

            n = pynvml
            t("nvmlDeviceGetSerial", n.nvmlDeviceGetSerial, h)
            t("nvmlDeviceGetVbiosVersion", n.nvmlDeviceGetVbiosVersion, h)
            t("nvmlDeviceGetPerformanceState", n.nvmlDeviceGetPerformanceState, h)
            t("nvmlDeviceGetCurrentClocksEventReasons", n.nvmlDeviceGetCurrentClocksEventReasons, h)
            t("nvmlDeviceGetClockInfo(SM)", n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM)
            t("nvmlDeviceGetMaxClockInfo(SM)", n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM)
            t("memory_temp_field", lambda: n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_MEMORY_TEMP])[0].value.uiVal)
            t("nvmlDeviceGetMigMode", n.nvmlDeviceGetMigMode, h)
            t("nvmlDeviceGetEccMode", n.nvmlDeviceGetEccMode, h)
            t("nvmlDeviceGetRetiredPagesPendingStatus", n.nvmlDeviceGetRetiredPagesPendingStatus, h)
            t("nvmlDeviceGetRetiredPages(SBE)", lambda: list(n.nvmlDeviceGetRetiredPages(
                h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)))
            t("nvmlDeviceGetNvLinkState(0)", n.nvmlDeviceGetNvLinkState, h, 0)
            out.append(row)
    finally:
        pynvml.nvmlShutdown()
    return out


def full_info(G, K, backend_name, smi):
    """One full info call as the module makes it (without Ansible): returns (ms, result dict)."""
    t = time.monotonic()
    deadline = G.Deadline(30)
    backend, _ = G.open_backend(backend_name, runner=G.subprocess_runner, smi_path=smi, deadline=deadline)
    try:
        inv = backend.inventory()
        indices = [g["index"] for g in inv]
        system = backend.system()
        gpus = backend.details(indices)
        try:
            links = backend.nvlinks(indices)
        except G.GpuError as exc:
            links = {"error": exc.msg}
        per_gpu, holders = G.gpu_processes(backend, indices)
        xid = K.xid_report(60)
    finally:
        backend.close()
    ms = (time.monotonic() - t) * 1000
    return ms, {"system": system, "gpus": gpus, "nvlinks": links, "per_gpu_processes": per_gpu,
                "device_holders": holders, "xid": xid}


def compare(nv_reads, sm_reads):
    """Per GPU and field: values of both backends (2 reads each) and the verdict."""
    rows = []
    verdicts = []
    for gi in range(len(nv_reads[0]["gpus"])):
        for key in nv_reads[0]["gpus"][gi]:
            if key in SKIP:
                continue
            nv = [r["gpus"][gi].get(key) for r in nv_reads]
            sm = [r["gpus"][gi].get(key) for r in sm_reads]
            if key in DRIFT:
                tol = DRIFT[key]
                if tol is None:
                    ok = nv[0] == sm[0] or nv[0] != nv[1] or sm[0] != sm[1] or nv[1] == sm[1]
                    kind = "moves"
                elif None in nv + sm:
                    ok = nv == sm
                    kind = "drift"
                else:
                    spread = max(abs(nv[0] - nv[1]), abs(sm[0] - sm[1]))
                    ok = abs(nv[0] - sm[0]) <= spread + tol and abs(nv[1] - sm[1]) <= spread + tol
                    kind = "drift"
            else:
                ok = nv[0] == sm[0] == nv[1] == sm[1]
                kind = "exact"
            rows.append({"gpu": gi, "field": key, "kind": kind, "nvml": nv, "nvidia_smi": sm, "agree": ok})
            verdicts.append(ok)
    return rows, all(verdicts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    install_shim()
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_errors as E
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_kmsg as K
    import pynvml

    smi = shutil.which("nvidia-smi")
    res = {"host": os.uname().nodename, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "nvidia_ml_py": getattr(pynvml, "__version__", None), "checks": {}}
    checks = res["checks"]

    def step(name, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 -- every step reports, the run goes on
            res.setdefault("errors", {})[name] = traceback.format_exc()
            log("step", name, "FAILED:\n" + traceback.format_exc())

    # 1. raw answers
    def raw():
        fields = ",".join(f for f, _, _ in G.SMI_GPU_QUERY)
        res["raw_query_gpu"] = run([smi, "--query-gpu=" + fields, "--format=csv"])
        res["raw_nvlink_s"] = run([smi, "nvlink", "-s"])
        res["raw_nvlink_e"] = run([smi, "nvlink", "-e"])
        res["raw_nvml"] = nvml_raw(pynvml)
        log("raw query-gpu rc", res["raw_query_gpu"]["rc"], res["raw_query_gpu"]["out"][:2000])
        log("nvlink -s rc", res["raw_nvlink_s"]["rc"], res["raw_nvlink_s"]["out"][:1500])
    step("raw", raw)

    # 2. + 3. both backends, interleaved, timed
    def agree():
        times = {"nvml": [], "nvidia-smi": []}
        reads = {"nvml": [], "nvidia-smi": []}
        for rep in range(max(2, args.reps)):
            for be in ("nvml", "nvidia-smi"):
                ms, r = full_info(G, K, be, smi)
                times[be].append(round(ms, 1))
                if rep < 2:
                    reads[be].append(r)
        res["info_call_ms"] = {be: {"all": v, "median": statistics.median(v), "max": max(v)}
                               for be, v in times.items()}
        rows, ok = compare(reads["nvml"], reads["nvidia-smi"])
        res["compare"] = rows
        res["reads"] = reads
        checks["backends_agree_on_every_field"] = ok
        checks["every_gpu_field_present"] = all(set(G.GPU_FIELDS) <= set(g) for r in reads["nvml"] + reads[
            "nvidia-smi"] for g in r["gpus"])
        nv_links = reads["nvml"][0]["nvlinks"]
        sm_links = reads["nvidia-smi"][0]["nvlinks"]
        res["nvlinks_agree"] = nv_links == sm_links
        checks["nvlink_links_agree"] = nv_links == sm_links
        for row in rows:
            if not row["agree"]:
                log("DISAGREE", json.dumps(row))
        log("info call ms", json.dumps(res["info_call_ms"]))
    step("agree", agree)

    # 4. time limits
    def limits():
        d = tempfile.mkdtemp(prefix="gpufleet-hang-")
        hang = os.path.join(d, "nvidia-smi")
        with open(hang, "w") as fh:
            fh.write("#!/bin/sh\nexec sleep 600\n")
        os.chmod(hang, 0o755)
        t = time.monotonic()
        err = None
        try:
            G.open_backend("nvidia-smi", runner=G.subprocess_runner, smi_path=hang, deadline=G.Deadline(2))
        except G.GpuError as exc:
            err = exc
        took = time.monotonic() - t
        res["hang_smi"] = {"s": round(took, 2), "error_class": getattr(err, "error_class", None),
                           "msg": getattr(err, "msg", None)}
        checks["hung_nvidia_smi_fails_as_timeout_within_4s"] = (
            err is not None and err.error_class == "timeout" and took < E.MIN_CALL_TIMEOUT_S + 1.0)
        t = time.monotonic()
        try:
            E.bounded_run([smi, "-q"], 0.005)
            res["real_smi_short_limit"] = {"timed_out": False}
        except E.CallTimedOut:
            res["real_smi_short_limit"] = {"timed_out": True}
        res["real_smi_short_limit"]["s"] = round(time.monotonic() - t, 3)
        checks["real_nvidia_smi_abandoned_within_0_6s"] = res["real_smi_short_limit"]["s"] < 0.6
        t = time.monotonic()
        try:
            E.call_in_thread(time.sleep, 1.0, "nvmlInit (stand-in that blocks)", 30)
            cls = None
        except E.GpuTimeoutError as exc:
            cls = exc.error_class
        res["blocked_nvml_init"] = {"s": round(time.monotonic() - t, 3), "error_class": cls}
        checks["blocked_nvml_init_abandoned_after_1s"] = cls == "timeout" and res["blocked_nvml_init"]["s"] < 1.5
        # idle wait through both backends, one slice: GPUs must read as free at once
        for be in ("nvml", "nvidia-smi"):
            backend, _ = G.open_backend(be, runner=G.subprocess_runner, smi_path=smi, deadline=G.Deadline(10))
            try:
                t = time.monotonic()
                out = G.wait_for_memory(backend, None, 1024, poll_interval_ms=100, timeout_s=5, slice_s=2)
                res["wait_idle_" + be] = {"ready": out["ready"], "progress": out["progress"],
                                          "ms": round((time.monotonic() - t) * 1000, 1)}
            finally:
                backend.close()
        log("limits", json.dumps({k: res[k] for k in ("hang_smi", "real_smi_short_limit", "blocked_nvml_init")}))
    step("limits", limits)

    # 5. Xid reader
    def xid():
        t = time.monotonic()
        rep = K.xid_report(60 * 24 * 30)
        rep["ms"] = round((time.monotonic() - t) * 1000, 1)
        rep["uid"] = os.getuid()
        res["xid"] = rep
        checks["xid_read_is_ok_or_unknown_never_empty_when_unreadable"] = (
            (rep["xid_status"] == "ok" and isinstance(rep["xid_events"], list))
            or (rep["xid_status"] == "unknown" and rep["xid_events"] is None))
        log("xid", json.dumps(rep)[:1500])
    step("xid", xid)

    res["ok"] = bool(checks) and all(checks.values()) and not res.get("errors")
    with open(os.path.join(args.out, "health.json"), "w") as fh:
        json.dump(res, fh, indent=1, sort_keys=True, default=str)
    with open(os.path.join(args.out, "log.txt"), "w") as fh:
        fh.write("\n".join(LOG) + "\n")
    log("checks", json.dumps(checks, indent=1))
    log("ok", res["ok"])
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
