"""The fleet check's decisions (controller side): which parts of a host check.yml reads, the per-host health
verdict from that read, the fleet view, the table (the textfile: metrics.py).

Plain functions (no Ansible needed), imported by the gpufleet_check filters (plugins/filter/gpufleet_check.py),
which the fleet_check role calls with the sglang_fleet_check_info result.

Verdict shape (one host)::

    {"verdict": "OK|WARN|CRIT", "reasons": [{"severity": "WARN|CRIT", "gpu": int|None, "code": str,
     "text": str}], "gpus_ok": int, "gpus_total": int, "gpus": [per-GPU summary], "sglang": {...}}

Reason codes (severity in brackets; thresholds and the Xid map come from ``config``, the fleet_check role's
variables): unreachable [CRIT], gpu_query_failed / <error_class> (no_devices, driver_mismatch, gpu_lost,
timeout, ...) [CRIT], fewer_gpus [CRIT], ecc_uncorrected [CRIT], ecc_uncorrected_aggregate [WARN],
remap_pending [CRIT], remap_failure [CRIT], retired_pages_pending [CRIT], xid_<N> [map; unknown Xid WARN],
xid_unknown [WARN], throttle [WARN], gpu_temperature / memory_temperature [WARN/CRIT], pcie_degraded [WARN],
nvlink_down [CRIT], nvlink_errors [WARN], persistence_off [WARN], mig_mode [CRIT], mig_pending [WARN],
memory_held_no_server [WARN], foreign_gpu_process [WARN], sglang_not_serving [CRIT], sglang_release [WARN],
server_args_drift [WARN], nccl_block_missing [CRIT], nccl_block_values [CRIT], nccl_check_failed [WARN],
nccl_worker_env [CRIT], restart_needed [WARN], root_code_untrusted [CRIT], check_read_failed [CRIT].
Where dcgmi is installed (docs/dcgm.md): dcgm_health_<system> (pcie, nvlink, memory, thermal, power, inforom,
driver, sm, connectx, pmu, mcu, other) [DCGM Warning WARN, Failure CRIT], dcgm_hostengine_down [WARN],
dcgm_no_watches [WARN], dcgm_read_failed [WARN].
"""
from __future__ import annotations

import datetime
import math
import time

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_info import index_ranges
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_memory import (
    unreadable_text,
    unreadable_wait_fields,
)

SEVERITY_RANK = {"OK": 0, "WARN": 1, "CRIT": 2}

# Defaults of the fleet_check role (roles/fleet_check/defaults/main.yml), for callers without the role.
DEFAULT_CONFIG = {
    "expected_gpus": None,
    "ecc_uncorrected_volatile_max": 0,
    "ecc_uncorrected_aggregate_max": -1,
    "xid_severity": {"13": "WARN", "31": "WARN", "43": "WARN", "45": "WARN", "48": "CRIT", "61": "WARN",
                     "62": "CRIT", "63": "WARN", "64": "CRIT", "68": "WARN", "69": "CRIT", "74": "CRIT",
                     "79": "CRIT", "92": "WARN", "94": "WARN", "95": "CRIT", "109": "WARN", "119": "CRIT",
                     "120": "CRIT", "140": "CRIT", "154": "CRIT"},
    "xid_unknown_severity": "WARN",
    "throttle_reasons": ["hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"],
    "gpu_temp_warn_c": 85,
    "gpu_temp_crit_c": 90,
    "memory_temp_warn_c": 90,
    "memory_temp_crit_c": 95,
    "nvlink_errors_warn": 100,
    "expected_mig_mode": "disabled",
    "require_persistence": True,
    "idle_max_used_mib": 1024,
    "server_process_names": ["sglang"],
    "sglang_version": "",
    # A running server that does not answer and started less than this long ago (s) may still be loading.
    "loading_window_s": 900,
}


def _sev(value, default="WARN"):
    text = str(value or default).upper()
    return text if text in ("WARN", "CRIT") else default


def _num(value):
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def _reason(severity, code, text, gpu=None):
    return {"severity": severity, "gpu": gpu, "code": code, "text": text}


def _ran(result):
    """A registered result that ran (not skipped by a tag or a condition, not absent)."""
    return isinstance(result, dict) and bool(result) and not result.get("skipped")


def _config(config):
    merged = dict(DEFAULT_CONFIG)
    merged.update({k: v for k, v in (config or {}).items() if v is not None})
    return merged


