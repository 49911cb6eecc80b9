"""plugins/plugin_utils/profile.py: named launch profiles, loaded and checked before restart.yml touches a host,
applied to each host's own values, saved by tune.yml (issue 34)."""
import yaml

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import profile

WINNER = {"name": "cand-a", "sglang_nccl_env": {"NCCL_PROTO": "LL", "NCCL_ALGO": None},
          "sglang_launch_args": {"speculative-num-steps": 2}, "ok": True,
          "single_stream_tok_s": {"median": 94.0}}
SOURCE = {"canary": "gpu-01", "run_id": "r1", "metric": "single_stream_tok_s", "medians": {"single_stream_tok_s": 94.0},
          "sglang_version": "0.5.23", "time": "2026-12-05T11:00:00Z"}


def test_a_rendered_profile_reads_back_and_passes_its_own_check(tmp_path):
    text = profile.render_profile("tune-gpu-01", WINNER, SOURCE)
    assert text.startswith("# gpufleet launch profile tune-gpu-01") and "gpufleet_profile=tune-gpu-01" in text
    (tmp_path / "tune-gpu-01.yml").write_text(text)
    loaded = profile.read_profile("tune-gpu-01", str(tmp_path))
    assert loaded["ok"] is True and loaded["path"] == str(tmp_path / "tune-gpu-01.yml")
    data = loaded["profile"]
    assert data["sglang_nccl_env"] == {"NCCL_PROTO": "LL", "NCCL_ALGO": None}
    assert data["sglang_launch_args"] == {"speculative-num-steps": 2}
    assert data["source"]["canary"] == "gpu-01" and data["source"]["candidate"] == "cand-a"


def test_apply_overrides_the_hosts_own_values_key_by_key():
    out = profile.apply_profile({"NCCL_PROTO": "Simple", "NCCL_ALGO": "Tree", "NCCL_NTHREADS": "512"},
                                {"model-path": "/m/own", "speculative-num-steps": 3},
                                {"sglang_nccl_env": {"NCCL_PROTO": "LL", "NCCL_ALGO": None},
                                 "sglang_launch_args": {"speculative-num-steps": 2}})
    assert out == {"sglang_nccl_env": {"NCCL_PROTO": "LL", "NCCL_NTHREADS": "512"},
                   "sglang_launch_args": {"model-path": "/m/own", "speculative-num-steps": 2}}
    assert profile.apply_profile({"A": "1"}, {"x": 1}, None) == {"sglang_nccl_env": {"A": "1"},
                                                                  "sglang_launch_args": {"x": 1}}


def test_a_missing_profile_names_the_file_and_the_profiles_there(tmp_path):
    (tmp_path / "fast.yml").write_text("name: fast\n")
    out = profile.read_profile("fastest", str(tmp_path))
    assert out["ok"] is False and str(tmp_path / "fastest.yml") in out["msg"] and "holds fast" in out["msg"]
    assert "nothing was changed on any host" in out["msg"]
    assert "holds no profile" in profile.read_profile("x", str(tmp_path / "none"))["msg"]


def test_bad_names_and_malformed_files_are_refused_naming_the_file(tmp_path):
    assert "not a profile name" in profile.read_profile("../etc/passwd", str(tmp_path))["msg"]
    (tmp_path / "broken.yml").write_text("name: broken\nsglang_nccl_env: [unclosed\n")
    out = profile.read_profile("broken", str(tmp_path))
    assert out["ok"] is False and "broken.yml cannot be read" in out["msg"]
    (tmp_path / "odd.yml").write_text("name: other\nsglang_nccl_env: {NCCL_PROTO: [LL]}\nport: 1\n")
    out = profile.read_profile("odd", str(tmp_path))
    assert "odd.yml is malformed" in out["msg"] and "unknown key(s) port" in out["msg"]
    assert "sglang_nccl_env.NCCL_PROTO must be a string" in out["msg"]
    (tmp_path / "named.yml").write_text("name: other\n")
    assert "its name is 'other', not 'named'" in profile.read_profile("named", str(tmp_path))["msg"]


def test_check_refuses_host_identity_and_secrets_in_launch_args():
    problems = profile.check_profile({"name": "p", "sglang_launch_args": {"port": 1, "api_key": "k", "tp-size": [[8]]},
                                      "sglang_nccl_env": {"1BAD": "x"}})
    text = "; ".join(problems)
    assert "sglang_launch_args.port belongs to the host" in text and "sglang_launch_args.api_key belongs" in text
    assert "sglang_launch_args.tp-size must be a value" in text and "'1BAD' is not an environment" in text
    assert profile.check_profile([1]) and profile.check_profile({"name": "p"}) == []


