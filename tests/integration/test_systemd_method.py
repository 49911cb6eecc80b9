"""restart.yml with ``sglang_launch_method: systemd`` on lab hosts whose PID 1 is Debian's systemd (issue 13).

The ``systemd_lab`` hosts (tests/lab/systemd_host.py) are reached as the non-root login user ``gpufleet`` with
sudo; the unit runs as ``sglang``. The scenarios the process method has in test_restart/test_rollback/
test_preflight/test_api_key run here through a real systemd: happy path and second run, check mode, a crash
on start rolled back, an orphaned worker taken by the unit's cgroup, a foreign GPU holder refused in
preflight, the API key. Assertions read the host itself (``systemctl show``, /proc, the unit file, HTTP).
"""
import json
import os
import re
import secrets
import shlex
import time

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.lab_only_once]

PLAYBOOK = "playbooks/restart.yml"
GRACE_S = 10
FAST = {"sglang_stop_grace_s": GRACE_S, "sglang_launch_ready_slice_s": 5}
UNIT_PATH = "/etc/systemd/system/sglang.service"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB_TOOLS = os.path.join(ROOT, "tests", "lab")


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def main_pid(lab, host):
    return int(lab.unit_props(host, "MainPID")["MainPID"])


def proc_field(lab, host, pid, path):
    res = lab.exec(host, ["cat", "/proc/%d/%s" % (pid, path)])
    return res.stdout if res.returncode == 0 else None


def sglang_pids(lab, host):
    """Pids (host namespace) of every process whose argv[0] starts with sglang:: or runs sglang.launch_server."""
    res = lab.exec(host, ["ps", "-eo", "pid=,args="], check=True)
    pids = []
    for line in res.stdout.splitlines():
        pid, _, args = line.strip().partition(" ")
        if args.startswith("sglang::") or "sglang.launch_server" in args:
            pids.append(int(pid))
    return pids


def in_unit_cgroup(lab, host, pid):
    text = proc_field(lab, host, pid, "cgroup") or ""
    return "/system.slice/sglang.service" in text


def restart(lab, limit=None, **extra):
    return lab.run_playbook(PLAYBOOK, extravars=dict(FAST, **extra), limit=limit)


def ensure_serving(lab, host):
    props = lab.unit_props(host, "ActiveState", "MainPID")
    if props.get("ActiveState") != "active" or lab.wait_http(host, timeout_s=2) != 200:
        runner = restart(lab, limit=host)
        assert runner.status == "successful", stdout_of(runner)[-4000:]
    return main_pid(lab, host)


def test_restart_twice_as_login_user_unit_enabled_one_grace_workers_in_the_unit(systemd_lab):
    lab = systemd_lab
    assert lab.group_vars["ansible_user"] == "gpufleet" and lab.group_vars["sglang_launch_method"] == "systemd"
    who = lab.run_module("ansible.builtin.command", "id -u")
    assert {d["res"]["stdout"] for d in lab.events(who, "runner_on_ok")} == {"1001"}  # not root
    first = restart(lab)
    assert first.status == "successful", stdout_of(first)[-4000:]
    pids = {}
    for host in lab.hosts:
        props = lab.unit_props(host, "ActiveState", "MainPID", "User", "UnitFileState", "TimeoutStopUSec",
                               "Restart", "KillMode", "NRestarts")
        assert props["ActiveState"] == "active" and props["User"] == "sglang"
        assert props["UnitFileState"] == "enabled"  # sglang_launch_enable defaults to true
        assert props["TimeoutStopUSec"] == "%ds" % GRACE_S  # the one grace, sglang_stop_grace_s
        assert props["Restart"] == "on-failure" and props["KillMode"] == "control-group"
        pid = int(props["MainPID"])
        status = proc_field(lab, host, pid, "status")
        assert "\nUid:\t%s" % lab.exec(host, ["id", "-u", "sglang"]).stdout.strip() in status
        workers = sglang_pids(lab, host)
        assert len(workers) >= 10 and all(in_unit_cgroup(lab, host, w) for w in workers), workers
        assert lab.wait_http(host, timeout_s=5) == 200
        pids[host] = (pid, workers)
    second = restart(lab)
    assert second.status == "successful", stdout_of(second)[-4000:]
    summary = stdout_of(second).split("GPUFLEET SUMMARY", 1)[1].splitlines()
    for host in lab.hosts:
        old_pid, old_workers = pids[host]
        new_pid = main_pid(lab, host)
        assert new_pid not in (0, old_pid)
        assert not set(old_workers) & set(sglang_pids(lab, host))  # the old tree is gone, systemd stopped it
        journal = lab.exec(host, ["journalctl", "-u", "sglang", "--no-pager", "-o", "cat"]).stdout
        assert "Stopping sglang.service" in journal or "Stopped sglang.service" in journal
        [row] = [line.split() for line in summary if line.startswith(host + " ")]
        assert row[1] == "ok" and row[-2:] == [str(pids[host][0]), str(new_pid)]  # old_pid, new_pid


