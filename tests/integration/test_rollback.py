"""restart.yml after the stop: a failure rolls the host back to the server it had (issue 10), over real SSH.

Each scenario fails a restart after the old server was stopped and then asserts, on the host itself, that it
serves again: ``/health_generate`` answers 200 from a new pid started with the previous argv (the launch
record, not the failed run's flags), and ``engine.py`` holds exactly the bytes it had before the run. A port
taken after the stop cannot be rolled back (the previous server could not bind either): the test asserts the
run names the holder, restores the file and says the host is not serving, then frees the port and restores
service. The progress scenario asserts that a 20 s load prints progress lines instead of 900 s of silence.

Faults that must strike after preflight (a stray listener, a read-only engine.py) are applied from the test
while the playbook runs: the GPU memory release is slowed (``release_delay_ms``) so the wait phase leaves a
window of seconds after the stop.
"""
import hashlib
import json
import os
import threading
import time

import pytest

pytestmark = pytest.mark.lab

PLAYBOOK = "playbooks/restart.yml"
FAST = {"sglang_stop_grace_s": 10, "sglang_launch_ready_slice_s": 5}
ENGINE = "lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py"


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def state_dir(lab, host):
    return lab.host_vars(host)["sglang_state_dir"]


def server_pid(lab, host):
    res = lab.exec(host, ["cat", "%s/sglang.pid" % state_dir(lab, host)])
    return int(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def alive(lab, host, pid):
    res = lab.exec(host, ["cat", "/proc/%d/stat" % pid])
    return res.returncode == 0 and res.stdout.split(") ", 1)[1][:1] not in ("Z", "X")


def cmdline(lab, host, pid):
    res = lab.exec(host, ["cat", "/proc/%d/cmdline" % pid])
    return res.stdout.replace("\0", " ").strip()


def engine_path(lab, host):
    return "%s/%s" % (lab.host_vars(host)["sglang_python"].rsplit("/bin/", 1)[0], ENGINE)


def engine_sha(lab, host):
    res = lab.exec(host, ["cat", engine_path(lab, host)], check=True)
    return hashlib.sha256(res.stdout.encode("utf-8", "surrogateescape")).hexdigest()


def launch_record(lab, host):
    res = lab.exec(host, ["cat", "%s/launch.json" % state_dir(lab, host)])
    return json.loads(res.stdout) if res.returncode == 0 else None


def ensure_serving(lab, host):
    """``host`` runs a verified server launched by restart.yml (so a launch record exists); returns its pid."""
    pid = server_pid(lab, host)
    if not (pid and alive(lab, host, pid) and launch_record(lab, host)
            and launch_record(lab, host)["pid"] == pid and lab.wait_http(host, timeout_s=2) == 200):
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert runner.status == "successful", stdout_of(runner)[-4000:]
        pid = server_pid(lab, host)
    return pid


def changed_config(lab, host, extra_args=None):
    """Extra vars giving ``host`` new launch args and one more NCCL variable (so the patch must write)."""
    hv = lab.host_vars(host)
    args = dict(hv["sglang_launch_args"])
    args.update(extra_args or {})
    env = dict(lab.group_vars["sglang_nccl_env"], NCCL_DEBUG="WARN")
    return dict(FAST, sglang_launch_args=args, sglang_nccl_env=env)


def facts(lab, runner, host, name):
    """The value of fact ``name`` from the last set_fact of ``host`` that set it."""
    value = None
    for d in lab.events(runner, "runner_on_ok", "set_fact"):
        got = d.get("res", {}).get("ansible_facts", {})
        if d["host"] == host and name in got:
            value = got[name]
    return value


def state_lines(lab, runner, host):
    [said] = [d for d in lab.events(runner, "runner_on_ok", "debug")
              if d["host"] == host and d["task"] == "Say what state the host is in"]
    return said["res"]["msg"]


def assert_serves_previous_launch(lab, host, before_pid, before_sha, record):
    """The host serves again: a new pid from the recorded argv, /health_generate 200, engine.py as before."""
    assert lab.wait_http(host, timeout_s=30) == 200
    pid = server_pid(lab, host)
    assert pid and pid != before_pid and alive(lab, host, pid)
    assert not alive(lab, host, before_pid)
    # The stand-in titles itself "<python> -m sglang.launch_server <args>": the args are the recorded ones.
    assert cmdline(lab, host, pid).endswith(" ".join(record["argv"][2:])), cmdline(lab, host, pid)
    assert engine_sha(lab, host) == before_sha


def run_in_background(lab, **kwargs):
    box = {}
    thread = threading.Thread(target=lambda: box.update(runner=lab.run_playbook(PLAYBOOK, **kwargs)), daemon=True)
    thread.start()
    return thread, box


def wait_until_dead(lab, host, pid, timeout_s=90):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not alive(lab, host, pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.lab_only_once
def test_new_server_crashing_on_a_changed_flag_rolls_back_to_the_previous_launch(lab):
    host = lab.hosts[1 % len(lab.hosts)]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    lab.fault(host, crash_with_arg="--max-running-requests")
    try:
        runner = lab.run_playbook(PLAYBOOK, limit=host,
                                  extravars=changed_config(lab, host, {"max-running-requests": 7}))
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "launch"
        cause = facts(lab, runner, host, "_gpufleet_failed_cause")
        assert "exited with status 1" in cause and "within" not in cause, cause
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        assert "engine.py restored" in rollback["detail"] and "as pid %d" % rollback["pid"] in rollback["detail"]
        # the failed run patched engine.py before the launch: the patch did write
        assert lab.events(runner, "runner_on_ok", "sglang_nccl_patch")[-1]["res"]["changed"]
        assert rollback["pid"] == server_pid(lab, host)
        [tail] = [d for d in lab.events(runner, "runner_on_ok", "debug") if d["task"] == "Show the end of the server log"]
        assert any("crash_with_arg" in line for line in tail["res"]["msg"]), tail["res"]["msg"]
        assert "Rollback: rolled_back" in state_lines(lab, runner, host)
        assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
        assert "--max-running-requests" not in cmdline(lab, host, server_pid(lab, host))
        # The operator reruns the same bad change: the server the first rollback relaunched (not the pid in the
        # launch record) is stopped, and the recorded launch goes back again instead of leaving the host dark.
        rolled_pid = server_pid(lab, host)
        again = lab.run_playbook(PLAYBOOK, limit=host,
                                 extravars=changed_config(lab, host, {"max-running-requests": 7}))
        assert again.status == "failed", stdout_of(again)[-4000:]
        rollback = facts(lab, again, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        assert_serves_previous_launch(lab, host, rolled_pid, before_sha, record)
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_port_taken_after_the_stop_names_the_holder_restores_the_file_and_says_the_host_is_down(lab):
    """Picked behaviour: no relaunch on a taken port (the previous server could not bind either)."""
    host = lab.hosts[2 % len(lab.hosts)]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    lab.fault(host, release_delay_ms=3000)
    try:
        thread, box = run_in_background(lab, limit=host, extravars=changed_config(lab, host))
        assert wait_until_dead(lab, host, before_pid), "the stop never came"
        lab.fault(host, port_held=30000)  # a stray listener takes the freed port during the GPU wait
        thread.join(300)
        runner = box["runner"]
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "launch"
        cause = facts(lab, runner, host, "_gpufleet_failed_cause")
        assert "port 30000 taken by pid" in cause and "stray-listener :30000" in cause and "before launch" in cause
        assert "within" not in cause
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "failed", rollback
        detail = rollback["detail"]
        assert "engine.py restored" in detail and "stray-listener :30000" in detail
        assert "could not bind a taken port" in detail and "The host is not serving" in detail
        assert "The old server is stopped and no new one serves" in " ".join(state_lines(lab, runner, host))
        assert engine_sha(lab, host) == before_sha
        assert lab.wait_http(host, timeout_s=1) is None  # the stray accepts, never answers HTTP
    finally:
        lab.clear_faults(host)
    after_pid = ensure_serving(lab, host)
    assert after_pid != before_pid and lab.wait_http(host) == 200
    assert engine_sha(lab, host) == before_sha and launch_record(lab, host)["argv"] == record["argv"]


# Every phase but preflight: preflight would refuse the read-only engine.py these tests set up on purpose.
NO_PREFLIGHT = "patch,stop,wait,launch,verify"


@pytest.mark.lab_only_once
def test_patch_failing_before_the_stop_leaves_the_old_server_serving(lab):
    """The patch runs first, while the old server serves: its failure stops nothing and changes no file."""
    host = lab.hosts[3 % len(lab.hosts)]
    before_pid = ensure_serving(lab, host)
    before_sha = engine_sha(lab, host)
    engine = engine_path(lab, host)
    lab.exec(host, ["mount", "--bind", engine, engine], check=True)
    try:
        lab.exec(host, ["mount", "-o", "remount,bind,ro", engine], check=True)
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=changed_config(lab, host), tags=NO_PREFLIGHT)
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "patch"
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "not_needed", rollback
        # The rename onto the read-only file failed inside the module: nothing was written, nothing to put back.
        assert ("never stopped" in rollback["detail"]
                or "neither changed engine.py nor stopped or started a server" in rollback["detail"]), rollback
        # nothing of the stop ran: the old server kept serving the whole time
        assert not lab.events(runner, "runner_on_ok", "sglang_stop")
        assert server_pid(lab, host) == before_pid and alive(lab, host, before_pid)
        assert lab.wait_http(host, timeout_s=5) == 200
        assert engine_sha(lab, host) == before_sha
        row = [d for d in lab.events(runner, "playbook_on_stats")][-1]["artifact_data"]["gpufleet_restart"][host]
        assert row["result"] == "failed" and row["phase"] == "patch" and row["downtime_s"] is None, row
        assert "the old server still serves" in row["advice"], row
    finally:
        lab.exec(host, ["umount", engine])


@pytest.mark.lab_only_once
def test_wait_failing_after_the_patch_puts_engine_py_back(lab):
    """The patch wrote engine.py before the stop; a failure in the GPU wait must put the old bytes back."""
    host = lab.hosts[3 % len(lab.hosts)]
    ensure_serving(lab, host)
    before_sha = engine_sha(lab, host)
    try:
        # 9 GPUs demanded of an 8-GPU host: the wait fails at its first look (fewer_gpus, a host-wide cause: no
        # relaunch). Preflight would refuse the host for the same reason, so it is skipped.
        extra = dict(changed_config(lab, host), gpufleet_expected_gpus=9)
        # a value no earlier run left in engine.py, so that the patch must write
        extra["sglang_nccl_env"] = dict(extra["sglang_nccl_env"], NCCL_DEBUG_SUBSYS="INIT,%d" % time.time_ns())
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=extra, tags=NO_PREFLIGHT)
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "wait"
        # the patch did write, before the stop
        assert lab.events(runner, "runner_on_ok", "sglang_nccl_patch")[-1]["res"]["changed"]
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "file_only", rollback
        assert "engine.py restored" in rollback["detail"] and "host-wide" in rollback["detail"], rollback
        assert engine_sha(lab, host) == before_sha
    finally:
        lab.clear_faults(host)
    ensure_serving(lab, host)
    assert lab.wait_http(host) == 200 and engine_sha(lab, host) == before_sha


@pytest.mark.lab_only_once
def test_a_slow_load_prints_progress_lines_while_it_waits(lab):
    host = lab.hosts[0]
    ensure_serving(lab, host)
    lab.fault(host, slow_load_s=20)
    try:
        started = time.time()
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=FAST)
        out = stdout_of(runner)
        assert runner.status == "successful", out[-4000:]
        assert time.time() - started >= 20
    finally:
        lab.clear_faults(host)
    retries = [d for d in lab.events(runner, "runner_retry", "sglang_process") if d["host"] == host]
    # 20 s of loading in 5 s slices: a progress report per slice, each saying what is awaited and how long. How
    # many depends on when the wait began after the spawn: the controller's tasks between the stop (which starts
    # the server) and the wait took 2-3 s on an idle machine, 10 s under CI's two lab workers (2 reports, at 15
    # and 20 s). So: at least two, at most a slice (plus the next call's start) apart, up to the load's end.
    assert len(retries) >= 2, [d["res"].get("progress") for d in retries]
    pid = server_pid(lab, host)
    addr = lab.host_vars(host)["sglang_host"]
    seconds = []
    for d in retries:
        progress = d["res"]["progress"]
        assert progress.startswith("waiting for /health_generate on %s:30000 (pid %d): " % (addr, pid)), progress
        assert "s of 900 s, last: connection refused" in progress and "log: '" in progress
        seconds.append(float(progress.split(": ", 1)[1].split(" s of ")[0]))
    assert seconds == sorted(seconds) and seconds[-1] >= 14
    gaps = [b - a for a, b in zip(seconds, seconds[1:])]
    assert all(g <= FAST["sglang_launch_ready_slice_s"] + 3 for g in gaps), seconds
    # the lines reach the job output (AWX shows stdout) through the gpufleet_summary callback, not only the events
    assert out.count("%s: waiting for /health_generate on %s:30000" % (host, addr)) >= len(retries), out[-3000:]
    assert lab.wait_http(host) == 200


