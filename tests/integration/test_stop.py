"""sglang_stop (role and module) on the lab fleet over real SSH: what is signalled and what never is.

Each lab host runs a monitor (an nvidia-persistenced stand-in holding /dev/nvidiactl and /dev/nvidia0) that must
never be signalled. These tests add an SGLang-titled process of another user, a live process holding an
NCCL-named segment, stale segments, an orphaned worker (re-parented to the host's PID 1) and workers that
ignore SIGTERM, then run restart.yml's stop phase and look at the host afterwards. Issue 10's findings: a
defunct worker whose thread holds GPU memory (5), an orphan keeping multiprocessing's resource tracker alive
(6), root's grep/pgrep watching SGLang (7), and progress lines during a long grace.
"""
import json
import re
import time

import pytest

pytestmark = pytest.mark.lab

PLAYBOOK = "playbooks/restart.yml"
FAST = {"sglang_launch_ready_delay_s": 1, "sglang_stop_grace_s": 3}
SPAWN = ("import os, sys, time, setproctitle\n"
         "setproctitle.setproctitle(sys.argv[1])\n"
         "if len(sys.argv) > 2: fh = open(sys.argv[2], 'wb'); fh.write(b'x'); fh.flush()\n"
         "time.sleep(600)\n")
PS = ("import json, os\n"
      "out = {}\n"
      "for p in filter(str.isdigit, os.listdir('/proc')):\n"
      "    try:\n"
      "        st = open('/proc/%s/stat' % p).read().rsplit(') ', 1)[1].split()\n"
      "        if st[0] in 'ZX': continue\n"
      "        out[p] = {'cmd': open('/proc/%s/cmdline' % p, 'rb').read().replace(b'\\0', b' ').decode('utf-8', 'replace').strip(),\n"
      "                  'uid': os.stat('/proc/%s' % p).st_uid, 'start': st[19]}\n"
      "    except (OSError, IndexError): pass\n"
      "print(json.dumps(out))\n")


DEFUNCT = ("import json, os\n"
           "out = []\n"
           "for p in filter(str.isdigit, os.listdir('/proc')):\n"
           "    try:\n"
           "        st = open('/proc/%s/stat' % p).read().rsplit(') ', 1)[1].split()\n"
           "        if st[0] != 'Z': continue\n"
           "        live = []\n"
           "        for t in os.listdir('/proc/%s/task' % p):\n"
           "            if open('/proc/%s/task/%s/stat' % (p, t)).read().rsplit(') ', 1)[1].split()[0] not in 'ZXx':\n"
           "                live.append(open('/proc/%s/task/%s/cmdline' % (p, t), 'rb').read().split(b'\\0')[0].decode())\n"
           "        out.append({'pid': int(p), 'start': st[19], 'threads': live})\n"
           "    except (OSError, IndexError): pass\n"
           "print(json.dumps(out))\n")
# SGLang's own clean-up pattern, searched in the whole command line: what the stop used before issue 10.
OLD_SUBSTRING_PATTERN = r"sglang::|sglang\.launch_server|sglang\.bench|sglang\.data_parallel|sglang\.srt"


def defunct(lab, host):
    """[{pid, start, threads: [title of each live thread]}] of the host's defunct (state Z) processes."""
    res = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", DEFUNCT], check=True)
    return json.loads(res.stdout)


def procs(lab, host):
    """{pid: {cmd, uid, start}} of live processes on the host."""
    res = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", PS], check=True)
    return {int(k): v for k, v in json.loads(res.stdout).items()}


