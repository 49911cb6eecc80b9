"""playbooks/patch.yml through ansible-runner (as AWX runs it), on real SGLang 0.5.23 files.

Two fleets:

* ``local`` (marker ``realrelease``): two inventory hosts on this machine (connection local), each with its
  own virtualenv holding the real 0.5.23 ``sglang`` package from PyPI. Needs no lab, only the wheel cache.
* ``lab`` (marker ``lab``): every host of the lab fleet over real SSH; each host has its own venv with the
  real 0.5.23 engine.py (tests/lab/, fixture ``lab`` in tests/integration/conftest.py).

For both: the first run patches every host (changed on each), the second changes nothing (runner stats and
per-host events), ``--check --diff`` shows the block in the diff events while the files stay byte-identical,
and ``-e sglang_nccl_patch_state=absent`` restores the original bytes.
"""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAYBOOK = os.path.join(ROOT, "playbooks", "patch.yml")
RELEASE = "0.5.23"
ENGINE_REL = os.path.join("sglang", "srt", "entrypoints", "engine.py")
BEGIN = "# BEGIN gpufleet managed block: sglang_nccl_patch"

ENV = {"NCCL_IB_HCA": "mlx5", "NCCL_MIN_NCHANNELS": 16, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _module_events(runner, host=None):
    """runner_on_ok / runner_on_failed events of the sglang_nccl_patch task, per host (dict host -> event_data)."""
    found = {}
    for event in runner.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_on_failed") and \
                data.get("task_action", "").endswith("sglang_nccl_patch"):
            found[data["host"]] = dict(data, failed=event["event"] == "runner_on_failed")
    return found


def _changed(runner):
    return {host: n for host, n in (runner.stats or {}).get("changed", {}).items() if n}


def _check_fleet(run, read, hosts, engine_paths, env):
    """The four behaviours, for any fleet. ``run(extravars, cmdline)`` -> runner; ``read(host, path)`` -> bytes;
    ``env``: the sglang_nccl_env the inventory gives."""
    expected = {k: str(v) for k, v in env.items()}
    first_name = sorted(expected)[0]
    # Start from SGLang's own file: on the shared lab another test may have left a block behind. On an
    # unpatched file, absent changes nothing.
    was = {h: read(h, engine_paths[h]) for h in hosts}
    clean = run({"sglang_nccl_patch_state": "absent"}, None)
    assert clean.status == "successful"
    assert sorted(_changed(clean)) == sorted(h for h in hosts if BEGIN.encode() in was[h])
    originals = {h: read(h, engine_paths[h]) for h in hosts}
    assert all(BEGIN.encode() not in data for data in originals.values())

    dry = run({}, "--check --diff")
    assert dry.status == "successful", dry.stdout.read() if hasattr(dry.stdout, "read") else dry.status
    events = _module_events(dry)
    assert sorted(events) == sorted(hosts)
    for host in hosts:
        res = events[host]["res"]
        assert res["changed"] and BEGIN in res["diff"]["after"] and BEGIN not in res["diff"]["before"]
        assert "os.environ[%r] = %r" % (first_name, expected[first_name]) in res["diff"]["after"]
        assert read(host, engine_paths[host]) == originals[host], "check mode wrote %s" % host

    first = run({}, None)
    assert first.status == "successful"
    assert sorted(_changed(first)) == sorted(hosts)
    events = _module_events(first)
    for host in hosts:
        res = events[host]["res"]
        assert res["changed"] and res["sglang_version"] == RELEASE and res["path"] == engine_paths[host]
        assert res["env"] == expected
        text = read(host, engine_paths[host]).decode("utf-8")
        lines = text.splitlines()
        assert BEGIN in lines[res["line"] - 1]
        assert lines[res["line"] + len(expected) + 1].strip() == 'mp.set_start_method("spawn", force=True)'
    patched = {h: read(h, engine_paths[h]) for h in hosts}

    second = run({}, None)
    assert second.status == "successful"
    assert _changed(second) == {}
    assert all(not e["res"]["changed"] for e in _module_events(second).values())
    assert {h: read(h, engine_paths[h]) for h in hosts} == patched

    undo = run({"sglang_nccl_patch_state": "absent"}, None)
    assert undo.status == "successful"
    assert sorted(_changed(undo)) == sorted(hosts)
    assert {h: read(h, engine_paths[h]) for h in hosts} == originals


# --- local fleet: two venvs on this machine ---------------------------------------------------------------------

def _make_venv(base, package_parent):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base)], check=True)
    purelib = subprocess.run([str(base / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # Only what the module reads: version files, dist-info and the engine file (a full copy is 130 MB).
    pkg = os.path.join(purelib, "sglang")
    os.makedirs(os.path.join(pkg, "srt", "entrypoints"))
    for rel in ("__init__.py", "_version.py", "version.py", os.path.join("srt", "entrypoints", "engine.py")):
        src = os.path.join(str(package_parent), "sglang", rel)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(pkg, rel))
    for name in os.listdir(str(package_parent)):
        if name.endswith(".dist-info"):
            shutil.copytree(os.path.join(str(package_parent), name), os.path.join(purelib, name))
    return str(base / "bin" / "python"), os.path.join(purelib, ENGINE_REL)


@pytest.mark.realrelease
def test_patch_playbook_on_local_fleet(tmp_path):
    ansible_runner = pytest.importorskip("ansible_runner")
    import yaml
    from support.sglang_wheels import sglang_package_dir

    package_parent = sglang_package_dir(RELEASE).parent
    hosts = ["gpu-a", "gpu-b"]
    host_vars, engine_paths = {}, {}
    for host in hosts:
        python, engine = _make_venv(tmp_path / ("venv-" + host), package_parent)
        engine_paths[host] = engine
        host_vars[host] = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                           "sglang_python": python}
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"gpu_hosts": {"hosts": host_vars, "vars": {"sglang_nccl_env": ENV}}}))

    def run(extravars, cmdline):
        private = tmp_path / "runner"
        shutil.rmtree(str(private), ignore_errors=True)
        private.mkdir()
        return ansible_runner.run(
            private_data_dir=str(private), playbook=PLAYBOOK, inventory=str(inventory),
            extravars=extravars, cmdline=cmdline, quiet=True,
            # The ansible-playbook of the interpreter running the tests (2.19 or 2.21 venv).
            envvars={"ANSIBLE_CONFIG": os.path.join(ROOT, "ansible.cfg"),
                     "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})

    def read(host, path):
        with open(path, "rb") as handle:
            return handle.read()

    _check_fleet(run, read, hosts, engine_paths, ENV)


# --- lab fleet: real SSH -----------------------------------------------------------------------------------------

@pytest.mark.lab_only_once
@pytest.mark.lab
def test_patch_playbook_on_lab_fleet(lab):
    hosts = list(lab.hosts)
    engine_paths = {}
    for host in hosts:
        out = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c",
                              "import importlib.util, os; "
                              "print(os.path.join(importlib.util.find_spec('sglang').submodule_search_locations[0],"
                              " 'srt', 'entrypoints', 'engine.py'))"])
        engine_paths[host] = _stdout(out).strip()

    def read(host, path):
        return _stdout_bytes(lab.exec(host, ["cat", path]))

    def run(extravars, cmdline):
        return lab.run_playbook(PLAYBOOK, extravars=extravars, cmdline=cmdline)

    # The inventory's own sglang_nccl_env (tests/lab/lab.py writes it into group_vars).
    env = lab.group_vars["sglang_nccl_env"]
    assert env, "the lab inventory has no sglang_nccl_env"
    try:
        _check_fleet(run, read, hosts, engine_paths, env)
    finally:
        # The lab is shared by the session: leave SGLang's own file behind whatever happened.
        run({"sglang_nccl_patch_state": "absent"}, None)


def _stdout_bytes(result):
    """stdout of a lab.exec() CompletedProcess as the file's bytes (lab.exec decodes with surrogateescape)."""
    assert result.returncode == 0, (result.args, result.stderr)
    return result.stdout.encode("utf-8", "surrogateescape")


def _stdout(result):
    return _stdout_bytes(result).decode("utf-8")
