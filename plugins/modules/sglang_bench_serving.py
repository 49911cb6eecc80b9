#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet (playbooks/tune.yml): SGLang's own serving benchmark, run on the host against its server.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_bench_serving
short_description: Measure an SGLang server with SGLang's own serving benchmark client
description:
  - Runs SGLang's benchmark client with the host's SGLang interpreter against the server at O(url), with
    C(--backend sglang), a random data set of fixed lengths (C(--random-range-ratio 1)) and a fixed seed, and
    returns its figures. Runs on the host, so the network between the controller and the host is not part of them.
  - "The client is C(python -m sglang.benchmark.serving) where the release has it (SGLang 0.5.23: there
    C(sglang.bench_serving) is a deprecated alias that re-exports it and warns), else C(python -m
    sglang.bench_serving). It is the client SGLang's own figures come from: it streams C(POST /generate), takes
    the time to first token, the inter-token latency and output tokens per second at a given concurrency.
    C(sglang.bench_one_batch_server) measures one batch's latency and by default launches a server of its own,
    so it is not used."
  - Prompts are random token ids from the tokenizer's vocabulary (C(--dataset-name random-ids)), so no data set
    is downloaded; with O(dataset_path) (a ShareGPT JSON on the host) the client's C(random) data set samples real
    text instead, which matters for speculative decoding, whose acceptance depends on the text.
  - The API key reaches the client through its environment (C(OPENAI_API_KEY), sent as C(Authorization Bearer)),
    never its command line, so it stays out of process listings.
  - Changes nothing on the host; the client's result file lives in a private temporary directory that is removed.
    Runs in check mode too (it only sends generations).
