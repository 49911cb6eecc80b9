"""README.md as a short guide, and the reference pages under docs/ that hold the rest (issue 33).

The README's copyable inventory is parsed by Ansible's own inventory plugin and its values are checked as a run
would check them: the command-line guard, the roles' argument specs, preflight's inventory check and NCCL's value
rules. docs/inventory.md's table of every role variable is generated from the specs; docs/check-reasons.md names
every reason code the fleet check can give."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from ansible.inventory.manager import InventoryManager
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.parsing.dataloader import DataLoader
from ansible.vars.manager import VariableManager

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl import env_value_problems, name_problem
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import guard, schema

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
import docs_pages  # noqa: E402  (tests/support is not a package on the path)

README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_LINES = 150

# Inventory variables of the interface table that no role's argument spec declares: each is read by a role's
# defaults, a playbook or a plugin (the test below makes sure it still is), or is Ansible's own.
NOT_IN_SPECS = {"ansible_python_interpreter"}


def _sections(text):
    """{heading text: body} of the level-2 sections of a Markdown text."""
    parts = re.split(r"^## +(.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _code_blocks(text, lang=None):
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)
            if lang is None or m.group(1) == lang]


def _links(text):
    """Relative link targets of a Markdown text (no URLs, no in-page anchors)."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:|#", t)]


def _slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_readme_is_a_guide_of_at_most_150_lines_with_the_two_commands_at_its_top():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, "README.md has %d lines; keep it a guide of at most %d" % (len(lines), MAX_LINES)
    top = README.split("\n## ", 1)[0]
    block = _code_blocks(top)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    # Both stay true: the Makefile has the targets, and CI's entry point runs `make test`.
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), flags=re.M)


def test_readme_sentences_stay_short():
    # The guide's measure (issue 33: the old README's median sentence was 30 words, paragraphs up to 298 words).
    measures = docs_pages.prose_measures(README)
    assert measures["median_sentence"] <= 15, measures
    assert measures["longest_paragraph"] <= 60, measures


def test_prose_measures_count_what_they_say():
    text = ("# T\n\nOne two three. Four five.\n\n```\nnot prose at all here\n```\n- a b c\n- d e\n\n"
            "| x | y |\n|---|---|\n| `v` | Six words are in this cell. |\n")
    m = docs_pages.prose_measures(text)
    assert (m["paragraphs"], m["sentences"], m["longest_sentence"], m["longest_paragraph"]) == (4, 5, 6, 6)
    assert m["median_sentence"] == 3 and m["lines"] == 13 and m["words"] == 37  # as wc -w: code and markup too


def test_every_link_in_the_readme_resolves_to_a_file_and_heading():
    links = _links(README)
    assert sum(1 for t in links if t.startswith("docs/")) >= 10, links
    for target in links:
        path, _, anchor = target.partition("#")
        file = ROOT / path
        assert file.exists(), "README.md links %s, which does not exist" % target
        if anchor and file.suffix == ".md":
            slugs = {_slug(h) for h in re.findall(r"^#+ +(.+)$", file.read_text(encoding="utf-8"), flags=re.M)}
            assert anchor in slugs, "README.md links %s: no such heading in %s" % (target, path)


@pytest.mark.parametrize("page", ["inventory", "check-reasons", "troubleshooting", "lab", "playbooks", "api-key",
                                  "cli", "summary", "restart-failures", "restart-lock", "router", "collection",
                                  "tests"])
def test_the_reference_pages_links_resolve(page):
    path = ROOT / "docs" / (page + ".md")
    for target in _links(path.read_text(encoding="utf-8")):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), "%s links %s, which does not exist" % (path.name, target)
        if anchor and resolved.suffix == ".md":
            slugs = {_slug(h) for h in re.findall(r"^#+ +(.+)$", resolved.read_text(encoding="utf-8"), flags=re.M)}
            assert anchor in slugs, "%s links %s: no such heading" % (path.name, target)


def test_no_page_links_a_readme_section_that_moved():
    # The README has no reference sections any more: a link to README.md#... would land nowhere.
    readme_slugs = {_slug(h) for h in re.findall(r"^#+ +(.+)$", README, flags=re.M)}
    for path in list((ROOT / "docs").glob("*.md")) + [ROOT / "tests" / "lab" / "README.md"]:
        for anchor in re.findall(r"README\.md#([\w-]+)", path.read_text(encoding="utf-8")):
            assert anchor in readme_slugs, "%s links README.md#%s, which is gone" % (path.name, anchor)


