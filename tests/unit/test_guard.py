"""plugins/plugin_utils/guard.py (the command-line guard's decisions, filters in plugins/filter/gpufleet_run.py):
the checks of survey answers, with the ranges of plugins/plugin_utils/schema.py. Moved from
test_filter_gpufleet_run.py."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import guard as run
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import schema



@pytest.mark.parametrize("value", [None, "", "  ", 1, "2", " 3 ", "25%", "0.5%", "100%", [1, "50%"], ("2", 5)])
def test_valid_serial_values_pass(value):
    assert run.gpufleet_serial_error(value) == ""


@pytest.mark.parametrize("value,word", [
    ("abc", "'abc' is neither a number of hosts nor a percentage"),
    (0, "below 1"), ("0", "below 1"), ("150%", "above 100 %"), ("0%", "is no hosts: a percentage must be above 0"),
    (2.5, "not a whole number"), (True, "boolean"), ([1, "x"], "'x'"), ([], "empty list"),
    ({"a": 1}, "dict"),
])
def test_invalid_serial_values_are_named_with_what_to_give(value, word):
    message = run.gpufleet_serial_error(value)
    assert message.startswith("gpufleet_serial") and word in message, message
    assert run.gpufleet_serial_value(value) == 1


def test_serial_value_keeps_valid_values_and_defaults_unset_to_one():
    assert run.gpufleet_serial_value("") == 1
    assert run.gpufleet_serial_value(None) == 1
    assert run.gpufleet_serial_value(" 25% ") == "25%"
    assert run.gpufleet_serial_value([1, " 50% "]) == [1, "50%"]
    assert run.gpufleet_serial_value(3) == 3


def test_empty_survey_answers_are_unset_and_pass():
    values = {"gpufleet_serial": "", "sglang_port": "", "target": "", "sglang_verify_throughput": "",
              "gpufleet_lock_lease_s": ""}
    assert run.gpufleet_guard_errors(values) == []


@pytest.mark.parametrize("name,value,word", [
    ("sglang_port", "abc", "sglang_port='abc' is not a whole number"),
    ("sglang_port", 70000, "sglang_port=70000 is out of range (1-65535)"),
    ("sglang_port", True, "sglang_port=True is not a whole number"),
    ("gpufleet_lock_lease_s", "0", "gpufleet_lock_lease_s='0' is out of range (1-604800)"),
    ("gpufleet_lock_stale_s", "soon", "gpufleet_lock_stale_s='soon' is not a whole number"),
    ("sglang_verify_throughput", "maybe", "sglang_verify_throughput='maybe' is not a boolean"),
    ("target", ["a", "b"], "target=['a', 'b'] is a list"),
])
def test_type_errors_name_the_variable_the_user_set(name, value, word):
    [message] = run.gpufleet_guard_errors({name: value})
    assert word in message, message


@pytest.mark.parametrize("name", schema.switches())
def test_a_mistyped_switch_is_refused_before_any_host_is_touched(name):
    # gpufleet_rollback=ture passed every check before the stop; the rollback's own argument check then failed and
    # the host was left down with no rollback; `| bool` reads it as false in silence elsewhere.
    [message] = run.gpufleet_guard_errors({name: "ture"})
    assert message.startswith("%s='ture' is not a boolean; give true or false" % name), message
    for good in (True, False, "yes", "No", " true ", "off", "1", 0, 1, "", None):
        assert run.gpufleet_guard_errors({name: good}) == [], (name, good)
    for bad in (2, "enabled", ["yes"], {"a": 1}):
        assert run.gpufleet_guard_errors({name: bad}), (name, bad)


def test_good_values_pass():
    assert run.gpufleet_guard_errors({"sglang_port": "30001", "gpufleet_lock_lease_s": 20,
                                      "sglang_verify_throughput": "yes", "target": "gpu_hosts:!gpu-07"}) == []


@pytest.mark.parametrize("name,value,word", [
    # -e sglang_launch_ready_timeout_s=-1 passed every check, the launch gave up after its first probe (the
    # server was still loading), and the rollback's relaunch did the same: a serving host down from a typo.
    ("sglang_launch_ready_timeout_s", "-1", "sglang_launch_ready_timeout_s='-1' is out of range (1-86400)"),
    ("sglang_launch_ready_timeout_s", "0", "sglang_launch_ready_timeout_s='0' is out of range (1-86400)"),
    # 'abc' was found only by the launch role's argument spec, after the stop; the rollback's wait failed on it
    # too and the summary said "serves nothing" while the relaunched server served.
    ("sglang_launch_ready_timeout_s", "abc", "sglang_launch_ready_timeout_s='abc' is not a whole number"),
    ("sglang_launch_ready_timeout_s", "1.5", "sglang_launch_ready_timeout_s='1.5' is not a whole number"),
    ("gpu_memory_wait_timeout_s", "0", "gpu_memory_wait_timeout_s='0' is out of range (more than 0 to 86400)"),
    ("gpu_memory_wait_timeout_s", "soon", "gpu_memory_wait_timeout_s='soon' is not a number"),
    ("sglang_stop_grace_s", "-2", "sglang_stop_grace_s='-2' is out of range (0 to 86400)"),
    ("sglang_launch_ready_slice_s", "nan", "sglang_launch_ready_slice_s='nan' is out of range (more than 0 to 3600)"),
    ("gpufleet_router_ready_timeout_s", True, "gpufleet_router_ready_timeout_s=True is not a number"),
])
def test_restart_timeouts_are_checked_before_any_host_is_touched(name, value, word):
    [message] = run.gpufleet_guard_errors({name: value})
    assert word in message and "do not set it for the role's default" in message, message


def test_an_empty_restart_timeout_is_refused_unless_its_role_maps_empty_to_the_default():
    # -e sglang_launch_ready_timeout_s= reaches the launch role's argument spec as '' and fails it after the
    # stop (and the rollback's relaunch wait with it); the router's two map '' to 120 (an unanswered survey).
    [message] = run.gpufleet_guard_errors({"sglang_launch_ready_timeout_s": " "})
    assert message.startswith("sglang_launch_ready_timeout_s is empty") and "do not set it at all" in message
    assert run.gpufleet_guard_errors({"gpufleet_router_ready_timeout_s": "", "gpufleet_router_drain_timeout_s": ""}) \
        == []


def test_infinite_values_and_a_stop_poll_interval_above_what_sglang_stop_takes_are_refused():
    [message] = run.gpufleet_guard_errors({"gpu_memory_wait_timeout_s": "inf"})
    assert "gpu_memory_wait_timeout_s='inf' is out of range" in message
    [message] = run.gpufleet_guard_errors({"sglang_stop_poll_interval_ms": 200})
    assert "sglang_stop_poll_interval_ms=200 is out of range (1-100)" in message
    assert "a whole number of ms (1-100)" in message
    assert run.gpufleet_guard_errors({"sglang_stop_poll_interval_ms": 100}) == []


def test_a_zero_drain_timeout_means_do_not_wait_and_passes():
    # roles/sglang_router: "0 = do not wait" for the in-flight requests after the router dropped the host.
    assert run.gpufleet_guard_errors({"gpufleet_router_drain_timeout_s": 0}) == []
    assert run.gpufleet_guard_errors({"gpufleet_router_drain_timeout_s": "0"}) == []
    [message] = run.gpufleet_guard_errors({"gpufleet_router_drain_timeout_s": -1})
    assert "out of range (0 to 86400)" in message


def test_good_restart_timeouts_pass():
    assert run.gpufleet_guard_errors({"sglang_launch_ready_timeout_s": "900", "gpu_memory_wait_timeout_s": "1.5",
                                      "sglang_stop_grace_s": 0, "gpu_memory_wait_max_used_mib": 0,
                                      "sglang_launch_ready_slice_s": 10, "gpufleet_router_drain_timeout_s": "",
                                      "gpu_memory_wait_slice_s": 2.5, "sglang_stop_kill_timeout_s": "15",
                                      "sglang_verify_request_timeout_s": None}) == []


def test_a_whole_number_written_with_a_point_passes_where_the_roles_take_it():
    # The roles' argument specs and modules (type int) take "900.0" as 900, so the guard must not refuse it; a
    # port is not a tunable and is put into URLs as written, so "30000.0" stays refused there.
    from ansible.module_utils.common.validation import check_type_int
    assert check_type_int("900.0") == 900
    assert run.gpufleet_guard_errors({"sglang_launch_ready_timeout_s": "900.0",
                                      "sglang_stop_poll_interval_ms": "50.0", "gpu_memory_wait_max_used_mib": 0.0}) == []
    [message] = run.gpufleet_guard_errors({"sglang_stop_poll_interval_ms": "150.0"})
    assert "out of range (1-100)" in message
    [message] = run.gpufleet_guard_errors({"sglang_launch_ready_timeout_s": "nan"})
    assert "not a whole number" in message
    assert run.gpufleet_guard_errors({"sglang_port": "30000.0"})


def test_launch_and_verify_numbers_are_checked_before_the_stop_too():
    # Trial: -e sglang_verify_max_new_tokens=-5 passed preflight, stopped a serving host, and verify failed on the
    # new server ("answered -1 without generated text") without naming the variable.
    [message] = run.gpufleet_guard_errors({"sglang_verify_max_new_tokens": -5})
    assert message.startswith("sglang_verify_max_new_tokens=-5 is out of range (1-65536)"), message
    assert "a whole number of tokens (1-65536)" in message
    [message] = run.gpufleet_guard_errors({"sglang_verify_max_regression_fraction": "lots"})
    assert "not a number" in message and "a fraction of the last good figure" in message
    for name in ("sglang_verify_throughput_requests", "sglang_verify_throughput_concurrency",
                 "sglang_verify_throughput_max_new_tokens"):
        assert run.gpufleet_guard_errors({name: 0}), name
    # 0 lines would show the whole tail ([-0:] is everything)
    assert run.gpufleet_guard_errors({"sglang_launch_log_tail_lines": 0})
    assert run.gpufleet_guard_errors({"sglang_launch_startup_check_s": -0.5})
    # a fraction: 30 meant as 30 % would switch the regression check off
    [message] = run.gpufleet_guard_errors({"sglang_verify_max_regression_fraction": 30})
    assert "out of range (0 to 1)" in message, message
    # 0 means something for these: no RestartSec pause, no worker count, no floor, no drop allowed, no startup
    # watch.
    assert run.gpufleet_guard_errors({"sglang_launch_systemd_restart_sec": 0, "sglang_launch_log_tail_lines": 1,
                                      "sglang_verify_min_workers": 0, "sglang_verify_min_tokens_per_s": 0,
                                      "sglang_verify_max_regression_fraction": "0", "sglang_launch_startup_check_s": 0,
                                      "sglang_launch_start_wait_s": 0.0, "sglang_verify_max_new_tokens": "8"}) == []


def test_guard_refuses_more_min_workers_than_the_launch_args_start():
    """1e3 (or 9 with tp 8) passed the guard and failed verify on a healthy new server: an outage and a rollback."""
    tp8 = {"tp-size": 8, "model-path": "/m"}
    [message] = run.gpufleet_guard_errors({"sglang_verify_min_workers": "1e3", "sglang_launch_args": tp8})
    assert message.startswith("sglang_verify_min_workers='1e3' is more than the 8 GPU worker processes"), message
    assert "give 8 or less" in message
    assert run.gpufleet_guard_errors({"sglang_verify_min_workers": 9, "sglang_launch_args": tp8})
    # the bound is tp × pp × dp, each size under either spelling; at the bound or without launch args it passes
    for args, fine in (({"tp": 8, "pp-size": 2}, 16), ({"tp-size": "4", "dp-size": 2}, 8), ({"dp": 3}, 3),
                       ({}, 1), ({"tp-size": None}, 1)):
        assert run.gpufleet_guard_errors({"sglang_verify_min_workers": fine, "sglang_launch_args": args}) == [], args
        assert run.gpufleet_guard_errors({"sglang_verify_min_workers": fine + 1, "sglang_launch_args": args}), args
    assert run.gpufleet_guard_errors({"sglang_verify_min_workers": 64}) == []
    # SGLang's long spellings count; an abbreviation of a size flag (argparse resolves it per release) or two
    # spellings of one size leave the bound unknown: no refusal of a setup that may be right
    for args in ({"tensor-parallel-size": 8}, {"tp-size": 4, "data-parallel-size": 2}, {"pipeline_parallel_size": 8}):
        assert run.gpufleet_guard_errors({"sglang_verify_min_workers": 8, "sglang_launch_args": args}) == [], args
        assert run.gpufleet_guard_errors({"sglang_verify_min_workers": 9, "sglang_launch_args": args}), args
    for args in ({"tp-si": 8}, {"tensor-p": 8}, {"d": 2}, {"tp": 2, "tp-size": 2}):
        assert run.gpufleet_guard_errors({"sglang_verify_min_workers": 16, "sglang_launch_args": args}) == [], args
    assert run.gpufleet_guard_errors({"sglang_verify_min_workers": "9" * 400, "sglang_launch_args": tp8})
    assert run.gpufleet_guard_errors({"sglang_verify_min_workers": 64, "sglang_launch_args": {"tp-size": "x"}}) == []
    # a value the tunables check refuses is named once
    assert len(run.gpufleet_guard_errors({"sglang_verify_min_workers": -1, "sglang_launch_args": tp8})) == 1


def test_tp_pp_size_reads_every_spelling_and_falls_back_to_one():
    """sglang_verify_min_workers' default: with tensor-parallel-size 8 it was 1 (only tp-size and tp were read)."""
    for args, want in (({"tp-size": 8}, 8), ({"tensor-parallel-size": 8}, 8), ({"tp": "4", "pp-size": 2}, 8),
                       ({"--pipeline_parallel_size": 2, "tp-size": 4, "dp-size": 2}, 8), ({}, 1),
                       ({"model-path": "/m"}, 1), ({"tp-size": None}, 1), ({"tp-size": 0}, 1),
                       ({"tp-si": 8}, 1), ({"tp": 8, "tp-size": 4}, 1), ({"tp-size": "x"}, 1), (None, 1), ("8", 1)):
        assert run.gpufleet_tp_pp_size(args) == want, args


