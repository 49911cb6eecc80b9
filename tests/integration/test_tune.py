"""Lab tests of the tune loop (issue 34): SGLang's own benchmark client, and tune.yml.

``bench_lab``: the session's lab with SGLang's benchmark client usable on every host (tests/lab/bench_deps.py: the
client's dependencies from PyPI, once, into a shared cache dir added to each host venv by a ``.pth``; a tokenizer
built locally into each host's target model dir). Only this module asks for it; it is taken away again after.

tune.yml (one real run over real SSH on one canary host): the baseline (the lab's inventory values: the seed's NCCL
set, 3-step EAGLE-3 speculation), a candidate with 2-step speculation (the stand-in's speed table makes it the
fastest: it reads the flags from its argv and the NCCL values from its workers' environment) and a candidate whose
server cannot start (fault knob crash_with_arg on a flag only that candidate passes), two repeats each, measured
with module sglang_bench_serving (the real client) with short lengths. Asserted on the host afterwards: the canary
serves the winner's values (read from the workers' environment and the server's argv), the JSON report's shape and
decision, the failed candidate's note and that the loop went on; bad candidates are refused before the canary is
touched (the server's pid unchanged).
"""
import importlib.util
import json
import os
import re
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpufleet_lab_tool_tune", os.path.join(ROOT, "tests", "lab", "lab.py"))
labtool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(labtool)

# Once per CI run (not again under ansible-core 2.21): the benchmark client's dependencies (torch and its CUDA
# libraries, ~6 GB) are installed per controller Python, and the tune run takes minutes; the tune decisions are
# unit-tested under every ansible-core.
pytestmark = [pytest.mark.lab, pytest.mark.lab_only_once]

KEY = "sk-gpufleet-tune-3f9c0d"
# The stand-in's fixed decode speed for these tests (faults.json knob tokens_per_s: it replaces the speed model).
TOKENS_PER_S = 400.0


@pytest.fixture(scope="module")
def bench_lab(lab):
    state = labtool.load_state(labtool.Names(lab.lab_dir))
    t0 = time.time()
    got = None
    for host in lab.hosts:
        got = labtool.bench_deps.enable(labtool.host_entry(state, host), log=lambda _msg: None)
    print("bench deps on %d hosts: %s, %.1f s" % (len(lab.hosts), "cached" if got["cached"] else "installed",
                                                   time.time() - t0))
    try:
        yield lab
    finally:
        for host in lab.hosts:
            labtool.bench_deps.disable(labtool.host_entry(state, host))


def _ps(lab, host):
    res = lab.exec(host, ["ps", "-eo", "pid=,args="], check=True)
    return {int(p): a for p, _, a in (line.strip().partition(" ") for line in res.stdout.splitlines()) if p}


def _stop_standin(lab, host, pid, timeout_s=30):
    lab.exec(host, ["kill", "-TERM", str(pid)])
    deadline = time.time() + timeout_s
    while time.time() < deadline and pid in _ps(lab, host):
        time.sleep(0.2)


def _result(lab, runner, host):
    """The module's result on ``host``, with ``failed`` set from the event (runner_on_failed)."""
    for status in ("runner_on_ok", "runner_on_failed"):
        for data in lab.events(runner, status, "sglang_bench_serving"):
            if data["host"] == host:
                return dict(data["res"], failed=status == "runner_on_failed")
    with open(runner.stdout.name) as fh:
        raise AssertionError("no sglang_bench_serving result for %s:\n%s" % (host, fh.read()[-3000:]))


