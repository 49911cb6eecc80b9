"""The sglang_preflight role against the lab fleet, over real SSH, through ansible-runner (as AWX runs it).

Playbook tests/integration/playbooks/preflight.yml runs the role alone on every lab host. Each lab host has its
own virtualenv with the real SGLang wheel (its server_args.py and engine.py), model directories, a per-host
/dev/shm and a network namespace, so the flags, paths, NCCL anchor and port checks meet real files and sockets.

Asserted on ansible-runner events: the verdict task (``Stop here if anything would make the restart fail``)
passes or fails per host with a message naming the problem, the module results carry the facts behind it,
and nothing is changed on any host (runner stats).
"""
import os

import pytest

pytestmark = pytest.mark.lab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAYBOOK = os.path.join(ROOT, "tests", "integration", "playbooks", "preflight.yml")
VERDICT = "Stop here if anything would make the restart fail"
VARIABLES = "Check the inventory variables the restart depends on"


@pytest.fixture
def fleet(request):
    try:
        return request.getfixturevalue("lab")
    except pytest.FixtureLookupError:
        pytest.skip("the lab fixture (tests/integration/conftest.py) is not available")


def run(lab, extravars=None, cmdline=None):
    return lab.run_playbook(PLAYBOOK, extravars=extravars or {}, cmdline=cmdline)


def task_events(runner, task):
    """host -> (event name, event_data) of the last ok/failed event of ``task``."""
    found = {}
    for event in runner.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_on_failed") and data.get("task") == task:
            found[data["host"]] = (event["event"], data)
    return found


def module_results(runner, action):
    found = {}
    for event in runner.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_on_failed") and \
                data.get("task_action", "").endswith(action):
            found[data["host"]] = data.get("res", {})
    return found


def verdict_messages(runner):
    """host -> one string of the verdict's message lines, for hosts where it failed."""
    out = {}
    for host, (name, data) in task_events(runner, VERDICT).items():
        if name == "runner_on_failed":
            msg = data["res"]["msg"]
            out[host] = "\n".join(msg) if isinstance(msg, list) else str(msg)
    return out


def assert_nothing_changed(runner):
    changed = {h: n for h, n in (runner.stats or {}).get("changed", {}).items() if n}
    assert changed == {}


def with_launch_args(extra):
    """Extra vars that keep each host's own sglang_launch_args and change some flags (templated per host)."""
    pairs = ", ".join("%r: %s" % (k, "none" if v is None else repr(v)) for k, v in extra.items())
    return {"sglang_preflight_launch_args": "{{ sglang_launch_args | combine({%s}) }}" % pairs}


def test_preflight_passes_on_every_lab_host(fleet):
    runner = run(fleet)
    hosts = sorted(fleet.hosts)
    assert runner.status == "successful"
    verdicts = task_events(runner, VERDICT)
    assert sorted(verdicts) == hosts
    assert all(name == "runner_on_ok" for name, _ in verdicts.values())
    args = module_results(runner, "sglang_server_args_info")
    for host in hosts:
        res = args[host]
        assert res["valid"] is True and res["errors"] == []
        argv = res["argv"]
        assert argv[argv.index("--tp-size") + 1] == "8"
        assert argv[-4:] == ["--host", "127.0.0.1", "--port", "30000"]
    versions = {args[h]["sglang_version"] for h in hosts}
    assert len(versions) == 1 and None not in versions
    facts = module_results(runner, "sglang_host_info")
    for host in hosts:
        assert facts[host]["port"]["free"] or facts[host]["port"]["held_by_managed"]
        assert facts[host]["shm"]["exists"] and facts[host]["shm"]["size_mib"] > 0
    assert_nothing_changed(runner)


def test_preflight_passes_in_check_mode(fleet):
    runner = run(fleet, cmdline="--check")
    assert runner.status == "successful"
    assert all(name == "runner_on_ok" for name, _ in task_events(runner, VERDICT).values())
    assert_nothing_changed(runner)


