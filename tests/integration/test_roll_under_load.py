"""Rolling restart behind the real sglang-router (PyPI sglang-router, tests/lab/lab_router.py) under load.

The short form of ``make roll-under-load``: the router runs on the lab bridge in front of three lab hosts;
loadgen.py sends continuous streaming and plain ``/generate`` requests through it while restart.yml, with
``gpufleet_router_url`` set, restarts two hosts one at a time. Then a restart whose new server crashes: the host
is rolled back and its old server is back in the router's pool. Asserts on the router's own worker list, the
playbook's events and the clients' results.

Then smg (sglang-router's successor, the pinned PyPI wheel) in front of the first host and a worker whose requests
fail (its circuit breaker opens while GET /workers lists it healthy), its worker routes behind a control-plane key:
the removal waits for / refuses on the router's own view of the pool, a draining entry is waited out before the
re-add, a duplicate POST's 409 counts as present, and the key never shows in output, events or command lines.
"""
import importlib.util
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "lab"))
import lab_router  # noqa: E402
import loadgen  # noqa: E402

PLAYBOOK = "playbooks/restart.yml"
FAST = {"sglang_stop_grace_s": 10, "sglang_launch_ready_slice_s": 5}

pytestmark = pytest.mark.lab_only_once


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def server_pid(lab, host):
    res = lab.exec(host, ["cat", "%s/sglang.pid" % lab.host_vars(host)["sglang_state_dir"]])
    return int(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def worker_url(lab, host):
    return "http://%s:%d" % (lab.host_vars(host)["sglang_host"], int(lab.host_vars(host).get("sglang_port", 30000)))


def pool(url):
    """{worker url: (id, is_healthy)} as the router lists it."""
    return {w["url"]: (w["id"], w["is_healthy"]) for w in lab_router.get_json(url + "/workers")["workers"]}


@pytest.fixture(scope="module")
def router(lab):
    """The first three lab hosts (fewer in a smaller lab) serving (launched by restart.yml) behind a router that lists
    them all healthy; info["hosts"] = their names."""
    hosts = lab.hosts[:3]
    idle = [h for h in hosts if not (lab.wait_http(h, timeout_s=1) == 200 and server_pid(lab, h))]
    if idle:
        runner = lab.run_playbook(PLAYBOOK, limit=",".join(idle), extravars=dict(FAST, gpufleet_serial=len(idle)))
        assert runner.status == "successful", stdout_of(runner)[-4000:]
    info = dict(lab_router.start(lab.lab_dir, port=38000 + os.getpid() % 1000, hosts=hosts), hosts=hosts)
    try:
        yield info
    finally:
        lab_router.stop(lab.lab_dir)


def test_rolling_restart_behind_the_router_fails_no_request(lab, router):
    hosts = lab.hosts[:2]
    before = pool(router["url"])
    pids = {h: server_pid(lab, h) for h in hosts}
    gen = loadgen.LoadGen(router["url"], concurrency=4, max_s=600, max_new_tokens=16).start()
    runner = lab.run_playbook(PLAYBOOK, limit=",".join(hosts),
                              extravars=dict(FAST, gpufleet_serial=1, gpufleet_router_url=router["url"]))
    res = gen.stop()
    out = stdout_of(runner)
    assert runner.status == "successful", out[-4000:]
    assert res["failed_requests"] == 0 and res["total_requests"] >= 200, res
    assert res["streamed"] >= 100, res
    # each restarted host left the pool (DELETE) before its stop and came back as a new worker entry, healthy
    removed = [d["host"] for d in lab.events(runner, "runner_on_ok", "uri") if d["task"] == "Router - remove the worker"]
    assert sorted(removed) == sorted(hosts), removed
    after = pool(router["url"])
    assert set(after) == set(before) and all(healthy for _, healthy in after.values()), after
    for h in hosts:
        assert after[worker_url(lab, h)][0] != before[worker_url(lab, h)][0]
        assert server_pid(lab, h) != pids[h]
    for h in router["hosts"][2:]:
        assert after[worker_url(lab, h)] == before[worker_url(lab, h)]
    # per host: removal, then the idle server, then the stop (module sglang_stop; preflight ran it in check mode first)
    seen = [(d["host"], "stop" if d.get("task_action", "").endswith("sglang_stop") else d["task"])
            for d in lab.events(runner, "runner_on_ok")]
    for h in hosts:
        mine = [t for host, t in seen if host == h and t in (
            "Router - remove the worker", "Router - wait until the server has no request in flight", "stop")]
        assert mine[-3:] == ["Router - remove the worker", "Router - wait until the server has no request in flight",
                            "stop"], mine

def test_a_failed_restart_puts_the_old_server_back_into_the_pool(lab, router):
    host = router["hosts"][-1]
    old_pid = server_pid(lab, host)
    lab.fault(host, crash_with_arg="--max-running-requests")
    try:
        args = dict(lab.host_vars(host)["sglang_launch_args"], **{"max-running-requests": 7})
        gen = loadgen.LoadGen(router["url"], concurrency=2, max_s=600, max_new_tokens=16).start()
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(FAST, sglang_launch_args=args,
                                                                       gpufleet_router_url=router["url"]))
        res = gen.stop()
    finally:
        lab.clear_faults(host)
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    assert "rollback: rolled_back" in out and "is back in the pool (the old server serves)" in out, out[-4000:]
    assert res["failed_requests"] == 0, res
    entry = pool(router["url"]).get(worker_url(lab, host))
    assert entry and entry[1] is True, pool(router["url"])
    assert server_pid(lab, host) not in (None, old_pid)


