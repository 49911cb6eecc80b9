"""What an ad-hoc run (``ansible HOSTS -m MODULE``) prints once: a long string that every host repeats.

An ad-hoc ``nvidia_gpu_info`` over a fleet returns the same host-wide strings from every host (the NVML fallback's
``backend_fallback_reason``, ``xid_reason``: 200-300 characters each). The gpufleet_default stdout callback prints
the first host's value whole and, for a later host whose value under the same key is the same string, a pointer to
that host. Presentation only: the result itself (job events, ansible-runner artifacts, ``-v``) keeps every value.

Plain functions (no Ansible needed), called by plugins/callback/gpufleet_default.py.
"""
from __future__ import annotations

# Shortest string said once (characters): shorter values cost less than the pointer that would replace them.
MIN_REPEAT_CHARS = 60


def same_as(host):
    """The pointer printed instead of a string ``host`` printed whole before."""
    return "(same as %s)" % host


def shorten_repeats(result, host, shown, min_chars=MIN_REPEAT_CHARS):
    """``(printed, shown_after)``: what to print of ``host``'s ``result`` given what earlier hosts printed.

    ``result``: the result dict; ``shown``: ``{(key, ...): {string: first host}}``, the long strings printed
    whole so far under each key path (top-level keys, and keys of dicts nested in dicts; lists are left alone).
    A string of at least ``min_chars`` characters that another host printed under the same key path reads
    ``(same as <that host>)``; one not printed yet is kept and recorded for ``host``. Neither argument is
    changed: ``printed`` is a new dict where something was shortened (``result`` itself otherwise), ``shown_after``
    a new mapping where something was recorded."""
    added = {}

    def walk(value, path):
        changed = False
        out = {}
        for key, item in value.items():
            where = path + (key,)
            if isinstance(item, dict):
                item_out = walk(item, where)
                changed = changed or item_out is not item
                out[key] = item_out
            elif isinstance(item, str) and len(item) >= min_chars:
                first = (shown.get(where) or {}).get(item) or (added.get(where) or {}).get(item)
                if first is None:
                    added.setdefault(where, {})[item] = host
                    out[key] = item
                elif first == host:
                    out[key] = item
                else:
                    out[key] = same_as(first)
                    changed = True
            else:
                out[key] = item
        return out if changed else value

    printed = walk(result, ())
    if not added:
        return printed, shown
    shown_after = {where: dict(strings) for where, strings in shown.items()}
    for where, strings in added.items():
        shown_after.setdefault(where, {}).update(strings)
    return printed, shown_after
