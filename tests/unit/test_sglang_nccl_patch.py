"""sglang_nccl_patch: behaviour of the module's plain functions and of main() on a small SGLang-shaped file.

Real releases are exercised in test_sglang_nccl_patch_releases.py; here the file is small so that every edge
(CRLF, no trailing newline, malformed markers, check mode, modes, backups) can be set up precisely.
"""
import hashlib
import importlib.util
import json
import os
import stat
import sys
import textwrap

import pytest
from gpu_module_harness import sglang_on_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ansible.module_utils import basic
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_nccl_plan as nccl_plan
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_nccl_check as nccl_check
from support.set_envs_exec import run_set_envs_and_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("sglang_nccl_patch", os.path.join(ROOT, "plugins", "modules", "sglang_nccl_patch.py"))
patch_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patch_module)

# Shaped like 0.5.4's function: SGLang writes CUDA_DEVICE_MAX_CONNECTIONS and NCCL_CUMEM_ENABLE itself.
SOURCE = textwrap.dedent('''\
    import os
    import multiprocessing as mp


    def _set_envs_and_config(server_args):
        # Set global environments
        os.environ["NCCL_CUMEM_ENABLE"] = "0"
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "4"
        if server_args.enable_metrics:
            set_prometheus_multiproc_dir()

        # Set mp start method
        mp.set_start_method("spawn", force=True)


    def other():
        return 1
    ''')
ANCHOR = '    mp.set_start_method("spawn", force=True)\n'
VERSION = "0.5.4"


def make_tree(tmp_path, source=SOURCE, newline=None):
    """sglang/srt/entrypoints/engine.py with a version.py, as in an installed wheel; returns the file path."""
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt" / "entrypoints").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text('__version__ = "%s"\n' % VERSION)
    path = pkg / "srt" / "entrypoints" / "engine.py"
    data = source.encode("utf-8")
    if newline:
        data = data.replace(b"\n", newline)
    path.write_bytes(data)
    return path


def run_main(capsys, args, check_mode=False, diff=False):
    """Drive the module's main() the way Ansible 2.19+/2.21 hands arguments to a module; return its JSON."""
    payload = dict(args, _ansible_check_mode=check_mode, _ansible_diff=diff)
    basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": payload}).encode("utf-8")
    if hasattr(basic, "_ANSIBLE_PROFILE"):  # 2.19+: the serialization profile travels with the arguments
        basic._ANSIBLE_PROFILE = "legacy"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        patch_module.main()
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    result["_rc"] = exited.value.code
    return result


@pytest.fixture(autouse=True)
def _reset_module_args():
    yield
    basic._ANSIBLE_ARGS = None
    if hasattr(basic, "_ANSIBLE_PROFILE"):
        basic._ANSIBLE_PROFILE = None