def test_guard_report_names_hosts_only_when_not_all_are_concerned():
    hostvars = {"h1": {"sglang_port": "x"}, "h2": {"sglang_port": "x"}, "h3": {"sglang_port": 30000}}
    assert run.gpufleet_guard_report(hostvars, ["h1", "h2"]) == [run.gpufleet_guard_errors({"sglang_port": "x"})[0]]
    [message] = run.gpufleet_guard_report(hostvars, ["h1", "h2", "h3"])
    assert message.endswith("(on h1, h2)")


def test_deprecated_stale_s_is_reported():
    assert run.gpufleet_guard_deprecations({"h1": {"gpufleet_lock_stale_s": 7200}}, ["h1"])[0].startswith(
        "gpufleet_lock_stale_s is deprecated: set gpufleet_lock_lease_s")
    assert run.gpufleet_guard_deprecations({"h1": {}}, ["h1"]) == []


@pytest.mark.parametrize("given,expected", [(0, "0"), ("0", "0"), (30, "30"), ("", "120"), (None, "120"),
                                            ("UNDEFINED", "120")])
def test_router_drain_and_ready_timeouts_keep_0_and_map_unset_to_the_default(given, expected):
    # roles/sglang_router/defaults: "0 = do not wait"; default(120, true) used to turn an integer 0 into 120.
    import pathlib
    import jinja2
    import yaml
    root = pathlib.Path(__file__).resolve().parents[2]
    defaults = yaml.safe_load((root / "roles" / "sglang_router" / "defaults" / "main.yml").read_text())
    env = jinja2.Environment()
    env.filters["gpufleet.fleet.gpufleet_unset"] = run.gpufleet_unset
    for role_var, playbook_var in (("sglang_router_drain_timeout_s", "gpufleet_router_drain_timeout_s"),
                                   ("sglang_router_ready_timeout_s", "gpufleet_router_ready_timeout_s")):
        values = {} if given == "UNDEFINED" else {playbook_var: given}
        assert env.from_string(defaults[role_var]).render(**values).strip() == expected, role_var


