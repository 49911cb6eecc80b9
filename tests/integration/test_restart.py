"""playbooks/restart.yml against the lab fleet over real SSH, through ansible-runner (as AWX runs it).

Asserted on ansible-runner events and on the hosts afterwards: every host gets a new server (new pid, the old
one gone), every GPU worker's /proc/<pid>/environ carries the inventory's NCCL values, the summary table is
printed, a second run is green too; check mode changes nothing; a GPU memory release that never comes fails
the host naming what holds the GPUs and rolls back to the old server; each preflight refusal stops the run before any host
is stopped.
"""
import json
import os
import time

import pytest

pytestmark = pytest.mark.lab

PLAYBOOK = "playbooks/restart.yml"
FAST = {"sglang_stop_grace_s": 10, "gpufleet_serial": 2}
# Reads every process titled sglang::scheduler_TP<n> on the host and prints {pid: environ} as JSON (bytes-safe).
WORKER_ENV = r"""
import json, os, re
out = {}
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        title = open('/proc/%s/cmdline' % pid, 'rb').read().split(b'\0')[0].decode('utf-8', 'replace')
        if re.match(r'sglang::scheduler_TP\d+$', title):
            env = open('/proc/%s/environ' % pid, 'rb').read()
            out[title + ':' + pid] = dict(e.decode('utf-8', 'backslashreplace').partition('=')[::2]
                                          for e in env.split(b'\0') if b'=' in e)
    except OSError:
        pass
print(json.dumps(out))
"""


def real_stops(lab, runner):
    """sglang_stop events of the rolling play: preflight also runs the module, in check mode, to list the stop set."""
    return [d for d in lab.events(runner, "runner_on_ok", "sglang_stop") if not d.get("play", "").startswith("Preflight")]


def pid_file(lab, host):
    return "%s/sglang.pid" % lab.host_vars(host)["sglang_state_dir"]


def server_pid(lab, host):
    res = lab.exec(host, ["cat", pid_file(lab, host)])
    return int(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def alive(lab, host, pid):
    res = lab.exec(host, ["cat", "/proc/%d/stat" % pid])
    return res.returncode == 0 and res.stdout.split(") ", 1)[1][:1] not in ("Z", "X")


def worker_envs(lab, host):
    res = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", WORKER_ENV], check=True)
    return json.loads(res.stdout)


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def ensure_serving(lab, hosts=None):
    """Every host (or ``hosts``) runs a ready server launched by the playbook; returns {host: pid}."""
    hosts = hosts or lab.hosts
    if not all(server_pid(lab, h) and alive(lab, h, server_pid(lab, h)) for h in hosts):
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=",".join(hosts))
        assert runner.status == "successful", stdout_of(runner)[-4000:]
    return {h: server_pid(lab, h) for h in hosts}