@pytest.mark.lab_only_once
def test_real_bench_serving_measures_the_standin_and_refuses_without_the_key(bench_lab):
    """SGLang 0.5.23's own client (python -m sglang.benchmark.serving) through the module against the stand-in
    with --api-key: without the key the task fails saying why and the server serves on untouched; with it the
    figures follow the stand-in's configured speed, every request completes, TTFT and ITL are measured."""
    lab = bench_lab
    host = lab.hosts[0]
    hv = lab.host_vars(host)
    # The lab is shared: a server another module left on this host would keep the port, and the key-less request
    # would reach it (CI saw that). Stop it the way an operator would, and see the port free before starting ours.
    lab.stop_server(host)
    lab.fault(host, tokens_per_s=TOKENS_PER_S)
    pid = lab.start_standin(host, args=dict(hv["sglang_launch_args"], **{"api-key": KEY}))
    try:
        assert lab.wait_http(host, timeout_s=60) == 200
        url = "http://%s:%d" % (hv["sglang_host"], hv["sglang_port"])
        args = {"python": hv["sglang_python"], "url": url, "num_prompts": 4, "max_concurrency": 1,
                "input_len": 32, "output_len": 64, "seed": 3, "warmup_requests": 1,
                "env": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}

        refused = lab.run_module("gpufleet.fleet.sglang_bench_serving", args, hosts=host)
        res = _result(lab, refused, host)
        assert res.get("failed"), res
        # SGLang answers 401 without the key: the module says so before the client would poll /v1/models for 60 s
        assert res["msg"] == ("the server at %s refused the benchmark (HTTP 401): it was started with --api-key; "
                              "pass the same key as api_key" % url), res["msg"]
        assert lab.wait_http(host, timeout_s=10) == 200 and pid in _ps(lab, host)  # the server serves on

        t0 = time.time()
        measured = lab.run_module("gpufleet.fleet.sglang_bench_serving", dict(args, api_key=KEY), hosts=host)
        took = time.time() - t0
        res = _result(lab, measured, host)
        assert not res.get("failed"), res.get("msg", "") + "\n" + res.get("output_tail", "")
        assert res["module"] == "sglang.benchmark.serving"
        assert res["completed"] == res["num_prompts"] == 4 and res["max_concurrency"] == 1
        # one stream at TOKENS_PER_S: below it by the HTTP and client overheads, never above it (+5 % slack)
        assert 0.5 * TOKENS_PER_S <= res["output_tok_s"] <= 1.05 * TOKENS_PER_S, res
        assert res["total_tok_s"] > res["output_tok_s"]  # input tokens counted too
        assert 0 < res["median_ttft_ms"] < 2000 and res["median_e2e_latency_ms"] > 0
        # the stand-in sends 8 chunks of 8 tokens: the client spreads each gap over its tokens, 1/400 s each
        assert 0.8 * 1000 / TOKENS_PER_S <= res["median_itl_ms"] <= 3 * 1000 / TOKENS_PER_S, res
        assert res["tokenizer"] == hv["sglang_launch_args"]["model-path"]
        assert KEY not in json.dumps(res["cmd"]) and KEY not in json.dumps(res)
        # nothing left on the host: the private dir of the client's result file is gone, the server still serves
        workdir = os.path.dirname(res["cmd"][res["cmd"].index("--output-file") + 1])
        assert os.path.basename(workdir).startswith("gpufleet-bench-")
        assert lab.exec(host, ["test", "-e", workdir]).returncode == 1
        assert lab.wait_http(host, timeout_s=10) == 200
        print("module run with the real client: %.1f s, %.1f tok/s single stream at %.0f" % (
            took, res["output_tok_s"], TOKENS_PER_S))
    finally:
        _stop_standin(lab, host, pid)
        lab.fault(host, tokens_per_s=None)


# tune.yml

PLAYBOOK = "playbooks/tune.yml"
FAST = {"sglang_stop_grace_s": 10, "sglang_launch_ready_slice_s": 5}
# Short measurements: a round is a restart and two bench runs of a few short requests.
SHORT = {"gpufleet_tune_repeats": 2, "gpufleet_tune_num_prompts": 3, "gpufleet_tune_input_len": 16,
         "gpufleet_tune_output_len": 24, "gpufleet_tune_concurrency": 2, "gpufleet_tune_warmup_requests": 1}
