"""module_utils/gpufleet_redact.py: every form an SGLang API key takes in a command line, a title or a log line is
hidden, without knowing the key; what is not a secret is left as it was."""
import json

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import (
    REDACTED,
    SGLANG_SECRET_FLAGS,
    abbreviates,
    inventory_flag,
    redact_argv,
    redact_data,
    redact_text,
)

KEY = "sk-Zq9+/x.y_z~1="
ADMIN = "adm1n-0ff1ce"


def test_argv_with_the_key_as_the_next_element_is_redacted():
    argv = ["python", "-m", "sglang.launch_server", "--api-key", KEY, "--admin-api-key", ADMIN, "--port", "30000"]
    assert redact_argv(argv) == ["python", "-m", "sglang.launch_server", "--api-key", REDACTED,
                                 "--admin-api-key", REDACTED, "--port", "30000"]


def test_argv_with_flag_equals_value_is_redacted():
    assert redact_argv(["x", "--api-key=" + KEY, "--admin-api-key=" + ADMIN]) == [
        "x", "--api-key=" + REDACTED, "--admin-api-key=" + REDACTED]


def test_a_value_that_starts_with_a_dash_is_redacted_after_equals_and_as_the_next_element():
    assert redact_argv(["--api-key", "-abc"]) == ["--api-key", REDACTED]
    assert redact_text("--api-key=-abc --port 1") == "--api-key=%s --port 1" % REDACTED


def test_one_element_holding_the_whole_command_line_is_redacted():
    # A setproctitle title: /proc/<pid>/cmdline holds one string, psutil returns it as argv[0] (issue 31's leak at
    # event_data.res.port.listeners[0].cmdline[0]).
    title = "/venv/bin/python -m sglang.launch_server --model-path m --api-key %s --admin-api-key=%s --port 1" % (
        KEY, ADMIN)
    [out] = redact_argv([title])
    assert KEY not in out and ADMIN not in out
    assert out == ("/venv/bin/python -m sglang.launch_server --model-path m --api-key %s --admin-api-key=%s --port 1"
                   % (REDACTED, REDACTED))


def test_sglang_0_5_23_server_args_dict_repr_is_redacted():
    # entrypoints/engine.py:311 logs server_args=<resolved_dict()>, a dict repr; nested records expand into dicts.
    line = ("[2026-12-04 10:00:00] server_args={'model_path': '/m', 'serving': {'api_key': '%s', "
            "'admin_api_key': '%s', 'host': '0.0.0.0'}, 'port': 30000}" % (KEY, ADMIN))
    out = redact_text(line)
    assert KEY not in out and ADMIN not in out
    assert "'api_key': '%s'" % REDACTED in out and "'admin_api_key': '%s'" % REDACTED in out
    assert "'host': '0.0.0.0'" in out and "'port': 30000}" in out


def test_older_server_args_repr_single_and_double_quoted_is_redacted():
    line = "server_args=ServerArgs(model_path='/m', api_key='%s', admin_api_key=\"%s\", port=1)" % (KEY, ADMIN)
    assert redact_text(line) == ("server_args=ServerArgs(model_path='/m', api_key='%s', admin_api_key=\"%s\", "
                                 "port=1)" % (REDACTED, REDACTED))


def test_a_key_holding_a_quote_is_redacted_whole():
    line = "ServerArgs(api_key=\"it's\\\"x\", port=1)"
    assert redact_text(line) == "ServerArgs(api_key=\"%s\", port=1)" % REDACTED


@pytest.mark.parametrize("line", [
    "server_args=ServerArgs(api_key=None, admin_api_key=None, port=1)",
    "server_args={'api_key': None, 'admin_api_key': None}",
    '{"api_key": null, "admin_api_key": ""}',
    "ServerArgs(api_key='', port=1)",
])
def test_no_key_stays_visible_as_no_key(line):
    assert redact_text(line) == line


def test_json_form_is_redacted():
    text = json.dumps({"api_key": KEY, "nested": {"admin_api_key": ADMIN}, "port": 1})
    out = redact_text(text)
    assert KEY not in out and ADMIN not in out and json.loads(out)["api_key"] == REDACTED


def test_list_repr_of_argv_is_redacted():
    text = str(["python", "--api-key", KEY, "--port", "1"])
    assert redact_text(text) == "['python', '--api-key', '%s', '--port', '1']" % REDACTED


def test_bearer_header_and_environment_assignment_are_redacted():
    assert redact_text("curl -H 'Authorization: Bearer %s' http://x" % KEY) == (
        "curl -H 'Authorization: Bearer %s' http://x" % REDACTED)
    assert redact_text("OPENAI_API_KEY=%s python x" % KEY) == "OPENAI_API_KEY=%s python x" % REDACTED


def test_smg_control_plane_keys_are_redacted():
    out = redact_text("smg --port 30000 --control-plane-api-keys id1:ops:admin:%s --policy random" % KEY)
    assert KEY not in out and out.endswith("--policy random")


@pytest.mark.parametrize("text", [
    "python -m sglang.launch_server --api-key-file /etc/sglang/key --port 1",  # a path, not a secret
    "--api-key-file=/etc/sglang/key",
    "python -m sglang.launch_server --api-key --port 1",  # no value (argparse refuses it): the next flag stays
    "sglang::scheduler_TP0",
    "set sglang_api_key (a vaulted variable) to the key",
    "the request needs Authorization: Bearer <key>",
    "Load weight begin. avail mem=79.10 GB",
])
def test_what_is_not_a_secret_is_left_alone(text):
    assert redact_text(text) == text


