"""The values rendered into the systemd unit, run as root or used as paths and user names (issue 31):
plugins/module_utils/gpufleet_unit_values.py (the rule), plugins/filter/gpufleet_values.py (guard and preflight)
and the unit filters of plugins/filter/gpufleet.py (systemd_value, systemd_path), read back the way systemd reads
a unit file (systemd.syntax(7), systemd.unit(5) specifiers)."""
import os

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_unit_values as uv
from plugins.filter import gpufleet as f
from plugins.filter import gpufleet_values as fv
from unit_template import render_unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAYLOAD = 'sglang\nExecStartPre=+/bin/sh -c "id > /tmp/pwned"'
CONTROLS = ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\x9b", "\u2028", "\u2029"]


def systemd_reads(text):
    """{(section, key): [values]} as systemd reads a unit file: a line ending in a backslash goes on with the next
    (the backslash becomes a space), # and ; start comments, white space at both ends of a value is dropped, and
    a specifier is resolved: %% is %, any other % is reported as a specifier ('<%X>')."""
    lines, pending = [], ""
    for raw in text.split("\n"):
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    read, section = {}, None
    for line in lines:
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out, i, value = [], 0, value.strip()
        while i < len(value):
            if value[i] == "%":
                out.append("%" if value[i + 1:i + 2] == "%" else "<%" + value[i + 1:i + 2] + ">")
                i += 2
            else:
                out.append(value[i])
                i += 1
        read.setdefault((section, key.strip()), []).append("".join(out))
    return read


def unit(**lines):
    return "[Service]\n" + "".join("%s=%s\n" % (k, v) for k, v in lines.items())


# --- control characters ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("char", CONTROLS)
@pytest.mark.parametrize("name", ["sglang_service_user", "sglang_state_dir", "sglang_host", "sglang_launch_unit_name",
                                  "sglang_launch_log_file", "sglang_python"])
def test_a_control_character_is_refused_naming_the_variable_and_shown_escaped(name, char):
    value = "/var/lib/gp" + char + "ufleet" if name not in ("sglang_service_user", "sglang_host") else "sgl" + char + "ang"
    [problem] = uv.value_problems(name, value)
    assert problem.startswith(name + "=") and "control character (%s)" % uv.escape(char) in problem
    assert "refused" in problem and char not in problem


def test_the_issue_payload_is_refused_with_the_value_escaped_on_one_line():
    [problem] = uv.unit_value_problems({"sglang_service_user": PAYLOAD})
    assert problem.startswith("sglang_service_user='sglang\\nExecStartPre=+/bin/sh")
    assert "\n" not in problem and "control character (\\n)" in problem


def test_escape_writes_every_unprintable_character_as_an_escape():
    assert uv.escape("a\nb\tc\x1b\x85\u2028\u200b'\\") == "a\\nb\\tc\\x1b\\x85\\u2028\\u200b\\'\\\\"
    assert uv.show("x" * 200).endswith("...'") and len(uv.show("x" * 200)) == 162
    assert uv.show("x" * 200, limit=70).endswith("...'") and len(uv.show("x" * 200, limit=70)) == 72
    assert uv.show(["a\nb"]) == "['a\\nb']"


@pytest.mark.parametrize("name", ["sglang_nccl_env", "sglang_launch_extra_env"])
def test_environment_names_and_values_with_control_characters_are_refused(name):
    [value_problem] = uv.value_problems(name, {"NCCL_PROTO": "LL\nExecStartPre=/bin/id"})
    assert value_problem.startswith(name + "[NCCL_PROTO]='LL\\nExecStartPre") and "refused" in value_problem
    [key_problem] = uv.value_problems(name, {"A\nB": "1"})
    assert key_problem.startswith(name + " has a key 'A\\nB'")
    assert uv.value_problems(name, {"NCCL_PROTO": "LL", "SPT_NOENV": 1, "X": "a b %$"}) == []


