"""The weight prefetch's controller-side decisions (role sglang_prefetch, issue 35): which paths the new launch
reads, and what the summary row says of the prefetch from the module's results.

On the host, module sglang_weights_prefetch (plugins/module_utils/gpufleet_prefetch.py) does the reading, bounded by
the memory the kernel has free without reclaim; this file only chooses its inputs and words its outcome. Plain
functions (no Ansible needed), the ``gpufleet_prefetch_<name>`` filters of plugins/filter/gpufleet_prefetch.py; unit
tests: tests/unit/plugins/plugin_utils/test_prefetch.py.

- ``paths(preflight_paths, launch_args)`` -> [str]: the model paths to prefetch, in order, once each.
- ``outcome(first, last)`` -> dict: ``prefetch_gib``, ``prefetch_s``, ``resident_pct``, ``prefetch_note`` for the
  summary row, from the first and the last call of the module (the role calls it in slices).
"""
from __future__ import annotations

from collections.abc import Mapping

# SGLang's flags whose value is a model directory the server reads at start (the target, the EAGLE draft, a
# separate tokenizer); the same list as sglang_preflight_path_flags' default, used only when preflight's resolved
# paths are not there (the role run on its own).
PATH_FLAGS = ("model-path", "speculative-draft-model-path", "tokenizer-path")
# SGLang's --load-format values (0.5.23 arg_groups/choices.py) under which the server reads no checkpoint from the
# model path: random weights (dummy), weights from a remote store or another running instance.
NO_LOCAL_CHECKPOINT = ("dummy", "remote", "remote_instance")
GIB = float(1 << 30)
MIB = float(1 << 20)
# Read-again below this is not said: a file that grew, the partial last page of each file.
REREAD_NOTE_BYTES = 16 * (1 << 20)


def paths(preflight_paths=None, launch_args=None):
    """The paths the new launch reads, in the order given, each once.

    ``preflight_paths``: sglang_preflight_model_paths (the values of the path flags as SGLang's own argument parser
    resolved them from the launch arguments: abbreviations and aliases included); when it is a list it is the
    answer. Otherwise (None: preflight did not run) the values of :data:`PATH_FLAGS` in ``launch_args``
    (sglang_launch_args), by exact name. Values that are not strings (a flag set true) are left out; a hub id
    stays (the module reports it as not a local path). Nothing when ``launch_args`` sets a ``load-format`` of
    :data:`NO_LOCAL_CHECKPOINT`: the server reads no weights from the model path then."""
    fmt = launch_args.get("load-format") if isinstance(launch_args, Mapping) else None
    if isinstance(fmt, str) and fmt.strip().lower().replace("-", "_") in NO_LOCAL_CHECKPOINT:
        return []
    if isinstance(preflight_paths, (list, tuple)):
        found = [p for p in preflight_paths if isinstance(p, str)]
    else:
        args = launch_args if isinstance(launch_args, Mapping) else {}
        found = [args[flag] for flag in PATH_FLAGS if isinstance(args.get(flag), str)]
    out = []
    for path in found:
        path = path.strip()
        if path and path not in out:
            out.append(path)
    return out


def _num(value):
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _gib(nbytes):
    return "%.1f GiB" % (nbytes / GIB)


def _size(nbytes):
    return _gib(nbytes) if nbytes >= GIB else "%.0f MiB" % (nbytes / MIB)


def _broken(res):
    """A failed result: the role registers with failed_when false (a failed prefetch never fails the restart), so a
    failure shows as a result without the module's figures."""
    return bool(res.get("failed")) or "total_bytes" not in res


