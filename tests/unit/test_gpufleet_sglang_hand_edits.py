"""gpufleet_sglang_hand_edits: hand-typed environment writes in _set_envs_and_config (issue 30, item 3).

The finder runs on real release text (the wheels' engine.py/server.py through tests/support/sglang_wheels.py and
SGLang's development branch in ../shared/upstream) with the seed's own edit typed in, before and after the
start-method call, and on every form a user writes.
"""
import os
import textwrap

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import split_lines
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_hand_edits import (
    HandEditError,
    find_env_writes,
    judge_hand_edits,
    read_taken_over,
    restore_taken_over,
    take_over_lines,
    taken_over_comment,
)
from support.sglang_wheels import sglang_package_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UPSTREAM = os.path.join(ROOT, "..", "shared", "upstream", "sglang-main")
# Every release the patch tests cover, with the file that defines the function.
RELEASES = [("0.3.6", "srt/server.py"), ("0.4.1.post6", "srt/server.py"), ("0.4.1.post7", "srt/entrypoints/engine.py"),
            ("0.4.5", "srt/entrypoints/engine.py"), ("0.4.6", "srt/entrypoints/engine.py"),
            ("0.5.4", "srt/entrypoints/engine.py"), ("0.5.5", "srt/entrypoints/engine.py"),
            ("0.5.10", "srt/entrypoints/engine.py"), ("0.5.11", "srt/entrypoints/engine.py"),
            ("0.5.14", "srt/entrypoints/engine.py"), ("0.5.20", "srt/entrypoints/engine.py"),
            ("0.5.23", "srt/entrypoints/engine.py")]
SEED_LINE = 'os.environ["NCCL_PROTO"] = "Simple"'
ANCHOR = 'mp.set_start_method("spawn", force=True)'


def release_text(version, rel):
    with open(os.path.join(str(sglang_package_dir(version)), rel)) as handle:
        return handle.read()


def with_line(source, line, where):
    """``source`` with ``line`` typed in at the start-method call's indentation, ``before`` or ``after`` it."""
    lines = split_lines(source)
    index = next(i for i, text in enumerate(lines) if text.strip().startswith("mp.set_start_method("))
    indent = lines[index][:len(lines[index]) - len(lines[index].lstrip())]
    lines.insert(index + (1 if where == "after" else 0), indent + line + "\n")
    return "".join(lines)


@pytest.mark.realrelease
@pytest.mark.parametrize("version, rel", RELEASES, ids=[v for v, _ in RELEASES])
def test_sglang_own_writes_are_not_hand_edits_in_any_release(version, rel):
    writes = find_env_writes(release_text(version, rel))
    assert writes and all(w["sglang_own"] for w in writes)
    # Managing every variable SGLang writes itself finds nothing to refuse or report.
    names = set(n for w in writes for n in w["names"])
    assert judge_hand_edits(writes, names) == ([], [])


@pytest.mark.parametrize("name", ["engine.py", "worker_launch.py"])
def test_sglang_own_writes_of_the_development_branch_are_not_hand_edits(name):
    path = os.path.join(UPSTREAM, name)
    if not os.path.exists(path):
        pytest.skip("../shared/upstream/sglang-main is not beside this checkout")
    with open(path) as handle:
        writes = find_env_writes(handle.read())
    assert writes and all(w["sglang_own"] for w in writes)


@pytest.mark.realrelease
@pytest.mark.parametrize("where", ["after", "before"])
def test_the_seeds_own_line_is_found_in_0_5_23_on_either_side_of_the_call(where):
    source = with_line(release_text("0.5.23", "srt/entrypoints/engine.py"), SEED_LINE, where)
    mine, others = judge_hand_edits(find_env_writes(source), ["NCCL_PROTO", "NCCL_ALGO"])
    assert others == [] and len(mine) == 1
    write = mine[0]
    assert write["text"] == SEED_LINE and write["names"] == ["NCCL_PROTO"] and write["form"] == "set"
    assert write["after_anchor"] is (where == "after")
    assert split_lines(source)[write["line"] - 1].strip() == SEED_LINE
    # A variable the block does not set: reported, not refused.
    assert judge_hand_edits(find_env_writes(source), ["NCCL_ALGO"]) == ([], [write])


@pytest.mark.realrelease
def test_an_sglang_line_typed_again_after_the_call_is_a_hand_edit():
    # SGLang never writes after the call: its own spelling there is the user's line.
    source = with_line(release_text("0.5.23", "srt/entrypoints/engine.py"),
                       'os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"', "after")
    mine, _ = judge_hand_edits(find_env_writes(source), ["CUDA_DEVICE_MAX_CONNECTIONS"])
    assert [(w["text"], w["after_anchor"]) for w in mine] == [('os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"', True)]