def spawn(lab, host, title, user=None, hold=None):
    """Start a detached process titled ``title`` on the host (as ``user`` if given); returns its pid."""
    if user:
        # Another user cannot run the lab's interpreter (it lives under root's 0700 home, and pyenv's 3.12
        # loads libpython from there): title a plain `sleep` through argv[0] instead of setproctitle.
        argv = ["bash", "-c", 'exec -a "$0" sleep 600', title]
        prefix = ["setpriv", "--reuid=%s" % user, "--regid=%s" % user, "--clear-groups"]
    else:
        argv = [lab.host_vars(host)["sglang_python"], "-c", SPAWN, title] + ([hold] if hold else [])
        prefix = []
    script = " ".join("'%s'" % a.replace("'", "'\\''") for a in prefix + argv)
    res = lab.exec(host, ["sh", "-c", "setsid %s </dev/null >/dev/null 2>&1 & echo $!" % script], check=True)
    pid = int(res.stdout.split()[-1])
    deadline = time.time() + 10
    while time.time() < deadline:
        if procs(lab, host).get(pid, {}).get("cmd", "").startswith(title):
            return pid
        time.sleep(0.1)
    raise AssertionError("%s did not start on %s" % (title, host))


def kill(lab, host, *pids):
    for pid in pids:
        lab.exec(host, ["kill", "-9", str(pid)])


