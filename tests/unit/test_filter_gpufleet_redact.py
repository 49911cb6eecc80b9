"""plugins/filter/gpufleet_redact.py: the failure notes' log tail and journal lines shown without API keys."""
import importlib.util
import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpufleet_redact_filters", ROOT / "plugins/filter/gpufleet_redact.py")
flt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(flt)


def test_log_lines_and_journal_lines_are_redacted_without_the_key():
    lines = ["[2026-12-04] server_args={'model_path': '/m', 'api_key': 'sk-abc', 'admin_api_key': None}",
             "systemd[1]: Started sglang.service - /venv/bin/python -m sglang.launch_server --api-key sk-abc --port 1",
             "RuntimeError: lab fault crash_on_start"]
    out = flt.gpufleet_redact(lines)
    assert out == ["[2026-12-04] server_args={'model_path': '/m', 'api_key': '********', 'admin_api_key': None}",
                   "systemd[1]: Started sglang.service - /venv/bin/python -m sglang.launch_server --api-key ******** "
                   "--port 1",
                   "RuntimeError: lab fault crash_on_start"]


def test_a_known_key_is_hidden_anywhere_and_an_empty_one_changes_nothing():
    assert flt.gpufleet_redact("echo sk-abc", "sk-abc") == "echo ********"
    assert flt.gpufleet_redact("echo sk-abc", "") == "echo sk-abc"
    assert flt.gpufleet_redact({"msg": "--api-key=sk-abc"}) == {"msg": "--api-key=********"}


def test_the_filter_is_registered_and_documented():
    assert flt.FilterModule().filters()["gpufleet_redact"] is flt.gpufleet_redact
    doc = yaml.safe_load((ROOT / "plugins/filter/gpufleet_redact.yml").read_text())
    assert doc["DOCUMENTATION"]["name"] == "gpufleet_redact"