ENV = {"NCCL_IB_HCA": "mlx5", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_MIN_NCHANNELS": 16}


# --- env validation -------------------------------------------------------------------------------------------

def test_env_integers_become_decimal_strings_and_names_are_sorted():
    assert patch_module.normalise_env({"B": 16, "A": "x"}) == [("A", "x"), ("B", "16")]


@pytest.mark.parametrize("value, expected", [
    (True, "of type bool is refused"),
    (None, "of type NoneType is refused"),
    (1.5, "of type float is refused"),
    (["a"], "of type list is refused"),
    ("a\x00b", "contains NUL"),
    ("\ud800", "lone surrogate"),
], ids=["bool", "null", "float", "list", "nul", "surrogate"])
def test_env_values_with_ambiguous_or_impossible_string_form_are_refused(value, expected):
    with pytest.raises(patch_module.PatchError, match=expected):
        patch_module.normalise_env({"NCCL_X": value})


@pytest.mark.parametrize("name", ["A\n", "", "9A", "A-B", "A B", "\u00c4"], ids=repr)
def test_env_names_outside_the_posix_pattern_are_refused(name):
    with pytest.raises(patch_module.PatchError, match="not a valid environment variable name"):
        patch_module.normalise_env({name: "v"})


def test_env_error_lists_every_bad_entry():
    with pytest.raises(patch_module.PatchError) as err:
        patch_module.normalise_env({"1BAD": "x", "GOOD": "y", "ALSO-BAD": "z", "B": False})
    msg = str(err.value)
    assert "'1BAD'" in msg and "'ALSO-BAD'" in msg and "B: value False" in msg and "GOOD" not in msg


# --- plan_patch (no I/O) --------------------------------------------------------------------------------------

def test_block_goes_right_before_anchor_with_its_indentation():
    plan = patch_module.plan_patch(SOURCE, patch_module.normalise_env(ENV), "present")
    lines = plan["after"].splitlines(True)
    start = plan["line"] - 1
    assert lines[start].startswith("    # BEGIN gpufleet managed block") and "do not edit by hand" in lines[start]
    assert lines[start + 1:start + 4] == [
        "    os.environ['CUDA_DEVICE_MAX_CONNECTIONS'] = '1'\n",
        "    os.environ['NCCL_IB_HCA'] = 'mlx5'\n",
        "    os.environ['NCCL_MIN_NCHANNELS'] = '16'\n",
    ]
    assert lines[start + 4].startswith("    # END gpufleet managed block")
    assert lines[start + 5] == ANCHOR
    # Nothing but whole lines was added.
    assert "".join(lines[:start] + lines[start + 5:]) == SOURCE


def test_tab_indented_anchor_gets_tab_indented_block():
    source = SOURCE.replace("\n    ", "\n\t")
    plan = patch_module.plan_patch(source, [("A", "1")], "present")
    assert "\n\tos.environ['A'] = '1'\n\tmp.set_start_method" in plan["after"].replace(
        "\t# END gpufleet managed block: sglang_nccl_patch\n", "")
    compile(plan["after"], "x", "exec")


def test_crlf_file_gets_crlf_block_and_absent_restores_it():
    source = SOURCE.replace("\n", "\r\n")
    plan = patch_module.plan_patch(source, [("A", "1")], "present")
    assert "\n" not in plan["after"].replace("\r\n", "")
    assert patch_module.plan_patch(plan["after"], [], "absent")["after"] == source


def test_anchor_on_last_line_without_newline():
    source = SOURCE.split("\n\n\ndef other")[0].rstrip("\n")
    assert source.endswith('force=True)')
    plan = patch_module.plan_patch(source, [("A", "1")], "present")
    assert plan["after"].endswith("# END gpufleet managed block: sglang_nccl_patch\n" + ANCHOR.rstrip("\n"))
    assert patch_module.plan_patch(plan["after"], [], "absent")["after"] == source


def test_other_env_replaces_block_instead_of_adding_one():
    first = patch_module.plan_patch(SOURCE, [("A", "1")], "present")["after"]
    second = patch_module.plan_patch(first, [("B", "2")], "present")
    assert second["changed"]
    assert second["after"].count("# BEGIN gpufleet") == 1
    assert "os.environ['A']" not in second["after"] and "os.environ['B'] = '2'" in second["after"]


def test_empty_env_removes_block():
    first = patch_module.plan_patch(SOURCE, [("A", "1")], "present")["after"]
    plan = patch_module.plan_patch(first, [], "present")
    assert plan == {"after": SOURCE, "changed": True, "line": None, "placement": None, "hand_edits": []}


@pytest.mark.parametrize("mangle", [
    lambda text: text.replace("    # END gpufleet managed block: sglang_nccl_patch\n", ""),
    lambda text: text.replace("    # BEGIN gpufleet managed block", "    # BEGIN-ish", 1),
    lambda text: text + "# BEGIN gpufleet managed block: sglang_nccl_patch\n# END gpufleet managed block: sglang_nccl_patch\n",
], ids=["begin-without-end", "end-without-begin", "two-blocks"])
def test_malformed_block_is_refused(mangle):
    patched = patch_module.plan_patch(SOURCE, [("A", "1")], "present")["after"]
    with pytest.raises(patch_module.PatchError, match="malformed .*BEGIN on line"):
        patch_module.plan_patch(mangle(patched), [("A", "1")], "present")


# --- property-based: any valid value arrives exactly, invalid input never touches the file --------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text())
def test_any_text_value_compiles_and_arrives_exactly_or_is_refused(tmp_path, value):
    path = tmp_path / "engine.py"
    path.write_text(SOURCE)
    try:
        items = patch_module.normalise_env({"NCCL_VALUE": value, "CUDA_DEVICE_MAX_CONNECTIONS": value})
    except patch_module.PatchError as exc:
        assert "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value), exc
        return
    after = patch_module.plan_patch(SOURCE, items, "present")["after"]
    assert after.isascii() or not SOURCE.isascii()
    path.write_text(after)
    env = run_set_envs_and_config(str(path), {"CUDA_DEVICE_MAX_CONNECTIONS": "untouched"})
    assert env["NCCL_VALUE"] == value
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]*\Z"))
def test_valid_names_are_accepted(name):
    items = patch_module.normalise_env({name: "v"})
    plan = patch_module.plan_patch(SOURCE, items, "present")
    compile(plan["after"], "x", "exec")
    assert "os.environ[%r] = 'v'" % name in plan["after"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=0, max_size=12).filter(lambda s: not patch_module.NAME_RE.fullmatch(s)))
def test_invalid_names_fail_without_touching_the_file(tmp_path_factory, name):
    path = make_tree(tmp_path_factory.mktemp("t"))
    before = path.read_bytes()
    with pytest.raises(patch_module.PatchError, match="not a valid environment variable name"):
        patch_module.normalise_env({name: "v"})
    # And through the module: failure, file byte-identical.
    result = _run_main_plain({"path": str(path), "env": {name: "v", "GOOD": "1"}})
    assert result["failed"] and "not a valid environment variable name" in result["msg"]
    assert path.read_bytes() == before


def _run_main_plain(args):
    """run_main without capsys (hypothesis forbids function-scoped fixtures per example)."""
    import io
    from contextlib import redirect_stdout
    payload = dict(args, _ansible_check_mode=False, _ansible_diff=False)
    basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": payload}).encode("utf-8")
    if hasattr(basic, "_ANSIBLE_PROFILE"):
        basic._ANSIBLE_PROFILE = "legacy"
    buf = io.StringIO()
    with redirect_stdout(buf), pytest.raises(SystemExit):
        patch_module.main()
    out = buf.getvalue()
    return json.loads(out[out.index("{"):])


