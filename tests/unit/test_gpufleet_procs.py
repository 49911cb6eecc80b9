"""gpufleet_procs: the /proc fd scan and process descriptions, on real processes of this machine."""
import getpass
import json
import os
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_procs as P

HOLDER = r"""
import os, sys, time
fds = [os.open(p, os.O_RDONLY) for p in sys.argv[1:] if os.path.isabs(p)]
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def fake_dev(tmp_path):
    """A directory standing in for /dev with nvidia0, nvidia1, nvidiactl, nvidia-uvm (regular files)."""
    d = tmp_path / "dev"
    d.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "other"):
        (d / name).write_text("")
    return d


def start_holder(paths, argv_extra=()):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER] + [str(p) for p in paths] + list(argv_extra),
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def stop(proc):
    proc.kill()
    proc.wait()


def test_find_device_holders_finds_a_process_holding_device_files(fake_dev):
    proc = start_holder([fake_dev / "nvidia1", fake_dev / "nvidiactl", fake_dev / "other"])
    try:
        holders = P.find_device_holders(glob=str(fake_dev / "nvidia*"))
    finally:
        stop(proc)
    assert holders[proc.pid] == sorted([str(fake_dev / "nvidia1"), str(fake_dev / "nvidiactl")])


def test_find_device_holders_leaves_out_excluded_pids(fake_dev):
    proc = start_holder([fake_dev / "nvidia0"])
    try:
        holders = P.find_device_holders(glob=str(fake_dev / "nvidia*"), exclude_pids={proc.pid})
    finally:
        stop(proc)
    assert proc.pid not in holders


def test_find_device_holders_skips_vanished_and_unreadable_processes(tmp_path, monkeypatch):
    proc_root = tmp_path / "proc"
    for pid, target in ((10, "/dev/nvidia0"), (12, "/dev/nvidia-uvm"), (13, "/dev/nvidia1")):
        fd = proc_root / str(pid) / "fd"
        fd.mkdir(parents=True)
        os.symlink(target, fd / "3")
        os.symlink("/dev/null", fd / "4")
    (proc_root / "11").mkdir()  # exited between listing /proc and reading its fds: no fd dir
    (proc_root / "self").mkdir()
    real_listdir = os.listdir

    def listdir(path):
        if str(path).endswith("/13/fd"):
            raise PermissionError(13, "Permission denied", str(path))  # another user's process
        return real_listdir(path)

    monkeypatch.setattr(P.os, "listdir", listdir)
    real_readlink = os.readlink

    def readlink(path):
        if str(path).endswith("/12/fd/4"):
            raise FileNotFoundError(2, "No such file", str(path))  # fd closed mid-scan
        return real_readlink(path)

    monkeypatch.setattr(P.os, "readlink", readlink)
    assert P.find_device_holders(proc_root=str(proc_root)) == {10: ["/dev/nvidia0"], 12: ["/dev/nvidia-uvm"]}


def test_process_info_describes_a_live_process():
    proc = start_holder([], argv_extra=["--flag", "value"])
    try:
        info = P.process_info(proc.pid)
    finally:
        stop(proc)
    assert info["pid"] == proc.pid and info["ppid"] == os.getpid()
    assert info["cmdline"][-2:] == ["--flag", "value"] and info["cmdline"][0] == sys.executable
    assert info["user"] == getpass.getuser()
    assert info["pgid"] == os.getpgid(0)
    assert abs(info["create_time"] - time.time()) < 120


def test_process_info_survives_invalid_utf8_name_and_cmdline():
    code = ("import sys, time\n"
            "open('/proc/self/comm', 'wb').write(b'gpu\\xff\\xfew')\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, b"arg\xff\xfe"], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    try:
        info = P.process_info(proc.pid)
    finally:
        stop(proc)
    assert info["name"] == "gpu\ufffd\ufffdw"
    assert info["cmdline"][-1] == "arg\ufffd\ufffd"
    json.dumps(info).encode("utf-8")  # serialisable for the controller


def test_process_info_of_a_gone_process_is_none():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert P.process_info(proc.pid) is None


def test_process_info_without_psutil_raises_missing_library(monkeypatch):
    monkeypatch.setattr(P, "HAS_PSUTIL", False)
    with pytest.raises(P.MissingLibraryError) as err:
        P.process_info(os.getpid())
    assert err.value.library == "psutil"
    assert P.describe_pids([os.getpid()]) == {os.getpid(): None}


@pytest.mark.parametrize("path,minor", [("/dev/nvidia0", 0), ("/dev/nvidia7", 7), ("/dev/nvidia15", 15),
                                        ("/dev/nvidiactl", None), ("/dev/nvidia-uvm", None),
                                        ("/dev/nvidia-caps/nvidia-cap1", None), ("/dev/nvidia-modeset", None)])
def test_gpu_minor_of_path_maps_only_per_gpu_nodes(path, minor):
    assert P.gpu_minor_of_path(path) == minor


def test_clean_text_replaces_surrogates_and_bytes():
    assert P.clean_text("a\udcffb") == "a\ufffdb"
    assert P.clean_text(b"a\xffb") == "a\ufffdb"
    assert P.clean_text("plain") == "plain" and P.clean_text(None) is None


def test_cmdline_text_joins_arguments_keeps_titles_and_survives_invalid_utf8(tmp_path):
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "cmdline").write_bytes(b"python3\x00-m\x00sglang.launch_server\x00--model-path\x00/m\xff\x00")
    (tmp_path / "42").mkdir()
    # setproctitle leaves one string padded with NULs
    (tmp_path / "42" / "cmdline").write_bytes(b"sglang::scheduler_TP3" + b"\x00" * 20)
    assert P.cmdline_text(41, proc_root=str(tmp_path)) == "python3 -m sglang.launch_server --model-path /m\\xff"
    assert P.cmdline_text(42, proc_root=str(tmp_path)) == "sglang::scheduler_TP3"
    assert P.cmdline_text(43, proc_root=str(tmp_path)) == ""


ZOMBIE_LEADER = r"""
import ctypes, os, platform, sys, threading, time
fds = []
def hold():
    fds.append(os.open(sys.argv[1], os.O_RDONLY))
    print("ready", flush=True)
    time.sleep(60)