def test_check_mode_changes_nothing(systemd_lab):
    lab = systemd_lab
    host = lab.hosts[0]
    pid = ensure_serving(lab, host)
    unit_before = lab.exec(host, ["sha256sum", UNIT_PATH], check=True).stdout
    runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, check=True)
    assert runner.status == "successful", stdout_of(runner)[-4000:]
    assert main_pid(lab, host) == pid
    assert lab.exec(host, ["sha256sum", UNIT_PATH], check=True).stdout == unit_before
    assert lab.wait_http(host, timeout_s=5) == 200


def test_crash_on_start_rolls_back_through_systemd_with_journal_lines_and_no_restart_fight(systemd_lab):
    lab = systemd_lab
    host = lab.hosts[0]
    old_pid = ensure_serving(lab, host)
    args = dict(lab.host_vars(host)["sglang_launch_args"], **{"max-running-requests": 77})
    # The flag's name, not its value: crash_with_arg matches any argv element holding the text, and the lab's
    # paths hold the pytest pid and its addresses a random octet ("77" in either crashed the rollback too).
    lab.fault(host, crash_with_arg="--max-running-requests")
    try:
        runner = restart(lab, limit=host, sglang_launch_args=args)
    finally:
        lab.clear_faults(host)
    out = stdout_of(runner)
    assert runner.status == "failed"
    assert "Journal of sglang.service" in out, out[-4000:]
    new_pid = main_pid(lab, host)
    assert new_pid not in (0, old_pid), out[-4000:]
    argv = proc_field(lab, host, new_pid, "cmdline").replace("\0", " ")
    assert "--max-running-requests" not in argv  # the previous launch came back, not the crashing one
    assert lab.wait_http(host, timeout_s=30) == 200
    props = lab.unit_props(host, "ActiveState", "NRestarts", "Restart")
    # Restart=on-failure never restarted the crashing server: rollback's stop cancelled the pending restart
    assert props["ActiveState"] == "active" and props["NRestarts"] == "0"
    time.sleep(2)
    assert main_pid(lab, host) == new_pid


def test_a_crash_loop_through_restart_sec_0_is_ended_by_the_rollback_and_the_message_invents_no_exit_status(
        systemd_lab):
    # RestartSec=0 and a fast crash: systemd runs the crashing configuration again and again while the launch
    # waits, toward StartLimitBurst= (after which it refuses starts until reset-failed, which the rollback runs).
    # The launched pid is gone and its unit already runs another process when the wait looks: the message said
    # "exited with status 0 0.0 s after it started" (the later process's ExecMainStatus).
    lab = systemd_lab
    host = lab.hosts[0]
    old_pid = ensure_serving(lab, host)
    args = dict(lab.host_vars(host)["sglang_launch_args"], **{"max-running-requests": 78})
    lab.fault(host, crash_with_arg="--max-running-requests", slow_load_s=0.1)
    try:
        runner = restart(lab, limit=host, sglang_launch_args=args, sglang_launch_systemd_restart_sec=0)
    finally:
        lab.clear_faults(host)
    out = stdout_of(runner)
    assert runner.status == "failed"
    journal = lab.exec(host, ["journalctl", "-u", "sglang", "--no-pager", "-o", "cat"]).stdout
    assert "Scheduled restart job" in journal, journal[-3000:]  # the crash loop happened
    new_pid = main_pid(lab, host)
    assert new_pid not in (0, old_pid), out[-6000:]
    argv = proc_field(lab, host, new_pid, "cmdline").replace("\0", " ")
    assert "--max-running-requests" not in argv
    assert lab.wait_http(host, timeout_s=30) == 200
    [row] = [line for line in out.split("GPUFLEET SUMMARY", 1)[1].splitlines() if line.startswith(host + ": ")]
    assert "rolled_back in launch" in row and "exited with status 0" not in row and " 0.0 s after" not in row, row
    # The relaunched previous unit has the previous RestartSec= back, not the crashing run's 0.
    assert lab.unit_props(host, "RestartUSec")["RestartUSec"] != "0"


