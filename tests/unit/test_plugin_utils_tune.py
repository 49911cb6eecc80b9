"""plugins/plugin_utils/tune.py: the tune loop's decisions (candidates, overrides, the interleaved schedule, the
statistics, the honest decision, the report and its table), with no Ansible and no host."""
import pytest

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import tune

SEED_NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": 16,
             "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": 512}
EAGLE2 = {"speculative-num-steps": 2, "speculative-num-draft-tokens": 3}


# --- check_candidates -------------------------------------------------------------------------------------------

def test_good_candidates_pass_including_null_overrides_and_a_note():
    candidates = [
        {"name": "seed-nccl", "sglang_nccl_env": SEED_NCCL, "note": "the seed's set"},
        {"name": "eagle.2_step", "sglang_launch_args": EAGLE2},
        {"name": "no-tuning", "sglang_nccl_env": {"NCCL_PROTO": None, "NCCL_ALGO": None}},
        {"name": "spec-off", "sglang_launch_args": {"speculative-algorithm": None}, "sglang_nccl_env": None},
    ]
    assert tune.check_candidates(candidates) == []
    assert tune.check_candidates(tuple(candidates[:1])) == []


@pytest.mark.parametrize("value, words", [
    (None, "must be a list of candidates"), ("seed-nccl", "got a string"), ({"name": "a"}, "got a mapping"),
    ([], "is empty"),
])
def test_anything_but_a_non_empty_list_is_refused(value, words):
    problems = tune.check_candidates(value)
    assert len(problems) == 1 and words in problems[0] and "gpufleet_tune_candidates" in problems[0]


def test_more_than_32_candidates_are_refused_32_are_fine():
    many = [{"name": "c%d" % i, "sglang_launch_args": {"speculative-num-steps": i}} for i in range(33)]
    assert tune.check_candidates(many[:32]) == []
    problems = tune.check_candidates(many)
    assert problems == ["gpufleet_tune_candidates has 33 candidates; at most 32 are tried in one run (each costs a "
                        "restart per repeat)"]


@pytest.mark.parametrize("entry, words", [
    ("seed-nccl", "candidate 1 is a string; each candidate is a mapping"),
    ({"sglang_launch_args": EAGLE2}, "candidate 1 has no name"),
    ({"name": 7, "sglang_launch_args": EAGLE2}, "candidate 1 has no name"),
    ({"name": "-dash", "sglang_launch_args": EAGLE2}, "name '-dash' must start with a letter or digit"),
    ({"name": "a/b", "sglang_launch_args": EAGLE2}, "name 'a/b' must start"),
    ({"name": "x" * 65, "sglang_launch_args": EAGLE2}, "at most 64 characters"),
    ({"name": "Baseline", "sglang_launch_args": EAGLE2}, "the name baseline is taken by the canary's own values"),
    ({"name": "a", "sglang_launch_args": EAGLE2, "nccl": {}}, "candidate 1 (a): unknown key(s) nccl"),
    ({"name": "a"}, "candidate 1 (a) overrides nothing"),
    ({"name": "a", "sglang_nccl_env": {}, "sglang_launch_args": {}}, "overrides nothing"),
    ({"name": "a", "sglang_nccl_env": ["NCCL_PROTO=LL"]}, "sglang_nccl_env is a list; give a mapping"),
    ({"name": "a", "sglang_launch_args": "--speculative-num-steps 2"}, "sglang_launch_args is a string"),
    ({"name": "a", "sglang_nccl_env": {"nccl_proto": "LL"}}, "NCCL reads NCCL_PROTO (capitals)"),
    ({"name": "a", "sglang_nccl_env": {"NCCL-PROTO": "LL"}}, "'NCCL-PROTO' is not a valid environment variable"),
    ({"name": "a", "sglang_nccl_env": {"NCCL_PROTO": "5"}}, "'5' not known to NCCL"),
    ({"name": "a", "sglang_nccl_env": {"NCCL_BUFFSIZE": "16M"}}, "NCCL reads only the leading number"),
    ({"name": "a", "sglang_nccl_env": {"NCCL_NTHREADS": 500}}, "a multiple of 32 from 64 to 512"),
    ({"name": "a", "sglang_nccl_env": {"NCCL_P2P_DISABLE": True}}, "value True of type bool is refused"),
    ({"name": "a", "sglang_launch_args": {"--speculative-num-steps": 2}}, "write speculative-num-steps"),
    ({"name": "a", "sglang_launch_args": {"speculative_num_steps": 2}}, "write speculative-num-steps"),
    ({"name": "a", "sglang_launch_args": {"Speculative-Num-Steps": 2}}, "write speculative-num-steps"),
    ({"name": "a", "sglang_launch_args": {"num steps": 2}}, "e.g. speculative-num-steps"),
    ({"name": "a", "sglang_launch_args": {"port": 31000}}, "must not set port: gpufleet renders --port from "
                                                           "sglang_port"),
    ({"name": "a", "sglang_launch_args": {"api-key": "s3cret"}}, "must not set api-key: the key would show"),
    ({"name": "a", "sglang_launch_args": EAGLE2, "note": 3}, "candidate 1 (a): note is a number; give text"),
])
def test_each_bad_candidate_gets_one_clear_message(entry, words):
    good = {"name": "fine", "sglang_nccl_env": SEED_NCCL}
    problems = tune.check_candidates([entry, good])
    assert len(problems) == 1, problems
    assert words in problems[0], problems[0]
    assert problems[0].startswith("candidate 1")
    assert "s3cret" not in problems[0]


