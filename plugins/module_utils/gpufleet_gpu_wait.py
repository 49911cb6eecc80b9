# -*- coding: utf-8 -*-
# gpufleet: the GPU memory wait of a module run (nvidia_gpu_wait, and sglang_stop's optional wait after the stop).
"""Wait on the target until GPU memory is released, as a module does it: validate the options, open one backend
session (:func:`gpufleet_gpu.backend_session`), poll (:func:`gpufleet_gpu.wait_for_memory`), and on timeout name
every GPU still over the limit with its processes (:func:`timeout_message`).

Two ways to end: :func:`wait_or_fail` for ``nvidia_gpu_wait`` (the module fails with ``error_class``
``not_released`` or the backend's class), :func:`wait_recorded` for a module whose own work is done and that
only reports the wait (``sglang_stop``): errors become keys of the returned mapping, nothing raises.
Options (:data:`WAIT_OPTIONS`, the ``argument_spec`` of nvidia_gpu_wait and of sglang_stop's ``gpu_wait``):
``gpus``, ``max_used_mib``, ``require_no_processes``, ``poll_interval_ms``, ``timeout_s``, ``slice_s``,
``started_at``, ``expected_count``, ``backend``, ``baseline_mib`` (``{GPU index: MiB}`` others held while the old
server ran: such a GPU counts as free at that plus ``max_used_mib``; sglang_preflight measures it).
"""
from __future__ import annotations

