"""sglang_stop (role and module) on the lab fleet over real SSH: what is signalled and what never is.

Each lab host runs a monitor (an nvidia-persistenced stand-in holding /dev/nvidiactl and /dev/nvidia0) that must
never be signalled. These tests add an SGLang-titled process of another user, a live process holding an
NCCL-named segment, stale segments, an orphaned worker (re-parented to the host's PID 1) and workers that
ignore SIGTERM, then run restart.yml's stop phase and look at the host afterwards.
"""
import json
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
