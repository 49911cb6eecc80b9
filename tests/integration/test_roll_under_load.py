"""Rolling restart behind the real sglang-router (PyPI sglang-router, tests/lab/lab_router.py) under load.

The short form of ``make roll-under-load``: the router runs on the lab bridge in front of three lab hosts;
loadgen.py sends continuous streaming and plain ``/generate`` requests through it while restart.yml, with
``gpufleet_router_url`` set, restarts two hosts one at a time. Then a restart whose new server crashes: the host
is rolled back and its old server is back in the router's pool. Asserts on the router's own worker list, the
playbook's events and the clients' results.
"""
import os
import sys
import time
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