import os
import time

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu import (
    BACKEND_CHOICES,
    GpuError,
    gpu_processes,
    resolve_selectors,
    wait_for_memory,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_memory import baseline_text, wait_limit
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import MissingLibraryError

WAIT_OPTIONS = dict(
    gpus=dict(type="list", elements="raw", default=[]),
    max_used_mib=dict(type="int", default=1024),
    require_no_processes=dict(type="bool", default=False),
    poll_interval_ms=dict(type="int", default=50),
    timeout_s=dict(type="float", default=120),
    slice_s=dict(type="float"),
    started_at=dict(type="float"),
    expected_count=dict(type="int"),
    backend=dict(type="str", choices=list(BACKEND_CHOICES), default="auto"),
    baseline_mib=dict(type="dict", default={}),
)

_CMDLINE_MAX = 160


def _short(text, limit=_CMDLINE_MAX):
    if text is None:
        return "(command line not readable: process gone or outside this PID namespace)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _proc_text(p):
    mem = " (%s MiB)" % p["used_memory_mib"] if p.get("used_memory_mib") is not None else ""
    return "pid %d%s: %s" % (p["pid"], mem, _short(p.get("cmdline") or p.get("name")))


def timeout_message(outcome, gpus, max_used_mib, timeout_s, require_no_processes=False, device_holders=None,
                    baseline_mib=None):
    """Operator message for a timeout: each busy GPU, its MiB and its processes (pid, cmdline).

    Processes the backend lists on that GPU (they own its memory) come first; processes that only have
    its /dev/nvidia<N> open follow separately -- every CUDA process opens the node of every visible GPU,
    and monitors hold them too, so they are candidates, not proven memory owners. When no GPU has a listed
    compute process, the fd holders are named instead (per-GPU holders, then holders of only the shared
    nodes nvidiactl / nvidia-uvm), so the operator always has pids to look at.
    """
    parts = []
    any_owner = False
    for gpu in gpus:
        if gpu["free"]:
            continue
        procs = gpu.get("processes") or []
        owners = [p for p in procs if any(s != "proc_fd" for s in p.get("source", ()))]
        others = [p for p in procs if p not in owners and p.get("kind") != "monitor"]
        monitors = [p for p in procs if p not in owners and p.get("kind") == "monitor"]
        if owners:
            any_owner = True
            held = "held by " + "; ".join(_proc_text(p) for p in owners)
        else:
            held = ("no compute process listed by %s (from a container without the host PID namespace, "
                    "look on the host; or the driver has not finished releasing the memory)"
                    % outcome.get("backend", "the backend"))
        if others:
            held += "; device also open in " + "; ".join(_proc_text(p) for p in others)
        if monitors:
            held += "; monitors with it open (they hold no memory, leave them): " + "; ".join(
                _proc_text(p) for p in monitors)
        base = wait_limit(gpu["index"], 0, baseline_mib)
        parts.append("GPU %d (%s): %s MiB used%s, %s" % (
            gpu["index"], gpu["uuid"], gpu["memory_used_mib"],
            " (%d MiB of it held by others while the old server ran)" % base if base else "", held))
    condition = "at most %d MiB used%s per GPU%s" % (
        max_used_mib, " and no compute process" if require_no_processes else "",
        " beyond what others held while the old server ran (%s)" % baseline_text(baseline_mib)
        if baseline_mib else "")
    if any_owner:
        todo = ("Stop these processes (role sglang_stop, or kill the pids listed) and run again; "
                "raise timeout_s if the release is just slow.")
    else:
        holders = [h for h in device_holders or () if h.get("kind") != "monitor"]
        per_gpu = [h for h in holders if h.get("kind") == "gpu"]
        shared = [h for h in holders if h.get("kind") == "shared_only"]
        named = []
        if per_gpu:
            named.append("processes with a GPU device open: " + "; ".join(_proc_text(h) for h in per_gpu))
        if shared:
            named.append("processes holding only the shared nodes (nvidiactl, nvidia-uvm): "
                         + "; ".join(_proc_text(h) for h in shared))
        if named:
            todo = ("No compute process is listed; the candidates are the %s. Stop those that belong to the "
                    "old server (role sglang_stop) and run again; raise timeout_s if the release is just slow."
                    % " | ".join(named))
        else:
            todo = ("No process with /dev/nvidia* open is visible from here either: look on the host "
                    "(`nvidia-smi`, `fuser -v /dev/nvidia*` as root); raise timeout_s if the release is just slow.")
    return ("GPU memory not released after %s s (wanted %s; %d polls). %s. %s"
            % (timeout_s, condition, outcome["polls"], " | ".join(parts), todo))


def run_wait(backend, params, fallback_reason=None, exclude_pids=None, started_at=None, now=time.time):
    """Run the wait (or one slice of it) with module-shaped ``params``; returns ``(ok, result, msg)``.

    ``ok`` is False only when the whole wait (``timeout_s`` from ``started_at``) ran out; a slice that ends
    with time left returns ok with ``ready`` False. Plain function (no Ansible needed).
    """
    indices = resolve_selectors(params["gpus"], backend.inventory())
    started_at = now() if started_at is None else float(started_at)
    before = max(0.0, now() - started_at)
    baseline = params.get("baseline_mib") or {}
    outcome = wait_for_memory(backend, indices, params["max_used_mib"], params["require_no_processes"],
                              params["poll_interval_ms"], params["timeout_s"], slice_s=slice_length(params),
                              elapsed_before_s=before, baseline_mib=baseline)
    busy = set(outcome["busy"])
    gpus = []
    for m in outcome["memory"]:
        row = dict(m)
        row["free"] = m["index"] not in busy
        row["processes"] = []
        gpus.append(row)
    holders = None
    final_timeout = bool(busy) and not outcome["slice_ended"]
    if final_timeout or (outcome["processes"] and not busy):
        # Name the holders: on timeout for the operator, and when the process list was read anyway.
        per_gpu, holders = gpu_processes(backend, indices, exclude_pids=exclude_pids)
        for row in gpus:
            row["processes"] = per_gpu.get(row["index"], [])
    result = {
        "changed": False,
        "backend": backend.name,
        "backend_fallback_reason": fallback_reason,
        "elapsed_ms": outcome["elapsed_ms"],
        "polls": outcome["polls"],
        "max_used_mib": params["max_used_mib"],
        "gpus": gpus,
        "ready": outcome["ready"],
        "started_at": round(started_at, 3),
        "progress": outcome["progress"],
        "baseline_mib": baseline,
    }
    if not final_timeout:
        return True, result, None
    outcome["backend"] = backend.name
    result["device_holders"] = holders or []
    result["error_class"] = "not_released"
    return False, result, timeout_message(outcome, gpus, params["max_used_mib"], params["timeout_s"],
                                          params["require_no_processes"], holders, baseline)


# A slice lasts at least timeout_s / MAX_SLICES, so a whole wait takes at most about this many calls: the
# gpu_memory_wait role chains its slices by a recursive include_tasks, and ansible-core's play iterator recurses once
# per level. About 245 levels deep (-e gpu_memory_wait_slice_s=0.05, memory not released) ansible-playbook died with
# "Exceeded maximum object depth ... maximum recursion depth exceeded" after the stop: no rescue and no rollback
# ran, and the host served nothing.
MAX_SLICES = 100


def slice_length(params):
    """Seconds one call waits at most (None: the whole timeout_s): ``slice_s``, longer where ``timeout_s`` would
    otherwise take more than :data:`MAX_SLICES` calls."""
    if params.get("slice_s") is None:
        return None
    return max(float(params["slice_s"]), float(params["timeout_s"]) / MAX_SLICES)


def bad_option(params):
    """The message for the first invalid wait option in ``params``, or None."""
    if params["poll_interval_ms"] < 1:
        return "poll_interval_ms must be at least 1 (got %d)" % params["poll_interval_ms"]
    for key in ("timeout_s", "max_used_mib", "slice_s", "expected_count"):
        if params.get(key) is not None and params[key] < 0:
            return "%s must be 0 or more (got %s)" % (key, params[key])
    return None


def _budget(params, started_at, now=time.time):
    """Seconds this call may wait: what is left of ``timeout_s`` since ``started_at``, at most ``slice_s``."""
    left = max(0.0, params["timeout_s"] - max(0.0, now() - started_at))
    return left if params.get("slice_s") is None else min(left, slice_length(params))


def wait_or_fail(module, params):
    """nvidia_gpu_wait's whole run for ``params`` (:data:`WAIT_OPTIONS`): exit_json when ready or when a slice
    ended with time left, fail_json with ``error_class`` otherwise."""
    problem = bad_option(params)
    if problem:
        module.fail_json(msg=problem, error_class="bad_option")
    started_at = params["started_at"] if params["started_at"] is not None else time.time()
    ok, result, msg = G.run_on_backend(module, lambda backend, reason: run_wait(
        backend, params, reason, exclude_pids={os.getpid()}, started_at=started_at),
        timeout_s=_budget(params, started_at), expected_count=params["expected_count"])
    if not ok:
        module.fail_json(msg=msg, **result)
    module.exit_json(**result)


def wait_recorded(params, smi_path, started_at=None, now=time.time):
    """The same wait for a module that must not fail because of it (sglang_stop after its processes are gone).

    Returns run_wait's result mapping plus ``msg``: on success ``ready`` (bool; false when ``slice_s`` ended with
    time left), ``started_at``, ``elapsed_ms``, ``polls``, ``progress``, ``gpus``; when the whole wait ran out,
    also ``error_class`` ``not_released`` and the operator message; on a backend failure ``ready`` false,
    ``error_class`` (the backend's class, ``missing_library``, ``bad_option``) and ``msg``. The caller's next
    step (the gpu_memory_wait role) goes on from ``started_at`` and reports any failure itself.
    """
    started_at = now() if started_at is None else float(started_at)
    base = {"ready": False, "started_at": round(started_at, 3), "elapsed_ms": None, "polls": 0,
            "progress": None, "gpus": [], "max_used_mib": params["max_used_mib"], "backend": params["backend"],
            "error_class": None, "msg": None}
    problem = bad_option(params)
    if problem:
        base.update(error_class="bad_option", msg=problem)
        return base
    try:
        ok, result, msg = G.backend_session(params["backend"], smi_path, lambda backend, reason: run_wait(
            backend, params, reason, exclude_pids={os.getpid()}, started_at=started_at),
            timeout_s=_budget(params, started_at, now), expected_count=params["expected_count"])
    except MissingLibraryError as exc:
        from ansible.module_utils.basic import missing_required_lib
        base.update(error_class="missing_library", msg=missing_required_lib(exc.library))
        return base
    except GpuError as exc:
        base.update(exc.fail_kwargs())
        base["elapsed_ms"] = int(round(max(0.0, now() - started_at) * 1000))
        return base
    base.update(result)
    base["msg"] = msg if not ok else result.get("progress")
    return base
