"""gpufleet router filters, for roles/sglang_router.

- ``gpufleet_router_inflight(result)`` → int: requests in flight on an SGLang server, from a registered
  ``ansible.builtin.uri`` result of ``GET /v1/loads`` (SGLang 0.5.23 srt/entrypoints/v1_loads.py:
  ``{"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}, ...]}``): the sum of
  ``num_running_reqs + num_waiting_reqs`` over the DP ranks. 0 when the result holds no ``loads`` list
  (no answer, 404); a rank missing a field counts 0 for it.
- ``gpufleet_router_refused(result)`` → bool: the ``uri`` result is a refused connection (nothing listens on
  the port, so nothing is in flight there).
- ``gpufleet_router_failed_removals(results)`` → ``[{"id", "status", "msg"}]``: the refused ``DELETE /workers/{id}``
  of a looped ``uri`` task, without the requests' headers.
- ``gpufleet_router_add_outcome(result)`` → ``"added"`` | ``"present"`` | ``"failed"``: what a ``POST /workers``
  (``uri`` result) did. 200/201/202 = added (sglang-router 0.3.2 also answers 202 to a URL it lists); smg answers
  409 ``{"code": "WORKER_ALREADY_EXISTS"}`` for a URL it lists = present; anything else failed.
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
    on Linux) in its ``msg``, as ``uri`` reports ``[Errno 111] Connection refused``. Nothing
    listens on the port then, so no request can be in flight there. A timeout, a reset or an HTTP error is not
    a refusal (returns False)."""
    if not isinstance(result, dict) or str(result.get("status")) != "-1":
        return False
    msg = str(result.get("msg") or "")
    return "Connection refused" in msg or "[Errno 111]" in msg


def gpufleet_router_failed_removals(results):
    """The ``DELETE /workers/{id}`` answers (the ``results`` of a looped ``uri`` task, each with ``item`` the worker
    entry) that are not 200/202/204/404, as ``[{"id", "status", "msg"}]``: only what a message needs, so that a
    task looping over them does not carry the requests' ``invocation`` (its Authorization header) into its
    events."""
    out = []
    for r in results or []:
        if not isinstance(r, dict) or r.get("skipped"):
            continue
        status = r.get("status")
        if str(status) in ("200", "202", "204", "404"):
            continue
        item = r.get("item") if isinstance(r.get("item"), dict) else {}
        out.append({"id": str(item.get("id", "?")), "status": status if status is not None else "nothing",
                    "msg": str(r.get("msg") or "")[:200]})
    return out


def gpufleet_router_add_outcome(result):
    if not isinstance(result, dict):
        return "failed"
    try:
        status = int(result.get("status"))
    except (TypeError, ValueError):
        return "failed"
    if status in (200, 201, 202):
        return "added"
    if status == 409:
        body = result.get("json")
        code = body.get("code") if isinstance(body, dict) else None
        if code is None and "WORKER_ALREADY_EXISTS" in str(result.get("content") or ""):
            code = "WORKER_ALREADY_EXISTS"
        if code == "WORKER_ALREADY_EXISTS":
            return "present"
    return "failed"


class FilterModule(object):
    """gpufleet router filters."""

    def filters(self):
        return {"gpufleet_router_inflight": gpufleet_router_inflight,
                "gpufleet_router_refused": gpufleet_router_refused,
                "gpufleet_router_add_outcome": gpufleet_router_add_outcome,
                "gpufleet_router_failed_removals": gpufleet_router_failed_removals}
