"""sglang_server_args_info main(): locating sglang for an interpreter, static/help/auto modes, results shape."""
import argparse
import json
import os
import stat
import sys
import textwrap

import pytest

from ansible.module_utils.testing import patch_module_args
from gpu_module_harness import load_module, sglang_on_path
from support.sglang_wheels import sglang_package_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EAGLE3 = {
    "model-path": "/models/target", "speculative-draft-model-path": "/models/draft",
    "speculative-algorithm": "EAGLE3", "speculative-num-steps": 3, "speculative-eagle-topk": 1,
    "speculative-num-draft-tokens": 4, "tp": 8, "trust-remote-code": True,
}


args_info = load_module("sglang_server_args_info")


def run_main(args, capsys):
    with patch_module_args(args):
        with pytest.raises(SystemExit) as exc:
            args_info.main()
    return exc.value.code, json.loads(capsys.readouterr().out)


@pytest.mark.realrelease
def test_python_whose_path_has_the_release_is_located_and_its_version_read(monkeypatch, capsys):
    pkg = sglang_package_dir("0.5.23")
    # find_spec("sglang") in a child interpreter finds the extracted wheel through PYTHONPATH
    sglang_on_path(monkeypatch, str(pkg.parent))
    rc, out = run_main({"python": sys.executable, "launch_args": EAGLE3, "host": "127.0.0.1", "port": 30000},
                       capsys)
    assert rc == 0, out
    assert out["sglang_version"] == "0.5.23"
    assert os.path.realpath(out["sglang_path"]) == os.path.realpath(str(pkg))
    assert out["valid"] is True and out["errors"] == [] and out["changed"] is False
    assert out["mode_used"] == "static" and out["style"] == "dataclass"
    assert out["resolved"]["tp"] == "--tp-size"
    assert out["argv"][-4:] == ["--host", "127.0.0.1", "--port", "30000"]
    assert any(f.endswith("arg_groups/fields/spec.py") for f in out["source_files"])


@pytest.mark.realrelease
@pytest.mark.parametrize("version", ["0.4.6", "0.5.20"])
def test_invalid_flags_are_returned_not_raised(version, capsys):
    pkg = str(sglang_package_dir(version))
    bad = dict(EAGLE3, **{"speculative-algorithm": "FOO", "tp": "eight", "no-such-flag": 1})
    rc, out = run_main({"package_dir": pkg, "launch_args": bad}, capsys)
    assert rc == 0
    assert out["valid"] is False and out["argv"] == []
    assert sorted(e["flag"] for e in out["errors"]) == ["--no-such-flag", "--speculative-algorithm", "--tp"]
    assert out["sglang_version"] == version


@pytest.mark.realrelease
def test_plugin_speculative_algorithm_can_be_allowed(capsys):
    pkg = str(sglang_package_dir("0.5.23"))
    args = dict(EAGLE3, **{"speculative-algorithm": "MYSPEC"})
    rc, out = run_main({"package_dir": pkg, "launch_args": args}, capsys)
    assert out["valid"] is False
    rc, out = run_main({"package_dir": pkg, "launch_args": args, "extra_speculative_algorithms": ["myspec"]},
                       capsys)
    assert out["valid"] is True, out["errors"]