@pytest.mark.lab_only_once
def test_a_relaunch_that_outlasts_the_ready_timeout_is_reported_as_loading_not_as_down(lab):
    """Loads take longer than sglang_launch_ready_timeout_s: the new server times out, and so does the rollback's
    relaunch of the previous one, which still runs and serves seconds later. The run says so, not "serves nothing"."""
    host = lab.hosts[0]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    lab.fault(host, slow_load_s=12)
    try:
        runner = lab.run_playbook(PLAYBOOK, limit=host,
                                  extravars=dict(changed_config(lab, host), sglang_launch_ready_timeout_s=3))
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "launch"
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "relaunched_loading", rollback
        pid = int(rollback["pid"])
        assert pid == server_pid(lab, host) and pid != before_pid and alive(lab, host, pid)
        assert "as pid %d and still runs" % pid in rollback["detail"]
        assert "check.yml -e target=%s" % host in rollback["detail"]
        row = facts(lab, runner, host, "gpufleet_summary_row")
        assert row["result"] == "failed" and "still loads" in row["advice"], row
        assert "serves nothing" not in out and "The host is not serving" not in out, out[-4000:]
        # ... and it does come up: the previous launch, engine.py as before the run
        assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
        assert server_pid(lab, host) == pid
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_a_rollback_wait_that_loses_the_lock_reports_what_the_relaunched_server_does_not_down(lab):
    """The rollback's readiness wait stops when the restart lock disappears (an operator ran unlock.yml by hand);
    the relaunched server still runs and comes up. The run used to report "rollback failed ... The host is not
    serving now"; a last look at the server now says what is true: still loading, or serving."""
    host = lab.hosts[0]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    lab.fault(host, crash_with_arg="--max-running-requests", slow_load_s=8)
    lock = "%s/restart.lock" % state_dir(lab, host)
    try:
        thread, box = run_in_background(lab, limit=host,
                                        extravars=changed_config(lab, host, {"max-running-requests": 9}))
        # The relaunch: a server from the recorded argv (without the crashing flag) after the crash.
        deadline, relaunched = time.time() + 120, None
        while time.time() < deadline and relaunched is None:
            pid = server_pid(lab, host)
            # An empty cmdline is a process that exited between the two reads (the crashing server), not a relaunch.
            argv = cmdline(lab, host, pid) if pid and pid != before_pid and alive(lab, host, pid) else ""
            if "--model-path" in argv and "--max-running-requests" not in argv:
                relaunched = pid
            time.sleep(0.2)
        assert relaunched, "no relaunch seen"
        lab.exec(host, ["rm", "-rf", lock], check=True)
        thread.join(180)
        runner = box["runner"]
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] in ("relaunched_loading", "rolled_back"), rollback
        assert int(rollback["pid"]) == relaunched
        assert "is gone" in rollback["detail"] and lock in rollback["detail"], rollback["detail"]
        assert "The host is not serving" not in out and "serves nothing" not in out, out[-4000:]
        assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
        assert server_pid(lab, host) == relaunched
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_verify_failing_stops_the_new_server_and_rolls_back(lab):
    host = lab.hosts[1 % len(lab.hosts)]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    # The new server comes up, then verification fails: its workers lack an NCCL value verify is told to expect
    # (more workers than tp-size 8 gives, the earlier trigger, is now refused by the guard before the stop).
    config = changed_config(lab, host)
    runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(
        config, sglang_verify_nccl_env=dict(config["sglang_nccl_env"], NCCL_IB_DISABLE="1")))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    assert facts(lab, runner, host, "_gpufleet_failed_phase") == "verify"
    assert "Workers without the configured NCCL values" in out, out[-4000:]
    new_pid = [d for d in lab.events(runner, "runner_on_ok", "sglang_process") if d["host"] == host][0]["res"]["pid"]
    rollback = facts(lab, runner, host, "_gpufleet_rollback")
    assert rollback["state"] == "rolled_back", rollback
    # the new server (which served, but failed verification) was stopped before the previous one came back
    [stop] = [d for d in lab.events(runner, "runner_on_ok", "sglang_stop")
              if d["task"] == "Rollback - stop the server this run launched and its leftovers"]
    assert any(e["pid"] == new_pid for e in stop["res"]["signalled"]), stop["res"]["signalled"]
    assert not alive(lab, host, new_pid)
    assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
    assert launch_record(lab, host) == record, "a failed run must not replace the launch record"


