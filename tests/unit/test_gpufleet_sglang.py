"""gpufleet_sglang: finding sglang, its release and _set_envs_and_config without importing sglang."""
import ast
import os
import sys
import textwrap

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import (
    ANCHOR_TEXT,
    SGLangLocateError,
    find_anchor,
    find_set_envs_file,
    locate_argv,
    locate_sglang,
    package_dir_of_file,
    parse_locate_output,
    read_sglang_version,
    split_lines,
)

FUNCTION = textwrap.dedent('''\
    import os
    import multiprocessing as mp


    def _set_envs_and_config(server_args):
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"

        # Set mp start method
        mp.set_start_method("spawn", force=True)
    ''')

# What 0.4.1.post7 .. 0.4.5 ship as srt/server.py: re-exports only.
SHIM = "from sglang.srt.entrypoints.engine import Engine, _set_envs_and_config\n"

# Importing this package would fail loudly: locating it must not import it.
INIT_THAT_MUST_NOT_RUN = "raise SystemExit('sglang was imported')\n"


def make_package(root, files, version_py='__version__ = "0.5.5"\n'):
    """An sglang package under ``root`` (a site-packages stand-in) with ``files`` (relative path -> text)."""
    pkg = root / "sglang"
    (pkg / "srt" / "entrypoints").mkdir(parents=True)
    (pkg / "__init__.py").write_text(INIT_THAT_MUST_NOT_RUN)
    if version_py is not None:
        (pkg / "version.py").write_text(version_py)
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    return pkg


def test_split_lines_numbers_lines_like_the_parser():
    # A form feed and U+2028 inside a line are not line breaks for Python's tokenizer.
    source = "a = 1\r\nb = '\x0c\u2028'\rc = 3\nd = 4"
    lines = split_lines(source)
    assert "".join(lines) == source
    tree = ast.parse(source)
    assert [lines[n.lineno - 1].split("=")[0].strip() for n in tree.body] == ["a", "b", "c", "d"]


def test_version_read_from_generated_version_file_with_chained_assignment(tmp_path):
    # 0.5.10+ ships sglang/_version.py with `__version__ = version = '0.5.23'` and a try/except version.py.
    pkg = make_package(tmp_path, {}, version_py="try:\n    from sglang._version import __version__\nexcept ImportError:\n    pass\n")
    (pkg / "_version.py").write_text("__version__: str\n__version__ = version = '0.5.23'\n")
    assert read_sglang_version(str(pkg)) == ("0.5.23", str(pkg / "_version.py"))


def test_version_read_from_metadata_when_package_has_no_literal(tmp_path):
    pkg = make_package(tmp_path, {}, version_py=None)
    meta = tmp_path / "sglang-0.5.11.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.4\nName: sglang\nVersion: 0.5.11\n\nVersion: 9.9\n")
    assert read_sglang_version(str(pkg)) == ("0.5.11", str(meta / "METADATA"))


def test_version_is_none_when_nothing_names_it(tmp_path):
    pkg = make_package(tmp_path, {}, version_py="__version__ = compute()\n")
    assert read_sglang_version(str(pkg)) == (None, None)


def test_defining_file_wins_over_reexport_shim(tmp_path):
    pkg = make_package(tmp_path, {"srt/entrypoints/engine.py": FUNCTION, "srt/server.py": SHIM})
    assert find_set_envs_file(str(pkg)) == str(pkg / "srt" / "entrypoints" / "engine.py")


def test_old_layout_uses_server_py(tmp_path):
    pkg = make_package(tmp_path, {"srt/server.py": FUNCTION})
    assert find_set_envs_file(str(pkg)) == str(pkg / "srt" / "server.py")


def test_missing_function_error_names_files_and_version(tmp_path):
    pkg = make_package(tmp_path, {"srt/server.py": SHIM})
    with pytest.raises(SGLangLocateError) as err:
        find_set_envs_file(str(pkg))
    msg = str(err.value)
    assert "0.5.5" in msg and "_set_envs_and_config" in msg
    assert str(pkg / "srt" / "server.py") in msg and "engine.py (missing)" in msg


def test_anchor_found_on_syntax_not_spelling():
    source = FUNCTION.replace('mp.set_start_method("spawn", force=True)', "mp.set_start_method('spawn', force = True)")
    found = find_anchor(source)
    assert found == {"function_line": 5, "anchor_line": 9, "col_offset": 4}


