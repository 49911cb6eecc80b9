# -*- coding: utf-8 -*-
# gpufleet: the nvidia_gpu_info read as plain functions (nvidia_gpu_info and sglang_fleet_check_info call them).
from __future__ import annotations

import json
import os

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu import (
    GPU_FIELDS,
    SMI_GPU_QUERY,
    GpuError,
    backend_session,
    gpu_processes,
    resolve_selectors,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_kmsg import DEFAULT_KMSG_PATH, xid_report

# Failures after which the kernel log is worth reading into the message.
XID_ON_FAIL = {"driver_not_loaded", "driver_mismatch", "no_devices", "fewer_gpus", "gpu_lost",
               "device_handle_error", "timeout", "backend_error"}


def attach_xid(report, inventory):
    """Add ``gpu_index`` to each Xid event of ``report`` (by PCI bus id); returns ``report``."""
    by_bus = {(g.get("pci_bus_id") or "").upper(): g["index"] for g in inventory}
    for event in report.get("xid_events") or ():
        event["gpu_index"] = by_bus.get(event["pci_bus_id"].upper())
    return report


def xid_text(report):
    """One line about the Xid events of ``report`` for a failure message."""
    if report["xid_events"] is None:
        return "Xid events: %s" % (report.get("xid_reason") or report["xid_status"])
    if not report["xid_events"]:
        return "Xid events: none in the kernel log (%s)." % report["xid_source"]
    return "Xid events (%s): %s" % (report["xid_source"], "; ".join(
        "%s %s" % (e["time"], e["text"]) for e in report["xid_events"][-5:]))


# The lists a GPU entry can carry besides GPU_FIELDS, and the nvidia-smi --query-gpu name of each field.
LIST_FIELDS = ("nvlinks", "processes")
SMI_NAMES = {smi: key for smi, key, dummy in SMI_GPU_QUERY if key in GPU_FIELDS}


def resolve_fields(names):
    """The GPU entry keys ``names`` (list of str: keys, nvidia-smi --query-gpu names, ``nvlinks``,
    ``processes``) ask for, ``index`` first, without repeats; ``None`` for an empty list (every field).

    Raises ValueError naming the unknown names and the names there are.
    """
    if not names:
        return None
    keys, unknown = ["index"], []
    for name in names:
        key = SMI_NAMES.get(name, name)
        if key not in GPU_FIELDS and key not in LIST_FIELDS or key == "unsupported":
            unknown.append(name)
        elif key not in keys:
            keys.append(key)
    if unknown:
        raise ValueError("fields: %s not a GPU field. Fields are the keys of gpus (%s, %s) or their nvidia-smi "
                         "--query-gpu names (%s)" % (", ".join(repr(n) for n in unknown),
                                                     ", ".join(k for k in GPU_FIELDS if k != "unsupported"),
                                                     ", ".join(LIST_FIELDS), ", ".join(SMI_NAMES)))
    return keys


def only_fields(gpus, keys):
    """``gpus`` cut to ``keys`` (from :func:`resolve_fields`; None keeps everything); ``unsupported`` keeps the
    raw answers of those keys only, and is left out when none of them is unsupported."""
    if keys is None:
        return gpus
    out = []
    for gpu in gpus:
        cut = {k: gpu[k] for k in keys if k in gpu}
        unsupported = {k: v for k, v in (gpu.get("unsupported") or {}).items()
                       if k in keys or ("processes" in keys and k.startswith("compute_apps"))}
        if unsupported:
            cut["unsupported"] = unsupported
        out.append(cut)
    return out


def index_ranges(indices, dash="-", sep=","):
    """GPU indices as ranges: ``[0, 1, 2, 5]`` -> ``"0-2,5"`` (sorted, repeats dropped); ``dash`` and ``sep`` for
    text written for people (``"0\u20132, 5"``). Values that are not whole numbers are listed as they are, last."""
    numbers = sorted({int(i) for i in indices if isinstance(i, int) and not isinstance(i, bool)})
    others = [str(i) for i in indices if not (isinstance(i, int) and not isinstance(i, bool))]
    parts = []
    for n in numbers:
        if parts and parts[-1][1] == n - 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    text = [str(a) if a == b else "%d%s%d" % (a, dash if b > a + 1 else sep, b) for a, b in parts]
    return sep.join(text + others)


def _same_key(value):
    """A comparable form of a GPU field's value (lists and dicts included)."""
    return json.dumps(value, sort_keys=True, default=str)


def short_form(gpus):
    """The ``detail: short`` answer for the GPU entries ``gpus`` (list of dict with ``index``):
    ``{"gpus_same": {key: value on every GPU}, "gpu_groups": [{"gpus": "0-5", key: value, ...}, ...]}``.

    A key whose value is the same on every GPU is said once, in ``gpus_same``; the GPUs are then grouped by the
    values of the other keys (each group only those keys, its GPUs as :func:`index_ranges`), in the order of their
    first GPU. When nothing differs there is one group holding only ``gpus``, so the GPUs read are always named.
    """
    if not gpus:
        return {"gpus_same": {}, "gpu_groups": []}
    keys = []
    for gpu in gpus:
        keys.extend(k for k in gpu if k != "index" and k not in keys)
    same = {}
    for key in keys:
        first = _same_key(gpus[0].get(key))
        if all(key in g for g in gpus) and all(_same_key(g.get(key)) == first for g in gpus[1:]):
            same[key] = gpus[0][key]
    groups, by_values = [], {}
    for gpu in gpus:
        rest = dict((k, gpu[k]) for k in keys if k in gpu and k not in same)
        marker = _same_key(rest)
        if marker not in by_values:
            by_values[marker] = ([], rest)
            groups.append(marker)
        by_values[marker][0].append(gpu.get("index"))
    out = []
    for marker in groups:
        indices, rest = by_values[marker]
        entry = {"gpus": index_ranges(indices)}
        entry.update(rest)
        out.append(entry)
    return {"gpus_same": same, "gpu_groups": out}


def gather(backend, selectors, processes=True, fallback_reason=None, exclude_pids=None, nvlink=True,
           xid=None, fields=None):
    """Build the module's result from an open backend (plain function, no Ansible needed).

    ``xid`` is an :func:`xid_report` dict (None: not read); its keys are merged into the result. ``fields``
    (keys from :func:`resolve_fields`, None for all) cuts each GPU entry; NVLink and processes are then read
    only when asked for there.
    """
    if fields is not None:
        nvlink, processes = "nvlinks" in fields, "processes" in fields
    inventory = backend.inventory()
    indices = resolve_selectors(selectors, inventory)
    system = backend.system()
    gpus = backend.details(indices)
    if nvlink:
        try:
            links = backend.nvlinks(indices)
        except GpuError as exc:
            if exc.error_class not in ("backend_error",):
                raise
            links = None
            for gpu in gpus:
                gpu["unsupported"]["nvlinks"] = exc.msg.splitlines()[0]
        for gpu in gpus:
            gpu["nvlinks"] = None if links is None else links.get(gpu["index"], [])
    holders = None  # not read: not the same as "no process holds a GPU" ([])
    if processes:
        per_gpu, holders = gpu_processes(backend, indices, exclude_pids=exclude_pids)
        unreadable = getattr(backend, "apps_unreadable", None) or {}
        for gpu in gpus:
            gpu["processes"] = per_gpu.get(gpu["index"], [])
            # The compute-apps list (or a pid / used_memory in it) the backend could not read, raw text as read.
            gpu.setdefault("unsupported", {}).update(unreadable.get(gpu["index"], {}))
        # The GPUs asked for: a holder of another GPU only is not one of theirs.
        chosen = set(indices)
        holders = [h for h in holders if not h.get("gpu_indices") or chosen & set(h["gpu_indices"])]
    result = {
        "changed": False,
        "backend": backend.name,
        "backend_fallback_reason": fallback_reason,
        "driver_version": system.get("driver_version"),
        "cuda_version": system.get("cuda_version"),
        "gpu_count": len(inventory),
        "gpus": only_fields(gpus, fields),
        "device_holders": holders,
    }
    if xid is not None:
        result.update(attach_xid(xid, inventory))
    return result


def xid_on_fail(xid_window_min, kmsg_path=None):
    """``on_fail`` for :func:`gpufleet_gpu.run_on_backend` / :func:`gpufleet_gpu.failure_kwargs`: after a failure that the
    kernel log may explain, the Xid report of the window (its ``msg`` a line about the events)."""
    def on_fail(exc):
        if exc.error_class not in XID_ON_FAIL or not xid_window_min:
            return {}
        report = xid_report(xid_window_min, kmsg_path=kmsg_path or DEFAULT_KMSG_PATH)
        out = dict(report)
        out["msg"] = xid_text(report)
        return out
    return on_fail


def read_gpu_info(backend, smi_path, gpus=(), processes=True, nvlink=True, xid_window_min=60, kmsg_path=None,
                  fields=None, timeout_s=30, expected_count=None):
    """The whole nvidia_gpu_info read of this host: :func:`backend_session` on ``backend`` (auto|nvml|nvidia-smi)
    running :func:`gather` with the Xid report of ``xid_window_min`` minutes (0: not read).

    ``fields``: keys from :func:`resolve_fields` (None: every field). Raises :class:`GpuError` and
    ``MissingLibraryError`` as :func:`backend_session` does.
    """
    def work(session, reason):
        xid = xid_report(xid_window_min, kmsg_path=kmsg_path or DEFAULT_KMSG_PATH)
        return gather(session, list(gpus or []), processes, reason, exclude_pids={os.getpid()}, nvlink=nvlink,
                      xid=xid, fields=fields)
    return backend_session(backend, smi_path, work, timeout_s=timeout_s, expected_count=expected_count,
                           smi_prefetch_details=True)