def stop_results(lab, runner):
    return {d["host"]: d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_stop")}


def launch(lab, host):
    runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop,launch")
    assert runner.status == "successful", open(runner.stdout.name).read()[-3000:]
    return int(lab.exec(host, ["cat", "%s/sglang.pid" % lab.host_vars(host)["sglang_state_dir"]]).stdout)


@pytest.mark.lab_only_once
def test_stop_kills_orphans_and_sigterm_ignoring_workers_but_never_monitor_or_other_users(lab):
    host = lab.hosts[1]
    lab.fault(host, orphan_worker=7, worker_ignores_sigterm=True)
    other = holder = None
    try:
        server = launch(lab, host)
        before = procs(lab, host)
        orphan = [p for p, v in before.items() if v["cmd"] == "sglang::scheduler_TP7"]
        assert orphan, "the lab did not make an orphan worker"
        assert all(lab.exec(host, ["cat", "/proc/%d/stat" % p]).stdout.rsplit(") ", 1)[1].split()[1] == "1"
                   for p in orphan), "orphan is not re-parented to PID 1"
        monitor = [p for p, v in before.items() if "nvidia-persistenced" in v["cmd"]]
        assert monitor
        other = spawn(lab, host, "sglang::scheduler_TP0 (another user's job)", user="65534")
        holder = spawn(lab, host, "training-job-holding-nccl-shm", hold="/dev/shm/nccl-live-holder")
        lab.fault(host, stale_shm=True)
        time.sleep(0.5)

        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop")
        assert runner.status == "successful", open(runner.stdout.name).read()[-3000:]
        res = stop_results(lab, runner)[host]
        by_pid = {e["pid"]: e for e in res["signalled"]}
        assert by_pid[server]["reason"] == "pid_file"
        for pid in orphan:
            assert by_pid[pid]["reason"] == "pattern"
            assert by_pid[pid]["signals"] == ["SIGTERM", "SIGKILL"] and by_pid[pid]["ended"] == "after SIGKILL"
        never = set(monitor) | {other, holder}
        assert not never & set(by_pid), "signalled a process it must never touch"

        after = procs(lab, host)
        for pid in never:
            assert pid in after and after[pid]["start"] == before.get(pid, after[pid])["start"], pid
        assert not [v["cmd"] for p, v in after.items()
                    if v["uid"] == 0 and ("sglang::" in v["cmd"] or "sglang.launch_server" in v["cmd"])]
        removed = set(res["removed_shm"])
        assert {"/dev/shm/sgl_shm_1", "/dev/shm/cuda.shm.0"} <= removed
        assert any(p.startswith("/dev/shm/nccl-lab") for p in removed)
        assert "/dev/shm/nccl-live-holder" not in removed
        assert any(k["path"] == "/dev/shm/nccl-live-holder" and holder in k["holders"] for k in res["kept_shm"])
        listing = lab.exec(host, ["ls", "/dev/shm"]).stdout.split()
        assert listing == ["nccl-live-holder"], listing
    finally:
        lab.clear_faults(host)
        kill(lab, host, *[p for p in (other, holder) if p])
        lab.exec(host, ["rm", "-f", "/dev/shm/nccl-live-holder"])


@pytest.mark.lab_only_once
def test_stop_in_check_mode_signals_nothing_and_second_stop_changes_nothing(lab):
    host = lab.hosts[0]
    server = launch(lab, host)
    dry = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop", check=True)
    assert dry.status == "successful"
    res = stop_results(lab, dry)[host]
    assert res["changed"] and server in {e["pid"] for e in res["signalled"]}
    assert all(e["ended"] == "would signal" and e["signals"] == [] for e in res["signalled"])
    assert server in procs(lab, host)

    first = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop")
    assert first.status == "successful" and stop_results(lab, first)[host]["changed"]
    assert server not in procs(lab, host)
    second = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop")
    assert second.status == "successful"
    res = stop_results(lab, second)[host]
    assert res["changed"] is False and res["signalled"] == []


def last_stop_result(lab, runner, host):
    """The role's final sglang_stop result (the last sglang_stop task that ended ok on the host)."""
    return [d["res"] for d in lab.events(runner, "runner_on_ok", "sglang_stop") if d["host"] == host][-1]


@pytest.mark.lab_only_once
def test_defunct_worker_holding_gpu_memory_is_killed_and_the_host_ends_serving(lab):
    # Finding 5: a <defunct> worker whose other thread holds GPU memory was skipped as dead; the wait timed out.
    host = lab.hosts[2]
    lab.fault(host, zombie_worker=3)
    try:
        launch(lab, host)
        [zombie] = [z for z in defunct(lab, host) if z["threads"] == ["sglang::scheduler_TP3"]]
        gpu3 = lab.gpus(host)[3]
        assert zombie["pid"] in {a["pid"] for a in gpu3["apps"]}, "the defunct worker does not hold GPU 3"
        lab.fault(host, zombie_worker=None)  # the new server starts normally

        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert runner.status == "successful", open(runner.stdout.name).read()[-3000:]
        res = last_stop_result(lab, runner, host)
        entry = {e["pid"]: e for e in res["signalled"]}[zombie["pid"]]
        assert (entry["defunct"], entry["signals"], entry["ended"]) == (True, ["SIGKILL"], "after SIGKILL")
        assert entry["cmdline"] == "sglang::scheduler_TP3"
        assert not [z for z in defunct(lab, host) if z["pid"] == zombie["pid"] and z["start"] == zombie["start"]]
        assert zombie["pid"] not in procs(lab, host) or procs(lab, host)[zombie["pid"]]["start"] != zombie["start"]
        assert zombie["pid"] not in {a["pid"] for g in lab.gpus(host) for a in g["apps"]}
        assert lab.wait_http(host, timeout_s=10) == 200
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_orphan_keeping_the_resource_tracker_alive_costs_one_short_stop_not_the_grace(lab):
    # Finding 6: multiprocessing's resource tracker (the server's child, in its process group) ignores SIGTERM
    # and exits only when its pipe closes; an orphaned worker holds that pipe. With one grace and the orphan
    # signalled together with the server, the stop takes seconds, not sglang_stop_grace_s.
    host = lab.hosts[1]
    lab.fault(host, orphan_worker=7)
    try:
        server = launch(lab, host)
        before = procs(lab, host)
        [tracker] = [p for p, v in before.items() if "multiprocessing.resource_tracker" in v["cmd"]]
        status = lab.exec(host, ["cat", "/proc/%d/status" % tracker], check=True).stdout
        sig_ign = int(re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M).group(1), 16)
        assert sig_ign & (1 << (15 - 1)), "the stand-in's resource tracker does not ignore SIGTERM"
        [orphan] = [p for p, v in before.items() if v["cmd"] == "sglang::scheduler_TP7"]

        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_stop_grace_s=30), limit=host, tags="stop")
        assert runner.status == "successful", open(runner.stdout.name).read()[-3000:]
        res = last_stop_result(lab, runner, host)
        by_pid = {e["pid"]: e for e in res["signalled"]}
        assert by_pid[server]["reason"] == "pid_file"
        assert (by_pid[tracker]["reason"], by_pid[tracker]["ended"]) == ("process_group", "after SIGTERM")
        assert (by_pid[orphan]["reason"], by_pid[orphan]["ended"]) == ("pattern", "after SIGTERM")
        assert res["stop_ms"] < 15000, "the stop waited on the tracker: %d ms" % res["stop_ms"]
        after = procs(lab, host)
        assert tracker not in after and orphan not in after
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_restart_never_signals_roots_grep_or_pgrep_loop_watching_sglang(lab):
    # Finding 7: matching was a substring anywhere in the command line.
    host = lab.hosts[2]
    watchers = ["bash -c 'sleep 600 | grep --line-buffered sglang.launch_server'",
                "bash -c 'while :; do pgrep -af sglang::scheduler; sleep 1; done'"]
    launch(lab, host)
    script = " ".join("setsid %s </dev/null >/dev/null 2>&1 & echo $!;" % w for w in watchers)
    groups = [int(x) for x in lab.exec(host, ["sh", "-c", script], check=True).stdout.split()]
    try:
        wanted = {"grep --line-buffered sglang.launch_server",
                  "bash -c sleep 600 | grep --line-buffered sglang.launch_server",
                  "bash -c while :; do pgrep -af sglang::scheduler; sleep 1; done"}
        deadline = time.time() + 10
        while True:
            before = procs(lab, host)
            bystanders = {p: v for p, v in before.items() if v["cmd"] in wanted and v["uid"] == 0}
            if len(bystanders) == len(wanted) or time.time() > deadline:
                break
            time.sleep(0.1)
        assert sorted(v["cmd"] for v in bystanders.values()) == sorted(wanted)
        assert all(re.search(OLD_SUBSTRING_PATTERN, v["cmd"]) for v in bystanders.values()), \
            "the old substring match would not have hit them: the test proves nothing"

        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert runner.status == "successful", open(runner.stdout.name).read()[-3000:]
        signalled = {e["pid"] for e in last_stop_result(lab, runner, host)["signalled"]}
        assert signalled and not signalled & set(bystanders)
        after = procs(lab, host)
        for pid, v in bystanders.items():
            assert pid in after and after[pid]["start"] == v["start"], "%s was signalled" % v["cmd"]
        assert lab.wait_http(host, timeout_s=10) == 200
    finally:
        for pgid in groups:
            lab.exec(host, ["kill", "-9", "--", "-%d" % pgid])


