"""module_utils/gpufleet_sglang_nccl_owned.py and filter gpufleet_nccl_conflicts: which sglang_nccl_env values
would undo an NCCL variable SGLang sets on purpose for the launch flags.

The table is re-checked against the real releases (PyPI wheels) by the realrelease test at the end, with the
static lister tests/support/sglang_nccl_writes.py.
"""
import ast
import importlib.util
import pathlib

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_sglang_nccl_owned as O

ROOT = pathlib.Path(__file__).resolve().parents[2]

DETERMINISTIC = {"model-path": "/models/m", "enable-deterministic-inference": True, "tp-size": 8}


def _load_filter():
    spec = importlib.util.spec_from_file_location("gpufleet_sglang_nccl_filters",
                                                  ROOT / "plugins" / "filter" / "gpufleet_sglang_nccl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deterministic_with_tp_8_refuses_nccl_algo():
    conflicts = O.nccl_conflicts("0.5.22", DETERMINISTIC, {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": 16})
    assert len(conflicts) == 1
    c = conflicts[0]
    assert c["flag"] == "--enable-deterministic-inference"
    assert c["variables"] == ["NCCL_ALGO", "NCCL_MAX_NCHANNELS"]
    assert c["sglang_sets"] == {"NCCL_ALGO": "allreduce:tree", "NCCL_MAX_NCHANNELS": "8"}
    assert c["yours"] == {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": "16"}
    assert c["where"] == "sglang 0.5.22 srt/arg_groups/attention_hook.py:674,696"
    assert c["rules_from"] == "0.5.22"


def test_message_names_flag_variables_sglang_values_and_switch():
    message = O.nccl_conflicts("0.5.22", DETERMINISTIC, {"NCCL_ALGO": "Ring"})[0]["message"]
    for part in ("--enable-deterministic-inference with tp-size 8", "NCCL_ALGO=allreduce:tree", "NCCL_ALGO=Ring",
                 "srt/arg_groups/attention_hook.py:674", "sglang_nccl_env_overrides", "the NCCL patch runs after"):
        assert part in message
    assert "newest" not in message  # a surveyed release: no note


def test_tp_1_is_not_refused():
    args = dict(DETERMINISTIC, **{"tp-size": 1})
    assert O.nccl_conflicts("0.5.23", args, {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": 16}) == []


def test_pp_alone_does_not_count_as_tp():
    # SGLang checks tp_size only; a pipeline of 8 single-GPU stages keeps NCCL_ALGO as the user wants it.
    for pp in ("pp", "pp-size", "pipeline-parallel-size"):
        args = {"enable-deterministic-inference": True, pp: 8}
        assert O.nccl_conflicts("0.5.23", args, {"NCCL_ALGO": "Ring"}) == [], pp


def test_flag_left_out_or_false_is_not_refused():
    for value in (False, None, "false"):
        args = dict(DETERMINISTIC, **{"enable-deterministic-inference": value})
        assert O.nccl_conflicts("0.5.23", args, {"NCCL_ALGO": "Ring"}) == [], value


@pytest.mark.parametrize("value", ["allreduce:tree", "AllReduce:Tree", " allreduce:tree "])
def test_value_equal_to_sglangs_is_not_refused(value):
    env = {"NCCL_ALGO": value, "NCCL_MIN_NCHANNELS": 8, "NCCL_MAX_NCHANNELS": "0x8"}
    assert O.nccl_conflicts("0.5.23", DETERMINISTIC, env) == []


def test_channel_pin_follows_sglang_deterministic_nccl_nchannels_in_the_env():
    env = {"NCCL_MAX_NCHANNELS": 16, "SGLANG_DETERMINISTIC_NCCL_NCHANNELS": "16"}
    assert O.nccl_conflicts("0.5.23", DETERMINISTIC, env) == []
    env["SGLANG_DETERMINISTIC_NCCL_NCHANNELS"] = "4"
    assert O.nccl_conflicts("0.5.23", DETERMINISTIC, env)[0]["sglang_sets"] == {"NCCL_MAX_NCHANNELS": "4"}


def test_overrides_allow_replacing_sglangs_value():
    env = {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": 16}
    assert O.nccl_conflicts("0.5.23", DETERMINISTIC, env, overrides=["NCCL_ALGO", "NCCL_MAX_NCHANNELS"]) == []
    left = O.nccl_conflicts("0.5.23", DETERMINISTIC, env, overrides=["NCCL_ALGO"])
    assert [c["variables"] for c in left] == [["NCCL_MAX_NCHANNELS"]]
    assert O.nccl_conflicts("0.5.23", DETERMINISTIC, {"NCCL_ALGO": "Ring"}, overrides="NCCL_ALGO") == []


@pytest.mark.parametrize("key", ["tp", "tp-size", "tensor-parallel-size", "--tp-size", "tp_size", "tensor-par"])
def test_tp_in_any_spelling_argparse_takes(key):
    args = {"enable-deterministic-inference": True, key: 8}
    conflicts = O.nccl_conflicts("0.5.23", args, {"NCCL_ALGO": "Ring"})
    assert [c["condition"] for c in conflicts] == ["--enable-deterministic-inference with tp-size 8"], key


def test_tp_given_as_a_string_counts():
    args = {"enable-deterministic-inference": "true", "tp": "8"}
    assert O.nccl_conflicts("0.5.23", args, {"NCCL_ALGO": "Ring"})


def test_options_the_release_resolved_win_over_own_reading():
    # sglang_server_args_info resolved an abbreviation this module's prefix rules find ambiguous.
    args = {"enable-d": True, "tp": 8}
    assert O.nccl_conflicts("0.5.23", args, {"NCCL_ALGO": "Ring"}) == []
    resolved = {"enable-d": "--enable-deterministic-inference", "tp": "--tp-size"}
    assert O.nccl_conflicts("0.5.23", args, {"NCCL_ALGO": "Ring"}, resolved=resolved)
    # An option the rules do not read is not guessed at by prefix once the release resolved it.
    assert O.nccl_conflicts("0.5.23", {"enable-deterministic-inference": True, "tp": 8}, {"NCCL_ALGO": "Ring"},
                            resolved={"tp": "--tpx-other"}) == []


def test_negated_switch_as_the_release_resolved_it():
    env = {"NCCL_GRAPH_REGISTER": 1}
    decode = {"tp": 8, "dp": 8, "enable-dp-attention": True, "disaggregation-mode": "decode", "no-enable-tp": True}
    resolved = {"tp": "--tp-size", "dp": "--dp-size", "enable-dp-attention": "--enable-dp-attention",
                "disaggregation-mode": "--disaggregation-mode", "no-enable-tp": "--no-enable-tp-lm-head-all-to-all"}
    assert O.nccl_conflicts("0.5.21", decode, env, resolved=resolved) == []
    assert O.nccl_conflicts("0.5.21", decode, env, resolved=dict(resolved, **{"no-enable-tp": None}))


def test_unknown_version_uses_newest_rules_and_says_so():
    conflicts = O.nccl_conflicts(None, DETERMINISTIC, {"NCCL_ALGO": "Ring"})
    assert conflicts[0]["rules_from"] == O.NEWEST == "0.5.23"
    assert "sglang release unknown: the rules of 0.5.23" in conflicts[0]["message"]
    garbled = O.nccl_conflicts("not-a-version", DETERMINISTIC, {"NCCL_ALGO": "Ring"})
    assert garbled[0]["rules_from"] == "0.5.23" and "'not-a-version'" in garbled[0]["message"]


def test_dev_build_newer_than_newest_uses_newest_rules_and_says_so():
    conflicts = O.nccl_conflicts("0.5.24.dev3+g1a2b3c", DETERMINISTIC, {"NCCL_ALGO": "Ring"})
    assert conflicts[0]["rules_from"] == "0.5.23"
    assert "sglang 0.5.24.dev3+g1a2b3c is newer than 0.5.23" in conflicts[0]["message"]


def test_release_before_deterministic_mode_has_no_rule():
    assert O.nccl_conflicts("0.5.2", DETERMINISTIC, {"NCCL_ALGO": "Ring"}) == []


def test_channel_pin_only_from_0_5_18():
    env = {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": 16}
    assert O.nccl_conflicts("0.5.17", DETERMINISTIC, env)[0]["variables"] == ["NCCL_ALGO"]
    old = O.nccl_conflicts("0.5.18", DETERMINISTIC, env)[0]
    assert old["variables"] == ["NCCL_ALGO", "NCCL_MAX_NCHANNELS"]
    assert old["where"] == "sglang 0.5.18 srt/server_args.py:8270,8281"


def test_release_between_surveyed_ones_cites_the_nearest_earlier():
    c = O.nccl_conflicts("0.5.8", DETERMINISTIC, {"NCCL_ALGO": "Ring"})[0]
    assert c["rules_from"] == "0.5.8" and c["where"] == "sglang 0.5.6 srt/server_args.py:2000"


def test_unconditional_defaults_are_what_the_patch_overrides():
    # NCCL_CUMEM_ENABLE/NCCL_NVLS_ENABLE=0 without a flag (always up to 0.5.4) are no conflict.
    env = {"NCCL_CUMEM_ENABLE": 1, "NCCL_NVLS_ENABLE": 1, "CUDA_DEVICE_MAX_CONNECTIONS": 1}
    for version in ("0.3.6", "0.4.1.post7", "0.5.4", "0.5.23"):
        assert O.nccl_conflicts(version, {"model-path": "/m", "tp": 1}, env) == [], version


def test_symm_mem_overwrites_cumem_and_nvls():
    conflicts = O.nccl_conflicts("0.5.23", {"enable-symm-mem": True}, {"NCCL_CUMEM_ENABLE": 0, "NCCL_NVLS_ENABLE": 0})
    assert [(c["flag"], c["variables"]) for c in conflicts] == [
        ("--enable-symm-mem", ["NCCL_NVLS_ENABLE"]), ("--enable-symm-mem", ["NCCL_CUMEM_ENABLE"])]
    assert all("the NCCL patch runs after SGLang" in c["message"] for c in conflicts)


def test_enable_nccl_nvls_before_0_5_5():
    conflicts = O.nccl_conflicts("0.4.6", {"enable-nccl-nvls": True}, {"NCCL_NVLS_ENABLE": "0"})
    assert [c["flag"] for c in conflicts] == ["--enable-nccl-nvls"]
    assert "srt/entrypoints/engine.py:429" in conflicts[0]["where"]


def test_setdefault_write_says_sglang_keeps_the_users_value():
    conflicts = O.nccl_conflicts("0.5.23", {"moe-a2a-backend": "deepep_v2"}, {"NCCL_CUMEM_ENABLE": "0"})
    assert [c["flag"] for c in conflicts] == ["--moe-a2a-backend"]
    assert "only when unset" in conflicts[0]["message"]
    assert conflicts[0]["where"] == "sglang 0.5.23 srt/arg_groups/moe_hook.py:403"


def test_graph_register_in_0_5_23_needs_multi_rank_cuda_graphs():
    env = {"NCCL_GRAPH_REGISTER": 1}
    assert [c["variables"] for c in O.nccl_conflicts("0.5.23", {"tp": 8}, env)] == [["NCCL_GRAPH_REGISTER"]]
    assert O.nccl_conflicts("0.5.23", {"tp": 8, "disable-cuda-graph": True}, env) == []
    assert O.nccl_conflicts("0.5.23", {"tp": 1}, env) == []
    assert O.nccl_conflicts("0.5.23", {"tp": 8}, {"NCCL_GRAPH_REGISTER": "0"}) == []


def test_graph_register_before_0_5_23_only_with_tp_lm_head_all_to_all():
    env = {"NCCL_GRAPH_REGISTER": 1}
    assert O.nccl_conflicts("0.5.21", {"tp": 8}, env) == []
    assert O.nccl_conflicts("0.5.21", {"tp": 8, "enable-tp-lm-head-all-to-all": True}, env)
    decode = {"tp": 8, "dp": 8, "enable-dp-attention": True, "disaggregation-mode": "decode"}
    assert O.nccl_conflicts("0.5.21", decode, env)
    assert O.nccl_conflicts("0.5.21", dict(decode, **{"no-enable-tp-lm-head-all-to-all": True}), env) == []
    assert O.nccl_conflicts("0.5.19", {"tp": 8, "enable-tp-lm-head-all-to-all": True}, env) == []


def test_bad_inputs_give_no_conflicts():
    assert O.nccl_conflicts("0.5.23", DETERMINISTIC, None) == []
    assert O.nccl_conflicts("0.5.23", DETERMINISTIC, ["NCCL_ALGO"]) == []
    assert O.nccl_conflicts("0.5.23", "tp=8", {"NCCL_ALGO": "Ring"}) == []


def test_version_order():
    order = ["0.4.1.post6", "0.4.1.post7", "0.5.0rc2", "0.5.3", "0.5.23", "0.5.23.post1", "0.5.24.dev3+gabc",
             "0.5.24rc1", "0.5.24"]
    assert sorted(order, key=O.version_key) == order
    assert O.version_key(None) is None and O.version_key("main") is None


def test_table_is_consistent():
    for write in O.WRITES:
        assert write["rule"] is None or write["rule"] in O.RULES, write
        assert write["variable"].startswith("NCCL_") and write["kind"] in ("set", "setdefault")
        assert write["lines"] and set(write["lines"]) <= set(O.SURVEYED), write
        for release in write["lines"]:
            assert write in O.writes_for(release), (release, write)
    assert list(O.SURVEYED) == sorted(O.SURVEYED, key=O.version_key)


def test_filter_pipes_sglang_nccl_env():
    filters = _load_filter().FilterModule().filters()
    conflicts = filters["gpufleet_nccl_conflicts"]({"NCCL_ALGO": "Ring"}, DETERMINISTIC, "0.5.23", ["NCCL_MIN_NCHANNELS"])
    assert [c["variables"] for c in conflicts] == [["NCCL_ALGO"]]
    assert filters["gpufleet_nccl_conflicts"]({"NCCL_ALGO": "Ring"}, DETERMINISTIC, "0.5.23", None, None)
    assert filters["gpufleet_nccl_conflicts"]({"NCCL_ALGO": "Ring"}, DETERMINISTIC) [0]["rules_from"] == "0.5.23"


# -- the table against the real releases ---------------------------------------------------------------------

def _covered_releases():
    """RELEASES of tests/unit/test_sglang_nccl_patch_releases.py (read, not imported: that module loads the patch
    module and prints at import)."""
    tree = ast.parse((ROOT / "tests" / "unit" / "test_sglang_nccl_patch_releases.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RELEASES" for t in node.targets):
            return [row[0] for row in ast.literal_eval(node.value)]
    raise AssertionError("RELEASES not found in test_sglang_nccl_patch_releases.py")


CHECKED = sorted(set(_covered_releases()) | set(O.SURVEYED), key=O.version_key)


def _identity(write):
    return write["file"], write["function"], write["variable"], write["kind"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", CHECKED)
def test_table_accounts_for_every_nccl_write_of_the_release(version):
    from support.sglang_nccl_writes import list_writes
    from support.sglang_wheels import sglang_package_dir

    found = list_writes(sglang_package_dir(version))
    computed = [w for w in found if w["variable"] is None]
    assert not computed, ("writes through a computed name: read them and extend the lister or the table: %s"
                          % computed)
    table = O.writes_for(version)
    missing = []
    for write in found:
        rows = [row for row in table if _identity(row) == _identity(write) and write["value"] in row["exprs"]]
        if not rows or any(version in row["lines"] and row["lines"][version] != write["line"] for row in rows):
            missing.append("%s:%d %s %s %s=%s if %s" % (write["file"], write["line"], write["function"],
                                                       write["kind"], write["variable"], write["value"],
                                                       " and ".join(write["conditions"]) or "always"))
    assert not missing, ("sglang %s writes NCCL variables WRITES in gpufleet_sglang_nccl_owned.py does not list "
                         "(or at another line): add them with their flag rule\n%s" % (version, "\n".join(missing)))
    gone = [row for row in table if not any(_identity(row) == _identity(w) and w["value"] in row["exprs"]
                                            for w in found)]
    assert not gone, "sglang %s lacks writes the table claims (set their gone_in): %s" % (version, gone)
    if version in O.SURVEYED:
        assert all(version in row["lines"] for row in table), "a surveyed release's line is missing from WRITES"


def test_overrides_as_a_comma_string_count_as_a_list_and_a_bad_type_is_named():
    env = {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": "16"}
    args = {"enable-deterministic-inference": True, "tp-size": 8}
    assert O.nccl_conflicts("0.5.23", args, env, overrides="NCCL_ALGO, NCCL_MAX_NCHANNELS") == []
    [bad] = O.nccl_conflicts("0.5.23", args, env, overrides=5)
    assert bad["message"] == ("sglang_nccl_env_overrides must be a list of variable names of sglang_nccl_env "
                              "(e.g. [NCCL_ALGO]), got int 5")


def test_a_misspelt_override_is_named_in_the_refusal():
    env = {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": "16"}
    args = {"enable-deterministic-inference": True, "tp-size": 8}
    [conflict] = O.nccl_conflicts("0.5.23", args, env, overrides=["NCCL_ALGO", "NCCL_MAX_NCHANNEL"])
    assert conflict["variables"] == ["NCCL_MAX_NCHANNELS"]
    assert conflict["message"].endswith(
        "; sglang_nccl_env_overrides names NCCL_MAX_NCHANNEL, which sglang_nccl_env does not set")


def test_the_channel_count_sglang_reads_from_the_servers_environment_is_the_one_compared():
    # SGLANG_DETERMINISTIC_NCCL_NCHANNELS=16 in sglang_launch_extra_env: SGLang pins 16, the same as the user's value.
    env = {"NCCL_MAX_NCHANNELS": "16", "NCCL_MIN_NCHANNELS": "16"}
    args = {"enable-deterministic-inference": True, "tp-size": 8}
    assert O.nccl_conflicts("0.5.23", args, env, server_env={"SGLANG_DETERMINISTIC_NCCL_NCHANNELS": "16"}) == []
    [conflict] = O.nccl_conflicts("0.5.23", args, env)
    assert conflict["sglang_sets"]["NCCL_MAX_NCHANNELS"] == "8"
