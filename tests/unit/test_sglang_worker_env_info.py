"""sglang_worker_env_info: environ parsing (bytes-safe), comparison, worker discovery from a real tree."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sglang_worker_env_info",
                                              ROOT / "plugins" / "modules" / "sglang_worker_env_info.py")
envinfo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(envinfo)


def test_parse_environ_keeps_non_utf8_bytes_and_skips_junk():
    raw = b"NCCL_PROTO=LL\x00WEIRD=\xff\xfe\x00NOEQUALS\x00EMPTY=\x00A=b=c\x00"
    env = envinfo.parse_environ(raw)
    assert env == {b"NCCL_PROTO": b"LL", b"WEIRD": b"\xff\xfe", b"EMPTY": b"", b"A": b"b=c"}


def test_compare_env_reports_missing_and_mismatched_with_non_utf8_value():
    env = envinfo.parse_environ(b"NCCL_PROTO=LL\x00NCCL_ALGO=\xffRing\x00NCCL_BUFFSIZE=16777216\x00")
    present, missing, mismatched = envinfo.compare_env(
        env, {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": 16777216, "NCCL_NTHREADS": 512},
        names=["NCCL_PROTO", "CUDA_DEVICE_MAX_CONNECTIONS"])
    assert present == {"NCCL_PROTO": "LL", "NCCL_ALGO": "\\xffRing", "NCCL_BUFFSIZE": "16777216"}
    assert missing == ["NCCL_NTHREADS"]
    assert mismatched == {"NCCL_ALGO": {"expected": "Ring", "actual": "\\xffRing"}}


def test_finds_titled_workers_among_descendants_and_reads_their_environ(capsys):
    tag = uuid.uuid4().hex[:8]
    # A parent that spawns two titled workers and one untitled helper, like SGLang's launcher.
    code = r"""
import os, subprocess, sys, time
kids = []
for n in range(2):
    kids.append(subprocess.Popen([sys.executable, "-c",
        "import setproctitle,time;setproctitle.setproctitle('sglang::scheduler_TP%d %s');time.sleep(60)" % (n, sys.argv[1])],
        env=dict(os.environ, SPT_NOENV="1", NCCL_PROTO="LL", NCCL_ALGO="Ring" if n == 0 else "Tree")))
kids.append(subprocess.Popen([sys.executable, "-c", "import time;time.sleep(60)"]))
time.sleep(1.0)
print("ready", flush=True)
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", code, tag], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == b"ready"
        from ansible.module_utils.testing import patch_module_args
        with patch_module_args({"pid": parent.pid, "expected": {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"},
                                "title_pattern": r"^sglang::scheduler_TP\d+ " + tag}):
            with pytest.raises(SystemExit):
                envinfo.main()
        result = json.loads(capsys.readouterr().out)
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()
    assert result["changed"] is False and result["worker_count"] == 2
    tp0, tp1 = result["workers"]
    assert tp0["title"].startswith("sglang::scheduler_TP0") and tp0["match"] is True
    assert tp1["mismatched"] == {"NCCL_ALGO": {"expected": "Ring", "actual": "Tree"}}
    assert result["all_match"] is False


def test_unreadable_environ_counts_as_not_matching(tmp_path):
    import re
    proc_root = tmp_path / "proc"
    (proc_root / "77").mkdir(parents=True)
    (proc_root / "77" / "cmdline").write_bytes(b"sglang::scheduler_TP0\x00")
    # A directory where the file should be: open() fails with an OSError even for root (who could read a
    # mode-0 file), like /proc/<pid>/environ of another user's process does for a non-root user.
    (proc_root / "77" / "environ").mkdir()
    [worker] = envinfo.inspect_workers([77], re.compile("^sglang::"), {"NCCL_PROTO": "LL"}, [], str(proc_root))
    assert worker["match"] is False and worker["missing"] == ["NCCL_PROTO"]
    assert "cannot read /proc/77/environ" in worker["error"]


def test_environ_overwritten_by_setproctitle_is_reported_with_the_fix(tmp_path):
    import re
    proc_root = tmp_path / "proc"
    (proc_root / "78").mkdir(parents=True)
    (proc_root / "78" / "cmdline").write_bytes(b"sglang::scheduler_TP3\x00")
    (proc_root / "78" / "environ").write_bytes(b"\x00" * 512)  # what a titled worker without SPT_NOENV shows
    [worker] = envinfo.inspect_workers([78], re.compile("^sglang::"), {"NCCL_PROTO": "LL"}, [], str(proc_root))
    assert worker["match"] is False and worker["missing"] == ["NCCL_PROTO"]
    assert "SPT_NOENV=1" in worker["error"]


def test_a_worker_that_exits_while_its_environ_is_read_is_left_out(tmp_path, monkeypatch):
    """ESRCH while reading /proc/<pid>/environ (the process ended meanwhile) means the worker is gone, not that
    its environment is unreadable for lack of privilege."""
    import errno
    import re
    proc_root = tmp_path / "proc"
    for pid in (79, 80):
        (proc_root / str(pid)).mkdir(parents=True)
        (proc_root / str(pid) / "cmdline").write_bytes(b"sglang::scheduler_TP0\x00")
        (proc_root / str(pid) / "environ").write_bytes(b"NCCL_PROTO=LL\x00")
    real = envinfo.read_environ

    def read(pid, root):
        if pid == 79:
            raise ProcessLookupError(errno.ESRCH, "No such process")
        return real(pid, root)
    # inspect_workers lives in module_utils (gpufleet_environ), shared with sglang_process state=verified.
    monkeypatch.setattr(sys.modules[envinfo.inspect_workers.__module__], "read_environ", read)
    workers = envinfo.inspect_workers([79, 80], re.compile("^sglang::"), {"NCCL_PROTO": "LL"}, [], str(proc_root))
    assert [(w["pid"], w["match"]) for w in workers] == [(80, True)]