def test_restart_replaces_every_server_and_nccl_values_reach_every_worker(lab):
    before = ensure_serving(lab)
    history_before = {h: history_entries(lab, h) for h in lab.hosts}
    runner = lab.run_playbook(PLAYBOOK, extravars=FAST)
    out = stdout_of(runner)
    assert runner.status == "successful", out[-4000:]
    expected = {k: str(v) for k, v in lab.group_vars["sglang_nccl_env"].items()}
    for host in lab.hosts:
        new = server_pid(lab, host)
        assert new and new != before[host], host
        assert not alive(lab, host, before[host]), "old server %d still runs on %s" % (before[host], host)
        envs = worker_envs(lab, host)
        assert len(envs) == lab.host_vars(host)["sglang_launch_args"]["tp-size"], envs.keys()
        for title, env in envs.items():
            assert {k: env.get(k) for k in expected} == expected, "%s %s" % (host, title)
        # lock released
        assert lab.exec(host, ["test", "-e", "%s/restart.lock" % lab.host_vars(host)["sglang_state_dir"]]).returncode == 1
        # One more entry in the host's launch history, with the NCCL values read from the workers (issue 34).
        history = history_entries(lab, host)
        assert len(history) == len(history_before[host]) + 1 and history[:-1] == history_before[host], host
        entry = history[-1]
        assert entry["nccl_env"] == workers_read(lab, host, list(expected)) == expected, (host, entry["nccl_env"])
        assert entry["playbook"] == "restart" and entry["host"] == host and entry["sglang_version"] == "0.5.23"
        assert entry["nccl_workers"] == len(envs) and entry["api_key_set"] is False
        assert entry["model_path"] == lab.host_vars(host)["sglang_launch_args"]["model-path"]
    # The process method's new server was started by the stop's own call (sglang_stop start_after), once GPU
    # memory was free, and the launch only waited for it: no start task ran.
    stops = {d["host"]: d["res"] for d in real_stops(lab, runner) if d["res"].get("done")}
    for host in lab.hosts:
        start = stops[host]["start"]
        assert start["started"] is True and start["pid"] == server_pid(lab, host), (host, start)
        assert start["started_at"] >= stops[host]["gpu_wait"]["started_at"] >= stops[host]["started_at"], start
        assert "new server started by the stop (pid %d)" % start["pid"] in out
    assert not [d for d in lab.events(runner, "runner_on_ok", "sglang_process")
                if d.get("task", "").startswith("Start SGLang in its own session")]
    # the module's own view agrees, per worker
    # (verify's one call, sglang_process state=verified: the generation, the workers' environ, the socket's owner)
    verify = {d["host"]: d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_process")
              if "in a burst, read every GPU worker" in d.get("task", "")}
    assert sorted(verify) == sorted(lab.hosts)
    assert all(r["workers"]["all_match"] and r["workers"]["worker_count"] == 8 for r in verify.values())
    assert all(r["generate"]["status"] == 200 and r["generate"]["json"]["text"] for r in verify.values())
    assert all(r["owner"]["ready"] and r["owner"]["pid"] == server_pid(lab, h) for h, r in verify.items())
    # summary: one line per host, result ok, NCCL ok, the new pid
    assert "GPUFLEET SUMMARY" in out
    table = out.split("GPUFLEET SUMMARY", 1)[1]
    for host in lab.hosts:
        line = next(l for l in table.splitlines() if l.startswith(host + " "))
        cells = line.split()
        assert cells[1] == "ok" and cells[6] == "ok" and cells[-1] == str(server_pid(lab, host)), line
        assert float(cells[2]) > 0 and int(cells[3]) >= 0, line

    again = lab.run_playbook(PLAYBOOK, extravars=FAST)
    assert again.status == "successful", stdout_of(again)[-4000:]
    assert all(server_pid(lab, h) != None for h in lab.hosts)


@pytest.mark.lab_only_once
def test_without_start_with_stop_the_launch_starts_the_server(lab):
    host = lab.hosts[0]
    before = ensure_serving(lab, [host])[host]
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, target=host, gpufleet_start_with_stop=False))
    assert runner.status == "successful", stdout_of(runner)[-4000:]
    new = server_pid(lab, host)
    assert new and new != before
    [stop] = [d["res"] for d in real_stops(lab, runner) if d["res"].get("done")]
    assert "start" not in stop, "no start_after was passed to the stop"
    starts = [d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_process")
              if d.get("task", "").startswith("Start SGLang in its own session")]
    assert [s["pid"] for s in starts] == [new], starts


