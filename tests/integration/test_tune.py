"""Lab tests of the tune loop (issue 34): SGLang's own benchmark client, and tune.yml.

``bench_lab``: the session's lab with SGLang's benchmark client usable on every host (tests/lab/bench_deps.py: the
client's dependencies from PyPI, once, into a shared cache dir added to each host venv by a ``.pth``; a tokenizer
built locally into each host's target model dir). Only this module asks for it; it is taken away again after.
"""
import importlib.util
import json
import os
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpufleet_lab_tool_tune", os.path.join(ROOT, "tests", "lab", "lab.py"))
labtool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(labtool)

pytestmark = pytest.mark.lab

KEY = "sk-gpufleet-tune-3f9c0d"
# The stand-in's fixed decode speed for these tests (faults.json knob tokens_per_s: it replaces the speed model).
TOKENS_PER_S = 400.0


@pytest.fixture(scope="module")
def bench_lab(lab):
    state = labtool.load_state(labtool.Names(lab.lab_dir))
    t0 = time.time()
    got = None
    for host in lab.hosts:
        got = labtool.bench_deps.enable(labtool.host_entry(state, host), log=lambda _msg: None)
    print("bench deps on %d hosts: %s, %.1f s" % (len(lab.hosts), "cached" if got["cached"] else "installed",
                                                   time.time() - t0))
    try:
        yield lab
    finally:
        for host in lab.hosts:
            labtool.bench_deps.disable(labtool.host_entry(state, host))


def _ps(lab, host):
    res = lab.exec(host, ["ps", "-eo", "pid=,args="], check=True)
    return {int(p): a for p, _, a in (line.strip().partition(" ") for line in res.stdout.splitlines()) if p}


def _stop_standin(lab, host, pid, timeout_s=30):
    lab.exec(host, ["kill", "-TERM", str(pid)])
    deadline = time.time() + timeout_s
    while time.time() < deadline and pid in _ps(lab, host):
        time.sleep(0.2)


def _result(lab, runner, host):
    """The module's result on ``host``, with ``failed`` set from the event (runner_on_failed)."""
    for status in ("runner_on_ok", "runner_on_failed"):
        for data in lab.events(runner, status, "sglang_bench_serving"):
            if data["host"] == host:
                return dict(data["res"], failed=status == "runner_on_failed")
    with open(runner.stdout.name) as fh:
        raise AssertionError("no sglang_bench_serving result for %s:\n%s" % (host, fh.read()[-3000:]))


@pytest.mark.lab_only_once
def test_real_bench_serving_measures_the_standin_and_refuses_without_the_key(bench_lab):
    """SGLang 0.5.23's own client (python -m sglang.benchmark.serving) through the module against the stand-in
    with --api-key: without the key the task fails saying why and the server serves on untouched; with it the
    figures follow the stand-in's configured speed, every request completes, TTFT and ITL are measured."""
    lab = bench_lab
    host = lab.hosts[0]
    hv = lab.host_vars(host)
    lab.fault(host, tokens_per_s=TOKENS_PER_S)
    pid = lab.start_standin(host, args=dict(hv["sglang_launch_args"], **{"api-key": KEY}))
    try:
        assert lab.wait_http(host, timeout_s=60) == 200
        url = "http://%s:%d" % (hv["sglang_host"], hv["sglang_port"])
        args = {"python": hv["sglang_python"], "url": url, "num_prompts": 4, "max_concurrency": 1,
                "input_len": 32, "output_len": 64, "seed": 3, "warmup_requests": 1,
                "env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}

        refused = lab.run_module("gpufleet.fleet.sglang_bench_serving", args, hosts=host)
        res = _result(lab, refused, host)
        assert res.get("failed"), res
        # SGLang answers 401 without the key: the module says so before the client would poll /v1/models for 60 s
        assert res["msg"] == ("the server at %s refused the benchmark (HTTP 401): it was started with --api-key; "
                              "pass the same key as api_key" % url), res["msg"]
        assert lab.wait_http(host, timeout_s=10) == 200 and pid in _ps(lab, host)  # the server serves on

        t0 = time.time()
        measured = lab.run_module("gpufleet.fleet.sglang_bench_serving", dict(args, api_key=KEY), hosts=host)
        took = time.time() - t0
        res = _result(lab, measured, host)
        assert not res.get("failed"), res.get("msg", "") + "\n" + res.get("output_tail", "")
        assert res["module"] == "sglang.benchmark.serving"
        assert res["completed"] == res["num_prompts"] == 4 and res["max_concurrency"] == 1
        # one stream at TOKENS_PER_S: below it by the HTTP and client overheads, never above it (+5 % slack)
        assert 0.5 * TOKENS_PER_S <= res["output_tok_s"] <= 1.05 * TOKENS_PER_S, res
        assert res["total_tok_s"] > res["output_tok_s"]  # input tokens counted too
        assert 0 < res["median_ttft_ms"] < 2000 and res["median_e2e_latency_ms"] > 0
        # the stand-in sends 8 chunks of 8 tokens: the client spreads each gap over its tokens, 1/400 s each
        assert 0.8 * 1000 / TOKENS_PER_S <= res["median_itl_ms"] <= 3 * 1000 / TOKENS_PER_S, res
        assert res["tokenizer"] == hv["sglang_launch_args"]["model-path"]
        assert KEY not in json.dumps(res["cmd"]) and KEY not in json.dumps(res)
        # nothing left on the host: the private dir of the client's result file is gone, the server still serves
        workdir = os.path.dirname(res["cmd"][res["cmd"].index("--output-file") + 1])
        assert os.path.basename(workdir).startswith("gpufleet-bench-")
        assert lab.exec(host, ["test", "-e", workdir]).returncode == 1
        assert lab.wait_http(host, timeout_s=10) == 200
        print("module run with the real client: %.1f s, %.1f tok/s single stream at %.0f" % (
            took, res["output_tok_s"], TOKENS_PER_S))
    finally:
        _stop_standin(lab, host, pid)
        lab.fault(host, tokens_per_s=None)