def gpu_reasons(gpu_result, config=None, server_running=None, server_pids=None):
    """Reasons from an ``nvidia_gpu_info`` result (with ``processes`` and ``nvlink``).

    ``server_running``: bool or None (unknown: the sglang checks did not run), ``server_pids``: pids of the
    server and its workers (a GPU process outside them is foreign). Returns (reasons, gpus_total).
    """
    cfg = _config(config)
    reasons = []
    if not _ran(gpu_result):
        return reasons, None
    expected = cfg.get("expected_gpus")
    expected = int(expected) if expected not in (None, "") else None
    if "gpus" not in gpu_result:
        cls = gpu_result.get("error_class") or "gpu_query_failed"
        first = (str(gpu_result.get("msg") or "nvidia_gpu_info failed").strip().splitlines() or [""])[0]
        reasons.append(_reason("CRIT", cls, "GPUs not readable: %s" % first[:300]))
        return reasons, expected or 0
    gpus = gpu_result.get("gpus") or []
    count = int(gpu_result.get("gpu_count") or len(gpus))
    if expected is not None and count < expected:
        reasons.append(_reason("CRIT", "fewer_gpus", "%d GPU(s) visible, %d expected (gpufleet_expected_gpus); "
                               "a GPU fell off the bus or the driver lost it: check the kernel log for Xid 79"
                               % (count, expected)))
    unc_vol = int(cfg["ecc_uncorrected_volatile_max"])
    unc_agg = int(cfg["ecc_uncorrected_aggregate_max"])
    throttle = set(cfg["throttle_reasons"] or [])
    mig_want = str(cfg["expected_mig_mode"] or "disabled").lower()
    for gpu in gpus:
        i = gpu.get("index")
        vol = _num(gpu.get("ecc_errors_uncorrected_volatile_total"))
        if vol is not None and vol > unc_vol:
            reasons.append(_reason("CRIT", "ecc_uncorrected", "%d uncorrected ECC error(s) since the driver loaded"
                                   % vol, i))
        agg = _num(gpu.get("ecc_errors_uncorrected_aggregate_total"))
        if unc_agg >= 0 and agg is not None and agg > unc_agg:
            reasons.append(_reason("WARN", "ecc_uncorrected_aggregate",
                                   "%d uncorrected ECC error(s) over the GPU's life" % agg, i))
        if gpu.get("remapped_rows_pending"):
            reasons.append(_reason("CRIT", "remap_pending", "row remap pending: reset the GPU (or reboot)", i))
        if gpu.get("remapped_rows_failure"):
            reasons.append(_reason("CRIT", "remap_failure", "row remapping failed: the GPU needs service", i))
        if gpu.get("retired_pages_pending"):
            reasons.append(_reason("CRIT", "retired_pages_pending", "page retirement pending: reboot", i))
        active = [r for r in (gpu.get("clocks_event_reasons") or []) if r in throttle]
        if active:
            reasons.append(_reason("WARN", "throttle", "clocks slowed: %s" % ", ".join(active), i))
        for field, code, warn, crit, label in (
                ("temperature_gpu_c", "gpu_temperature", cfg["gpu_temp_warn_c"], cfg["gpu_temp_crit_c"], "GPU"),
                ("temperature_memory_c", "memory_temperature", cfg["memory_temp_warn_c"],
                 cfg["memory_temp_crit_c"], "memory")):
            temp = _num(gpu.get(field))
            if temp is None:
                continue
            if temp >= float(crit):
                reasons.append(_reason("CRIT", code, "%s temperature %d C >= %s C" % (label, temp, crit), i))
            elif temp >= float(warn):
                reasons.append(_reason("WARN", code, "%s temperature %d C >= %s C" % (label, temp, warn), i))
        width, width_max = _num(gpu.get("pcie_link_width_current")), _num(gpu.get("pcie_link_width_max"))
        gen, gen_max = _num(gpu.get("pcie_link_gen_current")), _num(gpu.get("pcie_link_gen_max"))
        idle = "gpu_idle" in (gpu.get("clocks_event_reasons") or [])
        # An idle GPU trains its link down to save power (gen drops); lanes never drop on a healthy link.
        if width is not None and width_max is not None and width < width_max:
            reasons.append(_reason("WARN", "pcie_degraded", "PCIe x%d of x%d" % (width, width_max), i))
        elif gen is not None and gen_max is not None and gen < gen_max and not idle:
            reasons.append(_reason("WARN", "pcie_degraded", "PCIe gen %d of %d while busy" % (gen, gen_max), i))
        links = gpu.get("nvlinks") or []
        down = [str(link.get("link")) for link in links if str(link.get("state") or "").lower() != "active"]
        if down:
            reasons.append(_reason("CRIT", "nvlink_down", "NVLink link(s) %s down" % ", ".join(down), i))
        errs = sum(int(_num(link.get(k)) or 0) for link in links
                   for k in ("replay_errors", "recovery_errors", "crc_flit_errors", "crc_data_errors"))
        if errs > int(cfg["nvlink_errors_warn"]):
            reasons.append(_reason("WARN", "nvlink_errors", "%d NVLink error counts (> %s)"
                                   % (errs, cfg["nvlink_errors_warn"]), i))
        if cfg["require_persistence"] and str(gpu.get("persistence_mode") or "").lower() == "disabled":
            reasons.append(_reason("WARN", "persistence_off", "persistence mode off (nvidia-smi -pm 1, or run "
                                   "nvidia-persistenced)", i))
        mig_cur = str(gpu.get("mig_mode_current") or "").lower()
        mig_pend = str(gpu.get("mig_mode_pending") or "").lower()
        if mig_cur and mig_cur not in ("n/a", "none") and mig_cur != mig_want:
            reasons.append(_reason("CRIT", "mig_mode", "MIG mode %s, expected %s (gpufleet_expected_mig_mode)"
                                   % (mig_cur, mig_want), i))
        elif mig_pend and mig_pend not in ("n/a", "none") and mig_cur and mig_pend != mig_cur:
            reasons.append(_reason("WARN", "mig_pending", "MIG mode becomes %s at the next GPU reset" % mig_pend, i))
    # Fields the restart's GPU memory wait reads: restart.yml refuses the host while one reads no number.
    for entry in unreadable_wait_fields(gpu_result):
        reasons.append(_reason("CRIT", "gpu_field_unreadable", "%s: a restart would be refused (its GPU memory wait "
                               "could not tell when memory is free); nvidia-smi -q -i %s, Xid in the kernel log, a "
                               "GPU reset or reboot" % (unreadable_text(entry), entry.get("index")), entry.get("index")))
    # Xid events of the window, by the severity map; unreadable is unknown, never "none".
    status = gpu_result.get("xid_status")
    if status == "unknown":
        reasons.append(_reason("WARN", "xid_unknown", "Xid events unknown: %s"
                               % (gpu_result.get("xid_reason") or "kernel log not readable")))
    for event in gpu_result.get("xid_events") or []:
        xid = event.get("xid")
        sev = _sev((cfg["xid_severity"] or {}).get(str(xid)) or (cfg["xid_severity"] or {}).get(xid),
                   _sev(cfg["xid_unknown_severity"]))
        reasons.append(_reason(sev, "xid_%s" % xid, (event.get("text") or "Xid %s" % xid)[:300],
                               event.get("gpu_index")))
    # Memory and processes, against the server the sglang checks found.
    idle_max = int(cfg["idle_max_used_mib"])
    if server_running is False:
        held = [g for g in gpus if (_num(g.get("memory_used_mib")) or 0) > idle_max]
        for g in held:
            reasons.append(_reason("WARN", "memory_held_no_server", "%d MiB used while no server runs (a leftover "
                                   "process or a leak blocks the next start)" % g["memory_used_mib"], g.get("index")))
    if server_pids is not None:
        mine = {int(p) for p in server_pids if p is not None}
        for g in gpus:
            for proc in g.get("processes") or []:
                if proc.get("kind") == "monitor" or proc.get("pid") in mine:
                    continue
                if proc.get("used_memory_mib") is None and "proc_fd" in (proc.get("source") or []) \
                        and len(proc.get("source") or []) == 1:
                    continue  # only an open device file, no memory: a query tool
                reasons.append(_reason("WARN", "foreign_gpu_process", "pid %s (%s) uses the GPU and is not the "
                                       "server" % (proc.get("pid"), proc.get("name") or "?"), g.get("index")))
    return reasons, count


