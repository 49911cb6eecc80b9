"""sglang_bench_serving: the client's command line and environment, reading its result line, failure messages."""
import importlib.util
import json
import os
import pathlib
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from plugins.module_utils import gpufleet_bench_serving as bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sglang_bench_serving",
                                              ROOT / "plugins" / "modules" / "sglang_bench_serving.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)

KEY = "sk-gpufleet-bench-7d41aa"
# One line of `python -m sglang.benchmark.serving --output-file F --output-details` (SGLang 0.5.23, random-ids, 4
# prompts 32/64 tokens, concurrency 1), recorded in the lab against the stand-in at tokens_per_s 400 started with
# --api-key sk-rec-1; server_info (the server's /server_info, api_key included) trimmed to a few keys.
RECORDED = ROOT / "tests" / "unit" / "data" / "bench_serving_0.5.23.jsonl"


def recorded_line():
    return json.loads(RECORDED.read_text().splitlines()[-1])


def test_argv_fixes_lengths_and_seed_and_never_holds_the_key():
    argv = bench.build_argv("/opt/venv/bin/python", bench.NEW_MODULE, "http://10.0.0.5:30000/", "/tmp/x/r.jsonl",
                            num_prompts=8, max_concurrency=4, input_len=256, output_len=64, seed=7,
                            warmup_requests=2)
    assert argv[:3] == ["/opt/venv/bin/python", "-m", "sglang.benchmark.serving"]
    pairs = dict(zip(argv[3::2], argv[4::2]))
    assert pairs["--backend"] == "sglang" and pairs["--base-url"] == "http://10.0.0.5:30000"
    assert pairs["--dataset-name"] == "random-ids"  # "random" would fetch ShareGPT from the hub
    assert (pairs["--random-input-len"], pairs["--random-output-len"], pairs["--random-range-ratio"]) == (
        "256", "64", "1")
    assert (pairs["--seed"], pairs["--max-concurrency"], pairs["--num-prompts"], pairs["--warmup-requests"]) == (
        "7", "4", "8", "2")
    assert "--output-details" in argv and "--tokenizer" not in argv and "--dataset-path" not in argv
    assert not any("key" in a.lower() for a in argv)


def test_argv_with_a_dataset_file_uses_the_random_data_set_and_names_the_tokenizer():
    argv = bench.build_argv("py", bench.OLD_MODULE, "http://h:1", "/o", tokenizer="/models/m",
                            dataset_path="/data/sharegpt.json")
    assert argv[2] == "sglang.bench_serving"
    assert argv[argv.index("--dataset-name") + 1] == "random"
    assert argv[argv.index("--dataset-path") + 1] == "/data/sharegpt.json"
    assert argv[argv.index("--tokenizer") + 1] == "/models/m"


def test_env_carries_the_key_as_openai_api_key_and_drops_a_bare_api_key():
    env = bench.client_env({"PATH": "/bin", "API_KEY": "stale", "OPENAI_API_KEY": "other"}, api_key=KEY,
                           extra={"HF_HUB_OFFLINE": 1, "EMPTY": None})
    assert env["OPENAI_API_KEY"] == KEY and "API_KEY" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["EMPTY"] == "" and env["LC_ALL"] == "C"
    assert "OPENAI_API_KEY" not in bench.client_env({"OPENAI_API_KEY": "inherited"})


def test_client_module_prefers_the_benchmark_package_where_the_release_has_it():
    assert bench.client_module({"dirs": ["/s/sglang"], "new": True}) == "sglang.benchmark.serving"
    assert bench.client_module({"dirs": ["/s/sglang"], "new": False}) == "sglang.bench_serving"
    assert bench.client_module({"dirs": [], "new": False}) is None


def test_summarize_reads_the_real_key_names():
    line = recorded_line()
    got = bench.summarize(line, num_prompts=line["completed"])
    assert got["output_tok_s"] == round(line["output_throughput"], 3)
    assert got["total_tok_s"] == round(line["total_throughput"], 3)
    assert got["median_ttft_ms"] == round(line["median_ttft_ms"], 3)
    assert got["median_itl_ms"] == round(line["median_itl_ms"], 3)
    assert got["duration_s"] == round(line["duration"], 3)
    assert got["completed"] == line["completed"] and got["max_concurrency"] == line["max_concurrency"]
    assert bench.failure(0, "", line, line["completed"], "http://h", bench.NEW_MODULE) is None
    assert line["server_info"]["api_key"] == "sk-rec-1" and "sk-rec-1" not in json.dumps(got)  # never returned


