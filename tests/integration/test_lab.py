"""The lab itself (tests/lab/): hosts reached over real SSH with host key checking, isolation between hosts,
simulated GPUs, the stand-in server's life cycle, fault knobs, and a clean ``lab.py down``.

Run: ``.venv/bin/python -m pytest tests/integration/test_lab.py -m lab`` (root; ``make setup`` first).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.lab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB_PY = os.path.join(ROOT, "tests", "lab", "lab.py")
_spec = importlib.util.spec_from_file_location("gpufleet_lab_weights", os.path.join(ROOT, "tests", "lab", "weights.py"))
weights = importlib.util.module_from_spec(_spec)  # tests/lab/weights.py: the lab's checkpoints
_spec.loader.exec_module(weights)
NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512"}


def _ps(lab, host):
    """{pid: args} of every process in the host's PID namespace."""
    out = lab.exec(host, ["ps", "-eo", "pid=,args="], check=True).stdout
    procs = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        procs[int(pid)] = args.strip()
    return procs


def _workers(lab, host):
    return {int(m.group(1)): pid for pid, args in _ps(lab, host).items()
            for m in [re.fullmatch(r"sglang::scheduler_TP(\d+)", args)] if m}


def _start(lab, host, extra_env=None):
    """Start the stand-in with the inventory's EAGLE-3 args, or without the speculative flags on releases
    that do not have EAGLE3 yet (before 0.4.5 argparse rejects them, as real SGLang does)."""
    version = tuple(int(x) for x in re.findall(r"\d+", lab.group_vars["lab_sglang_version"])[:3])
    args = None
    if version < (0, 4, 5):
        hv = lab.host_vars(host)["sglang_launch_args"]
        args = {"model-path": hv["model-path"], "tp-size": 8}
    return lab.start_standin(host, extra_env=extra_env, args=args)


def _stop_standin(lab, host, pid, timeout_s=20):
    lab.exec(host, ["kill", "-TERM", str(pid)])
    deadline = time.time() + timeout_s
    while time.time() < deadline and pid in _ps(lab, host):
        time.sleep(0.1)


def test_every_host_answers_ansible_ping_over_ssh(lab):
    runner = lab.run_module("ping")
    assert runner.status == "successful", runner.stdout.read()
    assert lab.ok_hosts(runner, "ping") == set(lab.hosts)
    assert all(d["res"]["ping"] == "pong" for d in lab.events(runner, "runner_on_ok"))


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_ssh_refuses_a_host_key_missing_from_the_lab_known_hosts(lab, tmp_path):
    """Host key checking is on: the same key and user with an empty known_hosts file must fail."""
    hv = lab.host_vars(lab.hosts[0])
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    base = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ControlMaster=no",
            "-o", "ConnectTimeout=10", "-i", hv["ansible_ssh_private_key_file"], "-l", "root"]
    bad = subprocess.run(base + ["-o", "UserKnownHostsFile=%s" % empty, hv["ansible_host"], "true"],
                         capture_output=True, text=True)
    assert bad.returncode == 255 and "host key" in bad.stderr.lower()
    good = subprocess.run(base + ["-o", "UserKnownHostsFile=%s/ssh/known_hosts" % lab.lab_dir, hv["ansible_host"],
                                  "hostname"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == lab.hosts[0]


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_password_login_is_refused(lab):
    hv = lab.host_vars(lab.hosts[0])
    res = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "PubkeyAuthentication=no", "-o", "ControlMaster=no",
                          "-o", "UserKnownHostsFile=%s/ssh/known_hosts" % lab.lab_dir, "-l", "root",
                          hv["ansible_host"], "true"], capture_output=True, text=True)
    assert res.returncode == 255 and "permission denied" in res.stderr.lower()


@pytest.mark.lab_only_once
def test_lab_hosts_hide_the_machines_shell_start_up_files(lab):
    """bash runs ~/.bashrc for every SSH command; inside a lab host root's start-up files are empty, so a
    builder's shell set-up (pyenv init) costs no CPU per task; the rest of /root stays (the hosts' Python)."""
    host = lab.hosts[0]
    for name in (".bashrc", ".profile"):
        path = os.path.join("/root", name)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            continue
        inside = lab.exec(host, ["cat", path], check=True)
        assert inside.stdout == "", "%s inside %s still has the machine's content" % (path, host)
        with open(path) as handle:
            assert handle.read() != "", "the lab must not empty the machine's own %s" % path
    assert lab.exec(host, ["ls", "-d", "/root"], check=True).stdout.strip() == "/root"


