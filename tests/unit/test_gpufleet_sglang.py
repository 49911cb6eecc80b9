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
    find_set_envs_files,
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
UPSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "upstream",
                        "sglang-main")

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


def test_missing_function_error_names_what_only_names_it_and_the_version(tmp_path):
    pkg = make_package(tmp_path, {"srt/server.py": SHIM})
    with pytest.raises(SGLangLocateError) as err:
        find_set_envs_file(str(pkg))
    msg = str(err.value)
    assert "0.5.5" in msg and "_set_envs_and_config" in msg and "searched 3 .py files" in msg
    assert "these only name it: %s" % (pkg / "srt" / "server.py") in msg


def test_every_defining_file_of_the_package_is_found_engine_first(tmp_path):
    # SGLang's development branch after 0.5.23: a copy in worker_launch.py (SGLANG_PRESPAWN_WORKERS=1); the search
    # covers the whole package, not a list of names, and a file that only names the function is left out.
    pkg = make_package(tmp_path, {"srt/entrypoints/engine.py": FUNCTION, "srt/entrypoints/worker_launch.py": FUNCTION,
                                  "srt/server.py": SHIM, "srt/entrypoints/prespawn.py": "# calls _set_envs_and_config\n"})
    (pkg / "srt" / "aaa").mkdir()
    (pkg / "srt" / "aaa" / "copy.py").write_text(FUNCTION)
    (pkg / "srt" / "__pycache__").mkdir()
    (pkg / "srt" / "__pycache__" / "cached.py").write_text(FUNCTION)
    stats = {}
    assert find_set_envs_files(str(pkg), stats=stats) == [
        str(pkg / "srt" / "entrypoints" / "engine.py"), str(pkg / "srt" / "aaa" / "copy.py"),
        str(pkg / "srt" / "entrypoints" / "worker_launch.py")]
    # Only the three files whose bytes hold "def _set_envs_and_config" are parsed; __pycache__ is not searched.
    assert stats["files_scanned"] == 7 and stats["files_parsed"] == 3 and stats["scan_ms"] >= 0


def test_sglang_test_helpers_are_not_searched(tmp_path):
    # sglang/test/ ships in the wheel and never runs in a server: a stub there must neither be patched nor block.
    pkg = make_package(tmp_path, {"srt/entrypoints/engine.py": FUNCTION})
    (pkg / "test").mkdir()
    (pkg / "test" / "fake_envs_helper.py").write_text("def _set_envs_and_config(server_args): pass\n")
    (pkg / "srt" / "tests").mkdir()
    (pkg / "srt" / "tests" / "stub.py").write_text(FUNCTION)
    assert find_set_envs_files(str(pkg)) == [str(pkg / "srt" / "entrypoints" / "engine.py")]


def test_a_file_that_only_names_the_function_need_not_parse(tmp_path):
    pkg = make_package(tmp_path, {"srt/entrypoints/engine.py": FUNCTION,
                                  "srt/tmpl_broken.py": "# see _set_envs_and_config\n{{ template }} :\n"})
    assert find_set_envs_files(str(pkg)) == [str(pkg / "srt" / "entrypoints" / "engine.py")]


def test_a_linked_file_is_found_as_the_file_it_names_and_only_once(tmp_path):
    # An editable install may link a file into the package: the target is what gets patched (a rename over the link
    # would replace the link with a copy), and a link and its target are one file.
    source = tmp_path / "checkout" / "engine.py"
    source.parent.mkdir()
    source.write_text(FUNCTION)
    pkg = make_package(tmp_path, {})
    (pkg / "srt" / "entrypoints" / "engine.py").symlink_to(source)
    (pkg / "srt" / "again.py").symlink_to(source)
    assert find_set_envs_files(str(pkg)) == [str(source)]


def test_a_file_naming_the_function_that_does_not_parse_is_refused(tmp_path):
    # It may be the copy that defines it: patching only the others would leave its workers without the values.
    pkg = make_package(tmp_path, {"srt/entrypoints/engine.py": FUNCTION,
                                  "srt/entrypoints/worker_launch.py": "def _set_envs_and_config(:\n"})
    with pytest.raises(SGLangLocateError, match=r"cannot parse .*worker_launch\.py.* seems to define") as err:
        find_set_envs_files(str(pkg))
    assert sys.executable in str(err.value)


def test_the_whole_file_is_read_beyond_one_read_call(tmp_path):
    # The name may sit past the first MiB of a large file.
    pkg = make_package(tmp_path, {"srt/big.py": "# " + "x" * (3 << 20) + "\n" + FUNCTION})
    assert find_set_envs_files(str(pkg)) == [str(pkg / "srt" / "big.py")]


