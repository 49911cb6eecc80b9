"""Which paths gpufleet trusts: module_utils/gpufleet_trust.py (state files, the code root runs), the
gpufleet_root_interpreters filter, and sglang_host_info's owned_paths / root_interpreters options.

Run as root (the lab's machines and CI are): files are chowned to a uid no user has, the way a service user owns
them on a GPU host.
"""
import json
import os
import sys

import pytest
from ansible.module_utils.testing import patch_module_args
from gpu_module_harness import load_module

from ansible_collections.gpufleet.fleet.plugins.filter.gpufleet_trust import gpufleet_root_interpreters
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_trust as T

OTHER = 54321  # a uid with no user: stands for the service user
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")

host_info = load_module("sglang_host_info")


def run_main(args, capsys):
    with patch_module_args(args):
        with pytest.raises(SystemExit) as exc:
            host_info.main()
    return exc.value.code, json.loads(capsys.readouterr().out)


def tree(tmp_path, mode=0o755):
    state = tmp_path / "state"
    state.mkdir(mode)
    os.chmod(state, mode)
    (state / "launch.json").write_text("{}")
    os.chmod(state / "launch.json", 0o600)
    return state


def reasons(problems):
    return {(os.path.basename(p["path"]), p["reason"]) for p in problems}


def test_a_root_owned_state_dir_and_record_are_trusted(tmp_path):
    state = tree(tmp_path)
    assert T.path_problems(str(state / "launch.json"), {0}) == []
    assert T.path_problems(str(state), {0}) == []


def test_a_record_owned_by_another_user_is_named_with_owner_and_mode(tmp_path):
    state = tree(tmp_path)
    os.chown(state / "launch.json", OTHER, OTHER)
    [problem] = T.path_problems(str(state / "launch.json"), {0})
    assert problem["path"] == str(state / "launch.json") and problem["uid"] == OTHER
    assert problem["owner"] == str(OTHER) and problem["mode"] == "0600" and problem["reason"] == "belongs to another user"
    assert T.describe(problem) == "%s (owner %d, mode 0600) belongs to another user" % (state / "launch.json", OTHER)


def test_the_login_user_may_own_them_when_trusted(tmp_path):
    state = tree(tmp_path)
    os.chown(state, OTHER, OTHER)
    os.chown(state / "launch.json", OTHER, OTHER)
    assert T.path_problems(str(state / "launch.json"), {0, OTHER}) == []
    assert reasons(T.path_problems(str(state / "launch.json"), {0})) == {
        ("state", "belongs to another user"), ("launch.json", "belongs to another user")}


def test_a_group_writable_record_or_an_ancestor_writable_by_others_is_refused(tmp_path):
    state = tree(tmp_path)
    os.chmod(state / "launch.json", 0o620)
    assert reasons(T.path_problems(str(state / "launch.json"), {0})) == {("launch.json", "is writable by group or others")}
    os.chmod(state / "launch.json", 0o600)
    os.chmod(state, 0o777)  # anyone could rename another launch.json over it
    assert reasons(T.path_problems(str(state / "launch.json"), {0})) == {("state", "is writable by group or others")}


def test_a_sticky_ancestor_writable_by_others_is_fine_but_not_as_the_target(tmp_path):
    state = tree(tmp_path)
    os.chmod(state, 0o1777)  # like /tmp: only the owner of launch.json (root) may rename it
    assert T.path_problems(str(state / "launch.json"), {0}) == []
    assert reasons(T.path_problems(str(state), {0})) == {("state", "is writable by group or others")}


def test_a_missing_file_is_fine_unless_another_user_could_create_it_first(tmp_path):
    state = tree(tmp_path)
    assert T.path_problems(str(state / "new" / "launch.json"), {0}) == []
    os.chmod(state, 0o1777)
    [problem] = T.path_problems(str(state / "new" / "launch.json"), {0})
    assert problem["path"] == str(state) and "another user could create it first" in problem["reason"]


def test_a_link_is_judged_on_both_chains(tmp_path):
    state = tree(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, OTHER, OTHER)
    (elsewhere / "launch.json").write_text("{}")
    (state / "link.json").symlink_to(elsewhere / "launch.json")
    assert reasons(T.path_problems(str(state / "link.json"), {0})) == {
        ("elsewhere", "belongs to another user")}


def make_venv(tmp_path, site_owner=0, pth_dir=None):
    """A virtualenv's shape (pyvenv.cfg, bin/python -> this interpreter, lib/pythonX.Y/site-packages)."""
    root = tmp_path / "venv"
    version = "python%d.%d" % sys.version_info[:2]
    site = root / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    (root / "pyvenv.cfg").write_text("home = %s\ninclude-system-site-packages = false\n"
                                     % os.path.dirname(os.path.realpath(sys.executable)))
    (site / "pkg").mkdir()
    if pth_dir:
        (site / "extra.pth").write_text("# a comment\nimport os\n%s\n" % pth_dir)
    os.chown(site, site_owner, site_owner)
    return root, site