def test_duplicate_names_are_refused_whatever_their_case_naming_both():
    problems = tune.check_candidates([{"name": "eagle", "sglang_launch_args": EAGLE2},
                                      {"name": "Eagle", "sglang_nccl_env": SEED_NCCL}])
    assert problems == ["candidate 2 (Eagle): the name Eagle is already candidate 1's"]


def test_every_problem_of_every_candidate_is_listed_not_only_the_first():
    problems = tune.check_candidates([{"name": "a", "sglang_nccl_env": {"NCCL_PROTO": "fast"},
                                       "sglang_launch_args": {"tp_size": 8}}, 3])
    assert [p.split(":")[0].split(" is ")[0] for p in problems] == ["candidate 1 (a)", "candidate 1 (a)",
                                                                  "candidate 2"]


def test_unchecked_names_take_any_value_as_in_the_inventory_but_not_a_wrong_case():
    entry = {"name": "new-algo", "sglang_nccl_env": {"NCCL_ALGO": "NewAlgo"}}
    problems = tune.check_candidates([entry])
    assert len(problems) == 1 and "sglang_nccl_env_unchecked" in problems[0]
    assert "module option" not in problems[0]
    assert tune.check_candidates([entry], unchecked=["NCCL_ALGO"]) == []
    assert tune.check_candidates([{"name": "a", "sglang_nccl_env": {"nccl_algo": "x"}}], unchecked=["nccl_algo"])


# --- apply_overrides --------------------------------------------------------------------------------------------

def test_overrides_replace_add_and_null_removes_without_touching_the_inputs():
    own = {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Tree", "NCCL_DEBUG": "WARN"}
    overrides = {"NCCL_PROTO": "LL", "NCCL_ALGO": None, "NCCL_MAX_NCHANNELS": 16, "NCCL_IB_HCA": None}
    effective = tune.apply_overrides(own, overrides)
    assert effective == {"NCCL_PROTO": "LL", "NCCL_DEBUG": "WARN", "NCCL_MAX_NCHANNELS": 16}
    assert own == {"NCCL_PROTO": "Simple", "NCCL_ALGO": "Tree", "NCCL_DEBUG": "WARN"}
    assert overrides["NCCL_ALGO"] is None and effective is not own


def test_no_own_values_or_no_overrides():
    assert tune.apply_overrides(None, {"a": 1, "b": None}) == {"a": 1}
    own = {"model-path": "/m", "tp-size": 8}
    assert tune.apply_overrides(own, None) == own and tune.apply_overrides(own, None) is not own
    assert tune.apply_overrides(own, {}) == own
    assert tune.apply_overrides(None, None) == {}


# --- schedule ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("repeats", [1, 2, 3, 4])
def test_schedule_visits_every_name_once_per_repeat_in_rotating_orders(count, repeats):
    names = ["baseline"] + ["cand-%s" % chr(ord("a") + i) for i in range(count - 1)]
    rounds = tune.schedule(names, repeats)
    assert [r["round"] for r in rounds] == list(range(1, count * repeats + 1))
    orders = [[r["name"] for r in rounds if r["repeat"] == rep] for rep in range(1, repeats + 1)]
    assert [r["repeat"] for r in rounds] == sorted(r["repeat"] for r in rounds)
    for order in orders:
        assert sorted(order) == sorted(names)
    assert orders[0][0] == "baseline"  # the canary serves it already
    if count >= 2 and repeats >= 2:
        for name in names:
            positions = [order.index(name) for order in orders]
            # never the same place every time; within the first len(names) repeats never the same place twice
            assert len(set(positions)) > 1, (name, orders)
            assert len(set(positions[:count])) == len(positions[:count]), (name, orders)
        assert len({order[0] for order in orders}) > 1 and len({order[-1] for order in orders}) > 1
    if count >= 2 and (repeats >= 3 or count % 2 == 0 and repeats >= 2):
        for name in names:
            before = {order[order.index(name) - 1] if order.index(name) else None for order in orders}
            after = {order[order.index(name) + 1] if order.index(name) < count - 1 else None for order in orders}
            assert len(before) > 1 and len(after) > 1, (name, orders)


def test_with_an_even_count_each_name_follows_each_other_once_per_full_square():
    names = ["baseline", "a", "b", "c"]
    rounds = tune.schedule(names, 4)
    orders = [[r["name"] for r in rounds if r["repeat"] == rep] for rep in range(1, 5)]
    pairs = [(order[i], order[i + 1]) for order in orders for i in range(3)]
    assert len(pairs) == len(set(pairs)) == 12


def test_schedule_of_nothing():
    assert tune.schedule([], 3) == [] and tune.schedule(["baseline"], 0) == []
    assert tune.schedule(["baseline"], "2") == [{"round": 1, "repeat": 1, "name": "baseline"},
                                               {"round": 2, "repeat": 2, "name": "baseline"}]