@pytest.mark.lab_only_once
def test_a_stop_longer_than_15_s_prints_progress_lines(lab):
    # The orphan ignores SIGTERM, so the stop lasts the whole grace (20 s): a line must come before 15 s.
    host = lab.hosts[1]
    lab.fault(host, orphan_worker=7, worker_ignores_sigterm=True)
    try:
        launch(lab, host)
        orphan = [p for p, v in procs(lab, host).items() if v["cmd"] == "sglang::scheduler_TP7"]
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, sglang_stop_grace_s=20), limit=host, tags="stop")
        out = open(runner.stdout.name).read()
        assert runner.status == "successful", out[-3000:]
        lines = [line for line in out.splitlines() if "processes to exit after SIGTERM" in line]
        assert lines, out[-3000:]
        assert re.search(r"waiting for \d+ of \d+ processes to exit after SIGTERM: .*pid %d sglang::scheduler_TP7; "
                         r"1\d s of 20 s grace, then SIGKILL" % orphan[0], lines[0]), lines
        res = last_stop_result(lab, runner, host)
        assert res["stop_ms"] >= 20000
        assert {e["pid"]: e for e in res["signalled"]}[orphan[0]]["ended"] == "after SIGKILL"
    finally:
        lab.clear_faults(host)


@pytest.mark.lab_only_once
def test_a_router_and_a_bench_client_on_the_host_survive_a_restart_while_a_leftover_does_not(lab):
    """Issue 30: sglang-router titles itself sglang::router, which the default pattern (sglang::.*) took for a
    server's leftover; -m sglang.bench_serving too. Both run as the user the stop may signal (root here)."""
    host = lab.hosts[0]
    router = spawn(lab, host, "sglang::router")
    client = spawn(lab, host, "python3 -m sglang.bench_serving --backend sglang --port 30000 --num-prompts 1000")
    leftover = spawn(lab, host, "sglang::scheduler_TP5")  # a worker of an earlier server, re-parented
    try:
        before = procs(lab, host)
        assert before[router]["uid"] == before[client]["uid"] == before[leftover]["uid"] == 0
        # sglang_stop in check mode, as preflight calls it (process method: the pid file, the login user)
        dry = lab.run_module("sglang_stop", {"pid_file": "%s/sglang.pid" % lab.host_vars(host)["sglang_state_dir"],
                                             "remove_stale_shm": False}, hosts=host, check=True)
        assert dry.status == "successful", open(dry.stdout.name).read()[-3000:]
        [res] = [d["res"] for d in lab.events(dry, "runner_on_ok") if d["host"] == host]
        would = {e["pid"]: e for e in res["signalled"]}
        assert would[leftover]["reason"] == "pattern" and would[leftover]["ended"] == "would signal"
        assert router not in would and client not in would, sorted(would)
        assert sorted((k["pid"], k["kind"]) for k in res["kept"]) == sorted([(router, "router"), (client, "client")])
        assert "kept: " in res["progress"] and "router pid %d" % router in res["progress"], res["progress"]

        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host)
        assert runner.status == "successful", open(runner.stdout.name).read()[-3000:]
        signalled = {e["pid"] for e in last_stop_result(lab, runner, host)["signalled"]}
        assert leftover in signalled and not {router, client} & signalled
        [report] = [d["res"]["msg"] for d in lab.events(runner, "runner_on_ok", "debug")
                    if d["host"] == host and d["task"] == "Report what was stopped"]
        assert "kept: router pid %d, client pid %d" % (router, client) in report or \
            "kept: client pid %d, router pid %d" % (client, router) in report, report
        after = procs(lab, host)
        for pid in (router, client):
            assert pid in after and after[pid]["start"] == before[pid]["start"], after.get(pid)
        assert leftover not in after
        assert lab.wait_http(host, timeout_s=10) == 200
    finally:
        kill(lab, host, router, client, leftover)


@pytest.mark.lab_only_once
def test_an_unreadable_pid_file_fails_the_stop_by_name_and_the_server_keeps_serving(lab):
    """The pid file replaced by a directory (open() fails with EISDIR, for root too): the stop names the file and
    the error and signals nothing; the old server still runs. (Before the one pid-file reader: a traceback.)"""
    host = lab.hosts[1]
    server = launch(lab, host)
    pid_file = "%s/sglang.pid" % lab.host_vars(host)["sglang_state_dir"]
    lab.exec(host, ["sh", "-c", 'mv "$0" "$0.aside" && mkdir "$0"', pid_file], check=True)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=FAST, limit=host, tags="stop")
        assert runner.status == "failed"
        [msg] = [d["res"]["msg"] for d in lab.events(runner, "runner_on_failed", "sglang_stop")]
        assert msg.startswith("cannot read pid file %s: [Errno 21] Is a directory" % pid_file), msg
        assert "Traceback" not in msg
        assert server in procs(lab, host)  # nothing was signalled: the old server serves
    finally:
        lab.exec(host, ["sh", "-c", 'rmdir "$0" && mv "$0.aside" "$0"', pid_file], check=True)
