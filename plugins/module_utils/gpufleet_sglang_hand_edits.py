# -*- coding: utf-8 -*-
# gpufleet: environment writes typed by hand into SGLang's _set_envs_and_config, outside gpufleet's block.
"""Find, judge and take over hand-typed environment writes in ``_set_envs_and_config`` (issue 30, item 3).

Operators used to put NCCL settings into SGLang's function by hand (``os.environ["NCCL_PROTO"] = "Simple"``). A
write of a variable gpufleet's block also sets defeats the block when it runs after it (the block sits just before
``mp.set_start_method(...)``; a line after that statement wins) and, before it, silently comes back the day the
variable leaves ``sglang_nccl_env``. So :func:`find_env_writes` lists every write in the function, in every form
a user types: ``os.environ[N] = v`` (and ``+=``), ``os.environ.setdefault(N, v)``, ``os.environ.update({N: v})`` /
``update(N=v)``, ``os.putenv(N, v)``, ``del os.environ[N]``, ``os.environ.pop(N)``, ``os.unsetenv(N)``, also
through ``os`` imported under another name and ``environ`` (or ``putenv``) imported from ``os``, at module level or
in the function.

SGLang writes variables in that function itself (``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE``,
``CUDA_DEVICE_MAX_CONNECTIONS``, ...): those are not hand edits. :func:`is_sglang_own` tells them apart: a write
before the start-method statement whose statement text (whitespace dropped, quotes made double) is one SGLang
releases 0.3.6 to 0.5.23 and the development branch after it ship (:data:`SGLANG_OWN_WRITES`, read from the wheels
with ``tests/support/sglang_nccl_writes.py``). No release writes after the statement, so a write there is always
a hand edit.

:func:`judge_hand_edits` sorts the hand writes into managed ones (a name the block sets: refused, or taken over
with ``hand_edits=take_over``) and others (reported only). :func:`take_over_lines` removes managed ones from the
source, keeping each removed line's number and exact text, which the block records
(:func:`taken_over_comment`) so ``state: absent`` can put them back (:func:`restore_taken_over`).
"""
from __future__ import absolute_import, division, print_function

__metaclass__ = type

import ast

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import (
    FUNCTION_NAME,
    _is_start_method_call,
    _walk_own,
    find_function,
    split_lines,
)

HAND_EDIT_MODES = ("refuse", "take_over")

# The environment writes SGLang itself makes in _set_envs_and_config (srt/server.py 0.3.6-0.4.1.post6,
# srt/entrypoints/engine.py 0.4.1.post7-0.5.23, engine.py and worker_launch.py of the development branch at
# 874400b4), as :func:`statement_key` spells them. Re-check a new release with
# ``tests/support/sglang_nccl_writes.py --all VERSION`` (tests/unit/test_gpufleet_sglang_hand_edits.py checks every
# cached release has no hand write).
SGLANG_OWN_WRITES = frozenset((
    'os.environ.setdefault("NCCL_CUMEM_ENABLE","1")',
    'os.environ.setdefault("NCCL_MNNVL_ENABLE","1")',
    'os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]="4"',
    'os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]="8"',
    'os.environ["CUDA_MODULE_LOADING"]="AUTO"',
    'os.environ["CUTE_DSL_LOG_LEVEL"]="30"',
    'os.environ["CUTE_DSL_LOG_TO_CONSOLE"]="1"',
    'os.environ["NCCL_CUMEM_ENABLE"]="0"',
    'os.environ["NCCL_CUMEM_ENABLE"]=str(int(cfg.enable_symm_mem))',
    'os.environ["NCCL_CUMEM_ENABLE"]=str(int(cfg.enable_symm_memorkv_shard_symmetric_scratch))',
    'os.environ["NCCL_CUMEM_ENABLE"]=str(int(server_args.enable_symm_mem))',
    'os.environ["NCCL_GRAPH_MIXING_SUPPORT"]="0"',
    'os.environ["NCCL_NVLS_ENABLE"]="0"',
    'os.environ["NCCL_NVLS_ENABLE"]=str(int(cfg.enable_nccl_nvlsorcfg.enable_symm_mem))',
    'os.environ["NCCL_NVLS_ENABLE"]=str(int(server_args.enable_nccl_nvls))',
    'os.environ["NCCL_NVLS_ENABLE"]=str(int(server_args.enable_nccl_nvlsorserver_args.enable_symm_mem))',
    'os.environ["SGLANG_RUN_ID"]=(f"sglang-run-{time.time()}-{random.randint(0,100000000)}")',
    'os.environ["TF_CPP_MIN_LOG_LEVEL"]="3"',
    'os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"]="1"',
    'os.environ["TRTLLM_ENABLE_PDL"]="1"',
))

# Marker of a line the block records as taken over (inside the block, between BEGIN and END).
TAKEN_OVER_PREFIX = "# gpufleet took over line "


class HandEditError(Exception):
    """A hand write that cannot be taken over (shares its line, is the only statement of a branch, sets other
    names too); the message names the line and says what to do."""


