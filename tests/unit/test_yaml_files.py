"""Every YAML file the project ships parses.

A stray ``: `` inside a plain scalar (e.g. a role's argument_specs description) makes Ansible refuse every
playbook that uses the role; this catches it in a second instead of in the lab tests 30 minutes into CI.
"""
import os
import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Folders (walked for *.yml/*.yaml, symlinked folders skipped) and single YAML files (.ansible-lint is YAML too).
SHIPPED = ("awx", "inventory", "meta", "playbooks", "plugins", "roles", "requirements", "galaxy.yml",
           "execution-environment.yml",
           "changelogs", ".yamllint",
           ".ansible-lint")


def shipped_yaml():
    for top in SHIPPED:
        path = ROOT / top
        if path.is_file():
            yield path
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            for name in filenames:
                if name.endswith((".yml", ".yaml")):
                    yield pathlib.Path(dirpath) / name


FILES = sorted(shipped_yaml())


def test_the_walk_finds_the_role_specs():
    names = {str(p.relative_to(ROOT)) for p in FILES}
    assert "roles/fleet_check/meta/argument_specs.yml" in names
    assert "playbooks/restart.yml" in names
    assert "plugins/filter/gpufleet_gpu_baseline_text.yml" in names  # the filters' ansible-doc pages


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_parses(path):
    try:
        list(yaml.safe_load_all(path.read_text()))
    except yaml.YAMLError as exc:  # pragma: no cover - the failure message is the point
        pytest.fail("%s does not parse: %s" % (path.relative_to(ROOT), exc))


MODULE_FILES = sorted((ROOT / "plugins" / "modules").glob("*.py"))


@pytest.mark.parametrize("path", MODULE_FILES, ids=lambda p: p.name)
def test_module_docs_parse(path):
    """DOCUMENTATION, EXAMPLES and RETURN are YAML too: a stray ``: `` in a description makes ansible-doc refuse
    the module (caught here in a second instead of by the collection test in the lab run)."""
    import ast
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in ("DOCUMENTATION", "EXAMPLES",
                                                                                    "RETURN"):
            found[node.targets[0].id] = yaml.safe_load(node.value.value)
    assert set(found) == {"DOCUMENTATION", "EXAMPLES", "RETURN"}, path.name
    assert found["DOCUMENTATION"]["module"] == path.stem
