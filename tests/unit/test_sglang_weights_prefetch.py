"""sglang_weights_prefetch: main() with module arguments -- the result keys RETURN documents, check mode, failures."""
import os

import pytest
import yaml

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_prefetch as P
from gpu_module_harness import load_module, run_main
from test_gpufleet_prefetch import MIB, cold_file, resident

MODULE = load_module("sglang_weights_prefetch")
RETURN = yaml.safe_load(MODULE.RETURN)


def test_a_run_reads_the_model_and_returns_exactly_the_documented_keys(monkeypatch, tmp_path):
    f = cold_file(tmp_path / "m" / "model-00001-of-00001.safetensors", 4 * MIB)
    (tmp_path / "m" / "config.json").write_text("{}")  # just written: in the page cache already, not read
    done = run_main(monkeypatch, MODULE, {"paths": [str(f.parent), "org/hub-id"], "reserve_mib": 0})
    r = done.result
    assert not done.failed, r
    assert set(r) - {"changed", "invocation"} == set(RETURN)
    # Ansible reads a top-level "skipped" (or "failed", "unreachable") as the task's own status: a skipped hub id
    # once made the whole task show SKIPPED
    assert not {"skipped", "failed", "unreachable", "skip_reason"} & set(RETURN)
    assert set(r["bound"]) == set(RETURN["bound"]["contains"])
    assert set(r["files"][0]) == set(RETURN["files"]["contains"])
    assert set(r["skipped_paths"][0]) == set(RETURN["skipped_paths"]["contains"])
    assert r["changed"] is True and r["read_bytes"] == 4 * MIB and resident(f) == 4 * MIB
    assert [os.path.basename(x["path"]) for x in r["files"]] == ["config.json", "model-00001-of-00001.safetensors"]
    assert r["skipped_paths"][0]["reason"].startswith("not a local path: org/hub-id")
    assert r["done"] is True and r["stopped_by"] is None and r["resident_pct"] == 100.0


def test_check_mode_reads_nothing_and_changes_nothing(monkeypatch, tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 4 * MIB)
    done = run_main(monkeypatch, MODULE, {"paths": [str(f.parent)], "_ansible_check_mode": True})
    r = done.result
    assert not done.failed and r["changed"] is False and r["read_bytes"] == 0
    assert resident(f) <= 64 * 1024 and r["msg"].startswith("check mode: ")


def test_a_bad_option_fails_naming_it(monkeypatch):
    done = run_main(monkeypatch, MODULE, {"paths": ["/models/x"], "slice_s": 0})
    assert done.failed and done.result["msg"].startswith("slice_s must be more than 0 (got 0.0)")


def test_paths_is_required(monkeypatch):
    done = run_main(monkeypatch, MODULE, {})
    assert done.failed and "paths" in done.result["msg"]


@pytest.mark.parametrize("meminfo, text", [
    (OSError(2, "No such file or directory", "/proc/meminfo"), "No such file or directory: '/proc/meminfo'"),
    ("MemTotal: 1 kB\n", "no MemFree line in /proc/meminfo")])
def test_a_host_without_a_readable_meminfo_fails_saying_what_is_needed(monkeypatch, tmp_path, meminfo, text):
    real = P.read_proc

    def read_proc(name, root="/proc"):
        if name != "meminfo":
            return real(name, root)
        if isinstance(meminfo, Exception):
            raise meminfo
        return meminfo
    monkeypatch.setattr(P, "read_proc", read_proc)
    done = run_main(monkeypatch, MODULE, {"paths": [str(tmp_path)]})
    msg = done.result["msg"]
    assert done.failed and msg.startswith("cannot prefetch on this host: ") and text in msg
    assert "run on Linux with /proc mounted" in msg


def test_an_unexpected_error_fails_with_a_message_that_names_it(monkeypatch, tmp_path):
    # With failed_when: false (the role's), ansible-core 2.19 keeps no message or traceback of a module that
    # crashed: the summary's note said "prefetch failed, so the launch read its weights cold: no message".
    def boom(*_a, **_k):
        raise TypeError("'<' not supported between instances of 'int' and 'str'")
    monkeypatch.setattr(MODULE, "prefetch", boom)
    done = run_main(monkeypatch, MODULE, {"paths": [str(tmp_path)]})
    assert done.failed and done.result["msg"] == (
        "the prefetch failed unexpectedly: TypeError: '<' not supported between instances of 'int' and 'str'")