def dcgm_reasons(dcgm):
    """Reasons from what ``dcgmi health -c -j`` said (the read's ``dcgm``, module_utils/gpufleet_dcgm.py): one per
    DCGM incident, a Warning WARN and a Failure CRIT, coded after DCGM's health system, with the GPU when the
    incident names one and DCGM's own message. dcgmi not installed: none; dcgmi that could not answer (no host
    engine, no watches set, a timeout, output that is not its JSON): one WARN, never CRIT on its own."""
    if not _ran(dcgm) or dcgm.get("status") in (None, "absent"):
        return []
    status = dcgm["status"]
    said = str(dcgm.get("msg") or "")[:300]
    if status == "hostengine_down":
        return [_reason("WARN", "dcgm_hostengine_down", "DCGM health not read: dcgmi cannot reach the host engine "
                        "(%s); start it (systemctl start nvidia-dcgm) or set fleet_check_dcgmi='' to not read DCGM"
                        % said)]
    if status == "no_watches":
        return [_reason("WARN", "dcgm_no_watches", "DCGM health not read: no health watch is set (%s); set them "
                        "once with `dcgmi health -s a` (they stay set in the host engine)" % said)]
    if status != "ok":
        rc = "" if dcgm.get("rc") is None else ", rc %s" % dcgm["rc"]
        return [_reason("WARN", "dcgm_read_failed", "DCGM health not read (dcgmi %s%s): %s" % (status, rc, said))]
    reasons = []
    for inc in dcgm.get("incidents") or []:
        health = inc.get("health")
        if health == "pass":
            continue
        system = inc.get("system") or "other"
        # dcgmi labels incidents DCGM raises for every system (Xid 79, ...) "Internal error": not a system's name.
        label = inc.get("system_text") if system != "other" else "health"
        where = "" if inc.get("gpu") is not None else "%s %s: " % (inc.get("entity_group"), inc.get("entity_id"))
        text = "%sDCGM %s %s: %s" % (where, label or "health", inc.get("health_text") or health,
                                     str(inc.get("message") or "no message")[:400])
        reasons.append(_reason("CRIT" if health == "fail" else "WARN", "dcgm_health_%s" % system, text,
                               inc.get("gpu")))
    if not reasons and dcgm.get("overall") in ("warn", "fail", "unknown"):
        reasons.append(_reason("CRIT" if dcgm["overall"] == "fail" else "WARN", "dcgm_health_other",
                               "DCGM overall health %s, no incident listed" % dcgm.get("overall_text")))
    return reasons


def _server_args_drift(args_info, server_info):
    """Names of ServerArgs fields whose running value differs from the inventory's (both by dest name)."""
    out = []
    want = (args_info or {}).get("dest_values") or {}
    for dest, value in sorted(want.items()):
        if dest not in server_info:
            continue
        have = server_info[dest]
        if isinstance(value, bool) or isinstance(have, bool):
            same = bool(value) == bool(have)
        elif _num(value) is not None and _num(have) is not None:
            same = _num(value) == _num(have)
        else:
            same = str(value) == str(have)
        if not same:
            out.append("%s=%r (inventory %r)" % (dest, have, value))
    return out


def _started_epoch(s):
    """(the server's start, the host's time when that was read), both Unix time from the host's clock, from the
    read's ``started`` (``create_time``, ``now``: psutil on the host); None for what it did not give."""
    result = s.get("started")
    if not _ran(result) or result.get("failed"):
        return None, None
    return _num(result.get("create_time")), _num(result.get("now"))


