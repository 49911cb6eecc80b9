"""Static reading of SGLang's launch options and argparse's rules (gpufleet_sglang_args).

Release-level tests read the real wheels from PyPI (marker ``realrelease``); the rest use tiny source trees
written here that copy the two definition styles found in those wheels.
"""
import argparse
import functools
import textwrap

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_sglang_args as sa
from support.sglang_wheels import sglang_package_dir

RELEASES = ["0.4.6", "0.5.4", "0.5.14", "0.5.20", "0.5.23"]
# Which definition style each release uses (checked by reading the wheels: 0.5.13 is the last add_argument one).
STYLE = {"0.4.6": "add_argument", "0.5.4": "add_argument", "0.5.14": "dataclass", "0.5.20": "dataclass",
         "0.5.23": "dataclass"}

EAGLE3 = {
    "model-path": "/models/target",
    "speculative-draft-model-path": "/models/draft",
    "speculative-algorithm": "EAGLE3",
    "speculative-num-steps": 3,
    "speculative-eagle-topk": 1,
    "speculative-num-draft-tokens": 4,
    "tp-size": 8,
    "trust-remote-code": True,
}


@functools.lru_cache(maxsize=None)
def release(version):
    # Cached: a release is read once per test session (callers only read the options, never change them).
    pkg = sglang_package_dir(version)
    static = sa.read_static(str(pkg))
    known = {"--speculative-algorithm": sa.read_speculative_algorithms(str(pkg))}
    return static, known


def check(version, launch_args, **kw):
    static, known = release(version)
    return sa.check_launch_args(static["options"], launch_args, allow_abbrev=static["allow_abbrev"],
                                known_values=known, **kw)


class _ArgparseError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise _ArgparseError(message)


def real_parser(options):
    """An argparse parser with the options read statically, to hold our rules against argparse itself."""
    parser = _RaisingParser(prog="sglang serve")
    for option in options:
        if option["action"] == "help":
            continue
        kwargs = {"dest": option["dest"] + "_" + str(id(option))}
        strings = option["option_strings"]
        if option["action"] == "BooleanOptionalAction":
            strings = [s for s in strings if not s.startswith("--no-")]
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option["nargs"] == 0:
            kwargs["action"] = "store_true"
        else:
            if option["nargs"] is not None:
                kwargs["nargs"] = option["nargs"]
            kwargs["type"] = {"int": int, "float": float}.get(option["type"], str)
            if option["choices"] and option["type"] in ("int", "float", "str"):
                kwargs["choices"] = option["choices"]
        parser.add_argument(*strings, **kwargs)
    return parser


# ---- real releases ---------------------------------------------------------------------------------

