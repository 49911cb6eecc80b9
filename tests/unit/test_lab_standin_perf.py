"""The lab stand-in's decode speed (tests/lab/standin/perf.py): table, noise, pacing (docs/lab.md "Decode speed")."""
import os
import subprocess
import sys
import time
import types

import pytest

STANDIN = os.path.join(os.path.dirname(__file__), "..", "lab", "standin")
sys.path.insert(0, STANDIN)
import perf  # noqa: E402

SEED = dict(perf.SEED_NCCL)
EAGLE3 = {"speculative-algorithm": "EAGLE3", "speculative-num-steps": 3, "speculative-eagle-topk": 1,
          "speculative-num-draft-tokens": 4}


def flags(**kw):
    out = dict(EAGLE3)
    out.update({k.replace("_", "-"): v for k, v in kw.items()})
    return out


def test_the_seeds_figures():
    assert perf.decode_tok_s(SEED, flags(speculative_num_steps=2, speculative_num_draft_tokens=3)) == (
        "seed-nccl/eagle-2-steps", 94.0)
    assert perf.decode_tok_s(SEED, EAGLE3) == ("seed-nccl/eagle-3-steps", 82.5)  # the stable baseline
    assert perf.decode_tok_s({}, EAGLE3) == ("no-nccl/eagle-3-steps", 60.0)  # values did not reach the workers


def test_every_named_row_is_what_decode_tok_s_gives():
    envs = {"seed-nccl": SEED, "no-nccl": {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}}
    spec = {"eagle-1-step": flags(speculative_num_steps=1), "eagle-2-steps": flags(speculative_num_steps=2),
            "eagle-3-steps": EAGLE3, "eagle-4-steps": flags(speculative_num_steps=4),
            "eagle-tree": flags(speculative_eagle_topk=4, speculative_num_draft_tokens=8),
            "no-speculation": {"tp-size": 8}}
    for name, tok_s in perf.TABLE.items():
        nccl, _, row = name.partition("/")
        assert perf.decode_tok_s(envs[nccl], spec[row]) == (name, tok_s), name


def test_two_rows_within_8_percent_and_a_clear_best():
    ranked = sorted(perf.TABLE.values(), reverse=True)
    assert ranked[0] == 94.0 and ranked[1] == 88.0
    assert (ranked[0] - ranked[1]) / ranked[0] < 0.08
    assert perf.TABLE["seed-nccl/eagle-2-steps"] > perf.TABLE["seed-nccl/eagle-3-steps"] > perf.TABLE[
        "no-nccl/eagle-3-steps"]


def test_each_seed_value_counts_and_only_with_its_value():
    partial = dict(SEED, NCCL_PROTO="Simple")
    assert perf.decode_tok_s(partial, EAGLE3) == ("nccl-5of6/eagle-3-steps", 78.75)
    missing = {k: v for k, v in SEED.items() if k not in ("NCCL_ALGO", "NCCL_NTHREADS")}
    assert perf.decode_tok_s(missing, EAGLE3) == ("nccl-4of6/eagle-3-steps", 75.0)
    # integers as an inventory writes them compare as the strings the environment holds
    assert perf.decode_tok_s(dict(SEED, NCCL_MAX_NCHANNELS=16), EAGLE3)[1] == 82.5


def test_other_environment_is_ignored():
    noisy = dict(SEED, PATH="/usr/bin", SGLANG_X="1", NCCL_DEBUG="INFO", NCCL_NVLS_ENABLE="1",
                 CUDA_DEVICE_MAX_CONNECTIONS="8", nccl_proto="Simple")
    assert perf.decode_tok_s(noisy, EAGLE3) == perf.decode_tok_s(SEED, EAGLE3)
    assert perf.decode_tok_s(None, EAGLE3) == perf.decode_tok_s({}, EAGLE3)


def test_speculative_flags_first_match_and_their_defaults():
    # argparse dests (underscores) as the stand-in passes vars(args), dash-less names, or --flags
    assert perf.decode_tok_s(SEED, {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2})[1] == 94.0
    assert perf.decode_tok_s(SEED, {"--speculative-algorithm": "EAGLE", "--speculative-num-steps": "2"})[1] == 94.0
    assert perf.decode_tok_s(SEED, {"speculative-algorithm": "NEXTN"})[0] == "seed-nccl/eagle-3-steps"  # steps 3
    assert perf.decode_tok_s(SEED, {"speculative-algorithm": "eagle3", "speculative-num-steps": 7}) == (
        "seed-nccl/eagle-5+-steps", 70.5)
    assert perf.decode_tok_s(SEED, flags(speculative_num_steps=2, speculative_eagle_topk=2)) == (
        "seed-nccl/eagle-tree", 79.5)  # topk > 1 before steps
    assert perf.decode_tok_s(SEED, {"speculative-algorithm": "NGRAM", "speculative-num-steps": 2}) == (
        "seed-nccl/other-algorithm", 72.5)
    assert perf.decode_tok_s(SEED, {"speculative-algorithm": None, "speculative-num-steps": 2}) == (
        "seed-nccl/no-speculation", 60.0)
    # draft tokens are read but do not move the figure (topk 1: SGLang drafts steps + 1)
    assert perf.decode_tok_s(SEED, flags(speculative_num_draft_tokens=9)) == perf.decode_tok_s(SEED, EAGLE3)
    assert perf.decode_tok_s({}, {})[1] == 37.5


