"""Filters for the NCCL patch's files (plugins/filter/gpufleet_patch.py): what a rollback restores and says."""
import pytest

from ansible.errors import AnsibleFilterError
from ansible_collections.gpufleet.fleet.plugins.filter.gpufleet_patch import (
    NOT_CHANGED,
    gpufleet_hand_edit_lines,
    gpufleet_patch_kept,
    gpufleet_patch_record,
    gpufleet_patch_restore,
    gpufleet_rollback_serves,
)

ENGINE = "/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py"
WORKER = "/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/worker_launch.py"


def module_file(path, previous_file=None, sha=None, changed=True):
    return {"path": path, "changed": changed, "sha256": "after-" + path.rsplit("/", 1)[-1], "previous_file": previous_file,
            "previous_sha256": sha, "line": 10, "block": "none"}


def stat_result(item, checksum):
    return {"item": item, "stat": {"exists": checksum is not None, "checksum": checksum} if checksum else {"exists": False}}


def test_kept_lists_only_files_with_a_rollback_copy():
    files = [module_file(ENGINE, "/state/prev/srt.entrypoints.engine.py.prev", "a" * 64),
             module_file(WORKER, None, None, changed=False)]
    assert gpufleet_patch_kept(files) == [
        {"path": ENGINE, "previous_file": "/state/prev/srt.entrypoints.engine.py.prev", "sha256": "a" * 64}]
    assert gpufleet_patch_kept([]) == []
    with pytest.raises(AnsibleFilterError):
        gpufleet_patch_kept(None)


def test_record_keeps_path_and_checksum_of_every_file():
    assert gpufleet_patch_record([module_file(ENGINE), module_file(WORKER)]) == [
        {"path": ENGINE, "sha256": "after-engine.py"}, {"path": WORKER, "sha256": "after-worker_launch.py"}]


def test_files_that_differ_from_their_copy_are_restored_and_named():
    engine = {"path": ENGINE, "previous_file": "/p/e.prev", "sha256": "1" * 64}
    worker = {"path": WORKER, "previous_file": "/p/w.prev", "sha256": "2" * 64}
    out = gpufleet_patch_restore([stat_result(engine, "f" * 64), stat_result(worker, "e" * 64)])
    assert out["restore"] == [engine, worker]
    assert out["note"] == ("engine.py and worker_launch.py restored to their bytes from before this run "
                           "(sha256 111111111111, 222222222222)")


def test_one_file_keeps_the_wording_of_a_single_engine_py():
    engine = {"path": ENGINE, "previous_file": "/p/e.prev", "sha256": "1" * 64}
    out = gpufleet_patch_restore([stat_result(engine, "f" * 64)])
    assert out["note"] == "engine.py restored to its bytes from before this run (sha256 111111111111)"


def test_a_file_equal_to_its_copy_is_left_and_said_unchanged_a_missing_one_is_restored():
    engine = {"path": ENGINE, "previous_file": "/p/e.prev", "sha256": "1" * 64}
    worker = {"path": WORKER, "previous_file": "/p/w.prev", "sha256": "2" * 64}
    out = gpufleet_patch_restore([stat_result(engine, None), stat_result(worker, "2" * 64)])
    assert out["restore"] == [engine]
    assert out["note"] == ("engine.py restored to its bytes from before this run (sha256 111111111111); "
                           "worker_launch.py unchanged (the patch had not written it)")


def test_nothing_kept_means_nothing_changed_by_this_run():
    assert gpufleet_patch_restore([]) == {"restore": [], "note": NOT_CHANGED}
    assert gpufleet_patch_restore(None) == {"restore": [], "note": NOT_CHANGED}


def test_equal_base_names_are_told_apart_by_their_paths():
    one = {"path": "/a/sglang/srt/engine.py", "previous_file": "/p/1", "sha256": "1" * 64}
    two = {"path": "/a/sglang/other/engine.py", "previous_file": "/p/2", "sha256": "2" * 64}
    out = gpufleet_patch_restore([stat_result(one, "0" * 64), stat_result(two, "0" * 64)])
    assert out["note"].startswith("/a/sglang/srt/engine.py and /a/sglang/other/engine.py restored")


RECORD = {"nccl_env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_ALGO": "Ring"}}


def worker(rank, **over):
    return dict({"pid": 100 + rank, "title": "sglang::scheduler_TP%d" % rank, "match": True, "missing": [],
                 "mismatched": {}}, **over)


def test_previous_configuration_only_when_every_worker_carries_the_recorded_values():
    ok = {"workers": [worker(i) for i in range(8)], "all_match": True, "worker_count": 8}
    assert gpufleet_rollback_serves(ok, RECORD) == \
        "the host serves the previous configuration (its 8 workers carry the recorded NCCL values)"
    # worker_launch.py reinstalled unpatched since the record: SGLang's own value wins in the relaunched workers.
    drifted = {"workers": [worker(0, match=False, mismatched={"CUDA_DEVICE_MAX_CONNECTIONS": {"actual": "8",
                                                                                               "expected": "1"}}),
                           worker(1)], "all_match": False, "worker_count": 2}
    text = gpufleet_rollback_serves(drifted, RECORD)
    assert "previous configuration" not in text
    assert text.startswith("the host serves the previous argv and environment, but not the previous NCCL values: "
                           "1 of 2 workers lack them (sglang::scheduler_TP0: CUDA_DEVICE_MAX_CONNECTIONS=8, expected 1)")
    assert "run playbooks/patch.yml, then playbooks/restart.yml" in text


def test_unread_workers_or_an_old_record_make_no_claim_about_nccl_values():
    assert "could not be read (no server)" in gpufleet_rollback_serves({"msg": "no server", "workers": []}, RECORD)
    assert "could not be read" in gpufleet_rollback_serves({}, RECORD)
    assert "predates its NCCL values" in gpufleet_rollback_serves({"skipped": True}, {"argv": []})
    # No NCCL values were recorded (sglang_nccl_env empty): nothing to show, the configuration is the recorded one.
    assert gpufleet_rollback_serves({"skipped": True}, {"nccl_env": {}}) == "the host serves the previous configuration"


def test_hand_edit_lines_say_what_happened_to_each_line():
    entries = [
        {"path": ENGINE, "line": 1950, "text": 'os.environ["NCCL_PROTO"] = "Simple"', "names": ["NCCL_PROTO"],
         "after_anchor": True, "action": "taken_over"},
        {"path": ENGINE, "line": 1900, "text": 'os.environ["NCCL_DEBUG"] = "INFO"', "names": ["NCCL_DEBUG"],
         "after_anchor": False, "action": "reported"},
    ]
    first, second = gpufleet_hand_edit_lines(entries)
    assert first.startswith(ENGINE + ':1950: os.environ["NCCL_PROTO"] = "Simple" -- after the start-method call; ')
    assert "taken over by this run" in first and "absent puts it back" in first
    assert second.endswith("left as it is (sglang_nccl_env does not set NCCL_DEBUG): it still applies to the workers")
    assert gpufleet_hand_edit_lines([]) == []
    with pytest.raises(AnsibleFilterError):
        gpufleet_hand_edit_lines(None)