def test_the_verify_burst_settings_are_checked_before_the_stop_and_0_requests_turns_it_off():
    assert run.gpufleet_guard_errors({"sglang_verify_burst_requests": 0, "sglang_verify_burst_concurrency": 8,
                                      "sglang_verify_burst_max_new_tokens": "8",
                                      "sglang_verify_burst_timeout_s": "2.5"}) == []
    [message] = run.gpufleet_guard_errors({"sglang_verify_burst_requests": 99999999999999999999})
    assert message.startswith("sglang_verify_burst_requests=") and "(0-1000)" in message, message
    [message] = run.gpufleet_guard_errors({"sglang_verify_burst_concurrency": 65})
    assert "(1-64)" in message, message
    [message] = run.gpufleet_guard_errors({"sglang_verify_burst_timeout_s": 0})
    assert message.startswith("sglang_verify_burst_timeout_s=0 is out of range (more than 0 to 3600)"), message
    assert run.gpufleet_guard_errors({"sglang_verify_burst_max_new_tokens": 0})


def test_a_twenty_digit_serial_is_all_the_targeted_hosts_in_one_batch_and_said_so():
    # -e gpufleet_serial=99999999999999999999 passed the guard and ansible-core's batching looped over
    # range(serial) for ever before touching a host.
    huge = "99999999999999999999"
    assert run.gpufleet_serial_error(huge) == ""
    assert run.gpufleet_serial_value(huge, 4) == 4
    assert run.gpufleet_serial_value(int(huge), 4) == 4
    assert run.gpufleet_serial_value([1, huge], 4) == [1, 4]
    assert run.gpufleet_batch_size(huge, 4) == 4
    [note] = run.gpufleet_serial_notes(huge, 4)
    assert note == ("gpufleet_serial='99999999999999999999': a count is more than the 4 targeted host(s), so a batch "
                    "takes all 4 of them"), note
    assert run.gpufleet_serial_notes(4, 4) == [] and run.gpufleet_serial_notes("100%", 4) == []
    assert run.gpufleet_serial_notes("abc", 4) == []  # the guard's error says it
    # the guard play reads it from the first targeted host
    hostvars = {"a": {"gpufleet_serial": huge}, "b": {"gpufleet_serial": huge}}
    assert run.gpufleet_guard_notes(hostvars, ["a", "b"]) == run.gpufleet_serial_notes(huge, 2)
    assert run.gpufleet_guard_report(hostvars, ["a", "b"]) == []