CRASH_FLAG = "--max-running-requests"
# The lab has no network: the client loads the tokenizer the stand-in names, from the host's model dir.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

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
def tuned(bench_lab, tmp_path_factory):
    """One real tune.yml run on the last lab host: (host, runner, report, stdout, profile dir)."""
    lab = bench_lab
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
                                                            gpufleet_profile_dir=profiles,
                                                            gpufleet_tune_bench_env=OFFLINE))
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
    # the server that serves is the verified launch of the winner's values (its launch record) ...
    record = json.loads(lab.exec(host, ["cat", "%s/launch.json" % lab.host_vars(host)["sglang_state_dir"]],
                                 check=True).stdout)
    assert record["pid"] == pid, record
    argv = record["argv"]
    assert argv[argv.index("--speculative-num-steps") + 1] == "2", argv
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "3", argv
    assert CRASH_FLAG not in argv
    # ... as the server itself parsed them (its last server_args line) ...
    log = lab.exec(host, ["cat", "%s/sglang.log" % lab.host_vars(host)["sglang_state_dir"]], check=True).stdout
    parsed = [line for line in log.splitlines() if "server_args=ServerArgs(" in line][-1]
    assert "speculative_num_steps=2," in parsed and "speculative_num_draft_tokens=3," in parsed, parsed
    # ... and the NCCL values reached every worker
    envs = worker_envs(lab, host)
    assert len(envs) == 8, envs.keys()
    for env in envs.values():
        for name, value in lab.group_vars["sglang_nccl_env"].items():
            assert env.get(name) == str(value), (name, env)


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
    ([{"name": "x", "sglang_nccl_env": {"NCCL_PROTO": "LL;rm"}}], "NCCL_PROTO='LL;rm'"),
    ([{"name": "x", "sglang_launch_args": {"tp-size": 8}, "sglang_env": {}}], "unknown key(s) sglang_env"),
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
    if len(lab.hosts) < 2:
        pytest.skip("needs a lab of two hosts or more")
    before = {h: server_pid(lab, h) for h in lab.hosts}
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, target="gpu_hosts", gpufleet_tune_candidates=candidates()))
    out = stdout_of(runner)
    assert runner.status == "failed" and "tunes exactly one canary host" in out, out[-4000:]
    assert {h: server_pid(lab, h) for h in lab.hosts} == before


@pytest.mark.lab_only_once
def test_check_mode_is_refused_before_the_canary_is_touched(lab):
    host = lab.hosts[-1]
    before = ensure_serving(lab, host)
    runner = lab.run_playbook(PLAYBOOK, check=True, extravars=dict(FAST, target=host,
                                                                   gpufleet_tune_candidates=candidates()))
    out = stdout_of(runner)
    assert runner.status == "failed" and "tune.yml cannot run with --check" in out, out[-4000:]
    assert server_pid(lab, host) == before
    assert not lab.events(runner, "runner_on_ok", "sglang_bench_serving")


@pytest.mark.lab_only_once
def test_values_pinned_by_extra_vars_are_refused_before_the_canary_is_touched(lab):
    # -e sglang_launch_args=... wins over set_fact: every round would launch the same server under another name.
    host = lab.hosts[-1]
    before = ensure_serving(lab, host)
    pinned = dict(lab.host_vars(host)["sglang_launch_args"])
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, target=host, gpufleet_tune_candidates=candidates(),
                                                       sglang_launch_args=pinned))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    assert "given as an extra var (-e)" in out and "Nothing was changed" in out, out[-4000:]
    assert server_pid(lab, host) == before
    assert not lab.events(runner, "runner_on_ok", "sglang_stop")
    assert not lab.events(runner, "runner_on_ok", "sglang_bench_serving")


def _launch_record(lab, host):
    res = lab.exec(host, ["cat", "%s/launch.json" % lab.host_vars(host)["sglang_state_dir"]])
    return json.loads(res.stdout) if res.returncode == 0 and res.stdout.strip() else {}


