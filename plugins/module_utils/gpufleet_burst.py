# -*- coding: utf-8 -*-
# gpufleet: the verification's short concurrent burst of POST /generate (sglang_process state=verified).
"""A short burst of concurrent generations, to catch a server that answers one request and then hangs.

Why: sgl-project/sglang#22779 — after a SIGKILL restart a server answered its health check and single
requests, then hung after about 100 requests. One ``/generate`` proves nothing about that; a burst of a few
dozen small generations, several at a time, with a short per-request timeout, shows it in seconds.

How requests are counted (:func:`run_burst`):
- ``answered``: HTTP 200 whose JSON carries ``text`` (SGLang's native /generate answer, all releases).
- ``http_errors``: an HTTP answer other than that (status → count; 200 without text counts under 200). The
  server answered, so the burst goes on: the counts show how much of it failed (503s under load, 401s).
- ``timed_out``: no answer within ``timeout_s`` (the socket accepted, nothing came back: a hung scheduler).
- ``connection_errors``: refused or reset (the server is gone or the port closed).
- ``not_sent``: after the first request that got no answer (timed out or connection error) no new one starts:
  each would only wait its timeout out. The burst then ends within about one ``timeout_s``.
The burst passes only when every request was answered.

Stdlib only (urllib, threads); never through an http_proxy (the server is on this host).
"""
from __future__ import annotations

import json
import socket
import threading
import time

from urllib import request as _urlrequest
from urllib.error import HTTPError, URLError

DEFAULT_REQUESTS = 32
DEFAULT_CONCURRENCY = 8
DEFAULT_MAX_NEW_TOKENS = 8
DEFAULT_TIMEOUT_S = 10.0
# Beyond these a burst is a load test, not a check (and each in-flight request is a thread).
MAX_REQUESTS = 1000
MAX_CONCURRENCY = 64


def burst_errors(requests, concurrency, max_new_tokens, timeout_s):
    """What is wrong with a burst's settings, as a list of messages naming the option ([] when fine).

    ``requests`` 0 means no burst and is fine; otherwise 1..MAX_REQUESTS, ``concurrency`` 1..MAX_CONCURRENCY,
    ``max_new_tokens`` at least 1, ``timeout_s`` more than 0.
    """
    errors = []
    if requests < 0 or requests > MAX_REQUESTS:
        errors.append("burst.requests must be 0 (no burst) to %d, got %s" % (MAX_REQUESTS, requests))
    if requests and not 1 <= concurrency <= MAX_CONCURRENCY:
        errors.append("burst.concurrency must be 1 to %d, got %s" % (MAX_CONCURRENCY, concurrency))
    if requests and max_new_tokens < 1:
        errors.append("burst.max_new_tokens must be at least 1, got %s" % max_new_tokens)
    if requests and not timeout_s > 0:
        errors.append("burst.timeout_s must be more than 0, got %s" % timeout_s)
    return errors


def _opener():
    # No ProxyHandler entries: an http_proxy in the environment must not carry a request to this host's server.
    return _urlrequest.build_opener(_urlrequest.ProxyHandler({}))


def post_once(opener, url, body, headers, timeout_s):
    """One POST; returns ``(kind, detail)``: kind ``answered``, ``http`` (detail: status int), ``timeout`` or
    ``connection`` (detail: the reason as text). Never raises for network outcomes."""
    req = _urlrequest.Request(url, data=body, headers=headers, method="POST")
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            status, raw = resp.getcode(), resp.read()
    except HTTPError as exc:
        return "http", exc.code
    except (socket.timeout, TimeoutError):
        return "timeout", "no answer within %g s" % timeout_s
    except URLError as exc:
        reason = exc.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return "timeout", "no answer within %g s" % timeout_s
        return "connection", str(reason)
    except (OSError, ValueError) as exc:  # reset mid-answer, a broken status line
        return "connection", str(exc) or exc.__class__.__name__
    try:
        answer = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        answer = None
    if status == 200 and isinstance(answer, dict) and "text" in answer:
        return "answered", status
    return "http", status


def run_burst(url, requests=DEFAULT_REQUESTS, concurrency=DEFAULT_CONCURRENCY, max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
              timeout_s=DEFAULT_TIMEOUT_S, api_key=None, text="The capital of France is", post=post_once,
              monotonic=time.monotonic):
    """Send ``requests`` generations to ``url`` (``.../generate``), ``concurrency`` at a time, each allowed
    ``timeout_s`` seconds; with ``api_key``, SGLang's ``Authorization: Bearer`` header (never in the result).

    Returns ``{"ok", "requests", "concurrency", "answered", "timed_out", "connection_errors", "http_errors"
    ({status as str: count}), "not_sent", "wall_s", "slowest_ms" (slowest answered request), "first_error"
    (text or None), "msg"}`` (see :func:`burst_message`). Counting: see the module docstring.
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                         "temperature": 0}}).encode()
    opener = _opener() if post is post_once else None
    lock = threading.Lock()
    state = {"next": 0, "stop": False, "answered": 0, "timed_out": 0, "connection_errors": 0, "http_errors": {},
             "slowest_ms": 0, "first_error": None}

    def take():
        with lock:
            if state["stop"] or state["next"] >= requests:
                return None
            state["next"] += 1
            return state["next"]

    def worker():
        while take() is not None:
            began = monotonic()
            kind, detail = post(opener, url, body, headers, timeout_s)
            took_ms = int((monotonic() - began) * 1000)
            with lock:
                if kind == "answered":
                    state["answered"] += 1
                    state["slowest_ms"] = max(state["slowest_ms"], took_ms)
                    continue
                if kind == "http":
                    key = str(detail)
                    state["http_errors"][key] = state["http_errors"].get(key, 0) + 1
                    error = "HTTP %s" % detail
                else:
                    state["timed_out" if kind == "timeout" else "connection_errors"] += 1
                    state["stop"] = True
                    error = detail
                if state["first_error"] is None:
                    state["first_error"] = error

    started = monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for dummy in range(max(1, min(concurrency, requests)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = monotonic() - started
    with lock:
        sent = state["next"]
        out = {"requests": requests, "concurrency": concurrency, "answered": state["answered"],
               "timed_out": state["timed_out"], "connection_errors": state["connection_errors"],
               "http_errors": dict(state["http_errors"]), "not_sent": requests - sent,
               "wall_s": round(wall_s, 3), "slowest_ms": state["slowest_ms"], "first_error": state["first_error"],
               "timeout_s": timeout_s}
    out["ok"] = out["answered"] == requests
    out["msg"] = burst_message(out)
    return out


def burst_message(result):
    """One line: ``32 of 32 answered in 1.4 s (8 at a time)``, or for a failed burst what happened to the
    others, e.g. ``5 of 32 answered in 3.1 s (8 at a time); 8 got no answer within 3 s; 19 not sent after
    the first request without an answer``."""
    line = "%d of %d answered in %.1f s (%d at a time)" % (result["answered"], result["requests"], result["wall_s"],
                                                           result["concurrency"])
    parts = []
    if result["timed_out"]:
        parts.append("%d got no answer within %g s" % (result["timed_out"], result["timeout_s"]))
    if result["connection_errors"]:
        parts.append("%d connection error(s) (%s)" % (result["connection_errors"], result["first_error"]))
    for status, count in sorted(result["http_errors"].items()):
        parts.append("%d answered HTTP %s%s" % (count, status, " without generated text" if status == "200" else ""))
    if result["not_sent"]:
        parts.append("%d not sent after the first request without an answer" % result["not_sent"])
    return "; ".join([line] + parts)