def test_a_serial_of_more_digits_than_python_reads_is_capped_not_a_crash():
    thousands = "9" * 5000  # int() refuses more than 4300 digits (sys.int_info.default_max_str_digits)
    assert run.gpufleet_serial_error(thousands) == ""
    assert run.gpufleet_serial_value(thousands, 3) == 3
    assert run.gpufleet_serial_value(thousands) == run._SERIAL_CAP
    [note] = run.gpufleet_serial_notes(thousands, 3)
    assert len(note) < 200 and "all 3" in note
    # a float the YAML reader turns into infinity: an error, not an OverflowError from the message's %d
    assert "is not a whole number" in run.gpufleet_serial_error(float("inf"))
    assert "is not a whole number" in run.gpufleet_serial_error(float("nan"))


def test_serial_percentages_reach_ansible_whole_or_as_counts():
    # ansible-core's pct_to_int does int("0.5") for "0.5%" and raised "Unexpected Exception" after preflight.
    from ansible.utils.helpers import pct_to_int
    assert run.gpufleet_serial_value("0.5%") == "1%" and run.gpufleet_serial_value("12.5%") == "12%"
    assert run.gpufleet_serial_value("12.5%", 16) == 2 and run.gpufleet_serial_value("0.5%", 16) == 1
    assert run.gpufleet_serial_value(" 25% ", 8) == 2
    for value in ("0.5%", "12.5%", "100%", "3"):
        pct_to_int(run.gpufleet_serial_value(value), 16)  # raises no more


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(min_value=-10, max_value=10 ** 30),
                 st.integers(min_value=1, max_value=10 ** 30).map(str),
                 st.floats(min_value=0.001, max_value=100.0).map(lambda p: "%s%%" % p),
                 st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=30)),
       st.integers(min_value=1, max_value=500))