# --- main() -----------------------------------------------------------------------------------------------------

def test_patch_then_repatch_changes_nothing(tmp_path, capsys):
    path = make_tree(tmp_path)
    first = run_main(capsys, {"path": str(path), "env": ENV})
    assert first["changed"] and first["_rc"] == 0
    assert first["sglang_version"] == VERSION and first["path"] == str(path)
    assert first["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_IB_HCA": "mlx5", "NCCL_MIN_NCHANNELS": "16"}
    assert path.read_text().splitlines()[first["line"] - 1].lstrip().startswith("# BEGIN gpufleet")
    patched = path.read_bytes()
    second = run_main(capsys, {"path": str(path), "env": ENV})
    assert not second["changed"] and second["line"] == first["line"]
    assert path.read_bytes() == patched
    env = run_set_envs_and_config(str(path), {})
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_MIN_NCHANNELS"] == "16"


def test_check_mode_reports_change_and_diff_without_writing(tmp_path, capsys):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    result = run_main(capsys, {"path": str(path), "env": ENV}, check_mode=True, diff=True)
    assert result["changed"] and result["line"] is not None
    assert result["diff"]["before"] == SOURCE
    assert "os.environ['NCCL_IB_HCA'] = 'mlx5'" in result["diff"]["after"]
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    assert result["backup_file"] is None


def test_diff_only_when_asked(tmp_path, capsys):
    path = make_tree(tmp_path)
    assert "diff" not in run_main(capsys, {"path": str(path), "env": ENV})


def test_backup_keeps_original_bytes(tmp_path, capsys):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    result = run_main(capsys, {"path": str(path), "env": ENV, "backup": True})
    assert result["backup_file"] and os.path.dirname(result["backup_file"]) == str(path.parent)
    with open(result["backup_file"], "rb") as handle:
        assert handle.read() == before
    again = run_main(capsys, {"path": str(path), "env": ENV, "backup": True})
    assert again["backup_file"] is None  # nothing changed, nothing backed up


def test_previous_file_keeps_the_bytes_before_the_change_with_their_sha256_and_mode(tmp_path, capsys):
    path = make_tree(tmp_path)
    os.chmod(path, 0o640)
    before = path.read_bytes()
    prev = tmp_path / "state" / "sub" / "engine.py.prev"  # parent directories are created
    result = run_main(capsys, {"path": str(path), "env": ENV, "previous_file": str(prev)})
    assert result["_rc"] == 0 and result["changed"]
    assert prev.read_bytes() == before and path.read_bytes() != before
    assert result["previous"] == {"path": str(path), "previous_file": str(prev),
                                  "sha256": hashlib.sha256(before).hexdigest()}
    assert stat.S_IMODE(prev.stat().st_mode) == 0o640
    assert stat.S_IMODE(prev.parent.stat().st_mode) & 0o755 == 0o755
    assert [n for n in os.listdir(prev.parent) if n != "engine.py.prev"] == []  # no temporary file left


