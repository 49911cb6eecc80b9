"""Lab tests of the weight prefetch (issue 35: role sglang_prefetch, module sglang_weights_prefetch) over real SSH.

The lab host's model dirs get real safetensors checkpoints (tests/lab/weights.py: random bytes, written cold), and
the stand-in really reads them at start and keeps them mapped, reporting on /get_server_info how much of them was in
the page cache when it began (``weights_resident_before_pct``). Asserted on the host afterwards: a restart brings the
new launch's files into the page cache before the stop, so the new server starts on resident weights; a prefetch
that meets the memory bound stops there, says how much it left cold, and leaves the serving server's mapped pages
resident (its smaps Rss); ``--check`` reads nothing; a bad setting is refused before anything is touched.

All lab hosts share this machine's page cache: the files here are the only weight files of the lab, so what
fincore sees of them is this test's doing. One host, the last.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB_PY = os.path.join(ROOT, "tests", "lab", "lab.py")
_spec = importlib.util.spec_from_file_location("gpufleet_lab_weights", os.path.join(ROOT, "tests", "lab", "weights.py"))
weights = importlib.util.module_from_spec(_spec)  # tests/lab/weights.py: the lab's checkpoints
_spec.loader.exec_module(weights)
PLAYBOOK = "playbooks/restart.yml"
MIB = 1 << 20

# Once per CI run: the prefetch reads files on the host the same way under every ansible-core; its decisions are
# unit-tested under each.
pytestmark = [pytest.mark.lab, pytest.mark.lab_only_once]


def _lab_py(lab, *argv):
    res = subprocess.run([sys.executable, LAB_PY] + list(argv) + ["--lab-dir", lab.lab_dir], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def server_pid(lab, host):
    state = lab.host_vars(host)["sglang_state_dir"]
    res = lab.exec(host, ["cat", os.path.join(state, "sglang.pid")])
    return int(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def row_of(lab, runner, host):
    return [d for d in lab.events(runner, "playbook_on_stats")][-1]["artifact_data"]["gpufleet_restart"][host]


def resident(lab, host, model):
    """(resident bytes, total bytes) of a model dir of the host (lab.py resident: util-linux fincore)."""
    got = json.loads(_lab_py(lab, "resident", "--host", host))[host][model]
    return got["resident_bytes"], got["total_bytes"]


def server_info(lab, host):
    hv = lab.host_vars(host)
    code = ("import urllib.request as u; print(u.urlopen('http://%s:%d/get_server_info', timeout=10).read().decode())"
            % (hv["sglang_host"], hv.get("sglang_port", 30000)))
    return json.loads(lab.exec(host, [hv["sglang_python"], "-c", code], check=True).stdout)


def shard_rss_bytes(lab, host, pid, model_dir):
    """Rss over the process's mappings of the shards in ``model_dir`` (/proc/<pid>/smaps): its resident pages."""
    return weights.shard_rss_bytes(lab.exec(host, ["cat", "/proc/%d/smaps" % pid], check=True).stdout, model_dir)


def restart(lab, host, extravars=None, check=False):
    runner = lab.run_playbook(PLAYBOOK, extravars=dict({"target": host}, **(extravars or {})), check=check)
    return runner, stdout_of(runner)


def module(lab, host, args, check=False):
    # ad hoc k=v arguments: a list is given comma-separated (a JSON string would be one path)
    args = dict(args, paths=",".join(args["paths"]))
    runner = lab.run_module("gpufleet.fleet.sglang_weights_prefetch", args, hosts=host, check=check)
    for status in ("runner_on_ok", "runner_on_failed"):
        for data in lab.events(runner, status, "sglang_weights_prefetch"):
            if data["host"] == host:
                return dict(data["res"], failed=status == "runner_on_failed")
    raise AssertionError("no sglang_weights_prefetch result for %s:\n%s" % (host, stdout_of(runner)[-3000:]))