def test_noise_is_bounded_and_deterministic_per_seed_and_start():
    factors = [perf.noise_factor(seed, start, 0.05) for seed in range(20) for start in range(1, 51)]
    assert all(0.95 <= f <= 1.05 for f in factors)
    assert min(factors) < 0.96 and max(factors) > 1.04  # it uses the whole band
    assert len(set(factors)) == len(factors)
    assert perf.noise_factor(7, 3, 0.05) == perf.noise_factor(7, 3, 0.05)
    assert perf.noise_factor(7, 3, 0.05) != perf.noise_factor(8, 3, 0.05) != perf.noise_factor(7, 4, 0.05)
    assert perf.noise_factor(7, 3, 0) == 1.0
    # a known value, so a change of the generator shows (random.Random of a str seed is stable across runs)
    first = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); import perf; "
                            "print(repr(perf.noise_factor(7, 3, 0.05)))" % STANDIN],
                           capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONHASHSEED="123"))
    assert float(first.stdout) == perf.noise_factor(7, 3, 0.05)


def test_start_counter_counts_per_dir_and_start_speed_uses_it(tmp_path):
    assert [perf.next_start(str(tmp_path)) for _ in range(3)] == [1, 2, 3]
    knobs = {"perf_seed": 5, "perf_noise": 0.05}
    speed = perf.start_speed(SEED, EAGLE3, knobs, [str(tmp_path / "other")])
    assert speed["start"] == 1 and speed["row"] == "seed-nccl/eagle-3-steps" and speed["base"] == 82.5
    assert speed["factor"] == perf.noise_factor(5, 1, 0.05)
    assert speed["effective"] == pytest.approx(82.5 * speed["factor"])
    again = perf.start_speed(SEED, EAGLE3, knobs, [str(tmp_path / "other")])
    assert again["start"] == 2 and again["factor"] != speed["factor"]
    exact = perf.start_speed(SEED, EAGLE3, {"perf_noise": 0}, [str(tmp_path / "x")])
    assert exact["effective"] == 82.5 and exact["seed"] == perf.DEFAULT_SEED
    default = perf.start_speed(SEED, EAGLE3, {}, [str(tmp_path / "y")])
    assert default["noise"] == 0.05


def test_start_counter_falls_through_an_unwritable_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    speed = perf.start_speed(SEED, EAGLE3, {}, [None, str(blocker / "sub"), str(tmp_path / "ok")])
    assert speed["start"] == 1 and (tmp_path / "ok" / perf.STARTS_FILE).read_text().strip() == "1"
    assert perf.start_speed(SEED, EAGLE3, {}, [str(blocker / "sub")])["start"] == 0


def test_environ_of_a_live_process_and_of_an_overwritten_one():
    env = dict(SEED, PATH=os.environ.get("PATH", "/usr/bin"))
    proc = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(30)"],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        got = perf.read_environ(proc.pid)
        assert got == env
        assert perf.decode_tok_s(got, EAGLE3)[1] == 82.5
    finally:
        proc.kill()
        proc.wait()
    assert perf.parse_environ(b"sglang::scheduler_TP0\0\0\0\0") is None  # setproctitle without SPT_NOENV
    assert perf.read_environ(2 ** 22 + 7) is None


def test_per_stream_speed_is_sub_linear_in_concurrency():
    one = perf.per_stream_tok_s(94.0, 1)
    eight = perf.per_stream_tok_s(94.0, 8)
    assert one == 94.0 and perf.per_stream_tok_s(94.0, 0) == 94.0
    assert eight < one and one < 8 * eight < 8 * one  # more throughput at 8, less than 8 times
    assert 8 * eight == pytest.approx(94.0 * 8 / 1.7)


def _server(monkeypatch, knobs, tok_s):
    import sglang_standin
    monkeypatch.setattr(sglang_standin, "faults", lambda: dict(knobs))
    srv = sglang_standin.Server(types.SimpleNamespace(tp_size=8), [], "/nonexistent", "0.5.23")
    srv.speed = {"effective": tok_s}
    return srv


def test_standin_decodes_one_token_per_event_at_the_start_speed(monkeypatch):
    srv = _server(monkeypatch, {}, 200.0)
    seen = []
    t0 = time.monotonic()
    assert srv.decode(40, lambda done: seen.append((done, time.monotonic() - t0))) is False
    elapsed = time.monotonic() - t0
    assert seen[-1][0] == 40 and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(seen) >= 20  # one event per token, a few merged when the machine lagged
    assert 0.19 <= elapsed < 0.6  # 40 tokens at 200 tok/s = 0.2 s, slack for a shared machine
    assert seen[0][1] < 0.1  # the first token comes after one token's time, not at the end