def test_python_without_sglang_fails_saying_what_to_set(tmp_path, monkeypatch, capsys):
    sglang_on_path(monkeypatch, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rc, out = run_main({"python": sys.executable, "launch_args": {}}, capsys)
    assert rc == 1
    assert "sglang is not installed for %s" % sys.executable in out["msg"]
    assert "sglang_python" in out["msg"]


def test_interpreter_that_cannot_run_fails_with_rc(tmp_path, capsys):
    rc, out = run_main({"python": str(tmp_path / "missing-python"), "launch_args": {}}, capsys)
    assert rc == 1 and out["failed"] is True


def test_package_dir_without_server_args_fails(tmp_path, capsys):
    rc, out = run_main({"package_dir": str(tmp_path), "launch_args": {}}, capsys)
    assert rc == 1 and "no srt/server_args.py" in out["msg"]


def test_neither_python_nor_package_dir_is_a_spec_error(capsys):
    rc, out = run_main({"launch_args": {}}, capsys)
    assert rc == 1 and "one of the following is required: python, package_dir" in out["msg"]


def fake_release(tmp_path, server_args_source):
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text('__version__ = "9.9.9"\n')
    (pkg / "srt" / "server_args.py").write_text(server_args_source)
    return pkg


def fake_python(tmp_path, help_text):
    """An interpreter stand-in: `-m sglang.launch_server --help` prints argparse help, the rest runs Python."""
    helpfile = tmp_path / "help.txt"
    helpfile.write_text(help_text)
    script = tmp_path / "python"
    script.write_text(textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ] && [ "$3" = "--help" ]; then
          cat %s; exit 0
        fi
        exec %s "$@"
        """ % (helpfile, sys.executable)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def argparse_help():
    parser = argparse.ArgumentParser(prog="sglang serve")
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int)
    parser.add_argument("--speculative-algorithm", choices=["EAGLE", "EAGLE3"])
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    os.environ["COLUMNS"] = "100000"
    try:
        return parser.format_help()
    finally:
        del os.environ["COLUMNS"]


def test_auto_falls_back_to_help_when_the_source_has_no_definitions(tmp_path, monkeypatch, capsys):
    pkg = fake_release(tmp_path, "# a future layout this reader does not know\n")
    sglang_on_path(monkeypatch, str(pkg.parent))
    python = fake_python(tmp_path, argparse_help())
    args = {"model-path": "/m", "tp": 2, "trust-remote-code": True, "speculative-algorithm": "EAGLE3"}
    rc, out = run_main({"python": python, "launch_args": args, "port": 31000}, capsys)
    assert rc == 0, out
    assert out["mode_used"] == "help" and out["style"] == "help", out["errors"]
    assert out["sglang_version"] == "9.9.9"
    assert out["valid"], out["errors"]
    assert out["argv"] == ["--model-path", "/m", "--tp-size", "2", "--trust-remote-code",
                           "--speculative-algorithm", "EAGLE3", "--port", "31000"]
    rc, out = run_main({"python": python, "launch_args": dict(args, **{"speculative-algorithm": "FOO"})}, capsys)
    assert out["valid"] is False and "invalid choice: 'FOO'" in out["errors"][0]["message"]


def test_auto_falls_back_to_help_when_server_args_is_unparsable(tmp_path, monkeypatch, capsys):
    pkg = fake_release(tmp_path, "def broken(:\n")
    sglang_on_path(monkeypatch, str(pkg.parent))
    python = fake_python(tmp_path, argparse_help())
    rc, out = run_main({"python": python, "launch_args": {"model-path": "/m", "tp": 2}}, capsys)
    assert rc == 0 and out["mode_used"] == "help" and out["valid"] is True
    # 2.19+ returns warnings as structured summaries, older releases as strings: look at the text.
    warnings = json.dumps(out["warnings"])
    assert "static reading failed" in warnings and "cannot parse" in warnings
    rc, out = run_main({"python": python, "mode": "static", "launch_args": {"model-path": "/m"}}, capsys)
    assert rc == 1 and "cannot parse" in out["msg"]


def test_static_mode_refuses_a_source_without_definitions(tmp_path, capsys):
    pkg = fake_release(tmp_path, "x = 1\n")
    rc, out = run_main({"package_dir": str(pkg), "mode": "static"}, capsys)
    assert rc == 1 and "no argument definitions recognised" in out["msg"] and "mode=help" in out["msg"]


def test_help_mode_that_cannot_import_sglang_fails_with_its_output(tmp_path, monkeypatch, capsys):
    pkg = fake_release(tmp_path, "x = 1\n")
    sglang_on_path(monkeypatch, str(pkg.parent))
    rc, out = run_main({"python": sys.executable, "mode": "help"}, capsys)
    assert rc == 1
    assert "help mode imports sglang" in out["msg"]
    assert "sglang.launch_server" in out["stderr"]


@pytest.mark.realrelease
def test_misspelt_parser_is_an_error_and_a_converted_value_is_listed_as_given_unchecked(capsys):
    pkg = str(sglang_package_dir("0.5.23"))
    args = dict(EAGLE3, **{"tool-call-parser": "kimi_k25", "context-length": "128k"})
    rc, out = run_main({"package_dir": pkg, "launch_args": args}, capsys)
    assert rc == 0 and out["valid"] is False and out["argv"] == []
    (error,) = out["errors"]
    assert error["flag"] == "--tool-call-parser"
    assert error["message"].startswith("argument --tool-call-parser: invalid choice: 'kimi_k25' (choose from 'auto', ")
    assert "did you mean 'kimi_k2'" in error["message"]
    assert any(f.endswith("function_call/parser_names.py") for f in out["source_files"])
    assert out["given_unchecked"] == [{
        "flag": "--context-length", "option": "--context-length",
        "why": "SGLang converts the value with human_readable_int, which preflight does not run",
        "message": "--context-length (SGLang converts the value with human_readable_int, which preflight does "
                   "not run)"}]
    assert out["options_unchecked"] == ["--context-length"]
    rc, out = run_main({"package_dir": pkg, "launch_args": dict(args, **{"tool-call-parser": "kimi_k2"})}, capsys)
    assert out["valid"] is True, out["errors"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", ["0.5.12", "0.5.12.post1"])
def test_nextn_passes_preflight_on_0_5_12(version, capsys):
    pkg = str(sglang_package_dir(version))
    rc, out = run_main({"package_dir": pkg, "launch_args": dict(EAGLE3, **{"speculative-algorithm": "NEXTN"})},
                       capsys)
    assert out["valid"] is True, out["errors"]
    assert out["given_unchecked"] == []


DYNAMIC_CHOICES = textwrap.dedent('''\
    import argparse

    BACKENDS = ["triton", "fa3"]

    def add_backend_choices(choices):
        BACKENDS.extend(choices)

    class ServerArgs:
        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--model-path", type=str, required=True)
            parser.add_argument("--attention-backend", choices=BACKENDS)
            parser.add_argument("--hook", choices=list(load_hooks()))
    ''')


def test_given_unchecked_names_the_flag_whose_choices_are_dynamic(tmp_path, capsys):
    pkg = fake_release(tmp_path, DYNAMIC_CHOICES)
    args = {"model-path": "/m", "hook": "mine", "attention-backend": "fa3"}
    rc, out = run_main({"package_dir": str(pkg), "launch_args": args}, capsys)
    assert rc == 0 and out["valid"] is True, out["errors"]
    assert out["given_unchecked"] == [{
        "flag": "--hook", "option": "--hook", "why": "choices computed at run time (list(load_hooks()))",
        "message": "--hook (choices computed at run time (list(load_hooks())))"}]
    assert out["options_unchecked"] == ["--hook"]


def test_extra_choices_accept_a_name_a_plugin_adds(tmp_path, capsys):
    pkg = fake_release(tmp_path, DYNAMIC_CHOICES)
    args = {"model-path": "/m", "attention-backend": "npu_attn"}
    rc, out = run_main({"package_dir": str(pkg), "launch_args": args}, capsys)
    assert out["valid"] is False
    assert "add_backend_choices() (srt/server_args.py)" in out["errors"][0]["message"]
    rc, out = run_main({"package_dir": str(pkg), "launch_args": args,
                        "extra_choices": {"attention-backend": ["npu_attn"]}}, capsys)
    assert out["valid"] is True, out["errors"]
    assert out["argv"] == ["--model-path", "/m", "--attention-backend", "npu_attn"]
