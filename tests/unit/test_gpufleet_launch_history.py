"""The host's launch history: module_utils/gpufleet_launch_history.py and the modules gpufleet_launch_history and
gpufleet_launch_history_info (issue 34). The file lives in tmp_path."""
import importlib.util
import json
import os
import pathlib

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_launch_history as H

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(name + "_module", ROOT / "plugins" / "modules" / (name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


WRITE, READ = load("gpufleet_launch_history"), load("gpufleet_launch_history_info")


def run_main(mod, args, capsys, check_mode=False):
    from ansible.module_utils.testing import patch_module_args
    if check_mode:
        args = dict(args, _ansible_check_mode=True)
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


def entry(n, **extra):
    return dict({"time": "2026-12-05T11:%02d:00Z" % n, "run_id": "r%d" % n, "playbook": "restart",
                 "argv": ["python", "-m", "sglang.launch_server", "--api-key", "********"],
                 "env": {"NCCL_PROTO": "LL", "HF_TOKEN": "********"}, "api_key_set": True,
                 "nccl_env": {"NCCL_PROTO": "LL"}}, **extra)


def lines(path):
    return [json.loads(line) for line in open(path)]


def test_each_call_appends_one_line_mode_0600_oldest_first(tmp_path):
    path = str(tmp_path / "history.jsonl")
    for n in range(3):
        result = H.append_entry(path, entry(n), max_entries=10)
    assert result == {"changed": True, "path": path, "entries": 3, "dropped": 0, "mode": "0600"}
    assert [e["run_id"] for e in lines(path)] == ["r0", "r1", "r2"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and os.stat(path).st_uid == os.getuid()


def test_the_newest_max_entries_are_kept_and_no_temporary_file_is_left(tmp_path):
    path = str(tmp_path / "history.jsonl")
    for n in range(7):
        result = H.append_entry(path, entry(n), max_entries=3)
    assert result["entries"] == 3 and result["dropped"] == 1
    assert [e["run_id"] for e in lines(path)] == ["r4", "r5", "r6"]
    assert sorted(os.listdir(tmp_path)) == ["history.jsonl"]


def test_a_file_made_wider_by_hand_is_made_0600_again(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text(json.dumps(entry(0)) + "\n")
    os.chmod(path, 0o644)
    H.append_entry(str(path), entry(1))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and len(lines(path)) == 2


@pytest.mark.parametrize("bad", [
    {"argv": ["x"], "api_key": "sk-123"},
    {"env": {"HF_TOKEN": "hf_abc"}},
    {"env": {"OPENAI_API_KEY": "k"}},
    {"source": [{"password": "p"}]},
    {"figures": {"client_secret": 3}},
])
def test_an_entry_holding_a_secret_is_refused_naming_where_and_nothing_is_written(tmp_path, bad):
    path = str(tmp_path / "history.jsonl")
    H.append_entry(path, entry(0))
    with pytest.raises(H.HistoryError, match="looks like a secret at entry"):
        H.append_entry(path, dict(entry(1), **bad))
    assert [e["run_id"] for e in lines(path)] == ["r0"]


def test_hidden_or_absent_secrets_pass():
    ok = entry(0, api_key=None, env={"HF_TOKEN": "", "X_API_KEY": "********"}, api_key_set=False)
    assert H.secret_keys(ok) == [] and H.check_entry(ok)


def test_figures_and_names_that_only_contain_a_secret_word_are_no_secret():
    # sglang_verify's throughput figure (a lab restart with the throughput smoke was refused on it once).
    ok = entry(0, figures={"tokens_per_s": 93.5, "single_stream_tok_s": 94.0}, env={"TOKENIZERS_PARALLELISM": "false"})
    assert H.secret_keys(ok) == []
    assert H.secret_keys({"GITHUB_TOKEN": "g", "apiKey": "k", "db-password": "p", "--api-key": "k"}) == [
        "entry.GITHUB_TOKEN", "entry.apiKey", "entry.db-password", "entry.--api-key"]


def test_lines_that_are_not_json_objects_are_skipped_and_counted(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text(json.dumps(entry(0)) + "\n{torn\n[1]\n\n" + json.dumps(entry(1)) + "\n")
    entries, bad = H.read_entries(str(path))
    assert [e["run_id"] for e in entries] == ["r0", "r1"] and bad == 2
    assert H.read_entries(str(tmp_path / "none.jsonl")) == ([], 0)
    assert [e["run_id"] for e in H.last(entries, 1)] == ["r1"] and len(H.last(entries, 0)) == 2


def test_max_entries_below_one_is_refused():
    with pytest.raises(H.HistoryError, match="at least 1"):
        H.plan([], entry(0), 0)


def test_module_appends_and_check_mode_writes_nothing(tmp_path, capsys):
    path = str(tmp_path / "history.jsonl")
    result = run_main(WRITE, {"path": path, "entry": entry(0)}, capsys, check_mode=True)
    assert result["changed"] is True and result["entries"] == 1 and not os.path.exists(path)
    result = run_main(WRITE, {"path": path, "entry": entry(0), "max_entries": 5}, capsys)
    assert result["changed"] is True and result["line_bytes"] > 50 and len(lines(path)) == 1


def test_module_refuses_a_secret_and_a_missing_directory(tmp_path, capsys):
    result = run_main(WRITE, {"path": str(tmp_path / "h.jsonl"), "entry": entry(0, env={"HF_TOKEN": "hf_x"})}, capsys)
    assert result["failed"] is True and "entry.env.HF_TOKEN" in result["msg"] and "hf_x" not in json.dumps(result)
    result = run_main(WRITE, {"path": str(tmp_path / "no" / "h.jsonl"), "entry": entry(0)}, capsys)
    assert result["failed"] is True and "does not exist" in result["msg"]


def test_info_module_returns_the_last_entries_and_changes_nothing(tmp_path, capsys):
    path = str(tmp_path / "history.jsonl")
    for n in range(4):
        H.append_entry(path, entry(n))
    before = open(path).read()
    result = run_main(READ, {"path": path, "last": 2}, capsys)
    assert result["changed"] is False and result["total"] == 4 and result["exists"] is True
    assert [e["run_id"] for e in result["entries"]] == ["r2", "r3"] and open(path).read() == before
    result = run_main(READ, {"path": str(tmp_path / "none.jsonl")}, capsys)
    assert result["entries"] == [] and result["exists"] is False and result["total"] == 0