FORMS = [
    ('os.environ["NCCL_PROTO"] = "Simple"', "set"),
    ("os.environ['NCCL_PROTO'] += ',LL'", "append"),
    ('os.environ.setdefault("NCCL_PROTO", "Simple")', "setdefault"),
    ('os.putenv("NCCL_PROTO", "Simple")', "set"),
    ('os.environ.update({"NCCL_PROTO": "Simple"})', "update"),
    ('os.environ.update(NCCL_PROTO="Simple")', "update"),
    ('del os.environ["NCCL_PROTO"]', "unset"),
    ('os.environ.pop("NCCL_PROTO", None)', "unset"),
    ('os.unsetenv("NCCL_PROTO")', "unset"),
    ('environ["NCCL_PROTO"] = "Simple"', "set"),
    ('env["NCCL_PROTO"] = "Simple"', "set"),
    ('_os.environ["NCCL_PROTO"] = "Simple"', "set"),
    ('put("NCCL_PROTO", "Simple")', "set"),
]


@pytest.mark.parametrize("line, form", FORMS, ids=[f[0] for f in FORMS])
def test_every_form_a_user_types_is_found(line, form):
    source = textwrap.dedent('''\
        import os
        import os as _os
        from os import environ
        from os import environ as env, putenv as put
        import multiprocessing as mp


        def _set_envs_and_config(server_args):
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "4"
            mp.set_start_method("spawn", force=True)
            %s
        ''') % line
    mine, others = judge_hand_edits(find_env_writes(source), ["NCCL_PROTO"])
    assert others == [] and [(w["line"], w["form"], w["names"]) for w in mine] == [(11, form, ["NCCL_PROTO"])]


def test_writes_outside_the_function_or_in_a_nested_def_do_not_count():
    source = textwrap.dedent('''\
        import os
        os.environ["NCCL_PROTO"] = "Simple"


        def _set_envs_and_config(server_args):
            def later():
                os.environ["NCCL_PROTO"] = "LL"
            mp.set_start_method("spawn", force=True)


        def other():
            os.environ["NCCL_PROTO"] = "Simple"
        ''')
    assert find_env_writes(source) == []


def test_a_computed_name_may_be_any_variable_and_counts_as_managed():
    source = textwrap.dedent('''\
        import os


        def _set_envs_and_config(server_args):
            for name, value in server_args.extra_env.items():
                os.environ[name] = value
            os.environ.update(server_args.more_env)
            mp.set_start_method("spawn", force=True)
        ''')
    mine, others = judge_hand_edits(find_env_writes(source), ["NCCL_PROTO"])
    assert [w["names"] for w in mine] == [[None], [None]] and others == []


TAKE_SOURCE = textwrap.dedent('''\
    import os


    def _set_envs_and_config(server_args):
        os.environ["NCCL_ALGO"] = (
            "Ring"
        )
        if server_args.x:
            os.environ["NCCL_PROTO"] = "LL"
        os.environ["NCCL_DEBUG"] = "INFO"; x = 1
        os.environ.update({"NCCL_PROTO": "LL", "FOO": "1"})
        mp.set_start_method("spawn", force=True)
        os.environ["NCCL_PROTO"] = "Simple"  # tuned by hand
    ''')


def test_take_over_removes_whole_statements_and_restoring_gives_the_bytes_back():
    writes = find_env_writes(TAKE_SOURCE)
    by_line = dict((w["line"], w) for w in writes)
    chosen = [by_line[5], by_line[13]]
    after, taken = take_over_lines(TAKE_SOURCE, chosen, ["NCCL_ALGO", "NCCL_PROTO"])
    assert [n for n, _ in taken] == [5, 6, 7, 13]
    assert taken[-1][1] == '    os.environ["NCCL_PROTO"] = "Simple"  # tuned by hand\n'
    assert "Ring" not in after and "Simple" not in after
    # The block records the lines; reading them back and putting them in gives the file as it was.
    comments = [taken_over_comment(n, t, "    ", "\n") for n, t in taken]
    assert read_taken_over(comments) == taken
    restored, origin = restore_taken_over(split_lines(after), read_taken_over(comments))
    assert "".join(restored) == TAKE_SOURCE
    assert [i for i, o in enumerate(origin) if o is None] == [4, 5, 6, 12]


@pytest.mark.parametrize("line, reason", [
    (9, "the only statement of its branch"),
    (10, "shares its line with other code"),
    (11, "also writes FOO, which sglang_nccl_env does not set"),
])
def test_lines_gpufleet_cannot_remove_alone_are_refused_naming_the_line(line, reason):
    write = dict((w["line"], w) for w in find_env_writes(TAKE_SOURCE))[line]
    with pytest.raises(HandEditError) as raised:
        take_over_lines(TAKE_SOURCE, [write], ["NCCL_PROTO", "NCCL_DEBUG"])
    assert "cannot take over line %d" % line in str(raised.value) and reason in str(raised.value)