def test_sha256_is_that_of_the_bytes_left_in_the_file(tmp_path, capsys):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    checked = run_main(capsys, {"path": str(path), "env": ENV}, check_mode=True)
    assert checked["sha256"] == hashlib.sha256(before).hexdigest()  # check mode: nothing written
    written = run_main(capsys, {"path": str(path), "env": ENV})
    assert written["changed"] and written["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() != checked["sha256"]
    again = run_main(capsys, {"path": str(path), "env": ENV})
    assert not again["changed"] and again["sha256"] == written["sha256"]


def test_previous_file_is_not_written_when_nothing_changes_or_in_check_mode(tmp_path, capsys):
    path = make_tree(tmp_path)
    prev = tmp_path / "engine.py.prev"
    checked = run_main(capsys, {"path": str(path), "env": ENV, "previous_file": str(prev)}, check_mode=True)
    assert checked["changed"] and checked["previous"] is None and not prev.exists()
    # ... but says where the copy would go and what it would hold (tasks/previous.yml copies it as another user).
    assert checked["files"][0]["previous_file"] == str(prev)
    assert checked["files"][0]["previous_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    run_main(capsys, {"path": str(path), "env": ENV})
    again = run_main(capsys, {"path": str(path), "env": ENV, "previous_file": str(prev)})
    assert not again["changed"] and again["previous"] is None and not prev.exists()


def test_previous_file_that_cannot_be_written_fails_before_the_file_is_touched(tmp_path, capsys):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    result = run_main(capsys, {"path": str(path), "env": ENV, "previous_file": str(blocker / "engine.py.prev")})
    assert result["_rc"] == 1 and result["failed"]
    assert "cannot keep the current bytes" in result["msg"] and "No file is changed" in result["msg"]
    assert result["previous"] is None
    assert path.read_bytes() == before


def test_absent_restores_original_bytes(tmp_path, capsys):
    path = make_tree(tmp_path, newline=b"\r\n")
    before = path.read_bytes()
    run_main(capsys, {"path": str(path), "env": ENV})
    assert path.read_bytes() != before
    result = run_main(capsys, {"path": str(path), "state": "absent"}, diff=True)
    assert result["changed"] and result["line"] is None and result["env"] == {}
    assert path.read_bytes() == before
    assert not run_main(capsys, {"path": str(path), "state": "absent"})["changed"]


def test_write_is_a_rename_that_keeps_mode_and_owner(tmp_path, capsys):
    path = make_tree(tmp_path)
    os.chmod(str(path), 0o640)
    owner = (4321, 4321) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    if os.geteuid() == 0:
        os.chown(str(path), *owner)
    inode = path.stat().st_ino
    run_main(capsys, {"path": str(path), "env": ENV})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert (path.stat().st_uid, path.stat().st_gid) == owner
    assert path.stat().st_ino != inode  # replaced by rename, never rewritten in place
    assert [p.name for p in path.parent.iterdir() if "gpufleet-tmp" in p.name] == []


def test_stale_bytecode_of_patched_file_is_removed(tmp_path, capsys):
    path = make_tree(tmp_path)
    cache = path.parent / "__pycache__"
    cache.mkdir()
    (cache / "engine.cpython-311.pyc").write_bytes(b"old")
    (cache / "other.cpython-311.pyc").write_bytes(b"keep")
    run_main(capsys, {"path": str(path), "env": ENV})
    assert sorted(p.name for p in cache.iterdir()) == ["other.cpython-311.pyc"]


def test_source_that_would_not_compile_is_never_written(tmp_path, capsys, monkeypatch):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    # The plan lives in module_utils (gpufleet_nccl_plan); the module re-exports it.
    monkeypatch.setattr(nccl_plan, "render_block", lambda items, indent, eol, taken=(): [indent + "os.environ[\n"])
    result = run_main(capsys, {"path": str(path), "env": ENV})
    assert result["failed"] and "does not compile" in result["msg"] and str(path) in result["msg"]
    assert path.read_bytes() == before


@pytest.mark.parametrize("source, looked_for", [
    (SOURCE.replace("def _set_envs_and_config", "def _renamed"), "def _set_envs_and_config() not found"),
    (SOURCE.replace(ANCHOR, ANCHOR + ANCHOR), "calls mp.set_start_method(...) 2 times (lines 13, 14)"),
    (SOURCE.replace(ANCHOR, "    if fast:\n    " + ANCHOR), "line 14 is not a statement of its own"),
], ids=["no-function", "call-twice", "call-in-branch"])
def test_missing_function_or_ambiguous_shape_fails_naming_file_version_and_line(tmp_path, capsys, source, looked_for):
    path = make_tree(tmp_path, source=source)
    before = path.read_bytes()
    result = run_main(capsys, {"path": str(path), "env": ENV})
    assert result["failed"]
    assert str(path) in result["msg"] and "sglang %s" % VERSION in result["msg"] and looked_for in result["msg"]
    assert "No file was changed" in result["msg"]
    assert path.read_bytes() == before


def test_a_function_without_the_start_method_call_gets_the_block_at_its_end(tmp_path, capsys):
    path = make_tree(tmp_path, source=SOURCE.replace(ANCHOR, ""))
    before = path.read_bytes()
    result = run_main(capsys, {"path": str(path), "env": ENV})
    assert result["changed"] and result["files"][0]["placement"] == "end_of_body"
    lines = path.read_text().splitlines()
    # After the function's last statement (the if block), at the body's indentation, before `def other`.
    assert lines[result["line"] - 2].strip() == "set_prometheus_multiproc_dir()"
    assert lines[result["line"] - 1] == "    # BEGIN gpufleet managed block: sglang_nccl_patch" + patch_module.BEGIN_HINT
    env = run_set_envs_and_config(str(path), {}, start_method_calls=0)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_CUMEM_ENABLE"] == "0"
    assert not run_main(capsys, {"path": str(path), "env": ENV})["changed"]
    assert run_main(capsys, {"path": str(path), "state": "absent"})["changed"] and path.read_bytes() == before


def test_malformed_block_fails_and_leaves_file(tmp_path, capsys):
    path = make_tree(tmp_path, source=SOURCE.replace(
        ANCHOR, "    # BEGIN gpufleet managed block: sglang_nccl_patch\n" + ANCHOR))
    before = path.read_bytes()
    result = run_main(capsys, {"path": str(path), "state": "absent"})
    assert result["failed"] and "malformed" in result["msg"] and "BEGIN on line(s) 13, END on line(s) none" in result["msg"]
    assert path.read_bytes() == before


def test_bad_env_fails_before_reading_file(tmp_path, capsys):
    result = run_main(capsys, {"path": str(tmp_path / "missing.py"), "env": {"NCCL_X": True}})
    assert result["failed"] and "NCCL_X: value True of type bool is refused" in result["msg"]


def test_python_option_locates_the_file_and_release(tmp_path, capsys, monkeypatch):
    path = make_tree(tmp_path)
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    result = run_main(capsys, {"python": sys.executable, "env": ENV})
    assert result["changed"] and result["path"] == str(path) and result["sglang_version"] == VERSION


def test_python_without_sglang_fails_with_advice(capsys, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    result = run_main(capsys, {"python": sys.executable, "env": ENV})
    assert result["failed"] and "sglang is not installed for %s" % sys.executable in result["msg"]
    assert "sglang_python" in result["msg"]


def test_path_and_python_are_mutually_exclusive(tmp_path, capsys):
    result = run_main(capsys, {"python": sys.executable, "path": str(tmp_path)})
    assert result["failed"] and "mutually exclusive" in result["msg"]


# --- NCCL values (module_utils gpufleet_nccl) ------------------------------------------------------------------

def test_env_value_nccl_would_refuse_fails_naming_it_and_the_way_out():
    with pytest.raises(patch_module.PatchError) as err:
        patch_module.normalise_env({"NCCL_PROTO": 5, "NCCL_P2P_LEVEL": "nvl", "NCCL_IB_HCA": "mlx5"})
    msg = str(err.value)
    assert "NCCL_PROTO='5'" in msg and "NCCL_P2P_LEVEL='nvl'" in msg and "NCCL_IB_HCA" not in msg
    assert "sglang_nccl_env_unchecked" in msg


def test_an_nccl_name_nccl_never_reads_is_refused_even_when_unchecked_and_without_that_hint():
    with pytest.raises(patch_module.PatchError) as err:
        patch_module.normalise_env({"nccl_proto": "LL"}, unchecked=["nccl_proto"])
    msg = str(err.value)
    assert "NCCL reads NCCL_PROTO (capitals) and never looks at nccl_proto" in msg
    assert "sglang_nccl_env_unchecked" not in msg


def test_unchecked_names_are_written_as_given():
    assert patch_module.normalise_env({"NCCL_ALGO": "MyNewAlgo", "NCCL_PROTO": "LL"}, unchecked=["NCCL_ALGO"]) == [
        ("NCCL_ALGO", "MyNewAlgo"), ("NCCL_PROTO", "LL")]


def test_bad_nccl_value_fails_before_the_file_is_touched_and_unchecked_lets_it_through(tmp_path, capsys):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    result = run_main(capsys, {"path": str(path), "env": {"NCCL_BUFFSIZE": "4M"}})
    assert result["failed"] and "NCCL_BUFFSIZE='4M'" in result["msg"] and result["sha256"] is None
    assert path.read_bytes() == before
    result = run_main(capsys, {"path": str(path), "env": {"NCCL_BUFFSIZE": "4M"}, "unchecked": ["NCCL_BUFFSIZE"]})
    assert result["changed"] and result["env"] == {"NCCL_BUFFSIZE": "4M"}
    assert b"NCCL_BUFFSIZE" in path.read_bytes()
    # ...but not in silence: the warning says what the check would have refused.
    [warning] = result["warnings"]
    warning = str(warning)  # ansible-core 2.19+ returns a structured warning
    assert "NCCL_BUFFSIZE='4M'" in warning and "written anyway because it is in unchecked" in warning
    # A value the check takes, named in unchecked all the same, draws no warning.
    result = run_main(capsys, {"path": str(path), "env": {"NCCL_BUFFSIZE": "4194304"}, "unchecked": ["NCCL_BUFFSIZE"]})
    # (the module's warnings are process-global: the one above may still be listed)
    assert result["changed"] and not any("4194304" in str(w) for w in result.get("warnings") or [])


# --- several files define the function (SGLang's development branch after 0.5.23) --------------------------------

# The copy in srt/entrypoints/worker_launch.py runs instead of engine.py's when SGLANG_PRESPAWN_WORKERS=1; its
# start-method call takes a variable (../shared/upstream/sglang-main/).
WORKER_SOURCE = SOURCE.replace(ANCHOR, "    mp.set_start_method(\n        envs.SGLANG_MP_START_METHOD.get(),\n"
                                       "        force=True,\n    )\n")


def make_two_file_tree(tmp_path, worker_source=WORKER_SOURCE):
    engine = make_tree(tmp_path)
    worker = engine.parent / "worker_launch.py"
    worker.write_text(worker_source)
    return engine, worker


def test_python_option_patches_every_file_that_defines_the_function(tmp_path, capsys, monkeypatch):
    engine, worker = make_two_file_tree(tmp_path)
    originals = engine.read_bytes(), worker.read_bytes()
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    result = run_main(capsys, {"python": sys.executable, "env": ENV})
    assert result["_rc"] == 0 and result["changed"]
    assert result["path"] == str(engine) and result["paths"] == [str(engine), str(worker)]
    assert [f["relative"] for f in result["files"]] == ["srt/entrypoints/engine.py", "srt/entrypoints/worker_launch.py"]
    assert [(f["changed"], f["block"], f["placement"]) for f in result["files"]] == [
        (True, "none", "start_method"), (True, "none", "start_method")]
    assert result["scan"]["files_scanned"] == 4 and result["scan"]["files_parsed"] == 2
    for path, entry in zip((engine, worker), result["files"]):
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        env = run_set_envs_and_config(str(path), {})
        assert {k: env[k] for k in ENV} == {k: str(v) for k, v in ENV.items()}
    again = run_main(capsys, {"python": sys.executable, "env": ENV})
    assert not again["changed"] and [f["block"] for f in again["files"]] == ["same", "same"]
    assert again["files"][1]["block_env"] == {k: str(v) for k, v in ENV.items()}
    other = run_main(capsys, {"python": sys.executable, "env": {"NCCL_ALGO": "Ring"}}, check_mode=True)
    assert other["changed"] and [f["block"] for f in other["files"]] == ["other", "other"]
    removed = run_main(capsys, {"python": sys.executable, "state": "absent"})
    assert removed["changed"] and (engine.read_bytes(), worker.read_bytes()) == originals


def test_check_mode_diff_lists_every_file(tmp_path, capsys, monkeypatch):
    engine, worker = make_two_file_tree(tmp_path)
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    result = run_main(capsys, {"python": sys.executable, "env": ENV, "previous_dir": str(tmp_path / "prev")},
                      check_mode=True, diff=True)
    assert [d["before_header"] for d in result["diff"]] == [str(engine), str(worker)]
    assert [f["previous_file"] for f in result["files"]] == [
        str(tmp_path / "prev" / "srt.entrypoints.engine.py.prev"), str(tmp_path / "prev" / "srt.entrypoints.worker_launch.py.prev")]
    assert not (tmp_path / "prev").exists()
    assert all("os.environ['NCCL_IB_HCA'] = 'mlx5'" in d["after"] for d in result["diff"])
    assert engine.read_text() == SOURCE and worker.read_text() == WORKER_SOURCE


def test_previous_dir_keeps_each_file_under_its_package_path(tmp_path, capsys, monkeypatch):
    engine, worker = make_two_file_tree(tmp_path)
    originals = engine.read_bytes(), worker.read_bytes()
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    prev = tmp_path / "state" / "nccl-patch-prev"
    result = run_main(capsys, {"python": sys.executable, "env": ENV, "previous_dir": str(prev)})
    assert result["_rc"] == 0 and result["previous"] is None
    assert sorted(os.listdir(prev)) == ["srt.entrypoints.engine.py.prev", "srt.entrypoints.worker_launch.py.prev"]
    for original, entry in zip(originals, result["files"]):
        with open(entry["previous_file"], "rb") as handle:
            assert handle.read() == original
        assert entry["previous_sha256"] == hashlib.sha256(original).hexdigest()


def test_one_previous_file_for_two_changing_files_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    engine, worker = make_two_file_tree(tmp_path)
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    prev = tmp_path / "engine.py.prev"
    result = run_main(capsys, {"python": sys.executable, "env": ENV, "previous_file": str(prev)})
    assert result["failed"] and "use previous_dir" in result["msg"] and "No file was changed" in result["msg"]
    assert engine.read_text() == SOURCE and worker.read_text() == WORKER_SOURCE and not prev.exists()


def test_an_ambiguous_second_file_leaves_the_first_untouched(tmp_path, capsys, monkeypatch):
    engine, worker = make_two_file_tree(tmp_path, worker_source=SOURCE.replace(ANCHOR, ANCHOR + ANCHOR))
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    result = run_main(capsys, {"python": sys.executable, "env": ENV})
    assert result["failed"] and str(worker) in result["msg"] and "2 times" in result["msg"]
    assert engine.read_text() == SOURCE
    # Every file is still judged (check.yml reads engine.py's state from this failure), in the order of paths.
    assert [f["path"] for f in result["files"]] == [str(engine), str(worker)]
    assert (result["files"][0]["block"], result["files"][0]["changed"]) == ("none", True)
    assert set(result["files"][1]) == {"path", "relative", "error"} and "2 times" in result["files"][1]["error"]


def test_a_failed_write_of_the_second_file_puts_the_first_back(tmp_path, capsys, monkeypatch):
    engine, worker = make_two_file_tree(tmp_path)
    originals = engine.read_bytes(), worker.read_bytes()
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    real_write = patch_module.write_atomic

    def failing_write(module, path, data):
        if path == str(worker):
            raise OSError(28, "No space left on device")
        return real_write(module, path, data)

    monkeypatch.setattr(patch_module, "write_atomic", failing_write)
    prev = tmp_path / "prev"
    result = run_main(capsys, {"python": sys.executable, "env": ENV, "previous_dir": str(prev)})
    assert result["failed"] and "cannot write %s" % worker in result["msg"] and "No file is changed" in result["msg"]
    assert (engine.read_bytes(), worker.read_bytes()) == originals
    # The failure result says what the files hold now and where the copies are (a rollback finds nothing to do).
    assert [f["sha256"] for f in result["files"]] == [hashlib.sha256(o).hexdigest() for o in originals]
    assert result["files"][0]["previous_file"] == str(prev / "srt.entrypoints.engine.py.prev")


def test_every_changed_file_gets_its_own_backup_and_stale_bytecode_removed(tmp_path, capsys, monkeypatch):
    engine, worker = make_two_file_tree(tmp_path)
    originals = engine.read_bytes(), worker.read_bytes()
    cache = engine.parent / "__pycache__"
    cache.mkdir()
    for stem in ("engine", "worker_launch"):
        (cache / ("%s.cpython-311.pyc" % stem)).write_bytes(b"old")
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    result = run_main(capsys, {"python": sys.executable, "env": ENV, "backup": True})
    assert result["backup_file"] == result["files"][0]["backup_file"]
    for original, entry in zip(originals, result["files"]):
        assert os.path.dirname(entry["backup_file"]) == str(engine.parent)
        with open(entry["backup_file"], "rb") as handle:
            assert handle.read() == original
    assert list(cache.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Hand-typed writes of the block's variables (issue 30, item 3) and a full disk (item 8).

SEED_EDIT = '    os.environ["NCCL_PROTO"] = "Simple"\n'


def with_seed_edit(where="after", line=SEED_EDIT):
    return SOURCE.replace(ANCHOR, ANCHOR + line) if where == "after" else SOURCE.replace(ANCHOR, line + ANCHOR)


@pytest.mark.parametrize("where", ["after", "before"])
def test_a_hand_line_setting_a_managed_variable_is_refused_naming_file_line_and_text(tmp_path, capsys, where):
    path = make_tree(tmp_path, with_seed_edit(where))
    before = path.read_bytes()
    for check in (True, False):
        result = run_main(capsys, {"path": str(path), "env": {"NCCL_PROTO": "LL"}}, check_mode=check)
        assert result["failed"] and result["changed"] is False and path.read_bytes() == before
        line = 14 if where == "after" else 13
        assert '%s:%d: os.environ["NCCL_PROTO"] = "Simple"' % (path, line) in result["msg"]
        assert "sglang_nccl_patch_hand_edits=take_over" in result["msg"] and "No file was changed" in result["msg"]
        assert ("(after mp.set_start_method(...))" in result["msg"]) is (where == "after")
        assert result["hand_edits"] == [{"path": str(path), "line": line, "text": SEED_EDIT.strip(),
                                         "names": ["NCCL_PROTO"], "after_anchor": where == "after",
                                         "action": "refused"}]
    assert os.listdir(str(path.parent)) == ["engine.py"]


def test_sglangs_own_writes_of_a_managed_variable_are_not_hand_edits(tmp_path, capsys):
    path = make_tree(tmp_path)
    result = run_main(capsys, {"path": str(path), "env": {"NCCL_CUMEM_ENABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}})
    assert result["changed"] and not result.get("failed") and result["hand_edits"] == []


def test_a_hand_line_of_another_variable_is_reported_and_left(tmp_path, capsys):
    path = make_tree(tmp_path, with_seed_edit("after"))
    result = run_main(capsys, {"path": str(path), "env": {"NCCL_ALGO": "Ring"}})
    assert result["changed"] and not result.get("failed")
    assert [(h["line"], h["action"]) for h in result["hand_edits"]] == [(14, "reported")]
    assert SEED_EDIT in path.read_text()


def test_take_over_removes_the_hand_line_into_the_backup_and_absent_puts_it_back(tmp_path, capsys):
    original = with_seed_edit("after")
    path = make_tree(tmp_path, original)
    args = {"path": str(path), "env": {"NCCL_PROTO": "LL"}, "hand_edits": "take_over", "backup": True}
    plan = run_main(capsys, args, check_mode=True)
    assert plan["changed"] and path.read_text() == original
    assert [(h["line"], h["action"]) for h in plan["hand_edits"]] == [(14, "taken_over")]
    result = run_main(capsys, args)
    assert result["changed"] and [(h["line"], h["action"]) for h in result["hand_edits"]] == [(14, "taken_over")]
    with open(result["backup_file"]) as handle:
        assert handle.read() == original
    patched = path.read_text()
    assert "Simple" not in patched.split(patch_module.END_MARKER)[1]
    # What the workers inherit: the block's value, the hand line is gone.
    assert run_set_envs_and_config(str(path), {})["NCCL_PROTO"] == "LL"
    # The same run again, even with the default refuse: the line stays taken over, nothing changes.
    again = run_main(capsys, {"path": str(path), "env": {"NCCL_PROTO": "LL"}})
    assert not again.get("failed") and not again["changed"] and path.read_text() == patched
    assert [h["action"] for h in again["hand_edits"]] == ["kept"]
    # Other values: the block is replaced, the record of the taken line kept.
    other = run_main(capsys, {"path": str(path), "env": {"NCCL_PROTO": "LL128"}})
    assert other["changed"] and run_set_envs_and_config(str(path), {})["NCCL_PROTO"] == "LL128"
    removed = run_main(capsys, {"path": str(path), "state": "absent"})
    assert removed["changed"] and path.read_text() == original


def test_a_line_that_cannot_be_taken_over_alone_is_refused_naming_it(tmp_path, capsys):
    path = make_tree(tmp_path, with_seed_edit("after", '    os.environ["NCCL_PROTO"] = "Simple"; x = 1\n'))
    before = path.read_bytes()
    result = run_main(capsys, {"path": str(path), "env": {"NCCL_PROTO": "LL"}, "hand_edits": "take_over"})
    assert result["failed"] and "cannot take over line 14" in result["msg"] and "shares its line" in result["msg"]
    assert path.read_bytes() == before


def test_space_problems_name_the_filesystem_the_bytes_needed_and_free():
    def stat_fs(directory):
        return {"device": 1 if directory == "/venv" else 2, "mount": "/" if directory == "/venv" else "/var",
                "block": 4096, "free": 200000, "inodes": 10}
    needs = [("/venv", 100000, "the patched copy of engine.py"), ("/venv", 99000, "the backup of engine.py"),
             ("/var/lib/gpufleet", 99000, "the rollback copy of engine.py")]
    problems = patch_module.space_problems(needs, stat_fs)
    # 100000 and 99000 rounded up to 4096-byte blocks (102400 + 102400) plus 65536 to spare.
    assert len(problems) == 1 and "mounted at / for the NCCL patch: it needs 270336 bytes" in problems[0]
    assert "the backup of engine.py, 99000 bytes" in problems[0] and "has 200000 bytes free" in problems[0]
    assert patch_module.space_problems(needs[:1], stat_fs) == []
    few_inodes = patch_module.space_problems(needs[:2], lambda d: dict(stat_fs(d), free=10 ** 9, inodes=1))
    assert "1 free inodes for 2 new files" in few_inodes[0]


def test_space_needs_count_the_backup_and_the_rollback_copy_only_when_written():
    entry = {"path": "/venv/sglang/srt/entrypoints/engine.py", "raw": b"x" * 10, "data": b"x" * 12}
    assert patch_module.space_needs([entry], False, lambda e: None) == [
        ("/venv/sglang/srt/entrypoints", 12, "the patched copy of engine.py")]
    assert [n[:2] for n in patch_module.space_needs([entry], True, lambda e: "/var/lib/g/prev/x.prev")] == [
        ("/venv/sglang/srt/entrypoints", 12), ("/venv/sglang/srt/entrypoints", 10), ("/var/lib/g/prev", 10)]


@pytest.mark.parametrize("check", [True, False], ids=["check-mode", "run"])
def test_a_filesystem_too_full_for_the_copy_and_the_backup_is_refused_before_any_write(tmp_path, capsys, monkeypatch,
                                                                                      check):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    real = patch_module.filesystem_of
    monkeypatch.setattr(nccl_check, "filesystem_of", lambda d: dict(real(d), free=len(before)))
    result = run_main(capsys, {"path": str(path), "env": ENV, "backup": True}, check_mode=check)
    assert result["failed"] and "not enough room on the filesystem mounted at" in result["msg"]
    assert "has %d bytes free" % len(before) in result["msg"] and "No file was changed" in result["msg"]
    assert path.read_bytes() == before and os.listdir(str(path.parent)) == ["engine.py"]


@pytest.mark.parametrize("failing", ["backup", "file"])
def test_a_write_that_hits_a_full_disk_leaves_no_temporary_file_or_backup(tmp_path, capsys, monkeypatch, failing):
    path = make_tree(tmp_path)
    before = path.read_bytes()
    real_fsync = os.fsync
    calls = []

    def fsync(fd):
        # The backup's temporary copy is synced first, then the patched copy.
        calls.append(fd)
        if len(calls) == (1 if failing == "backup" else 2):
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    result = run_main(capsys, {"path": str(path), "env": ENV, "backup": True})
    assert result["failed"] and "No space left on device" in result["msg"]
    assert "free space there and rerun; no temporary file is left" in result["msg"]
    assert "become" not in result["msg"]
    assert path.read_bytes() == before
    assert os.listdir(str(path.parent)) == ["engine.py"]
    assert result["files"][0]["backup_file"] is None


def test_a_hand_line_below_gpufleets_block_is_named_by_its_line_in_the_file_now(tmp_path, capsys):
    # The usual case on a fleet: engine.py already carries the block when someone types a line after the call.
    patched = patch_module.plan_patch(SOURCE, [("NCCL_PROTO", "LL")], "present")["after"]
    lines = patched.splitlines(True)
    anchor = lines.index(ANCHOR)
    lines.insert(anchor + 1, SEED_EDIT)
    path = make_tree(tmp_path, "".join(lines))
    result = run_main(capsys, {"path": str(path), "env": {"NCCL_PROTO": "LL"}}, check_mode=True)
    assert result["failed"] and result["hand_edits"][0]["line"] == anchor + 2
    assert '%s:%d: os.environ["NCCL_PROTO"] = "Simple"' % (path, anchor + 2) in result["msg"]
    assert path.read_text().splitlines()[anchor + 1] == SEED_EDIT.rstrip("\n")
    taken = run_main(capsys, {"path": str(path), "env": {"NCCL_PROTO": "LL"}, "hand_edits": "take_over"})
    assert [(h["line"], h["action"]) for h in taken["hand_edits"]] == [(anchor + 2, "taken_over")]
    assert run_main(capsys, {"path": str(path), "state": "absent"})["changed"]
    assert path.read_text() == with_seed_edit("after")
