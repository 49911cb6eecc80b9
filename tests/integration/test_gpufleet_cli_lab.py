"""The gpufleet command against the lab, and how much a restart prints under the project's stdout callback."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
# the summary table's block (banner, header, a row per host, per-host notes) is not counted
MAX_LINES_BEFORE_TABLE = 120

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module", autouse=True)
def leave_the_hosts_idle(lab):
    """The restarts here leave servers running; later modules start their own and wait for free GPU memory."""
    yield
    stopped = lab.run_playbook("playbooks/restart.yml", extravars={"gpufleet_serial": len(lab.hosts)},
                               tags="stop,wait")
    assert stopped.status == "successful"


def gpufleet(lab, tmp_path, *args, timeout=600):
    """Run ``python -m gpufleet_cli`` from an unrelated directory, as a user would run .venv/bin/gpufleet."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PATH=BIN + ":" + os.environ.get("PATH", ""))
    env.pop("ANSIBLE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "gpufleet_cli", *args, "-i", lab.inventory,
                           "--artifacts-dir", str(tmp_path / "artifacts")],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=timeout)


def server_pid(lab, host):
    state = lab.host_vars(host)["sglang_state_dir"]
    out = lab.exec(host, ["cat", os.path.join(state, "sglang.pid")])
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


@pytest.mark.lab_only_once
def test_cli_restarts_two_hosts_then_checks_them_and_fails_on_a_crit_host(lab, tmp_path):
    hosts = lab.hosts[:2]
    res = gpufleet(lab, tmp_path, "restart", "--limit", ",".join(hosts))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # progress: a line per host and phase as it began (stderr is not a terminal here), then the table
    for host in hosts:
        phases = re.findall(r"^\s+%s\s+(\w+)" % re.escape(host), res.stderr, re.M)
        assert phases[:1] == ["preflight"] and "stop" in phases and phases[-1] == "verify", res.stderr
        assert re.search(r"%s\s.*\bok\b" % re.escape(host), res.stdout), res.stdout
    match = re.search(r"artifacts: (\S+) .*report: (\S+)", res.stderr)
    assert match, res.stderr
    artifacts, report_path = match.groups()
    assert os.path.isdir(os.path.join(artifacts, "job_events")) and os.path.exists(os.path.join(artifacts, "stdout"))
    report = json.load(open(report_path))
    assert report["exit_code"] == 0 and sorted(report["hosts"]) == sorted(hosts)
    for host in hosts:
        row = report["hosts"][host]
        assert row["result"] == "ok" and row["nccl"] == "ok" and row["new_pid"] == server_pid(lab, host)

    # check --json prints only the report; both hosts serve
    check = gpufleet(lab, tmp_path, "check", "--json", "--limit", ",".join(hosts))
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    doc = json.loads(check.stdout)
    assert {h: r["verdict"] for h, r in doc["hosts"].items()} == {h: "OK" for h in hosts}
    assert doc["artifacts_dir"] and os.path.isdir(doc["artifacts_dir"])

    # a host whose server does not answer (a wrong port) is CRIT, and the command exits non-zero
    crit = gpufleet(lab, tmp_path, "check", "--json", "--limit", hosts[0], "-e", "sglang_port=1")
    assert crit.returncode != 0
    doc = json.loads(crit.stdout)
    assert doc["hosts"][hosts[0]]["verdict"] == "CRIT" and doc["failed_hosts"] == [hosts[0]]
    assert any("health_generate" in r["text"] for r in doc["hosts"][hosts[0]]["reasons"])
    assert server_pid(lab, hosts[0]) == report["hosts"][hosts[0]]["new_pid"]  # check changed nothing


@pytest.mark.lab_only_once
def test_cli_says_ansibles_own_error_for_a_limit_that_matches_no_host_and_keeps_one_artifacts_path(lab, tmp_path):
    # it printed only "FAILED: 0 host(s), 2 s", --json gave run_errors: [] and the artifacts sat in
    # artifacts/<run>/artifacts/<run>
    before = {h: server_pid(lab, h) for h in lab.hosts}
    res = gpufleet(lab, tmp_path, "check", "--limit", "nosuchhost")
    assert res.returncode != 0
    assert "[WARNING]: Could not match supplied host pattern, ignoring: nosuchhost" in res.stdout, res.stdout
    assert re.search(r"^(\[ERROR\]:|ERROR!) .*no hosts", res.stdout, re.M), res.stdout
    doc = json.loads(gpufleet(lab, tmp_path, "check", "--json", "--limit", "nosuchhost").stdout)
    assert doc["hosts"] == {} and doc["exit_code"] != 0
    assert any("nosuchhost" in e for e in doc["run_errors"]) and any("no hosts" in e for e in doc["run_errors"])
    run_dir = doc["artifacts_dir"]
    assert os.path.dirname(run_dir) == str(tmp_path / "artifacts")
    for name in ("stdout", "job_events", "report.json", "report"):
        assert os.path.exists(os.path.join(run_dir, name)), sorted(os.listdir(run_dir))
    assert not os.path.exists(os.path.join(run_dir, "artifacts"))
    # nothing ran on any host
    assert {h: server_pid(lab, h) for h in lab.hosts} == before


