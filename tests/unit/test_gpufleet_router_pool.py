"""The router's pool as the router routes (plugins/module_utils/gpufleet_router_pool.py), fed with what the real
routers answered (tests/unit/data/router/, recorded in the lab from sglang-router 0.3.2 and smg 1.13.0 in front of
four lab hosts: GET /workers and the Prometheus exporter, --prometheus-port):

- ``*-idle``: all four workers serving, no outage;
- ``*-open``: the server of 10.213.141.2 killed under load: its circuit breaker open (smg_worker_cb_state 1) while
  GET /workers still lists it ``is_healthy: true``;
- ``*-removed`` / ``*-draining``: right after DELETE /workers/{id} of 10.213.141.1 (sglang-router: gone from the list,
  its series -1; smg: listed ``status: draining``, ``is_healthy: false``, health gauge 0);
- ``smg-1.13.0-after-baseline-roll.prom``: the exporter of smg during ``make roll-under-load ROUTER=smg``, after the
  baseline roll (restart.yml not telling the router) had restarted three of the four hosts: three circuits open
  (closed→open once each), one closed, every worker healthy;
- ``*-duplicate-post.http``: POST /workers for a URL the router lists (smg: 409 WORKER_ALREADY_EXISTS; sglang-router:
  202).
"""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "unit" / "data" / "router"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pool = _load("gpufleet_router_pool_under_test", "plugins/module_utils/gpufleet_router_pool.py")
filters = _load("gpufleet_router_filters_409", "plugins/filter/gpufleet_router.py")

W = ["http://10.213.141.%d:30000" % n for n in (1, 2, 3, 4)]
ROUTERS = ["sglang-router-0.3.2", "smg-1.13.0"]


def recorded(name):
    """(workers list, metrics text) of a recording."""
    workers = json.loads((DATA / (name + ".workers.json")).read_text())["workers"]
    return workers, (DATA / (name + ".prom")).read_text()


def view_of(name, metrics_read=True):
    workers, text = recorded(name)
    return pool.pool_view(workers, pool.parse_worker_metrics(text), metrics_read)


@pytest.mark.parametrize("router", ROUTERS)
def test_open_circuit_is_read_from_the_metrics_although_the_list_says_healthy(router):
    workers, text = recorded(router + "-open")
    assert all(w["is_healthy"] is True for w in workers)  # what GET /workers alone shows
    gauges = pool.parse_worker_metrics(text)
    assert {u: g["cb_state"] for u, g in gauges.items()} == {W[0]: 0, W[1]: 1, W[2]: 0, W[3]: 0}
    assert {u: g["health"] for u, g in gauges.items()} == dict.fromkeys(W, 1)
    view = {e["url"]: e for e in view_of(router + "-open")}
    assert view[W[1]]["routable"] is False and view[W[1]]["circuit"] == "open"
    assert view[W[1]]["why"] == "circuit open"
    assert all(view[u]["routable"] and view[u]["circuit"] == "closed" for u in (W[0], W[2], W[3]))


@pytest.mark.parametrize("router", ROUTERS)
def test_a_worker_may_leave_while_enough_others_take_traffic(router):
    view = view_of(router + "-open")
    v = pool.leave_verdict(view, W[0], 1)
    assert v["ok"] and v["others"] == 3 and v["routable"] == 2
    assert v["not_routable"] == {W[1]: "circuit open"}
    assert "2 of 3 other worker(s) take traffic" in v["msg"] and W[1] + " (circuit open)" in v["msg"]
    assert pool.leave_verdict(view, W[0], 2)["ok"]
    refused = pool.leave_verdict(view, W[0], 3)
    assert not refused["ok"] and "gpufleet_router_min_healthy 3" in refused["msg"]
    assert pool.leave_verdict(view, W[0], 0)["ok"]