def test_anchor_found_on_syntax_not_spelling():
    source = FUNCTION.replace('mp.set_start_method("spawn", force=True)', "mp.set_start_method('spawn', force = True)")
    found = find_anchor(source)
    assert found == {"function_line": 5, "anchor_line": 9, "statement_line": 9, "indent": "    ", "col_offset": 4,
                     "placement": "start_method"}


START = 'mp.set_start_method("spawn", force=True)'


@pytest.mark.parametrize("call, line", [
    # SGLang's development branch after 0.5.23 (../shared/upstream/sglang-main/engine.py)
    ("mp.set_start_method(envs.SGLANG_MP_START_METHOD.get(), force=True)", 9),
    # a later commit: a variable, possibly switched before the call
    ("start_method = envs.SGLANG_MP_START_METHOD.get()\n    if server_args.enable_memory_saver:\n"
     "        start_method = \"spawn\"\n    mp.set_start_method(start_method, force=True)", 12),
    # line breaks, comments and trailing commas inside the call
    ("mp.set_start_method(\n        # forkserver when start_early() prepared one\n        method,\n"
     "        force=True,  # replace a context set by a plugin\n    )", 9),
    ("mp.set_start_method(method)", 9),
    ("multiprocessing.set_start_method('forkserver')", 9),
    ("torch.multiprocessing.set_start_method(\"spawn\", force=True)", 9),
    # a comment on the line before and a blank line between
    ("# Set mp start method (forkserver when start_early() prepared one).\n\n    mp.set_start_method('spawn')", 11),
], ids=["envs-get", "variable", "line-breaks", "no-force", "multiprocessing", "torch-mp", "comment-blank"])
def test_block_goes_before_the_start_method_call_whatever_its_arguments(call, line):
    found = find_anchor(FUNCTION.replace(START, call))
    assert (found["placement"], found["anchor_line"], found["indent"]) == ("start_method", line, "    ")


def test_a_function_without_the_call_gets_the_block_at_the_end_of_its_body():
    source = FUNCTION.replace("    " + START, "    if x:\n        y = (1,\n             2)\n    # trailing comment") + \
        "\n\ndef other():\n    pass\n"
    found = find_anchor(source)
    # After the last statement's last line (the tuple ends on line 11), before the comment.
    assert (found["placement"], found["anchor_line"], found["statement_line"]) == ("end_of_body", 12, 9)


def test_a_final_return_keeps_the_block_before_it():
    found = find_anchor(FUNCTION.replace(START, "return None"))
    assert (found["placement"], found["anchor_line"]) == ("final_return", 9)


def test_a_call_inside_a_nested_function_does_not_count():
    source = FUNCTION.replace("    " + START, "    def later():\n        mp.set_start_method('fork')\n    later_ok = 1")
    found = find_anchor(source)
    assert found["placement"] == "end_of_body"


@pytest.mark.parametrize("source, expected", [
    ("import os\n", r"def _set_envs_and_config\(\) not found"),
    (FUNCTION.replace(START, START + "\n    " + START), r"calls mp.set_start_method\(...\) 2 times \(lines 9, 10\)"),
    (FUNCTION.replace("    " + START, "    if True: " + START), "is not a statement of its own .* the if statement on line 9"),
    (FUNCTION.replace("    " + START, "    if fast:\n        " + START), "line 10 is not a statement of its own .* if"),
    (FUNCTION.replace("    " + START, "    try:\n        %s\n    except RuntimeError:\n        pass" % START), "try statement"),
    (FUNCTION.replace("    " + START, "    ctx = " + START), "assign statement on line 9"),
    (FUNCTION.replace("    " + START, "    x = 1; " + START), "does not start its own line"),
    (FUNCTION.replace("    " + START, "    if early:\n        return\n    " + START), "return on line 10 before line 11"),
    (FUNCTION.replace("    " + START, "    for i in y:\n        return i\n    z = 1"), "return on line 10 before line 12"),
    (FUNCTION.replace("\n    " + START + "\n", "\n    z = 1"), "ends the file on line 9 without a line break"),
    ("def _set_envs_and_config(a): x = 1\n", "does not start its own line"),
    (FUNCTION + "\n\n" + FUNCTION.split("\n\n\n")[1], "appears 2 times"),
], ids=["no-function", "call-twice", "call-in-if-same-line", "call-in-branch", "call-in-try", "call-in-assignment",
        "call-after-semicolon", "early-return", "return-in-loop", "no-final-newline", "one-line-def", "function-twice"])