def test_a_root_owned_venv_may_be_run_by_root(tmp_path):
    root, site = make_venv(tmp_path)
    where = T.interpreter_paths(str(root / "bin" / "python"))
    assert str(root / "bin" / "python") in where["chains"] and str(root / "pyvenv.cfg") in where["chains"]
    assert str(site) in where["entries"]
    assert T.interpreter_problems(str(root / "bin" / "python")) == []


def test_site_packages_of_the_service_user_is_refused_for_root(tmp_path):
    root, site = make_venv(tmp_path, site_owner=OTHER)
    problems = T.interpreter_problems(str(root / "bin" / "python"))
    assert reasons(problems) == {("site-packages", "belongs to another user")}


def test_a_pth_file_or_package_another_user_owns_is_refused(tmp_path):
    root, site = make_venv(tmp_path)
    (site / "evil.pth").write_text("import os\n")
    os.chown(site / "evil.pth", OTHER, OTHER)
    os.chmod(site / "pkg", 0o777)
    assert reasons(T.interpreter_problems(str(root / "bin" / "python"))) == {
        ("evil.pth", "belongs to another user"), ("pkg", "is writable by group or others")}


def test_a_directory_a_pth_file_adds_is_judged_too(tmp_path):
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "psutil").mkdir()
    os.chown(deps / "psutil", OTHER, OTHER)
    root, site = make_venv(tmp_path, pth_dir=str(deps))
    assert str(deps) in T.interpreter_paths(str(root / "bin" / "python"))["entries"]
    assert reasons(T.interpreter_problems(str(root / "bin" / "python"))) == {("psutil", "belongs to another user")}


def test_a_bin_dir_another_user_can_write_is_refused(tmp_path):
    root, site = make_venv(tmp_path)
    os.chmod(root / "bin", 0o775)
    assert ("bin", "is writable by group or others") in reasons(T.interpreter_problems(str(root / "bin" / "python")))


def test_a_missing_interpreter_is_a_problem():
    assert T.interpreter_problems("/nonexistent/bin/python")[0]["reason"] == "does not exist"


def test_filter_says_root_runs_the_interpreter_with_any_become_or_a_root_login():
    assert gpufleet_root_interpreters({"preflight": False, "patch": False}, "ubuntu", "/v/bin/python") == {
        "self": False, "interpreters": {}}
    assert gpufleet_root_interpreters({"preflight": "True", "patch": False}, "ubuntu", "/v/bin/python") == {
        "self": True, "interpreters": {}}
    assert gpufleet_root_interpreters({"patch": True}, "ubuntu", "/v/bin/python") == {
        "self": True, "interpreters": {"sglang_python": "/v/bin/python"}}
    assert gpufleet_root_interpreters({}, "root", "/v/bin/python") == {
        "self": True, "interpreters": {"sglang_python": "/v/bin/python"}}
    # A patch given its file runs no interpreter of its own.
    assert gpufleet_root_interpreters({"patch": True}, "ubuntu", "/v/bin/python", "/x/engine.py")["interpreters"] == {}


def test_module_names_the_state_file_and_what_to_do(tmp_path, capsys):
    state = tree(tmp_path)
    os.chown(state / "launch.json", OTHER, OTHER)
    rc, out = run_main({"owned_paths": {"sglang_state_dir": str(state),
                                        "sglang_launch_record_file": str(state / "launch.json"),
                                        "sglang_launch_api_key_file": str(state / "sglang-api-key.env")}}, capsys)
    assert rc == 0 and out["changed"] is False
    [entry] = out["ownership"]
    assert entry["variable"] == "sglang_launch_record_file"
    assert entry["text"].startswith("sglang_launch_record_file %s cannot be trusted: %s (owner %d, mode 0600) belongs "
                                    "to another user. Only root" % (state / "launch.json", state / "launch.json", OTHER))
    assert "chown it to root and chmod go-w, or choose another sglang_launch_record_file" in entry["text"]


def test_module_judges_its_own_interpreter_and_the_ones_given(tmp_path, capsys):
    root, site = make_venv(tmp_path, site_owner=OTHER)
    rc, out = run_main({"root_interpreter_self": True, "root_interpreters": {"sglang_python": str(root / "bin" / "python")}},
                       capsys)
    assert rc == 0
    [entry] = out["root_code"]  # this test's own interpreter (root's) is fine
    assert entry["variable"] == "sglang_python" and entry["interpreter"] == str(root / "bin" / "python")
    assert ("sglang_python %s runs as root, but %s (owner %d, mode 0755) belongs to another user: a .pth file"
            % (root / "bin" / "python", site, OTHER)) in entry["text"]
    assert "sglang_nccl_patch_become=false" in entry["text"]
