"""The restart lock as a lease: module_utils/gpufleet_lock.py and library/gpufleet_lock.py.

Times are passed as ``now`` (host epoch s) so expiry is tested without sleeping; the lock lives in tmp_path.
"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_lock as L

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_module():
    spec = importlib.util.spec_from_file_location("gpufleet_lock_module", ROOT / "plugins" / "modules" / "gpufleet_lock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mod = load_module()


def run_main(args, capsys):
    from ansible.module_utils.testing import patch_module_args
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def lock_dir(tmp_path):
    return str(tmp_path / "state" / "restart.lock")


def owner(run_id, controller="ctl-1"):
    return {"run_id": run_id, "controller": controller, "pid": 4242, "user": "ops"}


def test_take_creates_state_dir_and_owner_record_with_host_clock_expiry(lock_dir):
    result, holder = L.take_lease(lock_dir, owner("r1"), lease_s=300, now=1000.0)
    assert (result, holder) == ("taken", None)
    record = json.load(open(os.path.join(lock_dir, "owner.json")))
    assert record["run_id"] == "r1" and record["controller"] == "ctl-1" and record["pid"] == 4242
    assert record["renewed_at"] == 1000.0 and record["lease_s"] == 300 and record["expires_at"] == 1300.0
    assert record["started"] == "1970-01-01T00:16:40Z" and record["expires"] == "1970-01-01T00:21:40Z"
    assert oct(os.stat(os.path.dirname(lock_dir)).st_mode & 0o777) == "0o755"
    # The lock's files: owner and group only (issue 31).
    assert oct(os.stat(os.path.join(lock_dir, "owner.json")).st_mode & 0o777) == "0o640"
    assert oct(os.stat(lock_dir.rstrip("/") + ".guard").st_mode & 0o777) == "0o640"


def test_unexpired_lease_of_another_run_refuses_naming_it(lock_dir):
    L.take_lease(lock_dir, owner("r1"), lease_s=300, now=1000.0)
    result, holder = L.take_lease(lock_dir, owner("r2", "awx-pod-7"), lease_s=300, now=1299.0)
    assert result == "refused"
    assert holder["run_id"] == "r1" and holder["expired"] is False and holder["remaining_s"] == 1.0
    assert json.load(open(os.path.join(lock_dir, "owner.json")))["run_id"] == "r1"


def test_expired_lease_is_taken_over_from_any_controller(lock_dir):
    L.take_lease(lock_dir, owner("r1", "awx-pod-1"), lease_s=300, now=1000.0)
    result, holder = L.take_lease(lock_dir, owner("r2", "awx-pod-2"), lease_s=300, now=1300.0)
    assert result == "taken_over" and holder["run_id"] == "r1" and holder["expired"] is True
    record = json.load(open(os.path.join(lock_dir, "owner.json")))
    assert record["run_id"] == "r2" and record["controller"] == "awx-pod-2" and record["expires_at"] == 1600.0


def test_renewal_moves_expiry_so_a_live_holder_is_never_taken_over(lock_dir):
    L.take_lease(lock_dir, owner("r1"), lease_s=300, now=1000.0)
    renewed = L.renew_lease(lock_dir, "r1", now=1250.0)
    assert renewed["expires_at"] == 1550.0 and renewed["lease_s"] == 300
    assert renewed["started_epoch"] == 1000.0
    assert L.take_lease(lock_dir, owner("r2"), lease_s=300, now=1400.0)[0] == "refused"
    assert L.take_lease(lock_dir, owner("r2"), lease_s=300, now=1550.0)[0] == "taken_over"


def test_renewal_with_new_lease_length(lock_dir):
    L.take_lease(lock_dir, owner("r1"), lease_s=300, now=1000.0)
    assert L.renew_lease(lock_dir, "r1", lease_s=20, now=1010.0)["expires_at"] == 1030.0


def test_renewal_raises_lock_lost_when_taken_over_or_removed(lock_dir):
    L.take_lease(lock_dir, owner("r1"), lease_s=10, now=1000.0)
    L.take_lease(lock_dir, owner("r2", "other"), lease_s=10, now=1011.0)
    with pytest.raises(L.LockLost) as lost:
        L.renew_lease(lock_dir, "r1", now=1012.0)
    assert "r2" in str(lost.value) and lost.value.holder["controller"] == "other"
    L.remove_lock(lock_dir)
    with pytest.raises(L.LockLost, match="is gone"):
        L.renew_lease(lock_dir, "r2")


def test_lease_renewer_throttles_to_a_third_of_the_lease(lock_dir):
    L.take_lease(lock_dir, owner("r1"), lease_s=30)
    clock = [100.0]
    renewer = L.LeaseRenewer(lock_dir, "r1", clock=lambda: clock[0])
    assert renewer.tick() is not None and renewer.every_s == 10.0
    clock[0] = 105.0
    assert renewer.tick() is None
    clock[0] = 110.0
    assert renewer.tick() is not None


def test_same_run_retaking_renews_and_keeps_start(lock_dir):
    L.take_lease(lock_dir, owner("r1"), lease_s=300, now=1000.0)
    assert L.take_lease(lock_dir, owner("r1"), lease_s=300, now=1100.0)[0] == "taken"
    record = json.load(open(os.path.join(lock_dir, "owner.json")))
    assert record["started_epoch"] == 1000.0 and record["expires_at"] == 1400.0


def test_take_over_run_id_only_takes_that_run(lock_dir):
    L.take_lease(lock_dir, owner("dead-1"), lease_s=300, now=1000.0)
    assert L.take_lease(lock_dir, owner("r2"), take_over_run_id="someone-else", now=1001.0)[0] == "refused"
    assert L.take_lease(lock_dir, owner("r2"), take_over_run_id="dead-1", now=1001.0)[0] == "taken_over"


def test_legacy_lock_without_lease_expires_from_its_mtime(lock_dir):
    # A lock written by an earlier release (mkdir + owner.json without lease fields).
    os.makedirs(lock_dir)
    with open(os.path.join(lock_dir, "owner.json"), "w") as handle:
        json.dump({"run_id": "old-1", "controller": "c", "pid": 1, "taken_at": "x"}, handle)
    mtime = os.stat(os.path.join(lock_dir, "owner.json")).st_mtime
    holder = L.read_holder(lock_dir, lease_s=60, now=mtime + 30)
    assert holder["legacy"] and not holder["expired"] and holder["expires_at"] == mtime + 60
    assert L.take_lease(lock_dir, owner("r2"), lease_s=60, now=mtime + 30)[0] == "refused"
    assert L.take_lease(lock_dir, owner("r2"), lease_s=60, now=mtime + 61)[0] == "taken_over"


def test_lock_without_owner_file_is_reported_and_judged_by_mtime(lock_dir):
    os.makedirs(lock_dir)
    holder = L.read_holder(lock_dir, lease_s=60)
    assert holder["unreadable"] == "no owner.json" and holder["run_id"] == "unknown" and not holder["expired"]


def test_release_removes_only_our_lock(lock_dir):
    L.take_lease(lock_dir, owner("r1"), lease_s=10, now=1000.0)
    L.take_lease(lock_dir, owner("r2"), lease_s=10, now=1011.0)
    assert L.release_lease(lock_dir, "r1")[0] == "not_owner"
    assert os.path.isdir(lock_dir)
    assert L.release_lease(lock_dir, "r2")[0] == "released"
    assert not os.path.exists(lock_dir)
    assert L.release_lease(lock_dir, "r2") == ("absent", None)


def test_check_mode_writes_nothing(lock_dir):
    assert L.take_lease(lock_dir, owner("r1"), check_mode=True) == ("taken", None)
    assert not os.path.exists(os.path.dirname(lock_dir))
    L.take_lease(lock_dir, owner("r1"))
    assert L.remove_lock(lock_dir, check_mode=True)[0] is False
    assert os.path.isdir(lock_dir)


def test_a_file_where_the_lock_directory_belongs_is_an_error(lock_dir):
    os.makedirs(os.path.dirname(lock_dir))
    open(lock_dir, "w").close()
    with pytest.raises(L.LockError, match="not a directory"):
        L.take_lease(lock_dir, owner("r1"))


def test_guard_flock_is_dropped_when_the_holder_process_dies(lock_dir):
    # A process that holds the guard and is killed must not block the next take (the kernel drops flock).
    os.makedirs(os.path.dirname(lock_dir))
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1] + '.guard', os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, lock_dir], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"held"
    proc.kill()
    proc.wait()
    started = time.monotonic()
    assert L.take_lease(lock_dir, owner("r1"))[0] == "taken"
    assert time.monotonic() - started < 5


# -- the module ------------------------------------------------------------------------------------------

def test_module_takes_renews_and_releases(lock_dir, capsys):
    res = run_main({"path": lock_dir, "owner": owner("r1"), "lease_s": 30, "min_lease_s": 200}, capsys)
    assert res["changed"] and res["acquired"] and res["result"] == "taken" and res["lease_s"] == 200
    assert res["lock"]["lease_s"] == 200 and res["lock"]["run_id"] == "r1"
    res = run_main({"path": lock_dir, "state": "renewed", "owner": {"run_id": "r1"}, "lease_s": 30}, capsys)
    assert res["result"] == "renewed" and res["acquired"] and res["lock"]["lease_s"] == 30
    res = run_main({"path": lock_dir, "state": "absent", "owner": {"run_id": "r1"}}, capsys)
    assert res["result"] == "released" and res["changed"] and not os.path.exists(lock_dir)


def test_module_refusal_names_the_holder(lock_dir, capsys):
    L.take_lease(lock_dir, owner("awx-4711", "awx-job-4711"), lease_s=300)
    res = run_main({"path": lock_dir, "owner": owner("r2")}, capsys)
    assert res["failed"] and res["result"] == "refused" and not res["acquired"]
    for word in ("awx-4711", "awx-job-4711", "pid 4242", "user ops", "lease expires", "unlock.yml"):
        assert word in res["msg"], (word, res["msg"])


def test_module_renewal_fails_when_the_lock_was_lost(lock_dir, capsys):
    L.take_lease(lock_dir, owner("r9"), lease_s=300)
    res = run_main({"path": lock_dir, "state": "renewed", "owner": {"run_id": "r1"}}, capsys)
    assert res["failed"] and "now held by run r9" in res["msg"]


def test_module_query_and_forced_remove_for_unlock(lock_dir, capsys):
    assert run_main({"path": lock_dir, "state": "query"}, capsys)["result"] == "free"
    L.take_lease(lock_dir, owner("r1"), lease_s=300)
    res = run_main({"path": lock_dir, "state": "query"}, capsys)
    assert res["result"] == "held" and res["lock"]["run_id"] == "r1" and not res["changed"]
    res = run_main({"path": lock_dir, "state": "absent", "force": True, "_ansible_check_mode": True}, capsys)
    assert res["result"] == "removed" and os.path.isdir(lock_dir) and "would remove" in res["msg"]
    res = run_main({"path": lock_dir, "state": "absent", "force": True, "_ansible_diff": True}, capsys)
    assert res["result"] == "removed" and res["changed"] and not os.path.exists(lock_dir)
    assert '"run_id": "r1"' in res["diff"]["before"] and res["diff"]["after"] == ""


def test_module_needs_a_run_id_to_take(lock_dir, capsys):
    res = run_main({"path": lock_dir, "owner": {"controller": "x"}}, capsys)
    assert res["failed"] and "owner.run_id" in res["msg"] and not os.path.exists(lock_dir)


def test_module_judges_a_legacy_lock_by_lease_s_without_the_floor(lock_dir, capsys):
    os.makedirs(lock_dir)
    with open(os.path.join(lock_dir, "owner.json"), "w") as handle:
        json.dump({"run_id": "old-1", "controller": "awx-1", "pid": 99}, handle)
    past = time.time() - 5
    os.utime(lock_dir, (past, past))
    os.utime(os.path.join(lock_dir, "owner.json"), (past, past))
    res = run_main({"path": lock_dir, "owner": owner("r2"), "lease_s": 1, "min_lease_s": 300}, capsys)
    assert res["result"] == "taken_over" and res["previous_holder"]["run_id"] == "old-1"
    assert res["lock"]["lease_s"] == 300