@pytest.mark.parametrize("spelling", ["loopback", "trailing slash"])
def test_a_loopback_or_misspelt_worker_url_is_refused_before_the_host_leaves_the_pool(lab, router, spelling):
    """gpufleet_router_worker_url on 127.0.0.1 names the router's own machine; with a trailing slash (or any path)
    it matches no entry of the router's list, which names workers as scheme://host:port: the run took the host for
    "not in the pool", stopped its server while the router kept sending it requests, and then added a second entry.
    Both are refused: nothing stopped or removed."""
    host = router["hosts"][0]
    pid = server_pid(lab, host)
    before = pool(router["url"])
    url = "http://127.0.0.1:30000" if spelling == "loopback" else worker_url(lab, host) + "/"
    assert spelling == "loopback" or url[:-1] in before, before
    runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(FAST, gpufleet_router_url=router["url"],
                                                                   gpufleet_router_worker_url=url))
    assert runner.status == "failed"
    out = stdout_of(runner)
    assert ("not a loopback" if spelling == "loopback" else "no path and no trailing slash") in out, out[-3000:]
    assert "Nothing was changed" in out, out[-3000:]
    assert server_pid(lab, host) == pid and lab.wait_http(host, timeout_s=2) == 200
    assert pool(router["url"]) == before


def test_a_host_down_and_out_of_the_pool_is_brought_back_by_a_plain_rerun(lab, router):
    """A failed run can leave a host serving nothing and out of the pool; its summary says so "until a
    restart.yml run for it succeeds". That rerun failed in the drain: the dead server's /v1/loads was refused
    for gpufleet_router_drain_timeout_s, the summary said "the old server still serves", and it tried to put
    the dead server back into the pool. A refused connection means nothing is in flight: the rerun launches,
    verifies and adds the worker, and says no server ran before it."""
    host = router["hosts"][1]
    url = worker_url(lab, host)
    old_pid = server_pid(lab, host)
    worker_id = pool(router["url"])[url][0]
    urllib.request.urlopen(urllib.request.Request(
        "%s/workers/%s" % (router["url"], urllib.parse.quote(worker_id, safe="")), method="DELETE"), timeout=10).read()
    lab.exec(host, ["kill", "-9", str(old_pid)], check=True)  # its workers follow (PR_SET_PDEATHSIG)
    deadline = time.time() + 30
    while time.time() < deadline and (url in pool(router["url"]) or lab.wait_http(host, timeout_s=0.5) == 200):
        time.sleep(0.2)
    assert url not in pool(router["url"]) and lab.wait_http(host, timeout_s=0.5) != 200
    runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(
        FAST, gpufleet_router_url=router["url"], gpufleet_router_drain_timeout_s=30))
    out = stdout_of(runner)
    assert runner.status == "successful", out[-4000:]
    [idle] = [d["res"]["msg"] for d in lab.events(runner, "runner_on_ok", "debug")
              if d["host"] == host and d["task"] == "Router - say that the server is idle"]
    assert "connection refused" in idle and "no request in flight" in idle, idle
    [line] = [x for x in out.split("GPUFLEET SUMMARY", 1)[1].splitlines() if x.startswith(host + ": ")]
    assert "ok: no server ran before this run" in line, line
    assert lab.wait_http(host, timeout_s=10) == 200 and server_pid(lab, host) not in (None, old_pid)
    assert pool(router["url"]).get(url, (None, False))[1] is True, pool(router["url"])