def test_property_serial_never_gives_ansible_a_batch_above_the_hosts_nor_a_value_it_cannot_read(value, n_hosts):
    from ansible.utils.helpers import pct_to_int
    error = run.gpufleet_serial_error(value)
    assert isinstance(error, str)
    given_value = run.gpufleet_serial_value(value, n_hosts)
    items = given_value if isinstance(given_value, list) else [given_value]
    for item in items:
        assert 1 <= pct_to_int(item, n_hosts) <= n_hosts
    if error:
        assert given_value == 1
    unknown = run.gpufleet_serial_value(value)  # the play's hosts not known: bounded all the same
    for item in unknown if isinstance(unknown, list) else [unknown]:
        assert 1 <= pct_to_int(item, n_hosts) <= run._SERIAL_CAP
    assert 1 <= run.gpufleet_batch_size(value, n_hosts) <= n_hosts


@pytest.mark.parametrize("name", sorted(schema.TUNABLES) + ["gpufleet_lock_lease_s", "gpufleet_lock_stale_s",
                                                          "gpufleet_lock_margin_s"])
def test_every_count_of_the_guard_has_a_most_and_a_twenty_digit_value_is_refused(name):
    for huge in ("99999999999999999999", 99999999999999999999, 10 ** 400, "9" * 5000, "1e400", 1e300):
        [message] = run.gpufleet_guard_errors({name: huge})
        assert message.startswith(name + "=") and ("out of range" in message or "not a whole number" in message
                                                   or "not a number" in message), message
        assert len(message) < 400, message
    high = schema.RANGES[name].high
    assert run.gpufleet_guard_errors({name: high}) == [], name


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(schema.TUNABLES) + ["gpufleet_lock_lease_s", "sglang_port"]),
       st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=25),
                 st.integers().map(str), st.booleans(), st.none()))