def _file_label(entry):
    """A patched file as the reasons name it: its path inside the sglang package, else its path."""
    return entry.get("relative") or entry.get("path") or "?"


def _block_state(entry):
    """``present`` (the patch would not change the file), ``missing`` (no block) or ``differs`` (other values,
    or the block sits elsewhere than the patch puts it)."""
    if not entry.get("changed"):
        return "present"
    return "missing" if entry.get("block") == "none" else "differs"


def worker_difference(worker):
    """What one worker's environment lacks or holds otherwise (str): "missing NCCL_PROTO; NCCL_ALGO=Tree, expected
    Ring"."""
    parts = []
    if worker.get("missing"):
        parts.append("missing " + ",".join(worker["missing"]))
    for name, seen in sorted((worker.get("mismatched") or {}).items()):
        if isinstance(seen, dict):
            parts.append("%s=%s, expected %s" % (name, seen.get("actual"), seen.get("expected")))
        else:
            parts.append("%s differs" % name)
    return "; ".join(parts) or worker.get("error") or "?"


def _block_difference(entry, wanted):
    """Which variables the file's block holds otherwise than ``wanted`` (str, short)."""
    have = entry.get("block_env") or {}
    wanted = wanted or {}
    diffs = ["%s is %s, wanted %s" % (name, repr(have[name]) if name in have else "unset",
                                      repr(wanted[name]) if name in wanted else "unset")
             for name in sorted(set(have) | set(wanted)) if have.get(name) != wanted.get(name)]
    return "; ".join(diffs)[:200] or "same values, in another place of the function"