@pytest.mark.lab_only_once
def test_a_failed_end_restart_fails_the_run_and_says_what_the_canary_serves(bench_lab, tmp_path):
    # The baseline stays (the candidate is 12 tok/s slower, no noise) and the candidate's round ran last, so the end
    # restarts the canary to the baseline. Once the baseline's round has launched, a knob makes every start whose
    # argv holds --trust-remote-code (the baseline's, not the candidate's: it removes the flag) crash: the end restart
    # fails and its rollback puts back the last verified launch, the candidate's. The run must fail and say so.
    import threading
    lab = bench_lab
    host = lab.hosts[-1]
    before = ensure_serving(lab, host)
    lab.fault(host, perf_noise=0)
    report_path = str(tmp_path / "tune.json")
    slow = {"name": "slow", "sglang_launch_args": {"speculative-num-steps": 5, "trust-remote-code": None}}
    stop, armed = threading.Event(), []

    def arm():  # the baseline's round launched and verified (a new launch record): arm the crash
        while not stop.is_set():
            record = _launch_record(lab, host)
            if record.get("pid") not in (None, before) and "--trust-remote-code" in record.get("argv", []):
                lab.fault(host, perf_noise=0, crash_with_arg="--trust-remote-code")
                armed.append(record["pid"])
                return
            time.sleep(0.5)

    watcher = threading.Thread(target=arm, daemon=True)
    watcher.start()
    try:
        runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, **dict(SHORT, gpufleet_tune_repeats=1),
                                                           target=host, gpufleet_tune_candidates=[slow],
                                                           gpufleet_tune_report=report_path,
                                                           gpufleet_tune_bench_env=OFFLINE))
    finally:
        stop.set()
        watcher.join(10)
        lab.clear_faults(host)
    out = stdout_of(runner)
    assert armed, out[-6000:]
    assert runner.status == "failed", out[-6000:]
    assert re.findall(r"round 1/2 baseline .*tok/s", out) and re.findall(r"round 2/2 slow .*tok/s", out), out[-6000:]
    with open(report_path) as handle:
        report = json.load(handle)
    assert report["winner"] == "baseline" and report["serving"] == "slow", report
    assert "serves its own values" not in out
    assert ("The restart of %s to the winner baseline failed" % host) in out, out[-6000:]
    assert "the canary serves slow (this run's last verified launch" in out and "(serving: slow)" in out
    assert "rolling restart stopped" not in out
    # the table's head says it too
    assert "now: NOT the winner: the canary serves slow" in out.split("GPUFLEET TUNE", 1)[1]
    # and it is true: the server that serves is the candidate's launch (argv), its workers carry the NCCL values
    pid = server_pid(lab, host)
    assert pid and lab.wait_http(host, timeout_s=10) == 200
    # the rollback relaunched the last verified launch (the launch record's argv, the candidate's) ...
    argv = _launch_record(lab, host)["argv"]
    assert argv[argv.index("--speculative-num-steps") + 1] == "5" and "--trust-remote-code" not in argv, argv
    # ... and the server that serves parsed those flags (its last server_args line: the last start)
    log = lab.exec(host, ["cat", "%s/sglang.log" % lab.host_vars(host)["sglang_state_dir"]], check=True).stdout
    parsed = [line for line in log.splitlines() if "server_args=ServerArgs(" in line][-1]
    assert "speculative_num_steps=5," in parsed, parsed
    for env in worker_envs(lab, host).values():
        for name, value in lab.group_vars["sglang_nccl_env"].items():
            assert env.get(name) == str(value), (name, env)


@pytest.mark.lab_only_once
@pytest.mark.parametrize("settings, words", [
    ({"gpufleet_tune_repeats": 0}, "gpufleet_tune_repeats must be an integer of 1 or more, got '0'"),
    ({"gpufleet_tune_output_len": -1, "gpufleet_tune_metric": "tok_s"}, "gpufleet_tune_metric must be one of"),
    ({"gpufleet_tune_profile": "kimi ll"}, "gpufleet_tune_profile 'kimi ll' is not a profile name"),
])
def test_bad_settings_are_refused_before_the_canary_is_touched(lab, settings, words):
    host = lab.hosts[-1]
    before = ensure_serving(lab, host)
    # as -e key=value gives them: strings
    runner = lab.run_playbook(PLAYBOOK, extravars=dict(FAST, target=host, gpufleet_tune_candidates=candidates(),
                                                       **{k: str(v) for k, v in settings.items()}))
    out = stdout_of(runner)
    assert runner.status == "failed", out[-4000:]
    assert words in out and "Nothing was changed" in out, out[-4000:]
    assert server_pid(lab, host) == before
    assert not lab.events(runner, "runner_on_ok", "sglang_stop")