def test_property_the_guard_never_raises_and_passes_only_values_within_the_bounds(name, value):
    errors = run.gpufleet_guard_errors({name: value})
    assert all(isinstance(e, str) for e in errors)
    if not errors and not run.gpufleet_unset(value) and not isinstance(value, bool):
        number = float(str(value).strip())
        assert number <= schema.RANGES[name].high, (name, value)


def test_the_argument_specs_for_validate_argument_spec_cover_the_set_variables_the_guard_has_no_message_for():
    hostvars = {"h1": {"sglang_launch_method": "sytemd", "sglang_port": "x", "gpufleet_rollback": "ture",
                       "sglang_launch_args": {"tp-size": 8}, "sglang_service_user": "", "target": "h1"},
                "h2": {"sglang_launch_method": "sytemd", "sglang_port": "x", "gpufleet_rollback": "ture",
                       "sglang_launch_args": {"tp-size": 8}},
                "h3": {"sglang_launch_method": "process"},
                "h4": {"gpufleet_serial": 2}}
    groups = run.gpufleet_guard_argument_specs(hostvars, ["h1", "h2", "h3", "h4"])
    # port, rollback and target have messages of their own; an empty value is unset; serial is raw
    assert groups == [
        {"hosts": ["h1", "h2"], "provided_arguments": {"sglang_launch_method": "sytemd",
                                                       "sglang_launch_args": {"tp-size": 8}},
         "argument_spec": {"sglang_launch_method": {"type": "str", "choices": ["systemd", "process"]},
                           "sglang_launch_args": {"type": "dict"}}},
        {"hosts": ["h3"], "provided_arguments": {"sglang_launch_method": "process"},
         "argument_spec": {"sglang_launch_method": {"type": "str", "choices": ["systemd", "process"]}}},
    ]
    assert run.gpufleet_guard_argument_specs(hostvars, ["h4"]) == []