@pytest.mark.lab_only_once
def test_check_mode_changes_nothing(lab):
    before = ensure_serving(lab)
    engines = {h: lab.exec(h, ["sh", "-c", "md5sum %s/lib/python3*/site-packages/sglang/srt/entrypoints/engine.py"
                              % lab.host_vars(h)["sglang_python"].rsplit("/bin/", 1)[0]]).stdout for h in lab.hosts}
    records = {h: lab.exec(h, ["md5sum", "%s/launch.json" % lab.host_vars(h)["sglang_state_dir"]]).stdout
               for h in lab.hosts}
    # --diff with a flag added: the launch record's diff is what the launch would change, and nothing else
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_launch_args=lab.launch_args_expr(
        {"enable-metrics": True})), check=True, diff=True)
    assert runner.status == "successful", stdout_of(runner)[-4000:]
    diffs = {d["host"]: d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_process")
             if d.get("task") == "Write the launch record"}
    assert set(diffs) == set(lab.hosts), diffs
    for host, res in diffs.items():
        assert res["changed"], res
        old, new = (json.loads(res["diff"][side]) for side in ("before", "after"))
        assert "--enable-metrics" in new["argv"]
        assert "--enable-metrics" not in old["argv"]
        assert {k for k in set(old) | set(new) if old.get(k) != new.get(k)} == {"argv"}, (old, new)
    for host in lab.hosts:
        assert server_pid(lab, host) == before[host] and alive(lab, host, before[host])
        assert lab.exec(host, ["md5sum", "%s/launch.json" % lab.host_vars(host)["sglang_state_dir"]]).stdout \
            == records[host]
        assert lab.exec(host, ["test", "-e", "%s/restart.lock" % lab.host_vars(host)["sglang_state_dir"]]).returncode == 1
    after = {h: lab.exec(h, ["sh", "-c", "md5sum %s/lib/python3*/site-packages/sglang/srt/entrypoints/engine.py"
                             % lab.host_vars(h)["sglang_python"].rsplit("/bin/", 1)[0]]).stdout for h in lab.hosts}
    assert after == engines
    # the stop reported what it would signal, and signalled nothing
    stops = {d["host"]: d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_stop")}
    assert all(any(e["pid"] == before[h] and e["ended"] == "would signal" for e in stops[h]["signalled"])
               for h in lab.hosts)
    # and says so in words: nothing "stopped" in a dry run
    said = [d["res"]["msg"] for d in lab.events(runner, "runner_on_ok", "debug")
            if d.get("task") == "Report what was stopped"]
    assert len(said) == len(lab.hosts) and all(" process(es) would be stopped (pids " in m for m in said), said
    # the summary names the server that keeps serving, and no new one
    rows = [d for d in lab.events(runner, "playbook_on_stats")][-1]["artifact_data"]["gpufleet_restart"]
    assert {h: (r["result"], r["old_pid"], r["new_pid"]) for h, r in rows.items()} == {
        h: ("check", before[h], None) for h in lab.hosts}, rows


@pytest.mark.lab_only_once
def test_memory_never_released_fails_naming_holders_and_the_rollback_does_not_relaunch_into_it(lab):
    """The wait fails naming what holds the GPUs; the rollback puts engine.py back and waits once more, and since
    the memory stays held it does not relaunch the recorded launch (beside what was never released its workers
    would run out of GPU memory: the lab's GPUs refuse an allocation that does not fit, as CUDA does). The host
    ends serving nothing, and the summary says why and what frees the memory."""
    host = lab.hosts[0]
    ensure_serving(lab, [host])
    old_pid = server_pid(lab, host)
    lab.fault(host, memory_never_released=True)
    state = lab.host_vars(host)["sglang_state_dir"]
    log_before = len(lab.exec(host, ["cat", state + "/sglang.log"]).stdout)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, gpu_memory_wait_timeout_s=3), limit=host)
        out = stdout_of(runner)
        assert runner.status == "failed", out[-3000:]
        # the wait, then the rollback's second wait of the same length
        waits = lab.events(runner, "runner_on_failed", "nvidia_gpu_wait")
        assert [w["host"] for w in waits] == [host, host], waits
        msg = waits[0]["res"]["msg"]
        assert "not released" in msg and "MiB used" in msg and "GPU 0" in msg
        left = server_pid(lab, host)
        assert left is None or not alive(lab, host, left)
        assert not alive(lab, host, old_pid)
        assert lab.wait_http(host, timeout_s=1) is None
        summary = out.split("GPUFLEET SUMMARY", 1)[1]
        assert "rolled_back" not in summary, summary
        assert "rollback failed while waiting once more for the GPU memory the wait found held" in summary, summary
        assert "so the previous server was not relaunched" in out and "nvidia-smi -r" in out, out[-3000:]
        # nothing was started into the full GPUs: no out-of-memory in the log since the run began
        log = lab.exec(host, ["cat", state + "/sglang.log"]).stdout
        assert "CUDA out of memory" not in log[log_before:], log[-2000:]
    finally:
        lab.clear_faults(host)
    ensure_serving(lab, [host])


