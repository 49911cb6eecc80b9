# -*- coding: utf-8 -*-
# gpufleet: the NCCL block plan of sglang_nccl_patch as plain functions: what each file that defines
# _set_envs_and_config holds and what the patch would make of it (nothing is written here). sglang_nccl_patch
# (which then writes) and sglang_fleet_check_info (check.yml's read) call them.
from __future__ import absolute_import, division, print_function

import ast
import hashlib
import os
import re
import sys

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl import env_value_problems, name_problem
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_hand_edits import (
    HandEditError,
    describe,
    find_env_writes,
    hand_edit_entry,
    judge_hand_edits,
    read_taken_over,
    restore_taken_over,
    take_over_lines,
    taken_over_comment,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import (
    ANCHOR_TEXT,
    FUNCTION_NAME,
    MANAGED_BEGIN,
    MANAGED_END,
    SGLangLocateError,
    find_anchor,
    locate_sglang,
    package_relative,
    managed_block_lines,
    split_lines,
)

# fullmatch, not match: "$" would accept a trailing newline.
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BEGIN_MARKER = MANAGED_BEGIN
END_MARKER = MANAGED_END
BEGIN_HINT = " (managed by gpufleet, do not edit by hand: change sglang_nccl_env and run playbooks/patch.yml)"


class PatchError(Exception):
    """Invalid input or a file the module refuses to change (message says what and what to do)."""


class HandEditRefused(PatchError):
    """Hand-typed writes of variables the block sets (``hand_edits=refuse``); ``entries`` lists them."""

    def __init__(self, message, entries):
        super(HandEditRefused, self).__init__(message)
        self.entries = entries


def normalise_env(env, unchecked=()):
    """Validate ``env`` (mapping name -> str|int) and return a list of ``(name, str value)`` sorted by name.

    Raises :class:`PatchError` listing every invalid entry: a name not matching ``^[A-Za-z_][A-Za-z0-9_]*$``,
    a bool/float/None/list/dict value (ambiguous string form: quote it), a value with NUL (the environment
    cannot hold it) or with a lone surrogate (``os.environ`` cannot encode it), and a value NCCL would refuse
    or misread (module_utils ``gpufleet_nccl``), except for the names in ``unchecked``.
    """
    problems = []
    items = []
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            problems.append("name %r is not a valid environment variable name (^[A-Za-z_][A-Za-z0-9_]*$)"
                            % (name,))
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            problems.append("%s: value %r of type %s is refused; quote the exact string you mean, for example "
                            "'1' (NCCL's switches are integers: it reads 'true' as 0)"
                            % (name, value, type(value).__name__))
            continue
        text = value if isinstance(value, str) else str(value)
        if "\x00" in text:
            problems.append("%s: value contains NUL, which an environment variable cannot hold" % name)
            continue
        try:
            text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            problems.append("%s: value contains a lone surrogate that os.environ cannot encode" % name)
            continue
        items.append((name, text))
    problems.extend(filter(None, (name_problem(name) for name, dummy in items)))
    value_problems = env_value_problems(items, unchecked)
    problems.extend(value_problems)
    if problems:
        raise PatchError("invalid env: " + "; ".join(problems) + (
            ". If your NCCL release takes such a value, name the variable in sglang_nccl_env_unchecked (module "
            "option unchecked)" if value_problems else ""))
    return sorted(items)


def render_block(items, indent, eol, taken=()):
    """The managed block as a list of whole lines (each ending with ``eol``), indented with ``indent``.

    Names and values are written with :func:`ascii`, which gives an ASCII-only literal that evaluates to the
    same str for any text, so the file's encoding and the value's quotes, backslashes or newlines never matter.
    ``taken``: ``(line, text)`` of hand-typed lines taken over, recorded as comments so ``absent`` puts them back.
    """
    lines = [indent + BEGIN_MARKER + BEGIN_HINT + eol]
    lines.extend(taken_over_comment(number, text, indent, eol) for number, text in taken)
    for name, value in items:
        lines.append("%sos.environ[%s] = %s%s" % (indent, ascii(name), ascii(value), eol))
    lines.append(indent + END_MARKER + eol)
    return lines


def find_block(text):
    """``(begin_index, end_index)`` (0-based, inclusive) of the managed block in ``text``, or None.

    Raises :class:`PatchError` when the markers are malformed: BEGIN without END, END without BEGIN, END
    before BEGIN, or more than one block.
    """
    try:
        found = managed_block_lines(text)
    except SGLangLocateError as exc:
        raise PatchError("%s; fix or remove the marker lines by hand, or reinstall the sglang wheel, then run "
                         "again" % exc)
    return None if found is None else (found[0] - 1, found[1] - 1)


def plan_patch(text, items, state, filename="<source>", hand_edits="refuse"):
    """Compute the new file content (plain function, no I/O).

    ``text``: current content (str, line endings as in the file). ``items``: from :func:`normalise_env`.
    ``state``: ``"present"`` or ``"absent"``. ``hand_edits``: what to do with hand-typed writes of a variable the
    block sets, anywhere in ``_set_envs_and_config`` outside the block (module_utils ``gpufleet_sglang_hand_edits``):
    ``refuse`` raises :class:`HandEditRefused` naming each; ``take_over`` removes their lines and records them in
    the block, so ``absent`` puts them back and the file is again as it was before gpufleet touched it. Lines a
    block already took over stay taken over in either mode (they are not in effect).

    Returns a dict: ``after`` (str), ``changed`` (bool), ``line`` (1-based first line of the block in
    ``after`` or None), ``placement`` (:func:`find_anchor`'s, or None without a block), ``hand_edits`` (list: each
    hand write with ``action`` ``taken_over`` (now), ``kept`` (taken over before) or ``reported`` (other names,
    left as they are)). Raises :class:`PatchError` (malformed block, a line that cannot be taken over),
    :class:`HandEditRefused` or
    :class:`~ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang.SGLangLocateError` (function or anchor missing).
    """
    lines = split_lines(text)
    block = find_block(text)
    taken_before = []
    if block is not None:
        begin, end = block
        taken_before = read_taken_over(lines[begin + 1:end])
        lines = lines[:begin] + lines[end + 1:]
    # The file as it was before gpufleet touched it: lines a take-over removed are back at their places.
    restored, origin = restore_taken_over(lines, taken_before)
    pristine = "".join(restored)

    def now(write):
        """``write`` with its line as the file has it now (the block before it counted); a line taken over before
        keeps the number it had."""
        index = origin[write["line"] - 1]
        if index is None:
            return write
        shift = (block[1] - block[0] + 1) if block is not None and index >= block[0] else 0
        return dict(write, line=index + shift + 1, end_line=write["end_line"] - write["line"] + index + shift + 1)

    if state == "absent" or not items:
        return {"after": pristine, "changed": pristine != text, "line": None, "placement": None, "hand_edits": []}
    names = [name for name, dummy in items]
    mine, others = judge_hand_edits(find_env_writes(pristine, filename=filename), names)
    before = set(number for number, dummy in taken_before)
    new = [w for w in mine if not before.intersection(range(w["line"], w["end_line"] + 1))]
    if new and hand_edits != "take_over":
        shown = [now(w) for w in new]
        raise HandEditRefused(hand_edit_message(filename, shown),
                              [hand_edit_entry(w, filename, "refused") for w in shown])
    try:
        source, taken = take_over_lines(pristine, mine, names)
    except HandEditError as exc:
        raise PatchError("%s: %s" % (filename, exc))
    entries = [hand_edit_entry(now(w), filename, "taken_over" if w in new else "kept") for w in mine]
    entries += [hand_edit_entry(now(w), filename, "reported") for w in others]
    lines = split_lines(source)
    anchor = find_anchor(source, filename=filename)
    index = anchor["anchor_line"] - 1
    # Line endings follow the statement the block goes before, or (end of the body) the line it follows.
    if anchor["placement"] == "end_of_body":
        eol = _line_ending(lines[index - 1]) or "\n"
    else:
        eol = _line_ending(lines[index]) or (_line_ending(lines[index - 1]) if index else "") or "\n"
    new_lines = lines[:index] + render_block(items, anchor["indent"], eol, taken) + lines[index:]
    after = "".join(new_lines)
    return {"after": after, "changed": after != text, "line": index + 1, "placement": anchor["placement"],
            "hand_edits": sorted(entries, key=lambda e: e["line"])}


def hand_edit_message(path, writes):
    """Why a file with hand-typed writes of the block's variables is refused, and the two ways on."""
    return ("%d hand-typed line(s) in %s() write variables the NCCL block sets, outside it: %s. SGLang ships no such "
            "line; one after %s overrides the block's value in every TP worker, one before it comes back when the "
            "variable leaves sglang_nccl_env. Remove them (put the values into sglang_nccl_env), or set "
            "sglang_nccl_patch_hand_edits=take_over (module option hand_edits) to have the patch remove them: the "
            "backup and the block keep them, and state=absent puts them back"
            % (len(writes), FUNCTION_NAME, "; ".join(
                describe(w, path) + (" (after %s)" % ANCHOR_TEXT if w["after_anchor"] else "") for w in writes),
               ANCHOR_TEXT))


def _line_ending(line):
    for ending in ("\r\n", "\n", "\r"):
        if line.endswith(ending):
            return ending
    return ""


def read_block_env(text):
    """The variables the managed block in ``text`` (str) sets now (name -> str), or None when there is no block.

    Only lines of the form the module writes are read (``os.environ[<literal>] = <literal>``); a block edited
    into another form gives the lines it can read. Raises :class:`PatchError` for malformed markers.
    """
    found = find_block(text)
    if found is None:
        return None
    env = {}
    for line in split_lines(text)[found[0] + 1:found[1]]:
        try:
            node = ast.parse(line.strip()).body[0]
        except (SyntaxError, ValueError, IndexError):
            continue
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            key = node.targets[0].slice
            if type(key).__name__ == "Index":  # Python 3.8 wraps the key in ast.Index
                key = key.value
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                env[key.value] = node.value.value
    return env


def previous_name(entry):
    """File name of a planned file's rollback copy in ``previous_dir``: its path inside the sglang package with
    dots, e.g. ``srt.entrypoints.engine.py.prev`` (unique per file, readable in a listing); its base name outside."""
    return (entry["relative"] or os.path.basename(entry["path"])).replace("/", ".") + ".prev"


def plan_files(found, items, state, release="sglang version unknown", hand_edits="refuse"):
    """Read and plan every file in ``found['paths']``; nothing is written.

    Returns ``(planned, refused)``. ``planned``: one dict per file that can be patched: ``path``, ``relative``,
    ``raw`` (bytes now), ``text``, ``plan`` (:func:`plan_patch`), ``data`` (bytes after), ``block``
    (``none``/``same``/``other``: what the file holds now against ``items``), ``block_env``, ``mtime``.
    ``refused``: one dict per file that cannot (``path``, ``relative``, ``error``: what is wrong and what to do;
    ``hand_edits`` when hand-typed lines were the reason). ``hand_edits``: :func:`plan_patch`'s. Every file is
    planned even after one is refused, so a caller can still judge the others (check.yml).
    """
    planned, refused = [], []
    for path in found["paths"]:
        relative = package_relative(found.get("package_dir"), path)
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
            mtime = os.stat(path).st_mtime
        except (IOError, OSError) as exc:
            refused.append({"path": path, "relative": relative, "error": "cannot read %s: %s" % (path, exc)})
            continue
        # surrogateescape keeps any byte sequence, so unchanged parts are written back byte for byte.
        text = raw.decode("utf-8", "surrogateescape")
        try:
            plan = plan_patch(text, items, state, filename=path, hand_edits=hand_edits)
            block_env = read_block_env(text)
        except HandEditRefused as exc:
            refused.append({"path": path, "relative": relative, "hand_edits": exc.entries,
                            "error": "cannot patch %s (%s): %s" % (path, release, exc)})
            continue
        except SGLangLocateError as exc:
            refused.append({"path": path, "relative": relative, "error": (
                "cannot patch %s (%s): %s. This shape of %s() is new to this module version (it puts the block "
                "before the function's %s statement, or at the end of its body when there is none)"
                % (path, release, exc, FUNCTION_NAME, ANCHOR_TEXT))})
            continue
        except PatchError as exc:
            refused.append({"path": path, "relative": relative, "error": "cannot patch %s (%s): %s" % (path, release, exc)})
            continue
        except SyntaxError as exc:
            refused.append({"path": path, "relative": relative, "error": (
                "cannot parse %s (%s) with Python at %s: %s. Run the module with ansible_python_interpreter set to "
                "the SGLang virtualenv's python" % (path, release, sys.executable, exc))})
            continue
        planned.append({
            "path": path, "raw": raw, "text": text, "plan": plan, "mtime": mtime, "relative": relative,
            "data": plan["after"].encode("utf-8", "surrogateescape"),
            "block_env": block_env,
            "block": "none" if block_env is None else ("same" if block_env == dict(items) else "other"),
        })
    return planned, refused


def file_result(entry, written):
    """The RV ``files`` entry of one planned file (``written``: its new bytes are in place)."""
    plan = entry["plan"]
    return {"path": entry["path"], "relative": entry["relative"], "changed": plan["changed"], "line": plan["line"],
            "placement": plan.get("placement"), "block": entry["block"], "block_env": entry["block_env"],
            "mtime": entry["mtime"],
            "sha256": hashlib.sha256(entry["data"] if written else entry["raw"]).hexdigest(),
            "backup_file": entry.get("backup_file"), "previous_file": entry.get("previous_file"),
            "previous_sha256": entry.get("previous_sha256")}


def plan_block(python=None, path=None, env=None, unchecked=(), state="present", hand_edits="refuse", run=None,
               here=False, package=None):
    """The NCCL block plan of every file of the sglang package (found by ``python``, or ``path``) that defines
    _set_envs_and_config, against ``env``; nothing is written. ``run(argv)`` runs a command as
    ``AnsibleModule.run_command`` does; ``here`` and ``package`` as for
    :func:`~ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang.locate_sglang`.

    Returns ``{"result", "items", "planned"}``: ``result`` holds sglang_nccl_patch's result keys ``changed``
    (whether the patch would change a file), ``path``, ``paths``, ``files`` (:func:`file_result` entries; a refused
    file ``path``, ``relative``, ``error``), ``sglang_version``, ``version_source``, ``scan``, ``hand_edits``, and
    ``failed``/``msg`` (and rc/stdout/stderr) where the module fails before writing (bad env, sglang not found,
    a file refused: every file is still judged); ``items`` is :func:`normalise_env`'s list, ``planned``
    :func:`plan_files`' (for a caller that writes). The disk space and compile checks of a write are the
    module's.
    """
    result = dict(changed=False, path=path, paths=[path] if path else [], files=[], sglang_version=None,
                  version_source=None, scan=None, hand_edits=[])
    out = {"result": result, "items": [], "planned": []}
    try:
        out["items"] = items = normalise_env(env, unchecked) if state == "present" else []
    except PatchError as exc:
        result.update(failed=True, msg=str(exc))
        return out
    try:
        found = locate_sglang(python=python, path=path, run=run, here=here, package=package)
    except SGLangLocateError as exc:
        result.update(failed=True, msg="%s (looking for every file of the sglang package that defines %s())"
                      % (exc, FUNCTION_NAME), rc=getattr(exc, "rc", None), stdout=getattr(exc, "stdout", None),
                      stderr=getattr(exc, "stderr", None))
        return out
    result.update(path=found["path"], paths=list(found["paths"]), sglang_version=found["version"],
                  version_source=found["version_source"], scan=found.get("scan"))
    release = "sglang %s" % (found["version"] or "version unknown")
    planned, refused = plan_files(found, items, state, release, hand_edits)
    out["planned"] = planned
    result["hand_edits"] = [h for e in planned for h in e["plan"].get("hand_edits", [])] + [
        h for r in refused for h in r.get("hand_edits", [])]
    if refused:
        # Every file is judged (check.yml reads the others' blocks from this failure), none is written.
        judged = dict((e["path"], file_result(e, False)) for e in planned)
        judged.update((r["path"], r) for r in refused)
        result["files"] = [judged[p] for p in found["paths"]]
        result.update(failed=True, msg=refused_message(refused))
    return out


def check_block(python=None, path=None, env=None, unchecked=(), state="present", hand_edits="refuse", run=None,
                here=False, package=None):
    """sglang_nccl_patch's answer in check mode as check.yml judges it (:func:`plan_block`'s ``result``, with
    ``files`` for every planned file): ``changed`` says whether the patch would change a file."""
    out = plan_block(python, path, env, unchecked, state, hand_edits, run, here, package)
    result = out["result"]
    if not result.get("failed"):
        result["files"] = [file_result(e, False) for e in out["planned"]]
        result["changed"] = any(e["plan"]["changed"] for e in out["planned"])
    return result


def refused_message(refused):
    """The failure message of a plan with refused files (the first one's error, the others named)."""
    return "%s.%s No file was changed." % (
        refused[0]["error"], (" %d more file(s) refused: %s." % (len(refused) - 1, ", ".join(
            r["path"] for r in refused[1:]))) if len(refused) > 1 else "")
