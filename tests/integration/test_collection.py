"""Packaging: the gpufleet.fleet collection (build, install, FQCN from an unrelated directory), the execution
environment's build context, AWX configuration as code, ansible-lint's module argument checks. No lab.

Tools that are not in the controller venvs (ansible-builder, awx.awx) come from a throwaway venv
(tests/support/tools_venv.py, wheels cached under .cache/); those tests skip naming the reason when PyPI is
unreachable and nothing is cached.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import tools_venv  # noqa: E402

PLAYBOOKS = ("restart", "check", "patch", "unlock")


def clean_env(**extra):
    """Environment of a user outside the checkout: no ANSIBLE_* settings, the venv's tools on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(PATH=BIN + ":" + os.environ.get("PATH", "/usr/bin:/bin"), ANSIBLE_NOCOLOR="1", **extra)
    return env


def run(argv, cwd, env, timeout=300):
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The collection built from the checkout and installed into a fresh collections path."""
    base = tmp_path_factory.mktemp("collection")
    build = run([os.path.join(BIN, "ansible-galaxy"), "collection", "build", "--output-path", str(base), ROOT],
                cwd=str(base), env=clean_env())
    assert build.returncode == 0, build.stderr
    tarball = glob.glob(str(base / "gpufleet-fleet-*.tar.gz"))
    assert len(tarball) == 1
    colls = base / "colls"
    inst = run([os.path.join(BIN, "ansible-galaxy"), "collection", "install", "-p", str(colls), tarball[0]],
               cwd=str(base), env=clean_env())
    assert inst.returncode == 0, inst.stderr
    work = base / "elsewhere"
    work.mkdir()
    return {"tarball": tarball[0], "colls": str(colls), "cwd": str(work),
            "env": clean_env(ANSIBLE_COLLECTIONS_PATH=str(colls))}


def test_tarball_holds_the_collection_and_not_the_checkout(installed):
    with tarfile.open(installed["tarball"]) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("MANIFEST.json"))["collection_info"]
    galaxy = yaml.safe_load(open(os.path.join(ROOT, "galaxy.yml")))
    assert (manifest["namespace"], manifest["name"], manifest["version"]) == ("gpufleet", "fleet", galaxy["version"])
    for module in glob.glob(os.path.join(ROOT, "plugins", "modules", "*.py")):
        assert "plugins/modules/" + os.path.basename(module) in names
    for name in ("plugins/module_utils/gpufleet_gpu.py", "plugins/filter/gpufleet_run.py",
                 "plugins/filter/sglang_argv.yml", "plugins/callback/gpufleet_summary.py",
                 "plugins/callback/gpufleet_default.py", "roles/sglang_stop/tasks/main.yml", "meta/runtime.yml") + \
            tuple("playbooks/%s.yml" % p for p in PLAYBOOKS):
        assert name in names, name
    assert not [n for n in names if n.split("/")[0] in ("tests", "library", "collections", ".git", "src", "awx")]


def test_the_collection_carries_its_license_and_changelog(installed):
    # Galaxy shows the license from MANIFEST.json and the changelog from changelogs/changelog.yaml; the fragments
    # and antsibull-changelog's working files stay in the checkout.
    with tarfile.open(installed["tarball"]) as tar:
        names = set(tar.getnames())
        info = json.load(tar.extractfile("MANIFEST.json"))["collection_info"]
        license_text = tar.extractfile("LICENSE").read().decode()
        changes = yaml.safe_load(tar.extractfile("changelogs/changelog.yaml"))
        changelog_md = tar.extractfile("CHANGELOG.md").read().decode()
    assert info["license"] == ["GPL-3.0-or-later"] and info["license_file"] is None
    assert license_text == open(os.path.join(ROOT, "LICENSE")).read()
    assert "GNU GENERAL PUBLIC LICENSE" in license_text and "Version 3, 29 June 2007" in license_text
    assert "0.1.0" in changes["releases"] and "nvidia_gpu_info" in str(changes["releases"]["0.1.0"]["modules"])
    assert "## v0\\.1\\.0" in changelog_md
    assert "infrastructure" in info["tags"] and info["issues"] and info["documentation"] and info["homepage"]
    assert not [n for n in names if n.startswith("changelogs/") and n not in ("changelogs", "changelogs/changelog.yaml")]
    assert not {"setup.py", "MANIFEST.in", "pyproject.toml", ".ansible-lint", ".yamllint"} & names
    # what ansible-galaxy installed is what was built
    inst = os.path.join(installed["colls"], "ansible_collections", "gpufleet", "fleet")
    for name in ("LICENSE", "CHANGELOG.md", "changelogs/changelog.yaml"):
        assert os.path.isfile(os.path.join(inst, name)), name
    assert json.load(open(os.path.join(inst, "MANIFEST.json")))["collection_info"]["license"] == ["GPL-3.0-or-later"]


def test_modules_resolve_by_fqcn_from_an_unrelated_directory(installed):
    ansible = os.path.join(BIN, "ansible")
    ok = run([ansible, "localhost", "-m", "gpufleet.fleet.sglang_host_info"], installed["cwd"], installed["env"])
    assert ok.returncode == 0 and "localhost | SUCCESS" in ok.stdout and '"managed_pid"' in ok.stdout, \
        ok.stdout + ok.stderr
    # nvidia_gpu_info gets as far as its GPU backend (module_utils imported by collection path): no GPU here
    gpu = run([ansible, "localhost", "-m", "gpufleet.fleet.nvidia_gpu_info"], installed["cwd"], installed["env"])
    assert gpu.returncode != 0 and "nvidia-smi" in gpu.stdout + gpu.stderr
    assert "Cannot resolve" not in gpu.stdout + gpu.stderr and "No module named" not in gpu.stdout + gpu.stderr
    # without the collection on the path the same call cannot resolve: the test above proves the install
    bare = run([ansible, "localhost", "-m", "gpufleet.fleet.sglang_host_info"], installed["cwd"], clean_env())
    assert bare.returncode != 0


def test_filters_and_modules_are_documented_for_ansible_doc(installed):
    doc = os.path.join(BIN, "ansible-doc")
    listed = run([doc, "-t", "filter", "-l", "gpufleet.fleet", "--json"], installed["cwd"], installed["env"])
    assert listed.returncode == 0, listed.stderr
    names = set(json.loads(listed.stdout))
    sys.path.insert(0, os.path.join(ROOT, "collections"))
    import importlib
    modules = [importlib.import_module("ansible_collections.gpufleet.fleet.plugins.filter." + os.path.basename(f)[:-3])
               for f in glob.glob(os.path.join(ROOT, "plugins", "filter", "*.py"))]
    defined = {"gpufleet.fleet." + n for m in modules for n in m.FilterModule().filters()}
    assert len(modules) >= 4 and "gpufleet.fleet.gpufleet_check_verdict" in defined
    assert names == defined
    one = run([doc, "-t", "filter", "--json", "gpufleet.fleet.gpufleet_serial_error"], installed["cwd"],
              installed["env"])
    data = json.loads(one.stdout)["gpufleet.fleet.gpufleet_serial_error"]
    assert "percentage" in " ".join(data["doc"]["description"]) and data["return"]["_value"]["type"] == "str"
    mod = run([doc, "--json", "gpufleet.fleet.nvidia_gpu_wait"], installed["cwd"], installed["env"])
    assert mod.returncode == 0 and json.loads(mod.stdout)["gpufleet.fleet.nvidia_gpu_wait"]["doc"]["options"]


def test_fqcn_playbooks_parse_and_the_summary_callback_runs_with_them(installed):
    playbook = os.path.join(BIN, "ansible-playbook")
    check = run([playbook, "--syntax-check", "-i", "localhost,"] + ["gpufleet.fleet." + p for p in PLAYBOOKS],
                installed["cwd"], installed["env"])
    assert check.returncode == 0, check.stdout + check.stderr
    # A run refused by the command-line guard still ends with the summary table (one row, not_reached): the
    # callback loads from the collection's playbooks/callback_plugins without enabling; enabled by FQCN as
    # well, it still prints once.
    for extra in ({}, {"ANSIBLE_CALLBACKS_ENABLED": "gpufleet.fleet.gpufleet_summary",
                       "ANSIBLE_STDOUT_CALLBACK": "gpufleet.fleet.gpufleet_default"}):
        refused = run([playbook, "-i", "gpu-x,", "gpufleet.fleet.restart", "-e", "target=gpu-x",
                       "-e", "gpufleet_serial=abc"], installed["cwd"], dict(installed["env"], **extra))
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stdout.count("GPUFLEET SUMMARY") == 1, (extra, refused.stdout)
        assert re.search(r"^gpu-x\s+not_reached", refused.stdout, re.M), refused.stdout
        assert "gpufleet_serial" in refused.stdout


def test_the_checkout_resolves_itself_as_the_collection_and_prints_one_summary():
    env = clean_env(ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"))
    playbook = os.path.join(BIN, "ansible-playbook")
    for ref in ("gpufleet.fleet.restart", "playbooks/restart.yml"):
        res = run([playbook, "-i", "gpu-x,", ref, "-e", "target=gpu-x", "-e", "gpufleet_serial=0"], ROOT, env)
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stdout.count("GPUFLEET SUMMARY") == 1, (ref, res.stdout)
        assert "ok: [" not in res.stdout  # gpufleet_default: ok results are summarised away at verbosity 0
    ad_hoc = run([os.path.join(BIN, "ansible"), "localhost", "-m", "sglang_host_info"], ROOT, env)
    assert ad_hoc.returncode == 0, ad_hoc.stdout + ad_hoc.stderr


# A restart cancelled after the stop (process method: the stop started the new server), as ansible-runner's events
# carry it; the CLI's report says what the cut left from the core's decisions (cut_short, outage_so_far).
_CANCELLED_RESTART = r"""
import json, sys
import gpufleet_cli
from gpufleet_cli import events