def _readme_inventory(tmp_path):
    """The README's copyable inventory, written to a file and loaded by Ansible's own inventory plugins:
    (hosts of gpu_hosts, the first host's variables)."""
    section = next(body for title, body in _sections(README).items() if "five variables" in title)
    text = _code_blocks(section, "yaml")[0]
    path = tmp_path / "hosts.yml"
    path.write_text(text, encoding="utf-8")
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(path)])
    hosts = [h.name for h in inventory.get_hosts("gpu_hosts")]
    host_vars = VariableManager(loader=loader, inventory=inventory).get_vars(host=inventory.get_host(hosts[0]))
    return hosts, host_vars, yaml.safe_load(text)


def test_the_readme_inventory_is_one_ansible_reads_and_a_run_accepts(tmp_path):
    hosts, host_vars, raw = _readme_inventory(tmp_path)
    assert len(hosts) >= 2, hosts
    five = ("sglang_python", "ansible_python_interpreter", "sglang_service_user", "sglang_launch_args",
            "sglang_nccl_env")
    for name in five:
        assert host_vars.get(name) not in (None, "", {}), name
    set_vars = {k: v for k, v in host_vars.items() if k not in ("inventory_file", "inventory_dir", "groups",
                                                                "group_names", "inventory_hostname",
                                                                "inventory_hostname_short", "omit",
                                                                "playbook_dir", "ansible_playbook_python",
                                                                "ansible_config_file", "ansible_facts",
                                                                "ansible_version", "ansible_check_mode",
                                                                "ansible_diff_mode", "ansible_forks",
                                                                "ansible_inventory_sources", "ansible_verbosity",
                                                                "ansible_run_tags", "ansible_skip_tags",
                                                                "ansible_collection_name", "ansible_search_path")}
    # The command-line guard and the roles' argument specs, as playbooks/tasks/guards.yml runs them.
    assert guard.gpufleet_guard_errors(set_vars) == []
    variables = schema.load()
    given = {k: v for k, v in set_vars.items() if k in variables}
    result = ArgumentSpecValidator(schema.argument_spec(given, variables)).validate(given)
    assert result.error_messages == []
    # NCCL's own rules for the values (preflight refuses a value NCCL would ignore or misread).
    nccl = host_vars["sglang_nccl_env"]
    assert [name_problem(n) for n in nccl if name_problem(n)] == []
    assert env_value_problems([(n, str(v)) for n, v in nccl.items()]) == []
    # The model and tensor parallelism the README's table talks about.
    assert host_vars["sglang_launch_args"].get("model-path", "").startswith("/")
    assert guard.gpufleet_tp_pp_size(host_vars["sglang_launch_args"])


# A controller-only play over the README's inventory: the guards every playbook runs first, then preflight's
# check of the inventory variables (roles/sglang_preflight/tasks/variables.yml, with the role's real defaults).
# set_fact, validate_argument_spec and assert run on the controller, so the example hosts need not exist.
_PLAY = """
- name: Guards
  hosts: all
  gather_facts: false
  any_errors_fatal: true
  vars:
    _gpufleet_target_pattern: gpu_hosts
  tasks:
    - name: Guards
      ansible.builtin.import_tasks: %(root)s/playbooks/tasks/guards.yml
- name: Preflight's inventory check
  hosts: gpu_hosts
  gather_facts: false
  tasks:
    - name: Preflight's variables
      ansible.builtin.include_role:
        name: sglang_preflight
        tasks_from: variables.yml
        rolespec_validate: false
"""