def test_a_secret_reaches_validate_argument_spec_only_as_a_stand_in_of_its_type():
    # The task's arguments and loop item land in the job events: the key must not (issue 31's grep found it there).
    key = "sk-" + "x" * 40
    hostvars = {"h1": {"sglang_api_key": key, "sglang_launch_method": "process"},
                "h2": {"sglang_api_key": ["not", "a", "string"]}}
    groups = run.gpufleet_guard_argument_specs(hostvars, ["h1", "h2"])
    assert key not in repr(groups)
    assert groups[0]["provided_arguments"] == {"sglang_api_key": "********", "sglang_launch_method": "process"}
    assert groups[0]["argument_spec"]["sglang_api_key"]["no_log"] is True
    # a wrong type is still a wrong type
    assert groups[1]["provided_arguments"] == {"sglang_api_key": []}


class _Lazy(dict):
    """A host's hostvars: a value templated from facts not gathered yet raises when read."""

    def __getitem__(self, key):
        if key == "sglang_host":
            raise RuntimeError("'ansible_default_ipv4' is undefined")
        return dict.__getitem__(self, key)


def test_a_value_that_cannot_be_templated_here_is_left_to_its_role():
    hostvars = {"h1": _Lazy(sglang_host="{{ ansible_default_ipv4.address }}", sglang_launch_method="process")}
    [group] = run.gpufleet_guard_argument_specs(hostvars, ["h1"])
    assert group["provided_arguments"] == {"sglang_launch_method": "process"}


def test_validate_argument_specs_errors_join_the_report_naming_the_hosts_they_concern():
    hostvars = {"h1": {"sglang_port": "x"}, "h2": {"sglang_port": "x"}, "h3": {}}
    validated = {"results": [
        {"item": {"hosts": ["h1", "h3"]}, "failed": False,
         "argument_errors": ["value of sglang_launch_method must be one of: systemd, process, got: sytemd found in "
                             "gpufleet_guard_values"]},
        {"item": {"hosts": ["h2"]}, "failed": False, "argument_errors": []},
    ]}
    report = run.gpufleet_guard_report(hostvars, ["h1", "h2", "h3"], validated)
    assert report[0].startswith("sglang_port='x' is not a whole number") and report[0].endswith("(on h1, h2)")
    assert report[1] == ("value of sglang_launch_method must be one of: systemd, process, got: sytemd (the type the "
                         "roles' argument specs give it); fix it where it is set (host_vars, group_vars, an AWX "
                         "survey or -e), or do not set it for the default (on h1, h3)")
    # nothing was looped over (no variable of that kind set): the report is the guard's own
    assert run.gpufleet_guard_report(hostvars, ["h3"], {"results": [], "skipped": True}) == []