@pytest.mark.lab_only_once
def test_memory_released_late_fails_the_wait_and_the_rollback_relaunches_once_it_is_free(lab):
    """The memory comes free after the wait ran out (8 s against 5 s) but within the rollback's second wait: the
    previous server is relaunched then, and the host serves again (rolled_back in wait)."""
    host = lab.hosts[0]
    ensure_serving(lab, [host])
    old_pid = server_pid(lab, host)
    lab.fault(host, release_delay_ms=8000)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, gpu_memory_wait_timeout_s=5), limit=host)
        out = stdout_of(runner)
        assert runner.status == "failed", out[-3000:]
        [failed] = lab.events(runner, "runner_on_failed", "nvidia_gpu_wait")
        assert "not released" in failed["res"]["msg"]
        rows = [d for d in lab.events(runner, "playbook_on_stats")][-1]["artifact_data"]["gpufleet_restart"]
        assert rows[host]["result"] == "rolled_back" and rows[host]["phase"] == "wait", rows[host]
        relaunched = server_pid(lab, host)
        assert relaunched not in (None, old_pid) and alive(lab, host, relaunched)
        assert rows[host]["new_pid"] == relaunched
        assert lab.wait_http(host, timeout_s=30) is not None
    finally:
        lab.clear_faults(host)
    ensure_serving(lab, [host])


def _assert_refused_before_any_stop(lab, runner, before, words):
    out = stdout_of(runner)
    assert runner.status == "failed", out[-3000:]
    failed = lab.events(runner, "runner_on_failed")
    assert failed, out[-3000:]
    text = " ".join(json.dumps(d.get("res", {}).get("msg", "")) for d in failed)
    for word in words:
        assert word in text, text[:3000]
    assert real_stops(lab, runner) == []
    assert lab.events(runner, "runner_on_ok", "systemd_service") == []
    for host, pid in before.items():
        assert alive(lab, host, pid), "%s: old server %d was stopped although preflight refused" % (host, pid)


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_preflight_refuses_unknown_flag_and_no_host_is_stopped(lab):
    before = ensure_serving(lab)
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_launch_args=lab.launch_args_expr(
        {"speculative-num-stepz": 3})))
    _assert_refused_before_any_stop(lab, runner, before, ["speculative-num-stepz"])


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_preflight_refuses_missing_model_path_and_no_host_is_stopped(lab):
    before = ensure_serving(lab)
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_launch_args=lab.launch_args_expr(
        {"model-path": "/models/no-such-model"})))
    _assert_refused_before_any_stop(lab, runner, before, ["/models/no-such-model"])


def test_preflight_refuses_null_launch_args_naming_the_variable(lab):
    host = lab.hosts[0]
    before = ensure_serving(lab, [host])
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_launch_args=None), limit=host)
    _assert_refused_before_any_stop(lab, runner, before, ["sglang_launch_args is empty or null"])


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_preflight_refuses_port_held_by_stray_listener_and_no_host_is_stopped(lab):
    before = ensure_serving(lab)
    host = lab.hosts[-1]
    lab.fault(host, port_held=30123)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_port=30123))
        _assert_refused_before_any_stop(lab, runner, before, ["30123"])
    finally:
        lab.fault(host, port_held=None)