@pytest.mark.lab_only_once
def test_without_a_launch_record_only_the_file_is_restored_and_the_run_says_so(lab):
    host = lab.hosts[0]
    ensure_serving(lab, host)
    before_sha = engine_sha(lab, host)
    record_file = "%s/launch.json" % state_dir(lab, host)
    lab.exec(host, ["mv", record_file, record_file + ".test-saved"], check=True)
    lab.fault(host, crash_with_arg="--max-running-requests")
    try:
        runner = lab.run_playbook(PLAYBOOK, limit=host,
                                  extravars=changed_config(lab, host, {"max-running-requests": 7}))
        assert runner.status == "failed", stdout_of(runner)[-4000:]
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "file_only", rollback
        assert "engine.py restored" in rollback["detail"] and "there is no launch record" in rollback["detail"]
        assert "The host is not serving" in rollback["detail"]
        assert engine_sha(lab, host) == before_sha
        assert lab.wait_http(host, timeout_s=1) is None
    finally:
        lab.clear_faults(host)
        lab.exec(host, ["mv", record_file + ".test-saved", record_file])
    ensure_serving(lab, host)
    assert lab.wait_http(host) == 200


FREEZER = "/sys/fs/cgroup/freezer"


@pytest.mark.lab_only_once
def test_a_stop_that_fails_after_signalling_rolls_back_once_the_stuck_worker_is_gone(lab):
    """A TP worker stuck in the kernel (state D; here frozen by a cgroup-v1 freezer, which holds SIGKILL pending
    as a hung driver call does) survives SIGKILL past sglang_stop_kill_timeout_s: the stop fails after it signalled
    the server, so it names no old pid and the rollback takes preflight's stop preview. The rollback waits for
    the GPU memory (the worker ends some seconds later, as a driver call that returns) before it relaunches the
    previous launch; relaunched at once, a real server would load into GPUs still full."""
    host = lab.hosts[2 % len(lab.hosts)]
    if lab.exec(host, ["test", "-w", FREEZER + "/cgroup.procs"]).returncode != 0:
        pytest.skip("no cgroup v1 freezer at %s (needed to hold a worker in state D)" % FREEZER)
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    [worker] = [int(p) for p in lab.exec(host, ["pgrep", "-P", str(before_pid), "-f", "sglang::scheduler_TP3"],
                                         check=True).stdout.split()]
    cgroup = "%s/gpufleet-test-%s-%d" % (FREEZER, host, worker)
    lab.exec(host, ["mkdir", cgroup], check=True)
    thawed = {}

    def thaw():
        lab.exec(host, ["sh", "-c", "echo THAWED > %s/freezer.state" % cgroup])
        thawed.setdefault("at", time.time())

    def thaw_after_sigkill(after_s=8):
        # SIGKILL pending (bit 9 of ShdPnd/SigPnd): the stop (or the server's death signal) has come; the stop
        # gives up after its kill timeout (2 s), and the worker "returns from the driver" after_s later.
        deadline = time.time() + 240
        while time.time() < deadline and "at" not in thawed:
            status = lab.exec(host, ["cat", "/proc/%d/status" % worker]).stdout
            pending = [int(line.split()[1], 16) for line in status.splitlines()
                       if line.startswith(("SigPnd:", "ShdPnd:"))]
            if any(mask & (1 << 8) for mask in pending):
                time.sleep(after_s)
                break
            time.sleep(0.2)
        thaw()

    try:
        lab.exec(host, ["sh", "-c", "echo %d > %s/cgroup.procs && echo FROZEN > %s/freezer.state"
                        % (worker, cgroup, cgroup)], check=True)
        assert lab.wait_http(host, timeout_s=5) == 200  # the server itself still serves
        thawer = threading.Thread(target=thaw_after_sigkill, daemon=True)
        thawer.start()
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(
            changed_config(lab, host), sglang_stop_grace_s=2, sglang_stop_kill_timeout_s=2))
        thawer.join(60)
    finally:
        thaw()
        wait_until_dead(lab, host, worker, timeout_s=30)
        lab.exec(host, ["rmdir", cgroup])
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    assert facts(lab, runner, host, "_gpufleet_failed_phase") == "stop"
    cause = facts(lab, runner, host, "_gpufleet_failed_cause")
    assert "survived SIGKILL" in cause and "pid %d state D" % worker in cause, cause
    # The stop named no old pid (its module failed): the rollback relaunched on preflight's preview.
    assert facts(lab, runner, host, "sglang_stop_old_pid") is None
    [waited] = [d for d in lab.events(runner, "runner_on_ok", "nvidia_gpu_wait")
                if d["host"] == host and d["task"] == "Rollback - wait until GPU memory is released"]
    assert waited["res"]["ready"], waited["res"]
    # The wait saw the memory free only after the worker was thawed (and died): the relaunch came after it.
    # (Same machine, same clock: the module's started_at and the test's time.time().)
    seen_free = waited["res"]["started_at"] + waited["res"]["elapsed_ms"] / 1000.0
    assert seen_free >= thawed["at"], (seen_free, thawed["at"])
    rollback = facts(lab, runner, host, "_gpufleet_rollback")
    assert rollback["state"] == "rolled_back", rollback
    assert not alive(lab, host, worker)
    assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
    [row] = [line for line in out.split("GPUFLEET SUMMARY", 1)[1].splitlines() if line.startswith(host + ": ")]
    assert "rolled_back in stop" in row, row