version_added: "0.3.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  python:
    description: The interpreter that has SGLang and its dependencies (the inventory's C(sglang_python)).
    type: path
    required: true
  url:
    description: Server base URL, e.g. C(http://127.0.0.1:30000).
    type: str
    required: true
  api_key:
    description:
      - "SGLang's C(--api-key), handed to the client as C(OPENAI_API_KEY) in its environment. A no_log option:
        Ansible masks it in the task's arguments and result."
    type: str
  tokenizer:
    description:
      - Tokenizer directory (or name) the client loads to make prompts and count the answer.
      - Default the server's own, C(tokenizer_path) or else C(model_path) of its C(/model_info)
        (C(/get_model_info) before SGLang 0.5.6), as the client itself picks it.
    type: str
  num_prompts:
    description: Requests measured (C(--num-prompts)).
    type: int
    default: 8
  max_concurrency:
    description: Requests in flight at once (C(--max-concurrency)); 1 gives the single-stream figure.
    type: int
    default: 1
  input_len:
    description: Prompt tokens per request (C(--random-input-len)).
    type: int
    default: 128
  output_len:
    description: Output tokens per request (C(--random-output-len)); the client sets C(ignore_eos).
    type: int
    default: 128
  seed:
    description: The client's random seed (C(--seed)).
    type: int
    default: 1
  warmup_requests:
    description: Requests sent before the measurement, not counted (C(--warmup-requests)).
    type: int
    default: 1
  dataset_path:
    description:
      - A ShareGPT-format JSON file on the host; switches to the client's C(random) data set, which cuts real
        text from it to the fixed lengths. Unset, prompts are random token ids and nothing is read or fetched.
    type: path
  timeout_s:
    description: Seconds the whole client run may take before it is stopped and the task fails.
    type: int
    default: 600
  env:
    description:
      - Extra environment for the client, e.g. C(HF_HUB_OFFLINE=1) on hosts without the hub (a mapping of names to
        values).
      - Its values are not returned - the result's C(invocation) shows the names with every value C(********) - and
        the value of a name that says it holds a credential (C(TOKEN), C(KEY), C(SECRET), C(PASS), C(CREDENTIAL),
        C(AUTH), e.g. C(HF_TOKEN)) is hidden in everything the module returns (messages, the client's output).
    type: dict
    default: {}
seealso:
  - module: gpufleet.fleet.sglang_generate_bench
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Runs the benchmark in check mode too; it only sends generations and changes nothing.
  diff_mode:
    support: none
  platform:
    support: full
    platforms: posix
"""

EXAMPLES = r"""
- name: Single-stream figure of the canary's server
  gpufleet.fleet.sglang_bench_serving:
    python: "{{ sglang_python }}"
    url: http://127.0.0.1:30000
    api_key: "{{ sglang_api_key | default(omit) }}"
    max_concurrency: 1
    env:
      HF_HUB_OFFLINE: "1"
  register: single

- name: Throughput at 8 streams
  gpufleet.fleet.sglang_bench_serving:
    python: "{{ sglang_python }}"
    url: http://127.0.0.1:30000
    num_prompts: 16
    max_concurrency: 8
  register: loaded
"""

RETURN = r"""
output_tok_s:
  description: >-
    Output tokens per second over the measured run (the client's output_throughput), tokens/s.
  returned: success
  type: float
  sample: 93.4
total_tok_s:
  description: >-
    Input plus output tokens per second (the client's total_throughput), tokens/s.
  returned: success
  type: float
request_throughput:
  description: Completed requests per second, requests/s.
  returned: success
  type: float
median_ttft_ms:
  description: Median time to first token, ms.
  returned: success
  type: float
median_itl_ms:
  description: Median inter-token latency, ms.
  returned: success
  type: float
median_e2e_latency_ms:
  description: Median end-to-end latency of one request, ms.
  returned: success
  type: float
completed:
  description: Requests that completed (equal to num_prompts on success).
  returned: always
  type: int
num_prompts:
  description: Requests measured.
  returned: always
  type: int
max_concurrency:
  description: Requests in flight at once.
  returned: always
  type: int
duration_s:
  description: Wall time of the measured run (warm-up not included), s.
  returned: success
  type: float
tokenizer:
  description: The tokenizer the client loaded.
  returned: when known
  type: str
cmd:
  description: >-
    The client's command line (argv); it never holds the API key.
  returned: when the client ran
  type: list
  elements: str
module:
  description: >-
    The client module that ran (sglang.benchmark.serving or sglang.bench_serving).
  returned: when sglang was found
  type: str
output_tail:
  description: >-
    The last lines of the client's output, secrets redacted.
  returned: failure
  type: str
"""

import gc
import json
import os
import shutil
import subprocess
import tempfile
from urllib.error import HTTPError

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import open_url
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_bench_serving as bench


def locate_client(python, env, timeout_s=60):
    """(module name or None, error or None): which client the interpreter's SGLang has, found without importing
    sglang."""
    try:
        proc = subprocess.run([python, "-c", bench.LOCATE_CODE], env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, "could not run %s: %s" % (python, exc)
    if proc.returncode != 0:
        return None, "%s could not look for sglang: %s" % (python, (proc.stderr or "").strip()[-300:])
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, "%s printed no answer when looking for sglang" % python
    module = bench.client_module(found)
    if module is None:
        return None, "sglang is not installed for %s (sglang_python)" % python
    return module, None


def probe_server(url, api_key, timeout_s=10):
    """None when the server answers ``GET /v1/models`` (the client's own readiness check) with the key, else why
    not: a refusal (401/403: the key) would otherwise keep the client polling for a minute and then say only
    "not ready"."""
    try:
        open_url(url.rstrip("/") + "/v1/models", headers=bench.auth_headers(api_key), timeout=timeout_s,
                 validate_certs=True).read()
    except HTTPError as exc:
        return bench.refusal(url, exc.code, bool(api_key))
    except Exception as exc:  # connection refused, timeout, TLS: the server is not there to measure
        return "the server at %s did not answer GET /v1/models: %s" % (url, exc)
    return None


def server_tokenizer(url, api_key, timeout_s=10):
    """The server's tokenizer path from its model info, or None."""
    for route in bench.model_info_url(url):
        try:
            resp = open_url(route, headers=bench.auth_headers(api_key), timeout=timeout_s, validate_certs=True)
            return bench.tokenizer_from_model_info(json.loads(resp.read()))
        except Exception:  # older route names, or no answer: the next one, else the client's own choice
            continue
    return None


def run_client(argv, env, timeout_s):
    """(rc, output): the client's exit status (None when stopped at the timeout) and its output."""
    try:
        proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out
    return proc.returncode, proc.stdout


def main():
    module = redact_module(AnsibleModule(
        argument_spec=dict(
            python=dict(type="path", required=True),
            url=dict(type="str", required=True),
            api_key=dict(type="str", no_log=True),
            tokenizer=dict(type="str", no_log=False),
            num_prompts=dict(type="int", default=8),
            max_concurrency=dict(type="int", default=1),
            input_len=dict(type="int", default=128),
            output_len=dict(type="int", default=128),
            seed=dict(type="int", default=1),
            warmup_requests=dict(type="int", default=1),
            dataset_path=dict(type="path"),
            timeout_s=dict(type="int", default=600),
            env=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    ))
    p = module.params
    # env may carry a credential (HF_TOKEN): the invocation shows its names only, and a value under a credential's
    # name is hidden wherever the output would show it. Not no_log: Ansible would then mask every occurrence of
    # each value, so HF_HUB_OFFLINE=1 would turn every figure holding a 1 into ********.
    module.params = dict(p, env=bench.shown_env(p["env"]))
    module.no_log_values.update(bench.secret_env_values(p["env"]))
    base = dict(num_prompts=p["num_prompts"], max_concurrency=p["max_concurrency"], completed=0)
    for name in ("num_prompts", "max_concurrency", "input_len", "output_len", "timeout_s"):
        if p[name] < 1:
            module.fail_json(msg="%s must be at least 1 (got %d)" % (name, p[name]), **base)
    if p["warmup_requests"] < 0:
        module.fail_json(msg="warmup_requests must be 0 or more (got %d)" % p["warmup_requests"], **base)
    env = bench.client_env(os.environ, api_key=p["api_key"], extra=p["env"])
    client, error = locate_client(p["python"], env)
    if error:
        module.fail_json(msg=error, **base)
    refused = probe_server(p["url"], p["api_key"])
    if refused:
        module.fail_json(msg=refused, module=client, **base)
    tokenizer = p["tokenizer"] or server_tokenizer(p["url"], p["api_key"])
    workdir = tempfile.mkdtemp(prefix="gpufleet-bench-")
    try:
        argv = bench.build_argv(p["python"], client, p["url"], os.path.join(workdir, "result.jsonl"),
                                tokenizer=tokenizer, num_prompts=p["num_prompts"],
                                max_concurrency=p["max_concurrency"], input_len=p["input_len"],
                                output_len=p["output_len"], seed=p["seed"], warmup_requests=p["warmup_requests"],
                                dataset_path=p["dataset_path"])
        rc, output = run_client(argv, dict(env, TMPDIR=workdir), p["timeout_s"])
        line = bench.read_result(os.path.join(workdir, "result.jsonl"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    known = (p["api_key"],) + tuple(bench.secret_env_values(p["env"]))
    result = dict(base, cmd=argv, module=client, tokenizer=tokenizer)
    if rc is None:
        module.fail_json(msg="%s against %s did not finish in %d s (timeout_s)" % (client, p["url"], p["timeout_s"]),
                         output_tail=bench.tail(output, known=known), **result)
    why = bench.failure(rc, output, line, p["num_prompts"], p["url"], client, known=known)
    if line is not None:
        result.update(bench.summarize(line, p["num_prompts"]))
        result["max_concurrency"] = p["max_concurrency"]
    if why:
        module.fail_json(msg=why, rc=rc, output_tail=bench.tail(output, known=known), **result)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    gc.freeze()
    main()
