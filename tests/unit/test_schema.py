"""plugins/plugin_utils/schema.py: the schema of the restart's variables, generated from the roles' real
meta/argument_specs.yml, and the ties that keep the guard, the ranges and the one home of each default honest."""
import ast
import pathlib
import re

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import guard, schema

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIABLES = schema.load()


def _names_the_guard_reads():
    """Every variable name the guard's code reads from a host's values: ``values.get("name")``,
    ``first.get("name")``, ``hostvars[h].get("name")`` and the name tuples it loops over."""
    tree = ast.parse((ROOT / "plugins" / "plugin_utils" / "guard.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            names.update(e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return names


def test_the_real_argument_specs_agree_on_every_type_and_declare_the_run_variables():
    # load() raised nothing (no name with two types); the run-level variables have a home too.
    assert len(VARIABLES) > 150
    for name in ("target", "gpufleet_serial", "sglang_port", "sglang_state_dir", "sglang_launch_method",
                 "gpufleet_lock_lease_s", "gpu_memory_wait_poll_interval_ms"):
        assert name in VARIABLES, name
    assert VARIABLES["sglang_launch_method"].choices == ["systemd", "process"]
    assert VARIABLES["gpu_memory_wait_poll_interval_ms"].type == "int"


def test_every_variable_the_guard_reads_is_declared_in_some_argument_spec():
    read = _names_the_guard_reads() | set(schema.RANGES) | set(schema.SWITCHES_RAW) | set(guard._OWN_MESSAGES)
    # the values of the guard's own message tables are not variables
    read -= {"results", "item", "hosts", "argument_errors", "start", "lock"}
    assert "sglang_verify_min_workers" in read and "gpufleet_lock_margin_s" in read  # the scan sees both kinds
    missing = sorted(n for n in read if n not in VARIABLES)
    assert missing == [], "checked by the guard but declared by no role's meta/argument_specs.yml: %s" % missing


def test_every_range_is_on_a_number_and_every_raw_switch_is_declared():
    for name, rng in schema.RANGES.items():
        assert VARIABLES[name].type in ("int", "float"), name
        assert rng.high is not None and rng.low <= rng.high, name
        if VARIABLES[name].type == "float":
            assert rng.low == 0, name  # a float's least is 0, open or closed (zero_ok)
    for name in schema.SWITCHES_RAW:
        assert VARIABLES[name].type == "raw", name


def test_switches_are_the_bool_variables_of_the_specs():
    switches = schema.switches()
    assert "gpufleet_rollback" in switches and "sglang_verify_throughput" in switches
    assert "sglang_verify_become" not in switches  # declared by no role: the verify role derives it
    assert all(VARIABLES[n].type == "bool" or n in schema.SWITCHES_RAW for n in switches)


def _roles(tmp_path, **specs):
    for role, options in specs.items():
        meta = tmp_path / role / "meta"
        meta.mkdir(parents=True)
        (meta / "argument_specs.yml").write_text(yaml.safe_dump({"argument_specs": {"main": {"options": options}}}))
    return str(tmp_path)


def test_a_type_that_disagrees_between_two_roles_fails_the_schema(tmp_path):
    roles = _roles(tmp_path, a={"x_port": {"type": "int"}}, b={"x_port": {"type": "str"}})
    with pytest.raises(schema.SchemaError, match=r"x_port: type is 'int' in a/main but 'str' in b/main"):
        schema.load(roles)


def test_choices_that_disagree_fail_and_equal_declarations_merge(tmp_path):
    roles = _roles(tmp_path, a={"m": {"type": "str", "choices": ["x", "y"]}, "n": {"type": "bool"}},
                   b={"m": {"type": "str", "choices": ["x"]}})
    with pytest.raises(schema.SchemaError, match="m: choices"):
        schema.load(roles)
    roles = _roles(tmp_path / "ok", a={"n": {"type": "bool", "default": True}}, b={"n": {"type": "bool"}})
    assert schema.load(roles)["n"].where == ["a/main", "b/main"]


def test_a_name_in_the_guard_but_in_no_spec_is_found(tmp_path):
    roles = _roles(tmp_path, a={"sglang_port": {"type": "int"}})
    variables = schema.load(roles)
    assert [n for n in schema.RANGES if n not in variables]  # what the test above would report


def test_the_argument_spec_for_validate_argument_spec_checks_types_and_choices_only():
    spec = schema.argument_spec(["sglang_launch_method", "gpu_memory_wait_gpus", "sglang_launch_args", "nope"])
    assert spec == {"sglang_launch_method": {"type": "str", "choices": ["systemd", "process"]},
                    "gpu_memory_wait_gpus": {"type": "list", "elements": "raw"},
                    "sglang_launch_args": {"type": "dict"}}
    errors = ArgumentSpecValidator(spec).validate({"sglang_launch_method": "sytemd", "gpu_memory_wait_gpus": [0, 1],
                                                   "sglang_launch_args": "tp-size"}).error_messages
    assert len(errors) == 2 and any("sytemd" in e and "systemd, process" in e for e in errors), errors
    # nothing required, no defaults applied: a run that sets none of them passes
    assert ArgumentSpecValidator(spec).validate({}).error_messages == []
    # the whole schema is a spec Ansible takes
    assert ArgumentSpecValidator(schema.argument_spec(VARIABLES)).validate({}).error_messages == []


def _home_values():
    """{name: (file, value)} of every literal value in a role's defaults/main.yml (the one home of a default)."""
    homes = {}
    for path in sorted((ROOT / "roles").glob("*/defaults/main.yml")):
        for name, value in (yaml.safe_load(path.read_text()) or {}).items():
            assert name not in homes, "%s has two homes: %s and %s" % (name, homes[name][0], path)
            homes[name] = (str(path.relative_to(ROOT)), value)
    return homes


def test_every_default_has_one_home_and_its_spec_documents_that_value():
    homes = _home_values()
    for name, var in VARIABLES.items():
        if not var.has_default or name not in homes:
            continue
        where, value = homes[name]
        if isinstance(var.default, str) and "{{" in var.default or isinstance(value, str) and "{{" in value:
            continue  # a default worked out from other variables: the spec says how in words
        assert value == var.default, "%s: %s says %r, the argument spec (%s) %r" % (
            name, where, value, ", ".join(var.where), var.default)


# `name | default(<literal>)` where the spec gives `name` a default: a second home for it that can drift (the stop's
# GPU wait fell back to a poll interval of 100 ms while the wait's default was 20). Sentinels that mean "not given"
# (None, '', omit) are not a second home. _KNOWN: drifts kept on purpose, each with its reason (file, variable).
_FALLBACK = re.compile(r"\b([a-z][a-z0-9_]*) \| default\(([^(),]+)(?:, *true)?\)")
_PENDING = set()
_KNOWN = {
    # The lease plan bounds the stretch between renewals by 30 s where the readiness slice defaults to 10 s: a
    # longer bound only renews more often (safe). To go when the lease plan reads the resolved role values.
    ("playbooks/vars/restart_host.yml", "sglang_launch_ready_slice_s"),
}


def test_no_role_or_playbook_falls_back_to_another_value_than_the_variables_home():
    drift = []
    for path in sorted(list((ROOT / "roles").rglob("*.yml")) + list((ROOT / "playbooks").rglob("*.yml"))):
        rel = str(path.relative_to(ROOT))
        if rel in _PENDING or "/meta/" in rel:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name, literal in _FALLBACK.findall(line):
                var = VARIABLES.get(name)
                if var is None or not var.has_default or literal.strip() in ("None", "''", '""', "omit"):
                    continue
                try:
                    value = yaml.safe_load(literal)
                except yaml.YAMLError:
                    continue
                if isinstance(value, str) and re.fullmatch(r"[a-z_][a-z0-9_.]*", literal.strip()):
                    continue  # a variable, not a literal
                if value != var.default and (rel, name) not in _KNOWN:
                    drift.append("%s:%d %s falls back to %r, its default is %r" % (rel, number, name, value,
                                                                                 var.default))
    assert drift == []


def test_the_shared_values_have_one_home():
    homes = _home_values()
    for name in ("sglang_state_dir", "sglang_launch_method", "gpu_memory_wait_poll_interval_ms", "gpufleet_gpu_wait"):
        assert homes[name][0] == "roles/gpufleet_common/defaults/main.yml", name
    assert homes["gpu_memory_wait_poll_interval_ms"][1] == 20
    # the stop's own wait takes the same settings, not a copy of them
    assert "gpu_memory_wait_poll_interval_ms" in str(homes["gpufleet_gpu_wait"][1]["poll_interval_ms"])
    stop_vars = yaml.safe_load((ROOT / "roles" / "sglang_stop" / "vars" / "main.yml").read_text())
    assert stop_vars["_sglang_stop_gpu_wait"] == "{{ gpufleet_gpu_wait }}"
    # one line each: the home itself
    for path in sorted(list((ROOT / "roles").rglob("*.yml")) + list((ROOT / "playbooks").rglob("*.yml"))):
        rel = str(path.relative_to(ROOT))
        if rel in _PENDING or rel.startswith("roles/gpufleet_common/"):
            continue
        text = path.read_text()
        assert "default('systemd')" not in text and "/var/lib/gpufleet" not in text, rel


def test_every_role_depends_on_the_common_role_for_its_shared_defaults():
    for role in sorted(p.parent.parent.name for p in (ROOT / "roles").glob("*/tasks/main.yml")):
        meta = yaml.safe_load((ROOT / "roles" / role / "meta" / "main.yml").read_text())
        assert {"role": "gpufleet.fleet.gpufleet_common"} in meta["dependencies"], role
