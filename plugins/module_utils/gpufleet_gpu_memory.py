# -*- coding: utf-8 -*-
# gpufleet: what the GPU memory wait after the stop needs to read, and what it should wait for.
"""Decisions around the wait for GPU memory (issue 30), as plain functions of nvidia_gpu_info's result.

* :func:`unreadable_wait_fields` -- the fields the wait reads (``memory.used``, ``memory.total``, the compute-apps
  list with its ``pid`` and ``used_memory``) that a GPU cannot report now: preflight refuses the host on them (the
  wait would fail at once after the stop), check.yml names them.
* :func:`foreign_memory` -- per GPU, memory held while the server runs that no process nvidia-smi / NVML lists
  accounts for (a container's process in another PID namespace): the old server runs beside it, so the wait after
  the stop waits for the server's own memory (each GPU back to that memory plus ``max_used_mib``), not for an empty
  GPU that will never come.
* :func:`tp_balance_problem` -- whether SGLang would refuse to start beside that memory: its TP memory-balance check
  (sglang/srt/distributed/bootstrap.py ``_check_tp_memory_balance``, 0.5.23; ``ModelRunner`` in earlier releases)
  raises "The memory capacity is unbalanced" when the least free GPU of the world has under 0.9 of a rank's own free
  memory, unless ``SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK`` is false.
* :func:`wait_limit` -- the wait's limit for one GPU with such a baseline.

Nothing here imports Ansible.
"""
from __future__ import annotations

#: nvidia_gpu_info keys the wait reads per GPU -> the nvidia-smi field name (NVML: nvmlDeviceGetMemoryInfo).
WAIT_GPU_FIELDS = (("memory_used_mib", "memory.used"), ("memory_total_mib", "memory.total"))
#: Keys of a GPU's ``unsupported`` map for the compute-apps list (set by the backends) -> field named to the user.
APPS_FIELDS = {"compute_apps": "the compute-apps list", "compute_apps.pid": "compute-apps pid",
               "compute_apps.used_memory": "compute-apps used_memory"}
#: SGLang's factor: every rank's free memory before the load must be at least this share of the least free one's.
TP_BALANCE_FACTOR = 0.9
TP_BALANCE_ENV = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"
_FALSE_WORDS = ("0", "false", "no", "off", "n", "f")

UNREADABLE_TODO = ("What to do: the old server keeps serving meanwhile. Look at the GPU with `nvidia-smi -q -i "
                   "<index>` and for Xid errors (`dmesg | grep -i xid`); a memory field that reads [N/A] or "
                   "[Unknown Error] usually needs a GPU reset (`nvidia-smi -r -i <index>` once nothing runs on it) "
                   "or a reboot. Then rerun.")


def unreadable_wait_fields(gpu_info):
    """``[{"index", "uuid", "field", "raw"}]``: every field the wait after the stop needs that a GPU of
    ``gpu_info`` (nvidia_gpu_info's result, with processes) cannot report; ``raw`` is what was read ("[N/A]",
    "[Unknown Error]", an NVML error). A key missing from a GPU entry (not asked for) is not unreadable."""
    out = []
    for gpu in (gpu_info or {}).get("gpus") or []:
        raw = gpu.get("unsupported") or {}
        for key, field in WAIT_GPU_FIELDS:
            if key in gpu and gpu[key] is None:
                out.append({"index": gpu.get("index"), "uuid": gpu.get("uuid"), "field": field,
                            "raw": raw.get(key) or "?"})
        for key, field in sorted(APPS_FIELDS.items()):
            if key in raw:
                out.append({"index": gpu.get("index"), "uuid": gpu.get("uuid"), "field": field, "raw": raw[key]})
    return out


def unreadable_text(entry):
    """One entry of :func:`unreadable_wait_fields` in words: "GPU 3 (GPU-...): memory.used unreadable (reads '[N/A]')"."""
    return "GPU %s (%s): %s unreadable (reads %r)" % (entry.get("index"), entry.get("uuid") or "?", entry["field"],
                                                      entry.get("raw"))