def test_second_run_is_refused_while_a_host_is_locked(lab):
    host = lab.hosts[0]
    before = ensure_serving(lab, [host])
    lock = "%s/restart.lock" % lab.host_vars(host)["sglang_state_dir"]
    lab.exec(host, ["mkdir", lock], check=True)
    lab.exec(host, ["sh", "-c", 'echo \'{"run_id": "awx-4711", "controller": "awx-1", "pid": 99}\' > %s/owner.json' % lock],
             check=True)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert runner.status == "failed"
        # Preflight refuses it (its message is a list of problems), before play 3's lock take would.
        msgs = " ".join(json.dumps(d["res"].get("msg", "")) for d in lab.events(runner, "runner_on_failed"))
        assert "locked by another restart: run awx-4711 from awx-1 (pid 99" in msgs, msgs
        assert real_stops(lab, runner) == []
        assert alive(lab, host, before[host])
        assert lab.exec(host, ["test", "-d", lock]).returncode == 0, "another run's lock must be left alone"
    finally:
        lab.exec(host, ["rm", "-rf", lock])


def _hold_lock(lab, host, run_id):
    lock = "%s/restart.lock" % lab.host_vars(host)["sglang_state_dir"]
    lab.exec(host, ["mkdir", lock], check=True)
    lab.exec(host, ["sh", "-c", 'echo \'{"run_id": "%s", "controller": "awx-1", "pid": 99}\' > %s/owner.json'
                    % (run_id, lock)], check=True)
    return lock


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_tagged_run_refuses_a_locked_host_too(lab):
    # The lock tasks carry tag always; a dynamic include_tasks would run none of them under --tags stop,wait.
    host = lab.hosts[0]
    before = ensure_serving(lab, [host])
    lock = _hold_lock(lab, host, "awx-4712")
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop,wait")
        assert runner.status == "failed"
        msgs = " ".join(d["res"].get("msg", "") for d in lab.events(runner, "runner_on_failed"))
        assert "locked by another restart" in msgs and "awx-4712" in msgs
        assert real_stops(lab, runner) == []
        assert alive(lab, host, before[host])
        assert lab.exec(host, ["test", "-d", lock]).returncode == 0, "another run's lock must be left alone"
    finally:
        lab.exec(host, ["rm", "-rf", lock])


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_lock_of_a_run_killed_on_this_controller_is_taken_over(lab):
    # Ctrl-C twice / SIGKILL leaves the lock; its owner.json names this controller and a pid now dead.
    import socket
    import subprocess
    import sys
    host = lab.hosts[0]
    ensure_serving(lab, [host])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = "%s/restart.lock" % lab.host_vars(host)["sglang_state_dir"]
    lab.exec(host, ["mkdir", lock], check=True)
    owner = json.dumps({"run_id": "killed-1", "controller": socket.gethostname(), "pid": dead.pid})
    lab.exec(host, ["sh", "-c", "cat > %s/owner.json" % lock], input=owner, check=True)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert runner.status == "successful", stdout_of(runner)[-4000:]
        assert lab.exec(host, ["test", "-e", lock]).returncode == 1
    finally:
        lab.exec(host, ["rm", "-rf", lock])


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_inventory_lock_stale_s_takes_over_an_older_lock(lab):
    # gpufleet_lock_stale_s is read from the inventory (docs/inventory.md); a play var of the same name would override it.
    host = lab.hosts[0]
    ensure_serving(lab, [host])
    host_vars = os.path.join(lab.inventory, "host_vars", host + ".yml")
    os.makedirs(os.path.dirname(host_vars), exist_ok=True)
    with open(host_vars, "w") as handle:
        handle.write("gpufleet_lock_stale_s: 1\n")
    lock = _hold_lock(lab, host, "dead-run-1")
    try:
        time.sleep(3)
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop,wait")
        assert runner.status == "successful", stdout_of(runner)[-4000:]
        assert real_stops(lab, runner), "the stale lock must be taken over"
        assert lab.exec(host, ["test", "-e", lock]).returncode == 1, "the run releases the lock it took over"
    finally:
        os.unlink(host_vars)
        lab.exec(host, ["rm", "-rf", lock])
    ensure_serving(lab, [host])