def sglang_reasons(s, config=None):
    """Reasons and the ``sglang`` summary from the sglang/nccl gatherings.

    ``s``: dict with registered results ``health`` (uri /health_generate), ``server_info`` (uri
    /get_server_info, json), ``host`` (sglang_host_info: managed_pid, managed_running), ``args``
    (sglang_server_args_info), ``patch_present`` (sglang_nccl_patch in check mode with state present: its RV
    ``files`` says per patched file whether it would change, its block and mtime), ``workers``
    (sglang_worker_env_info),
    ``started`` (the server's start and the time of the read, Unix time, host clock). Missing or skipped keys are not
    judged.
    """
    cfg = _config(config)
    reasons = []
    summary = {}
    health, host = s.get("health"), s.get("host")
    running = None
    if _ran(host) and "managed_running" in host:
        running = bool(host.get("managed_running"))
        summary["server_pid"] = host.get("managed_pid")
        summary["server_running"] = running
    if _ran(health):
        status = int(health.get("status") or 0) if str(health.get("status") or "0").lstrip("-").isdigit() else 0
        summary["serving"] = status == 200
        summary["health_status"] = status
        if status != 200:
            seen = "no generation from %s (%s %s)" % (health.get("url") or "/health_generate", status,
                                                      str(health.get("msg") or "")[:120]
                                                      if status != 503 else "warming up or draining")
            started, host_now = _started_epoch(s)
            age = (host_now - started) if started is not None and host_now is not None else None
            if running and (age is None or age <= float(cfg["loading_window_s"])):
                # The managed server's process runs but does not answer, and started recently (or when is not
                # known): most often a model still loading (a slow start, or restart.yml's rollback left it
                # relaunched_loading). "Restart" would kill that load.
                when = (" since %s UTC (host clock, %.0f s ago)" % (
                    time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)), age) if age is not None else "")
                text = ("%s; the server (pid %s) runs%s: it may still be loading, run playbooks/check.yml again "
                        "to see when it serves; if it never does, read its log, then restart with "
                        "playbooks/restart.yml" % (seen, host.get("managed_pid"), when))
            elif running:
                text = ("%s; the server (pid %s) has run since %s UTC (host clock), longer than a load takes "
                        "(loading_window_s %s s), and does not answer: read its log, then restart with "
                        "playbooks/restart.yml" % (seen, host.get("managed_pid"), time.strftime(
                            "%Y-%m-%d %H:%M:%S", time.gmtime(started)), cfg["loading_window_s"]))
            else:
                text = "%s: restart with playbooks/restart.yml" % seen
            reasons.append(_reason("CRIT", "sglang_not_serving", text))
    info = s.get("server_info")
    info_json = info.get("json") if _ran(info) and isinstance(info.get("json"), dict) else None
    installed = None
    for src in (s.get("patch_present"), s.get("args")):
        if _ran(src) and src.get("sglang_version"):
            installed = src["sglang_version"]
            break
    summary["version_installed"] = installed
    if info_json is not None:
        running_version = info_json.get("version")
        summary["version_running"] = running_version
        if running_version and installed and str(running_version) != str(installed):
            reasons.append(_reason("WARN", "sglang_release", "server runs sglang %s, %s is installed: restart to run "
                                   "the installed release" % (running_version, installed)))
        drift = _server_args_drift(s.get("args"), info_json) if _ran(s.get("args")) else []
        summary["args_drift"] = drift
        if drift:
            reasons.append(_reason("WARN", "server_args_drift", "running server args differ from "
                                   "sglang_launch_args: %s; restart to apply" % "; ".join(drift)[:400]))
    want_version = str(cfg.get("sglang_version") or "")
    if want_version and installed and str(installed) != want_version:
        reasons.append(_reason("WARN", "sglang_release", "sglang %s installed, %s expected "
                               "(fleet_check_sglang_version)" % (installed, want_version)))
    # NCCL block in every file of the installed sglang that defines _set_envs_and_config (engine.py; on SGLang
    # after 0.5.23 also worker_launch.py, run instead when SGLANG_PRESPAWN_WORKERS=1): the patch module's check
    # mode says per file whether it would change it and what block the file holds now.
    present = s.get("patch_present")
    files = []
    if _ran(present):
        entries = [f for f in (present.get("files") or []) if isinstance(f, dict)]
        # A file the patch refuses (an ambiguous shape) carries only "error"; the others are still judged.
        files = [f for f in entries if "changed" in f]
        refused = [f for f in entries if "error" in f]
        if not files and (present.get("failed") or "changed" not in present or present.get("msg")):
            summary["nccl_block"] = "unknown"
            reasons.append(_reason("WARN", "nccl_check_failed", "NCCL block not checkable: %s"
                                   % str(present.get("msg") or "?").splitlines()[0][:300]))
        else:
            summary["nccl_files"] = {_file_label(f): _block_state(f) for f in files}
            summary["nccl_files"].update((_file_label(f), "unknown") for f in refused)
            missing = [f for f in files if _block_state(f) == "missing"]
            differs = [f for f in files if _block_state(f) == "differs"]
            summary["nccl_block"] = ("missing" if missing else "differs" if differs
                                     else "unknown" if refused else "present")
            if missing:
                reasons.append(_reason("CRIT", "nccl_block_missing", "the NCCL block is missing from %s (a reinstall "
                                       "of sglang removes it): run playbooks/patch.yml, then playbooks/restart.yml"
                                       % ", ".join(f.get("path") or "?" for f in missing)))
            if differs:
                reasons.append(_reason("CRIT", "nccl_block_values", "the NCCL block in %s does not hold "
                                       "sglang_nccl_env's values (%s): run playbooks/patch.yml, then "
                                       "playbooks/restart.yml" % (", ".join(f.get("path") or "?" for f in differs),
                                                                  _block_difference(differs[0], present.get("env")))))
            for entry in refused:
                reasons.append(_reason("WARN", "nccl_check_failed", "NCCL block not checkable in %s: %s"
                                       % (entry.get("path"), str(entry.get("error") or "?").splitlines()[0][:300])))
        # Hand-typed writes in _set_envs_and_config outside the block (issue 30): of the block's variables a
        # restart refuses them (or takes them over with sglang_nccl_patch_hand_edits=take_over); of others they
        # apply to the workers as typed.
        for hand in [h for h in (present.get("hand_edits") or []) if isinstance(h, dict)][:4]:
            if hand.get("action") not in ("refused", "reported"):
                continue
            effect = "; it overrides the NCCL block's value (after the start-method call)" if hand.get("after_anchor") else ""
            verdict_text = (": restart.yml refuses the host until it is removed or sglang_nccl_patch_hand_edits=take_over"
                            if hand.get("action") == "refused"
                            else ": sglang_nccl_env does not set that variable, the line applies")
            reasons.append(_reason("WARN", "nccl_hand_edit", "%s:%s: %s is typed by hand into _set_envs_and_config%s%s"
                                   % (hand.get("path"), hand.get("line"), str(hand.get("text"))[:160], effect,
                                      verdict_text)))
    workers = s.get("workers")
    if _ran(workers) and "workers" in workers:
        listed = workers.get("workers") or []
        bad = [w for w in listed if not w.get("match")]
        summary["workers"] = len(listed)
        summary["workers_nccl_ok"] = len(listed) - len(bad)
        if bad:
            names = ", ".join("%s (%s)" % (w.get("title"), worker_difference(w)) for w in bad[:4])
            reasons.append(_reason("CRIT", "nccl_worker_env", "%d of %d worker(s) lack the NCCL values: %s; "
                                   "restart with playbooks/restart.yml" % (len(bad), len(listed), names[:400])))
    # A patched file newer than the running server: the workers run with the block it had at the start.
    changed_after = []
    started, dummy = _started_epoch(s)
    mtimes = [(f, _num(f.get("mtime"))) for f in files]
    mtimes = [(f, m) for f, m in mtimes if m is not None]
    if mtimes and started is not None:
        summary["server_started_epoch"] = round(started, 1)
        summary["engine_mtime_epoch"] = round(max(m for dummy, m in mtimes), 1)
        changed_after = [f for f, m in mtimes if m > started + 1]
        # Both times come from the host's clock. A missing or wrong block already says "patch, then restart".
        if changed_after and summary.get("nccl_block") in (None, "present", "unknown"):
            reasons.append(_reason("WARN", "restart_needed", "%s changed after the server started: restart "
                                   "(playbooks/restart.yml) so the workers get the current NCCL block"
                                   % " and ".join(f.get("path") or "?" for f in changed_after)))
    return reasons, summary, running


def _gpu_summary(gpu, reasons):
    keys = ("index", "uuid", "name", "pci_bus_id", "memory_used_mib", "memory_total_mib", "utilization_gpu_pct",
            "temperature_gpu_c", "temperature_memory_c", "power_draw_w", "persistence_mode", "mig_mode_current",
            "ecc_errors_uncorrected_volatile_total", "remapped_rows_pending", "clocks_event_reasons")
    out = {k: gpu.get(k) for k in keys}
    mine = [r for r in reasons if r["gpu"] == gpu.get("index")]
    out["verdict"] = max([r["severity"] for r in mine] or ["OK"], key=SEVERITY_RANK.get)
    return out