def test_read_result_takes_the_last_line_and_survives_junk(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"completed": 1}\n{"completed": 2}\n\n')
    assert bench.read_result(str(path)) == {"completed": 2}
    path.write_text("not json\n")
    assert bench.read_result(str(path)) is None
    assert bench.read_result(str(tmp_path / "missing")) is None


def test_failure_names_the_missing_dependency():
    out = "Traceback (most recent call last):\n  File ...\nModuleNotFoundError: No module named 'aiohttp'\n"
    msg = bench.failure(1, out, None, 8, "http://h:1", bench.NEW_MODULE)
    assert "could not start" in msg and "No module named 'aiohttp'" in msg and "dependencies" in msg


def test_failure_when_fewer_requests_complete_quotes_the_request_errors_without_the_key():
    line = dict(recorded_line(), completed=5,
                errors=["", "Traceback...\nClientConnectorError: Cannot connect to host", "",
                        "Unauthorized: Bearer %s rejected" % KEY])
    msg = bench.failure(0, "", line, 8, "http://h:1", bench.NEW_MODULE, known=(KEY,))
    assert "only 5 of 8 requests completed" in msg and "Cannot connect to host" in msg
    assert KEY not in msg


def test_failure_when_the_client_exits_nonzero_or_writes_nothing():
    msg = bench.failure(1, "Server at http://h:1/v1/models is not ready. Exiting.\n", None, 8, "http://h:1",
                        bench.NEW_MODULE)
    assert "exited 1" in msg and "is not ready" in msg
    assert "wrote no result line" in bench.failure(0, "done\n", None, 8, "http://h:1", bench.NEW_MODULE)


def test_tail_redacts_the_key_the_client_prints_in_server_info():
    text = "line\n" * 40 + "server_info={'api_key': '%s', 'tp_size': 8}\n" % KEY
    got = bench.tail(text, lines=5, known=(KEY,))
    assert KEY not in got and "tp_size" in got and len(got.splitlines()) == 5


def test_tokenizer_from_model_info_as_the_client_picks_it():
    assert bench.tokenizer_from_model_info({"tokenizer_path": "/t", "model_path": "/m"}) == "/t"
    assert bench.tokenizer_from_model_info({"tokenizer_path": None, "model_path": "/m"}) == "/m"
    assert bench.tokenizer_from_model_info([]) is None


# -- main() with a small client double on PYTHONPATH: the module's plumbing (env, temp dir, messages) ----------
CLIENT = textwrap.dedent("""
    import json, os, sys
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    if os.environ.get("BENCH_DOUBLE_IMPORT_ERROR"):
        raise ModuleNotFoundError("No module named 'aiohttp'")
    n = int(args["--num-prompts"])
    ok = os.environ.get("OPENAI_API_KEY") == os.environ.get("BENCH_DOUBLE_EXPECT")
    print("server_info={'api_key': %r}" % os.environ.get("OPENAI_API_KEY"))
    print("hub token in use: %s" % os.environ.get("HF_TOKEN"))
    with open(os.environ["BENCH_DOUBLE_SEEN"], "w") as fh:
        json.dump({"argv": sys.argv, "tmpdir": os.environ.get("TMPDIR")}, fh)
    line = {"completed": n if ok else 0, "output_throughput": 101.5, "total_throughput": 203.0,
            "request_throughput": 0.8, "median_ttft_ms": 40.0, "median_itl_ms": 9.9, "median_e2e_latency_ms": 1300.0,
            "duration": 10.0, "max_concurrency": int(args["--max-concurrency"]),
            "errors": [] if ok else ["Unauthorized"] * n}
    with open(args["--output-file"], "a") as fh:
        fh.write(json.dumps(line) + "\\n")
""")


@pytest.fixture()
def double(tmp_path):
    pkg = tmp_path / "site" / "sglang" / "benchmark"
    pkg.mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "serving.py").write_text(CLIENT)
    return {"PYTHONPATH": str(tmp_path / "site"), "BENCH_DOUBLE_EXPECT": KEY,
            "BENCH_DOUBLE_SEEN": str(tmp_path / "seen.json")}


