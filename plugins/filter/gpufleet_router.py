"""gpufleet router filters, for roles/sglang_router.

- ``gpufleet_router_inflight(result)`` → int: requests in flight on an SGLang server, from a registered
  ``ansible.builtin.uri`` result of ``GET /v1/loads`` (SGLang 0.5.23 srt/entrypoints/v1_loads.py:
  ``{"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}, ...]}``): the sum of
  ``num_running_reqs + num_waiting_reqs`` over the DP ranks. 0 when the result holds no ``loads`` list
  (no answer, 404); a rank missing a field counts 0 for it.
- ``gpufleet_router_refused(result)`` → bool: the ``uri`` result is a refused connection (nothing listens on
  the port, so nothing is in flight there).
"""
from __future__ import annotations


def gpufleet_router_inflight(result):
    body = (result or {}).get("json") if isinstance(result, dict) else None
    loads = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(loads, list):
        return 0
    total = 0
    for rank in loads:
        if isinstance(rank, dict):
            for key in ("num_running_reqs", "num_waiting_reqs"):
                try:
                    total += max(0, int(rank.get(key) or 0))
                except (TypeError, ValueError):
                    pass
    return total


def gpufleet_router_refused(result):
    """Whether a ``uri`` result ``result`` (dict) is a refused connection: status -1 and ECONNREFUSED (errno 111
    on Linux) in its ``msg``, as ``uri`` reports ``<urlopen error [Errno 111] Connection refused>``. Nothing
    listens on the port then, so no request can be in flight there. A timeout, a reset or an HTTP error is not
    a refusal (returns False)."""
    if not isinstance(result, dict) or str(result.get("status")) != "-1":
        return False
    msg = str(result.get("msg") or "")
    return "Connection refused" in msg or "[Errno 111]" in msg


class FilterModule(object):
    """gpufleet router filters."""

    def filters(self):
        return {"gpufleet_router_inflight": gpufleet_router_inflight,
                "gpufleet_router_refused": gpufleet_router_refused}