def test_orphaned_worker_is_taken_by_the_units_cgroup(systemd_lab):
    lab = systemd_lab
    host = lab.hosts[-1]
    ensure_serving(lab, host)
    # The worker escapes while the server runs (it was started, say, by Restart=on-failure between runs):
    # restart the unit by hand with the knob on. restart.yml itself would refuse such a server in verify.
    lab.fault(host, orphan_worker=True)
    try:
        assert lab.systemctl(host, "restart", "sglang.service").returncode == 0
        assert lab.wait_http(host, timeout_s=60) == 200
    finally:
        lab.clear_faults(host)
    orphans = [p for p in sglang_pids(lab, host)
               if (proc_field(lab, host, p, "stat") or ") ? 0").split(") ", 1)[1].split()[1] == "1"
               and "scheduler_TP" in (proc_field(lab, host, p, "cmdline") or "")]
    assert orphans, "the orphan_worker knob left no worker re-parented to PID 1"
    assert all(in_unit_cgroup(lab, host, p) for p in orphans)
    runner = restart(lab, limit=host)
    assert runner.status == "successful", stdout_of(runner)[-4000:]
    assert not set(orphans) & set(sglang_pids(lab, host))  # KillMode=control-group took it with the unit
    assert lab.wait_http(host, timeout_s=5) == 200


HOLDER = ("import os, sys, time\n"
          "sys.path.insert(0, sys.argv[3])\n"
          "import gpusim\n"
          "fd = os.open('/dev/nvidia%d' % int(sys.argv[1]), os.O_RDWR)\n"
          "sock = gpusim.hold(int(sys.argv[1]), int(sys.argv[2]))\n"
          "time.sleep(600)\n")


def test_foreign_gpu_holder_is_refused_in_preflight_and_the_unit_keeps_serving(systemd_lab):
    lab = systemd_lab
    host = lab.hosts[-1]
    pid = ensure_serving(lab, host)
    python = lab.host_vars(host)["sglang_python"]
    script = "setsid %s -c %s 3 20000 %s </dev/null >/dev/null 2>&1 & echo $!" % (
        python, shlex.quote(HOLDER), shlex.quote(LAB_TOOLS))
    holder = int(lab.exec(host, ["sh", "-c", script], check=True).stdout.split()[-1])
    try:
        deadline = time.time() + 10
        while holder not in [a["pid"] for a in lab.gpus(host)[3]["apps"]]:
            assert time.time() < deadline, "holder did not register"
            time.sleep(0.1)
        runner = restart(lab, limit=host)
        out = stdout_of(runner)
        assert runner.status == "failed"
        assert "pid %d (user root) holds 20000 MiB on GPU 3" % holder in out, out[-4000:]
        assert main_pid(lab, host) == pid and lab.wait_http(host, timeout_s=5) == 200
    finally:
        lab.exec(host, ["kill", "-KILL", str(holder)])


def where_held(root, text):
    """For a failure message: per file under ``root`` holding ``text``, the task and the bytes around it (``text``
    shown as <KEY>)."""
    out = []
    for rel in files_holding(root, text):
        with open(os.path.join(root, rel), "rb") as handle:
            data = handle.read().decode("utf-8", "replace")
        at = data.index(text)
        task = re.search(r'"task": "([^"]*)"', data)
        out.append("%s [%s]: ...%s..." % (rel, task.group(1) if task else "?",
                                          data[max(0, at - 300):at + len(text) + 100].replace(text, "<KEY>")))
    return "\n".join(out)