def test_launch_args_keys_and_values_at_any_depth_are_checked():
    args = {"model-path": "/models/m", "served-model-name": "m\u2028x", "cuda-graph-bs": [1, "2\n"],
            "json-model-override-args": {"rope\x1b": {"type": "yarn\r"}}, "tp-size": 8, "trust-remote-code": True}
    problems = uv.value_problems("sglang_launch_args", args)
    assert [p.split("=")[0].split(" ")[0] for p in problems] == [
        "sglang_launch_args[served-model-name]", "sglang_launch_args[cuda-graph-bs][1]",
        "sglang_launch_args[json-model-override-args]", "sglang_launch_args[json-model-override-args][rope\\x1b][type]"]
    assert uv.value_problems("sglang_launch_args", {"model-path": "/m", "chat-template": "a %s $x 'q'"}) == []


def test_launcher_first_word_is_a_path_or_a_command_name_and_the_rest_has_no_control_character():
    assert uv.value_problems("sglang_launcher", ["/opt/sglang/.venv/bin/python", "-m", "sglang.launch_server"]) == []
    assert uv.value_problems("sglang_launcher", ["sglang", "serve"]) == []
    for first in ("+/bin/sh", "-/usr/bin/python", "@/usr/bin/python", "!python", ":python", "bin/python",
                  "/opt/../bin/python", "/opt/x y/python"):
        [problem] = uv.value_problems("sglang_launcher", [first, "-m", "x"])
        assert problem.startswith("sglang_launcher[0]=") and "refused" in problem, first
    [problem] = uv.value_problems("sglang_launcher", ["/usr/bin/python", "-c\nExecStartPre=/bin/id"])
    assert problem.startswith("sglang_launcher[1]=")
    assert uv.value_problems("sglang_launcher", "not a list") == []  # the roles' type check names that


# --- user names ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("user", ["sglang", "_sglang", "svc-sglang", "first.last", "Sglang", "a" * 32])
def test_posix_user_names_pass(user):
    assert uv.value_problems("sglang_service_user", user) == []


@pytest.mark.parametrize("user", ["sglang ExecStartPre=x", "-sglang", "1000", "sglang$", "sgl%ang", "sgl/ang",
                                  "sgl:ang", "a" * 33, ".hidden", "sglang\\", "séglang"])
def test_anything_else_is_not_a_user_name(user):
    [problem] = uv.value_problems("sglang_service_user", user)
    assert problem.startswith("sglang_service_user=") and "is not a user name: refused" in problem


def test_root_is_refused_for_the_systemd_method_only():
    [problem] = uv.unit_value_problems({"sglang_service_user": "root"})
    assert problem.startswith("sglang_service_user=root: refused, the server runs unprivileged")
    assert uv.unit_value_problems({"sglang_service_user": "root", "sglang_launch_method": "systemd"}) == [problem]
    assert uv.unit_value_problems({"sglang_service_user": "root", "sglang_launch_method": "process"}) == []
    [typed] = uv.unit_value_problems({"sglang_service_user": 1000})
    assert "is a int, not a user name" in typed


# --- paths --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/", "/var/lib/gpufleet", "/srv/state-1/sglang.log", "/opt/100%/x$y",
                                  "/var/lib/gpu:fleet", "/données/état"])
def test_absolute_normalised_paths_pass(path):
    assert uv.value_problems("sglang_state_dir", path) == []


@pytest.mark.parametrize("path,words", [
    ("var/lib/gpufleet", "not an absolute path"), ("-/var/lib/gpufleet", "not an absolute path"),
    ("~/state", "not an absolute path"), ("/var/lib/../../etc", "not a normalised path"),
    ("/var/lib/./gpufleet", "not a normalised path"), ("/var/lib//gpufleet", "not a normalised path"),
    ("//var/lib/gpufleet", "not a normalised path"), ("/var/lib/gpufleet/", "not a normalised path"),
    ("/var/lib/gpufleet/..", "not a normalised path"), ("/var/lib/gpu\\fleet", "a backslash"),
    ("/var/lib/gpufleet\\", "a backslash"), ("/var/lib/gpu fleet", "white space"), ("/var/lib/gpufleet ", "white space"),
    ("/var/lib/gpu\u00a0fleet", "white space"), ('/var/lib/"gpufleet"', "a quote"), ("/var/lib/gpu'fleet", "a quote"),
    ("/var/lib/*", "a glob character"), ("/var/lib/gpufleet?", "a glob character"), ("/var/lib/[ab]", "a glob character"),
    ("/var/lib/gpu\u200bfleet", "not printable"), ("/" + "a" * 4095, "more than a path may be"),
])
def test_paths_a_systemd_setting_would_not_keep_are_refused(path, words):
    for name in ("sglang_state_dir", "sglang_launch_log_file", "sglang_launch_api_key_file", "gpufleet_lock_dir",
                 "sglang_python", "sglang_nccl_patch_path", "sglang_launch_unit_dir"):
        [problem] = uv.value_problems(name, path)
        assert problem.startswith((name + "=", name + " is")) and words in problem


