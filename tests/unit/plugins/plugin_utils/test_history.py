"""plugins/plugin_utils/history.py: the entry a verified launch appends and the table of the history (issue 34)."""
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import history

NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": "16777216"}


def workers(*envs):
    return {"workers": [{"pid": 10 + i, "title": "sglang::scheduler_TP%d" % i, "env": env, "match": True}
                        for i, env in enumerate(envs)], "worker_count": len(envs), "all_match": True}


def raw(**extra):
    return dict({"time": "2026-12-05T11:00:00Z", "run_id": 4711, "host": "gpu-01", "candidate": None,
                 "profile": "", "argv": ["/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/m/k2"],
                 "env": {"NCCL_PROTO": "LL", "SPT_NOENV": "1"}, "api_key_set": True,
                 "workers": workers(NCCL, NCCL), "expected": NCCL, "sglang_version": "0.5.23",
                 "launch_args": {"model-path": "/m/k2", "speculative-draft-model-path": "/m/eagle3", "tp-size": 8},
                 "figures": {}, "tokens_per_s": None}, **extra)


def test_a_restart_entry_holds_what_the_workers_carried_and_the_model_paths():
    e = history.history_entry(raw())
    assert e["playbook"] == "restart" and e["candidate"] is None and e["profile"] is None
    assert e["run_id"] == "4711" and e["host"] == "gpu-01" and e["sglang_version"] == "0.5.23"
    assert e["nccl_env"] == NCCL and e["nccl_workers"] == 2
    assert e["model_path"] == "/m/k2" and e["speculative_draft_model_path"] == "/m/eagle3"
    assert e["figures"] == {} and e["api_key_set"] is True


def test_the_nccl_values_are_the_ones_read_not_the_ones_meant():
    # One worker did not get NCCL_ALGO, another has a different NCCL_PROTO: the entry says so.
    e = history.history_entry(raw(workers=workers({"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}, {"NCCL_PROTO": "Simple"})))
    assert e["nccl_env"] == {"NCCL_PROTO": ["LL", "Simple"], "NCCL_ALGO": "Ring"}
    assert history.history_entry(raw(workers={}))["nccl_env"] == {}


def test_a_tune_entry_names_its_candidate_and_keeps_figures_and_verify_tokens():
    e = history.history_entry(raw(candidate="cand-a", profile="tune-gpu-01", tokens_per_s="93.5",
                                  figures={"single_stream_tok_s": 94.1, "itl_ms": 10.6, "ttft_ms": None}))
    assert e["playbook"] == "tune" and e["candidate"] == "cand-a" and e["profile"] == "tune-gpu-01"
    assert e["figures"] == {"single_stream_tok_s": 94.1, "itl_ms": 10.6, "tokens_per_s": 93.5}


def test_no_secret_reaches_the_entry():
    e = history.history_entry(raw(argv=["python", "--api-key", "sk-live-1", "--admin-api-key=adm-secret"],
                                  env={"HF_TOKEN": "hf_x", "MY_API_KEY": "k", "NCCL_PROTO": "LL", "EMPTY_TOKEN": ""}))
    text = repr(e)
    assert "sk-live-1" not in text and "adm-secret" not in text and "hf_x" not in text and "'k'" not in text
    assert e["env"] == {"HF_TOKEN": "********", "MY_API_KEY": "********", "NCCL_PROTO": "LL", "EMPTY_TOKEN": ""}
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_launch_history as H
    assert H.secret_keys(e) == []


def test_the_table_has_one_row_per_entry_with_short_nccl_values_and_figures():
    first = history.history_entry(raw())
    second = history.history_entry(raw(time="2026-12-05T12:00:00Z", run_id="r2", candidate="cand-a",
                                       figures={"single_stream_tok_s": 94.12, "ttft_ms": 41.2}))
    table = history.history_table([first, second]).splitlines()
    assert table[0].split()[:4] == ["time", "host", "run", "id"] and len(table) == 3
    assert "PROTO=LL ALGO=Ring BUFFSIZE=16M" in table[1] and "0.5.23" in table[1] and table[1].endswith("-")
    assert "tune" in table[2] and "cand-a" in table[2] and table[2].endswith("94.1 tok/s 1x, TTFT 41 ms")
    assert history.history_table([]) == "no launch recorded"


def test_fleet_entries_merge_hosts_by_time():
    a = {"time": "2026-12-05T11:00:00Z", "run_id": "1"}
    b = {"time": "2026-12-05T10:00:00Z", "run_id": "2"}
    merged = history.fleet_entries({"gpu-02": [a], "gpu-01": [b]})
    assert [(e["host"], e["run_id"]) for e in merged] == [("gpu-01", "2"), ("gpu-02", "1")]
