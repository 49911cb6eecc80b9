# -*- coding: utf-8 -*-
"""The router's pool as the router routes: which workers take traffic (sglang-router 0.3.2, smg 1.x).

Both routers list their workers with ``GET /workers`` (``workers[].{id, url, is_healthy}``; smg adds ``status``:
pending | ready | not_ready | failed | draining) and export, on their Prometheus port (``--prometheus-host`` /
``--prometheus-port``, default 0.0.0.0:29000, path ``/metrics``), per worker URL:

- ``smg_worker_cb_state{worker="<url>"}``: the circuit breaker, 0 closed, 1 open, 2 half_open; -1 for a worker
  the router removed (sglang-router 0.3.2; smg 1.13 drops the series instead). smg 1.13 creates the series at
  the worker's first request: no series for a listed worker = the breaker it started with, closed.
- ``smg_worker_health{worker="<url>"}``: 1 healthy, 0 unhealthy, -1 removed.

A worker takes traffic when the router would pick it: listed, ``is_healthy`` true, status ready (where the router
says), and its circuit closed or half-open (an open circuit gets no request until its timeout, default 60 s,
has passed and a request finds it half-open; ``GET /workers`` still says ``is_healthy: true`` then). The open
state is updated lazily: on a router that gets no request the gauge can stay 1 after the timeout.

Plain functions, no Ansible: ``parse_worker_metrics``, ``pool_view``, ``leave_verdict``, ``routable_verdict``.
"""
from __future__ import absolute_import, division, print_function

__metaclass__ = type

import re

CB_STATES = {0: "closed", 1: "open", 2: "half_open", -1: "removed"}
_SAMPLE = re.compile(r'^(smg_worker_cb_state|smg_worker_health)\{([^}]*)\}\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_worker_metrics(text):
    """{worker url: {"cb_state": int|None, "health": int|None}} from a Prometheus text exposition.
    Lines other than the two gauges are ignored; a value that is not a number is left out (None)."""
    out = {}
    for line in (text or "").splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        url = labels.get("worker")
        if not url:
            continue
        try:
            value = int(float(m.group(3)))
        except ValueError:
            continue
        key = "cb_state" if m.group(1) == "smg_worker_cb_state" else "health"
        out.setdefault(url, {"cb_state": None, "health": None})[key] = value
    return out


def _entry_view(worker, metrics, metrics_read):
    url = str(worker.get("url") or "")
    gauges = (metrics or {}).get(url, {}) if metrics_read else {}
    cb = gauges.get("cb_state")
    health = gauges.get("health")
    status = worker.get("status")
    why = []
    if worker.get("is_healthy") is not True:
        why.append("is_healthy %s" % str(worker.get("is_healthy")).lower())
    if status is not None and str(status) != "ready":
        why.append("status %s" % status)
    if health is not None and health != 1:
        why.append("health gauge %d" % health)
    if cb is not None and cb not in (0, 2):
        why.append("circuit %s" % CB_STATES.get(cb, str(cb)))
    if not metrics_read:
        circuit = "unknown"
    elif cb is None:
        circuit = "closed"  # no series yet: no request so far, the breaker it started with
    else:
        circuit = CB_STATES.get(cb, str(cb))
    return {"url": url, "id": worker.get("id"), "is_healthy": worker.get("is_healthy"), "status": status,
            "circuit": circuit, "routable": not why, "why": ", ".join(why)}


def pool_view(workers, metrics=None, metrics_read=False):
    """Per listed worker (in the router's order): {url, id, is_healthy, status, circuit, routable, why}.
    ``workers``: the ``workers`` list of ``GET /workers``; ``metrics``: ``parse_worker_metrics`` of the metrics
    text; ``metrics_read`` false = no metrics (circuit "unknown", decided on the list alone)."""
    return [_entry_view(w, metrics, metrics_read) for w in (workers or []) if isinstance(w, dict)]


def _describe(entries):
    return "; ".join("%s (%s)" % (e["url"], e["why"] or "circuit " + e["circuit"]) for e in entries) or "none"


def leave_verdict(view, worker_url, min_healthy):
    """Can ``worker_url`` leave the pool? It can when at least ``min_healthy`` OTHER listed workers take traffic
    (routable). Returns {ok, others, routable, routable_urls, not_routable, msg}."""
    others = [e for e in view if e["url"] != worker_url]
    routable = [e for e in others if e["routable"]]
    blocked = [e for e in others if not e["routable"]]
    need = max(0, int(min_healthy))
    ok = len(routable) >= need
    msg = "%d of %d other worker(s) take traffic (gpufleet_router_min_healthy %d): %s" % (
        len(routable), len(others), need, _describe(routable))
    if blocked:
        msg += "; not taking traffic: " + _describe(blocked)
    return {"ok": ok, "others": len(others), "routable": len(routable),
            "routable_urls": [e["url"] for e in routable], "not_routable": {e["url"]: e["why"] for e in blocked},
            "msg": msg}


def routable_verdict(view, worker_url):
    """Does the router route to ``worker_url``? Returns {ok, listed, msg}: ok when an entry with that URL is
    listed and takes traffic."""
    mine = [e for e in view if e["url"] == worker_url]
    ok = any(e["routable"] for e in mine)
    if not mine:
        msg = "%s is not listed" % worker_url
    elif ok:
        msg = "%s takes traffic (circuit %s)" % (worker_url, next(e["circuit"] for e in mine if e["routable"]))
    else:
        msg = "%s is listed but takes no traffic: %s" % (worker_url, "; ".join(e["why"] for e in mine))
    return {"ok": ok, "listed": bool(mine), "msg": msg}