def test_a_path_that_is_no_string_is_refused_and_an_unset_one_is_left_to_the_roles():
    [problem] = uv.value_problems("sglang_state_dir", ["/a"])
    assert "is a list, not a path" in problem
    assert uv.value_problems("sglang_state_dir", None) == [] and uv.value_problems("sglang_nccl_patch_path", "") == []


def test_a_path_derived_from_a_refused_state_dir_is_named_once():
    bad = "/var/lib/g\nx"
    problems = uv.unit_value_problems({"sglang_state_dir": bad, "sglang_launch_log_file": bad + "/sglang.log",
                                       "gpufleet_lock_dir": bad + "/restart.lock", "sglang_python": "/o/../p",
                                       "sglang_launcher": ["/o/../p", "-m", "sglang.launch_server"]})
    assert [p.split("=")[0] for p in problems] == ["sglang_state_dir", "sglang_python"]


# --- unit names and addresses -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sglang.service", "sglang-8b.service", "sglang@gpu0.service", "a:b_c.service"])
def test_service_unit_names_pass(name):
    assert uv.value_problems("sglang_launch_unit_name", name) == []


@pytest.mark.parametrize("name", ["sglang", "sglang.timer", "../sglang.service", "x/sglang.service",
                                  "-sglang.service", "sglang@.service", "sgl ang.service", "sgl\\x2dang.service",
                                  "a" * 250 + ".service"])
def test_other_unit_names_are_refused(name):
    [problem] = uv.value_problems("sglang_launch_unit_name", name)
    assert "is not a service unit name: refused" in problem


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "fe80::1%eth0", "gpu-01", "gpu-01.example.com.",
                                  "node_7.cluster.local"])
def test_addresses_and_host_names_pass(host):
    assert uv.value_problems("sglang_host", host) == []


@pytest.mark.parametrize("host", ["127.0.0.1 --api-key x", "-h", "[::1]", "a..b", "host/x", "%n", "a" * 64, " 0.0.0.0"])
def test_other_hosts_are_refused(host):
    [problem] = uv.value_problems("sglang_host", host)
    assert problem.startswith("sglang_host=") and "neither an IP address nor a host name: refused" in problem


def test_the_example_inventory_passes():
    with open(os.path.join(ROOT, "inventory", "example", "group_vars", "gpu_hosts.yml")) as handle:
        values = yaml.safe_load(handle)
    assert uv.unit_value_problems(values) == []


# --- the guard and preflight filters ------------------------------------------------------------------------------

class _HostVars(dict):
    """A host's hostvars: reading a value may raise (an undefined variable inside a template)."""

    def get(self, name, default=None):
        value = dict.get(self, name, default)
        if isinstance(value, Exception):
            raise value
        return value


def test_guard_report_names_each_problem_once_with_the_hosts_it_concerns():
    hostvars = {"a": _HostVars(sglang_service_user=PAYLOAD, sglang_state_dir="/s"),
                "b": _HostVars(sglang_service_user=PAYLOAD, sglang_state_dir="/s/../t"),
                "c": _HostVars(sglang_service_user=PAYLOAD, sglang_python=RuntimeError("undefined"))}
    report = fv.gpufleet_unit_value_report(hostvars, ["a", "b", "c"])
    assert len(report) == 2
    assert report[0].startswith("sglang_service_user='sglang\\nExecStartPre") and "(on " not in report[0]
    assert report[1].startswith("sglang_state_dir='/s/../t' is not a normalised path") and report[1].endswith("(on b)")
    assert fv.gpufleet_unit_value_report({"a": _HostVars(sglang_state_dir="/s")}, ["a"]) == []