def reserve_for_headroom(lab, host, path, headroom_mib):
    """sglang_prefetch_reserve_mib that leaves about ``headroom_mib`` between MemFree and the watermarks now, from
    the module's own reading of them (check mode reads no file)."""
    bound = module(lab, host, {"paths": [path]}, check=True)["bound"]
    return max(int((bound["mem_free_bytes"] - bound["watermark_bytes"]) // MIB) - headroom_mib, 0)


@pytest.fixture(scope="module")
def host(lab):
    """The last host, with the usual lab model dirs and no weight files afterwards, left as found: serving when it
    served, else stopped."""
    name = lab.hosts[-1]
    was_serving = server_pid(lab, name) is not None and lab.wait_http(name, timeout_s=1) == 200
    lab.fault(name, slow_load_s=0)
    try:
        yield name
    finally:
        lab.clear_faults(name)
        for model in ("target", "draft"):
            _lab_py(lab, "weights", "--host", name, "--model", model, "--size-mib", "0")
        # the server maps the removed files: restart it on the usual dirs, or stop it as it was found
        runner = lab.run_playbook(PLAYBOOK, extravars={"target": name}, tags=None if was_serving else "stop,wait")
        assert runner.status == "successful", stdout_of(runner)[-3000:]


def test_a_restart_prefetches_the_new_weights_before_the_stop_and_the_server_starts_on_them_resident(lab, host):
    hv = lab.host_vars(host)
    target = hv["sglang_launch_args"]["model-path"]
    first, out = restart(lab, host)  # a server on the usual config-only dirs: nothing to prefetch yet
    assert first.status == "successful", out[-3000:]
    old = server_pid(lab, host)
    _lab_py(lab, "weights", "--host", host, "--size-mib", "512", "--shards", "2")  # written cold
    cold, total = resident(lab, host, os.path.basename(target))
    assert cold < 0.01 * total

    runner, out = restart(lab, host)
    assert runner.status == "successful", out[-3000:]
    row = row_of(lab, runner, host)
    assert row["result"] == "ok" and row["old_pid"] == old and server_pid(lab, host) not in (None, old)
    assert 0.48 <= row["prefetch_gib"] <= 0.52 and row["resident_pct"] == 100.0 and row["prefetch_s"] > 0, row
    assert row["advice"] is None  # nothing left cold, nothing skipped: no note
    assert re.search(r"^%s\s+ok\s+[\d.]+\s+\d+\s+0\.5G/[\d.]+s/100%%\s" % re.escape(host), out, re.M), out[-2000:]
    # the new server found its weights in the page cache when it began to read them
    info = server_info(lab, host)
    assert info["weights_files"] == 2 and info["weights_bytes"] >= 512 * MIB
    assert info["weights_resident_before_pct"] >= 99.0, info
    # the prefetch ran before the restart lock was taken (read-only: it needs none)
    assert out.index("Read the new launch's weight files into the page cache") < out.index("Take the restart lock")


def test_a_prefetch_that_meets_the_memory_bound_stops_says_so_and_leaves_the_servers_pages(lab, host):
    hv = lab.host_vars(host)
    target, draft = hv["sglang_launch_args"]["model-path"], hv["sglang_launch_args"]["speculative-draft-model-path"]
    if server_pid(lab, host) is None or not any(n.endswith(".safetensors") for n in os.listdir(target)):
        _lab_py(lab, "weights", "--host", host, "--size-mib", "512", "--shards", "2")  # run alone (-k)
        first, out = restart(lab, host)
        assert first.status == "successful", out[-3000:]
    pid = server_pid(lab, host)
    serving_rss = shard_rss_bytes(lab, host, pid, target)
    assert serving_rss > 0.99 * 512 * MIB  # the serving stand-in maps its 512 MiB of weights, all resident
    # the next launch also reads 1 GiB of draft weights, cold
    _lab_py(lab, "weights", "--host", host, "--model", "draft", "--size-mib", "1024", "--shards", "4")
    draft_model = os.path.basename(draft)

    # --check reads nothing: the draft stays cold, the server untouched
    checked, out = restart(lab, host, check=True)
    assert checked.status == "successful", out[-3000:]
    assert row_of(lab, checked, host)["result"] == "check" and server_pid(lab, host) == pid
    got, total = resident(lab, host, draft_model)
    assert got < 0.01 * total

    # the module alone, with about 128 MiB of headroom: it stops at the bound, far short of the 1 GiB
    reserve = reserve_for_headroom(lab, host, draft, 128)
    res = module(lab, host, {"paths": [draft], "reserve_mib": reserve})
    assert not res["failed"] and res["stopped_by"] == "memory" and res["done"] is True, res
    assert 0 < res["cold_bytes"] and res["read_bytes"] < 512 * MIB, res
    assert res["residency_method"] == "mincore"
    got, total = resident(lab, host, draft_model)
    assert got < 0.5 * total
    # what the serving server has mapped is all still resident
    assert shard_rss_bytes(lab, host, pid, target) >= serving_rss

    # the same bound in a restart: it says how much it left cold, and the host serves again on both models
    reserve = reserve_for_headroom(lab, host, draft, 128)
    runner, out = restart(lab, host, {"sglang_prefetch_reserve_mib": reserve})
    assert runner.status == "successful", out[-3000:]
    row = row_of(lab, runner, host)
    assert row["result"] == "ok" and server_pid(lab, host) not in (None, pid)
    assert row["resident_pct"] < 100.0, row
    assert re.search(r"prefetch stopped at the memory bound \(it never makes the kernel reclaim\): [\d.]+ GiB left "
                     r"cold \(MemFree [\d.]+ GiB less watermarks [\d.]+ GiB and reserve [\d.]+ GiB\)",
                     row["advice"] or ""), row
    assert "prefetch stopped at the memory bound" in out.split("GPUFLEET SUMMARY", 1)[1]
    info = server_info(lab, host)
    assert info["weights_files"] == 6 and info["weights_bytes"] >= 1536 * MIB
    assert lab.wait_http(host, timeout_s=10) == 200


def test_a_bad_prefetch_setting_is_refused_before_any_host_is_touched(lab, host):
    before = server_pid(lab, host)
    runner, out = restart(lab, host, {"sglang_prefetch_reserve_mib": -5})
    assert runner.status == "failed"
    assert "sglang_prefetch_reserve_mib" in out, out[-3000:]
    assert server_pid(lab, host) == before
    if before:
        assert lab.wait_http(host, timeout_s=10) == 200
    assert "Read the new launch's weight files" not in out  # the guard refused in the first play