@pytest.mark.lab_only_once
def test_throughput_regression_fails_and_keeps_last_good(lab):
    host = lab.hosts[0]
    ensure_serving(lab, [host])
    last_good = "%s/last_good.json" % lab.host_vars(host)["sglang_state_dir"]
    lab.exec(host, ["rm", "-f", last_good])
    smoke = dict(FAST, sglang_verify_throughput=True, sglang_verify_throughput_requests=4,
                 sglang_verify_throughput_concurrency=4, sglang_verify_throughput_max_new_tokens=100)
    lab.fault(host, tokens_per_s=1000)
    try:
        good = lab.run_playbook(PLAYBOOK, extravars=smoke, limit=host, tags="verify")
        assert good.status == "successful", stdout_of(good)[-3000:]
        stored = json.loads(lab.exec(host, ["cat", last_good], check=True).stdout)
        assert stored["tokens_per_s"] > 500  # 4 parallel requests at 1000 tokens/s each, minus HTTP overhead
        lab.fault(host, tokens_per_s=100)  # a tenth: far beyond the 30 % allowed
        serving_pid = server_pid(lab, host)
        slow = lab.run_playbook(PLAYBOOK, extravars=smoke, limit=host, tags="verify")
        assert slow.status == "failed"
        # a --tags verify run stopped and launched nothing: no rollback, the verified server keeps serving
        assert server_pid(lab, host) == serving_pid and alive(lab, host, serving_pid)
        assert lab.wait_http(host, path="/health_generate", status=200, timeout_s=10) is not None
        msgs = " ".join(d["res"].get("msg", "") for d in lab.events(slow, "runner_on_failed"))
        assert "below the last good" in msgs and str(stored["tokens_per_s"]) in msgs
        assert json.loads(lab.exec(host, ["cat", last_good], check=True).stdout) == stored
        table = stdout_of(slow).split("GPUFLEET SUMMARY", 1)[1]
        line = next(l for l in table.splitlines() if l.startswith(host + " "))
        assert line.split()[1] == "failed"
    finally:
        lab.fault(host, tokens_per_s=None)
        lab.exec(host, ["rm", "-f", last_good])


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_launch_failure_shows_log_tail_and_names_the_full_log(lab):
    host = lab.hosts[-1]
    ensure_serving(lab, [host])
    lab.fault(host, crash_on_start=True)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        out = stdout_of(runner)
        assert runner.status == "failed"
        log_file = "%s/sglang.log" % lab.host_vars(host)["sglang_state_dir"]
        [tail] = [d for d in lab.events(runner, "runner_on_ok", "debug")
                  if d["task"] == "Show the end of the server log"]
        assert tail["res"]["msg"], "log tail is empty"
        msgs = [d["res"]["msg"] for d in lab.events(runner, "runner_on_failed") if d["host"] == host]
        assert any(log_file in m and "did not start or did not answer" in m for m in msgs), msgs
        # One-line messages quote how the log ends; none announces log lines it does not hold.
        row = lab.events(runner, "playbook_on_stats")[-1]["artifact_data"]["gpufleet_restart"][host]
        finals = [d["res"]["msg"] for d in lab.events(runner, "runner_on_failed") if d["host"] == host and
                  d["task"] in ("Fail with where to look", "Fail the host (the rolling restart stops here)")]
        assert len(finals) == 2, finals
        for line in finals + [row["cause"]]:
            assert "log:." not in line and "Its log ends: '" in line and "crash_on_start" in line, line
        assert "The old server is stopped and no new one serves" in out
        # verify never ran (its one call is sglang_process state=verified), and the stop did run
        assert not [d for d in lab.events(runner, "runner_on_ok", "sglang_process")
                    if d["host"] == host and "in a burst, read every GPU worker" in d.get("task", "")]
        assert [d for d in real_stops(lab, runner) if d["host"] == host]
    finally:
        lab.clear_faults(host)
    ensure_serving(lab, [host])