# SGLang's development branch after 0.5.23 keeps a copy of _set_envs_and_config in srt/entrypoints/worker_launch.py,
# run instead of engine.py's when SGLANG_PRESPAWN_WORKERS=1 (../shared/upstream/sglang-main/SOURCE.md). The lab's
# stand-in does the same (tests/support/set_envs_exec.py set_envs_source), so a host whose worker_launch.py lacks the
# block verifies 0/N workers.
UPSTREAM_WORKER_LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared",
                                      "upstream", "sglang-main", "worker_launch.py")
WORKER_LAUNCH = ENGINE.replace("engine.py", "worker_launch.py")


def worker_launch_path(lab, host):
    return "%s/%s" % (lab.host_vars(host)["sglang_python"].rsplit("/bin/", 1)[0], WORKER_LAUNCH)


def file_sha(lab, host, path):
    res = lab.exec(host, ["cat", path], check=True)
    return hashlib.sha256(res.stdout.encode("utf-8", "surrogateescape")).hexdigest()


@pytest.mark.lab_only_once
@pytest.mark.skipif(not os.path.exists(UPSTREAM_WORKER_LAUNCH), reason="../shared/upstream/sglang-main is not here")
def test_prespawn_copy_is_patched_verified_and_put_back_with_engine_py(lab):
    host = lab.hosts[3 % len(lab.hosts)]
    ensure_serving(lab, host)
    worker = worker_launch_path(lab, host)
    with open(UPSTREAM_WORKER_LAUNCH, "rb") as handle:
        upstream = handle.read()
    lab.exec(host, ["sh", "-c", 'cat > "$0"', worker], input=upstream.decode("utf-8"), check=True)
    prespawn = dict(changed_config(lab, host), sglang_launch_extra_env={"SPT_NOENV": "1", "SGLANG_PRESPAWN_WORKERS": "1"})
    # SGLang's function sets CUDA_DEVICE_MAX_CONNECTIONS=8 itself: only a patched worker_launch.py gives the workers 1.
    prespawn["sglang_nccl_env"] = dict(prespawn["sglang_nccl_env"], CUDA_DEVICE_MAX_CONNECTIONS="1")
    try:
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=prespawn)
        out = stdout_of(runner)
        assert runner.status == "successful", out[-4000:]
        [patch] = [d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_nccl_patch") if d["host"] == host
                   and d["task"] == "Put NCCL variables into SGLang's _set_envs_and_config"]
        assert patch["paths"] == [engine_path(lab, host), worker]
        assert [f["changed"] for f in patch["files"]] == [True, True]
        for path in (engine_path(lab, host), worker):
            text = lab.exec(host, ["cat", path], check=True).stdout
            assert "# BEGIN gpufleet managed block" in text and "os.environ['NCCL_DEBUG'] = 'WARN'" in text
        # The server ran worker_launch.py's copy, and verify found the values in every worker.
        log = lab.exec(host, ["cat", "%s/sglang.log" % state_dir(lab, host)], check=True).stdout
        ran = [line for line in log.splitlines() if "_set_envs_and_config (" in line][-1]
        assert "srt/entrypoints/worker_launch.py) set:" in ran, ran
        [verified] = [d for d in lab.events(runner, "runner_on_ok", "assert") if d["host"] == host and
                      d["task"] == "The server generates, every worker carries the NCCL values, and the launched server owns the port"]
        assert "NCCL values present in all" in verified["res"]["msg"]
        record = launch_record(lab, host)
        assert [f["path"] for f in record["nccl_files"]] == [engine_path(lab, host), worker]

        # A failed launch after the patch puts both files back as they were before that run.
        before = {path: file_sha(lab, host, path) for path in (engine_path(lab, host), worker)}
        before_pid = server_pid(lab, host)
        lab.fault(host, crash_with_arg="--max-running-requests")
        bad = dict(prespawn, sglang_launch_args=dict(prespawn["sglang_launch_args"], **{"max-running-requests": 7}),
                   sglang_nccl_env=dict(prespawn["sglang_nccl_env"], NCCL_DEBUG="INFO"))
        failed = lab.run_playbook(PLAYBOOK, limit=host, extravars=bad)
        assert failed.status == "failed", stdout_of(failed)[-4000:]
        rollback = facts(lab, failed, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        assert "engine.py and worker_launch.py restored to their bytes from before this run" in rollback["detail"]
        assert "the host serves the previous configuration (its 8 workers carry the recorded NCCL values)" in \
            rollback["detail"], rollback
        assert {path: file_sha(lab, host, path) for path in before} == before
        assert_serves_previous_launch(lab, host, before_pid, before[engine_path(lab, host)], record)

        # sglang reinstalled since that launch was recorded: worker_launch.py is SGLang's own again. The same failed
        # restart rolls back to the recorded argv and environment, but the workers run the unpatched copy: the note
        # must not call that the previous configuration.
        lab.exec(host, ["sh", "-c", 'cat > "$0"', worker], input=upstream.decode("utf-8"), check=True)
        relaunched = server_pid(lab, host)
        again = lab.run_playbook(PLAYBOOK, limit=host, extravars=bad)
        assert again.status == "failed", stdout_of(again)[-4000:]
        rollback = facts(lab, again, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        assert "previous configuration" not in rollback["detail"], rollback
        assert "not the previous NCCL values" in rollback["detail"]
        assert "CUDA_DEVICE_MAX_CONNECTIONS=8, expected 1" in rollback["detail"]
        assert file_sha(lab, host, worker) == hashlib.sha256(upstream).hexdigest()
        assert server_pid(lab, host) != relaunched and lab.wait_http(host, timeout_s=30) == 200
    finally:
        lab.clear_faults(host)
        lab.exec(host, ["rm", "-f", worker])
        # Back to the group's configuration (the launch record held SGLANG_PRESPAWN_WORKERS).
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=FAST)
        assert runner.status == "successful", stdout_of(runner)[-4000:]


BURST_PROBE = ("import json, sys, urllib.request\n"
               "ok = 0\n"
               "for _ in range(int(sys.argv[2])):\n"
               "    req = urllib.request.Request(sys.argv[1], data=json.dumps({'text': 'x', 'sampling_params':\n"
               "        {'max_new_tokens': 4}}).encode(), headers={'Content-Type': 'application/json'})\n"
               "    try:\n"
               "        ok += 'text' in json.loads(urllib.request.urlopen(req, timeout=3).read())\n"
               "    except OSError as exc:\n"
               "        print(exc)\n"
               "        break\n"
               "print(ok)\n")


@pytest.mark.lab_only_once
def test_a_server_that_hangs_after_a_few_requests_fails_the_verify_burst_and_the_old_one_comes_back(lab):
    """sgl-project/sglang#22779: the new server answers its readiness probe and the single /generate, then hangs
    (accepts, never answers). The burst after the single request names how many answered, the rollback stops the
    hung server and relaunches the recorded launch, which answers more than the burst asked (the knob holds only
    for a start whose argv has the new flag)."""
    host = lab.hosts[1 % len(lab.hosts)]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    # 6 answers: the single /generate, then 5 of the burst.
    lab.fault(host, hang_after_requests={"n": 6, "with_arg": "--max-running-requests"})
    try:
        started = time.monotonic()
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(
            changed_config(lab, host, {"max-running-requests": 7}), sglang_verify_burst_timeout_s=2))
        took = time.monotonic() - started
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "verify"
        cause = facts(lab, runner, host, "_gpufleet_failed_cause")
        assert "/generate burst after the single generation: 5 of 32 answered in " in cause, cause
        assert "8 got no answer within 2 s" in cause and "19 not sent" in cause, cause
        [look] = [d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_process")
                  if d["host"] == host and "burst" in d["res"]]
        new_pid = look["pid"]
        assert look["generate"]["status"] == 200 and look["burst"]["answered"] == 5
        assert 2 <= look["burst"]["wall_s"] < 6, look["burst"]
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        assert "Rollback: rolled_back" in state_lines(lab, runner, host)
        assert not alive(lab, host, new_pid)
        assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
        assert "--max-running-requests" not in cmdline(lab, host, server_pid(lab, host))
        assert launch_record(lab, host) == record, "a failed run must not replace the launch record"
        # the relaunched server does not hang: it answers 40 generations in a row
        hv = lab.host_vars(host)
        url = "http://%s:%s/generate" % (hv.get("sglang_host", "127.0.0.1"), hv.get("sglang_port", 30000))
        probe = lab.exec(host, [hv["sglang_python"], "-c", BURST_PROBE, url, "40"], check=True)
        assert probe.stdout.strip() == "40", probe
        assert took < 120, took
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_memory_unreadable_after_the_stop_relaunches_the_previous_server_and_says_so(lab):
    """Issue 30: memory.used reads [N/A] only once the stop freed the GPUs (preflight read it fine): the wait fails at
    once saying "unreadable", and the rollback relaunches the previous server without a memory check (it ran on these
    GPUs a moment ago); its own readiness decides, and the note says exactly that."""
    host = lab.hosts[0]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    lab.fault(host, smi_field_values={"memory.used": "[N/A]"}, smi_field_values_when_free=True)
    try:
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=changed_config(lab, host))
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "wait"
        cause = facts(lab, runner, host, "_gpufleet_failed_cause")
        assert "memory.used unreadable (nvidia-smi reads '[N/A]')" in cause and "held" not in cause, cause
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        detail = rollback["detail"]
        assert "GPU memory could not be read (GPU 0 (GPU-" in detail
        assert "relaunched without a memory check" in detail and "as pid %d" % rollback["pid"] in detail
        assert "held" not in detail and "second wait" not in detail, detail
        assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_a_holder_no_gpu_list_names_is_waited_beside_and_the_summary_names_its_memory(lab):
    """Issue 30: 5000 MiB on GPU 3 held by a process nvidia-smi does not list (knob hidden_holder), little enough for
    SGLang's TP memory-balance check: the old server ran beside it, so the wait waits for the server's own memory
    only, the new server starts beside it and the summary names the memory left to its holder."""
    host = lab.hosts[1 % len(lab.hosts)]
    before_pid = ensure_serving(lab, host)
    lab.fault(host, hidden_holder={"gpu": 3, "mib": 5000})
    try:
        deadline = time.time() + 10  # the host's init starts the holder on the fault's SIGHUP
        while time.time() < deadline and lab.gpus(host)[3]["used_mib"] < 125000:
            time.sleep(0.1)
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=FAST)
        out = stdout_of(runner)
        assert runner.status == "successful", out[-4000:]
        row = [d for d in lab.events(runner, "playbook_on_stats")][-1]["artifact_data"]["gpufleet_restart"][host]
        assert row["result"] == "ok", row
        # 5000 MiB and its context, and the 9 MiB context of the server's worker no process row counts
        assert "left to them (GPU 3: 5018 MiB): the wait after the stop waited for the server's own memory" \
            in row["advice"], row
        [waited] = [d for d in lab.events(runner, "runner_on_ok", "sglang_stop") if d["task"].startswith("Stop the")]
        assert waited["res"]["gpu_wait"]["baseline_mib"] == {"3": 5018} and waited["res"]["gpu_wait"]["ready"]
        pid = server_pid(lab, host)
        assert pid != before_pid and lab.wait_http(host, timeout_s=30) == 200
        gpu3 = lab.gpus(host)[3]
        assert gpu3["used_mib"] == 120009 + 5009 and [a["used_mib"] for a in gpu3["apps"]] == [120000]
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_a_failed_launch_beside_a_holder_no_gpu_list_names_relaunches_the_previous_server_beside_it(lab):
    """Issue 30: the rollback's wait too counts the memory others held while the old server ran (preflight's
    baseline): it relaunches the previous server beside it at once instead of waiting for memory that never goes."""
    host = lab.hosts[1 % len(lab.hosts)]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    lab.fault(host, hidden_holder={"gpu": 5, "mib": 3000}, crash_with_arg="--max-running-requests")
    try:
        deadline = time.time() + 10  # the host's init starts the holder on the fault's SIGHUP
        while time.time() < deadline and lab.gpus(host)[5]["used_mib"] < 123000:
            time.sleep(0.1)
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(
            changed_config(lab, host, {"max-running-requests": 7}), gpu_memory_wait_timeout_s=20))
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "launch"
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        [waited] = [d for d in lab.events(runner, "runner_on_ok", "nvidia_gpu_wait")
                    if d["task"] == "Rollback - wait until GPU memory is released"]
        assert waited["res"]["ready"] and waited["res"]["baseline_mib"] == {"5": 3018}, waited["res"]
        row = [d for d in lab.events(runner, "playbook_on_stats")][-1]["artifact_data"]["gpufleet_restart"][host]
        assert row["result"] == "rolled_back" and "left to them (GPU 5: 3018 MiB)" in row["advice"], row
        assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
        assert lab.gpus(host)[5]["used_mib"] == 120009 + 3009  # the holder kept its memory all along
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_memory_others_take_after_preflight_is_relaunched_beside_when_the_previous_server_fits(lab):
    """Issue 30: another job takes 5000 MiB of GPU 3 the moment the old server's worker there goes (knob
    hidden_holder_after_stop), after preflight read the GPUs: the wait after the stop and the rollback's wait run out,
    and the rollback relaunches the previous server beside that memory because every GPU still has what the server
    held there free (preflight's measurement) and SGLang's balance check passes. The note says so."""
    host = lab.hosts[0]
    before_pid = ensure_serving(lab, host)
    before_sha, record = engine_sha(lab, host), launch_record(lab, host)
    lab.fault(host, hidden_holder_after_stop={"gpu": 3, "mib": 5000})
    try:
        runner = lab.run_playbook(PLAYBOOK, limit=host, extravars=dict(changed_config(lab, host),
                                                                         gpu_memory_wait_timeout_s=3))
        out = stdout_of(runner)
        assert runner.status == "failed", out[-4000:]
        assert facts(lab, runner, host, "_gpufleet_failed_phase") == "wait"
        rollback = facts(lab, runner, host, "_gpufleet_rollback")
        assert rollback["state"] == "rolled_back", rollback
        detail = rollback["detail"]
        assert "GPU memory others took after preflight stayed held through the wait" in detail, detail
        assert "(least: 138146 MiB free for at most 120000 MiB), so it was relaunched beside it" in detail, detail
        # the rollback's wait ran out too (the memory stays), and did not fail: the old server fits beside it
        [waited] = [d for d in lab.events(runner, "runner_on_ok", "nvidia_gpu_wait")
                    if d["task"] == "Rollback - wait until GPU memory is released"]
        assert waited["res"]["error_class"] == "not_released" and not waited["res"]["ready"], waited["res"]
        assert_serves_previous_launch(lab, host, before_pid, before_sha, record)
        assert lab.gpus(host)[3]["used_mib"] == 120009 + 5009  # relaunched beside the memory taken
    finally:
        lab.clear_faults(host)