def files_holding(root, text):
    """Every file under ``root`` (controller side) whose bytes hold ``text``."""
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as handle:
                if text.encode() in handle.read():
                    found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def test_api_key_lives_in_a_root_only_file_never_in_the_unit_and_the_server_demands_it(systemd_lab, tmp_path):
    # Issue 31 too: a keyed restart over the keyed server (-vvv), check.yml and a failed keyed launch rolled back
    # leave the key in no artifact, report or file of the state dir but the root-only key file and the 0640 log.
    lab = systemd_lab
    host = lab.hosts[0]
    key = "sk-systemd-lab-" + secrets.token_hex(16)
    state = lab.host_vars(host)["sglang_state_dir"]
    log, key_file = state + "/sglang.log", state + "/sglang-api-key.env"
    runner = restart(lab, limit=host, sglang_api_key=key)
    runners = [runner]
    try:
        out = stdout_of(runner)
        assert runner.status == "successful", out[-4000:]
        assert key not in out
        unit = lab.exec(host, ["cat", UNIT_PATH], check=True).stdout
        assert key not in unit and "EnvironmentFile=%s" % key_file in unit
        st = lab.exec(host, ["stat", "-c", "%a %U", key_file], check=True).stdout.split()
        assert st == ["600", "root"]
        # systemd creates the log under UMask=0027 (root:root 0640: it opens append: before dropping to User=).
        assert lab.unit_props(host, "UMask")["UMask"] == "0027"
        code = ("import urllib.request, urllib.error, sys\n"
                "req = urllib.request.Request('http://%s:30000/v1/models', headers=dict(sys.argv[1:2] and "
                "[('Authorization', 'Bearer ' + sys.argv[1])]))\n"
                "try:\n    print(urllib.request.urlopen(req, timeout=5).status)\n"
                "except urllib.error.HTTPError as e:\n    print(e.code)\n") % lab.host_vars(host).get("sglang_host", "127.0.0.1")
        python = lab.host_vars(host)["sglang_python"]
        assert lab.exec(host, [python, "-c", code]).stdout.strip() == "401"
        assert lab.exec(host, [python, "-c", code, key]).stdout.strip() == "200"
        # A log an earlier release left world-readable is tightened before the next start.
        lab.exec(host, ["chmod", "0644", log], check=True)
        again = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_api_key=key), limit=host, cmdline="-vvv")
        assert again.status == "successful", stdout_of(again)[-4000:]
        runners.append(again)
        listeners = [d["res"]["host"]["port"]["listeners"]
                     for d in lab.events(again, "runner_on_ok", "sglang_preflight_info")
                     if ((d.get("res") or {}).get("host") or {}).get("port")]
        assert listeners and "--api-key ********" in json.dumps(listeners), listeners  # read, redacted
        report = tmp_path / "report"
        check = lab.run_playbook("playbooks/check.yml", limit=host, extravars={
            "gpufleet_report_dir": str(report), "gpufleet_textfile_dir": "{{ lab_host_dir }}/textfile"})
        assert check.status == "successful", stdout_of(check)[-4000:]
        runners.append(check)
        args = dict(lab.host_vars(host)["sglang_launch_args"], **{"max-running-requests": 77})
        lab.fault(host, crash_with_arg="--max-running-requests")
        try:
            failed = restart(lab, limit=host, sglang_api_key=key, sglang_launch_args=args)
        finally:
            lab.clear_faults(host)
        assert failed.status == "failed" and "Journal of sglang.service" in stdout_of(failed)
        runners.append(failed)
        # Rolled back: the previous keyed server serves again.
        assert lab.wait_http(host, timeout_s=30) == 200
        assert lab.exec(host, [python, "-c", code, key]).stdout.strip() == "200"
        for run in runners:
            assert files_holding(run.config.artifact_dir, key) == [], where_held(run.config.artifact_dir, key)
        assert files_holding(str(report), key) == []
        held = lab.exec(host, ["grep", "-rlF", "--", key, state, lab.host_vars(host)["lab_host_dir"] + "/textfile"])
        assert sorted(held.stdout.split()) == sorted([key_file, log])  # SGLang logs server_args with the key
        assert key not in lab.exec(host, ["journalctl", "--no-pager", "-o", "cat"]).stdout
        modes = {p: lab.exec(host, ["stat", "-c", "%a", state + "/" + p], check=True).stdout.strip()
                 for p in ("sglang.log", "launch.json")}
        assert modes == {"sglang.log": "640", "launch.json": "640"}, modes
    finally:
        back = restart(lab, limit=host)  # without the key: the file goes, the server takes no key
        assert back.status == "successful", stdout_of(back)[-4000:]
    assert lab.exec(host, ["test", "-e", key_file]).returncode == 1


def test_root_login_runs_no_sudo_and_the_unit_still_runs_as_the_service_user(systemd_lab):
    lab = systemd_lab
    host = lab.hosts[-1]
    old_pid = ensure_serving(lab, host)

    def sudo_lines():
        res = lab.exec(host, ["journalctl", "_COMM=sudo", "--no-pager", "-o", "cat"], check=True)
        return [line for line in res.stdout.splitlines() if line.strip()]

    before = sudo_lines()
    assert before, "the login user's runs used sudo (the journal shows none: is journald logging?)"
    runner = restart(lab, limit=host, ansible_user="root")
    assert runner.status == "successful", stdout_of(runner)[-4000:]
    assert sudo_lines() == before  # sglang_launch_become, sglang_stop_become, ... are all false for root
    props = lab.unit_props(host, "ActiveState", "MainPID", "User")
    assert props["ActiveState"] == "active" and props["User"] == "sglang" and int(props["MainPID"]) != old_pid
    # check.yml as the same non-root login user, no -e fleet_check_become: the default follows the launch method
    # (systemd + non-root login -> become), so the sglang user's worker environments are read, not reported missing.
    check = lab.run_playbook("playbooks/check.yml", extravars={})
    verdicts = {}
    for ev in check.events:
        if ev.get("event") == "playbook_on_stats":
            verdicts = ((ev.get("event_data") or {}).get("artifact_data") or {}).get("gpufleet_check") or {}
    assert set(verdicts) == set(lab.hosts), stdout_of(check)[-3000:]
    for host in lab.hosts:
        codes = {r["code"] for r in verdicts[host]["reasons"]}
        assert not codes & {"nccl_worker_env", "nccl_check_failed", "not_serving"}, verdicts[host]