# -- launch history and profiles (issue 34) -------------------------------------------------------------------

def history_path(lab, host):
    return "%s/history.jsonl" % lab.host_vars(host)["sglang_state_dir"]


def history_entries(lab, host):
    res = lab.exec(host, ["cat", history_path(lab, host)])
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()] if res.returncode == 0 else []


def workers_read(lab, host, names):
    """{name: value} the host's GPU workers carry for ``names`` (every worker must agree), read from /proc."""
    values = {}
    for env in worker_envs(lab, host).values():
        for name in names:
            values.setdefault(name, set()).add(env.get(name))
    assert all(len(v) == 1 for v in values.values()), values
    return {name: next(iter(v)) for name, v in values.items()}


@pytest.mark.lab_only_once
def test_the_history_playbook_shows_and_publishes_the_hosts_launches_and_the_file_is_0600(lab):
    # Read-only: the entries the restarts before left (test_restart_replaces_every_server... asserts that each
    # restart adds one with the workers' values; test_api_key that a keyed one holds no key).
    host = lab.hosts[0]
    ensure_serving(lab, [host])
    entries = history_entries(lab, host)
    assert entries, "a verified launch left no history entry"
    assert lab.exec(host, ["stat", "-c", "%a", history_path(lab, host)], check=True).stdout.strip() == "600"
    shown = lab.run_playbook("playbooks/history.yml", extravars={"target": host, "gpufleet_history_last": 2})
    out = stdout_of(shown)
    assert shown.status == "successful", out[-3000:]
    [stats] = [e["event_data"].get("artifact_data") for e in shown.events if e["event"] == "playbook_on_stats"]
    assert stats["gpufleet_history"][host] == entries[-2:]
    # The gpufleet_summary callback prints them as one table, the NCCL values in short form.
    table = out.split("GPUFLEET HISTORY", 1)[1]
    row = next(line for line in table.splitlines() if entries[-1]["run_id"] in line)
    assert host in row and "restart" in row and "PROTO=%s" % entries[-1]["nccl_env"]["NCCL_PROTO"] in row, row


PROFILE = {"name": "lab-fast", "sglang_nccl_env": {"NCCL_NTHREADS": "256", "NCCL_ALGO": None},
           "sglang_launch_args": {"speculative-num-steps": 2, "speculative-num-draft-tokens": 3},
           "source": {"canary": "gpu-lab-01", "run_id": "test"}}