@pytest.mark.parametrize("router", ROUTERS)
def test_the_last_worker_with_a_closed_circuit_may_not_leave(router):
    """The issue's case: three circuits open after the baseline roll, one closed: that one must not go out."""
    workers, text = recorded(router + "-open")
    for u in (W[2], W[3]):  # open two more circuits, as the real text writes them
        text = text.replace('smg_worker_cb_state{worker="%s"} 0' % u, 'smg_worker_cb_state{worker="%s"} 1' % u)
    view = pool.pool_view(workers, pool.parse_worker_metrics(text), True)
    v = pool.leave_verdict(view, W[0], 1)
    assert not v["ok"] and v["routable"] == 0 and set(v["not_routable"]) == {W[1], W[2], W[3]}
    assert v["msg"].startswith("0 of 3 other worker(s) take traffic")
    assert pool.leave_verdict(view, W[1], 1)["ok"]  # an open worker may go: W[0] still takes traffic
    # without the metrics the list alone lets it go (the run says that the circuit state was not read)
    assert pool.leave_verdict(pool.pool_view(workers, {}, False), W[0], 1)["ok"]


def test_half_open_takes_traffic():
    workers, text = recorded("smg-1.13.0-open")
    text = text.replace('smg_worker_cb_state{worker="%s"} 1' % W[1], 'smg_worker_cb_state{worker="%s"} 2' % W[1])
    view = {e["url"]: e for e in pool.pool_view(workers, pool.parse_worker_metrics(text), True)}
    assert view[W[1]]["routable"] and view[W[1]]["circuit"] == "half_open"


@pytest.mark.parametrize("router", ROUTERS)
def test_idle_pool_all_routable(router):
    view = view_of(router + "-idle") if (DATA / (router + "-idle.workers.json")).exists() else None
    if view is None:
        workers, _ = recorded(router + "-open")
        view = pool.pool_view(workers, pool.parse_worker_metrics((DATA / (router + "-idle.prom")).read_text()), True)
    assert sorted(e["url"] for e in view) == W and all(e["routable"] for e in view)
    assert pool.routable_verdict(view, W[0]) == {"ok": True, "listed": True,
                                                 "msg": W[0] + " takes traffic (circuit closed)"}


def test_smg_without_series_yet_counts_circuits_closed():
    """smg 1.13 creates a worker's gauges at its first request or health pass: none yet = the breaker it starts
    with, closed (not 'unknown')."""
    workers, _ = recorded("smg-1.13.0-idle")
    view = pool.pool_view(workers, pool.parse_worker_metrics("# TYPE smg_worker_pool_size gauge\n"), True)
    assert all(e["routable"] and e["circuit"] == "closed" for e in view)


def test_sglang_router_removed_worker_is_gone_from_list_and_its_series_is_minus_one():
    workers, text = recorded("sglang-router-0.3.2-removed")
    gauges = pool.parse_worker_metrics(text)
    assert gauges[W[0]] == {"cb_state": -1, "health": -1}
    view = pool.pool_view(workers, gauges, True)
    assert W[0] not in [e["url"] for e in view]
    r = pool.routable_verdict(view, W[0])
    assert r == {"ok": False, "listed": False, "msg": W[0] + " is not listed"}
    assert pool.leave_verdict(view, W[1], 1)["routable"] == 2  # the removed one does not count


def test_smg_draining_worker_is_listed_but_takes_no_traffic():
    view = {e["url"]: e for e in view_of("smg-1.13.0-draining")}
    assert view[W[0]]["status"] == "draining" and not view[W[0]]["routable"]
    assert view[W[0]]["why"] == "is_healthy false, status draining, health gauge 0"
    r = pool.routable_verdict(list(view.values()), W[0])
    assert not r["ok"] and r["listed"] and "takes no traffic: is_healthy false, status draining" in r["msg"]
    v = pool.leave_verdict(list(view.values()), W[1], 3)
    assert not v["ok"] and v["routable"] == 2 and W[0] in v["not_routable"]


def test_metrics_not_read_says_unknown_and_decides_on_the_list():
    workers, _ = recorded("smg-1.13.0-draining")
    view = {e["url"]: e for e in pool.pool_view(workers, None, False)}
    assert all(e["circuit"] == "unknown" for e in view.values())
    assert not view[W[0]]["routable"] and view[W[1]]["routable"]