def outcome(first, last=None, check_mode=False):
    """What the summary row says of the prefetch, from the module's first and last results of this host.

    ``first``/``last``: sglang_weights_prefetch results (``last`` defaults to ``first``: one call was enough). The
    prefetched amount is what the whole prefetch read from storage into the page cache (``total_read_bytes`` of the
    last call: the module counts only the part of each chunk that was not cached just before it read it); without
    that key, what became resident (``resident_after_bytes`` of the last call less ``resident_before_bytes`` of the
    first).
    A result that failed (``failed``, or no ``total_bytes``: the role registers with failed_when false), was
    skipped, or is missing gives only a note (or nothing).

    Returns ``prefetch_gib`` (GiB, 2 decimals; null when nothing was measured, and in check mode, which reads
    nothing), ``prefetch_s`` (s, the whole prefetch), ``resident_pct`` (share of the new launch's files in the page
    cache when the prefetch ended, just before the lock and the stop; 0-100), ``prefetch_note`` (one line when the
    operator should know: stopped at the memory bound or by the timeout, paths skipped, the module failed; else
    null)."""
    out = {"prefetch_gib": None, "prefetch_s": None, "resident_pct": None, "prefetch_note": None}
    first = first if isinstance(first, Mapping) else {}
    last = last if isinstance(last, Mapping) and last else first
    if not first or first.get("skipped") is True:
        return out
    if _broken(first) or _broken(last):
        failed = last if _broken(last) else first
        out["prefetch_note"] = ("prefetch failed, so the launch read its weights cold: %s"
                                % " ".join(str(failed.get("msg") or "no message").split())[:300])
        return out
    before, after = _num(first.get("resident_before_bytes")), _num(last.get("resident_after_bytes"))
    total = _num(last.get("total_bytes"))
    read = _num(last.get("total_read_bytes"))
    if not check_mode and read is not None:
        out["prefetch_gib"] = round(read / GIB, 2)
    elif not check_mode and before is not None and after is not None:
        out["prefetch_gib"] = round(max(after - before, 0.0) / GIB, 2)
    seconds = _num(last.get("total_elapsed_s"))
    out["prefetch_s"] = None if check_mode or seconds is None else round(seconds, 1)
    pct = _num(last.get("resident_pct"))
    if pct is None and total and after is not None:
        pct = 100.0 * after / total
    out["resident_pct"] = None if pct is None or not total else round(pct, 1)
    notes = []
    # mincore tells the page cache only to a file's owner or writer: the module reports the others' residency as
    # null (and reads them whole); no share can be said for the set then.
    unknown = [f for f in last.get("files") or [] if isinstance(f, Mapping) and not f.get("skipped")
               and f.get("resident_after_bytes") is None]
    if unknown:
        out["resident_pct"] = None
        notes.append("residency of %d file(s) unknown (mincore tells the page cache only to a file's owner or "
                     "writer; they were read whole): set sglang_prefetch_become=true to measure it" % len(unknown))
    cold = _num(last.get("cold_bytes"))
    stopped_by = last.get("stopped_by")
    if stopped_by == "memory":
        bound = last.get("bound") if isinstance(last.get("bound"), Mapping) else {}
        notes.append("prefetch stopped at the memory bound (it never makes the kernel reclaim): %s left cold "
                     "(MemFree %s less watermarks %s and reserve %s)"
                     % (_gib(cold or 0), _gib(_num(bound.get("mem_free_bytes")) or 0),
                        _gib(_num(bound.get("watermark_bytes")) or 0), _gib(_num(bound.get("reserve_bytes")) or 0)))
    elif stopped_by == "timeout":
        notes.append("prefetch stopped at sglang_prefetch_timeout_s after %s s: %s left cold"
                     % (out["prefetch_s"], _gib(cold or 0)))
    # More read than was cold at the start: pages the prefetch had read left the page cache before it ended (it
    # evicts nothing itself), so it read them again and the launch may find them gone too. Seen on the lab's VM,
    # whose kdamond pages out cold memory within seconds (DAMON pageout); memory.reclaim agents do the same.
    at_start = _num(last.get("resident_at_start_bytes"))
    if not unknown and not check_mode and None not in (read, total, at_start):
        again = read - (total - at_start)
        if again > REREAD_NOTE_BYTES:
            notes.append("prefetch read %s again: pages it had read left the page cache before it ended (proactive "
                         "reclaim such as DAMON pageout or a memory.reclaim agent, or another process dropping them)"
                         % _size(again))
    for entry in last.get("skipped_paths") or []:
        if isinstance(entry, Mapping):
            notes.append("prefetch skipped %s (%s)" % (entry.get("path"), entry.get("reason")))
    for entry in last.get("files") or []:
        if isinstance(entry, Mapping) and entry.get("skipped"):
            notes.append("prefetch skipped %s (%s)" % (entry.get("path"), entry.get("skipped")))
    if notes:
        out["prefetch_note"] = "; ".join(notes[:4]) + ("; and %d more" % (len(notes) - 4) if len(notes) > 4 else "")
    return out


def cell(row):
    """The summary table's ``prefetch`` cell: ``<GiB>G/<s>s/<resident>%`` (e.g. ``12.0G/8.3s/100%``; no spaces: the
    table's readers split on them), ``-`` when the prefetch did not run or measured nothing."""
    row = row if isinstance(row, Mapping) else {}
    gib, sec, pct = _num(row.get("prefetch_gib")), _num(row.get("prefetch_s")), _num(row.get("resident_pct"))
    if gib is None and pct is None:
        return "-"
    parts = ["%.1fG" % gib if gib is not None else "-", "%.1fs" % sec if sec is not None else "-",
             "%d%%" % int(pct) if pct is not None else "-"]
    return "/".join(parts)