@pytest.mark.lab_only_once
def test_a_four_host_restart_reads_in_about_one_screen_plus_the_table(lab):
    if len(lab.hosts) < 4:
        pytest.skip("needs a lab of 4 hosts (GPUFLEET_TEST_LAB_HOSTS=4, the default)")
    hosts = lab.hosts[:4]
    env = dict(os.environ, **lab._envvars())
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", lab.inventory,
                           os.path.join(ROOT, "playbooks", "restart.yml"), "--limit", ",".join(hosts)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    table_at = next(i for i, line in enumerate(lines) if line.startswith("GPUFLEET SUMMARY"))
    before = lines[:table_at]
    assert len(before) <= MAX_LINES_BEFORE_TABLE, "\n".join(before)
    table = lines[table_at + 1:]
    for host in hosts:
        assert any(re.match(r"%s\s+ok\s" % re.escape(host), line) for line in table), table
        # what matters per host is still there: the stop, the GPU memory release, the launch
        assert "  %s: GPU memory free after" % host in proc.stdout
        assert re.search(r"^  %s: \d+ process\(es\) stopped" % re.escape(host), proc.stdout, re.M)
    assert not [line for line in before if line.startswith(("ok: [", "skipping: [", "included: "))]
    assert proc.stdout.count("GPUFLEET SUMMARY") == 1


@pytest.mark.lab_only_once
def test_sigterm_mid_restart_cancels_with_a_report_of_the_outage_and_a_rerun_recovers(lab, tmp_path):
    # kill (SIGTERM: systemd, a CI job's timeout) used to end the command at once, without a report; a background
    # job of a script ignores SIGINT, so SIGTERM is how such a run is stopped.
    host = lab.hosts[2]
    first = gpufleet(lab, tmp_path, "restart", "--limit", host)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    before = server_pid(lab, host)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PATH=BIN + ":" + os.environ.get("PATH", ""))
    env.pop("ANSIBLE_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "gpufleet_cli", "restart", "--limit", host, "-i", lab.inventory,
                             "--artifacts-dir", str(tmp_path / "artifacts")], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            # the wait phase begins once the stop's result is in (the old server is stopped)
            if re.match(r"^\s+%s\s+wait\b" % re.escape(host), line):
                proc.send_signal(signal.SIGTERM)
                break
        rest_out, rest_err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + rest_err
    assert proc.returncode != 0, err
    # ansible-playbook got SIGTERM (as from an AWX cancel), stopped its tasks and printed its summary; the CLI's
    # report and last line say the same (before: "FAILED: 1 host(s): 1 ok" once the playbook had run to its end)
    assert re.search(r"cancelling: ansible-playbook \(pid \d+\) got SIGTERM", err), err
    report = json.load(open(re.search(r"report: (\S+)", err).group(1)))
    row = report["hosts"][host]
    assert report["status"] == "canceled" and row["result"] == "cancelled" and report["rc"] == 99, (report, err)
    assert row["old_pid"] == before and isinstance(row["downtime_s"], float), row
    assert row["cause"].startswith("cancelled after the stop (old server pid %d)" % before), row
    assert "-e target=%s" % host in row["cause"], row
    assert re.search(r"^CANCELLED: 1 host\(s\): 1 cancelled, \d+ s$", err.strip().splitlines()[-1]), err[-500:]
    playbook_out = open(os.path.join(report["artifacts_dir"], "stdout")).read()
    summary = playbook_out.split("GPUFLEET SUMMARY (cancelled: SIGTERM)", 1)
    assert len(summary) == 2, playbook_out[-3000:]
    assert " ".join(row["cause"].split()) in " ".join(summary[1].split()), (row["cause"], summary[1])
    # The advice is followed as written: the rerun takes over the cancelled run's lock and the host serves.
    rerun = gpufleet(lab, tmp_path, "restart", "--limit", host)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert server_pid(lab, host) not in (None, before)


