"""sglang_generate_bench: sends SGLang's bearer when an api_key is given, and never reports the key."""
import importlib.util
import json
import pathlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "sglang_generate_bench", ROOT / "plugins" / "modules" / "sglang_generate_bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

KEY = "sk-gpufleet-bench-51c2e8"


@pytest.fixture()
def server_url():
    """A loopback /generate that, like SGLang with --api-key, answers 401 without the right bearer."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.headers.get("Authorization") != "Bearer " + KEY:
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            n = body["sampling_params"]["max_new_tokens"]
            data = json.dumps({"text": "x", "meta_info": {"completion_tokens": n}}).encode()
            self.send_response(200)
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
            bench.main()
    out = capsys.readouterr().out
    return json.loads(out), out


def test_bench_sends_the_bearer_and_masks_the_key(server_url, capsys):
    result, out = run_main({"url": server_url, "api_key": KEY, "requests": 3, "concurrency": 2,
                            "max_new_tokens": 5}, capsys)
    assert not result.get("failed") and result["completion_tokens"] == 15
    assert KEY not in out


def test_bench_without_the_key_fails_naming_the_401(server_url, capsys):
    result, _ = run_main({"url": server_url, "requests": 1, "concurrency": 1, "max_new_tokens": 5}, capsys)
    assert result["failed"] and "401" in result["msg"]


def test_request_headers_add_authorization_only_with_a_key():
    assert "Authorization" not in bench.request_headers(None)
    assert "Authorization" not in bench.request_headers("")
    assert bench.request_headers("k")["Authorization"] == "Bearer k"