def test_preflight_problems_check_every_name_given():
    problems = fv.gpufleet_unit_value_problems({"sglang_launch_method": "systemd", "sglang_service_user": "root",
                                                "sglang_launch_record_file": None, "sglang_host": "0.0.0.0\n"})
    assert [p.split("=")[0] for p in problems] == ["sglang_service_user", "sglang_host"]
    assert fv.gpufleet_unit_value_problems(None) == []


# --- the unit filters: what systemd reads back --------------------------------------------------------------------

@pytest.mark.parametrize("value", ["SGLang server (gpufleet) on 0.0.0.0:30000", "100% $HOME 'q' \"d\" a\\b ; # x",
                                   "%n %i %%", "état"])
def test_systemd_value_is_read_back_as_written(value):
    line = f.systemd_value(value, "x")
    assert systemd_reads(unit(Description=line)) == {("Service", "Description"): [value]}


@pytest.mark.parametrize("path", ["/var/lib/gpufleet", "/srv/100%/a$b/sglang.log", "/", "/x/%%n"])
def test_systemd_path_is_read_back_as_written(path):
    line = f.systemd_path(path, "sglang_launch_log_file")
    read = systemd_reads(unit(WorkingDirectory=line, EnvironmentFile=line, StandardOutput="append:" + line))
    assert read == {("Service", "WorkingDirectory"): [path], ("Service", "EnvironmentFile"): [path],
                    ("Service", "StandardOutput"): ["append:" + path]}


def test_the_issue_payload_unescaped_would_have_been_a_root_directive():
    # Why: the template filled User= with the raw value before issue 31.
    assert systemd_reads(unit(User=PAYLOAD))[("Service", "ExecStartPre")] == ['+/bin/sh -c "id > /tmp/pwned"']
    with pytest.raises(AnsibleFilterError, match=r"^sglang_service_user='sglang\\nExecStartPre"):
        f.systemd_value(PAYLOAD, "sglang_service_user", "user")


@pytest.mark.parametrize("value,words", [
    ("a\nb", "control character"), ("a\\", "ends in a backslash"), (" a", "white space at an end"),
    ("a ", "white space at an end"), ("a\u2028b", "control character"),
])
def test_systemd_value_refuses_what_systemd_would_not_read_back(value, words):
    with pytest.raises(AnsibleFilterError, match="^Description=") as err:
        f.systemd_value(value, "Description")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_trailing_backslash_would_swallow_the_next_line():
    assert ("Service", "User") not in systemd_reads(unit(Description="x\\", User="sglang"))


@pytest.mark.parametrize("rule,value", [("user", "root"), ("user", "a b"), ("host", "0.0.0.0 x"),
                                        ("path", "rel/x"), ("path", "/a/../b"), ("unit_name", "x")])
def test_systemd_value_with_a_rule_refuses_what_the_guard_refuses(rule, value):
    with pytest.raises(AnsibleFilterError, match="^v=|^v is"):
        f.systemd_value(value, "v", rule)
    assert f.systemd_value("sglang", "v", "user") == "sglang"


def test_systemd_path_refuses_every_path_the_guard_refuses():
    for bad in ("relative", "/a/", "/a b", "/a\\", "/a*", "/a\nb"):
        with pytest.raises(AnsibleFilterError, match="^sglang_launch_chdir="):
            f.systemd_path(bad, "sglang_launch_chdir")


@pytest.mark.parametrize("first", ["+/bin/sh", "-/usr/bin/python", "@/usr/bin/python", "bin/python", "/a/../python"])
def test_sglang_argv_refuses_a_first_word_systemd_would_read_as_a_prefix(first):
    with pytest.raises(AnsibleFilterError, match=r"^sglang_launcher\[0\]="):
        f.sglang_argv({"model-path": "/m"}, [first, "-m", "sglang.launch_server"])
    assert f.sglang_argv({}, ["sglang", "serve"])[:2] == ["sglang", "serve"]


# --- the unit template ----------------------------------------------------------------------------------------------

