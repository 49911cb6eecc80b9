"""gpufleet_burst: the verification's concurrent /generate burst against a loopback server that hangs after N
answers (accepts, reads the request, never replies: a hung scheduler, sgl-project/sglang#22779)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_burst as B

KEY = "sk-gpufleet-burst-7f1d"


def serve(hang_after=None, status=200, body=None, want_key=None, delay_s=0.0):
    """A loopback /generate; returns (url, state, close). ``hang_after``: answers that many, then never replies."""
    state = {"answered": 0, "seen": 0, "keys": set()}
    lock = threading.Lock()
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def do_POST(self):
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            json.loads(raw)
            with lock:
                state["seen"] += 1
                state["keys"].add(self.headers.get("Authorization"))
                hang = hang_after is not None and state["answered"] >= hang_after
                if not hang:
                    state["answered"] += 1
            if hang:
                release.wait(30)
                return
            if want_key and self.headers.get("Authorization") != "Bearer " + want_key:
                code, data = 401, b'{"error": "Unauthorized"}'
            else:
                time.sleep(delay_s)
                code, data = status, json.dumps(body if body is not None else {"text": " Paris"}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # socketserver's 5 drops SYNs of a burst of 8 (1 s retransmit); uvicorn has 2048

    httpd = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def close():
        release.set()
        httpd.shutdown()
        httpd.server_close()
    return "http://127.0.0.1:%d/generate" % httpd.server_address[1], state, close


@pytest.fixture
def server(request):
    made = []

    def make(**kw):
        url, state, close = serve(**kw)
        made.append(close)
        return url, state
    yield make
    for close in made:
        close()


def test_a_healthy_server_answers_every_request_of_the_burst(server):
    url, state = server()
    res = B.run_burst(url, requests=32, concurrency=8, timeout_s=5)
    assert res["ok"] and res["answered"] == 32 and state["seen"] == 32
    assert res["timed_out"] == res["not_sent"] == res["connection_errors"] == 0 and res["http_errors"] == {}
    assert res["msg"].startswith("32 of 32 answered in ") and res["msg"].endswith(" s (8 at a time)")
    assert res["wall_s"] < 0.9, res  # no request waited for a retransmitted SYN


def test_a_server_hanging_after_5_fails_naming_5_of_32_within_about_one_timeout(server):
    url, state = server(hang_after=5)
    began = time.monotonic()
    res = B.run_burst(url, requests=32, concurrency=8, timeout_s=1.0)
    took = time.monotonic() - began
    assert not res["ok"]
    assert res["answered"] == 5
    # the 8 in flight when it hung (5 answered + 8 sent; the rest never started)
    assert res["timed_out"] == 8 and res["not_sent"] == 32 - 5 - 8
    assert res["msg"].startswith("5 of 32 answered in "), res["msg"]
    assert "8 got no answer within 1 s" in res["msg"] and "19 not sent after the first request" in res["msg"]
    # no new request after the first timeout: about one timeout, not four rounds of them
    assert took < 3.5, took
    assert state["seen"] == 13


def test_http_errors_are_answers_the_burst_goes_on_and_fails_naming_the_status(server):
    url, state = server(status=503, body={"error": "overloaded"})
    res = B.run_burst(url, requests=10, concurrency=3, timeout_s=5)
    assert not res["ok"] and res["answered"] == 0 and res["http_errors"] == {"503": 10}
    assert res["not_sent"] == 0 and state["seen"] == 10
    assert "10 answered HTTP 503" in res["msg"] and res["first_error"] == "HTTP 503"


def test_an_answer_without_generated_text_is_not_counted_as_answered(server):
    url, _ = server(body={"error": "no text here"})
    res = B.run_burst(url, requests=4, concurrency=2, timeout_s=5)
    assert res["answered"] == 0 and res["http_errors"] == {"200": 4}
    assert "4 answered HTTP 200 without generated text" in res["msg"]


def test_a_closed_port_is_a_connection_error_and_stops_the_burst():
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    res = B.run_burst("http://127.0.0.1:%d/generate" % port, requests=20, concurrency=1, timeout_s=2)
    assert not res["ok"] and res["connection_errors"] == 1 and res["not_sent"] == 19
    assert "refused" in res["msg"].lower(), res["msg"]


def test_the_api_key_is_sent_as_bearer_and_never_in_the_result(server):
    url, state = server(want_key=KEY)
    res = B.run_burst(url, requests=6, concurrency=3, timeout_s=5, api_key=KEY)
    assert res["ok"] and state["keys"] == {"Bearer " + KEY}
    assert KEY not in json.dumps(res)
    without = B.run_burst(url, requests=2, concurrency=1, timeout_s=5)
    assert without["http_errors"] == {"401": 2} and "2 answered HTTP 401" in without["msg"]


def test_an_http_proxy_in_the_environment_is_not_used(server, monkeypatch):
    url, _ = server()
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # discard port: a proxied request would fail
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    assert B.run_burst(url, requests=3, concurrency=3, timeout_s=5)["ok"]


@pytest.mark.parametrize("args, word", [
    ((-1, 8, 8, 10), "burst.requests"), ((1001, 8, 8, 10), "burst.requests"), ((32, 0, 8, 10), "burst.concurrency"),
    ((32, 65, 8, 10), "burst.concurrency"), ((32, 8, 0, 10), "burst.max_new_tokens"),
    ((32, 8, 8, 0), "burst.timeout_s")])
def test_settings_out_of_range_are_named(args, word):
    [error] = B.burst_errors(*args)
    assert error.startswith(word)


def test_zero_requests_is_no_burst_and_valid_whatever_the_rest():
    assert B.burst_errors(0, 0, 0, 0) == []
    assert B.burst_errors(32, 8, 8, 10.0) == []