def test_a_refused_drain_probe_while_the_old_server_runs_elsewhere_stops_nothing(lab, router):
    """-e sglang_port=30001 behind the router: this run's worker URL and drain probe name a port nothing listens
    on, while the old server serves the router on 30000. A refused probe must not pass for "nothing in flight"
    there: the run fails before the stop, names the running server, and the pool is as it was."""
    host = router["hosts"][2]
    old_pid = server_pid(lab, host)
    before = pool(router["url"])
    runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(
        FAST, gpufleet_router_url=router["url"], sglang_port=30001, gpufleet_router_drain_timeout_s=30))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    failed = " ".join(d["res"].get("msg", "") for d in lab.events(runner, "runner_on_failed") if d["host"] == host)
    assert "was refused, but SGLang processes run" in failed and "sglang_port" in failed, failed
    assert "main pid %d" % old_pid in failed, failed
    assert server_pid(lab, host) == old_pid and lab.wait_http(host, timeout_s=5) == 200
    assert not lab.events(runner, "runner_on_ok", "sglang_stop") or all(
        e["ended"] == "would signal" for d in lab.events(runner, "runner_on_ok", "sglang_stop")
        for e in d["res"].get("signalled", []))
    assert pool(router["url"]) == before  # nothing removed, nothing added


# --- smg (sglang-router's successor, pinned in requirements/controller.txt) -------------------------------------------

class FailingWorker:
    """A worker the router finds healthy (200 to every GET: /health, /server_info, /v1/models, ...) whose every
    POST (a /generate) answers 500: the router's circuit breaker for it opens while GET /workers lists it
    is_healthy true, as after the outages of a roll the router was not told about."""

    def __init__(self, host, port):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"model_path": "lab-failing-worker", "is_generation": True, "loads": []})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._send(500, {"error": "lab failing worker"})

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.url = "http://%s:%d" % (host, port)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def smg_pool(router, key=None):
    """{worker url: (id, is_healthy, status)} as smg lists it."""
    return {w["url"]: (w["id"], w["is_healthy"], w.get("status"))
            for w in lab_router.get_json(router["url"] + "/workers", key=key or router["key"])["workers"]}