def unreadable_refusal(entries):
    """Preflight's refusal for :func:`unreadable_wait_fields` entries ('' for none)."""
    if not entries:
        return ""
    return ("GPU memory unreadable: %s. The wait after the stop reads these to tell when the old server's memory "
            "is free; it would fail at once and leave the host without a server. %s"
            % ("; ".join(unreadable_text(e) for e in entries), UNREADABLE_TODO))


def foreign_memory(gpus, max_used_mib):
    """``{str(index): MiB}`` of memory the wait should leave alone: per GPU of ``gpus`` (the ``gpus`` list of
    sglang_host_info's ``gpu_after_stop``) whose ``remaining_mib`` (used minus the stop set's listed memory) is over
    ``max_used_mib`` although no listed process outside the stop set holds it, and whose accounting is complete or
    is not expected to be freed by the stop. Keys are strings (Ansible passes dict keys as strings)."""
    out = {}
    for gpu in gpus or []:
        left = gpu.get("remaining_mib")
        if left is None or left <= max_used_mib or gpu.get("foreign_listed"):
            continue
        if gpu.get("accounting") != "complete" and gpu.get("held_by_stop_set"):
            continue  # nothing tells the server's memory from another's: the stop is expected to free it
        out[str(gpu["index"])] = int(left)
    return out


def wait_limit(index, max_used_mib, baseline_mib=None):
    """The most MiB GPU ``index`` may show for the wait to count it free: ``max_used_mib`` plus what others held
    there while the old server ran (``baseline_mib``, keys str or int)."""
    base = baseline_mib or {}
    extra = base.get(str(index), base.get(index, 0)) if isinstance(base, dict) else 0
    return int(max_used_mib) + int(extra or 0)


def baseline_text(baseline_mib):
    """"GPU 3: 20018 MiB" for each GPU of a baseline, in index order ('' for none)."""
    items = sorted(((int(k), int(v)) for k, v in (baseline_mib or {}).items()), key=lambda kv: kv[0])
    return ", ".join("GPU %d: %d MiB" % kv for kv in items)


def _check_off(env):
    value = (env or {}).get(TP_BALANCE_ENV)
    return value is not None and str(value).strip().lower() in _FALSE_WORDS


def tp_balance_problem(gpus, baseline_mib, world_size, env=None):
    """Why SGLang would refuse to start beside ``baseline_mib`` ('' when it would not).

    ``gpus``: sglang_host_info's ``gpu_after_stop.gpus`` (``index``, ``memory_total_mib``, ``memory_reserved_mib``,
    ``held_by_stop_set``); only the GPUs the old server holds count (its world). Free memory after the stop is total
    - reserved - baseline per GPU. ``world_size``: tp-size x pp-size (1: no check, SGLang checks only a distributed
    world). ``env``: the server's extra environment (the check can be switched off there).
    """
    if not baseline_mib or int(world_size or 1) <= 1 or _check_off(env):
        return ""
    free = {}
    for gpu in gpus or []:
        total = gpu.get("memory_total_mib")
        if total is None or not gpu.get("held_by_stop_set"):
            continue
        free[gpu["index"]] = int(total) - int(gpu.get("memory_reserved_mib") or 0) - wait_limit(gpu["index"], 0,
                                                                                                baseline_mib)
    if len(free) < 2:
        return ""
    least = min(free, key=lambda i: free[i])
    most = max(free, key=lambda i: free[i])
    if free[least] >= TP_BALANCE_FACTOR * free[most]:
        return ""
    return ("memory held by processes no GPU list names (%s) leaves GPU %d %d MiB free against %d MiB on GPU %d: "
            "SGLang refuses to start a server with tp-size x pp-size %d when a GPU has less than %.0f %% of another's "
            "free memory (\"The memory capacity is unbalanced. Some GPUs may be occupied by other processes\"), so "
            "neither the new server nor the old one could start after the stop. What to do: end what holds that "
            "memory (it runs in another container or PID namespace: `nvidia-smi` on the host, `fuser -v /dev/nvidia*` "
            "as root) and rerun; or, if the server is known to fit beside it, set %s=false in "
            "sglang_launch_extra_env and rerun"
            % (baseline_text(baseline_mib), least, free[least], free[most], most, int(world_size),
               TP_BALANCE_FACTOR * 100, TP_BALANCE_ENV))