def statement_key(source_lines, node):
    """The text of statement ``node`` (its lines joined, whitespace dropped, ``'`` made ``"``): how
    :data:`SGLANG_OWN_WRITES` spells a write, whatever its line breaks and quoting."""
    text = "".join(source_lines[node.lineno - 1:node.end_lineno])
    return "".join(text.split()).replace("'", '"')


def _aliases(tree, function):
    """(names bound to the ``os`` module, names bound to ``os.environ``, names bound to ``os.putenv`` /
    ``os.unsetenv``) by imports at module level or in ``function`` (and plain ``X = os.environ`` there)."""
    modules, environs, calls = {"os"}, set(), {}
    nodes = list(tree.body) + list(_walk_own(function))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "os":
                    modules.add(alias.asname or "os")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and not node.level:
            for alias in node.names:
                if alias.name == "environ":
                    environs.add(alias.asname or "environ")
                elif alias.name in ("putenv", "unsetenv"):
                    calls[alias.asname or alias.name] = alias.name
    for node in nodes:
        if isinstance(node, ast.Assign) and _is_environ(node.value, modules, environs):
            environs.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return modules, environs, calls


def _is_environ(node, modules, environs):
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id in modules
    return isinstance(node, ast.Name) and node.id in environs


def _literal(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _write_names(node, modules, environs, calls):
    """``(form, [names])`` when ``node`` writes the environment, else None; a name that is not a string literal is
    None (a computed name: it may be any variable)."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        keys = [t.slice for t in targets if isinstance(t, ast.Subscript) and _is_environ(t.value, modules, environs)]
        if keys:
            keys = [k.value if type(k).__name__ == "Index" else k for k in keys]  # Python 3.8's ast.Index
            form = {"Assign": "set", "AugAssign": "append", "Delete": "unset"}[type(node).__name__]
            return form, [_literal(k) for k in keys]
        return None
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and _is_environ(func.value, modules, environs):
        if func.attr in ("setdefault", "pop") and node.args:
            return ("setdefault" if func.attr == "setdefault" else "unset"), [_literal(node.args[0])]
        if func.attr == "update":
            names = [kw.arg for kw in node.keywords]  # update(**d): arg None, a computed name
            for arg in node.args:
                names.extend([_literal(k) if k is not None else None for k in arg.keys]
                             if isinstance(arg, ast.Dict) else [None])
            return "update", names
        if func.attr in ("clear", "popitem"):
            return "unset", [None]
        return None
    name = None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
        name = func.attr
    elif isinstance(func, ast.Name):
        name = calls.get(func.id)
    if name in ("putenv", "unsetenv") and node.args:
        return ("set" if name == "putenv" else "unset"), [_literal(node.args[0])]
    return None


def _statement_of(function, node):
    """The innermost statement under ``function`` that holds ``node``, and the body list it is in."""
    best = (None, None)
    stack = [(function, None)]
    while stack:
        parent, dummy = stack.pop()
        for field in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(parent, field, None)
            if not isinstance(body, list):
                continue
            for statement in body:
                if statement is node or any(child is node for child in ast.walk(statement)):
                    best = (statement, body)
                    if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        stack.append((statement, None))
    return best


def find_env_writes(source, filename="<source>", skip_lines=None):
    """Every environment write in ``_set_envs_and_config`` of ``source`` (str), in line order (list of dicts).

    Each: ``line`` and ``end_line`` (1-based, of the whole statement), ``text`` (its first line, stripped), ``form``
    (``set``, ``append``, ``setdefault``, ``update``, ``unset``), ``names`` (list; None for a computed name),
    ``after_anchor`` (bool: the statement comes after the function's ``set_start_method(...)`` call),
    ``sglang_own`` (:func:`is_sglang_own`), ``whole_lines`` (the statement alone on its lines, so its lines can be
    removed) and ``only_statement`` (the only statement of its branch or loop: removing it would leave it empty).
    ``skip_lines``: 1-based lines to leave out (gpufleet's own block). Nested ``def``/``lambda`` bodies are not
    entered (they do not run with the function). An empty list when the function is missing; SyntaxError when
    ``source`` does not parse.
    """
    tree = ast.parse(source, filename=filename)
    functions = find_function(tree)
    if len(functions) != 1:
        return []
    function = functions[0]
    lines = split_lines(source)
    modules, environs, calls = _aliases(tree, function)
    own = list(_walk_own(function))
    anchors = [n.lineno for n in own if _is_start_method_call(n)]
    anchor = min(anchors) if anchors else None
    skip = set(skip_lines or ())
    found, seen = [], set()
    for node in own:
        write = _write_names(node, modules, environs, calls)
        if write is None:
            continue
        statement, body = _statement_of(function, node)
        if statement is None or id(statement) in seen or statement.lineno in skip:
            continue
        seen.add(id(statement))
        first, last = lines[statement.lineno - 1], lines[statement.end_lineno - 1]
        indent = len(first) - len(first.lstrip(" \t"))
        tail = last.encode("utf-8", "surrogateescape")[statement.end_col_offset:].decode("utf-8", "surrogateescape")
        after = anchor is not None and statement.lineno > anchor
        key = statement_key(lines, statement)
        found.append({
            "line": statement.lineno, "end_line": statement.end_lineno, "text": first.strip(),
            "form": write[0], "names": write[1], "after_anchor": after,
            "sglang_own": is_sglang_own(key, after),
            "whole_lines": statement.col_offset == indent and (not tail.strip() or tail.strip().startswith("#")),
            "only_statement": body is not None and len(body) == 1,
        })
    return sorted(found, key=lambda w: w["line"])


def is_sglang_own(key, after_anchor):
    """True when a write spelled ``key`` (:func:`statement_key`) is one SGLang ships: one of
    :data:`SGLANG_OWN_WRITES`, before the start-method statement (no release writes after it)."""
    return not after_anchor and key in SGLANG_OWN_WRITES


def judge_hand_edits(writes, managed):
    """Split hand writes (not SGLang's own) into ``(managed, other)`` lists: ``managed`` set, remove or may set a
    name of ``managed`` (an iterable of names; a computed name may be any), ``other`` only other names."""
    managed = set(managed)
    mine, others = [], []
    for write in writes:
        if write["sglang_own"]:
            continue
        names = write["names"]
        (mine if any(n is None or n in managed for n in names) else others).append(write)
    return mine, others


def describe(write, path):
    """One hand write in words: ``<path>:<line>: <text>``."""
    return "%s:%d: %s" % (path, write["line"], write["text"])


def take_over_lines(source, writes, managed):
    """Remove the lines of ``writes`` (managed hand writes of ``source``) from it.

    Returns ``(new_source, taken)``: ``taken`` a list of ``(line, text)`` (1-based line in ``source``, the exact
    line with its ending). Raises :class:`HandEditError` naming the line for a write gpufleet cannot remove alone: one
    that shares a line with other code, is the only statement of its branch or loop, or also sets names the block
    does not (``update`` of several variables, a computed name).
    """
    managed = set(managed)
    lines = split_lines(source)
    drop = set()
    for write in writes:
        reason = None
        if not write["whole_lines"]:
            reason = "it shares its line with other code"
        elif write["only_statement"]:
            reason = "it is the only statement of its branch or loop, which would be left empty"
        elif any(n is None or n not in managed for n in write["names"]):
            reason = "it also writes %s, which sglang_nccl_env does not set" % ", ".join(
                sorted(n or "a computed name" for n in set(write["names"]) if n is None or n not in managed))
        if reason:
            raise HandEditError("cannot take over line %d (%s): %s; edit that line by hand, then rerun"
                                % (write["line"], write["text"], reason))
        drop.update(range(write["line"], write["end_line"] + 1))
    taken = [(number, lines[number - 1]) for number in sorted(drop)]
    kept = [line for number, line in enumerate(lines, 1) if number not in drop]
    return "".join(kept), taken


def taken_over_comment(line, text, indent, eol):
    """The block's record of one removed line: ``# gpufleet took over line N (state=absent puts it back): '...'``
    (the exact text as an ASCII literal)."""
    return "%s%s%d (state=absent puts it back): %s%s" % (indent, TAKEN_OVER_PREFIX, line, ascii(text), eol)


def read_taken_over(block_lines):
    """``[(line, text)]`` recorded in the block's lines (list of str), in line order; unreadable records skipped."""
    taken = []
    for raw in block_lines:
        stripped = raw.strip()
        if not stripped.startswith(TAKEN_OVER_PREFIX):
            continue
        number, dummy, literal = stripped[len(TAKEN_OVER_PREFIX):].partition(": ")
        try:
            text = ast.literal_eval(literal)
            taken.append((int(number.split()[0]), text))
        except (ValueError, SyntaxError, IndexError):
            continue
    return sorted(taken)


def restore_taken_over(lines, taken):
    """``lines`` (list of str, without the block) with each ``(line, text)`` of ``taken`` put back at its line:
    the file as it was before the take-over. Returns ``(restored_lines, origin)``: origin[i] is the index in
    ``lines`` of restored line i, or None for a line put back."""
    restored, origin = list(lines), list(range(len(lines)))
    for number, text in sorted(taken):
        index = min(number - 1, len(restored))
        restored.insert(index, text)
        origin.insert(index, None)
    return restored, origin


def hand_edit_entry(write, path, action):
    """The RV entry for one hand write: ``path``, ``line``, ``text``, ``names``, ``after_anchor``, ``action``
    (``refused``, ``taken_over``, ``kept``, ``reported``)."""
    return {"path": path, "line": write["line"], "text": write["text"], "names": write["names"],
            "after_anchor": write["after_anchor"], "action": action}


__all__ = ["FUNCTION_NAME", "HAND_EDIT_MODES", "HandEditError", "SGLANG_OWN_WRITES", "describe", "find_env_writes",
           "hand_edit_entry", "is_sglang_own", "judge_hand_edits", "read_taken_over", "restore_taken_over",
           "statement_key", "take_over_lines", "taken_over_comment"]