def cb_state(router, url):
    text = urllib.request.urlopen(router["metrics_url"], timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith('smg_worker_cb_state{worker="%s"}' % url):
            return float(line.split()[-1])
    return None


@pytest.fixture(scope="module")
def smg(lab, router):
    """smg 1.13 in front of the first lab host (serving, from the router fixture) and a FailingWorker, its worker
    routes behind a control-plane key; its circuit breaker opens after 2 failures and stays open 10 min."""
    port = 39000 + os.getpid() % 1000
    key = "cp-" + os.urandom(12).hex()
    host = lab.hosts[0]
    fake = FailingWorker(lab_router.bridge_ip(lab_router._lab_state(lab.lab_dir)), port + 2)
    info = lab_router.start(lab.lab_dir, port=port, router="smg", control_plane_key=key, hosts=[host], name="router-smg",
                            extra=["--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "600"])
    try:
        deadline = time.time() + 60
        req = urllib.request.Request(info["url"] + "/workers", data=json.dumps({"url": fake.url}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
        assert urllib.request.urlopen(req, timeout=10).status == 202
        while time.time() < deadline and not smg_pool(dict(info, key=key)).get(fake.url, (0, False))[1]:
            time.sleep(0.5)
        yield dict(info, key=key, host=host, fake=fake.url)
    finally:
        lab_router.stop(lab.lab_dir, "router-smg")
        fake.close()


def smg_vars(smg, **more):
    return dict(dict(FAST, gpufleet_router_url=smg["url"], gpufleet_router_metrics_url=smg["metrics_url"],
                     gpufleet_router_control_plane_key=smg["key"]), **more)


def test_smg_refuses_to_take_out_the_last_worker_that_takes_traffic(lab, smg):
    """Item 4: the router lists both workers is_healthy true, but the circuit of the other one is open (its
    requests failed): taking this host out would leave smg answering 503 no_available_workers. The run waits
    (gpufleet_router_routable_timeout_s), then fails before the stop: the old server serves, still in the pool."""
    host = smg["host"]
    gen = loadgen.LoadGen(smg["url"], concurrency=2, max_requests=8, max_new_tokens=2)
    res = gen.start().wait()  # the router retries the failing worker's 500s on the lab host: clients see 200
    assert res["failed_requests"] == 0, res
    assert cb_state(smg, smg["fake"]) == 1 and cb_state(smg, worker_url(lab, host)) == 0
    before = smg_pool(smg)
    assert before[smg["fake"]][1] is True  # GET /workers alone says healthy
    pid = server_pid(lab, host)
    runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=smg_vars(smg, gpufleet_router_routable_timeout_s=4))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    failed = " ".join(d["res"].get("msg", "") for d in lab.events(runner, "runner_on_failed") if d["host"] == host)
    assert "was not taken out of the pool" in failed and "0 of 1 other worker(s) take traffic" in failed, failed
    assert smg["fake"] + " (circuit open)" in failed and "The server was not stopped" in failed, failed
    assert "FAILED - RETRYING" in out and "wait until enough other workers take traffic" in out
    summary = out.split("GPUFLEET SUMMARY", 1)[1]
    assert host + ": failed in stop: sglang_router: " + worker_url(lab, host) + " was not taken out of the pool" in summary
    assert "rollback: not_needed" in summary and "the old server still serves as before" in summary, summary
    assert server_pid(lab, host) == pid and lab.wait_http(host, timeout_s=5) == 200
    assert smg_pool(smg) == before  # nothing removed
    assert smg["key"] not in out


def test_smg_min_healthy_above_the_pool_refuses_at_once(lab, smg):
    """gpufleet_router_min_healthy 2 while the pool lists one other worker: no wait can help, the removal is refused
    at once (no retry lines) and the pool is as it was."""
    host = smg["host"]
    before = smg_pool(smg)
    runner = lab.run_playbook("tests/integration/playbooks/router_roundtrip.yml", limit=host,
                              extravars=smg_vars(smg, gpufleet_router_min_healthy=2))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-3000:]
    failed = " ".join(d["res"].get("msg", "") for d in lab.events(runner, "runner_on_failed"))
    assert "(gpufleet_router_min_healthy 2)" in failed and "the pool lists only 1 other worker(s), not waited for" in failed
    assert "The server was not stopped and stays in the pool" in failed, failed
    assert "FAILED - RETRYING" not in out
    assert smg_pool(smg) == before


def test_smg_draining_entry_is_waited_out_before_the_add(lab, smg):
    """smg lists a removed worker as status draining until its requests are done; a POST meanwhile answers 409 and
    the entry then vanishes. Putting the worker back right after a removal waits the draining entry out, then adds
    it: in the pool, ready, routed to."""
    host, url = smg["host"], worker_url(lab, smg["host"])
    old_id = smg_pool(smg)[url][0]
    req = urllib.request.Request("%s/workers/%s" % (smg["url"], urllib.parse.quote(old_id, safe="")), method="DELETE",
                                 headers={"Authorization": "Bearer " + smg["key"]})
    assert urllib.request.urlopen(req, timeout=10).status == 202
    # 202: smg takes the worker out in the background; the entry turns draining a moment later (seen in CI)
    deadline, state = time.time() + 10, None
    while time.time() < deadline:
        state = smg_pool(smg).get(url, (None, None, None))[1:]
        if state == (False, "draining"):
            break
        time.sleep(0.02)
    assert state == (False, "draining"), state
    runner = lab.run_playbook("tests/integration/playbooks/router_roundtrip.yml", limit=host,
                              extravars=smg_vars(smg, router_steps=["present"]))
    out = stdout_of(runner)
    assert runner.status == "successful", out[-3000:]
    waited = [d for d in lab.events(runner, "runner_on_ok")
              if d["task"] == "Router - wait until the router has dropped a draining entry of the worker"]
    added = [d for d in lab.events(runner, "runner_on_ok") if d["task"] == "Router - add the worker"]
    assert waited and added  # both ran (runner_on_ok), not skipped
    after = smg_pool(smg)
    assert after[url][0] != old_id and after[url][1:] == (True, "ready"), after


def test_smg_control_plane_key_and_duplicate_add(lab, smg):
    """Item 5: smg's worker routes behind a control-plane key (not the data-plane --api-key): the role takes the
    host out and puts it back with gpufleet_router_control_plane_key, which never shows in the output, an event or
    any process's command line; a wrong key changes nothing; a duplicate POST answers 409 WORKER_ALREADY_EXISTS,
    which the role takes for "present"."""
    import threading
    host, url = smg["host"], worker_url(lab, smg["host"])
    with pytest.raises(urllib.error.HTTPError) as denied:
        lab_router.get_json(smg["url"] + "/workers", key="wrong")
    assert denied.value.code == 401
    before = smg_pool(smg)
    runner = lab.run_playbook("tests/integration/playbooks/router_roundtrip.yml", limit=host,
                              extravars=smg_vars(smg, gpufleet_router_control_plane_key="wrong"))
    assert runner.status == "failed"
    failed = " ".join(d["res"].get("msg", "") for d in lab.events(runner, "runner_on_failed"))
    assert "answered 401" in failed and "gpufleet_router_control_plane_key" in failed and "Nothing was changed" in failed
    assert smg_pool(smg) == before

    seen, stop = [], threading.Event()

    def watch():  # the key must never be in a command line (ps) while the play runs
        while not stop.is_set():
            for pid in os.listdir("/proc"):
                try:
                    with open("/proc/%s/cmdline" % pid, "rb") as fh:
                        if smg["key"].encode() in fh.read():
                            seen.append(pid)
                except OSError:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # min_healthy 0: the failing worker's circuit is open, so the pool check would (rightly) refuse
        runner = lab.run_playbook("tests/integration/playbooks/router_roundtrip.yml", limit=host,
                                  extravars=smg_vars(smg, gpufleet_router_min_healthy=0))
    finally:
        stop.set()
        watcher.join()
    out = stdout_of(runner)
    assert runner.status == "successful", out[-4000:]
    router_pid = json.load(open(os.path.join(lab.lab_dir, "router-smg.json")))["pid"]
    assert set(seen) <= {str(router_pid)}, seen  # only smg itself, started with --control-plane-api-keys
    assert smg["key"] not in out and all(smg["key"] not in json.dumps(ev) for ev in runner.events)
    [routed] = [d["res"]["msg"] for d in lab.events(runner, "runner_on_ok", "debug")
                if d["task"] == "Router - say that the router routes to the worker"]
    assert routed == url + " takes traffic (circuit closed)", routed
    after = smg_pool(smg)
    assert after[url][0] != before[url][0] and after[url][1:] == (True, "ready")

    req = urllib.request.Request(smg["url"] + "/workers", data=json.dumps({"url": url}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + smg["key"]})
    with pytest.raises(urllib.error.HTTPError) as dup:
        urllib.request.urlopen(req, timeout=10)
    body = dup.value.read().decode()
    assert dup.value.code == 409 and json.loads(body)["code"] == "WORKER_ALREADY_EXISTS"
    spec = importlib.util.spec_from_file_location("gpufleet_router_filter", os.path.join(ROOT, "plugins", "filter",
                                                                                       "gpufleet_router.py"))
    filters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(filters)
    # the role's POST task registers uri's result: status, the parsed json and the raw content
    assert filters.gpufleet_router_add_outcome({"status": 409, "json": json.loads(body), "content": body}) == "present"
    assert smg_pool(smg) == after  # the duplicate added nothing