threading.Thread(target=hold).start()
while not fds:
    time.sleep(0.01)
time.sleep(0.1)
# exit only the main thread (SYS_exit, not exit_group): the process shows <defunct>, its thread holds the fd
ctypes.CDLL(None, use_errno=True).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="SYS_exit number")
def test_find_device_holders_reads_thread_fd_tables_of_a_defunct_main_thread(fake_dev):
    proc = subprocess.Popen([sys.executable, "-c", ZOMBIE_LEADER, str(fake_dev / "nvidia1")], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 5
        state = ""
        while time.monotonic() < deadline:
            with open("/proc/%d/stat" % proc.pid) as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.05)
        assert state == "Z"  # the main thread is gone ...
        assert os.listdir("/proc/%d/fd" % proc.pid) == []  # ... and with it the fd list of /proc/<pid>/fd
        holders = P.find_device_holders(glob=str(fake_dev / "nvidia*"))
        assert holders.get(proc.pid) == [str(fake_dev / "nvidia1")]
    finally:
        stop(proc)


def test_find_device_holders_reads_a_thread_table_that_differs(tmp_path):
    """A fake /proc: pid 40's main fd list is empty, its thread 41 holds /dev/nvidia2."""
    proc = tmp_path / "proc"
    (proc / "40" / "fd").mkdir(parents=True)
    (proc / "40" / "task" / "40" / "fd").mkdir(parents=True)
    (proc / "40" / "task" / "41" / "fd").mkdir(parents=True)
    os.symlink("/dev/nvidia2", str(proc / "40" / "task" / "41" / "fd" / "7"))
    (proc / "50" / "fd").mkdir(parents=True)
    os.symlink("/dev/nvidiactl", str(proc / "50" / "fd" / "3"))
    assert P.find_device_holders(proc_root=str(proc)) == {40: ["/dev/nvidia2"], 50: ["/dev/nvidiactl"]}


@pytest.mark.parametrize("paths, name, gpus, kind", [
    (["/dev/nvidia0", "/dev/nvidiactl"], "python3", [0], "gpu"),
    (["/dev/nvidiactl", "/dev/nvidia-uvm"], "python3", [], "shared_only"),
    (["/dev/nvidiactl", "/dev/nvidia0"], "nvidia-persiste", [0], "monitor"),
    (["/dev/nvidiactl"], "nv-hostengine", [], "monitor"),
    (["/dev/nvidia3"], "python3", [], "gpu"),  # a node of a GPU not mapped (other namespace) still counts
])
def test_holder_kind(paths, name, gpus, kind):
    assert P.holder_kind(paths, name, gpus) == kind


def test_process_info_and_cmdline_text_never_show_an_api_key(tmp_path):
    import subprocess
    import sys
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_procs
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--api-key", "s3cret"])
    try:
        import time
        deadline = time.time() + 10
        while "--api-key" not in gpufleet_procs.cmdline_text(proc.pid) and time.time() < deadline:
            time.sleep(0.01)
        assert "s3cret" not in gpufleet_procs.cmdline_text(proc.pid)
        assert "--api-key ********" in gpufleet_procs.cmdline_text(proc.pid)
        info = gpufleet_procs.process_info(proc.pid)
        assert info["cmdline"][-2:] == ["--api-key", "********"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("program, sub, kind", [
    ("sglang::router", None, "router"), ("smg::router", None, "router"),
    ("sglang_router.launch_router", None, "router"), ("sglang_router.launch_server", None, "router"),
    ("smg.launch_router", None, "router"), ("/venv/bin/smg", "launch", "router"), ("smg", "serve", "router"),
    ("/usr/local/bin/sglang-router", None, "router"),
    ("sglang.bench_serving", None, "client"), ("sglang.bench_one_batch_server", None, "client"),
    ("sglang.check_env", None, "client"), ("sglang.profiler", None, "client"), ("/venv/bin/sglang", "version", "client"),
    ("sglang::detokenizer_router", None, None), ("sglang::scheduler_TP0", None, None), ("sglang::server", None, None),
    ("sglang::tokenizer_worker:77", None, None), ("sglang::data_parallel_controller", None, None),
    ("sglang.launch_server", None, None), ("sglang.bench_one_batch", None, None), ("/venv/bin/sglang", "serve", None),
    ("sglang_routerx", None, None), ("smgx.server", None, None), (None, None, None), ("", None, None)])
def test_sglang_bystander_names_routers_and_clients_and_nothing_of_a_server(program, sub, kind):
    assert P.sglang_bystander(program, sub) == kind