# Parts of sglang_fleet_check_info (its option gather) and the tag of check.yml that selects each (--tags,
# --skip-tags). The server is read whenever another part is: the verdict of each needs it.
PART_TAGS = (("gpu", "gpu"), ("sglang", "sglang"), ("nccl_files", "nccl"), ("nccl_workers", "nccl"))
PARTS = ("server", "gpu", "sglang", "nccl_files", "nccl_workers")
# Parts read with become when fleet_check_become is on: the kernel log (Xid), other users' GPU processes and
# /proc/<pid>/environ. The others run SGLang's python (launch args, engine.py), which root must not run
# unchecked, or need no privilege.
BECOME_PARTS = ("gpu", "nccl_workers")
# The keys of a sglang_fleet_check_info result the verdict reads (each shaped as its own module's result).
READ_KEYS = ("host", "started", "gpu", "dcgm", "health", "server_info", "args", "patch_present", "workers")


def _tag_selected(tags, run_tags, skip_tags):
    """Whether a task tagged ``tags`` runs under ``ansible_run_tags`` / ``ansible_skip_tags`` (Ansible's rules for
    all, tagged and named tags)."""
    run = set(run_tags or ["all"])
    skip = set(skip_tags or [])
    if skip & tags or "tagged" in skip or "all" in skip:
        return False
    return "all" in run or "tagged" in run or bool(run & tags)


def check_reads(run_tags=None, skip_tags=None, become=False):
    """What check.yml reads on a host, as sglang_fleet_check_info's ``gather`` lists: ``{"login": [...],
    "become": [...]}``. ``run_tags``/``skip_tags``: ansible_run_tags and ansible_skip_tags (--tags gpu reads the
    server and the GPUs only). ``become`` (fleet_check_become): the parts in BECOME_PARTS go to a second call with
    become, made after the first (as the login user) has checked that root may run the interpreter; otherwise
    one call reads everything."""
    chosen = set(name for name, tag in PART_TAGS if _tag_selected({tag}, run_tags, skip_tags))
    parts = [name for name in PARTS if name in chosen or (name == "server" and chosen)]
    if not become:
        return {"login": parts, "become": []}
    return {"login": [p for p in parts if p not in BECOME_PARTS], "become": [p for p in parts if p in BECOME_PARTS]}


def merge_reads(reads):
    """One gathered dict (the keys of :func:`sglang_reasons`) from sglang_fleet_check_info results: one result or
    a list (the login call's, then the become call's; a skipped one is left out). ``root_code`` keeps the trust
    check's findings; ``read_failed`` the message of a call that returned no part (a task timeout, a module
    error); ``unreachable`` the message of a call the connection failed for."""
    merged = {}
    for read in (reads if isinstance(reads, (list, tuple)) else [reads]):
        if not _ran(read):
            continue
        if read.get("unreachable"):
            merged["unreachable"] = str(read.get("msg") or "")
            continue
        if read.get("root_code"):
            merged["root_code"] = read["root_code"]
        if "gathered" not in read:
            # The module returned no parts: it failed (a timeout, an interpreter that cannot run, a result that
            # could not be read). The task's failed_when: false leaves failed false, so its absence is the sign.
            stderr = str(read.get("module_stderr") or "").strip()
            merged["read_failed"] = str(read.get("msg") or stderr or "the module failed without a message") + (
                " (%s)" % stderr.splitlines()[-1][:300] if read.get("msg") and stderr else "")
        for key in READ_KEYS:
            if key in read:
                merged[key] = read[key]
    return merged


def gpufleet_check_verdict(gathered, config=None):
    """One host's verdict from what the fleet_check role read.

    ``gathered``: the sglang_fleet_check_info result (or a list of them, see :func:`merge_reads`), or a dict
    {"gpu": nvidia_gpu_info result, "health", "server_info", "host", "args", "patch_present", "workers",
    "started"} (see :func:`sglang_reasons`). A host a call could not reach is CRIT unreachable; one where root
    would run code another user can change is CRIT root_code_untrusted (nothing else was read); a call that read
    nothing is CRIT check_read_failed.
    """
    if isinstance(gathered, (list, tuple)) or "gathered" in (gathered or {}):
        gathered = merge_reads(gathered)
    gathered = gathered or {}
    if "unreachable" in gathered:
        return gpufleet_check_unreachable(gathered["unreachable"], _config(config).get("expected_gpus"))
    if gathered.get("root_code"):
        return gpufleet_check_root_code([e.get("text") for e in gathered["root_code"] if isinstance(e, dict)],
                                        _config(config).get("expected_gpus"))
    s_reasons, summary, running = sglang_reasons(gathered, config)
    if gathered.get("read_failed"):
        first = (gathered["read_failed"].strip().splitlines() or [""])[0][:300]
        s_reasons.append(_reason("CRIT", "check_read_failed", "the host could not be read: %s" % first))
    workers = gathered.get("workers")
    pids = None
    if _ran(workers) and _ran(gathered.get("host")) and running:
        pids = [gathered["host"].get("managed_pid")] + [w.get("pid") for w in workers.get("workers") or []]
    g_reasons, total = gpu_reasons(gathered.get("gpu"), config, server_running=running, server_pids=pids)
    reasons = g_reasons + dcgm_reasons(gathered.get("dcgm")) + s_reasons
    reasons.sort(key=lambda r: (-SEVERITY_RANK[r["severity"]], r["gpu"] if r["gpu"] is not None else -1, r["code"]))
    gpu_result = gathered.get("gpu")
    gpus = [_gpu_summary(g, reasons) for g in (gpu_result or {}).get("gpus") or []] if _ran(gpu_result) else []
    host_wide_gpu_crit = any(r["gpu"] is None and r["severity"] == "CRIT" and r["code"] in
                             ("fewer_gpus",) for r in g_reasons)
    ok = sum(1 for g in gpus if g["verdict"] == "OK")
    if total is None:
        total = len(gpus)
    if host_wide_gpu_crit:
        ok = min(ok, len(gpus))
    return {
        "verdict": max([r["severity"] for r in reasons] or ["OK"], key=SEVERITY_RANK.get),
        "reasons": reasons,
        "gpus_ok": ok,
        "gpus_total": max(total, len(gpus)),
        "gpus": gpus,
        "sglang": summary,
        "driver_version": (gpu_result or {}).get("driver_version") if _ran(gpu_result) else None,
    }