@pytest.fixture()
def server():
    """A loopback SGLang look-alike started with --api-key KEY: /v1/models and /model_info, 401 without the bearer."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):
            pass

        def do_GET(self):
            if self.headers.get("Authorization") != "Bearer " + KEY:
                code, body = 401, {"error": "Unauthorized"}
            elif self.path == "/model_info":
                code, body = 200, {"model_path": "/models/m", "tokenizer_path": "/models/m"}
            elif self.path == "/v1/models":
                code, body = 200, {"object": "list", "data": [{"id": "/models/m"}]}
            else:
                code, body = 404, {"detail": "Not Found"}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield "http://127.0.0.1:%d" % httpd.server_address[1]
    httpd.shutdown()


def run_main(args, capsys):
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    out = capsys.readouterr().out
    return json.loads(out), out


def test_main_hands_the_key_through_the_environment_and_removes_its_temp_dir(double, server, capsys):
    result, out = run_main({"python": sys.executable, "url": server, "api_key": KEY,
                            "num_prompts": 3, "max_concurrency": 2, "env": double}, capsys)
    assert not result.get("failed"), result
    assert result["module"] == "sglang.benchmark.serving" and result["completed"] == 3
    assert result["output_tok_s"] == 101.5 and result["median_itl_ms"] == 9.9 and result["max_concurrency"] == 2
    assert result["tokenizer"] == "/models/m"  # the server's /model_info, as the client picks it
    seen = json.loads(pathlib.Path(double["BENCH_DOUBLE_SEEN"]).read_text())
    assert KEY not in json.dumps(seen["argv"]) and KEY not in out
    assert not os.path.exists(seen["tmpdir"])  # the private dir with the result file is gone


def test_main_fails_with_the_count_when_requests_fail(double, server, capsys):
    double["BENCH_DOUBLE_EXPECT"] = "another-key"
    result, out = run_main({"python": sys.executable, "url": server, "api_key": KEY,
                            "tokenizer": "/m", "num_prompts": 2, "env": double}, capsys)
    assert result["failed"] and "only 0 of 2 requests completed: Unauthorized" in result["msg"]
    assert KEY not in out and "output_tail" in result


def test_main_fails_naming_the_missing_dependency(double, server, capsys):
    double["BENCH_DOUBLE_IMPORT_ERROR"] = "1"
    result, _ = run_main({"python": sys.executable, "url": server, "api_key": KEY, "tokenizer": "/m",
                          "env": double}, capsys)
    assert result["failed"] and "No module named 'aiohttp'" in result["msg"]


@pytest.mark.parametrize("key, words", [(None, "it was started with --api-key; pass the same key as api_key"),
                                        ("wrong", "api_key is not the server's --api-key")])
def test_main_refused_by_the_server_says_why_without_running_the_client(double, server, capsys, key, words):
    args = {"python": sys.executable, "url": server, "env": double}
    if key:
        args["api_key"] = key
    result, _ = run_main(args, capsys)
    assert result["failed"] and "refused the benchmark (HTTP 401)" in result["msg"] and words in result["msg"]
    assert not os.path.exists(double["BENCH_DOUBLE_SEEN"])  # the client never started


def test_main_with_no_server_says_it_did_not_answer(double, capsys):
    result, _ = run_main({"python": sys.executable, "url": "http://127.0.0.1:9", "env": double}, capsys)
    assert result["failed"] and "did not answer GET /v1/models" in result["msg"]


def test_main_without_sglang_says_so(capsys):
    result, _ = run_main({"python": sys.executable, "url": "http://127.0.0.1:9",
                          "env": {"PYTHONPATH": "/nonexistent"}}, capsys)
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("this interpreter has sglang")
    assert result["failed"] and "sglang is not installed" in result["msg"]


def test_main_refuses_bad_numbers(capsys):
    result, _ = run_main({"python": sys.executable, "url": "http://h:1", "num_prompts": 0}, capsys)
    assert result["failed"] and result["msg"] == "num_prompts must be at least 1 (got 0)"


def test_main_returns_no_env_value_and_hides_a_credentials_value(double, server, capsys):
    token = "hf_gpufleetBenchToken42"
    env = dict(double, HF_TOKEN=token, HF_HUB_OFFLINE="1")
    result, out = run_main({"python": sys.executable, "url": server, "api_key": KEY, "num_prompts": 3, "env": env},
                           capsys)
    assert not result.get("failed"), result
    # ansible-core up to 2.20 returns the module's arguments (invocation); 2.21 returns none: nothing to mask there
    if "invocation" in result:
        shown = result["invocation"]["module_args"]["env"]
        assert sorted(shown) == sorted(env) and set(shown.values()) == {"********"}
    assert token not in out and double["BENCH_DOUBLE_SEEN"] not in out
    # a short value such as HF_HUB_OFFLINE=1 does not mask the figures (what no_log on env would do)
    assert result["output_tok_s"] == 101.5 and result["completed"] == 3
    # the client's output echoing the token: the failure's tail and message do not hold it
    env["BENCH_DOUBLE_EXPECT"] = "another-key"
    result, out = run_main({"python": sys.executable, "url": server, "api_key": KEY, "tokenizer": "/m",
                            "num_prompts": 2, "env": env}, capsys)
    assert result["failed"] and "hub token in use: " in result["output_tail"]
    assert token not in out and KEY not in out