def test_save_writes_new_or_same_values_and_refuses_a_different_profile_unless_overwrite(tmp_path):
    path = str(tmp_path / "tune-gpu-01.yml")
    text = profile.render_profile("tune-gpu-01", WINNER, SOURCE)
    assert profile.save_plan(text, path)["write"] is True
    open(path, "w").write(text)
    newer = profile.render_profile("tune-gpu-01", WINNER, dict(SOURCE, run_id="r2"))
    assert profile.save_plan(newer, path) == {"write": True,
                                              "msg": "profile %s updated (same values, newer source)" % path}
    other = profile.render_profile("tune-gpu-01", dict(WINNER, sglang_launch_args={"speculative-num-steps": 3}), SOURCE)
    refused = profile.save_plan(other, path)
    assert refused["write"] is False and "gpufleet_profile_overwrite=true" in refused["msg"]
    assert profile.save_plan(other, path, True)["write"] is True
    assert yaml.safe_load(open(path))["sglang_launch_args"] == {"speculative-num-steps": 2}


def test_check_refuses_abbreviations_of_host_identity_and_secrets():
    problems = profile.check_profile({"name": "p", "sglang_launch_args": {"api-ke": "SECRET", "admin-api-k": "S2",
                                                                          "ho": "0.0.0.0", "po": 1, "a": 1}})
    text = "; ".join(problems)
    assert len(problems) == 4 and "SECRET" not in text, problems
    assert "sglang_launch_args.api-ke (--api-key abbreviated) belongs to the host's inventory" in text
    assert "admin-api-k (--admin-api-key abbreviated)" in text and "ho (--host abbreviated)" in text
    assert "po (--port abbreviated)" in text


def test_mapping_valued_launch_args_render_into_a_profile_as_sglang_argv_renders_them(tmp_path):
    # sglang_argv renders a mapping as compact JSON (--json-model-override-args '{"rope_scaling":{"factor":2}}'),
    # and a list of mappings one JSON word each: a profile holds them as they are.
    args = {"json-model-override-args": {"rope_scaling": {"factor": 2, "type": "yarn"}},
            "lora-paths": [{"name": "a", "path": "/l/a"}, "b=/l/b"], "speculative-num-steps": 2}
    text = profile.render_profile("tune-gpu-01", dict(WINNER, sglang_launch_args=args), SOURCE)
    (tmp_path / "tune-gpu-01.yml").write_text(text)
    loaded = profile.read_profile("tune-gpu-01", str(tmp_path))
    assert loaded["ok"] is True and loaded["profile"]["sglang_launch_args"] == args
    from ansible_collections.gpufleet.fleet.plugins.filter.gpufleet import sglang_argv
    argv = sglang_argv(loaded["profile"]["sglang_launch_args"], ["sglang", "serve"])
    assert argv[2:4] == ["--json-model-override-args", '{"rope_scaling":{"factor":2,"type":"yarn"}}']
    # what sglang_argv cannot render stays refused: a list inside a list, true inside a list, non-text keys
    for bad in ([[8]], [True, 1], {1: 2}, {"a": {"b"}}):
        problems = profile.check_profile({"name": "p", "sglang_launch_args": {"x": bad}})
        assert problems and "sglang_launch_args.x must be a value, a mapping" in problems[0], bad


def test_check_name_is_the_profile_name_rule_with_its_message():
    for good in ("tune-gpu-01", "kimi.v2_fast", "a" * 64):
        assert profile.check_name(good) is None
    for bad in ("kimi ll", "tune-fe80::1", "tune-x\n", "", None, "-x", "a" * 65, "../x", 7):
        msg = profile.check_name(bad)
        assert msg and "is not a profile name" in msg and "<name>.yml" in msg, bad
    from ansible_collections.gpufleet.fleet.plugins.filter.gpufleet_profile import FilterModule
    assert FilterModule().filters()["gpufleet_profile_check_name"]("kimi ll").startswith("profile name 'kimi ll'")


def test_names_with_a_trailing_newline_are_refused():
    # "$" would match before the newline: the file name would hold it.
    assert profile.check_profile({"name": "tune-x\n"})[0].startswith("name 'tune-x\\n' is not a profile name")
    assert "sglang_nccl_env: 'NCCL_PROTO\\n'" in "; ".join(
        profile.check_profile({"name": "p", "sglang_nccl_env": {"NCCL_PROTO\n": "LL"}}))
    assert "'speculative-num-steps\\n' is not an SGLang flag" in "; ".join(
        profile.check_profile({"name": "p", "sglang_launch_args": {"speculative-num-steps\n": 2}}))