def gpu_list(indices):
    """GPU indices as people read them: ``[0, 1, 2, 5]`` -> ``"0\u20132, 5"`` (an en dash for a range)."""
    return index_ranges(indices, dash="\u2013", sep=", ")


def group_reasons(reasons):
    """The reasons as they are said (presentation only; the verdict keeps one reason per GPU): reasons of the same
    severity, code and text on several GPUs become one, ``{"severity", "code", "text", "gpus": [indices]}``
    (``gpus`` empty for a host-wide reason), in the order of each one's first reason. ``label`` is what follows the
    code: ``GPU 0\u20137: <text>`` (see :func:`gpu_list`), or the text alone for a host-wide reason."""
    out, at = [], {}
    for r in reasons or []:
        if not isinstance(r, dict):
            r = {"severity": "", "code": "", "text": str(r), "gpu": None}
        gpu = r.get("gpu")
        key = (r.get("severity"), r.get("code"), r.get("text"), gpu is None)
        if gpu is None or key not in at:
            entry = {"severity": r.get("severity"), "code": r.get("code"), "text": r.get("text"), "gpus": []}
            if gpu is not None:
                at[key] = entry
            out.append(entry)
        if gpu is not None and gpu not in at[key]["gpus"]:
            at[key]["gpus"].append(gpu)
    for entry in out:
        entry["label"] = ("GPU %s: %s" % (gpu_list(entry["gpus"]), entry["text"])) if entry["gpus"] \
            else str(entry["text"] or "")
    return out


def gpufleet_check_line(result):
    """The line check.yml says for one host: "VERDICT, GPUs ok/total: SEVERITY code [GPU 0\u20137: ]text | ...", the
    same reason on several GPUs said once with its GPUs (:func:`group_reasons`); a host judged root_code_untrusted
    (nothing else read) "CRIT: <why>"."""
    r = result or {}
    reasons = r.get("reasons") or []
    if len(reasons) == 1 and reasons[0].get("code") == "root_code_untrusted":
        return "%s: %s" % (r.get("verdict"), reasons[0].get("text"))
    line = "%s, GPUs %s/%s" % (r.get("verdict"), r.get("gpus_ok"), r.get("gpus_total"))
    if reasons:
        line += ": " + " | ".join("%s %s %s" % (x["severity"], x["code"], x["label"]) for x in group_reasons(reasons))
    return line


def gpufleet_check_unreachable(message, expected_gpus=None):
    """The verdict of a host that could not be reached (CRIT ``unreachable``)."""
    first = (str(message or "").strip().splitlines() or [""])[0][:300]
    total = int(expected_gpus) if expected_gpus not in (None, "") else 0
    return {"verdict": "CRIT", "reasons": [_reason("CRIT", "unreachable", "host not reachable over ssh%s"
                                                   % (": " + first if first else ""))],
            "gpus_ok": 0, "gpus_total": total, "gpus": [], "sglang": {}, "driver_version": None}


def gpufleet_check_root_code(texts, expected_gpus=None):
    """The verdict of a host whose reads with become were not run (CRIT ``root_code_untrusted``): root would run an
    interpreter another user can change (sglang_host_info's ``root_code`` texts, issue 31)."""
    texts = [str(t) for t in (texts or []) if str(t).strip()] or ["root would run code another user can change"]
    total = int(expected_gpus) if expected_gpus not in (None, "") else 0
    text = "not checked with become: %s" % " | ".join(t[:600] for t in texts[:3])
    return {"verdict": "CRIT", "reasons": [_reason("CRIT", "root_code_untrusted", text)],
            "gpus_ok": 0, "gpus_total": total, "gpus": [], "sglang": {}, "driver_version": None}


# The keys of one host's verdict (gpufleet_check_verdict's answer); the registered result of gpufleet_check_judge
# holds them beside the task's own (changed, msg).
VERDICT_KEYS = ("verdict", "reasons", "gpus_ok", "gpus_total", "gpus", "sglang", "driver_version")


