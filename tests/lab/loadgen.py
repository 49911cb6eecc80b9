#!/usr/bin/env python3
"""Bounded load generator: continuous ``POST /generate`` requests (every other one streaming) against a URL.

    loadgen.py URL [--concurrency 8] [--seconds 60] [--max-requests 100000] [--max-new-tokens 16]

Library use: ``LoadGen(url, ...)`` with ``start()`` / ``stop()`` → result dict, or ``run(url, ...)``.
A request counts as failed when it raises (connection refused or reset, timeout), answers a status other
than 200, or its body is not what SGLang sends: a JSON object with ``text`` for a plain request; for
``"stream": true`` server-sent events ``data: {json with text}`` ending with ``data: [DONE]``.
Result: ``{"total_requests", "failed_requests", "streamed", "seconds", "errors": {cause: count}, "samples":
[first failures, at most 10], "first_failure_s", "last_failure_s"}`` (seconds from the start; None without failures). Prints ``failed_requests=N total_requests=M``.
"""
import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse


class LoadGen:
    def __init__(self, url, concurrency=8, max_requests=100000, max_s=600.0, max_new_tokens=16, timeout_s=60.0):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.concurrency, self.max_requests, self.max_s = concurrency, max_requests, max_s
        self.max_new_tokens, self.timeout_s = max_new_tokens, timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.total = self.failed = self.streamed = 0
        self.errors, self.samples = {}, []
        self._threads = []
        self._t0 = None
        self.first_failure_s = self.last_failure_s = None

    def _fail(self, cause, detail=""):
        with self._lock:
            t = time.time() - self._t0
            self.first_failure_s = t if self.first_failure_s is None else self.first_failure_s
            self.last_failure_s = t
            self.failed += 1
            self.errors[cause] = self.errors.get(cause, 0) + 1
            if len(self.samples) < 10:
                self.samples.append("%.1fs %s %s" % (time.time() - self._t0, cause, detail[:200]))

    def _take(self):
        with self._lock:
            if self._stop.is_set() or self.total >= self.max_requests or time.time() - self._t0 > self.max_s:
                return None
            self.total += 1
            return self.total

    def _one(self, conn, n):
        stream = n % 2 == 0
        body = json.dumps({"text": "request %d of the lab load" % n, "stream": stream,
                           "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0}})
        conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return "http_%d" % resp.status, data.decode(errors="replace")
        if not stream:
            try:
                ok = isinstance(json.loads(data).get("text"), str)
            except (ValueError, AttributeError):
                ok = False
            return (None, "") if ok else ("bad_json", data.decode(errors="replace"))
        events = [line[6:] for line in data.decode(errors="replace").splitlines() if line.startswith("data: ")]
        if not events or events[-1].strip() != "[DONE]":
            return "stream_without_done", data.decode(errors="replace")[-200:]
        try:
            if not all(isinstance(json.loads(e).get("text"), str) for e in events[:-1]) or len(events) < 2:
                return "bad_stream_event", data.decode(errors="replace")[:200]
        except (ValueError, AttributeError):
            return "bad_stream_event", data.decode(errors="replace")[:200]
        with self._lock:
            self.streamed += 1
        return None, ""

    def _worker(self):
        conn = None
        while True:
            n = self._take()
            if n is None:
                break
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                cause, detail = self._one(conn, n)
            except (OSError, http.client.HTTPException) as exc:
                cause, detail = type(exc).__name__, str(exc)
                conn.close()
                conn = None
            if cause:
                self._fail(cause, detail)
        if conn is not None:
            conn.close()

    def start(self):
        self._t0 = time.time()
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        return self.result()

    def wait(self):
        for t in self._threads:
            t.join()
        return self.result()

    def result(self):
        with self._lock:
            return {"total_requests": self.total, "failed_requests": self.failed, "streamed": self.streamed,
                    "seconds": round(time.time() - self._t0, 1), "errors": dict(self.errors),
                    "samples": list(self.samples),
                    "first_failure_s": None if self.first_failure_s is None else round(self.first_failure_s, 1),
                    "last_failure_s": None if self.last_failure_s is None else round(self.last_failure_s, 1)}


def run(url, **kw):
    return LoadGen(url, **kw).start().wait()


def main(argv=None):
    p = argparse.ArgumentParser(prog="loadgen.py", description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-requests", type=int, default=100000)
    p.add_argument("--max-new-tokens", type=int, default=16)
    a = p.parse_args(argv)
    res = run(a.url, concurrency=a.concurrency, max_s=a.seconds, max_requests=a.max_requests,
              max_new_tokens=a.max_new_tokens)
    print(json.dumps(res, indent=1))
    print("failed_requests=%d total_requests=%d" % (res["failed_requests"], res["total_requests"]))
    return 1 if res["failed_requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
