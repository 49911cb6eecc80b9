"""playbooks/tune.yml against the lab (issue 34): one real tune run over real SSH on one canary host.

The baseline (the lab's inventory values: the seed's NCCL set, 3-step EAGLE-3 speculation), a candidate with
2-step speculation (the stand-in's speed table makes it the fastest: it reads the flags from its argv and the NCCL
values from its workers' environment) and a candidate whose server cannot start (fault knob crash_with_arg on a
flag only that candidate passes), two repeats each, measured with module sglang_bench_serving with short lengths.
Asserted on the host afterwards: the canary serves the winner's values (read from the workers' environment and the
server's argv), the JSON report's shape and decision, the failed candidate's note and that the loop went on; and
bad candidates are refused before the canary is touched (the server's pid unchanged).
"""
import json
import os
import re

import pytest

pytestmark = pytest.mark.lab

PLAYBOOK = "playbooks/tune.yml"
FAST = {"sglang_stop_grace_s": 10, "sglang_launch_ready_slice_s": 5}
# Short measurements: a round is a restart and two bench runs of a few short requests.
SHORT = {"gpufleet_tune_repeats": 2, "gpufleet_tune_num_prompts": 3, "gpufleet_tune_input_len": 16,
         "gpufleet_tune_output_len": 24, "gpufleet_tune_concurrency": 2, "gpufleet_tune_warmup_requests": 1}
CRASH_FLAG = "--max-running-requests"

# Reads every process titled sglang::scheduler_TP<n> on the host and prints {title:pid: environ} as JSON.
WORKER_ENV = r"""
import json, os, re
out = {}
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        title = open('/proc/%s/cmdline' % pid, 'rb').read().split(b'\0')[0].decode('utf-8', 'replace')
        if re.match(r'sglang::scheduler_TP\d+$', title):
            env = open('/proc/%s/environ' % pid, 'rb').read()
            out[title + ':' + pid] = dict(e.decode('utf-8', 'backslashreplace').partition('=')[::2]
                                          for e in env.split(b'\0') if b'=' in e)
    except OSError:
        pass
print(json.dumps(out))
"""


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def server_pid(lab, host):
    res = lab.exec(host, ["cat", "%s/sglang.pid" % lab.host_vars(host)["sglang_state_dir"]])
    return int(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def cmdline(lab, host, pid):
    return lab.exec(host, ["cat", "/proc/%d/cmdline" % pid]).stdout.split("\0")


def worker_envs(lab, host):
    res = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", WORKER_ENV], check=True)
    return json.loads(res.stdout)


def ensure_serving(lab, host):
    pid = server_pid(lab, host)
    if not (pid and lab.wait_http(host, timeout_s=2) == 200):
        runner = lab.run_playbook("playbooks/restart.yml", extravars=FAST, limit=host)
        assert runner.status == "successful", stdout_of(runner)[-4000:]
        pid = server_pid(lab, host)
    return pid


def candidates():
    return [{"name": "spec2", "note": "2-step speculation",
             "sglang_launch_args": {"speculative-num-steps": 2, "speculative-num-draft-tokens": 3}},
            {"name": "cannot-start", "sglang_launch_args": {CRASH_FLAG.lstrip("-"): 7}}]


@pytest.fixture(scope="module")
def tuned(lab, tmp_path_factory):
    """One real tune.yml run on the last lab host: (host, runner, report, stdout, profile dir)."""
    host = lab.hosts[-1]
    ensure_serving(lab, host)
    work = tmp_path_factory.mktemp("tune")
    report_path, profiles = str(work / "tune.json"), str(work / "profiles")
    lab.fault(host, crash_with_arg=CRASH_FLAG)
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, **SHORT, target=host,
                                                            gpufleet_tune_candidates=candidates(),
                                                            gpufleet_tune_report=report_path,
                                                            gpufleet_tune_profile="tuned-canary",
                                                            gpufleet_profile_dir=profiles))
    finally:
        lab.clear_faults(host)
    out = stdout_of(runner)
    assert runner.status == "successful", out[-6000:]
    with open(report_path) as handle:
        report = json.load(handle)
    return host, runner, report, out, profiles