#: MiB a GPU must have free beyond the old server's own footprint for the rollback to relaunch it beside others.
FIT_MARGIN_MIB = 1024


def server_footprint(gpu):
    """MiB the old server held on one GPU of sglang_host_info's ``gpu_after_stop.gpus`` (preflight, while it ran):
    its processes' listed memory when the accounting is complete, else all the GPU's used memory less what others
    held there (a server whose memory no list names in full). None when the GPU was not the server's."""
    if not gpu.get("held_by_stop_set"):
        return None
    if gpu.get("accounting") == "complete" and gpu.get("stop_set_mib"):
        return int(gpu["stop_set_mib"])
    used = gpu.get("memory_used_mib")
    return None if used is None else int(used)


def rollback_fit(wait_gpus, server, margin_mib=FIT_MARGIN_MIB):
    """Whether the rollback may relaunch the previous server although its wait for GPU memory ran out.

    The wait ran out because memory stayed held that preflight did not see (another job took GPU memory after
    preflight, while the host was between servers). Relaunched into GPUs too full, a server runs out of memory
    (on a real host only after loading its weights), so it goes ahead only when every GPU the old server used has,
    free now, what that server held there (``server_footprint``) plus ``margin_mib``, and SGLang's TP
    memory-balance check would pass (:func:`tp_balance_problem`'s rule over the free memory now).

    ``wait_gpus``: nvidia_gpu_wait's ``gpus`` (``index``, ``memory_used_mib``, ``memory_total_mib``,
    ``memory_reserved_mib``); ``server``: ``{"gpus": gpu_after_stop.gpus, "world_size": tp x pp, "env": the
    server's extra environment}`` as preflight measured them while the old server ran.
    Returns ``{"fits": bool, "text": str}``: the sentence says what was free against what the server held (for the
    note), or why it does not fit; ``fits`` is False with an empty text when nothing is known (no preflight
    measurement, a GPU unread), so the rollback keeps refusing as before.
    """
    server = server if isinstance(server, dict) else {}
    need = {}
    for gpu in server.get("gpus") or []:
        mib = server_footprint(gpu)
        if mib is not None:
            need[int(gpu["index"])] = mib
    now = {int(g["index"]): g for g in wait_gpus or [] if isinstance(g, dict) and "index" in g}
    if not need or any(i not in now for i in need):
        return {"fits": False, "text": ""}
    free, short = {}, []
    for index in sorted(need):
        g = now[index]
        if g.get("memory_used_mib") is None or g.get("memory_total_mib") is None:
            return {"fits": False, "text": ""}
        free[index] = int(g["memory_total_mib"]) - int(g.get("memory_reserved_mib") or 0) - int(g["memory_used_mib"])
        if free[index] < need[index] + int(margin_mib):
            short.append("GPU %d: %d MiB free, the previous server held %d MiB" % (index, free[index], need[index]))
    if short:
        return {"fits": False, "text": "the previous server would not fit beside it (%s)" % "; ".join(short)}
    world = int(server.get("world_size") or 1)
    if world > 1 and len(free) > 1 and not _check_off(server.get("env")):
        least = min(free, key=lambda i: free[i])
        most = max(free, key=lambda i: free[i])
        if free[least] < TP_BALANCE_FACTOR * free[most]:
            return {"fits": False, "text": (
                "the previous server would not start beside it: GPU %d has %d MiB free against %d MiB on GPU %d, "
                "and SGLang refuses a tp-size x pp-size %d world when a GPU has less than %.0f %% of another's free "
                "memory" % (least, free[least], free[most], most, world, TP_BALANCE_FACTOR * 100))}
    widest = max(need.values())
    return {"fits": True, "text": (
        "GPU memory others took after preflight stayed held through the wait, but every GPU the previous server "
        "used has what it held there free (least: %d MiB free for at most %d MiB), so it was relaunched beside it"
        % (min(free.values()), widest))}