TITLED = "import sys, time, setproctitle\nsetproctitle.setproctitle(sys.argv[1])\ntime.sleep(600)\n"


def spawn_as_service_user(lab, host, title):
    """A detached process of the unit's user ``sglang`` titled ``title`` (setproctitle, as SGLang and the routers
    title themselves), started from outside the unit (lab exec): not in the unit's cgroup, as a router started
    separately is not."""
    script = "setsid setpriv --reuid=sglang --regid=sglang --clear-groups %s -c %s %s </dev/null >/dev/null 2>&1 " \
             "& echo $!" % (shlex.quote(lab.host_vars(host)["sglang_python"]), shlex.quote(TITLED), shlex.quote(title))
    pid = int(lab.exec(host, ["sh", "-c", script], check=True).stdout.split()[-1])
    deadline = time.time() + 10
    while not (proc_field(lab, host, pid, "cmdline") or "").startswith(title):
        assert time.time() < deadline, "%s did not start" % title
        time.sleep(0.1)
    return pid


def test_a_router_and_a_bench_client_of_the_service_user_survive_a_restart_while_a_leftover_does_not(systemd_lab):
    """Issue 30 under systemd: the stop ends what the unit's cgroup leaves of the service user's SGLang processes
    (users: [sglang]); a router (sglang::router) and a client (-m sglang.bench_serving) of that same user, started
    outside the unit, are kept and named, while a stray scheduler of that user is still ended."""
    lab = systemd_lab
    host = lab.hosts[0]
    ensure_serving(lab, host)
    router = spawn_as_service_user(lab, host, "sglang::router")
    client = spawn_as_service_user(lab, host, "python3 -m sglang.bench_serving --backend sglang --num-prompts 900")
    leftover = spawn_as_service_user(lab, host, "sglang::scheduler_TP5")
    uid = lab.exec(host, ["id", "-u", "sglang"], check=True).stdout.strip()
    try:
        for pid in (router, client, leftover):
            assert "\nUid:\t%s" % uid in proc_field(lab, host, pid, "status") and not in_unit_cgroup(lab, host, pid)
        starts = {pid: proc_field(lab, host, pid, "stat").split(") ", 1)[1].split()[19] for pid in (router, client)}
        # sglang_stop in check mode, as preflight and the stop role call it here (users: the service user, root)
        dry = lab.run_module("sglang_stop", {"users": "sglang", "remove_stale_shm": False}, hosts=host,
                             extravars={"ansible_become": True}, check=True)
        assert dry.status == "successful", stdout_of(dry)[-4000:]
        [res] = [d["res"] for d in lab.events(dry, "runner_on_ok") if d["host"] == host]
        would = {e["pid"]: e for e in res["signalled"]}
        assert would[leftover]["reason"] == "pattern" and would[leftover]["ended"] == "would signal", would
        assert router not in would and client not in would, sorted(would)
        assert sorted((k["pid"], k["kind"]) for k in res["kept"]) == sorted([(router, "router"), (client, "client")])

        runner = restart(lab, limit=host)
        assert runner.status == "successful", stdout_of(runner)[-4000:]
        ended = {e["pid"] for d in lab.events(runner, "runner_on_ok", "sglang_stop") if d["host"] == host
                 for e in d["res"].get("signalled", []) if e.get("ended") != "would signal"}
        assert leftover in ended and not {router, client} & ended, ended
        for pid in (router, client):
            stat = proc_field(lab, host, pid, "stat")
            assert stat and stat.split(") ", 1)[1].split()[19] == starts[pid], pid
        assert proc_field(lab, host, leftover, "stat") is None
        assert lab.wait_http(host, timeout_s=5) == 200
    finally:
        lab.exec(host, ["kill", "-KILL", str(router), str(client), str(leftover)])


# issue 31: trust no state file, and root runs no code another user can write.