@pytest.mark.parametrize("source, expected", [
    ("import os\n", "def _set_envs_and_config() not found"),
    (FUNCTION.replace('mp.set_start_method("spawn", force=True)', 'mp.set_start_method("fork", force=True)'),
     "statement %s not found" % ANCHOR_TEXT),
    (FUNCTION.replace('mp.set_start_method("spawn", force=True)',
                      'mp.set_start_method("spawn", force=True)\n    mp.set_start_method("spawn", force=True)'),
     "appears 2 times"),
    (FUNCTION.replace('    mp.set_start_method("spawn", force=True)',
                      '    if True: mp.set_start_method("spawn", force=True)'),
     "does not start its own line"),
    (FUNCTION + "\n\n" + FUNCTION.split("\n\n\n")[1], "appears 2 times"),
], ids=["no-function", "no-anchor", "anchor-twice", "anchor-not-own-line", "function-twice"])
def test_anchor_problems_are_reported(source, expected):
    with pytest.raises(SGLangLocateError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        find_anchor(source)


def test_anchor_outside_the_function_does_not_count():
    source = FUNCTION.replace('    mp.set_start_method("spawn", force=True)', "    pass") + \
        '\nmp.set_start_method("spawn", force=True)\n'
    with pytest.raises(SGLangLocateError, match="not found inside"):
        find_anchor(source)


def test_locate_finds_package_through_interpreter_without_importing_it(tmp_path, monkeypatch):
    site = tmp_path / "site"
    pkg = make_package(site, {"srt/entrypoints/engine.py": FUNCTION, "srt/server.py": SHIM})
    monkeypatch.setenv("PYTHONPATH", str(site))
    found = locate_sglang(python=sys.executable)
    assert found["package_dir"] == str(pkg)
    assert found["path"] == str(pkg / "srt" / "entrypoints" / "engine.py")
    assert found["version"] == "0.5.5"
    assert found["python_version"] == "%d.%d.%d" % sys.version_info[:3]


def test_locate_ignores_sglang_folder_in_current_directory(tmp_path, monkeypatch):
    decoy = tmp_path / "cwd"
    make_package(decoy, {"srt/server.py": FUNCTION})
    monkeypatch.chdir(decoy)
    calls = []

    def run_here(argv):
        # Run in the decoy directory on purpose: the script itself must drop '' from sys.path.
        import subprocess
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(decoy),
                              env=dict(os.environ, PYTHONPATH=""))
        calls.append(argv)
        return proc.returncode, proc.stdout, proc.stderr

    with pytest.raises(SGLangLocateError, match="not installed"):
        locate_sglang(python=sys.executable, run=run_here)
    assert calls == [locate_argv(sys.executable)]


def test_locate_reports_interpreter_without_sglang(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(SGLangLocateError, match="sglang is not installed for %s" % sys.executable):
        locate_sglang(python=sys.executable)


def test_locate_reports_interpreter_that_cannot_run(tmp_path):
    missing = str(tmp_path / "no-such-python")
    with pytest.raises(SGLangLocateError) as err:
        locate_sglang(python=missing)
    assert missing in str(err.value) and err.value.rc != 0


def test_locate_by_path_reads_version_of_enclosing_package(tmp_path):
    pkg = make_package(tmp_path, {"srt/server.py": FUNCTION}, version_py='__version__ = "0.4.1.post6"\n')
    found = locate_sglang(path=str(pkg / "srt" / "server.py"))
    assert (found["path"], found["package_dir"], found["version"]) == (
        str(pkg / "srt" / "server.py"), str(pkg), "0.4.1.post6")
    assert package_dir_of_file(str(tmp_path / "elsewhere.py")) is None


def test_locate_needs_exactly_one_of_python_and_path(tmp_path):
    with pytest.raises(ValueError):
        locate_sglang()
    with pytest.raises(ValueError):
        locate_sglang(python=sys.executable, path=str(tmp_path))


def test_locate_output_without_json_is_an_error():
    with pytest.raises(SGLangLocateError, match="could not read"):
        parse_locate_output("Traceback ...\n")
    assert parse_locate_output('noise\n{"locations": ["/x/sglang"]}\n') == {"locations": ["/x/sglang"]}


def test_managed_block_lines_found_absent_or_malformed():
    from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import MANAGED_BEGIN, MANAGED_END, managed_block_lines
    patched = FUNCTION.replace("    mp.set_start_method", "    %s\n    os.environ['A'] = '1'\n    %s\n    mp.set_start_method"
                               % (MANAGED_BEGIN, MANAGED_END))
    assert managed_block_lines(patched) == (9, 11)
    assert managed_block_lines(FUNCTION) is None
    with pytest.raises(SGLangLocateError, match=r"BEGIN on line\(s\) 9, END on line\(s\) none"):
        managed_block_lines(patched.replace(MANAGED_END, "# gone"))


def test_locate_package_needs_no_set_envs_file(tmp_path, monkeypatch):
    # preflight modules (sglang_server_args_info) only need the package and its release.
    from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import locate_package
    site = tmp_path / "site"
    pkg = make_package(site, {"srt/server.py": SHIM})
    monkeypatch.setenv("PYTHONPATH", str(site))
    found = locate_package(sys.executable)
    assert (found["package_dir"], found["version"]) == (str(pkg), "0.5.5")
    with pytest.raises(SGLangLocateError, match="no file of sglang 0.5.5 defines"):
        locate_sglang(python=sys.executable)


def test_locate_falls_back_to_installed_metadata_version(tmp_path, monkeypatch):
    # Editable installs: the package has no literal version and no dist-info beside it; the interpreter's
    # importlib.metadata (a dist-info elsewhere on sys.path) names the release.
    src = tmp_path / "src"
    make_package(src, {"srt/entrypoints/engine.py": FUNCTION}, version_py=None)
    meta_dir = tmp_path / "meta"
    (meta_dir / "sglang-0.5.23.dist-info").mkdir(parents=True)
    (meta_dir / "sglang-0.5.23.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(src), str(meta_dir)]))
    found = locate_sglang(python=sys.executable)
    assert (found["version"], found["version_source"]) == ("0.5.23", "importlib.metadata")