def render(**overrides):
    values = dict(_sglang_launch_port=30000, _sglang_launch_host="0.0.0.0", sglang_service_user="sglang",
                  sglang_launch_chdir="/var/lib/gpufleet", sglang_launch_env={"NCCL_PROTO": "LL"},
                  sglang_launch_argv=["/opt/sglang/bin/python", "-m", "sglang.launch_server"],
                  _sglang_launch_stop_grace_s=60, sglang_launch_systemd_restart="no",
                  sglang_launch_systemd_restart_sec=30, sglang_launch_log_file="/var/lib/gpufleet/sglang.log",
                  _sglang_launch_api_key="k", _sglang_launch_api_key_env="GPUFLEET_SGLANG_API_KEY",
                  sglang_launch_api_key_file="/var/lib/gpufleet/sglang-api-key.env")
    values.update(overrides)
    return render_unit(values)


def test_the_unit_reads_back_every_value_as_given():
    read = systemd_reads(render(_sglang_launch_host="fe80::1%eth0", sglang_service_user="first.last",
                                     sglang_launch_chdir="/srv/100%/gpufleet",
                                     sglang_launch_log_file="/srv/100%/gpufleet/%n.log",
                                     sglang_launch_api_key_file="/srv/100%/gpufleet/$KEY.env"))
    assert read[("Unit", "Description")] == ["SGLang server (gpufleet) on fe80::1%eth0:30000"]
    assert read[("Service", "User")] == ["first.last"]
    assert read[("Service", "WorkingDirectory")] == ["/srv/100%/gpufleet"]
    assert read[("Service", "StandardOutput")] == ["append:/srv/100%/gpufleet/%n.log"]
    assert read[("Service", "EnvironmentFile")] == ["/srv/100%/gpufleet/$KEY.env"]


@pytest.mark.parametrize("field,value", [
    ("sglang_service_user", PAYLOAD), ("_sglang_launch_host", "0.0.0.0\n[Service]\nExecStartPre=+/bin/id"),
    ("sglang_launch_chdir", "/var/lib/x\nExecStartPre=+/bin/id"), ("sglang_launch_log_file", "/var/lib/x.log\\"),
    ("sglang_launch_api_key_file", "-/var/lib/x.env"), ("sglang_launch_chdir", "~"), ("sglang_service_user", "root"),
])
def test_the_unit_is_not_rendered_with_a_value_the_guard_refuses(field, value):
    name = "sglang_host" if field == "_sglang_launch_host" else field
    with pytest.raises(AnsibleFilterError, match="^%s" % name):
        render(**{field: value})


# --- the API key: one bearer token, never shown --------------------------------------------------------------------

@pytest.mark.parametrize("key", ["sk-gpufleet-0123abcd", "a.b_c~d+e/f-g==", "K"])
def test_a_bearer_token_key_passes(key):
    assert uv.value_problems("sglang_api_key", key) == []


@pytest.mark.parametrize("key", ["sk-1\n", "sk-1\nLD_PRELOAD=/tmp/x.so", "sk 1", "sk'1", 'sk"1', "sk-1=x", "sk\t1",
                                 "sk-1\u2028"])
def test_a_key_that_is_no_bearer_token_is_refused_and_never_shown(key):
    [problem] = uv.value_problems("sglang_api_key", key)
    assert problem.startswith("sglang_api_key must be one bearer token") and "not shown" in problem
    secret = key.split("\n")[0].split()[0].split("'")[0].split('"')[0]
    assert secret not in problem.replace("sglang_api_key", "")
    assert uv.escape(key) not in problem


def test_the_guard_refuses_a_key_with_a_line_break_without_showing_it():
    key = "sk-unique-7f3a\nLD_PRELOAD=/tmp/x.so"
    report = fv.gpufleet_unit_value_report({"a": _HostVars(sglang_api_key=key)}, ["a"])
    assert len(report) == 1 and report[0].startswith("sglang_api_key must be one bearer token")
    assert "sk-unique-7f3a" not in report[0] and "LD_PRELOAD" not in report[0]
    assert fv.gpufleet_unit_value_report({"a": _HostVars(sglang_api_key="sk-unique-7f3a")}, ["a"]) == []


def test_a_cut_value_keeps_its_first_control_character_in_view():
    value = "/srv/" + "long-directory-name/" * 10 + "state\nExecStartPre=+/bin/sh -c id"
    shown = uv.show(value)
    assert shown.startswith("'/srv/long-directory") and "state\\nExecStartPre=" in shown and "..." in shown
    assert len(shown) <= 170
    problem = uv.control_problem("sglang_state_dir", value)
    assert "state\\nExecStartPre=" in problem and "\n" not in problem