def test_process_on_one_host_is_invisible_on_another(lab):
    if len(lab.hosts) < 2:
        pytest.skip("needs two hosts")
    first, second = lab.hosts[0], lab.hosts[1]
    marker = "317.%d" % os.getpid()
    started = lab.exec(first, ["sh", "-c", "sleep %s >/dev/null 2>&1 & echo $!" % marker], check=True)
    pid = int(started.stdout.split()[-1])
    try:
        # seen from the first host over SSH (sshd lives in that host's PID namespace) ...
        runner = lab.run_module("command", "pgrep -f 'sleep %s'" % marker, hosts=first)
        ok = lab.events(runner, "runner_on_ok")
        assert [d["host"] for d in ok] == [first]
        assert str(pid) in ok[0]["res"]["stdout"].split()
        # ... and nowhere on the second one, whose /proc is its own
        assert not any("sleep %s" % marker in args for args in _ps(lab, second).values())
        assert lab.exec(second, ["sh", "-c", "test -e /proc/%d/cmdline && grep -q %s /proc/%d/cmdline" % (
            pid, marker, pid)]).returncode != 0
    finally:
        lab.exec(first, ["kill", str(pid)])


def test_nvidia_smi_over_ssh_reports_eight_h200_per_host(lab):
    runner = lab.run_module("command", "nvidia-smi --query-gpu=index,name,memory.total,uuid,pci.bus_id "
                                       "--format=csv,noheader,nounits")
    assert runner.status == "successful"
    ok = {d["host"]: d["res"]["stdout"].splitlines() for d in lab.events(runner, "runner_on_ok")}
    assert set(ok) == set(lab.hosts)
    uuids = set()
    for host, rows in ok.items():
        assert len(rows) == 8, (host, rows)
        for i, row in enumerate(rows):
            index, name, total, uuid, bus = row.split(", ")
            assert (int(index), name, int(total)) == (i, "NVIDIA H200", 143771)
            assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid)
            assert re.fullmatch(r"00000000:[0-9A-F]{2}:00\.0", bus)
            uuids.add(uuid)
    assert len(uuids) == 8 * len(lab.hosts)


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_patching_one_host_leaves_the_others_and_the_release_untouched(lab):
    if len(lab.hosts) < 2:
        pytest.skip("needs two hosts")
    first, second = lab.hosts[0], lab.hosts[1]
    # engine.py from 0.4.1.post7, srt/server.py before (FIELD-NOTES)
    find = ("import importlib.util, os; d = importlib.util.find_spec('sglang').submodule_search_locations[0]; "
            "e = os.path.join(d, 'srt', 'entrypoints', 'engine.py'); "
            "print(e if os.path.exists(e) else os.path.join(d, 'srt', 'server.py'))")
    paths = {h: lab.exec(h, [lab.host_vars(h)["sglang_python"], "-c", find], check=True).stdout.strip()
             for h in (first, second)}
    assert paths[first].startswith(lab.host_dirs[first] + "/venv/")
    before = {h: open(p, "rb").read() for h, p in paths.items()}
    marker = b"\n# lab isolation probe %d\n" % os.getpid()
    try:
        with open(paths[first], "ab") as fh:
            fh.write(marker)
        assert open(paths[first], "rb").read().endswith(marker)
        assert open(paths[second], "rb").read() == before[second]
        assert "def _set_envs_and_config(" in before[second].decode()
    finally:
        with open(paths[first], "wb") as fh:
            fh.write(before[first])


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_standin_serves_holds_gpu_memory_passes_nccl_env_and_releases_on_sigterm(lab):
    host = lab.hosts[-1]
    env = dict(NCCL, SPT_NOENV="1")
    pid = _start(lab, host, extra_env=env)
    try:
        assert lab.wait_http(host, "/health_generate", 200, timeout_s=60) == 200
        workers = _workers(lab, host)
        assert sorted(workers) == list(range(8))
        assert "-m sglang.launch_server" in _ps(lab, host)[pid]
        apps = lab.exec(host, ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                               "--format=csv,noheader,nounits"], check=True).stdout.splitlines()
        by_pid = {int(r.split(", ")[0]): r.split(", ") for r in apps}
        uuids = [g["uuid"] for g in lab.gpus(host)]
        for rank, wpid in workers.items():
            assert by_pid[wpid][1] == "sglang::scheduler_TP%d" % rank
            assert int(by_pid[wpid][2]) == 120000
            assert by_pid[wpid][3] == uuids[rank]
            environ = lab.exec(host, ["cat", "/proc/%d/environ" % wpid], check=True).stdout.split("\0")
            for key, value in NCCL.items():
                assert "%s=%s" % (key, value) in environ, (rank, key)
            fds = lab.exec(host, ["sh", "-c", "readlink /proc/%d/fd/*" % wpid]).stdout.split()
            assert "/dev/nvidia%d" % rank in fds
        info = json.loads(lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c",
                                          "import urllib.request as u; print(u.urlopen("
                                          "'http://%s:30000/get_server_info').read().decode())"
                                          % lab.host_vars(host)["sglang_host"]],
                                   check=True).stdout)
        assert info["version"] == lab.group_vars["lab_sglang_version"]
        assert info["tp_size"] == 8
    finally:
        _stop_standin(lab, host, pid)
    stopped = time.time()
    assert pid not in _ps(lab, host)
    assert not _workers(lab, host)
    # the memory outlives its holders by release_delay_ms (150 ms by default), then it is free
    deadline = stopped + 5
    while time.time() < deadline and any(g["used_mib"] for g in lab.gpus(host)):
        time.sleep(0.05)
    used = lab.exec(host, ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    check=True).stdout.split()
    assert used == ["0"] * 8


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_worker_environ_is_overwritten_by_setproctitle_without_spt_noenv(lab):
    """Like real SGLang workers (setproctitle), /proc/<worker>/environ hides the environment unless SPT_NOENV."""
    host = lab.hosts[0]
    pid = _start(lab, host, extra_env=dict(NCCL))
    try:
        assert lab.wait_http(host, "/health_generate", 200, timeout_s=60) == 200
        wpid = _workers(lab, host)[0]
        environ = lab.exec(host, ["cat", "/proc/%d/environ" % wpid], check=True).stdout
        assert "NCCL_PROTO=LL" not in environ
        main_environ = lab.exec(host, ["cat", "/proc/%d/environ" % pid], check=True).stdout
        assert "NCCL_PROTO=LL" in main_environ.split("\0")
    finally:
        _stop_standin(lab, host, pid)


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_port_held_fault_fails_the_start_only_after_loading(lab):
    host = lab.hosts[0]
    lab.fault(host, port_held=30000, slow_load_s=0.5)
    try:
        time.sleep(0.3)
        assert any(a.startswith("stray-listener") for a in _ps(lab, host).values())
        t0 = time.time()
        pid = _start(lab, host)
        deadline = time.time() + 30
        while time.time() < deadline and pid in _ps(lab, host):
            time.sleep(0.1)
        assert time.time() - t0 >= 0.5
        log = open(os.path.join(lab.host_dirs[host], "state", "standin-test.log")).read()
        assert "Address already in use" in log
        assert not _workers(lab, host)
    finally:
        lab.clear_faults(host)
    time.sleep(0.3)
    assert not any(a.startswith("stray-listener") for a in _ps(lab, host).values())


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_memory_never_released_fault_keeps_memory_until_cleared(lab):
    host = lab.hosts[0]
    lab.fault(host, memory_never_released=True)
    holder = None
    try:
        code = ("import sys; sys.path.insert(0, %r); import gpusim, time; s = gpusim.hold(2, 4096); "
                "print('held', flush=True); time.sleep(0.2)" % os.path.join(ROOT, "tests", "lab"))
        holder = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", code], check=True)
        assert "held" in holder.stdout
        time.sleep(0.5)
        assert lab.gpus(host)[2]["used_mib"] >= 4096
        assert lab.gpus(host)[2]["apps"] == []  # the holder is gone; its memory is not
    finally:
        lab.clear_faults(host)
    deadline = time.time() + 5
    while time.time() < deadline and lab.gpus(host)[2]["used_mib"]:
        time.sleep(0.05)
    assert lab.gpus(host)[2]["used_mib"] == 0


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_a_hold_that_does_not_fit_fails_like_cuda_out_of_memory(lab):
    host = lab.hosts[0]
    before = lab.gpus(host)[4]["used_mib"]
    code = ("import sys; sys.path.insert(0, %r); import gpusim\n"
            "try:\n    gpusim.hold(4, 143156)\nexcept OSError as exc:\n    print('refused', exc)"
            % os.path.join(ROOT, "tests", "lab"))
    out = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", code], check=True).stdout
    assert "refused gpusimd refused: CUDA out of memory. Tried to allocate 143156 MiB on GPU 4" in out, out
    assert lab.gpus(host)[4]["used_mib"] == before


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_monitor_keeps_nvidia_nodes_open_on_every_host(lab):
    for host in lab.hosts:
        procs = _ps(lab, host)
        mon = [pid for pid, args in procs.items() if args.startswith("/usr/bin/nvidia-persistenced")]
        assert len(mon) == 1, procs
        fds = lab.exec(host, ["sh", "-c", "readlink /proc/%d/fd/*" % mon[0]]).stdout.split()
        assert {"/dev/nvidiactl", "/dev/nvidia0"} <= set(fds)
        comm = lab.exec(host, ["cat", "/proc/%d/comm" % mon[0]], check=True).stdout.strip()
        assert comm == "nvidia-persiste"


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_proc_driver_nvidia_maps_bus_ids_to_minor_numbers(lab):
    host = lab.hosts[0]
    for g in lab.gpus(host):
        bus = "%04x:%s" % (int(g["pci_bus_id"][:8], 16), g["pci_bus_id"][9:].lower())
        info = lab.exec(host, ["cat", "/proc/driver/nvidia/gpus/%s/information" % bus], check=True).stdout
        minor = [l for l in info.splitlines() if l.startswith("Device Minor:")]
        assert int(minor[0].split(":", 1)[1]) == g["index"]
        assert g["uuid"] in info


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_lab_down_leaves_no_namespace_bridge_process_or_mount(tmp_path):
    if os.geteuid() != 0 or not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("needs root and sshd")
    lab_dir = str(tmp_path / "lab")
    up = subprocess.run([sys.executable, LAB_PY, "up", "--hosts", "2", "--lab-dir", lab_dir],
                        capture_output=True, text=True)
    state = json.load(open(os.path.join(lab_dir, "lab.json"))) if os.path.exists(
        os.path.join(lab_dir, "lab.json")) else {}
    try:
        assert up.returncode == 0, up.stderr
        assert os.path.exists("/sys/class/net/%s" % state["bridge"])
        pids = [h["init_pid"] for h in state["hosts"]]
        assert all(os.path.exists("/proc/%d" % p) for p in pids)
    finally:
        down = subprocess.run([sys.executable, LAB_PY, "down", "--lab-dir", lab_dir], capture_output=True, text=True)
    assert down.returncode == 0, down.stderr
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "gfl-%s-" % state["tag"] not in netns
    assert not os.path.exists("/sys/class/net/%s" % state["bridge"])
    for p in pids:
        try:
            os.kill(p, 0)
            alive = open("/proc/%d/cmdline" % p).read() != ""
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        assert not alive, p
    assert os.path.realpath(lab_dir) not in open("/proc/self/mountinfo").read()
    assert os.listdir(lab_dir) == []
    again = subprocess.run([sys.executable, LAB_PY, "down", "--lab-dir", lab_dir], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_crash_on_start_fault_exits_1_after_loading_and_frees_the_gpus(lab):
    host = lab.hosts[0]
    lab.fault(host, crash_on_start=True, slow_load_s=0.2)
    try:
        pid = _start(lab, host)
        deadline = time.time() + 30
        while time.time() < deadline and pid in _ps(lab, host):
            time.sleep(0.1)
        assert pid not in _ps(lab, host)
        assert not _workers(lab, host)
        log = open(os.path.join(lab.host_dirs[host], "state", "standin-test.log")).read()
        assert "crash_on_start" in log and "ready to roll" not in log
    finally:
        lab.clear_faults(host)
    deadline = time.time() + 5
    while time.time() < deadline and any(g["used_mib"] for g in lab.gpus(host)):
        time.sleep(0.05)
    assert not any(g["used_mib"] for g in lab.gpus(host))


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_orphan_worker_fault_survives_the_server_and_keeps_its_memory(lab):
    host = lab.hosts[0]
    lab.fault(host, orphan_worker=7)
    pid = _start(lab, host)
    orphan = None
    try:
        assert lab.wait_http(host, "/health_generate", 200, timeout_s=60) == 200
        orphan = _workers(lab, host)[7]
        ppid = lab.exec(host, ["ps", "-o", "ppid=", "-p", str(orphan)], check=True).stdout.strip()
        assert ppid == "1"
        sids = lab.exec(host, ["ps", "-o", "sid=,pgid=", "-p", "%d,%d" % (orphan, pid)], check=True).stdout.split()
        assert sids[0] != sids[2] and sids[1] != sids[3]  # another session and process group than the server
        _stop_standin(lab, host, pid)
        time.sleep(0.5)
        assert _workers(lab, host) == {7: orphan}
        assert lab.gpus(host)[7]["used_mib"] >= 120000 and lab.gpus(host)[0]["used_mib"] == 0
    finally:
        lab.clear_faults(host)
        _stop_standin(lab, host, pid)
        if orphan:
            lab.exec(host, ["kill", "-KILL", str(orphan)])
    deadline = time.time() + 5
    while time.time() < deadline and lab.gpus(host)[7]["used_mib"]:
        time.sleep(0.05)
    assert lab.gpus(host)[7]["used_mib"] == 0


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_worker_ignores_sigterm_fault_needs_sigkill(lab):
    host = lab.hosts[0]
    lab.fault(host, worker_ignores_sigterm=True)
    pid = _start(lab, host)
    try:
        assert lab.wait_http(host, "/health_generate", 200, timeout_s=60) == 200
        worker = _workers(lab, host)[0]
        lab.exec(host, ["kill", "-TERM", str(worker)])
        time.sleep(0.5)
        assert worker in _ps(lab, host)
    finally:
        lab.clear_faults(host)
        _stop_standin(lab, host, pid)
    assert not _workers(lab, host)


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_stale_shm_fault_leaves_segments_in_that_hosts_dev_shm_only(lab):
    host = lab.hosts[0]
    lab.fault(host, stale_shm=True)
    try:
        time.sleep(0.3)
        names = lab.exec(host, ["ls", "/dev/shm"], check=True).stdout.split()
        assert "sgl_shm_1" in names and "cuda.shm.0" in names and any(n.startswith("nccl-") for n in names)
        if len(lab.hosts) > 1:
            assert "sgl_shm_1" not in lab.exec(lab.hosts[1], ["ls", "/dev/shm"], check=True).stdout.split()

    finally:
        lab.clear_faults(host)
        lab.exec(host, ["sh", "-c", "rm -f /dev/shm/nccl-lab* /dev/shm/sgl_shm_1 /dev/shm/cuda.shm.0"])


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_stale_shm_mib_really_fills_that_hosts_dev_shm(lab):
    # tests/lab/README.md: "fill it with stale_shm=<MiB>"; sparse files would take no tmpfs space at all.
    host = lab.hosts[0]

    def used_mib():
        out = lab.exec(host, ["df", "-m", "--output=used", "/dev/shm"], check=True).stdout.split()
        return int(out[-1])

    before = used_mib()
    lab.fault(host, stale_shm=100)
    try:
        deadline = time.time() + 5
        while used_mib() < before + 300 and time.time() < deadline:
            time.sleep(0.1)
        assert used_mib() >= before + 300
    finally:
        lab.clear_faults(host)
        lab.exec(host, ["sh", "-c", "rm -f /dev/shm/nccl-lab* /dev/shm/sgl_shm_1 /dev/shm/cuda.shm.0"])


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_generate_reports_tokens_at_the_configured_speed(lab):
    host = lab.hosts[0]
    lab.fault(host, tokens_per_s=400)
    pid = _start(lab, host)
    try:
        assert lab.wait_http(host, "/health_generate", 200, timeout_s=60) == 200
        code = ("import json, urllib.request as u; r = u.urlopen(u.Request('http://%s:30000/generate', "
                "data=json.dumps({'text': 'a b c', 'sampling_params': {'max_new_tokens': 200}}).encode(), "
                "headers={'Content-Type': 'application/json'})); print(r.read().decode())"
                % lab.host_vars(host)["sglang_host"])
        out = json.loads(lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", code], check=True).stdout)
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 200 and meta["prompt_tokens"] == 3
        assert 0.45 <= meta["e2e_latency"] < 2.0
    finally:
        lab.clear_faults(host)
        _stop_standin(lab, host, pid)


# Client inside the host: one streaming /generate, rate between the first and the last token event (the decode
# speed, without the HTTP set-up), then one plain /generate timed end to end. Prints JSON.
_MEASURE = """
import json, sys, time, urllib.request as u
url, n = sys.argv[1], int(sys.argv[2])
def post(stream):
    body = json.dumps({"text": "a b c", "stream": stream, "sampling_params": {"max_new_tokens": n}}).encode()
    return u.urlopen(u.Request(url, data=body, headers={"Content-Type": "application/json"}), timeout=60)
events = []
with post(True) as r:
    for line in r:
        if line.startswith(b"data: {"):
            events.append((time.monotonic(), json.loads(line[6:])["meta_info"]["completion_tokens"]))
(t1, k1), (t2, k2) = events[0], events[-1]
t0 = time.monotonic()
plain = json.loads(post(False).read())
print(json.dumps({"stream_tok_s": (k2 - k1) / (t2 - t1), "events": len(events), "last": k2,
                  "plain_tok_s": plain["meta_info"]["completion_tokens"] / (time.monotonic() - t0)}))
"""


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_standin_decodes_at_the_table_speed_of_the_nccl_values_its_workers_got(lab):
    """The seed's NCCL set in the server's environment reaches the workers and the stand-in serves at the table's
    speed for it; without it, at the no-NCCL row (perf_noise 0: exact figures), measured over HTTP."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "lab", "standin"))
    import perf
    host = lab.hosts[1]
    hv = lab.host_vars(host)
    flags = hv["sglang_launch_args"]
    if tuple(int(x) for x in re.findall(r"\d+", lab.group_vars["lab_sglang_version"])[:3]) < (0, 4, 5):
        flags = {}  # _start drops the speculative flags there
    url = "http://%s:30000/generate" % hv["sglang_host"]
    log = os.path.join(lab.host_dirs[host], "state", "standin-test.log")
    lab.fault(host, perf_noise=0)
    measured = {}
    try:
        for name, env in (("seed", dict(NCCL, SPT_NOENV="1")), ("none", {"SPT_NOENV": "1"})):
            row, tok_s = perf.decode_tok_s(env, flags)
            pid = _start(lab, host, extra_env=env)
            try:
                assert lab.wait_http(host, "/health_generate", 200, timeout_s=60) == 200
                got = json.loads(lab.exec(host, [hv["sglang_python"], "-c", _MEASURE, url, "48"],
                                          check=True).stdout)
                with open(log) as fh:
                    started = fh.read()
                assert "decode speed: row %s, base %.2f tok/s, factor 1.0000" % (row, tok_s) in started
                assert "from /proc/" in started  # read from a worker, not from the server's own environment
            finally:
                _stop_standin(lab, host, pid)
                deadline = time.time() + 5  # the next start needs the GPU memory back
                while time.time() < deadline and any(g["used_mib"] for g in lab.gpus(host)):
                    time.sleep(0.05)
            measured[name] = (tok_s, got)
    finally:
        lab.clear_faults(host)
    for name, (tok_s, got) in measured.items():
        assert got["last"] == 48 and got["events"] >= 24, (name, got)  # about one SSE event per token
        assert 0.9 * tok_s <= got["stream_tok_s"] <= 1.1 * tok_s, (name, tok_s, got)
        assert 0.85 * tok_s <= got["plain_tok_s"] <= 1.05 * tok_s, (name, tok_s, got)
    (seed_tok_s, seed), (none_tok_s, none) = measured["seed"], measured["none"]
    assert seed_tok_s > none_tok_s and seed["stream_tok_s"] > 1.15 * none["stream_tok_s"]


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_full_dev_shm_makes_the_next_start_die_with_sigbus(lab):
    host = lab.hosts[0]
    fill = "dd if=/dev/zero of=/dev/shm/lab-filler bs=1M count=100000 2>/dev/null; true"
    lab.exec(host, ["sh", "-c", fill], check=True)
    try:
        free = lab.exec(host, ["sh", "-c", "df -m /dev/shm | tail -1"], check=True).stdout.split()
        assert int(free[3]) < 64
        hv = lab.host_vars(host)
        res = lab.exec(host, [hv["sglang_python"], hv["sglang_launcher"][1], "--model-path",
                              hv["sglang_launch_args"]["model-path"], "--tp-size", "8"], timeout=60)
        assert res.returncode == 128 + 7 or res.returncode == -7, (res.returncode, res.stderr)
        assert "Bus error" in res.stderr
        assert not _workers(lab, host)
    finally:
        lab.exec(host, ["rm", "-f", "/dev/shm/lab-filler"])


def _lab_py(lab, *argv):
    res = subprocess.run([sys.executable, LAB_PY] + list(argv) + ["--lab-dir", lab.lab_dir], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _shard_rss_bytes(lab, host, pid, model_dir):
    """Rss over the process's mappings of the shards in ``model_dir`` (/proc/<pid>/smaps on the host)."""
    return weights.shard_rss_bytes(lab.exec(host, ["cat", "/proc/%d/smaps" % pid], check=True).stdout, model_dir)


@pytest.mark.lab_only_once  # the lab itself: the same under every ansible-core
def test_standin_reads_a_cold_checkpoint_at_start_and_keeps_it_mapped(lab):
    """lab.py weights writes 256 MiB of safetensors cold; the stand-in (slow_load_s=0) reads every page before it
    serves and keeps the shards mapped; lab.py weights --size-mib 0 gives the usual config.json-only dir back."""
    host = lab.hosts[-1]
    target = lab.host_vars(host)["sglang_launch_args"]["model-path"]
    model = os.path.basename(target)
    # The lab is shared: a server another module left on this host would keep the port (ours would not bind) and
    # its mappings. Stop it the way an operator would.
    lab.stop_server(host)
    _lab_py(lab, "weights", "--host", host, "--size-mib", "256", "--shards", "2")
    pid = None
    try:
        _lab_py(lab, "evict", "--host", host)
        cold = json.loads(_lab_py(lab, "resident", "--host", host))[host][model]
        assert cold["weight_files"] == 2 and cold["total_bytes"] > 256 << 20
        assert cold["resident_bytes"] < 0.01 * cold["total_bytes"]
        lab.fault(host, slow_load_s=0)
        pid = _start(lab, host)
        assert lab.wait_http(host, "/health_generate", 200, timeout_s=60) == 200
        warm = json.loads(_lab_py(lab, "resident", "--host", host))[host][model]
        assert warm["resident_bytes"] > 0.99 * cold["total_bytes"]
        shards = sum(os.path.getsize(os.path.join(target, n)) for n in os.listdir(target) if n.endswith(".safetensors"))
        assert _shard_rss_bytes(lab, host, pid, target) > 0.99 * shards
        info = json.loads(lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c",
                                          "import urllib.request as u; print(u.urlopen("
                                          "'http://%s:30000/get_server_info').read().decode())"
                                          % lab.host_vars(host)["sglang_host"]], check=True).stdout)
        assert (info["weights_bytes"], info["weights_files"]) == (shards, 2)
        assert 0 < info["weights_load_s"] < 30 and info["weights_resident_before_pct"] < 1
        with open(os.path.join(lab.host_dirs[host], "state", "standin-test.log")) as fh:
            assert re.search(r"loaded 0\.25 GiB of weights from 2 files in [\d.]+ s \(resident before: [\d.]+ %\)",
                             fh.read())
    finally:
        lab.clear_faults(host)
        if pid:
            _stop_standin(lab, host, pid)
        _lab_py(lab, "weights", "--host", host, "--size-mib", "0")
    assert sorted(os.listdir(target)) == ["config.json"]