def gpufleet_check_fleet(hostvars, targets, fact="fleet_check_result"):
    """host → verdict (:data:`VERDICT_KEYS`) for every targeted host, in target order; a host without a verdict, or
    whose verdict still waits for the call with become (``pending.become``), is CRIT (its check never finished:
    unreachable, or a task failed; the run's output names which)."""
    out = {}
    for host in targets or []:
        hv = hostvars.get(host) if hasattr(hostvars, "get") else None
        result = hv.get(fact) if hv is not None and hasattr(hv, "get") else None
        # A verdict that still waits for the call with become is not the host's: that call's play lost the host.
        if isinstance(result, dict) and result.get("verdict") and not (result.get("pending") or {}).get("become"):
            out[str(host)] = dict((key, result[key]) for key in VERDICT_KEYS if key in result)
        else:
            out[str(host)] = {"verdict": "CRIT", "reasons": [_reason(
                "CRIT", "unreachable", "no check result: the host could not be reached or its check stopped "
                "(see the run's output)")], "gpus_ok": 0, "gpus_total": 0, "gpus": [], "sglang": {},
                "driver_version": None}
    return out


def pending_steps(reads, become_reads=(), textfile_dir="", check_mode=False):
    """What check.yml still does on a host after a judged read (the plays after the read run only on the hosts
    that need them): ``become`` the parts a call with become reads (``become_reads``, none after a call with
    become), ``textfile`` the directory of gpufleet.prom ('' for none: not asked, check mode). Neither on a host
    the read could not reach, nor where root would run code another user can change."""
    merged = merge_reads(reads)
    if merged.get("unreachable") is not None or merged.get("root_code"):
        return {"become": [], "textfile": ""}
    return {"become": list(become_reads or []), "textfile": "" if check_mode else str(textfile_dir or "")}


def gpufleet_check_pending(hostvars, step, fact="fleet_check_result"):
    """The hosts (inventory order) whose registered verdict (``fact``) says ``step`` (``become`` or ``textfile``,
    see :func:`pending_steps`) is still to do: the host pattern of the play that does it."""
    out = []
    for host in (hostvars or {}):
        hv = hostvars.get(host) if hasattr(hostvars, "get") else None
        result = hv.get(fact) if hv is not None and hasattr(hv, "get") else None
        if isinstance(result, dict) and (result.get("pending") or {}).get(step):
            out.append(str(host))
    return out


def gpufleet_check_stats(fleet):
    """The set_stats ``gpufleet_check`` value: host → {verdict, reasons, gpus_ok, gpus_total}."""
    return {h: {"verdict": r["verdict"], "reasons": r["reasons"], "gpus_ok": r["gpus_ok"],
                "gpus_total": r["gpus_total"]} for h, r in (fleet or {}).items()}


def gpufleet_check_report(fleet, generated_at=None):
    """The check.json document: {"generated_at": ISO 8601 UTC, "hosts": {host: verdict}}."""
    when = generated_at or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"generated_at": when, "hosts": dict(fleet or {})}


def gpufleet_check_failing(fleet, fail_on="crit"):
    """Hosts whose verdict fails the run under ``fail_on`` (crit: CRIT; warn: WARN or CRIT; never: none)."""
    mode = str(fail_on or "crit").lower()
    if mode == "never":
        return []
    floor = SEVERITY_RANK["WARN"] if mode == "warn" else SEVERITY_RANK["CRIT"]
    return [h for h, r in (fleet or {}).items() if SEVERITY_RANK.get(r.get("verdict"), 2) >= floor]


def short_reasons(reasons, limit=3, width=90):
    """``CRIT ecc_uncorrected GPU 1, WARN gpu_temperature GPU 0\u20137 (+2)`` for the table: the reasons grouped
    (:func:`group_reasons`), the first ``limit`` by severity and code with their GPUs, then how many more."""
    groups = group_reasons(reasons)
    parts = ["%s %s%s" % (g["severity"], g["code"], " GPU %s" % gpu_list(g["gpus"]) if g["gpus"] else "")
             for g in groups[:limit]]
    text = ", ".join(parts)
    if len(groups) > limit:
        text += " (+%d)" % (len(groups) - limit)
    return text if len(text) <= width else text[:width - 3] + "..."


def gpufleet_check_report_rows(fleet):
    """The hosts of the HTML report, worst first (CRIT, WARN, OK; then by host name): each its verdict's keys
    plus ``host`` and ``reason_groups`` (:func:`group_reasons`: the same reason on several GPUs once, with its
    GPUs)."""
    rows = []
    for host, r in (fleet or {}).items():
        row = dict(r or {})
        row["host"] = str(host)
        row["verdict"] = row.get("verdict") if row.get("verdict") in SEVERITY_RANK else "CRIT"
        row["reason_groups"] = group_reasons(row.get("reasons"))
        rows.append(row)
    rows.sort(key=lambda row: (-SEVERITY_RANK[row["verdict"]], row["host"]))
    return rows


def gpufleet_check_table(fleet):
    """Fixed-width table: host, verdict, gpus (ok/total), reasons (short); a count line at the end."""
    lines = [("host", "verdict", "gpus", "reasons")]
    counts = {"OK": 0, "WARN": 0, "CRIT": 0}
    for host, r in (fleet or {}).items():
        verdict = r.get("verdict") or "CRIT"
        counts[verdict] = counts.get(verdict, 0) + 1
        lines.append((str(host), verdict, "%s/%s" % (r.get("gpus_ok", 0), r.get("gpus_total", 0)),
                      short_reasons(r.get("reasons")) or "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    body = "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(line)).rstrip() for line in lines)
    return body + "\n%d host(s): %d OK, %d WARN, %d CRIT" % (len(fleet or {}), counts["OK"], counts["WARN"],
                                                             counts["CRIT"])
