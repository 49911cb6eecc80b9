"""sglang_host_info: disk and /dev/shm figures, the TCP listener on the port and whether it is the managed server."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from ansible.module_utils.testing import patch_module_args
from gpu_module_harness import load_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


host_info = load_module("sglang_host_info")


def run_main(args, capsys):
    with patch_module_args(args):
        with pytest.raises(SystemExit) as exc:
            host_info.main()
    return exc.value.code, json.loads(capsys.readouterr().out)


@pytest.fixture
def listener():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def test_names_this_process_as_the_listener_and_not_managed_without_pid_file(listener, capsys):
    rc, out = run_main({"port": listener, "host": "127.0.0.1"}, capsys)
    assert rc == 0
    (entry,) = out["port"]["listeners"]
    assert entry["pid"] == os.getpid()
    assert entry["address"] == "127.0.0.1" and entry["conflicts"] is True
    assert entry["cmdline"] == __import__("psutil").Process().cmdline()
    assert out["port"]["free"] is False and out["port"]["held_by_managed"] is False
    assert out["managed_pid"] is None and out["changed"] is False


def test_listener_in_the_pid_file_counts_as_the_managed_server(listener, tmp_path, capsys):
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("%d\n" % os.getpid())
    rc, out = run_main({"port": listener, "pid_file": str(pid_file)}, capsys)
    assert out["managed_pid"] == os.getpid() and out["managed_running"] is True
    assert out["port"]["held_by_managed"] is True
    assert out["port"]["listeners"][0]["managed"] is True


def test_listener_in_a_child_of_the_managed_pid_counts_as_managed(tmp_path, capsys):
    # The child binds and listens; the pid file names this test process, its parent.
    code = ("import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(1); "
            "print(s.getsockname()[1], flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        pid_file = tmp_path / "sglang.pid"
        pid_file.write_text(str(os.getpid()))
        rc, out = run_main({"port": port, "pid_file": str(pid_file)}, capsys)
        (entry,) = out["port"]["listeners"]
        assert entry["pid"] == child.pid and entry["managed"] is True
        assert out["port"]["held_by_managed"] is True
        sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            pid_file.write_text(str(sibling.pid))  # alive, but not an ancestor of the listener
            rc, out = run_main({"port": port, "pid_file": str(pid_file)}, capsys)
            assert out["managed_running"] is True
            assert out["port"]["held_by_managed"] is False
        finally:
            sibling.kill()
            sibling.wait()
    finally:
        child.kill()
        child.wait()


def test_stale_pid_file_is_not_a_managed_server(listener, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text(str(dead.pid))
    rc, out = run_main({"port": listener, "pid_file": str(pid_file)}, capsys)
    assert out["managed_running"] is False
    assert out["port"]["held_by_managed"] is False


def test_free_port_is_reported_free(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    rc, out = run_main({"port": port}, capsys)
    assert out["port"] == {"port": port, "free": True, "held_by_managed": False, "listeners": []}


def test_listener_on_another_specific_address_does_not_conflict():
    assert host_info._conflicts("127.0.0.1", "127.0.0.1")
    assert host_info._conflicts("0.0.0.0", "127.0.0.1")
    assert host_info._conflicts("127.0.0.1", "0.0.0.0")
    assert host_info._conflicts("::", "10.0.0.5")
    assert not host_info._conflicts("10.0.0.5", "127.0.0.1")


def test_disk_figures_match_shutil_disk_usage_and_missing_paths_use_their_parent(tmp_path, capsys):
    missing = tmp_path / "not" / "yet"
    rc, out = run_main({"paths": [str(tmp_path), str(missing)]}, capsys)
    first, second = out["disk"]
    usage = shutil.disk_usage(str(tmp_path))
    assert first["exists"] is True and first["measured_path"] == str(tmp_path)
    assert abs(first["total_mib"] - usage.total // 2 ** 20) <= 1
    # free space moves while other processes write; f_bavail is what shutil reports as free
    assert abs(first["free_mib"] - usage.free // 2 ** 20) < 256
    assert second["exists"] is False and second["measured_path"] == str(tmp_path)


def test_shm_lists_sglang_and_nccl_segments_only(tmp_path, capsys):
    for name, size in (("nccl-abc", 2 * 2 ** 20), ("cuda.shm.0.1", 10), ("sgl_shm_x", 0), ("postgres", 5)):
        (tmp_path / name).write_bytes(b"\0" * size)
    rc, out = run_main({"shm_path": str(tmp_path)}, capsys)
    names = [s["name"] for s in out["shm"]["stale_segments"]]
    assert names == ["cuda.shm.0.1", "nccl-abc", "sgl_shm_x"]
    assert out["shm"]["stale_segments"][1]["size_mib"] == 2.0
    usage = shutil.disk_usage(str(tmp_path))
    assert abs(out["shm"]["size_mib"] - usage.total // 2 ** 20) <= 1
    assert "port" not in out


def test_missing_shm_is_reported_not_fatal(tmp_path, capsys):
    rc, out = run_main({"shm_path": str(tmp_path / "nope")}, capsys)
    assert rc == 0 and out["shm"]["exists"] is False and out["shm"]["free_mib"] == 0


def test_garbage_pid_file_means_no_managed_server(tmp_path, capsys):
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("not a pid")
    rc, out = run_main({"pid_file": str(pid_file)}, capsys)
    assert out["managed_pid"] is None and out["managed_running"] is False


def test_port_out_of_range_fails(capsys):
    rc, out = run_main({"port": 70000}, capsys)
    assert rc == 1 and "between 1 and 65535" in out["msg"]


def test_missing_psutil_is_reported_with_missing_required_lib(monkeypatch, capsys):
    monkeypatch.setattr(host_info, "HAS_PSUTIL", False)
    rc, out = run_main({"port": 30000}, capsys)
    assert rc == 1 and "psutil" in out["msg"] and "Failed to import the required Python library" in out["msg"]
