"""restart.yml's rolling play (Ansible's free strategy inside a serial batch, and its "Stop the roll after a failed
host" gate), against the lab over real SSH.

Inside a batch each host goes through its phases on its own: with one host of a batch of 2 made slow to load
(lab fault ``slow_load_s``), the fast host is verified and done while the slow one is still waiting for its
server (asserted on the order of ansible-runner events: under the linear strategy the fast host could not
start verify before the slow host's readiness wait ended). A host that fails in batch 1 lets its batch mate
finish its own restart and stops the roll there: batch 2 is not started (its servers keep their pids).
"""
import pytest

pytestmark = [pytest.mark.lab, pytest.mark.lab_only_once]

RESTART = "playbooks/restart.yml"
FAST = {"sglang_stop_grace_s": 10, "gpufleet_serial": 2}


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def server_pid(lab, host):
    res = lab.exec(host, ["cat", "%s/sglang.pid" % lab.host_vars(host)["sglang_state_dir"]])
    return int(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def ensure_serving(lab, hosts):
    if not all(lab.wait_http(h, timeout_s=1) == 200 for h in hosts):
        runner = lab.run_playbook(RESTART, extravars=FAST, limit=",".join(hosts))
        assert runner.status == "successful", stdout_of(runner)[-4000:]
    return {h: server_pid(lab, h) for h in hosts}


def rolling(events, event, host, action):
    """Positions (in the run's event order) of ``event`` results of ``action`` for ``host`` in the rolling play."""
    return [i for i, ev in enumerate(events)
            if ev.get("event") == event and ev["event_data"].get("host") == host
            and ev["event_data"].get("task_action", "").endswith(action)
            and ev["event_data"].get("play", "").startswith("Restart")]


def custom_stats(runner):
    [stats] = [e["event_data"] for e in runner.events if e.get("event") == "playbook_on_stats"]
    return (stats.get("artifact_data") or {}).get("gpufleet_restart", {})


def test_the_fast_host_of_a_batch_is_verified_while_the_slow_one_still_loads(lab):
    fast, slow = lab.hosts[0], lab.hosts[1]
    before = ensure_serving(lab, [fast, slow])
    lab.fault(slow, slow_load_s=12)
    try:
        runner = lab.run_playbook(RESTART, extravars=FAST, limit="%s,%s" % (fast, slow))
        out = stdout_of(runner)
        assert runner.status == "successful", out[-4000:]
        events = list(runner.events)
        fast_verified = [i for i in rolling(events, "runner_on_ok", fast, "sglang_process")
                         if "in a burst, read every GPU worker" in events[i]["event_data"].get("task", "")]
        slow_ready = [i for i in rolling(events, "runner_on_ok", slow, "sglang_process")
                      if events[i]["event_data"]["res"].get("ready")]
        assert fast_verified and slow_ready, out[-4000:]
        # the fast host's verify (after its launch) came back before the slow host's server was ready
        assert fast_verified[-1] < slow_ready[-1]
        rows = custom_stats(runner)
        assert rows[fast]["result"] == "ok" and rows[slow]["result"] == "ok"
        # downtime per host, from its own stop to its own readiness: the fast host's leaves out the slow load
        assert rows[fast]["downtime_s"] < rows[slow]["downtime_s"]
        assert all(server_pid(lab, h) not in (None, before[h]) for h in (fast, slow))
        assert "max_fail_percentage with the free strategy is not supported" not in out
    finally:
        lab.clear_faults(slow)


def test_a_failed_host_in_batch_1_lets_its_batch_mate_finish_and_batch_2_never_starts(lab):
    assert len(lab.hosts) >= 4, "needs 4 lab hosts (GPUFLEET_TEST_LAB_HOSTS)"
    bad, mate, later = lab.hosts[0], lab.hosts[1], lab.hosts[2:4]
    before = ensure_serving(lab, [bad, mate] + later)
    # Only the new flag crashes, given to bad alone: its rollback relaunches the previous launch, so the host ends
    # serving and no restart is needed after the test (crash_on_start crashed the relaunch too: ~30 s more); the
    # mate records its usual launch.
    lab.fault(bad, crash_with_arg="--max-running-requests")
    try:
        runner = lab.run_playbook(RESTART, limit=",".join([bad, mate] + later), extravars=dict(
            FAST, sglang_launch_args=lab.launch_args_expr({"max-running-requests": 7}, only=bad)))
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        rows = custom_stats(runner)
        assert rows[bad]["result"] == "rolled_back" and rows[bad]["phase"] == "launch", rows[bad]
        # the batch mate was not cut short: its restart went through
        assert rows[mate]["result"] == "ok" and server_pid(lab, mate) != before[mate]
        for host in later:
            assert rows[host]["result"] == "not_started" and bad in rows[host]["cause"], rows[host]
            events = list(runner.events)
            # not even the lock was taken: the gate ended the host before its first module ran
            assert rolling(events, "runner_on_ok", host, "gpufleet_lock") == []
            assert rolling(events, "runner_on_ok", host, "sglang_stop") == []
            assert server_pid(lab, host) == before[host], "batch 2 must not be touched"
            [said] = [events[i]["event_data"]["res"]["msg"] for i in rolling(events, "runner_on_ok", host, "debug")]
            assert said.startswith("not started: the rolling restart stopped at %s (rolled_back)" % bad), said
            assert lab.exec(host, ["test", "-e", "%s/restart.lock" % lab.host_vars(host)["sglang_state_dir"]]
                            ).returncode == 1
        assert "max_fail_percentage with the free strategy is not supported" not in out
    finally:
        lab.clear_faults(bad)
    ensure_serving(lab, [bad])