def test_standin_streams_slow_down_with_requests_in_flight(monkeypatch):
    srv = _server(monkeypatch, {}, 200.0)
    srv.inflight = 8  # seven other streams decoding
    t0 = time.monotonic()
    srv.decode(20, lambda done: None)
    assert 0.16 <= time.monotonic() - t0 < 0.6  # 20 / (200 / 1.7) = 0.17 s


def test_tokens_per_s_knob_still_wins(monkeypatch):
    srv = _server(monkeypatch, {"tokens_per_s": 400}, 10.0)
    seen = []
    t0 = time.monotonic()
    assert srv.decode(80, seen.append) is True
    assert 0.19 <= time.monotonic() - t0 < 0.6  # 80 / 400, not 80 / 10
    assert seen == [10, 20, 30, 40, 50, 60, 70, 80]  # the knob's eight chunks, as before
    body = {"text": "a b c", "sampling_params": {"max_new_tokens": 40}}
    t0 = time.monotonic()
    out = srv.generate(body)
    assert 0.09 <= time.monotonic() - t0 < 0.5 and out["meta_info"]["completion_tokens"] == 40


def test_docs_lab_md_shows_the_same_table():
    import re
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "lab.md")) as fh:
        text = fh.read().split("## Decode speed", 1)[1]
    rows = dict(re.findall(r"^\| `([a-z0-9+/-]+)` \| ([0-9.]+) \|", text, re.M))
    assert {k: float(v) for k, v in rows.items()} == perf.TABLE
    deltas = dict(re.findall(r"^\| `([a-z0-9+-]+)` \| .* \| ([−+]?[0-9.]+) \|$", text, re.M))
    assert {k: float(v.replace("−", "-")) for k, v in deltas.items()} == {n: d for n, _, d, _ in perf.SPEC_ROWS}
    assert all("`%s` | `%s`" % kv in text or "`%s`" % kv[1] in text for kv in perf.SEED_NCCL.items())
    assert "60.0 + 3.75" in text and perf.NCCL_NONE_TOK_S == 60.0 and perf.NCCL_PER_VALUE_TOK_S == 3.75
    assert "1 + 0.1 × (n − 1)" in text and perf.CONCURRENCY_COST == 0.1


def test_tune_trials_candidates_and_verdicts():
    """make tune-trials: the committed candidates' table speeds, and how a trial is judged."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import tune_trials
    import yaml
    with open(tune_trials.DEFAULT_CANDIDATES) as fh:
        candidates = yaml.safe_load(fh)["gpufleet_tune_candidates"]
    own_args = {"model-path": "/m", "tp-size": 8, "speculative-algorithm": "EAGLE3", "speculative-num-steps": 3,
                "speculative-eagle-topk": 1, "speculative-num-draft-tokens": 4}  # the lab inventory's
    speeds = tune_trials.expected_speeds(candidates, dict(perf.SEED_NCCL, NCCL_MAX_NCHANNELS=16), own_args)
    tok = {n: v for n, (_, v) in speeds.items()}
    assert tok == {"baseline": 82.5, "eagle-2-steps": 94.0, "eagle-1-step": 88.0, "eagle-4-steps": 76.5,
                   "nccl-tree-simple": 75.0}
    assert len(candidates) == 4 and tune_trials.table_best(speeds) == "eagle-2-steps"
    assert (94.0 - 88.0) / 94.0 < 0.08 and min(tok.values()) < tok["baseline"]
    log = ("[x] lab stand-in decode speed: row seed-nccl/eagle-3-steps, base 82.50 tok/s, factor 0.9700 (...)\n"
           "[y] lab stand-in decode speed: row seed-nccl/eagle-2-steps, base 94.00 tok/s, factor 1.0300 (...)\n")
    assert tune_trials.last_speed(log) == ("seed-nccl/eagle-2-steps", 94.0, 1.03)
    assert tune_trials.last_speed("no start") is None
    good = tune_trials.judge({}, speeds, {"winner": "eagle-2-steps"}, ("r", 94.0, 1.0), 200)
    assert good["picked_best"] and good["never_worse"]
    kept = tune_trials.judge({}, speeds, {"winner": "baseline"}, ("r", 82.5, 1.0), 200)
    assert not kept["picked_best"] and kept["never_worse"]
    worse = tune_trials.judge({}, speeds, {"winner": "eagle-4-steps"}, ("r", 76.5, 1.0), 200)
    assert not worse["never_worse"]
    down = tune_trials.judge({}, speeds, None, ("r", 94.0, 1.0), 503)
    assert not down["picked_best"] and not down["never_worse"]