def test_metric_parser_ignores_other_series_and_odd_lines():
    text = ('# HELP smg_worker_cb_state x\nsmg_worker_cb_state{worker="http://a:1"} 1\n'
            'smg_worker_cb_state_other{worker="http://b:1"} 1\nsmg_worker_health{worker="http://a:1"} NaN\n'
            'smg_worker_health{worker="http://c:1",extra="x \\"q\\""} 1\nsmg_worker_cb_state{} 0\ngarbage\n')
    assert pool.parse_worker_metrics(text) == {"http://a:1": {"cb_state": 1, "health": None},
                                               "http://c:1": {"cb_state": None, "health": 1}}
    assert pool.parse_worker_metrics("") == {} and pool.parse_worker_metrics(None) == {}


def _http(name):
    head, _, body = (DATA / name).read_text().partition("\n\n")
    status = int(head.split()[1])
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    return {"status": status, "json": parsed, "content": body}


def test_duplicate_post_is_present_for_smg_409_and_added_for_sglang_router_202():
    smg = _http("smg-1.13.0-duplicate-post.http")
    assert smg["status"] == 409 and smg["json"]["code"] == "WORKER_ALREADY_EXISTS"
    assert filters.gpufleet_router_add_outcome(smg) == "present"
    assert filters.gpufleet_router_add_outcome(dict(smg, json=None)) == "present"  # body not parsed as JSON
    old = _http("sglang-router-0.3.2-duplicate-post.http")
    assert old["status"] == 202 and filters.gpufleet_router_add_outcome(old) == "added"


@pytest.mark.parametrize("result", [
    {"status": 409, "json": {"code": "WORKER_CONFLICT", "error": "x"}, "content": ""},
    {"status": 400, "json": {"code": "WORKER_ALREADY_EXISTS"}},
    {"status": 401, "content": "Missing or invalid Authorization header"},
    {"status": -1, "msg": "Connection refused"}, {"status": "x"}, None, "x",
])
def test_other_answers_to_a_post_fail(result):
    assert filters.gpufleet_router_add_outcome(result) == "failed"


def test_after_the_baseline_roll_only_the_closed_worker_is_held_back():
    """The issue's case as recorded: GET /workers listed all four is_healthy true (the list below says so); the
    integrated roll took out the one worker whose circuit was closed (~20 % 503 no_available_workers)."""
    text = (DATA / "smg-1.13.0-after-baseline-roll.prom").read_text()
    urls = ["http://10.213.97.%d:30000" % n for n in (1, 2, 3, 4)]
    workers = [{"id": str(n), "url": u, "is_healthy": True, "status": "ready"} for n, u in enumerate(urls)]
    view = pool.pool_view(workers, pool.parse_worker_metrics(text), True)
    assert [e["circuit"] for e in view] == ["open", "open", "open", "closed"]
    held = pool.leave_verdict(view, urls[3], 1)
    assert not held["ok"] and held["routable"] == 0 and sorted(held["not_routable"]) == urls[:3]
    for u in urls[:3]:  # any of the open ones may go: the closed one takes the traffic
        assert pool.leave_verdict(view, u, 1)["ok"]
        assert not pool.leave_verdict(view, u, 2)["ok"]
    assert pool.routable_verdict(view, urls[0])["msg"] == urls[0] + " is listed but takes no traffic: circuit open"


def test_failed_removals_carry_no_request_headers():
    results = [
        {"status": 202, "item": {"id": "a"}, "invocation": {"module_args": {"headers": {"Authorization": "Bearer k"}}}},
        {"status": 404, "item": {"id": "b"}},
        {"status": 401, "msg": "HTTP Error 401: Unauthorized", "item": {"id": "c", "url": "http://x:1"},
         "invocation": {"module_args": {"headers": {"Authorization": "Bearer secret-key"}}}},
        {"status": -1, "msg": "Request failed: <urlopen error timed out>", "item": {"id": "d"}},
        {"skipped": True}, {},
    ]
    out = filters.gpufleet_router_failed_removals(results)
    assert out == [{"id": "c", "status": 401, "msg": "HTTP Error 401: Unauthorized"},
                   {"id": "d", "status": -1, "msg": "Request failed: <urlopen error timed out>"},
                   {"id": "?", "status": "nothing", "msg": ""}]
    assert "secret-key" not in json.dumps(out)
    assert filters.gpufleet_router_failed_removals(None) == []