def state_dir(lab, host):
    return lab.host_vars(host)["sglang_state_dir"]


def file_sha(lab, host, path):
    return lab.exec(host, ["sha256sum", path], check=True).stdout.split()[0]


def engine_file(lab, host):
    python = lab.host_vars(host)["sglang_python"]
    return "%s/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py" % python.rsplit("/bin/", 1)[0]


def state_lines(lab, runner, host):
    [said] = [d for d in lab.events(runner, "runner_on_ok", "debug")
              if d["host"] == host and d["task"] == "Say what state the host is in"]
    return " ".join(said["res"]["msg"])


def write_as_root(lab, host, path, text, mode="600"):
    lab.exec(host, ["sh", "-c", 'cat > "$1" && chmod "$2" "$1"', "sh", path, mode], input=text, check=True)


def test_a_tampered_or_malformed_launch_record_is_never_run_and_engine_py_still_goes_back(systemd_lab):
    """Two failed restarts (lab fault crash_on_start): the first against a record whose unit carries an injected
    ExecStartPre=+ line, the second (the host down since the first) against a record cut in half."""
    lab = systemd_lab
    host = lab.hosts[0]
    ensure_serving(lab, host)
    record_file = "%s/launch.json" % state_dir(lab, host)
    good = lab.exec(host, ["cat", record_file], check=True).stdout
    marker = "/tmp/gpufleet-pwned-%d" % os.getpid()
    injected = json.loads(good)
    injected["unit_text"] = injected["unit_text"].replace(
        "[Service]\n", "[Service]\nExecStartPre=+/bin/sh -c 'id > %s'\n" % marker)
    cases = [(json.dumps(injected), "ExecStartPre is not a directive gpufleet writes in [Service]"),
             (good[:len(good) // 2], "not valid JSON")]
    try:
        for bad, why in cases:
            lab.exec(host, ["rm", "-f", marker])
            before_sha = file_sha(lab, host, engine_file(lab, host))
            write_as_root(lab, host, record_file, bad)
            # A value no earlier run left in engine.py: the patch writes, so the rollback has bytes to put back.
            env = dict(lab.group_vars["sglang_nccl_env"], NCCL_DEBUG_SUBSYS="INIT,%d" % time.time_ns())
            lab.fault(host, crash_on_start=True)
            try:
                runner = restart(lab, limit=host, sglang_nccl_env=env)
            finally:
                lab.clear_faults(host)
            assert runner.status == "failed"
            said = state_lines(lab, runner, host)
            assert "Rollback: file_only" in said, said
            assert ("the previous server was not relaunched: the launch record %s was refused (" % record_file) in said
            assert why in said and "remove or fix that file" in said and "The host is not serving" in said, said
            assert "engine.py restored" in said, said
            assert file_sha(lab, host, engine_file(lab, host)) == before_sha  # the patch's bytes went back
            assert lab.exec(host, ["test", "-e", marker]).returncode == 1  # the injected command never ran
            assert "ExecStartPre" not in lab.exec(host, ["cat", UNIT_PATH], check=True).stdout
            assert lab.unit_props(host, "ActiveState")["ActiveState"] != "active"
            assert "from_json" not in stdout_of(runner)
    finally:
        write_as_root(lab, host, record_file, good)
        lab.exec(host, ["rm", "-f", marker])
    ensure_serving(lab, host)


def test_a_launch_record_the_service_user_owns_is_refused_in_preflight_naming_file_owner_and_mode(systemd_lab):
    lab = systemd_lab
    host = lab.hosts[-1]
    pid = ensure_serving(lab, host)
    # The record root's rollback relaunches from, and the bytes it copies back over engine.py.
    prev_dir = "%s/nccl-patch-prev" % state_dir(lab, host)
    lab.exec(host, ["mkdir", "-p", prev_dir], check=True)
    for variable, path in (("sglang_launch_record_file", "%s/launch.json" % state_dir(lab, host)),
                           ("sglang_nccl_patch_previous_dir", prev_dir)):
        lab.exec(host, ["chown", "sglang", path], check=True)
        try:
            runner = restart(lab, limit=host)
            out = stdout_of(runner)
            assert runner.status == "failed"
            mode = lab.exec(host, ["stat", "-c", "%04a", path], check=True).stdout.strip()
            assert ("%s %s cannot be trusted: %s (owner sglang, mode %s) belongs to another user"
                    % (variable, path, path, mode)) in out, out[-4000:]
            assert "chown it to root and chmod go-w" in out
            assert main_pid(lab, host) == pid and lab.wait_http(host, timeout_s=5) == 200
        finally:
            lab.exec(host, ["chown", "root", path], check=True)


def test_a_venv_site_packages_the_service_user_owns_is_refused_before_root_runs_it(systemd_lab):
    lab = systemd_lab
    host = lab.hosts[-1]
    pid = ensure_serving(lab, host)
    python = lab.host_vars(host)["sglang_python"]
    site = "%s/lib/python3.11/site-packages" % python.rsplit("/bin/", 1)[0]
    marker = "%s/pth-ran-as-root" % state_dir(lab, host)
    pth = "%s/zz-gpufleet-test.pth" % site
    lab.exec(host, ["rm", "-f", marker])
    owner = lab.exec(host, ["stat", "-c", "%U", site], check=True).stdout.strip()
    assert owner == "root"  # the lab's venv belongs to root, as an installed SGLang does
    # What the service user could drop there once it owns the directory: a line site.py runs at every start.
    lab.exec(host, ["sh", "-c", 'printf "%s\\n" "$2" > "$1"', "sh", pth,
                    "import os; os.geteuid() == 0 and open(%r, 'w').write('root')" % marker], check=True)
    lab.exec(host, ["chown", "sglang", site, pth], check=True)
    try:
        runner = restart(lab, limit=host)
        out = stdout_of(runner)
        assert runner.status == "failed"
        assert ("ansible_python_interpreter %s runs as root, but %s (owner sglang, mode" % (python, site)) in out, \
            out[-4000:]
        assert "a .pth file or module another user puts there would run as root" in out
        # Before wait_http: the lab's own probe runs the venv's interpreter as root.
        assert lab.exec(host, ["test", "-e", marker]).returncode == 1  # root never ran the venv's interpreter
        assert main_pid(lab, host) == pid
        # patch.yml (sglang_nccl_patch_become) and check.yml (fleet_check_become) run no preflight: their roles
        # judge the interpreter themselves before root runs it.
        patch = lab.run_playbook("playbooks/patch.yml", limit=host)
        out = stdout_of(patch)
        assert patch.status == "failed" and "Nothing was patched." in out, out[-4000:]
        assert ("ansible_python_interpreter %s runs as root, but %s (owner sglang" % (python, site)) in out
        check = lab.run_playbook("playbooks/check.yml", limit=host)
        out = stdout_of(check)
        assert "CRIT: not checked with become: ansible_python_interpreter %s runs as root" % python in out, \
            out[-4000:]
        assert check.status == "failed"  # gpufleet_check_fail_on=crit
        assert lab.exec(host, ["test", "-e", marker]).returncode == 1
        assert main_pid(lab, host) == pid
    finally:
        lab.exec(host, ["rm", "-f", pth])
        lab.exec(host, ["chown", "root", site], check=True)
        lab.exec(host, ["rm", "-f", marker])
    assert lab.wait_http(host, timeout_s=5) == 200


PWNED = 'ExecStartPre=+/bin/sh -c "id > /tmp/pwned"'


def test_values_that_would_become_unit_directives_are_refused_before_any_host_is_touched(systemd_lab):
    """Issue 31: -e sglang_service_user with a line break became an ExecStartPre=+ that systemd ran as root. The
    command-line guard refuses it (and a newline in sglang_state_dir or sglang_host, a path with '..') naming the
    variable, with the value escaped, under --check --diff too, before any host is touched; preflight alone refuses
    it as well (the role on its own is safe)."""
    lab = systemd_lab
    host = lab.hosts[0]
    state = lab.host_vars(host)["sglang_state_dir"]
    lab.exec(host, ["rm", "-f", "/tmp/pwned"], check=True)
    pid = ensure_serving(lab, host)
    unit_before = lab.exec(host, ["cat", UNIT_PATH], check=True).stdout
    cases = [  # (extra vars, check mode, what the refusal shows)
        ({"sglang_service_user": "sglang\n" + PWNED}, False, "sglang_service_user='sglang\\n" + PWNED + "'"),
        ({"sglang_service_user": "sglang\n" + PWNED}, True, "sglang_service_user='sglang\\n" + PWNED + "'"),
        # A long lab path is cut in the message, the line break kept in view.
        ({"sglang_state_dir": state + "\n" + PWNED}, False, "state\\nExecStartPre="),
        ({"sglang_host": "0.0.0.0\n[Service]\n" + PWNED}, True, "sglang_host='0.0.0.0\\n[Service]\\nExecStartPre="),
        ({"sglang_launch_log_file": state + "/../../../tmp/pwned"}, False,
         "/../../../tmp/pwned' is not a normalised path"),
    ]
    for extra, check, shown in cases:
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, **extra), limit=host, check=check, diff=check)
        out = stdout_of(runner)
        assert runner.status == "failed", out[-3000:]
        name = list(extra)[0]
        assert shown in out and ("%s='" % name) in out and "refused" in out and "Nothing was changed." in out, \
            out[-3000:]
        # Only the command-line play ran (controller-only tasks): no task reached the host, no diff was shown.
        plays = {(e.get("event_data") or {}).get("play", "") for e in runner.events if e.get("event") == "runner_on_ok"}
        assert plays and all(p.startswith("Check the command line") for p in plays), plays
        # The line break is shown escaped, never raw: no output line starts with the injected directive.
        assert not [line for line in out.splitlines() if line.lstrip().startswith(("ExecStartPre", "[Service]"))]
        assert "--- before" not in out
    # The role alone (no guard): preflight's variable check refuses it the same way, before its first host task.
    alone = lab.run_module("ansible.builtin.include_role", "name=sglang_preflight tasks_from=variables",
                           hosts=host, extravars={"sglang_service_user": "sglang\n" + PWNED})
    [failed] = lab.events(alone, "runner_on_failed")
    assert "sglang_service_user='sglang\\n" + PWNED + "' holds a control character (\\n): refused" in " ".join(failed["res"]["msg"])
    # The host: the same unit file, the same server serving, nothing ran as root.
    assert lab.exec(host, ["cat", UNIT_PATH], check=True).stdout == unit_before
    assert main_pid(lab, host) == pid and lab.wait_http(host, timeout_s=5) == 200
    assert lab.exec(host, ["test", "-e", "/tmp/pwned"]).returncode == 1


def test_the_unit_filters_are_read_back_by_systemd_as_written(systemd_lab):
    """systemd_value/systemd_path (plugins/filter/gpufleet.py) against the host's real systemd: a throwaway unit
    with %, $, quotes and a backslash in Description=, specifier-looking paths in WorkingDirectory=,
    EnvironmentFile= and StandardOutput=append:, control bytes in Environment= and ExecStart= reads back
    (systemctl show, the file echo wrote) exactly as given."""
    from plugins.filter import gpufleet as f
    lab = systemd_lab
    host = lab.hosts[-1]
    name, base = "gpufleet-roundtrip.service", "/tmp/gpufleet-rt-%n$x"
    values = {"Description": "SGLang 100% $HOME %n 'q' \"d\" a\\b", "WorkingDirectory": base,
              "EnvironmentFile": base + "/k%i.env", "StandardOutput": base + "/out%H.log"}
    text = ("[Unit]\nDescription=%s\n[Service]\nType=oneshot\nUser=%s\nWorkingDirectory=%s\nEnvironmentFile=%s\n"
            "StandardOutput=append:%s\nEnvironment=%s\nExecStart=/bin/echo %s\n" % (
                f.systemd_value(values["Description"], "Description"), f.systemd_value("sglang", "User", "user"),
                f.systemd_path(values["WorkingDirectory"], "w"), f.systemd_path(values["EnvironmentFile"], "e"),
                f.systemd_path(values["StandardOutput"], "s"), f.systemd_env_assignment("a\x1bb\x7f%n", "X"),
                f.systemd_quote("wri\x1btten")))
    assert not [c for c in text if ord(c) < 0x20 and c != "\n"]  # control bytes only as escapes
    lab.exec(host, ["sh", "-c", 'mkdir -p "$1" && touch "$1/k%i.env" && chmod 0777 "$1"', "sh", base], check=True)
    lab.exec(host, ["sh", "-c", 'cat > "/etc/systemd/system/$1"', "sh", name], input=text, check=True)
    try:
        lab.systemctl(host, "daemon-reload")
        props = lab.unit_props(host, "Description", "User", "WorkingDirectory", "EnvironmentFiles", "Environment",
                               unit=name)
        assert props["Description"] == values["Description"] and props["User"] == "sglang"
        assert props["WorkingDirectory"] == base
        assert props["EnvironmentFiles"] == values["EnvironmentFile"] + " (ignore_errors=no)"
        assert props["Environment"] == '"X=a\\033b\\177%n"'  # systemctl shows the real bytes in octal
        assert lab.systemctl(host, "start", name).returncode == 0
        assert lab.exec(host, ["cat", values["StandardOutput"]], check=True).stdout == "wri\x1btten\n"
    finally:
        lab.exec(host, ["rm", "-rf", "/etc/systemd/system/" + name, base])
        lab.systemctl(host, "daemon-reload")
