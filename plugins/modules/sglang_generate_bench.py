#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet (role sglang_verify): a short throughput smoke test run on the target itself.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_generate_bench
short_description: Measure SGLang output tokens/s with a few POST /generate requests
description:
  - Sends O(requests) generations to O(url)C(/generate) from the target, O(concurrency) at a time, and reports
    output tokens per second (sum of C(meta_info.completion_tokens) divided by the wall time of the whole batch).
  - Runs on the target so Ansible's own per-task overhead is not part of the figure.
  - Changes nothing on the host.
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  url:
    description: Server base URL, e.g. C(http://127.0.0.1:30000).
    type: str
    required: true
  api_key:
    description:
      - "SGLang's C(--api-key); sent as C(Authorization: Bearer KEY) on every request when set. A no_log
        option: Ansible masks it in the task's arguments and result."
    type: str
  requests:
    description: Number of generations.
    type: int
    default: 16
  concurrency:
    description: Generations in flight at once.
    type: int
    default: 4
  max_new_tokens:
    description: Output tokens per generation (C(ignore_eos) keeps the count fixed).
    type: int
    default: 128
  prompt:
    description: Prompt text.
    type: str
    default: Write a long story about a lighthouse keeper.
  timeout_s:
    description: Seconds one request may take.
    type: float
    default: 300
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Sends the requests in check mode too; they change nothing.
  diff_mode:
    support: none
  platform:
    support: full
    platforms: posix
"""

EXAMPLES = r"""
- gpufleet.fleet.sglang_generate_bench:
    url: http://127.0.0.1:30000
    requests: 16
  register: bench
"""

RETURN = r"""
tokens_per_s:
  description: Output tokens per second over the batch (tokens/s).
  returned: success
  type: float
completion_tokens:
  description: Sum of completion tokens over all requests.
  returned: success
  type: int
wall_s:
  description: Wall time of the batch, s.
  returned: success
  type: float
requests:
  description: Number of requests sent.
  returned: always
  type: int
"""

import gc
import json
import time
from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url


def request_headers(api_key=None):
    """Headers (dict str → str) of one generation: JSON, plus ``Authorization: Bearer <api_key>`` when set.

    SGLang 0.5.23 (srt/utils/auth.py) answers 401 on /generate without the bearer when --api-key is set.
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    return headers


def one_request(url, prompt, max_new_tokens, timeout_s, api_key=None):
    """POST one generation; returns completion tokens (int) from meta_info. Raises on HTTP or JSON errors."""
    body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                           "ignore_eos": True}})
    resp = open_url(url.rstrip("/") + "/generate", data=body, method="POST",
                    headers=request_headers(api_key), timeout=timeout_s, validate_certs=True)
    data = json.loads(resp.read())
    return int(data["meta_info"]["completion_tokens"])


def main():
    module = AnsibleModule(
        argument_spec=dict(
            url=dict(type="str", required=True),
            api_key=dict(type="str", no_log=True),
            requests=dict(type="int", default=16),
            concurrency=dict(type="int", default=4),
            max_new_tokens=dict(type="int", default=128, no_log=False),
            prompt=dict(type="str", default="Write a long story about a lighthouse keeper."),
            timeout_s=dict(type="float", default=300),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["requests"] < 1 or p["concurrency"] < 1:
        module.fail_json(msg="requests and concurrency must be at least 1", requests=p["requests"])
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=p["concurrency"]) as pool:
            tokens = list(pool.map(lambda _i: one_request(p["url"], p["prompt"], p["max_new_tokens"],
                                                          p["timeout_s"], p["api_key"]), range(p["requests"])))
    except Exception as exc:  # any failed request fails the smoke test, with the reason
        module.fail_json(msg="generation against %s failed: %s" % (p["url"], exc), requests=p["requests"])
    wall = time.monotonic() - started
    total = sum(tokens)
    module.exit_json(changed=False, tokens_per_s=round(total / wall, 2) if wall > 0 else 0.0,
                     completion_tokens=total, wall_s=round(wall, 3), requests=p["requests"])


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