def ev(kind, **data):
    return {"event": kind, "event_data": dict(host="gpu-01", play="Restart SGLang host by host", **data)}

wall = [5000.0]
p = events.FleetProgress(wall=lambda: wall[0])
p.handle(ev("runner_on_ok", task="Stop", role="gpufleet.fleet.sglang_stop",
            res={"signalled": [{"pid": 4242, "signals": ["SIGTERM"]}], "main_pid": 4242, "stop_ms": 1500,
                 "start": {"started": True, "pid": 5151}}))
p.handle(ev("runner_on_ok", task="Publish what this host may be doing if the connection is lost (launch)",
            task_path="/c/ansible_collections/gpufleet/fleet/playbooks/tasks/restart_phase.yml:9",
            res={"ansible_stats": {"data": {"gpufleet_restart": {"gpu-01": {"phase": "launch"}}}}}))
wall[0] = 5030.0
report = events.build_report("restart", p, "canceled", None, "/a")
print(json.dumps({"row": report["hosts"]["gpu-01"], "cli": gpufleet_cli.__file__,
                  "core": type(p.run).__name__ and p.run.__file__,
                  "modules": sorted({getattr(m, "__file__", None) or "" for m in list(sys.modules.values())})}))
"""


def test_the_cli_runs_from_outside_the_checkout_on_the_installed_collections_core(installed, tmp_path):
    # The gpufleet package as pip installs it (src/gpufleet_cli, pure Python, into a directory of its own: the
    # controller venv has no `wheel` to build one offline): neither the checkout nor its collections/ link is on
    # the CLI's path; the core comes from the installed collection.
    site = tmp_path / "site"
    shutil.copytree(os.path.join(ROOT, "src", "gpufleet_cli"), str(site / "gpufleet_cli"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(installed["env"], PYTHONPATH=str(site))
    cwd = installed["cwd"]
    help_ = run([sys.executable, "-m", "gpufleet_cli", "check", "--help"], cwd, env)
    assert help_.returncode == 0 and "--inventory" in help_.stdout, help_.stdout + help_.stderr
    # The CLI's event handling on the installed core: the cancelled host's cause and outage are its decisions.
    done = run([sys.executable, "-c", _CANCELLED_RESTART], cwd, env)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout)
    assert seen["cli"].startswith(str(site) + os.sep)
    assert seen["core"] == os.path.join(installed["colls"], "ansible_collections", "gpufleet", "fleet", "plugins",
                                        "plugin_utils", "run.py")
    # nothing from the checkout (its venv aside): not src/, not plugins/ through collections/
    assert not [m for m in seen["modules"] if m.startswith(ROOT + os.sep) and not m.startswith(sys.prefix + os.sep)]
    row = seen["row"]
    assert row["phase"] == "launch" and row["old_pid"] == 4242 and row["new_pid"] == 5151
    assert row["downtime_s"] == 31.5 and row["still_down"] is True
    assert row["cause"].startswith("cancelled after the stop (old server pid 4242): the new server (pid 5151) was "
                                   "started but not verified"), row["cause"]
    # A real run: the installed collection's restart.yml, refused by its command-line guard (nothing touched).
    art = tmp_path / "art"
    refused = run([sys.executable, "-m", "gpufleet_cli", "restart", "-i", "gpu-x,", "-e", "target=gpu-x",
                   "-e", "gpufleet_serial=abc", "--json", "--artifacts-dir", str(art)], cwd, env)
    report = json.loads(refused.stdout)
    assert refused.returncode != 0 and report["exit_code"] == refused.returncode, refused.stderr
    assert any("gpufleet_serial" in e for e in report["run_errors"]), report
    # Without the collection anywhere Ansible looks, the CLI says so and runs nothing.
    bare = run([sys.executable, "-m", "gpufleet_cli", "check", "--artifacts-dir", str(tmp_path / "bare")], cwd,
               dict(clean_env(PYTHONPATH=str(site)), HOME=str(tmp_path), ANSIBLE_COLLECTIONS_PATH=str(tmp_path)))
    assert bare.returncode == 2 and "gpufleet.fleet collection is not installed" in bare.stderr, bare.stderr
    assert not (tmp_path / "bare").exists()


@pytest.mark.lab_only_once
def test_ansible_lint_imports_the_modules_and_checks_their_arguments(tmp_path):
    lint = os.path.join(BIN, "ansible-lint")
    if not os.path.exists(lint):
        pytest.skip("ansible-lint is installed in the primary venv only (requirements/controller.txt)")
    bad = os.path.join(ROOT, "playbooks", "_lint_probe_%d.yml" % os.getpid())
    with open(bad, "w") as fh:
        fh.write("---\n- name: Probe\n  hosts: gpu_hosts\n  gather_facts: false\n  tasks:\n"
                 "    - name: Read the GPUs with an argument the module does not have\n"
                 "      gpufleet.fleet.nvidia_gpu_info:\n        bogus_probe_arg: 1\n")
    try:
        res = run([lint, "playbooks", "roles"], ROOT, clean_env(ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg")),
                  timeout=600)
    finally:
        os.unlink(bad)
    out = res.stdout + res.stderr
    assert "Ignored exception" not in out and "No module named" not in out, out[-3000:]
    assert "bogus_probe_arg" in out and "Unsupported parameters" in out, out[-3000:]
    # the only finding is the probe's, and it fails the lint (.ansible-lint: args is not only a warning)
    assert res.returncode != 0 and re.search(r"1 failure\(s\), 0 warning\(s\)", out), out[-2000:]


@pytest.fixture(scope="module")
def tools():
    try:
        return tools_venv.tools_venv()
    except (tools_venv.ToolsUnavailable, subprocess.SubprocessError, OSError) as exc:
        pytest.skip("ansible-builder / awx.awx not available (PyPI unreachable, nothing cached): %s" % exc)


@pytest.mark.lab_only_once
def test_the_checkout_finds_awx_awx_through_ansible_cfg_once_the_tools_venv_exists(tools):
    # plain `ansible-lint` / ansible-doc at the root, no ANSIBLE_COLLECTIONS_PATH: ansible.cfg's collections_path
    # names .cache/collections, where tools_venv links the awx.awx it unpacked
    env = clean_env(ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"))
    doc = run([os.path.join(BIN, "ansible-doc"), "-j", "awx.awx.workflow_job_template"], ROOT, env, timeout=120)
    assert doc.returncode == 0, doc.stderr[-2000:]
    path = json.loads(doc.stdout)["awx.awx.workflow_job_template"]["doc"]["filename"]
    assert os.path.realpath(path).startswith(os.path.realpath(tools["collections"])), path


@pytest.mark.lab_only_once
def test_ansible_builder_creates_the_ee_context_with_the_collection(tools, installed, tmp_path):
    ee = yaml.safe_load(open(os.path.join(ROOT, "execution-environment.yml")))
    assert ee["version"] == 3
    pins = open(os.path.join(ROOT, "requirements", "controller.txt")).read()
    assert ee["dependencies"]["ansible_core"]["package_pip"] in pins.splitlines()
    assert ee["dependencies"]["ansible_runner"]["package_pip"] in pins.splitlines()
    # no version in the EE file (galaxy.yml is the one source): make ee-context copies the tarball of galaxy.yml's
    # version to a fixed name, dist/ee/gpufleet-fleet.tar.gz; put this build's tarball there
    dist = os.path.join(ROOT, "dist", "ee")
    os.makedirs(dist, exist_ok=True)
    name = "gpufleet-fleet.tar.gz"
    assert ee["additional_build_files"][0]["src"] == "dist/ee/" + name
    version = yaml.safe_load(open(os.path.join(ROOT, "galaxy.yml")))["version"]
    assert version not in open(os.path.join(ROOT, "execution-environment.yml")).read()
    shutil.copy(installed["tarball"], os.path.join(dist, name))
    ctx = tmp_path / "context"
    res = run([os.path.join(tools["bin"], "ansible-builder"), "create", "-f", "execution-environment.yml",
               "-c", str(ctx), "--output-filename", "Containerfile"], ROOT, clean_env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    containerfile = (ctx / "Containerfile").read_text()
    assert ee["dependencies"]["ansible_core"]["package_pip"] in containerfile
    assert (ctx / "_build" / "collections" / name).exists()
    # the galaxy stage: ansible-galaxy collection install -r requirements.yml in /build (= _build)
    into = tmp_path / "ee-collections"
    galaxy = run([os.path.join(BIN, "ansible-galaxy"), "collection", "install", "-r", "requirements.yml",
                  "-p", str(into)], str(ctx / "_build"), clean_env())
    assert galaxy.returncode == 0, galaxy.stdout + galaxy.stderr
    assert (into / "ansible_collections" / "gpufleet" / "fleet" / "plugins" / "modules" / "nvidia_gpu_info.py").exists()


@pytest.mark.lab_only_once
def test_awx_configuration_parses_lints_clean_and_names_real_playbooks(tools, tmp_path):
    env = clean_env(ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"),
                    ANSIBLE_COLLECTIONS_PATH=tools["collections"] + ":" + os.path.join(ROOT, "collections"))
    syntax = run([os.path.join(BIN, "ansible-playbook"), "--syntax-check", "awx/configure.yml"], ROOT, env)
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    lint = os.path.join(BIN, "ansible-lint")
    clean = run([lint, "awx/configure.yml"], ROOT, env, timeout=600)
    assert clean.returncode == 0 and re.search(r"0 failure\(s\), 0 warning\(s\)", clean.stdout + clean.stderr), \
        (clean.stdout + clean.stderr)[-3000:]
    # awx.awx's argument specs are really checked: a wrong parameter is reported
    text = open(os.path.join(ROOT, "awx", "configure.yml")).read()
    probe = os.path.join(ROOT, "awx", "_probe_%d.yml" % os.getpid())
    with open(probe, "w") as fh:
        fh.write(text.replace("        scm_update_on_launch: true\n",
                              "        scm_update_on_launch: true\n        bogus_probe_arg: 1\n"))
    try:
        bad = run([lint, probe], ROOT, env, timeout=600)
    finally:
        os.unlink(probe)
    assert "bogus_probe_arg" in bad.stdout + bad.stderr and bad.returncode != 0
    # what the job templates run exists; every survey variable is one the playbooks read
    play = yaml.safe_load(text)[0]
    tasks = {t["name"]: t for t in play["tasks"]}
    jt = next(t for t in play["tasks"] if "awx.awx.job_template" in t)
    assert sorted(i["name"] for i in jt["loop"]) == sorted(PLAYBOOKS)
    for item in jt["loop"]:
        assert os.path.exists(os.path.join(ROOT, "playbooks", item["name"] + ".yml"))
        for q in item["questions"]:
            used = subprocess.run(["grep", "-rqw", q["variable"], "playbooks", "roles"], cwd=ROOT)
            assert used.returncode == 0, q["variable"]
    assert jt["awx.awx.job_template"]["notification_templates_error"] == ["{{ _p }} failure"]
    sched = tasks["Hourly fleet check"]["awx.awx.schedule"]
    assert sched["unified_job_template"] == "{{ _p }} check"
    awx_vars = yaml.safe_load(open(os.path.join(ROOT, "awx", "vars.yml")))
    assert "FREQ=HOURLY" in awx_vars["gpufleet_awx_check_rrule"]
    # AD_HOC_COMMANDS is global: gpufleet adds its modules to the controller's current list, never replaces it
    settings = [t for t in tasks.values() if "awx.awx.settings" in t and t["awx.awx.settings"]["name"] == "AD_HOC_COMMANDS"]
    assert len(settings) == 1 and "_gpufleet_awx_ad_hoc_now | union(" in settings[0]["awx.awx.settings"]["value"]
    assert "'settings/jobs'" in tasks["Read the ad-hoc modules AWX allows now (settings/jobs)"]["ansible.builtin.set_fact"][
        "_gpufleet_awx_ad_hoc_now"]
    assert all(m.startswith("gpufleet.fleet.") for m in awx_vars["gpufleet_awx_ad_hoc_commands"])
    for module in awx_vars["gpufleet_awx_ad_hoc_commands"]:
        if module.startswith("gpufleet.fleet."):
            assert os.path.exists(os.path.join(ROOT, "plugins", "modules", module.split(".")[-1] + ".py"))
    _workflow_nodes_name_real_templates(play, tasks, jt)
    _credential_types_inject_what_the_playbooks_read(play, jt)
    _rendered_arguments_pass_the_awx_modules_specs(text, tools, tmp_path)
    _workflow_nodes_match_the_documented_suboptions(play, tasks, tools)


def _read_by(variable, *paths):
    """True when ``variable`` (a whole word) appears in the files under ``paths`` (relative to the checkout)."""
    return subprocess.run(["grep", "-rqw", variable, *paths], cwd=ROOT).returncode == 0


def _workflow_nodes_name_real_templates(play, tasks, jt):
    """The maintenance workflow: check -> (success) restart -> (always) check, each node a job template this
    playbook creates, the first check unsliced and told to fail on nothing but a broken run (prompts its job
    template accepts), the restart reading the check's artifact (gpufleet_check)."""
    [wf] = [t["awx.awx.workflow_job_template"] for t in tasks.values() if "awx.awx.workflow_job_template" in t]
    templates = {"{{ _p }} %s" % item["name"]: item for item in jt["loop"]}
    nodes = {node["identifier"]: node for node in wf["workflow_nodes"]}
    for node in nodes.values():
        assert node["unified_job_template"]["type"] == "job_template"
        assert node["unified_job_template"]["name"] in templates, node["unified_job_template"]
        for edge in ("success_nodes", "failure_nodes", "always_nodes"):
            for child in (node.get("related") or {}).get(edge, []):
                assert child["identifier"] in nodes, child
        item = templates[node["unified_job_template"]["name"]]
        # extra_data reaches a job only for variables its template's survey asks (or ask_variables_on_launch)
        assert set(node.get("extra_data") or {}) <= {q["variable"] for q in item["questions"]}, node
    edges = {(parent, edge, child["identifier"]) for parent, node in nodes.items()
             for edge, children in (node.get("related") or {}).items() for child in children}
    assert edges == {("check-before", "success_nodes", "restart"), ("restart", "always_nodes", "check-after")}
    assert [nodes[n]["unified_job_template"]["name"] for n in ("check-before", "restart", "check-after")] == \
        ["{{ _p }} check", "{{ _p }} restart", "{{ _p }} check"]
    assert nodes["check-before"]["extra_data"] == {"gpufleet_check_fail_on": "never"}
    # unsliced: a sliced job's artifacts are its slices' merged key by key (one slice's gpufleet_check would win)
    assert nodes["check-before"]["job_slice_count"] == 1
    assert jt["awx.awx.job_template"]["ask_job_slice_count_on_launch"] == "{{ item.slices | int > 1 }}"
    assert templates["{{ _p }} check"]["slices"] == "{{ gpufleet_awx_check_slice_count }}"
    assert templates["{{ _p }} restart"]["slices"] == 1  # never sliced: slices would roll at once
    assert "gpufleet_check:" in open(os.path.join(ROOT, "playbooks", "check.yml")).read()  # the artifact's key
    assert _read_by("gpufleet_check", "playbooks/restart.yml") and _read_by("gpufleet_restart_verdicts", "playbooks/restart.yml")
    for question in wf["survey_spec"]["spec"][1:]:
        assert _read_by(question["variable"], "playbooks", "roles"), question["variable"]
    assert wf["notification_templates_error"] == ["{{ _p }} failure"]


