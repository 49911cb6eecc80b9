"""sglang_host_info: disk and /dev/shm figures, the TCP listener on the port and whether it is the managed server."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from ansible.module_utils.testing import patch_module_args
from gpu_module_harness import load_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


host_info = load_module("sglang_host_info")
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_host_measure as host_measure  # noqa: E402


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


def test_a_listener_titled_with_its_whole_command_line_has_its_key_redacted(capsys):
    # Issue 31: setproctitle leaves the title as one argv element; the key was at port.listeners[0].cmdline[0].
    key = "sk-unit-" + "9f" * 12
    title = "/venv/bin/python -m sglang.launch_server --model-path /m --api-key %s --admin-api-key=%s --port 1" % (
        key, key)
    code = ("import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(1); "
            "print(s.getsockname()[1], flush=True); time.sleep(30)")
    child = subprocess.Popen([title, "-c", code], executable=sys.executable, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        rc, out = run_main({"port": port}, capsys)
        (entry,) = out["port"]["listeners"]
        assert entry["pid"] == child.pid and key not in json.dumps(out)
        assert entry["cmdline"][0] == title.replace(key, "********")
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
    monkeypatch.setattr(host_measure, "HAS_PSUTIL", False)
    rc, out = run_main({"port": 30000}, capsys)
    assert rc == 1 and "psutil" in out["msg"] and "Failed to import the required Python library" in out["msg"]


# ---------------------------------------------------------------------------------------------------------------
# Foresight: the stop set, GPU memory after the stop, /dev/shm the stop frees, write access, model directories.

def proc(pid, mib, user="root", cmdline="python x.py", source=("nvidia-smi",), name=None):
    return {"pid": pid, "used_memory_mib": mib, "user": user, "cmdline": cmdline, "name": name or cmdline.split()[0],
            "source": list(source)}


def gpu(index, used, *procs):
    return {"index": index, "memory_used_mib": used, "processes": list(procs)}


SERVER = {100, 101, 102}


def after(gpus, stop=SERVER, holders=(), max_used_mib=1024, visible=lambda pid: True):
    return host_info.gpu_after_stop({"gpus": gpus, "device_holders": list(holders)}, stop, max_used_mib, visible)


def test_stop_set_is_the_previewed_pids_plus_the_unit_members():
    preview = {"signalled": [{"pid": 7, "ended": "would signal"}, {"pid": 9}], "removed_shm": []}
    assert host_info.stop_set(preview, {3}) == {3, 7, 9}
    assert host_info.stop_set(None) == set()


def test_gpu_memory_of_the_stop_set_is_expected_to_go():
    res = after([gpu(0, 120009, proc(101, 120000, cmdline="sglang::scheduler_TP0")),
                 gpu(1, 120009, proc(102, 120000, cmdline="sglang::scheduler_TP1"))])
    assert res["blocked"] is False and res["holders"] == [] and res["unexplained"] == []
    assert [(g["stop_set_mib"], g["remaining_mib"], g["accounting"]) for g in res["gpus"]] == \
        [(120000, 9, "complete"), (120000, 9, "complete")]


def test_foreign_compute_process_is_named_with_user_mib_gpus_and_command_line():
    train = dict(user="bob", cmdline="python train.py --epochs 3")
    res = after([gpu(2, 140018, proc(101, 120000), proc(555, 20000, **train)),
                 gpu(3, 20009, proc(555, 20000, **train))])
    assert res["blocked"] is True and res["unexplained"] == []
    (holder,) = res["holders"]
    assert holder["pid"] == 555 and holder["used_memory_mib"] == 40000 and holder["gpu_indices"] == [2, 3]
    assert holder["text"] == "pid 555 (user bob) holds 40000 MiB on GPUs 2, 3: python train.py --epochs 3"


def test_foreign_compute_process_without_mib_still_blocks_and_says_so():
    (holder,) = after([gpu(0, 500, proc(555, None, user="bob"))])["holders"]
    assert holder["used_memory_mib"] is None and "GPU memory (MiB not reported) on GPU 0" in holder["text"]


def test_known_monitors_never_count_whatever_they_hold():
    smi = proc(40, 0, cmdline="nvidia-smi -l 1", name="nvidia-smi")
    persist = {"pid": 3, "name": "nvidia-persiste", "cmdline": "/usr/bin/nvidia-persistenced --user x",
               "user": "root", "gpu_indices": [0]}
    res = after([gpu(0, 0, smi, dict(persist, used_memory_mib=None, source=["proc_fd"]))], holders=[persist])
    assert res["blocked"] is False


def test_container_without_compute_list_trusts_a_stop_set_process_holding_the_device():
    fd_only = proc(101, None, cmdline="sglang::scheduler_TP0", source=["proc_fd"])
    res = after([gpu(0, 120009, fd_only)])
    assert res["blocked"] is False and res["gpus"][0]["accounting"] == "incomplete"
    assert res["gpus"][0]["held_by_stop_set"] is True


def test_memory_no_stop_set_process_explains_is_reported_with_the_other_device_holders():
    other = {"pid": 777, "name": "python", "cmdline": "python other.py", "user": "eve", "gpu_indices": [4]}
    res = after([gpu(4, 30009, dict(other, used_memory_mib=None, source=["proc_fd"]))], holders=[other])
    (item,) = res["unexplained"]
    # Memory no listed process accounts for is what the old server runs beside: the wait's baseline, not a refusal.
    assert res["blocked"] is False and item["index"] == 4 and item["other_holders"] == [777]
    assert res["baseline_mib"] == {"4": 30009}
    assert "GPU 4: 30009 MiB stay in use after the stop" in item["text"]
    assert "pid 777 (user eve): python other.py" in item["text"]


def test_complete_accounting_with_memory_left_over_becomes_the_waits_baseline():
    shared = {"pid": 555, "name": "python3", "cmdline": "python3 /srv/batch/embed_worker.py", "user": "root",
              "gpu_indices": [], "kind": "shared_only", "devices": ["/dev/nvidiactl", "/dev/nvidia-uvm"]}
    res = after([gpu(0, 150000, proc(101, 120000))], holders=[shared])
    assert res["blocked"] is False and res["unexplained"][0]["remaining_mib"] == 30000
    assert res["baseline_mib"] == {"0": 30000}
    text = res["unexplained"][0]["text"]
    assert "no GPU list names its holder" in text
    assert "only /dev/nvidiactl and /dev/nvidia-uvm (candidates): pid 555 (user root): python3 /srv/batch/" in text


def test_memory_the_stop_set_may_hold_unlisted_is_no_baseline():
    # No compute list at all (a container without the host PID namespace), a stop-set process holds the device:
    # the stop is expected to free it, so the wait keeps its plain limit.
    res = after([gpu(0, 120009, proc(101, None, cmdline="sglang::scheduler_TP0", source=["proc_fd"]))])
    assert res["baseline_mib"] == {} and res["unexplained"] == []


def test_a_listed_holder_outside_the_stop_set_is_no_baseline():
    other = proc(700, 20000, cmdline="python train.py", user="bob")
    res = after([gpu(3, 140018, proc(101, 120000), other)])
    assert res["blocked"] is True and res["baseline_mib"] == {}
    assert res["gpus"][0]["foreign_listed"] is True


def test_compute_pids_from_another_pid_namespace_are_not_blamed_but_named():
    hidden = proc(90001, 20000, user=None, cmdline="", name="python")
    res = after([gpu(0, 20009, hidden)], visible=lambda pid: pid != 90001)
    assert res["holders"] == []
    assert "not visible in this PID namespace (another container?): pids 90001" in res["unexplained"][0]["text"]
    # ...and when a stop-set process holds that GPU, the stop is trusted to free it
    res = after([gpu(0, 20009, hidden, proc(101, None, source=["proc_fd"]))], visible=lambda pid: pid != 90001)
    assert res["blocked"] is False


def test_unit_members_are_the_processes_of_the_main_pid_cgroup_and_below(tmp_path):
    groups = {1: "0::/init.scope", 50: "0::/system.slice/sglang.service", 51: "0::/system.slice/sglang.service",
              52: "0::/system.slice/sglang.service/sub", 60: "0::/system.slice/sglang.service2",
              70: "12:name=systemd:/system.slice/other.service"}
    for pid, line in groups.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(line + "\n")
    assert host_info.unit_members(50, str(tmp_path)) == {50, 51, 52}
    assert host_info.cgroup_of(70, str(tmp_path)) == "/system.slice/other.service"
    assert host_info.unit_members(999, str(tmp_path)) == {999}


def test_shm_segments_the_stop_removes_or_that_only_the_stop_set_holds_count_as_free(tmp_path, capsys):
    def segment(name, mib):
        with open(str(tmp_path / name), "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, mib << 20)
    segment("nccl-stale", 2)
    segment("sgl_shm_live", 3)
    segment("cuda.shm.other", 4)
    preview = {"signalled": [{"pid": 101}], "removed_shm": [str(tmp_path / "nccl-stale")],
               "kept_shm": [{"path": str(tmp_path / "sgl_shm_live"), "holders": [101], "reason": "held"},
                            {"path": str(tmp_path / "cuda.shm.other"), "holders": [101, 555], "reason": "held"}]}
    rc, out = run_main({"shm_path": str(tmp_path), "stop_preview": preview}, capsys)
    shm = out["shm"]
    assert rc == 0 and out["stop_pids"] == [101]
    assert shm["freed_by_stop_mib"] == 5.0
    assert shm["free_after_stop_mib"] == shm["free_mib"] + 5
    (kept,) = shm["kept_segments"]
    assert kept["name"] == "cuda.shm.other" and kept["holders"] == [101, 555]
    assert kept["text"] == "cuda.shm.other (4.0 MiB, held by pids 101, 555)"


def test_without_a_stop_preview_nothing_counts_as_freed(tmp_path, capsys):
    (tmp_path / "nccl-x").write_bytes(b"\0" * 4096)
    rc, out = run_main({"shm_path": str(tmp_path)}, capsys)
    assert out["shm"]["freed_by_stop_mib"] == 0 and out["shm"]["free_after_stop_mib"] == out["shm"]["free_mib"]
    assert out["stop_pids"] == []


def test_replace_access_needs_a_writable_directory(tmp_path, monkeypatch):
    target = tmp_path / "engine.py"
    target.write_text("x = 1\n")
    entry = host_info.replace_access(str(target))
    assert entry["ok"] is True and entry["reason"] is None and entry["checked_path"] == str(tmp_path)
    assert entry["purpose"] == "replace" and entry["file_writable"] is True
    real_access = os.access
    monkeypatch.setattr(host_measure.os, "access", lambda path, mode, **kw: False if path == str(tmp_path)
                        else real_access(path, mode))
    entry = host_info.replace_access(str(target))
    assert entry["ok"] is False
    assert entry["reason"].startswith("user %s cannot create files in %s (%s belongs to "
                                      % (entry["user"], tmp_path, tmp_path))
    assert "with mode 0%o" % (os.stat(str(tmp_path)).st_mode & 0o777) in entry["reason"]


def test_a_read_only_filesystem_is_named_as_such(tmp_path, monkeypatch):
    class RO(object):
        f_flag = os.ST_RDONLY
    monkeypatch.setattr(host_measure.os, "statvfs", lambda path: RO())
    assert host_info._why_not(str(tmp_path)) == "%s is on a read-only filesystem" % tmp_path


def test_dir_access_accepts_a_creatable_directory_and_refuses_a_file(tmp_path):
    entry = host_info.dir_access(str(tmp_path / "state" / "deeper"))
    assert entry["ok"] is True and entry["checked_path"] == str(tmp_path)
    (tmp_path / "afile").write_text("")
    entry = host_info.dir_access(str(tmp_path / "afile"))
    assert entry["ok"] is False and entry["reason"] == "%s exists and is not a directory" % (tmp_path / "afile")


def test_model_directories_need_a_marker_file(tmp_path, capsys):
    empty = tmp_path / "mountpoint"
    empty.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    rc, out = run_main({"model_dirs": {"model_path": str(model), "speculative-draft-model-path": str(empty),
                                       "tokenizer-path": str(tok)},
                        "model_markers": {"tokenizer-path": ["tokenizer_config.json", "tokenizer.json"]}}, capsys)
    by_flag = {m["flag"]: m for m in out["model_dirs"]}
    assert by_flag["model-path"]["found"] == "config.json"
    assert by_flag["speculative-draft-model-path"]["found"] is None
    assert by_flag["speculative-draft-model-path"]["markers"] == ["config.json"]
    assert by_flag["tokenizer-path"]["found"] == "tokenizer.json"


def test_main_reports_gpu_after_stop_only_when_gpu_info_is_given(capsys):
    me = os.getpid()  # a live pid: main() checks that compute pids exist here
    info = {"gpus": [gpu(0, 20009, proc(me, 20000, user="bob"))], "device_holders": []}
    rc, out = run_main({"gpu_info": info, "stop_preview": {"signalled": []}, "max_used_mib": 1024}, capsys)
    assert rc == 0 and out["gpu_after_stop"]["blocked"] is True
    assert out["gpu_after_stop"]["holders"][0]["pid"] == me
    rc, out = run_main({}, capsys)
    assert "gpu_after_stop" not in out and out["write_access"] == [] and out["model_dirs"] == []


def test_reads_the_restart_lock_without_taking_it(tmp_path, capsys):
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_lock
    lock = tmp_path / "restart.lock"
    rc, result = run_main({"lock_dir": str(lock)}, capsys)
    assert rc == 0 and result["restart_lock"] is None and not lock.exists()
    gpufleet_lock.take_lease(str(lock), {"run_id": "awx-7", "controller": "awx-pod-1", "pid": 12}, 300)
    before = (lock / "owner.json").read_text()
    rc, result = run_main({"lock_dir": str(lock) + "/"}, capsys)
    held = result["restart_lock"]
    assert rc == 0 and held["run_id"] == "awx-7" and held["controller"] == "awx-pod-1"
    assert held["expired"] is False and 290 < held["remaining_s"] <= 300
    assert (lock / "owner.json").read_text() == before, "read only"
    # A lock of an earlier release (no lease fields) is judged by its mtime and the lease asked for.
    legacy = tmp_path / "legacy.lock"
    legacy.mkdir()
    (legacy / "owner.json").write_text('{"run_id": "old-1"}')
    os.utime(str(legacy / "owner.json"), (time.time() - 100, time.time() - 100))
    os.utime(str(legacy), (time.time() - 100, time.time() - 100))
    rc, result = run_main({"lock_dir": str(legacy), "lock_lease_s": 60}, capsys)
    assert rc == 0 and result["restart_lock"]["expired"] is True
    rc, result = run_main({"lock_dir": str(legacy)}, capsys)
    assert rc == 0 and result["restart_lock"]["expired"] is False
    # Not readable as a lock: said, not failed.
    lock_file = tmp_path / "file.lock"
    lock_file.write_text("x")
    rc, result = run_main({"lock_dir": str(lock_file)}, capsys)
    assert rc == 0 and result["restart_lock"] is None and "not a directory" in result["restart_lock_error"]


def test_mount_points_are_read_from_mountinfo_with_escapes_decoded(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_bytes(b"22 1 0:21 / / rw,relatime - ext4 /dev/vda1 rw\n"
                     b"90 22 0:21 /src/engine.py /opt/sglang/my\\040venv/engine.py ro,relatime - ext4 /dev/vda1 rw\n")
    assert host_info.mount_points(str(info)) == {"/", "/opt/sglang/my venv/engine.py"}
    assert host_info.mount_points(str(tmp_path / "missing")) == set()


def test_replace_access_refuses_a_file_that_is_a_mount_point_of_its_own(tmp_path):
    target = tmp_path / "engine.py"
    target.write_text("x = 1\n")
    entry = host_info.replace_access(str(target), mounts={str(target)})
    assert entry["ok"] is False and "is a mount point of its own" in entry["reason"] and "EBUSY" in entry["reason"]
    assert host_info.replace_access(str(target), mounts={"/"})["ok"] is True