def test_tune_report_shape_and_the_winner_the_stand_in_speeds_make_best(lab, tuned):
    host, runner, report, out, profiles = tuned
    assert report["baseline"] == "baseline" and report["metric"] == "single_stream_tok_s"
    names = [c["name"] for c in report["candidates"]]
    assert sorted(names) == ["baseline", "cannot-start", "spec2"], names
    by = {c["name"]: c for c in report["candidates"]}
    base = by["baseline"]
    # the baseline's values are the canary's own (inventory)
    assert base["sglang_launch_args"] == lab.host_vars(host)["sglang_launch_args"]
    assert base["sglang_nccl_env"] == lab.group_vars["sglang_nccl_env"]
    assert by["spec2"]["sglang_launch_args"] == {"speculative-num-steps": 2, "speculative-num-draft-tokens": 3}
    for name in ("baseline", "spec2"):
        entry = by[name]
        assert entry["ok"] is True, entry
        for metric in ("single_stream_tok_s", "throughput_tok_s", "ttft_ms", "itl_ms"):
            figures = entry[metric]
            assert set(figures) == {"median", "min", "max", "runs"}, figures
            assert len(figures["runs"]) == 2 and figures["min"] <= figures["median"] <= figures["max"], figures
    # The speeds the stand-in itself decoded at (its log, one line per start: the table row it read from its
    # workers' environment and argv, and the base tok/s): 2-step speculation is the faster row.
    log = lab.exec(host, ["cat", "%s/sglang.log" % lab.host_vars(host)["sglang_state_dir"]], check=True).stdout
    rows = dict(re.findall(r"decode speed: row (\S+), base ([0-9.]+) tok/s", log))
    assert float(rows["seed-nccl/eagle-2-steps"]) > float(rows["seed-nccl/eagle-3-steps"]), rows
    assert by["spec2"]["single_stream_tok_s"]["median"] > base["single_stream_tok_s"]["median"], report
    assert report["winner"] == "spec2", report
    # the table follows the canary's summary row, with the report's numbers
    assert out.index("GPUFLEET SUMMARY") < out.index("GPUFLEET TUNE"), out[-4000:]
    table = out.split("GPUFLEET TUNE", 1)[1]
    assert "the winner on single_stream_tok_s is spec2" in table
    assert "%s (%s-%s)" % (by["spec2"]["single_stream_tok_s"]["median"], by["spec2"]["single_stream_tok_s"]["min"],
                           by["spec2"]["single_stream_tok_s"]["max"]) in table, table
    # progress: one line per round (3 entries x 2 repeats)
    assert len(set(re.findall(r"round (\d)/6 ", out))) == 6, out[-4000:]
    # the winner's profile, on the controller, holds its overrides
    import yaml
    with open(os.path.join(profiles, "tuned-canary.yml")) as handle:
        profile = yaml.safe_load(handle)
    assert profile["sglang_launch_args"] == by["spec2"]["sglang_launch_args"] and profile["source"]["canary"] == host


def test_tune_leaves_the_canary_serving_the_winners_values(lab, tuned):
    host, runner, report, out, profiles = tuned
    pid = server_pid(lab, host)
    assert pid and lab.wait_http(host, timeout_s=10) == 200
    argv = cmdline(lab, host, pid)
    assert argv[argv.index("--speculative-num-steps") + 1] == "2", argv
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "3", argv
    assert CRASH_FLAG not in argv
    envs = worker_envs(lab, host)
    assert len(envs) == 8, envs.keys()
    for env in envs.values():
        assert env.get("NCCL_PROTO") == "LL" and env.get("NCCL_ALGO") == "Ring", env


@pytest.mark.lab_only_once
def test_a_candidate_that_cannot_start_is_recorded_and_the_loop_goes_on(lab, tuned):
    host, runner, report, out, profiles = tuned
    bad = [c for c in report["candidates"] if c["name"] == "cannot-start"][0]
    assert bad["ok"] is False
    assert "restart failed in phase launch" in bad["note"] and "rollback: rolled_back" in bad["note"], bad
    assert bad["single_stream_tok_s"]["runs"] == []
    # both of its rounds ran and failed; the rounds after them measured
    assert len(re.findall(r"cannot-start \(repeat \d/2\): FAILED", out)) == 2, out[-4000:]
    rounds = re.findall(r"round (\d)/6 (\S+) \(repeat \d/2\): (FAILED)?", out)
    assert [int(r[0]) for r in rounds] == list(range(1, 7)), rounds
    failed_at = [int(r[0]) for r in rounds if r[2]]
    assert any(not r[2] and int(r[0]) > failed_at[0] for r in rounds), rounds


@pytest.mark.lab_only_once
@pytest.mark.parametrize("bad, words", [
    ([{"name": "baseline", "sglang_launch_args": {"speculative-num-steps": 2}}], "baseline"),
    ([{"name": "x", "sglang_nccl_env": {"NOT_NCCL": "1"}}], "NOT_NCCL"),
])
def test_bad_candidates_are_refused_before_the_canary_is_touched(lab, bad, words):
    host = lab.hosts[-1]
    before = ensure_serving(lab, host)
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, target=host, gpufleet_tune_candidates=bad))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    assert "gpufleet_tune_candidates:" in out and words in out and "Nothing was changed" in out, out[-4000:]
    assert server_pid(lab, host) == before
    assert not lab.events(runner, "runner_on_ok", "sglang_stop")


@pytest.mark.lab_only_once
def test_more_than_one_canary_is_refused(lab):
    before = {h: server_pid(lab, h) for h in lab.hosts}
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, target="gpu_hosts", gpufleet_tune_candidates=candidates()))
    out = stdout_of(runner)
    assert runner.status == "failed" and "tunes exactly one canary host" in out, out[-4000:]
    assert {h: server_pid(lab, h) for h in lab.hosts} == before