def _credential_types_inject_what_the_playbooks_read(play, jt):
    """Each credential type: secret inputs, extra_vars injectors (the playbooks read variables, not the
    environment) that render one of its fields into a variable the playbooks or roles read; its credential is
    attached to job templates whose playbook reads that variable; no key in a survey."""
    injected = {}
    for ctype in play["vars"]["_credential_types"]:
        fields = {f["id"]: f for f in ctype["inputs"]["fields"]}
        assert all(f.get("secret") is True for f in fields.values()), ctype["name"]
        assert set(ctype["injectors"]) == {"extra_vars"}, ctype["injectors"]
        for variable, template in ctype["injectors"]["extra_vars"].items():
            field = re.fullmatch(r"\{% raw %\}\{\{ (\w+) \}\}\{% endraw %\}", template)
            assert field and field.group(1) in fields, template
            assert _read_by(variable, "roles", "playbooks"), variable
            injected[variable] = ctype["name"]
    assert set(injected) == {"sglang_api_key", "gpufleet_router_api_key", "gpufleet_router_control_plane_key"}
    credentials = play["vars"]["_api_credentials"]
    reads = {"restart": ("sglang_api_key", "gpufleet_router_api_key"), "check": ("sglang_api_key",)}
    for item in jt["loop"]:
        assert set(item["api_keys"]) <= set(credentials), item["name"]
        assert sorted(item["api_keys"]) == sorted({"sglang_api_key": "sglang", "gpufleet_router_api_key": "router"}[v]
                                                  for v in reads.get(item["name"], ())), item["name"]
        for question in item["questions"]:
            assert "key" not in question["variable"], question
    assert "sglang_api_key" in open(os.path.join(ROOT, "roles", "fleet_check", "vars", "main.yml")).read()