@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_reader_finds_the_style_and_the_eagle3_options_of_each_release(version):
    static, _ = release(version)
    assert static["style"] == STYLE[version]
    names = {s for o in static["options"] for s in o["option_strings"]}
    for flag in ["--model-path", "--speculative-draft-model-path", "--speculative-num-steps",
                 "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--tp-size", "--trust-remote-code",
                 "--host", "--port"]:
        assert flag in names, (version, flag)
    assert len(static["options"]) > 100


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_eagle3_flag_set_is_accepted_and_rendered_with_canonical_names(version):
    result = check(version, EAGLE3, host="127.0.0.1", port=30000)
    assert result["errors"] == []
    assert result["valid"] is True
    argv = result["argv"]
    assert argv[argv.index("--tp-size") + 1] == "8"
    assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert "--trust-remote-code" in argv and argv[argv.index("--trust-remote-code") + 1].startswith("--")
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", "30000"]
    # argparse itself accepts what was rendered
    parsed = vars(real_parser(release(version)[0]["options"]).parse_args(argv))
    assert 8 in parsed.values() and "/models/draft" in parsed.values()


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_tp_is_accepted_only_as_an_abbreviation_of_tp_size(version):
    result = check(version, dict(EAGLE3, **{"tp-size": None, "tp": 8}))
    assert result["valid"], result["errors"]
    assert result["resolved"]["tp"] == "--tp-size"
    assert "--tp" not in result["argv"] and "--tp-size" in result["argv"]
    static, _ = release(version)
    assert "--tp" not in {s for o in static["options"] for s in o["option_strings"]}


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_unknown_flag_is_refused_with_a_close_spelling(version):
    result = check(version, dict(EAGLE3, tp_size=8))
    assert not result["valid"]
    assert [e["flag"] for e in result["errors"]] == ["--tp_size"]
    assert "unrecognized argument --tp_size" in result["errors"][0]["message"]
    assert "--tp-size" in result["errors"][0]["message"]
    assert result["argv"] and "--tp_size" not in result["argv"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_unknown_speculative_algorithm_is_refused(version):
    result = check(version, dict(EAGLE3, **{"speculative-algorithm": "FOO"}))
    assert not result["valid"]
    (error,) = result["errors"]
    assert error["flag"] == "--speculative-algorithm"
    assert "'FOO'" in error["message"] and "EAGLE3" in error["message"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_non_integer_tp_size_is_refused(version):
    result = check(version, dict(EAGLE3, **{"tp-size": "eight"}))
    assert not result["valid"]
    assert result["errors"] == [{"flag": "--tp-size", "message": "argument --tp-size: invalid int value: 'eight'"}]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_ambiguous_prefix_lists_the_candidates_like_argparse(version):
    result = check(version, dict(EAGLE3, **{"speculative-num": 3}))
    assert not result["valid"]
    (error,) = result["errors"]
    assert error["message"].startswith("ambiguous option: --speculative-num could match ")
    assert "--speculative-num-steps" in error["message"] and "--speculative-num-draft-tokens" in error["message"]
    parser = real_parser(release(version)[0]["options"])
    with pytest.raises(_ArgparseError, match="ambiguous option: --speculative-num"):
        parser.parse_args(["--model-path", "/m", "--speculative-num", "3"])


@pytest.mark.realrelease
@pytest.mark.parametrize("version,accepted", [("0.5.4", True), ("0.5.14", True), ("0.5.20", False),
                                              ("0.5.23", False)])
def test_cuda_graph_max_bs_is_accepted_until_the_rename_took_effect(version, accepted):
    result = check(version, dict(EAGLE3, **{"cuda-graph-max-bs": 160}))
    assert result["valid"] is accepted, result["errors"]
    if accepted:
        assert result["argv"][result["argv"].index("--cuda-graph-max-bs") + 1] == "160"
    else:
        (error,) = result["errors"]
        assert "--cuda-graph-max-bs-decode" in error["message"]
        assert error["message"].startswith("ambiguous option: --cuda-graph-max-bs could match")


@pytest.mark.realrelease
def test_deprecated_alias_is_accepted_with_a_warning_naming_the_new_flag():
    result = check("0.5.14", dict(EAGLE3, **{"cuda-graph-max-bs": 160}))
    assert result["warnings"] == [{"flag": "--cuda-graph-max-bs", "message": (
        "--cuda-graph-max-bs is deprecated in this SGLang release; use --cuda-graph-max-bs-decode instead")}]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_model_path_is_required(version):
    result = check(version, {"tp-size": 8})
    assert not result["valid"]
    assert {"flag": "--model-path", "message": "the following arguments are required: --model-path"} \
        in result["errors"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", ["0.5.4", "0.5.23"])
def test_choices_are_checked_where_argparse_has_them(version):
    result = check(version, dict(EAGLE3, **{"load-format": "nope"}))
    assert not result["valid"]
    assert "invalid choice: 'nope'" in result["errors"][0]["message"]
    assert "'safetensors'" in result["errors"][0]["message"]
    assert check(version, dict(EAGLE3, **{"load-format": "safetensors"}))["valid"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", RELEASES)
def test_our_abbreviation_rules_agree_with_argparse_on_every_prefix_of_eagle_flags(version):
    static, _ = release(version)
    parser = real_parser(static["options"])
    index = sa._index(static["options"])
    for flag in ["--speculative-draft-model-path", "--speculative-eagle-topk", "--tp-size", "--trust-remote-code",
                 "--cuda-graph-max-bs", "--port", "--host", "--model-path"]:
        for cut in range(3, len(flag) + 1):
            prefix = flag[:cut]
            _, option, _message = sa.resolve_flag(prefix, index)
            takes_value = option is not None and option["nargs"] != 0
            argv = ["--model-path", "/m", prefix] + (["1"] if takes_value else [])
            try:
                parser.parse_args(argv)
                argparse_ok = True
            except _ArgparseError:
                argparse_ok = False
            assert argparse_ok is (option is not None), (version, prefix)


@pytest.mark.realrelease
def test_help_output_of_a_release_parses_back_to_the_same_options():
    static, _ = release("0.5.23")
    parser = real_parser(static["options"])
    import os
    os.environ["COLUMNS"] = "100000"
    try:
        text = parser.format_help()
    finally:
        del os.environ["COLUMNS"]
    helped = sa.parse_help(text)
    by_name = {o["option_strings"][0]: o for o in helped}
    for option in static["options"]:
        if option["action"] == "BooleanOptionalAction":
            continue
        got = by_name[option["option_strings"][0]]
        assert got["option_strings"] == option["option_strings"]
        assert (got["nargs"] == 0) is (option["nargs"] == 0), option["option_strings"]
        if option["choices"] and option["type"] in ("str", "int"):
            assert got["choices"] == [str(c) for c in option["choices"]]
    result = sa.check_launch_args(helped, dict(EAGLE3, **{"tp-size": None, "tp": 8}), host="127.0.0.1", port=30000)
    assert result["valid"], result["errors"]
    assert result["resolved"]["tp"] == "--tp-size"


# ---- rules on small synthetic trees -------------------------------------------------------------------

ADD_ARGUMENT_STYLE = '''
import argparse
from sglang.srt.choices import LOAD_FORMATS
from sglang.srt.actions import DeprecatedAction

MODES = ["a", "b"]

class ServerArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser):
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
        parser.add_argument("--load-format", type=str, choices=LOAD_FORMATS + ["extra"])
        parser.add_argument("--mode", choices=MODES)
        parser.add_argument("--bs", type=int, nargs="+")
        parser.add_argument("--lora", action="append")
        parser.add_argument("--ratio", type=float)
        parser.add_argument("--old-flag", action=DeprecatedAction)
        parser.add_argument("--trust-remote-code", action="store_true")
        parser.add_argument("--dyn", choices=list(get_registry()))
        parser.add_argument("--mem", type=human_readable_int)

def prepare_server_args(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)
'''

DATACLASS_STYLE = '''
from typing import List, Literal, Optional
from sglang.srt.arg_groups.arg_utils import A, Arg, add_cli_args_from_dataclass
from sglang.srt.arg_groups.fields.model import Model

_INPUT_NAMESPACES = [Model]

class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        add_cli_args_from_dataclass(parser, ServerArgs)
        parser.add_argument("--config", type=str)

def prepare_server_args(argv):
    parser = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=ABBREV)
'''

FIELDS = '''
from typing import List, Literal, Optional
import msgspec
from sglang.srt.arg_groups.arg_utils import A, Arg, Derived

class Model(msgspec.Struct):
    _NS_PATH = "model"
    model_path: A[str, Arg(help="Path.", aliases=["--model"])]
    tp_size: A[int, Arg(help="TP.", aliases=["--tensor-parallel-size"])] = 1
    quant: A[Optional[Literal["fp8", "awq"]], "Quantization."] = None
    cuda_graph_bs: A[Optional[List[int]], "Batch sizes."] = None
    trust_remote_code: A[bool, "Trust."] = False
    hidden: A[int, Arg(help="x", no_cli=True)] = 0
    derived_thing: A[int, Derived(doc="computed")] = 0
    plain: int = 3
    enable_x: A[bool, Arg(help="x", action=argparse.BooleanOptionalAction)] = True
    fp8_gemm_runner_backend: A[str, Arg(help="x", cli_name="--fp8-gemm-backend", choices=["auto", "cutlass"])] = "auto"
'''


def write_tree(tmp_path, files):
    pkg = tmp_path / "sglang"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(pkg)


@pytest.fixture
def add_argument_tree(tmp_path):
    return write_tree(tmp_path, {
        "srt/server_args.py": ADD_ARGUMENT_STYLE,
        "srt/choices.py": 'LOAD_FORMATS = ["auto", "safetensors"]\n',
        "srt/actions.py": ("import argparse\nclass DeprecatedAction(argparse.Action):\n"
                           "    def __init__(self, option_strings, dest, nargs=0, **kw):\n"
                           "        super().__init__(option_strings, dest, nargs=nargs, **kw)\n"),
    })


def dataclass_tree(tmp_path, abbrev=True):
    return write_tree(tmp_path, {
        "srt/server_args.py": DATACLASS_STYLE.replace("ABBREV", str(abbrev)),
        "srt/arg_groups/arg_utils.py": "A = None\n",
        "srt/arg_groups/fields/model.py": FIELDS,
    })


def options_by_name(static):
    return {o["option_strings"][0]: o for o in static["options"]}


def test_add_argument_reader_resolves_imported_and_concatenated_choices(add_argument_tree):
    static = sa.read_static(add_argument_tree)
    opts = options_by_name(static)
    assert static["style"] == "add_argument"
    assert opts["--load-format"]["choices"] == ["auto", "safetensors", "extra"]
    assert opts["--mode"]["choices"] == ["a", "b"]
    assert opts["--dyn"]["choices_known"] is False
    assert opts["--old-flag"]["nargs"] == 0 and opts["--old-flag"]["deprecated"]
    assert opts["--model-path"]["required"] and opts["--model-path"]["option_strings"] == ["--model-path", "--model"]
    assert opts["--mem"]["type"] is None and opts["--mem"]["type_name"] == "human_readable_int"
    assert any(f.endswith("choices.py") for f in static["files"])


def test_dataclass_reader_follows_add_cli_args_from_dataclass_rules(tmp_path):
    static = sa.read_static(dataclass_tree(tmp_path))
    opts = options_by_name(static)
    assert static["style"] == "dataclass"
    assert opts["--model-path"]["required"] is True and "--model" in opts["--model-path"]["option_strings"]
    assert opts["--tp-size"]["type"] == "int" and opts["--tp-size"]["required"] is False
    assert opts["--quant"]["choices"] == ["fp8", "awq"]
    assert opts["--cuda-graph-bs"]["nargs"] == "+" and opts["--cuda-graph-bs"]["type"] == "int"
    assert opts["--trust-remote-code"]["nargs"] == 0
    assert "--fp8-gemm-backend" in opts and "--fp8-gemm-runner-backend" not in opts
    assert opts["--enable-x"]["option_strings"] == ["--enable-x", "--no-enable-x"]
    assert "--config" in opts
    for absent in ("--hidden", "--derived-thing", "--plain"):
        assert absent not in opts


def test_allow_abbrev_false_in_the_release_turns_prefixes_into_errors(tmp_path):
    static = sa.read_static(dataclass_tree(tmp_path, abbrev=False))
    assert static["allow_abbrev"] is False
    result = sa.check_launch_args(static["options"], {"model-path": "/m", "tp": 2}, allow_abbrev=False)
    assert not result["valid"]
    assert result["errors"][0]["message"].startswith("unrecognized argument --tp")


def test_values_are_rendered_by_kind(add_argument_tree):
    static = sa.read_static(add_argument_tree)
    result = sa.check_launch_args(static["options"], {
        "model": "/m", "bs": [1, 2, 4], "lora": ["a=/x", "b=/y"], "ratio": 0.5, "trust-remote-code": True,
        "mode": None, "old-flag": False, "mem": "16G"})
    assert result["errors"] == []
    assert result["argv"] == ["--model", "/m", "--bs", "1", "2", "4", "--lora", "a=/x", "--lora", "b=/y",
                              "--ratio", "0.5", "--trust-remote-code", "--mem", "16G"]
    assert result["resolved"]["model"] == "--model"
    assert sa.check_launch_args(static["options"], {"model-p": "/m"})["resolved"] == {"model-p": "--model-path"}
    assert result["values"]["--bs"] == [1, 2, 4]
    assert result["dest_values"]["model_path"] == "/m" and result["dest_values"]["trust_remote_code"] is True


@pytest.mark.parametrize("args,flag,fragment", [
    ({"trust-remote-code": "yes"}, "--trust-remote-code", "is a switch: give true"),
    ({"tp-size": True}, "--tp-size", "expects a value (int)"),
    ({"tp-size": [1, 2]}, "--tp-size", "takes one value, got a list of 2"),
    ({"ratio": "fast"}, "--ratio", "invalid float value: 'fast'"),
    ({"tp-size": 2.5}, "--tp-size", "invalid int value: '2.5'"),
    ({"mode": "c"}, "--mode", "invalid choice: 'c' (choose from 'a', 'b')"),
    ({"bs": []}, "--bs", "expects at least one value"),
    ({"he": True}, "--he", "argparse's --help"),
    ({"tp-size": 1, "tensor-parallel-size": 2}, "--tensor-parallel-size", "sets the same option as --tp-size"),
    ({"port": 1}, "--port", "is rendered from sglang_port"),
])
def test_bad_values_are_reported_per_flag(add_argument_tree, args, flag, fragment):
    static = sa.read_static(add_argument_tree)
    result = sa.check_launch_args(static["options"], dict({"model-path": "/m"}, **args), port=30000)
    assert not result["valid"]
    assert any(e["flag"] == flag and fragment in e["message"] for e in result["errors"]), result["errors"]


def test_port_in_launch_args_is_reported_once(add_argument_tree):
    static = sa.read_static(add_argument_tree)
    result = sa.check_launch_args(static["options"], {"model-path": "/m", "port": 1}, port=30000)
    assert [e["message"] for e in result["errors"]].count(
        "--port is rendered from sglang_port; remove 'port' from sglang_launch_args") == 1, result["errors"]


def test_every_error_is_reported_not_only_the_first(add_argument_tree):
    static = sa.read_static(add_argument_tree)
    result = sa.check_launch_args(static["options"], {"tp-size": "x", "nonsense": 1, "mode": "z"})
    assert sorted(e["flag"] for e in result["errors"]) == ["--mode", "--model-path", "--nonsense", "--tp-size"]


def test_value_that_looks_like_an_option_uses_the_equals_form(add_argument_tree):
    static = sa.read_static(add_argument_tree)
    result = sa.check_launch_args(static["options"], {"model-path": "-weird", "tp-size": -1})
    assert result["argv"] == ["--model-path=-weird", "--tp-size", "-1"]


def test_missing_server_args_is_an_operational_error(tmp_path):
    with pytest.raises(sa.SglangArgsError, match="cannot read .*server_args.py"):
        sa.read_static(str(tmp_path))


def test_help_text_parsing_reads_arity_and_choices():
    text = textwrap.dedent("""\
        usage: sglang serve [-h] --model-path MODEL_PATH

        options:
          -h, --help            show this help message and exit
          --model-path MODEL_PATH, --model MODEL_PATH
                                The path of the model weights.
          --tp-size TP_SIZE, --tensor-parallel-size TP_SIZE
          --load-format {auto,pt,safetensors}
          --cuda-graph-bs CUDA_GRAPH_BS [CUDA_GRAPH_BS ...]
          --lora-paths [LORA_PATHS ...]
          --json-model-override-args [JSON_MODEL_OVERRIDE_ARGS]
          --trust-remote-code   Whether or not to allow custom models.
        """)
    opts = {o["option_strings"][0]: o for o in sa.parse_help(text)}
    assert opts["--model-path"]["option_strings"] == ["--model-path", "--model"]
    assert opts["--load-format"]["choices"] == ["auto", "pt", "safetensors"]
    assert opts["--cuda-graph-bs"]["nargs"] == "+"
    assert opts["--lora-paths"]["nargs"] == "*"
    assert opts["--json-model-override-args"]["nargs"] == "?"
    assert opts["--trust-remote-code"]["nargs"] == 0
    assert opts["-h"]["action"] == "help"


@pytest.mark.realrelease
def test_releases_that_predate_eagle3_refuse_the_flag_set():
    # 0.4.1.post6 knows only EAGLE; 0.3.6 has no speculative decoding flags at all.
    result = check("0.4.1.post6", EAGLE3)
    assert result["errors"] == [{"flag": "--speculative-algorithm", "message":
                                 "argument --speculative-algorithm: invalid choice: 'EAGLE3' (choose from 'EAGLE'); "
                                 "did you mean 'EAGLE'?"}]
    result = check("0.3.6", EAGLE3)
    assert sorted(e["flag"] for e in result["errors"]) == [
        "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-eagle-topk",
        "--speculative-num-draft-tokens", "--speculative-num-steps"]


# ---- choices SGLang keeps in other modules (parsers, backends), real releases -------------------------------

# Every release from 0.4.6 in test_sglang_nccl_patch_releases.RELEASES, plus 0.5.12 and 0.5.12.post1 (NEXTN).
CHOICE_RELEASES = ["0.4.6", "0.5.4", "0.5.5", "0.5.10", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.14", "0.5.20",
                   "0.5.23"]


def _version(version):
    return tuple(int(p) for p in version.replace("post", ".").split(".") if p.isdigit())


@pytest.mark.realrelease
@pytest.mark.parametrize("version", CHOICE_RELEASES)
def test_every_choices_expression_of_the_release_is_read(version):
    static, _ = release(version)
    assert [(o["option_strings"][0], o["choices_expr"]) for o in static["options"] if not o["choices_known"]] == []
    opts = options_by_name(static)
    for flag in ("--tool-call-parser", "--reasoning-parser", "--quantization", "--attention-backend",
                 "--grammar-backend", "--load-format"):
        assert opts[flag]["choices"], (version, flag)


@pytest.mark.realrelease
@pytest.mark.parametrize("version", CHOICE_RELEASES)
def test_misspelt_tool_call_parser_is_refused_like_argparse_and_the_real_name_accepted(version):
    result = check(version, dict(EAGLE3, **{"tool-call-parser": "kimi_k25"}))
    (error,) = result["errors"]
    assert error["flag"] == "--tool-call-parser"
    assert error["message"].startswith("argument --tool-call-parser: invalid choice: 'kimi_k25' (choose from ")
    with pytest.raises(_ArgparseError, match="invalid choice: 'kimi_k25'"):
        real_parser(release(version)[0]["options"]).parse_args(["--model-path", "/m", "--tool-call-parser", "kimi_k25"])
    # 0.4.6 lists four tool-call parsers in server_args.py, none for Kimi
    has_kimi = version != "0.4.6"
    assert ("did you mean 'kimi_k2'" in error["message"]) is has_kimi
    assert check(version, dict(EAGLE3, **{"tool-call-parser": "kimi_k2"}))["valid"] is has_kimi


@pytest.mark.realrelease
@pytest.mark.parametrize("version", CHOICE_RELEASES)
def test_misspelt_reasoning_parser_is_refused_with_the_close_spelling(version):
    result = check(version, dict(EAGLE3, **{"reasoning-parser": "deepseek_r1"}))
    (error,) = result["errors"]
    assert error["message"].startswith("argument --reasoning-parser: invalid choice: 'deepseek_r1' (choose from ")
    assert "did you mean 'deepseek-r1'" in error["message"]
    assert check(version, dict(EAGLE3, **{"reasoning-parser": "deepseek-r1"}))["valid"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", CHOICE_RELEASES)
def test_nextn_is_accepted_on_every_release_that_takes_it(version):
    result = check(version, dict(EAGLE3, **{"speculative-algorithm": "NEXTN"}))
    assert result["valid"], result["errors"]
    # Up to 0.5.11 argparse's choices compare case-sensitively; from 0.5.12 SGLang upper-cases the value first
    # (0.5.12: ServerArgs._handle_speculative_decoding, then _resolve_speculative_algorithm_alias).
    assert check(version, dict(EAGLE3, **{"speculative-algorithm": "nextn"}))["valid"] is (
        _version(version) >= (0, 5, 12))


@pytest.mark.realrelease
@pytest.mark.parametrize("version", ["0.5.12", "0.5.12.post1"])
def test_nextn_alias_of_0_5_12_is_read_from_server_args(version):
    # spec_info's enum has no NEXTN and spec_registry no _RESERVED_ALIASES in these two releases.
    assert "NEXTN" in sa.read_speculative_algorithms(str(sglang_package_dir(version)))
    result = check(version, dict(EAGLE3, **{"speculative-algorithm": "NEXTM"}))
    assert "did you mean 'NEXTN'?" in result["errors"][0]["message"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version,hook_file", [("0.5.4", "srt/server_args.py"),
                                               ("0.5.23", "srt/arg_groups/choices.py")])
def test_value_outside_a_list_plugins_can_grow_is_refused_saying_so(version, hook_file):
    args = dict(EAGLE3, **{"attention-backend": "my_npu_attn"})
    (error,) = check(version, args)["errors"]
    assert "invalid choice: 'my_npu_attn'" in error["message"]
    assert "add_attention_backend_choices() (%s)" % hook_file in error["message"]
    assert "extra_choices" in error["message"]
    assert check(version, args, extra_choices={"attention-backend": ["my_npu_attn"]})["valid"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_value_the_release_converts_itself_is_listed_as_unchecked(version):
    result = check(version, dict(EAGLE3, **{"context-length": "128k", "tool-call-parser": "kimi_k2"}))
    assert result["valid"], result["errors"]
    why = "SGLang converts the value with human_readable_int, which preflight does not run"
    assert result["unchecked"] == [{"flag": "--context-length", "option": "--context-length", "why": why,
                                    "message": "--context-length (%s)" % why}]


@pytest.mark.realrelease
def test_retired_cuda_graph_backend_is_refused_with_the_converters_own_message():
    # 0.5.23: type_parser=parse_cuda_graph_backend_arg raises for tc_piecewise before argparse's choices.
    result = check("0.5.23", dict(EAGLE3, **{"cuda-graph-backend-decode": "tc_piecewise"}))
    assert result["errors"] == [{"flag": "--cuda-graph-backend-decode", "message": (
        "argument --cuda-graph-backend-decode: tc_piecewise was removed; select breakable, full, or disabled")}]
    result = check("0.5.23", dict(EAGLE3, **{"cuda-graph-backend-decode": "breakable"}))
    assert result["valid"] and result["unchecked"] == []
    assert check("0.5.20", dict(EAGLE3, **{"cuda-graph-backend-decode": "tc_piecewise"}))["valid"]


@pytest.mark.realrelease
def test_choices_built_from_an_enum_and_from_an_environment_switch_are_read():
    # --kv-canary-real-data: [m.name.lower() for m in RealKvHashMode]; --sampling-backend: token_oracle is added
    # when SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE is on, which preflight cannot see, so it is accepted.
    assert check("0.5.20", dict(EAGLE3, **{"kv-canary-real-data": "partial", "sampling-backend": "token_oracle"}))[
        "valid"]
    (error,) = check("0.5.20", dict(EAGLE3, **{"kv-canary-real-data": "PARTIAL"}))["errors"]
    assert error["message"].startswith("argument --kv-canary-real-data: invalid choice: 'PARTIAL' (choose from "
                                       "'none', 'partial', 'all')")


# ---- choices, converters and aliases on small synthetic trees -----------------------------------------------

CHOICES_STYLE = '''
import argparse
import sys
from sglang.srt.parsers import Parsers
from sglang.srt.utils import NAMES
from sglang.srt.modes import Mode

BACKENDS = ["a", "b"]

def add_backend_choices(choices):
    BACKENDS.extend(choices)

def _tool_names():
    module = sys.modules.get("sglang.srt.parsers")
    if module is not None:
        return list(module.Parsers.Map)
    from sglang.srt.parser_names import TOOL_NAMES

    return list(TOOL_NAMES)

def parse_phase(raw):
    """Refuse the retired name."""
    if raw == "old":
        raise argparse.ArgumentTypeError("old was removed; pick new")
    return raw

def nullable(val):
    if not val or val == "None":
        return None
    return val

def _resolve_alias(speculative_algorithm, draft=None):
    if speculative_algorithm == "NEXTN" or speculative_algorithm == "EAGLE":
        return "EAGLE"
    return speculative_algorithm

class ServerArgs:
    def __post_init__(self):
        self.speculative_algorithm = _resolve_alias(self.speculative_algorithm)

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", type=str, required=True)
        parser.add_argument("--reasoning", choices=list(Parsers.Map.keys()))
        parser.add_argument("--tool", choices=["auto"] + _tool_names())
        parser.add_argument("--name", choices=NAMES)
        parser.add_argument("--mode", choices=[m.name.lower() for m in Mode])
        parser.add_argument("--backend", choices=BACKENDS)
        sampling = set(BACKENDS)
        if envs.FOO.get():
            sampling.add("oracle")
        parser.add_argument("--sampling", choices=sampling)
        parser.add_argument("--phase", type=parse_phase, choices=Phase.ALL)
        parser.add_argument("--qpath", type=nullable)
        parser.add_argument("--dyn", choices=list(get_registry()))
        parser.add_argument("--mem", type=human_readable_int)
        parser.add_argument("--speculative-algorithm", type=str)

class Phase:
    FULL = "full"
    OLD = "old"
    ALL = (FULL, "none")
'''


@pytest.fixture
def choices_tree(tmp_path):
    return write_tree(tmp_path, {
        "srt/server_args.py": CHOICES_STYLE,
        "srt/parsers.py": "class Parsers:\n    Map: dict = {'r1': R1Detector, **{'qwen3': Q}}\n",
        "srt/parser_names.py": "TOOL_NAMES = ['kimi_k2', 'qwen25']\n",
        "srt/utils/__init__.py": "from .common import *\n",
        "srt/utils/common.py": "NAMES = ('x', 'y')\n",
        "srt/modes.py": "from enum import IntEnum, auto\nclass Mode(IntEnum):\n    NONE = 0\n    PARTIAL = auto()\n",
        "srt/speculative/spec_info.py": "class SpeculativeAlgorithm(Enum):\n    EAGLE = 1\n    NONE = 2\n",
        "srt/plugins/__init__.py": "def load_plugins():\n    pass\n",
        "launch_server.py": "from sglang.srt.plugins import load_plugins\nload_plugins()\n",
    })


def test_choices_are_read_from_dict_keys_star_imports_functions_enums_and_class_bodies(choices_tree):
    opts = options_by_name(sa.read_static(choices_tree))
    assert opts["--reasoning"]["choices"] == ["r1", "qwen3"]
    assert opts["--tool"]["choices"] == ["auto", "kimi_k2", "qwen25"]
    assert opts["--name"]["choices"] == ["x", "y"]
    assert opts["--mode"]["choices"] == ["none", "partial"]
    assert opts["--phase"]["choices"] == ["full", "none"]
    assert opts["--sampling"]["choices"] == ["a", "b", "oracle"]
    assert opts["--dyn"]["choices_known"] is False and opts["--dyn"]["choices_expr"] == "list(get_registry())"


def test_choices_note_says_how_the_release_can_add_names_at_run_time(choices_tree):
    opts = options_by_name(sa.read_static(choices_tree))
    assert opts["--backend"]["choices_note"] == "plugins can add names with add_backend_choices() (srt/server_args.py)"
    assert "Parsers.Map (srt/parsers.py)" in opts["--reasoning"]["choices_note"]
    assert "_tool_names() (srt/server_args.py) read the live registry" in opts["--tool"]["choices_note"]
    assert opts["--sampling"]["choices_note"] == ("plugins can add names with add_backend_choices() "
                                                  "(srt/server_args.py); the release adds 'oracle' only when "
                                                  "envs.FOO.get()")
    assert opts["--name"]["choices_note"] is None and opts["--mode"]["choices_note"] is None


def test_close_spelling_and_run_time_note_follow_argparses_invalid_choice(choices_tree):
    options = sa.read_static(choices_tree)["options"]
    result = sa.check_launch_args(options, {"model-path": "/m", "tool": "kimi_k25", "name": "z"})
    messages = {e["flag"]: e["message"] for e in result["errors"]}
    assert messages["--tool"].startswith(
        "argument --tool: invalid choice: 'kimi_k25' (choose from 'auto', 'kimi_k2', 'qwen25'); "
        "did you mean 'kimi_k2'? (these are the names in the release's source; a plugin that registers")
    assert messages["--name"] == "argument --name: invalid choice: 'z' (choose from 'x', 'y')"
    result = sa.check_launch_args(options, {"model-path": "/m", "tool": "mine"}, extra_choices={"to": ["mine"]})
    assert result["valid"], result["errors"]
    result = sa.check_launch_args(options, {"model-path": "/m"}, extra_choices={"nope": ["x"]})
    assert result["errors"][0]["message"].startswith(
        "sglang_preflight_extra_choices (module option extra_choices): unrecognized argument --nope")


def test_pass_through_converter_is_run_and_others_are_listed_as_unchecked(choices_tree):
    options = sa.read_static(choices_tree)["options"]
    result = sa.check_launch_args(options, {"model-path": "/m", "phase": "old"})
    assert result["errors"] == [{"flag": "--phase", "message": "argument --phase: old was removed; pick new"}]
    result = sa.check_launch_args(options, {"model-path": "/m", "phase": "ful"})
    assert "invalid choice: 'ful'" in result["errors"][0]["message"]
    result = sa.check_launch_args(options, {"model-path": "/m", "phase": "full", "qpath": "/q", "dyn": "x",
                                            "me": "16G"})
    assert result["valid"], result["errors"]
    assert [(u["flag"], u["option"], u["why"]) for u in result["unchecked"]] == [
        ("--dyn", "--dyn", "choices computed at run time (list(get_registry()))"),
        ("--me", "--mem", "SGLang converts the value with human_readable_int, which preflight does not run")]
    assert result["unchecked"][1]["message"] == \
        "--me (--mem: SGLang converts the value with human_readable_int, which preflight does not run)"


def test_given_unchecked_lists_a_dynamic_choice_flag_not_a_checked_or_refused_one(add_argument_tree):
    options = sa.read_static(add_argument_tree)["options"]
    result = sa.check_launch_args(options, {"model-path": "/m", "dyn": "anything", "mode": "a", "tp-size": 2})
    assert [u["flag"] for u in result["unchecked"]] == ["--dyn"]
    result = sa.check_launch_args(options, {"model-path": "/m", "dyn": "anything", "mode": "zz"})
    assert [u["flag"] for u in result["unchecked"]] == ["--dyn"] and result["errors"][0]["flag"] == "--mode"


def test_speculative_alias_mapped_in_server_args_is_a_known_name(choices_tree):
    assert sa.read_speculative_algorithms(choices_tree) == ["EAGLE", "NEXTN"]
    options = sa.read_static(choices_tree)["options"]
    known = {"--speculative-algorithm": ["EAGLE", "NEXTN"]}
    assert sa.check_launch_args(options, {"model-path": "/m", "speculative-algorithm": "nextn"},
                                known_values=known)["valid"]
    result = sa.check_launch_args(options, {"model-path": "/m", "speculative-algorithm": "EAGLE2"},
                                  known_values=known)
    assert "did you mean 'EAGLE'?" in result["errors"][0]["message"]
    # no names found: SGLang still checks the value later, so it is listed as unchecked
    result = sa.check_launch_args(options, {"model-path": "/m", "speculative-algorithm": "X"},
                                  known_values={"--speculative-algorithm": None})
    assert result["valid"] and [u["flag"] for u in result["unchecked"]] == ["--speculative-algorithm"]


@pytest.mark.realrelease
@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
def test_lora_paths_take_several_values_through_action_kwargs(version):
    # Arg(action=LoRAPathAction, action_kwargs={"type": str, "nargs": "*"}): the dict's literal values are read.
    result = check(version, dict(EAGLE3, **{"lora-paths": ["a=/x", "b=/y"]}))
    assert result["valid"], result["errors"]
    argv = result["argv"]
    assert argv[argv.index("--lora-paths"):argv.index("--lora-paths") + 3] == ["--lora-paths", "a=/x", "b=/y"]


@pytest.mark.realrelease
def test_dest_values_hold_what_argparse_stores_for_negative_switches():
    # 0.5.23: --enable-tp-lm-head-all-to-all is a BooleanOptionalAction; its --no- form stores False (the NCCL
    # conflict rules and check.yml's drift read dest_values as argparse would leave them).
    base = dict(EAGLE3)
    negative = check("0.5.23", dict(base, **{"no-enable-tp-lm-head-all-to-all": True}))
    assert not negative["errors"] and negative["dest_values"]["enable_tp_lm_head_all_to_all"] is False
    positive = check("0.5.23", dict(base, **{"enable-tp-lm-head-all-to-all": True}))
    assert positive["dest_values"]["enable_tp_lm_head_all_to_all"] is True
    assert check("0.5.23", dict(base, **{"trust-remote-code": True}))["dest_values"]["trust_remote_code"] is True