def test_ambiguous_shapes_are_refused_naming_the_line(source, expected):
    with pytest.raises(SGLangLocateError, match=expected):
        find_anchor(source)


def test_a_call_outside_the_function_does_not_count():
    source = FUNCTION.replace('    mp.set_start_method("spawn", force=True)', "    pass") + \
        '\nmp.set_start_method("spawn", force=True)\n'
    found = find_anchor(source)
    assert (found["placement"], found["anchor_line"]) == ("end_of_body", 10)


@pytest.mark.parametrize("name", ["engine.py", "worker_launch.py"])
def test_upstream_development_files_anchor_before_their_start_method_call(name):
    # Unmodified files of SGLang's development branch after 0.5.23 (../shared/upstream/sglang-main/SOURCE.md).
    path = os.path.join(UPSTREAM, name)
    if not os.path.exists(path):
        pytest.skip("../shared/upstream/sglang-main is not beside this checkout")
    with open(path) as handle:
        source = handle.read()
    found = find_anchor(source, filename=path)
    line = split_lines(source)[found["anchor_line"] - 1]
    assert found["placement"] == "start_method"
    assert line.strip() == "mp.set_start_method(envs.SGLANG_MP_START_METHOD.get(), force=True)"


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


# --- the module's own interpreter: SGLang found in this process (locate_package(here=True)) ---------------------

def test_same_interpreter_is_the_same_file_and_the_same_virtualenv(tmp_path):
    from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import same_interpreter
    real = os.path.realpath(sys.executable)
    assert same_interpreter(real, executable=real)
    link = tmp_path / "bin" / "python3"
    link.parent.mkdir()
    link.symlink_to(real)
    # A link outside any virtualenv starts the same interpreter with the same search path.
    assert same_interpreter(str(link), executable=real)
    # A virtualenv's python links to the same file, but starts in another environment (its pyvenv.cfg).
    (tmp_path / "pyvenv.cfg").write_text("home = %s\n" % os.path.dirname(real))
    assert not same_interpreter(str(link), executable=real)
    assert not same_interpreter(str(tmp_path / "no-such-python"), executable=real)
    assert not same_interpreter("", executable=real) and not same_interpreter(real, executable="")


def test_in_process_locate_answers_as_the_started_interpreter_does(tmp_path, monkeypatch):
    from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import locate_package
    site = tmp_path / "site"
    pkg = make_package(site, {"srt/entrypoints/engine.py": FUNCTION})
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.syspath_prepend(str(site))
    started = []

    def run(argv):
        started.append(argv)
        import subprocess
        proc = subprocess.run(argv, capture_output=True, text=True, cwd="/")
        return proc.returncode, proc.stdout, proc.stderr

    here = locate_package(sys.executable, run=run, here=True)
    assert started == [] and here["located"] == "in_process"
    there = locate_package(sys.executable, run=run)
    assert started == [locate_argv(sys.executable)] and there["located"] == "interpreter"
    assert dict(here, located=None) == dict(there, located=None)
    assert here["package_dir"] == str(pkg) and here["version"] == "0.5.5"
    # Another interpreter (a virtualenv's, say) is started, here=True or not.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = %s\n" % os.path.dirname(os.path.realpath(sys.executable)))
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    other = locate_package(str(venv / "bin" / "python"), run=run, here=True)
    assert started[-1] == locate_argv(str(venv / "bin" / "python")) and other["located"] == "interpreter"
    assert other["package_dir"] == str(pkg)  # through PYTHONPATH, which that interpreter was started with


def test_in_process_locate_skips_the_current_directory_and_reads_metadata_only_when_the_files_name_no_release(
        tmp_path, monkeypatch):
    from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import locate_package
    decoy = tmp_path / "cwd"
    make_package(decoy, {"srt/server.py": FUNCTION})
    monkeypatch.chdir(decoy)
    monkeypatch.syspath_prepend("")
    with pytest.raises(SGLangLocateError, match="not installed"):
        locate_package(sys.executable, here=True)
    src, meta = tmp_path / "src", tmp_path / "meta"
    make_package(src, {"srt/entrypoints/engine.py": FUNCTION}, version_py=None)
    (meta / "sglang-0.5.23.dist-info").mkdir(parents=True)
    (meta / "sglang-0.5.23.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    monkeypatch.syspath_prepend(str(meta))
    monkeypatch.syspath_prepend(str(src))
    found = locate_package(sys.executable, here=True)
    assert (found["version"], found["version_source"], found["located"]) == ("0.5.23", "importlib.metadata", "in_process")