def test_argv_without_secrets_and_empty_values_are_unchanged():
    argv = ["python", "-m", "sglang.launch_server", "--api-key-file", "/k", "--port", "1"]
    assert redact_argv(argv) == argv
    assert redact_argv(None) is None and redact_argv([]) == []
    assert redact_text("") == "" and redact_text(None) is None


def test_a_known_secret_is_hidden_wherever_it_appears():
    assert redact_text("echo %s > /tmp/x" % KEY, known=[KEY, "", None]) == "echo %s > /tmp/x" % REDACTED


def test_redact_data_walks_a_module_result():
    result = {"msg": "exited; last line: server_args=ServerArgs(api_key='%s')" % KEY,
              "listeners": [{"pid": 1, "cmdline": ["python -m sglang.launch_server --api-key " + KEY]}],
              "values": {"--api-key": KEY, "--port": 1}, "dest_values": {"api_key": KEY, "admin_api_key": None},
              "argv": ["--api-key", KEY], "rc": 1}
    out = redact_data(result)
    assert KEY not in json.dumps(out)
    assert out["values"] == {"--api-key": REDACTED, "--port": 1}
    assert out["dest_values"] == {"api_key": REDACTED, "admin_api_key": None}
    assert out["argv"] == ["--api-key", REDACTED] and out["rc"] == 1
    assert result["argv"] == ["--api-key", KEY], "the input is not changed"


def test_a_line_shortened_inside_the_key_still_hides_what_is_left_of_it():
    # sglang_process's progress quotes the log's last line cut to 100 characters: the closing quote may be gone.
    line = "server_args=ServerArgs(api_key='%s', port=1)" % KEY
    assert redact_text(line[:40]) == "server_args=ServerArgs(api_key=" + REDACTED
    assert KEY[:5] not in redact_text(line[:40])


def test_a_variable_reference_is_not_a_key_and_the_unit_text_reads_back_as_written():
    # The systemd unit's ExecStart= (the rollback reads it back from launch.json through a redacted module result).
    unit = "ExecStart=/v/bin/python -m sglang.launch_server --port 30000 --api-key ${GPUFLEET_SGLANG_API_KEY}\n"
    assert redact_text(unit) == unit
    assert redact_text("--api-key=$KEY --admin-api-key ${ADMIN}") == "--api-key=$KEY --admin-api-key ${ADMIN}"
    assert redact_text("--api-key $x-real-key") == "--api-key ********"


def test_abbreviated_key_flags_are_redacted_as_sglangs_argparse_reads_them():
    # argparse (allow_abbrev) takes --api-ke for --api-key: the value after it is a key all the same.
    argv = ["python", "-m", "sglang.launch_server", "--api-ke", KEY, "--admin-api-k", ADMIN, "--port", "1"]
    assert redact_argv(argv) == ["python", "-m", "sglang.launch_server", "--api-ke", REDACTED,
                                 "--admin-api-k", REDACTED, "--port", "1"]
    assert redact_argv(["x", "--api-ke=" + KEY, "--ad=" + ADMIN, "--ap", KEY]) == [
        "x", "--api-ke=" + REDACTED, "--ad=" + REDACTED, "--ap", REDACTED]
    title = "python -m sglang.launch_server --api-ke %s --admin-api=%s --port 1" % (KEY, ADMIN)
    assert redact_text(title) == "python -m sglang.launch_server --api-ke %s --admin-api=%s --port 1" % (
        REDACTED, REDACTED)
    assert redact_text(str(["--api-k", KEY])) == "['--api-k', '%s']" % REDACTED
    # one letter is no abbreviation counted (ambiguous in SGLang), a longer flag is another flag
    assert redact_argv(["--a", "x", "--api-key-file", "/k", "--port", "1"]) == [
        "--a", "x", "--api-key-file", "/k", "--port", "1"]


@pytest.mark.parametrize("name, flag", [
    ("api-key", "api-key"), ("api-ke", "api-key"), ("ap", "api-key"), ("api_key", "api-key"), ("API-KE", "api-key"),
    ("admin-api-key", "admin-api-key"), ("admin-api-k", "admin-api-key"), ("ad", "admin-api-key"),
    ("host", "host"), ("ho", "host"), ("port", "port"), ("po", "port"), ("--po", "port"),
    ("a", None), ("h", None), ("p", None), ("hosts", None), ("api-key-file", None), ("tp-size", None),
    ("speculative-num-steps", None), ("", None), (None, None), (7, None),
])
def test_inventory_flag_names_the_flag_a_name_is_or_abbreviates(name, flag):
    assert inventory_flag(name) == flag
    assert inventory_flag(name, SGLANG_SECRET_FLAGS) == (flag if flag in SGLANG_SECRET_FLAGS else None)


def test_abbreviates_is_argparses_prefix_rule_for_long_options():
    assert abbreviates("--tp", "--tp-size") and abbreviates("--tp-size", "--tp-size")
    assert not abbreviates("--tp-sizes", "--tp-size") and not abbreviates("tp", "--tp-size")
    assert not abbreviates("--h", "-h")