def _undocumented(value, options, where):
    """Keys of ``value`` (nested dicts and lists of dicts) that ``options`` (a module's documented suboptions) does
    not name, and values outside a documented ``choices``; as "path: problem" strings."""
    problems = []
    if not isinstance(value, dict):
        return problems
    for key, sub in value.items():
        path = "%s.%s" % (where, key)
        if key not in options:
            problems.append("%s: not a documented suboption" % path)
            continue
        spec = options[key]
        if spec.get("choices") and "{{" not in str(sub) and sub not in spec["choices"]:
            problems.append("%s: %r not in %s" % (path, sub, spec["choices"]))
        for item in (sub if isinstance(sub, list) else [sub]):
            if spec.get("suboptions"):
                problems += _undocumented(item, spec["suboptions"], path)
    return problems


def _workflow_nodes_match_the_documented_suboptions(play, tasks, tools):
    """awx.awx's workflow_job_template takes workflow_nodes as a list of plain dicts (its code reads them, Ansible
    checks nothing inside them): they are held to the suboptions its documentation gives (awx.awx 22.7.0), and to
    the keys its code reads with [] (identifier, unified_job_template's name and type)."""
    module = os.path.join(tools["collections"], "ansible_collections", "awx", "awx", "plugins", "modules",
                          "workflow_job_template.py")
    import ast
    [doc] = [node.value.value for node in ast.parse(open(module).read()).body if isinstance(node, ast.Assign)
             and [getattr(t, "id", None) for t in node.targets] == ["DOCUMENTATION"]]
    options = yaml.safe_load(doc)["options"]["workflow_nodes"]["suboptions"]
    [wf] = [t["awx.awx.workflow_job_template"] for t in tasks.values() if "awx.awx.workflow_job_template" in t]
    for node in wf["workflow_nodes"]:
        assert _undocumented(node, options, node["identifier"]) == []
        assert node["identifier"] and node["unified_job_template"]["name"] and node["unified_job_template"]["type"]