def _run_play(tmp_path, *extra):
    play = tmp_path / "play.yml"
    play.write_text(_PLAY % {"root": ROOT})
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="default",
               ANSIBLE_NOCOLOR="1", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run([os.path.join(bindir, "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(play),
                           *extra], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)


def test_the_readme_inventory_passes_the_guards_and_preflights_inventory_check(tmp_path):
    hosts, _, _ = _readme_inventory(tmp_path)
    run = _run_play(tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "Check the inventory variables the restart depends on" in run.stdout
    for host in hosts:
        assert re.search(r"^%s\s*: ok=[1-9]\d* .*failed=0" % re.escape(host), run.stdout, flags=re.M), \
            run.stdout[-2000:]


def test_a_wrong_value_in_the_readme_inventory_is_refused_by_the_same_play(tmp_path):
    # The play above can fail: an empty sglang_service_user (the systemd default needs one) is refused by
    # preflight's check, a misspelt launch method by the guard.
    _readme_inventory(tmp_path)
    run = _run_play(tmp_path, "-e", "sglang_service_user=")
    assert run.returncode != 0 and "sglang_service_user is not set" in run.stdout, run.stdout[-3000:]
    run = _run_play(tmp_path, "-e", "sglang_launch_method=sytemd")
    assert run.returncode != 0 and "sytemd" in run.stdout, run.stdout[-3000:]
    assert env_value_problems([("NCCL_PROTO", "simple-ish")])


def test_docs_inventory_holds_the_current_table_of_every_role_variable():
    page = (ROOT / "docs" / "inventory.md").read_text(encoding="utf-8")
    assert docs_pages.generated_part(page) == docs_pages.inventory_reference(), \
        "docs/inventory.md and the roles' argument specs disagree: run make docs"
    for name in docs_pages.declared():
        assert "| `%s` |" % name in page, name


def test_the_generated_table_changes_when_a_spec_changes(tmp_path):
    roles = tmp_path / "roles"
    shutil.copytree(ROOT / "roles", roles)
    before = docs_pages.inventory_reference(str(roles))
    spec = roles / "sglang_stop" / "meta" / "argument_specs.yml"
    data = yaml.safe_load(spec.read_text())
    data["argument_specs"]["main"]["options"]["sglang_stop_new_knob"] = {"type": "int", "default": 7,
                                                                         "description": "A new knob."}
    spec.write_text(yaml.safe_dump(data))
    after = docs_pages.inventory_reference(str(roles))
    assert after != before and "| `sglang_stop_new_knob` | int | `7` | `sglang_stop` | A new knob. |" in after
    page = (ROOT / "docs" / "inventory.md").read_text(encoding="utf-8")
    assert docs_pages.generated_part(docs_pages.updated_page(page, str(roles))) == after


def test_the_inventory_interface_table_names_only_variables_gpufleet_reads():
    page = (ROOT / "docs" / "inventory.md").read_text(encoding="utf-8")
    interface = _sections(page)["The inventory interface"]
    names = re.findall(r"^\| `([a-z_]+)`", interface, flags=re.M)
    assert len(names) >= 30
    declared = docs_pages.declared()
    sources = "\n".join(p.read_text(encoding="utf-8") for pattern in ("roles/*/defaults/main.yml",
                                                                        "roles/*/tasks/*.yml", "playbooks/*.yml",
                                                                        "playbooks/tasks/*.yml",
                                                                        "plugins/plugin_utils/*.py")
                        for p in ROOT.glob(pattern))
    for name in names:
        if name in declared or name in NOT_IN_SPECS:
            continue
        assert re.search(r"\b%s\b" % name, sources), "docs/inventory.md names %s, which nothing reads" % name


def test_check_reason_codes_are_found_in_the_code():
    codes = docs_pages.check_reason_codes()
    # The extraction reaches every kind of code: literal, looped through a tuple, built, an error class.
    for code in ("unreachable", "nccl_worker_env", "gpu_temperature", "memory_temperature", "xid_<N>",
                 "driver_mismatch", "gpu_lost", "gpu_query_failed", "root_code_untrusted"):
        assert code in codes, code
    assert len(codes) >= 40


def test_docs_check_reasons_names_every_reason_code():
    page = (ROOT / "docs" / "check-reasons.md").read_text(encoding="utf-8")
    missing = [c for c in docs_pages.check_reason_codes() if "`%s`" % c not in page]
    assert missing == [], "docs/check-reasons.md lacks the reason codes %s" % missing


def test_the_script_says_when_the_page_is_out_of_date(tmp_path, monkeypatch, capsys):
    page = tmp_path / "inventory.md"
    text = (ROOT / "docs" / "inventory.md").read_text(encoding="utf-8")
    cut = text.index(docs_pages.BEGIN)
    page.write_text(text[:cut] + text[cut:].replace("| `sglang_port` |", "| `sglang_port_old` |", 1))
    monkeypatch.setattr(docs_pages, "INVENTORY_PAGE", str(page))
    assert docs_pages.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert docs_pages.main([]) == 0 and page.read_text() == text
    assert docs_pages.main(["--check"]) == 0
    assert os.path.exists(page)
