#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: the router's pool as the router routes (health and circuit breaker per worker).
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_router_pool_info
short_description: Which workers of an sglang-router or smg pool take traffic (health and circuit breaker)
description:
  - "Reads the pool of an sglang-router (0.3.x) or smg (Shepherd Model Gateway, 1.x) router as the router routes:
    C(GET <router_url>/workers) (the list: C(id), C(url), C(is_healthy), and in smg C(status)) and, with
    O(metrics_url), the router's Prometheus exporter (C(--prometheus-port)): C(smg_worker_cb_state) (circuit
    breaker 0 closed, 1 open, 2 half_open) and C(smg_worker_health) per worker URL."
  - "A worker takes traffic (is routable) when it is listed with C(is_healthy) true, status C(ready) where the
    router reports one, and its circuit closed or half-open. C(GET /workers) alone does not show the circuit: a
    worker whose circuit is open is listed healthy and gets no request (the router answers 503
    C(no_available_workers) when every circuit is open)."
  - "Without O(metrics_url), or when the metrics do not answer, the circuit state is unknown: the verdicts use
    the list alone and RV(metrics_note) says so."
  - "Reports whether O(worker_url) may leave the pool (RV(leave): at least O(min_healthy) other workers take
    traffic) and whether the router routes to it (RV(routable))."
  - Never changes anything.
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  router_url:
    description: The router's base URL, C(http(s)://host:port).
    type: str
    required: true
  api_key:
    description:
      - Bearer token for the router's worker routes (smg C(--control-plane-api-keys) admin key, or the router's
        C(--api-key) where no control-plane key is set). Empty = none.
    type: str
    default: ""
  metrics_url:
    description:
      - The router's Prometheus endpoint, e.g. C(http://10.0.0.5:29000/metrics) (the router's
        C(--prometheus-host)/C(--prometheus-port); a URL without a path gets C(/metrics)). Empty = not read.
    type: str
    default: ""
  worker_url:
    description: The worker URL whose verdicts are reported, spelt as the router lists it.
    type: str
    required: true
  min_healthy:
    description: How many other workers must take traffic for O(worker_url) to leave the pool.
    type: int
    default: 1
  timeout_s:
    description: Seconds one HTTP request may take.
    type: int
    default: 10
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    support: full
    platforms: posix
"""

EXAMPLES = r"""
- name: Can this worker leave the pool?
  gpufleet.fleet.sglang_router_pool_info:
    router_url: http://10.0.0.5:30000
    metrics_url: http://10.0.0.5:29000/metrics
    worker_url: http://10.0.0.11:30000
    min_healthy: 1
  register: pool
  until: pool.leave.ok
  retries: 60
  delay: 2
  delegate_to: localhost
"""

RETURN = r"""
pool:
  description: Every listed worker as the router routes it.
  returned: always
  type: list
  elements: dict
  contains:
    url:
      description: >-
        The worker URL.
      type: str
    id:
      description: >-
        The router's id for the entry.
      type: str
    is_healthy:
      description: >-
        C(is_healthy) as listed.
      type: bool
    status:
      description: >-
        smg's status (pending, ready, not_ready, failed, draining); null for sglang-router.
      type: str
    circuit:
      description: >-
        closed, open, half_open, removed, or unknown (metrics not read).
      type: str
    routable:
      description: >-
        Whether the router would send it a request.
      type: bool
    why:
      description: >-
        Why not (empty when routable).
      type: str
metrics_read:
  description: Whether the circuit states come from O(metrics_url).
  returned: always
  type: bool
metrics_note:
  description: Why the circuit state is unknown (empty when read).
  returned: always
  type: str
leave:
  description: Whether O(worker_url) may leave the pool.
  returned: always
  type: dict
  contains:
    ok:
      description: >-
        At least O(min_healthy) other workers take traffic.
      type: bool
    others:
      description: >-
        Other listed workers.
      type: int
    routable:
      description: >-
        Other workers that take traffic.
      type: int
    routable_urls:
      description: >-
        Their URLs.
      type: list
      elements: str
    not_routable:
      description: >-
        Other workers that take none, URL to reason.
      type: dict
    msg:
      description: >-
        One line saying so.
      type: str
routable:
  description: Whether the router routes to O(worker_url).
  returned: always
  type: dict
  contains:
    ok:
      description: >-
        Listed and taking traffic.
      type: bool
    listed:
      description: >-
        Listed at all.
      type: bool
    msg:
      description: >-
        One line saying so.
      type: str
"""

import gc
import json

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import fetch_url
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_router_pool import (
    leave_verdict, parse_worker_metrics, pool_view, routable_verdict)


def _metrics_url(url):
    url = (url or "").strip()
    if url and url.split("://", 1)[-1].find("/") < 0:
        url += "/metrics"
    return url


def _get(module, url, headers, timeout):
    resp, info = fetch_url(module, url, headers=headers, timeout=timeout, method="GET")
    body = resp.read() if resp is not None else info.get("body", b"")
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    return info.get("status", -1), body, info.get("msg", "")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            router_url=dict(type="str", required=True),
            api_key=dict(type="str", default="", no_log=True),
            metrics_url=dict(type="str", default=""),
            worker_url=dict(type="str", required=True),
            min_healthy=dict(type="int", default=1),
            timeout_s=dict(type="int", default=10),
        ),
        supports_check_mode=True,
    )
    p = module.params
    base = p["router_url"].strip().rstrip("/")
    headers = {"Authorization": "Bearer " + p["api_key"]} if p["api_key"] else {}
    status, body, msg = _get(module, base + "/workers", headers, p["timeout_s"])
    try:
        workers = json.loads(body).get("workers") if status == 200 else None
    except (ValueError, AttributeError):
        workers = None
    if not isinstance(workers, list):
        hint = (": wrong or missing key (gpufleet_router_control_plane_key for smg's control-plane keys, else "
                "gpufleet_router_api_key)") if status in (401, 403) else ""
        module.fail_json(msg="GET %s/workers answered %s (%s)%s" % (base, status, (msg or body)[:200], hint),
                         status=status)
    metrics, metrics_read, note = {}, False, ""
    murl = _metrics_url(p["metrics_url"])
    if not murl:
        note = ("circuit state not read: gpufleet_router_metrics_url is unset (the router's --prometheus-port, "
                "e.g. http://ROUTER:29000/metrics); deciding on GET /workers alone (is_healthy, status)")
    else:
        mstatus, mbody, mmsg = _get(module, murl, {}, p["timeout_s"])
        if mstatus == 200 and "smg_" in mbody:
            # smg 1.13 creates a worker's series at its first request: none yet = circuits as they start, closed
            metrics, metrics_read = parse_worker_metrics(mbody), True
        elif mstatus == 200:
            note = ("circuit state not read: %s answered without any smg_ series (not the router's exporter?); "
                    "deciding on GET /workers alone" % murl)
        else:
            note = ("circuit state not read: %s answered %s (%s); deciding on GET /workers alone"
                    % (murl, mstatus, (mmsg or mbody)[:160]))
    view = pool_view(workers, metrics, metrics_read)
    module.exit_json(changed=False, pool=view, metrics_read=metrics_read, metrics_note=note,
                     leave=leave_verdict(view, p["worker_url"], p["min_healthy"]),
                     routable=routable_verdict(view, p["worker_url"]))


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
