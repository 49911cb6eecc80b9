"""The capacity guard (plugins/filter/gpufleet_run.py: gpufleet_max_unavailable against gpufleet_serial) and the
router role's in-flight count (plugins/filter/gpufleet_router.py)."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load("gpufleet_run_filters_cap", "plugins/filter/gpufleet_run.py")
router = _load("gpufleet_router_filters", "plugins/filter/gpufleet_router.py")


@pytest.mark.parametrize("serial,hosts,size", [
    (None, 8, 1), ("", 8, 1), (3, 8, 3), ("3", 8, 3), (20, 8, 8), ("25%", 8, 2), ("10%", 8, 1), ("100%", 5, 5),
    ([1, "50%"], 8, 4), (["2", 1], 8, 2), ("bogus", 8, 1),
])
def test_batch_size_is_what_one_serial_batch_takes_out(serial, hosts, size):
    assert run.gpufleet_batch_size(serial, hosts) == size


@pytest.mark.parametrize("serial,limit,hosts", [
    (2, 2, 8), (None, 1, 8), ("25%", 2, 8), ("25%", "25%", 8), ([1, 2], "2", 4), (1, "10%", 4), (5, None, 8),
    (5, "", 8), (3, "bogus", 8),  # an invalid limit is the format check's error, not the capacity guard's
])
def test_serial_within_max_unavailable_passes(serial, limit, hosts):
    assert run.gpufleet_capacity_error(serial, limit, hosts) == ""


@pytest.mark.parametrize("serial,limit,hosts,words", [
    (3, 2, 8, ["gpufleet_serial=3 takes 3 of the 8", "gpufleet_max_unavailable=2 allows (2)", "lower gpufleet_serial to 2"]),
    ("50%", "25%", 8, ["takes 4 of the 8", "'25%' allows (2)"]),
    ([1, "100%"], 1, 4, ["takes 4 of the 4", "allows (1)"]),
    (2, "10%", 8, ["takes 2", "allows (1)"]),
])
def test_serial_above_max_unavailable_is_refused_naming_both(serial, limit, hosts, words):
    message = run.gpufleet_capacity_error(serial, limit, hosts)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("value", ["x", 0, "0%", "150%", 1.5, True])
def test_invalid_max_unavailable_is_named(value):
    assert run.gpufleet_max_unavailable_error(value).startswith("gpufleet_max_unavailable=")
    assert any(e.startswith("gpufleet_max_unavailable=") for e in run.gpufleet_guard_errors(
        {"gpufleet_max_unavailable": value}))


def test_guard_report_names_the_capacity_violation_once_for_the_run():
    hostvars = {h: {"gpufleet_serial": 3, "gpufleet_max_unavailable": "25%"} for h in ("a", "b", "c", "d")}
    report = run.gpufleet_guard_report(hostvars, ["a", "b", "c", "d"])
    assert len(report) == 1 and "takes 3 of the 4" in report[0] and "allows (1)" in report[0], report
    hostvars = {h: {"gpufleet_serial": 1, "gpufleet_max_unavailable": "25%"} for h in ("a", "b", "c", "d")}
    assert run.gpufleet_guard_report(hostvars, ["a", "b", "c", "d"]) == []


@pytest.mark.parametrize("result,count", [
    ({"status": 200, "json": {"loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1},
                                        {"dp_rank": 1, "num_running_reqs": 4}]}}, 7),
    ({"status": 200, "json": {"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]}}, 0),
    ({"status": 404, "json": {"detail": "Not Found"}}, 0),
    ({"status": -1, "msg": "connection refused"}, 0),
    ({"status": 200, "json": {"loads": [{"num_running_reqs": "x"}, "junk", {"num_waiting_reqs": -3}]}}, 0),
    (None, 0),
])
def test_inflight_sums_running_and_waiting_requests_over_dp_ranks(result, count):
    assert router.gpufleet_router_inflight(result) == count


@pytest.mark.parametrize("result,refused", [
    # ansible.builtin.uri's message when nothing listens (the helper's trial: a server that was down)
    ({"status": -1, "msg": "Status code was -1 and not [200, 404]: Request failed: "
                           "<urlopen error [Errno 111] Connection refused>"}, True),
    ({"status": "-1", "msg": "Connection refused"}, True),
    # a hung server or a dropped connection: the in-flight count is unknown, not zero
    ({"status": -1, "msg": "Status code was -1 and not [200, 404]: Request failed: <urlopen error timed out>"}, False),
    ({"status": -1, "msg": "Connection reset by peer"}, False),
    ({"status": 503, "msg": "Connection refused"}, False),
    ({"status": 200, "json": {"loads": []}}, False),
    (None, False), ("x", False),
])
def test_refused_is_only_a_refused_connection(result, refused):
    assert router.gpufleet_router_refused(result) is refused