@pytest.mark.lab_only_once
def test_ctrl_c_on_ansible_playbook_mid_restart_still_prints_what_the_host_was_left_in(lab):
    # ansible-core skips v2_playbook_on_stats and every always: section on Ctrl-C; the run printed only "User
    # interrupted execution" while the host it was restarting served nothing.
    host = lab.hosts[3]
    env = dict(os.environ, **lab._envvars())
    argv = [os.path.join(BIN, "ansible-playbook"), "-i", lab.inventory, os.path.join(ROOT, "playbooks", "restart.yml"),
            "-e", "target=%s" % host]
    first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:]
    before = server_pid(lab, host)
    lab.fault(host, release_delay_ms=20000)  # the stop's memory wait lasts: the run is cut inside the outage
    try:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        # One reader for the whole output (a for loop over proc.stdout followed by communicate() loses what the
        # loop's buffer read ahead); the test thread sends the Ctrl-C when the stop's line appears.
        seen, stopped = [], threading.Event()

        def read():
            for line in proc.stdout:
                seen.append(line)
                if re.match(r"^  %s: \d+ process\(es\) stopped" % re.escape(host), line):
                    stopped.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        hung = None
        try:
            assert stopped.wait(300), "".join(seen)[-3000:]
            # Into the GPU memory wait's module run (the stop line comes 10 s into the 20 s release): not while the
            # next tasks start. The likely cause of a hang there (read from ansible-core 2.19's source, not traced):
            # its worker exits at once on SIGINT (WorkerProcess._term, os._exit), also
            # while it holds the result queue's write lock in FinalQueue.put (a task's start or result is sent then);
            # the main process's own put of the strategy's sentinel then waits forever, in StrategyBase.cleanup.
            # Seen twice in clean-clone CI runs (ps: main thread in futex_do_wait, the results thread reading its
            # pipe, no worker left), never in a quiet run; a second Ctrl-C then kills it (SIGINT is SIG_DFL by then).
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
            try:
                proc.wait(timeout=240)
            except subprocess.TimeoutExpired:
                # Say where it hangs for the next reader (see above).
                hung = subprocess.run(["ps", "-s", str(proc.pid), "-L", "-o", "pid,ppid,tid,stat,wchan:24,etime,cmd"],
                                      capture_output=True, text=True).stdout
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(30)
        out = "".join(seen)
        assert hung is None, "ansible-playbook still ran 240 s after Ctrl-C:\n%s\n%s" % (hung, out[-3000:])
        assert proc.returncode != 0, out[-3000:]
        summary = out.split("GPUFLEET SUMMARY (interrupted)", 1)
        assert len(summary) == 2, out[-3000:]
        assert re.search(r"%s: interrupted in (stop|wait): ansible-playbook was interrupted" % re.escape(host),
                         summary[1]), summary[1]
        assert "-e target=%s" % host in summary[1] and re.search(r"%s\s+interrupted\s+down:" % re.escape(host),
                                                                  summary[1]), summary[1]
        assert not (server_pid(lab, host) == before and lab.wait_http(host, timeout_s=1) is not None)
    finally:
        lab.clear_faults(host)
    # The old server's memory is released 20 s after it died (the fault's delay, already under way): until then
    # preflight rightly refuses memory no visible process holds. Then the advice, followed: the rerun takes over
    # the interrupted run's lock and the host serves again.
    deadline = time.time() + 60
    while time.time() < deadline:
        used = lab.exec(host, ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]).stdout
        if used.split() and max(int(v) for v in used.split()) <= 1024:
            break
        time.sleep(1)
    rerun = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert server_pid(lab, host) not in (None, before)
    # It found no server (downtime 0.0), but says the interrupted run left the host down, and since when at most.
    note = rerun.stdout.split("GPUFLEET SUMMARY", 1)[1]
    assert "did not finish (this run took over its restart lock), so the host was most likely down" in note, note