@pytest.mark.lab_only_once
def test_restart_with_a_profile_gives_the_workers_the_profiles_values(lab, tmp_path):
    import yaml
    host = lab.hosts[1]
    ensure_serving(lab, [host])
    (tmp_path / "lab-fast.yml").write_text(yaml.safe_dump(PROFILE))
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, gpufleet_profile="lab-fast",
                                                           gpufleet_profile_dir=str(tmp_path)), limit=host)
        assert runner.status == "successful", stdout_of(runner)[-4000:]
        # The host's own values with the profile's on top: NCCL_NTHREADS changed, NCCL_ALGO gone, the rest kept.
        own = {k: str(v) for k, v in lab.group_vars["sglang_nccl_env"].items()}
        read = workers_read(lab, host, list(own))
        assert read["NCCL_NTHREADS"] == "256" and read["NCCL_ALGO"] is None
        assert read["NCCL_PROTO"] == own["NCCL_PROTO"] and read["NCCL_BUFFSIZE"] == own["NCCL_BUFFSIZE"]
        argv = " ".join(lab.exec(host, ["cat", "/proc/%d/cmdline" % server_pid(lab, host)], check=True)
                        .stdout.split("\0"))
        assert "--speculative-num-steps 2" in argv and "--speculative-num-draft-tokens 3" in argv, argv
        assert lab.host_vars(host)["sglang_launch_args"]["model-path"] in argv
        entry = history_entries(lab, host)[-1]
        assert entry["profile"] == "lab-fast" and entry["nccl_env"]["NCCL_NTHREADS"] == "256"
        assert "NCCL_ALGO" not in entry["nccl_env"]
    finally:
        # The run back to the inventory's values, with a history that cannot be written (a directory in its
        # place): bookkeeping never fails a verified launch, the run says why the entry is missing.
        path = history_path(lab, host)
        lab.exec(host, ["sh", "-c", "mv %s %s.keep && mkdir %s/" % (path, path, path)], check=True)
        try:
            profiled = server_pid(lab, host)
            restore = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        finally:
            lab.exec(host, ["sh", "-c", "rmdir %s && mv %s.keep %s" % (path, path, path)], check=True)
        out = stdout_of(restore)
        assert restore.status == "successful", out[-3000:]
        assert "launch history not written, the launch itself is verified" in out, out[-3000:]
        new = server_pid(lab, host)
        assert new != profiled and alive(lab, host, new) and not alive(lab, host, profiled)
        own = {k: str(v) for k, v in lab.group_vars["sglang_nccl_env"].items()}
        assert workers_read(lab, host, list(own)) == own


@pytest.mark.lab_only_once
def test_a_missing_or_malformed_profile_stops_the_run_before_any_host_is_touched(lab, tmp_path):
    hosts = lab.hosts[:2]
    before = ensure_serving(lab, hosts)
    (tmp_path / "broken.yml").write_text("name: broken\nsglang_nccl_env: [NCCL_PROTO\n")
    for name, words in (("nosuch", "no such file"), ("broken", "broken.yml cannot be read")):
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, gpufleet_profile=name,
                                                           gpufleet_profile_dir=str(tmp_path)),
                                  limit=",".join(hosts))
        out = stdout_of(runner)
        assert runner.status == "failed", out[-3000:]
        assert words in out and "nothing was changed on any host" in out and str(tmp_path) in out, out[-3000:]
        # Nothing ran on a host: no preflight read, no stop; the same servers serve.
        assert not lab.events(runner, "runner_on_ok", "sglang_preflight_info") and not real_stops(lab, runner)
        assert {h: server_pid(lab, h) for h in hosts} == before
        assert all(alive(lab, h, before[h]) for h in hosts)


@pytest.mark.lab_only_once
def test_a_profile_that_extra_vars_would_override_is_refused_before_any_host_is_touched(lab, tmp_path):
    # -e sglang_nccl_env=... wins over the profile's set_fact: the run would launch the extra var's values and say
    # it launched the profile. It is refused in the preflight play instead, and the servers keep serving.
    hosts = lab.hosts[:2]
    before = ensure_serving(lab, hosts)
    (tmp_path / "fast.yml").write_text("name: fast\nsglang_nccl_env: {NCCL_MAX_NCHANNELS: '8'}\n")
    pinned = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, gpufleet_profile="fast", gpufleet_profile_dir=str(tmp_path),
                                                       sglang_nccl_env=pinned),
                              limit=",".join(hosts))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-3000:]
    assert "gpufleet_profile=fast cannot be applied" in out and "extra var (-e)" in out, out[-3000:]
    assert "Nothing was stopped or changed" in out, out[-3000:]
    assert not real_stops(lab, runner)
    assert {h: server_pid(lab, h) for h in hosts} == before
    assert all(alive(lab, h, before[h]) for h in hosts)