def _rendered_arguments_pass_the_awx_modules_specs(text, tools, tmp_path):
    """ansible-lint's args rule skips a task whose values are templated, as most here are: the rendered values are
    checked by running the playbook as AWX runs jobs (ansible-runner) against a controller that refuses connections,
    every task, the optional credentials included. awx.awx validates its argument spec before it connects, so each
    module call must fail on the connection alone (an unknown option, a wrong type or choice fails before it)."""
    import ansible_runner
    probe = tmp_path / "awx-probe"
    (probe / "runner").mkdir(parents=True)
    (probe / "configure.yml").write_text(
        text.replace("  gather_facts: false\n", "  gather_facts: false\n  ignore_errors: true\n", 1)
        .replace("      no_log: true\n", "      no_log: false\n"))  # dummy keys: let the results show the message
    shutil.copy(os.path.join(ROOT, "awx", "vars.yml"), str(probe / "vars.yml"))
    # vars.yml reads the EE image's tag from the checkout's galaxy.yml, one folder above the playbook
    shutil.copy(os.path.join(ROOT, "galaxy.yml"), str(tmp_path / "galaxy.yml"))
    runner = ansible_runner.run(
        private_data_dir=str(probe / "runner"), playbook=str(probe / "configure.yml"), quiet=True,
        envvars={"CONTROLLER_HOST": "https://127.0.0.1:9", "CONTROLLER_OAUTH_TOKEN": "probe",
                 "GPUFLEET_AWX_SGLANG_API_KEY": "probe-key", "GPUFLEET_AWX_ROUTER_API_KEY": "probe-key",
                 "ANSIBLE_COLLECTIONS_PATH": tools["collections"] + ":" + os.path.join(ROOT, "collections")},
        extravars={"gpufleet_awx_sglang_api_key_credential": True, "gpufleet_awx_router_credential": True,
                   "gpufleet_awx_maintenance_enabled": True,
                   # what the settings lookup would have read (it fails on the connection like the modules)
                   "_gpufleet_awx_ad_hoc_now": ["command"]})
    calls = {}
    for event in runner.events:
        data = event.get("event_data") or {}
        if event.get("event") in ("runner_on_failed", "runner_item_on_failed", "runner_on_ok") and \
                not (data.get("res") or {}).get("results"):
            calls.setdefault(data["task"], []).append(str((data.get("res") or {}).get("msg")))
    play = yaml.safe_load(text)[0]
    expected = {t["name"] for t in play["tasks"] if any(k.startswith("awx.awx.") for k in t)}
    assert expected <= set(calls), sorted(expected - set(calls))
    for task, messages in calls.items():
        for message in messages:
            assert "trying to connect to https://127.0.0.1:9" in message, (task, message)
    assert len(calls["Job templates restart, check, patch, unlock (surveys, API-key credentials, slicing, failure "
                     "notification)"]) == 4