def _signal_playbook_at(argv, env, pattern, signum=signal.SIGTERM, group=True, delay_s=0.0, limit_s=120):
    """Run ``argv`` (ansible-playbook) in its own session; when a line of its output matches ``pattern`` wait
    ``delay_s`` and send ``signum`` to its process group (``group``: as AWX's and a terminal's signals reach the
    workers too) or its main process. Returns (rc, output, seconds from the signal to its exit); fails when the line
    never came or it still ran ``limit_s`` after the signal."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen, hit = [], threading.Event()

    def read():
        for line in proc.stdout:
            seen.append(line)
            if re.search(pattern, line):
                hit.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert hit.wait(300), "".join(seen)[-3000:]
        time.sleep(delay_s)
        sent = time.monotonic()
        (os.killpg if group else os.kill)(proc.pid, signum)
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            hung = subprocess.run(["ps", "-s", str(proc.pid), "-L", "-o", "pid,ppid,tid,stat,wchan:24,etime,cmd"],
                                  capture_output=True, text=True).stdout
            raise AssertionError("ansible-playbook still ran %d s after the signal:\n%s\n%s"
                                 % (limit_s, hung, "".join(seen)[-3000:]))
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(30)
    return proc.returncode, "".join(seen), took


def _lock_owner(lab, host):
    state = lab.host_vars(host)["sglang_state_dir"]
    res = lab.exec(host, ["cat", os.path.join(state, "restart.lock", "owner.json")])
    return json.loads(res.stdout) if res.returncode == 0 else None


@pytest.mark.lab_only_once
def test_sigterm_on_ansible_playbook_after_the_stop_says_the_new_server_runs_unverified_and_the_lock_is_left(lab):
    # An AWX cancel arrives as SIGTERM (ansible/awx#12142): ansible-core exited at once, rc 143, no summary, the
    # lock left and the server the stop had started running unverified and unrecorded, said nowhere.
    host = lab.hosts[1]
    env = dict(os.environ, **lab._envvars())
    argv = [os.path.join(BIN, "ansible-playbook"), "-i", lab.inventory, os.path.join(ROOT, "playbooks", "restart.yml"),
            "-e", "target=%s" % host]
    if lab.wait_http(host, timeout_s=1) != 200:
        first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert first.returncode == 0, first.stdout[-3000:]
    before = server_pid(lab, host)
    lab.fault(host, slow_load_s=12)  # the new server the stop starts loads for 12 s: the cancel comes while it loads
    try:
        # the stop's line names the server it started; 2 s later the run is in the launch's readiness wait
        rc, out, took = _signal_playbook_at(argv, env, r"^  %s: \d+ process\(es\) stopped.*new server started by "
                                            r"the stop \(pid \d+\)" % re.escape(host), delay_s=2, limit_s=90)
    finally:
        lab.clear_faults(host)
    assert rc == 99, out[-3000:]  # ansible-playbook's "User interrupted execution", as on Ctrl-C
    assert took < 45, took  # stopped at once, or at worst by the 30 s bound on a blocked cleanup
    new = int(re.search(r"new server started by the stop \(pid (\d+)\)", out).group(1))
    summary = out.split("GPUFLEET SUMMARY (cancelled: SIGTERM)", 1)
    assert len(summary) == 2 and out.count("GPUFLEET SUMMARY") == 1, out[-3000:]
    note = " ".join(summary[1].split())
    assert re.search(r"%s: cancelled in (launch|verify): ansible-playbook was cancelled \(SIGTERM" % re.escape(host),
                     note), note
    assert "the new server (pid %d) was started but not verified and not recorded" % new in note, note
    assert re.search(r"%s\s+cancelled\s+down:" % re.escape(host), summary[1]), summary[1]
    # what the note says is what the host shows: the old server is gone, the new one runs (and serves once loaded)
    assert new != before and lab.exec(host, ["kill", "-0", str(new)]).returncode == 0
    assert lab.exec(host, ["kill", "-0", str(before)]).returncode != 0
    owner = _lock_owner(lab, host)
    assert owner is not None and "The restart lock (run %s) stays on the host" % owner["run_id"] in note, note
    assert "playbooks/unlock.yml -e target=%s" % host in note
    assert lab.wait_http(host, timeout_s=60) == 200
    # the advice, followed: a rerun from this controller takes the lock over at once and verifies a new server
    rerun = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert server_pid(lab, host) not in (None, before, new) and _lock_owner(lab, host) is None


@pytest.mark.lab_only_once
def test_sigterm_during_preflight_leaves_every_host_untouched_and_says_so(lab):
    hosts = lab.hosts[:2]
    env = dict(os.environ, **lab._envvars())
    argv = [os.path.join(BIN, "ansible-playbook"), "-i", lab.inventory, os.path.join(ROOT, "playbooks", "restart.yml"),
            "--limit", ",".join(hosts)]
    for host in hosts:
        if lab.wait_http(host, timeout_s=1) != 200:
            first = subprocess.run(argv[:-2] + ["-e", "target=%s" % host], cwd=ROOT, env=env, capture_output=True,
                                   text=True, timeout=600)
            assert first.returncode == 0, first.stdout[-3000:]
    before = {h: server_pid(lab, h) for h in hosts}
    # -v prints every task: the cancel comes as preflight's first task starts (preflight runs for seconds)
    rc, out, took = _signal_playbook_at(argv + ["-v"], env, r"^TASK \[sglang_preflight : ", limit_s=60)
    assert rc == 99 and took < 45, (took, out[-3000:])
    summary = " ".join(out.split("GPUFLEET SUMMARY (cancelled: SIGTERM)", 1)[1].split())
    for host in hosts:
        assert re.search(r"%s\b.*cancelled in preflight: nothing was changed on this host \(untouched\)"
                         % re.escape(host), summary) or "%s: not_started" % host in summary, summary
        assert server_pid(lab, host) == before[host] and lab.wait_http(host, timeout_s=5) == 200
        assert _lock_owner(lab, host) is None