def test_unknown_flag_fails_every_host_naming_the_flag_and_the_close_spelling(fleet):
    runner = run(fleet, with_launch_args({"tp_size": 8, "tp-size": None}))
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == sorted(fleet.hosts)
    for text in messages.values():
        assert "unrecognized argument --tp_size" in text and "did you mean --tp-size" in text
    for res in module_results(runner, "sglang_server_args_info").values():
        assert res["valid"] is False and [e["flag"] for e in res["errors"]] == ["--tp_size"]
    assert_nothing_changed(runner)


def test_bad_speculative_algorithm_fails_listing_the_known_ones(fleet):
    runner = run(fleet, with_launch_args({"speculative-algorithm": "FOO"}))
    assert runner.status == "failed"
    for text in verdict_messages(runner).values():
        assert "--speculative-algorithm" in text and "'FOO'" in text and "EAGLE3" in text
    assert sorted(verdict_messages(runner)) == sorted(fleet.hosts)


def test_missing_model_directory_fails_naming_the_path(fleet):
    runner = run(fleet, with_launch_args({"model-path": "/nonexistent/gpufleet-model"}))
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == sorted(fleet.hosts)
    for text in messages.values():
        assert "--model-path /nonexistent/gpufleet-model: does not exist on this host" in text


def test_bad_nccl_variable_name_fails_before_any_other_check(fleet):
    runner = run(fleet, {"sglang_nccl_env": {"NCCL_OK": "1", "1NCCL-BAD": "x"}})
    assert runner.status == "failed"
    failed = task_events(runner, VARIABLES)
    assert sorted(failed) == sorted(fleet.hosts)
    for name, data in failed.values():
        assert name == "runner_on_failed"
        assert "sglang_nccl_env has invalid variable names 1NCCL-BAD" in "\n".join(data["res"]["msg"])
    # the module checks never ran
    assert module_results(runner, "sglang_server_args_info") == {}


def test_port_held_by_a_stray_listener_fails_that_host_only(fleet):
    hosts = sorted(fleet.hosts)
    victim = hosts[0]
    fleet.fault(victim, port_held=True)
    try:
        runner = run(fleet)
    finally:
        fleet.fault(victim, port_held=False)
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == [victim]
    assert "port 30000 is held by pid " in messages[victim]
    assert "stray-listener" in messages[victim]
    assert "which is not the SGLang server being replaced" in messages[victim]
    facts = module_results(runner, "sglang_host_info")[victim]["port"]
    assert facts["free"] is False and facts["held_by_managed"] is False
    (listener,) = [item for item in facts["listeners"] if item["conflicts"]]
    assert listener["pid"] and listener["address"] == "0.0.0.0"
    oks = task_events(runner, VERDICT)
    assert all(oks[h][0] == "runner_on_ok" for h in hosts[1:])


# engine.py of the installed release with the anchor statement replaced: what a future release that moved it
# would look like. Written on each host by its own interpreter (sglang located without importing it).
NOANCHOR = "/tmp/gpufleet-preflight-noanchor-engine.py"
NOANCHOR_SCRIPT = (
    "import importlib.util, os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
    "d = importlib.util.find_spec('sglang').submodule_search_locations[0]; "
    "src = open(os.path.join(d, 'srt', 'entrypoints', 'engine.py')).read(); "
    "anchor = 'mp.set_start_method(' + chr(34) + 'spawn' + chr(34) + ', force=True)'; "
    "assert src.count(anchor) == 1; "
    "open(sys.argv[1], 'w').write(src.replace(anchor, 'pass'))")


def test_missing_nccl_anchor_fails_naming_the_file(fleet):
    hosts = sorted(fleet.hosts)
    for host in hosts:
        fleet.exec(host, [fleet.host_vars(host)["sglang_python"], "-c", NOANCHOR_SCRIPT, NOANCHOR])
    runner = run(fleet, {"sglang_preflight_nccl_patch_path": NOANCHOR})
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == hosts
    for text in messages.values():
        assert "NCCL patch would fail" in text and NOANCHOR in text
        assert 'mp.set_start_method("spawn", force=True)' in text
    for res in module_results(runner, "sglang_nccl_patch").values():
        assert res["changed"] is False
    assert_nothing_changed(runner)
