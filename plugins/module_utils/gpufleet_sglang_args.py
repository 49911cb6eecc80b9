# -*- coding: utf-8 -*-
# gpufleet: SGLang launch flags, read from an installed release without importing it.
"""Read SGLang's command-line options from source (or ``--help``) and check launch flags against them.

Nothing here imports ``sglang``: importing it pulls torch and CUDA. The release's argument definitions
are read with :mod:`ast` from ``sglang/srt/server_args.py`` in the two styles seen in real wheels:

* ``add_argument`` style (0.4.x up to 0.5.13): ``ServerArgs.add_cli_args`` calls
  ``parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, ...)`` for every option.
* dataclass-field style (0.5.14 and later): fields are annotated ``A[T, "help"]`` or
  ``A[T, Arg(choices=..., aliases=[...], ...)]`` and ``add_cli_args`` calls
  ``add_cli_args_from_dataclass(parser, ServerArgs)``; the flag is ``--`` + field name with ``_`` → ``-``.
  From 0.5.20 the fields live in namespace classes under ``sglang/srt/arg_groups/fields/`` listed in
  ``_INPUT_NAMESPACES`` in ``server_args.py``. A few flags (deprecated aliases, dynamic choices, ``--config``)
  are still registered with ``add_argument`` in ``add_cli_args``.

Flags are then checked with the rules of Python's :mod:`argparse`, which SGLang's ``prepare_server_args``
uses with ``allow_abbrev`` left on: an exact option string wins; otherwise a prefix of exactly one long
option string is accepted as an abbreviation (``--tp`` → ``--tp-size``), and a prefix of several is the
error ``ambiguous option: --x could match --x-a, --x-b`` (this is why ``--cuda-graph-max-bs`` fails from
0.5.20: both ``--cuda-graph-max-bs-decode`` and ``--cuda-graph-max-bs-prefill`` start with it).

An option is a plain ``dict``::

    {"option_strings": ["--tp-size", "--tensor-parallel-size"], "dest": "tp_size",
     "nargs": None | 0 | "?" | "*" | "+" | int, "type": "int" | "float" | "str" | None,
     "type_name": "int" | "human_readable_int" | ..., "choices": [..] | None, "choices_known": bool,
     "action": "store" | "store_true" | "BooleanOptionalAction" | "DeprecatedAliasStoreAction" | ...,
     "required": bool, "deprecated": bool, "new_flag": str | None, "source": "srt/server_args.py:1234",
     "choices_note": str | None, "choices_expr": str | None, "converter": {"name", "rejects"} | None}

Choices are often kept outside the ``add_argument`` call: module-level lists in another file, the keys of a
class-level dict (``list(ReasoningParser.DetectorMap.keys())``), a function returning a names module
(``_tool_call_parser_choices()``, 0.5.23), the members of an Enum; the evaluator below follows those.
``choices_note`` says how the release can add names at run time (an ``add_*_choices`` helper for plugins, a
parser registry plugins fill): the names read are still the ones checked, and a refusal says so.

``type`` is ``None`` when the release converts the value with its own function (``human_readable_int``,
``json.loads``…): such values are not type-checked here, unless ``converter`` describes a pass-through
function (``nullable_str``, ``parse_cuda_graph_backend_arg``). ``choices_known`` is false when the choices
cannot be read (``choices_expr`` holds the expression): such values are not choice-checked here. Either way
:func:`check_launch_args` lists the flag in its ``unchecked`` result.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import abbreviates

SERVER_ARGS_REL = os.path.join("srt", "server_args.py")
ARG_UTILS_REL = os.path.join("srt", "arg_groups", "arg_utils.py")

# argparse adds -h/--help to every parser (add_help=True); it takes part in prefix matching.
_HELP_OPTION = {
    "option_strings": ["-h", "--help"], "dest": "help", "nargs": 0, "type": None, "type_name": None,
    "choices": None, "choices_known": True, "action": "help", "required": False, "deprecated": False,
    "new_flag": None, "source": "argparse",
}

_BUILTIN_TYPES = {"int": "int", "float": "float", "str": "str"}
# argparse actions that never take a value on the command line.
_ZERO_ARG_ACTIONS = {"store_true", "store_false", "store_const", "append_const", "count", "help",
                     "version", "BooleanOptionalAction"}
_UNRESOLVED = object()


class SglangArgsError(Exception):
    """The release's argument definitions could not be read (file missing or unparsable)."""


# --------------------------------------------------------------------------------------------------
# Static reading: a tiny evaluator for the constant expressions SGLang uses for choices and defaults
# --------------------------------------------------------------------------------------------------

_TREES = {}


def _parse(path):
    """Syntax tree of a source file, parsed once per process (read_static and read_speculative_algorithms
    both read server_args.py: 0.3 s a parse for 0.5.12's 6 000 lines)."""
    try:
        stat = os.stat(path)
        key = (path, stat.st_mtime_ns, stat.st_size)
        if key in _TREES:
            return _TREES[key]
        with open(path, "rb") as handle:
            source = handle.read().decode("utf-8")
    except (IOError, OSError) as exc:
        raise SglangArgsError("cannot read %s: %s" % (path, exc))
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise SglangArgsError("cannot parse %s: %s" % (path, exc))
    _TREES[key] = tree
    return tree


class _Module(object):
    """One parsed source file of the package, with its imports from the package resolved lazily."""

    def __init__(self, reader, rel_path):
        self.reader = reader
        self.rel_path = rel_path
        path = os.path.join(reader.package_dir, rel_path)
        self.tree = _parse(path)
        reader.files_read.append(path)
        self.assignments = {}
        self.classes = {}
        self.functions = {}
        self.imports = {}
        # ``from .common import *`` (0.5.4's srt/utils/__init__.py re-exports srt/utils/common.py this way)
        self.star_imports = []
        self._hooks = None
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.assignments[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                self.assignments[node.target.id] = node.value
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ImportFrom):
                self._add_import(node, override=True)
            elif isinstance(node, ast.Try):
                # Optional imports sit in try blocks; their names still resolve when the file exists.
                for sub in node.body:
                    if isinstance(sub, ast.ImportFrom):
                        self._add_import(sub, override=False)

    def import_target(self, node):
        """Dotted ``sglang.…`` module an ImportFrom names (relative ones resolved), or None if outside."""
        if not node.level:
            return node.module if node.module and node.module.startswith("sglang.") else None
        package = ["sglang"] + self.rel_path[:-len(".py")].split(os.sep)[:-1]
        if node.level > 1:
            package = package[:-(node.level - 1)]
        if not package:
            return None
        return ".".join(package + (node.module.split(".") if node.module else []))

    def _add_import(self, node, override):
        dotted = self.import_target(node)
        if dotted is None:
            return
        for alias in node.names:
            if alias.name == "*":
                self.star_imports.append(dotted)
            elif override:
                self.imports[alias.asname or alias.name] = (dotted, alias.name)
            else:
                self.imports.setdefault(alias.asname or alias.name, (dotted, alias.name))

    def resolve_name(self, name, depth=0):
        """(module, node) that defines ``name`` (an assignment value, a ClassDef or a FunctionDef), or
        (None, None)."""
        if depth > 8:
            return None, None
        if name in self.assignments:
            return self, self.assignments[name]
        if name in self.classes:
            return self, self.classes[name]
        if name in self.functions:
            return self, self.functions[name]
        if name in self.imports:
            module_name, original = self.imports[name]
            other = self.reader.module_for(module_name)
            if other is not None:
                return other.resolve_name(original, depth + 1)
            return None, None
        for module_name in self.star_imports:
            other = self.reader.module_for(module_name)
            if other is not None:
                owner, value = other.resolve_name(name, depth + 1)
                if owner is not None:
                    return owner, value
        return None, None

    def extension_hooks(self):
        """Module-level lists this file lets other code grow: ``{list name: hook name}``.

        SGLang keeps most choice lists as module-level lists with a public helper that extends them for
        platform plugins: ``def add_attention_backend_choices(choices): ATTENTION_BACKEND_CHOICES.extend(
        choices)`` (srt/server_args.py, 0.5.4–0.5.14) or ``add_attention_backend_choices =
        ATTENTION_BACKEND_CHOICES.extend`` (srt/arg_groups/choices.py, 0.5.20+). No caller ships in the wheel.
        """
        if self._hooks is None:
            self._hooks = {}
            growers = ("extend", "append", "insert", "update", "add")
            for node in self.tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) \
                        and node.value.attr in growers and isinstance(node.value.value, ast.Name):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            self._hooks.setdefault(node.value.value.id, target.id)
                elif isinstance(node, ast.FunctionDef) and len(node.body) <= 2:
                    # the helpers are one-liners; walking every function of utils/common.py costs 0.1 s
                    for sub in ast.walk(node):
                        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) \
                                and sub.func.attr in growers and isinstance(sub.func.value, ast.Name) \
                                and sub.func.value.id in self.assignments:
                            self._hooks.setdefault(sub.func.value.id, node.name)
        return self._hooks


class _Reader(object):
    def __init__(self, package_dir):
        self.package_dir = package_dir
        self.files_read = []
        self._modules = {}
        self._plugins = None

    def module(self, rel_path):
        if rel_path not in self._modules:
            self._modules[rel_path] = _Module(self, rel_path)
        return self._modules[rel_path]

    def loads_plugins(self):
        """True when the release loads ``sglang.srt.plugins`` entry points before it parses the command
        line: ``load_plugins()`` in launch_server.py (and cli/serve.py), from 0.5.11."""
        if self._plugins is None:
            module = self.module_for("sglang.launch_server")
            self._plugins = module is not None and any(
                isinstance(n, ast.Call) and _subscript_parts(n.func)[0] == "load_plugins"
                for n in ast.walk(module.tree))
        return self._plugins

    def module_for(self, dotted):
        """Parsed module for ``sglang.a.b`` (file a/b.py or a/b/__init__.py), or None if absent."""
        parts = dotted.split(".")[1:]
        for rel in (os.path.join(*parts) + ".py" if parts else None,
                    os.path.join(*(parts + ["__init__.py"]))):
            if rel and os.path.isfile(os.path.join(self.package_dir, rel)):
                try:
                    return self.module(rel)
                except SglangArgsError:
                    return None
        return None


class _Imported(object):
    """A name a function imports inside its body (``from sglang.x import NAMES``), resolved when used."""

    def __init__(self, dotted, name):
        self.dotted = dotted
        self.name = name

    def resolve(self, reader):
        """(module, node) that defines the imported name in ``reader``'s package, or (None, None)."""
        other = reader.module_for(self.dotted)
        return other.resolve_name(self.name) if other is not None else (None, None)


def _evaluate(module, node, local=None, depth=0):
    """Value of a constant expression (lists of literals, names bound to them, ``a + b``, ``list(x)``,
    ``Class.ATTR``, the keys of a dict (``list(X.DetectorMap.keys())``), a call of a module function
    without arguments that returns such a value), or ``_UNRESOLVED`` when it needs run time (plugin
    registries). A dict's values that are not literals (classes in parser registries) stay unresolved:
    only its keys are used as choices."""
    if node is None or depth > 12:
        return _UNRESOLVED
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.Name):
        if local and node.id in local:
            entry = local[node.id]
            if isinstance(entry, _Imported):
                owner, value = entry.resolve(module.reader)
                if owner is None or not isinstance(value, ast.expr):
                    return _UNRESOLVED
                return _evaluate(owner, value, None, depth + 1)
            return _evaluate(module, entry, local, depth + 1)
        owner, value = module.resolve_name(node.id)
        if owner is None or not isinstance(value, ast.expr):
            return _UNRESOLVED
        return _evaluate(owner, value, None, depth + 1)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = []
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                inner = _evaluate(module, elt.value, local, depth + 1)
                if inner is _UNRESOLVED:
                    return _UNRESOLVED
                items.extend(inner)
                continue
            value = _evaluate(module, elt, local, depth + 1)
            if value is _UNRESOLVED:
                return _UNRESOLVED
            items.append(value)
        return items
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:  # {**OTHER}
                inner = _evaluate(module, value, local, depth + 1)
                if not isinstance(inner, dict):
                    return _UNRESOLVED
                out.update(inner)
                continue
            key_value = _evaluate(module, key, local, depth + 1)
            if key_value is _UNRESOLVED or isinstance(key_value, (list, dict)):
                return _UNRESOLVED
            try:
                out[key_value] = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                out[key_value] = _UNRESOLVED  # a class or function: only the keys are used (choices)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _evaluate(module, node.left, local, depth + 1)
        right = _evaluate(module, node.right, local, depth + 1)
        if left is _UNRESOLVED or right is _UNRESOLVED or isinstance(left, dict) or isinstance(right, dict):
            return _UNRESOLVED
        try:
            return list(left) + list(right)
        except TypeError:
            return _UNRESOLVED
    if isinstance(node, ast.ListComp) and len(node.generators) == 1 and not node.generators[0].ifs \
            and isinstance(node.generators[0].target, ast.Name):
        # [m.name.lower() for m in RealKvHashMode] (--kv-canary-real-data, 0.5.14+)
        members = _enum_members(module, node.generators[0].iter, local)
        if members is None:
            members = _evaluate(module, node.generators[0].iter, local, depth + 1)
        if not isinstance(members, list):
            return _UNRESOLVED
        items = [_evaluate_member(node.elt, node.generators[0].target.id, m) for m in members]
        return _UNRESOLVED if any(i is _UNRESOLVED for i in items) else items
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 \
            and node.func.id in ("list", "tuple", "set", "sorted", "frozenset") and not node.keywords:
        members = _enum_members(module, node.args[0], local)
        if members is not None:
            return members
        inner = _evaluate(module, node.args[0], local, depth + 1)
        if inner is _UNRESOLVED or not isinstance(inner, (list, tuple, dict, str, set, frozenset)):
            return _UNRESOLVED
        if node.func.id == "sorted" or isinstance(inner, (set, frozenset)) or node.func.id in ("set", "frozenset"):
            return sorted(inner, key=str)  # a set's order changes from run to run (string hashing)
        return list(inner)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "keys" \
            and not node.args and not node.keywords:
        inner = _evaluate(module, node.func.value, local, depth + 1)
        return list(inner) if isinstance(inner, dict) else _UNRESOLVED
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args and not node.keywords \
            and not (local and node.func.id in local):
        owner, func = module.resolve_name(node.func.id)
        if isinstance(func, ast.FunctionDef):
            scope = _function_return(func)
            if scope is not None:
                return _evaluate(owner, scope[0], scope[1], depth + 1)
        return _UNRESOLVED
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        owner, cls = module.resolve_name(node.value.id)
        if isinstance(cls, ast.ClassDef):
            value = _class_attribute(cls, node.attr)
            if value is not None:
                # Class-body names (``ALL = (FULL, BREAKABLE, DISABLED)``) resolve in the class first.
                return _evaluate(owner, value, _class_scope(cls), depth + 1)
    return _UNRESOLVED


class _EnumMember(object):
    """A member of an Enum class read from source: ``name`` and, when a literal, ``value``."""

    def __init__(self, name, value):
        self.name = name
        self.value = value


_ENUM_BASES = ("Enum", "IntEnum", "StrEnum", "IntFlag", "Flag")


def _enum_members(module, node, local=None):
    """Members of the Enum class ``node`` names (``list(RealKvHashMode)``), or None if it is not one."""
    owner, cls = None, None
    if isinstance(node, ast.Name):
        entry = local.get(node.id) if local else None
        if isinstance(entry, _Imported):
            owner, cls = entry.resolve(module.reader)
        elif entry is None:
            owner, cls = module.resolve_name(node.id)
    if not isinstance(cls, ast.ClassDef) or not any(_subscript_parts(b)[0] in _ENUM_BASES for b in cls.bases):
        return None
    members = []
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and not stmt.targets[0].id.startswith("_"):
            try:
                value = ast.literal_eval(stmt.value)
            except (ValueError, TypeError, SyntaxError):
                value = _UNRESOLVED  # auto() and friends: the name is still known
            members.append(_EnumMember(stmt.targets[0].id, value))
    return members


def _evaluate_member(node, var, member):
    """``m.name``, ``m.value``, ``m.name.lower()``/``.upper()`` for one enum member bound to ``var``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == var \
            and node.attr in ("name", "value"):
        return getattr(member, node.attr)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args \
            and node.func.attr in ("lower", "upper"):
        inner = _evaluate_member(node.func.value, var, member)
        return getattr(inner, node.func.attr)() if isinstance(inner, str) else _UNRESOLVED
    return _UNRESOLVED


def _class_attribute(cls, name):
    """Value node of ``name = ...`` (or ``name: T = ...``) in a class body, or None."""
    for stmt in cls.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else (
            [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value else [])
        for target in targets:
            if isinstance(target, ast.Name) and target.id == name:
                return stmt.value
    return None


def _class_scope(cls):
    scope = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    scope[target.id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
            scope[stmt.target.id] = stmt.value
    return scope


def _is_docstring(stmt):
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _live_registry_names(func):
    """Names a function binds to ``sys.modules.get(...)``: a module another import already loaded."""
    names = set()
    for stmt in func.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) \
                and _unparse(stmt.value.func) == "sys.modules.get":
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return names


def _function_return(func):
    """(return value node, local scope) of a module function without parameters whose result does not
    depend on run time, or None.

    The body may hold a docstring, imports, assignments, and early returns guarded by ``if <m> is not
    None`` where ``m = sys.modules.get(...)``: SGLang 0.5.23's ``_tool_call_parser_choices()`` returns the
    live registry when a plugin already imported it, else the names in ``function_call/parser_names.py``;
    the final return is the value SGLang uses when nothing was registered at run time.
    """
    args = func.args
    if args.args or args.kwonlyargs or args.vararg or args.kwarg or getattr(args, "posonlyargs", None):
        return None
    if not func.body or not isinstance(func.body[-1], ast.Return) or func.body[-1].value is None:
        return None
    live = _live_registry_names(func)
    scope = {}
    for stmt in func.body[:-1]:
        if _is_docstring(stmt):
            continue
        if isinstance(stmt, ast.ImportFrom):
            dotted = stmt.module if stmt.module and not stmt.level and stmt.module.startswith("sglang.") \
                else None
            for alias in stmt.names:
                if dotted and alias.name != "*":
                    scope[alias.asname or alias.name] = _Imported(dotted, alias.name)
            continue
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            for target in stmt.targets:
                scope[target.id] = stmt.value
            continue
        if isinstance(stmt, ast.If) and not stmt.orelse and _guard_name(stmt.test) in live \
                and all(isinstance(sub, ast.Return) for sub in stmt.body):
            continue
        return None
    return func.body[-1].value, scope


def _guard_name(test):
    """``m`` for the tests ``m is not None`` and ``m``, else None."""
    if isinstance(test, ast.Name):
        return test.id
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and len(test.ops) == 1 \
            and isinstance(test.ops[0], ast.IsNot) and isinstance(test.comparators[0], ast.Constant) \
            and test.comparators[0].value is None:
        return test.left.id
    return None


def _choices_note(module, node, local=None, depth=0):
    """How the release can add choices at run time to those read from ``node``, or None.

    Three shapes are seen in real wheels: a module-level list with an ``add_*_choices`` helper for
    plugins (see :meth:`_Module.extension_hooks`); a function that returns a live registry when a plugin
    imported it first (0.5.23's parser choices); a class-level dict such as
    ``FunctionCallParser.ToolCallParserEnum`` in a release that loads plugins (``sglang.srt.plugins``,
    from 0.5.11) before it parses the command line.
    """
    if node is None or depth > 12:
        return None
    for sub in ast.walk(node):
        note = None
        if isinstance(sub, ast.Name):
            if local and sub.id in local:
                entry = local[sub.id]
                if isinstance(entry, _Imported):
                    owner, value = entry.resolve(module.reader)
                    if owner is not None and isinstance(value, ast.expr):
                        hook = owner.extension_hooks().get(entry.name)
                        note = hook and "plugins can add names with %s() (%s)" % (hook, owner.rel_path)
                elif isinstance(entry, ast.expr) and entry is not node:
                    note = _choices_note(module, entry, local, depth + 1)
            else:
                owner, value = module.resolve_name(sub.id)
                if owner is not None and isinstance(value, ast.expr):
                    hook = owner.extension_hooks().get(sub.id)
                    if hook:
                        note = "plugins can add names with %s() (%s)" % (hook, owner.rel_path)
                    else:
                        note = _choices_note(owner, value, None, depth + 1)
                elif isinstance(value, ast.FunctionDef):
                    scope = _function_return(value)
                    if scope is not None and _live_registry_names(value):
                        note = ("a plugin that registers a parser makes %s() (%s) read the live registry"
                                % (value.name, owner.rel_path))
                    elif scope is not None:
                        note = _choices_note(owner, scope[0], scope[1], depth + 1)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and not (
                local and sub.value.id in local):
            owner, cls = module.resolve_name(sub.value.id)
            if isinstance(cls, ast.ClassDef) and isinstance(_class_attribute(cls, sub.attr), ast.Dict) \
                    and module.reader.loads_plugins():
                note = ("plugins, loaded before the command line is parsed (sglang.srt.plugins), can add "
                        "entries to %s.%s (%s)" % (cls.name, sub.attr, owner.rel_path))
        if note:
            return note
    return None


def _unparse(node):
    """Source text of a small expression (``json.loads``, ``DeprecatedAction``); ast.unparse is Python 3.9+."""
    if hasattr(ast, "unparse"):
        return ast.unparse(node)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _unparse(node.value) + "." + node.attr
    return "?"


def _type_from_node(node):
    """(type, type_name) for an argparse ``type=`` expression."""
    if node is None:
        return "str", None
    name = _unparse(node)
    return _BUILTIN_TYPES.get(name), name


def _converter_rules(module, type_node):
    """What a release's own ``type=`` converter does, when it is a plain pass-through, else None.

    A converter that only returns its argument or None, and raises only for given constants, is checked
    here as argparse would run it: ``nullable_str`` (srt/utils/common.py, every release) turns ``""`` and
    ``"None"`` into None and passes the rest; ``parse_cuda_graph_backend_arg``
    (srt/model_executor/cuda_graph_config.py, 0.5.23) refuses ``tc_piecewise`` with its own message and
    passes the rest to the ``choices`` check. Returns ``{"name": str, "rejects": {value: message}}``.
    """
    if not isinstance(type_node, ast.Name):
        return None
    owner, func = module.resolve_name(type_node.id)
    if not isinstance(func, ast.FunctionDef) or len(func.args.args) != 1 or func.args.vararg \
            or func.args.kwarg or func.args.kwonlyargs:
        return None
    param = func.args.args[0].arg

    def passes(ret):
        return isinstance(ret, ast.Return) and (
            (isinstance(ret.value, ast.Name) and ret.value.id == param)
            or (isinstance(ret.value, ast.Constant) and ret.value.value is None))

    rejects = {}
    for stmt in func.body:
        if _is_docstring(stmt) or passes(stmt):
            continue
        if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 \
                and not any(isinstance(n, ast.Call) for n in ast.walk(stmt.test)):
            if passes(stmt.body[0]):
                continue
            values = _compared_constants(owner, stmt.test, param)
            if isinstance(stmt.body[0], ast.Raise) and values:
                exc = stmt.body[0].exc
                message = None
                if isinstance(exc, ast.Call) and exc.args:
                    message = _evaluate(owner, exc.args[0])
                for value in values:
                    rejects[value] = message if isinstance(message, str) else \
                        "%s refuses %r" % (func.name, value)
                continue
        return None
    return {"name": func.name, "rejects": rejects}


def _compared_constants(module, test, param):
    """The string constants ``param`` is compared with in ``param == "x"`` / ``param in ("x", "y")``."""
    if not (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == param
            and len(test.ops) == 1):
        return None
    value = _evaluate(module, test.comparators[0])
    if isinstance(test.ops[0], ast.Eq) and isinstance(value, str):
        return [value]
    if isinstance(test.ops[0], ast.In) and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _action_nargs(module, action_node):
    """Default ``nargs`` of a custom argparse Action class, read from its ``__init__`` signature.

    SGLang's ``DeprecatedAction``/``DeprecatedStoreTrueAction`` declare ``nargs=0`` there (take no
    value); ``DeprecatedAliasStoreAction`` declares none (takes one value, argparse's default).
    """
    if isinstance(action_node, ast.Attribute):
        # argparse.BooleanOptionalAction and friends
        return 0 if action_node.attr == "BooleanOptionalAction" else None
    if not isinstance(action_node, ast.Name):
        return None
    owner, cls = module.resolve_name(action_node.id)
    if not isinstance(cls, ast.ClassDef):
        return None
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            args = stmt.args.args + stmt.args.kwonlyargs
            defaults = [None] * (len(stmt.args.args) - len(stmt.args.defaults)) + list(stmt.args.defaults) \
                + list(stmt.args.kw_defaults)
            for arg, default in zip(args, defaults):
                if arg.arg == "nargs" and default is not None:
                    value = _evaluate(owner, default)
                    return None if value is _UNRESOLVED else value
    return None


def _make_option(option_strings, dest, action, nargs, type_, type_name, choices, required, source,
                 new_flag=None, choices_note=None, choices_expr=None, converter=None):
    if dest is None:
        longs = [s for s in option_strings if s.startswith("--")]
        dest = (longs or option_strings)[0].lstrip("-").replace("-", "_")
    if action == "BooleanOptionalAction":
        # argparse adds the negative form for every long option string.
        option_strings = list(option_strings) + [
            "--no-" + s[2:] for s in option_strings if s.startswith("--")]
    if action in _ZERO_ARG_ACTIONS:
        nargs = 0
    if isinstance(choices, (set, frozenset)):
        choices = sorted(choices, key=str)
    if isinstance(choices, (list, tuple)) and any(
            c is _UNRESOLVED or isinstance(c, _EnumMember) for c in choices):
        # enum members themselves (``choices=list(Mode)``) or a Literal naming something unreadable
        choices = _UNRESOLVED
    known = choices is not _UNRESOLVED
    return {
        "option_strings": list(option_strings), "dest": dest, "nargs": nargs,
        "type": None if nargs == 0 else type_, "type_name": None if nargs == 0 else type_name,
        "choices": list(choices) if known and choices is not None else None,
        "choices_known": known, "action": action, "required": bool(required),
        "deprecated": action.startswith("Deprecated") or new_flag is not None, "new_flag": new_flag,
        "source": source,
        # how the release can add choices at run time (plugins), for messages; None when it cannot
        "choices_note": choices_note if known and choices is not None else None,
        # the choices expression when it could not be read (``choices_known`` false)
        "choices_expr": None if known else choices_expr,
        # the release's own converter when it is a pass-through checked here (see _converter_rules)
        "converter": None if nargs == 0 else converter,
    }


def _option_from_add_argument(module, call, local, mutations=None):
    names = []
    for arg in call.args:
        value = _evaluate(module, arg, local)
        if isinstance(value, str):
            names.append(value)
        else:
            return None
    if not names or not all(n.startswith("-") for n in names):
        return None
    kw = dict((k.arg, k.value) for k in call.keywords if k.arg)
    action_node = kw.get("action")
    action = "store"
    nargs = None
    if action_node is not None:
        if isinstance(action_node, ast.Constant) and isinstance(action_node.value, str):
            action = action_node.value
        else:
            action = action_node.attr if isinstance(action_node, ast.Attribute) else _unparse(action_node)
            nargs = _action_nargs(module, action_node)
    if "nargs" in kw:
        value = _evaluate(module, kw["nargs"], local)
        nargs = None if value is _UNRESOLVED else value
    type_, type_name = _type_from_node(kw.get("type"))
    choices = _evaluate(module, kw["choices"], local) if "choices" in kw else None
    dest = _evaluate(module, kw["dest"], local) if "dest" in kw else None
    required = _evaluate(module, kw["required"], local) if "required" in kw else False
    new_flag = _evaluate(module, kw["new_flag"], local) if "new_flag" in kw else None
    note, expr = _choices_facts(module, kw.get("choices"), choices, local)
    added = _local_additions(module, kw.get("choices"), mutations)
    if added is _UNRESOLVED:
        choices, note, expr = _UNRESOLVED, None, _unparse(kw["choices"]) + " (changed at run time)"
    elif added and choices is not _UNRESOLVED and choices is not None:
        # 0.5.20+: ``sampling_backend_choices.add("token_oracle")`` when an environment switch is on. The
        # names added are accepted as well: preflight does not see the server's environment.
        choices = list(choices) + [v for v in added[0] if v not in list(choices)]
        note = "; ".join(n for n in (note, "the release adds %s only when %s" % (
            ", ".join(repr(v) for v in added[0]), added[1])) if n)
    return _make_option(names, dest if isinstance(dest, str) else None, action, nargs, type_, type_name,
                        choices, required is True, "%s:%d" % (module.rel_path, call.lineno),
                        new_flag if isinstance(new_flag, str) else None, note, expr,
                        _converter_rules(module, kw.get("type")) if type_ is None else None)


def _choices_facts(module, node, choices, local=None):
    """(run-time extension note, unreadable expression) for a ``choices=`` expression."""
    if node is None:
        return None, None
    if choices is _UNRESOLVED:
        return None, _unparse(node)
    return _choices_note(module, node, local), None


# ---- dataclass-field style -----------------------------------------------------------------------

def _split_annotation(node):
    """(inner type node, metadata nodes) for ``A[T, meta...]``/``Annotated[T, meta...]``, else None."""
    if not isinstance(node, ast.Subscript):
        return None
    base = node.value
    base_name = base.id if isinstance(base, ast.Name) else (base.attr if isinstance(base, ast.Attribute) else "")
    if base_name not in ("A", "Annotated"):
        return None
    inner = node.slice
    if hasattr(ast, "Index") and isinstance(inner, getattr(ast, "Index")):  # Python < 3.9
        inner = inner.value
    if not isinstance(inner, ast.Tuple) or len(inner.elts) < 2:
        return None
    return inner.elts[0], inner.elts[1:]


def _subscript_parts(node):
    """(base name, [argument nodes]) of ``X[a, b]``; (name, []) for a bare name."""
    if isinstance(node, ast.Subscript):
        base = node.value
        name = base.id if isinstance(base, ast.Name) else (base.attr if isinstance(base, ast.Attribute) else "")
        inner = node.slice
        if hasattr(ast, "Index") and isinstance(inner, getattr(ast, "Index")):
            inner = inner.value
        return name, list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
    if isinstance(node, ast.Name):
        return node.id, []
    if isinstance(node, ast.Attribute):
        return node.attr, []
    if isinstance(node, ast.Constant) and node.value is None:
        return "None", []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        # string annotations (from __future__ import annotations written as quotes)
        try:
            return _subscript_parts(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return "", []
    return "", []


def _unwrap_optional(node):
    name, args = _subscript_parts(node)
    if name == "Optional" and len(args) == 1:
        return args[0]
    if name == "Union":
        rest = [a for a in args if _subscript_parts(a)[0] != "None"]
        if len(rest) == 1:
            return rest[0]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [node.left, node.right]
        rest = [s for s in sides if _subscript_parts(s)[0] != "None"]
        if len(rest) == 1:
            return rest[0]
    return node


def _option_from_field(module, name, annotation, has_default):
    """Option for one annotated field, mirroring ``add_cli_args_from_dataclass`` (arg_utils.py, 0.5.14+):
    custom action first, then Optional → Literal (choices) → list (nargs "+") → bool (store_true) →
    scalar. Returns None for fields without CLI surface (no help/Arg metadata, ``no_cli=True``)."""
    parts = _split_annotation(annotation)
    if parts is None:
        return None
    type_node, metas = parts
    meta = None
    for m in metas:
        if isinstance(m, ast.Constant) and isinstance(m.value, str):
            meta = {}
            break
        if isinstance(m, (ast.JoinedStr, ast.BinOp)):  # f-string or concatenated help text
            meta = {}
            break
        if isinstance(m, ast.Call) and _subscript_parts(m.func)[0] == "Arg":
            meta = dict((k.arg, k.value) for k in m.keywords if k.arg)
            break
    if meta is None:
        return None

    def value(key, default=None):
        if key not in meta:
            return default
        result = _evaluate(module, meta[key])
        return default if result is _UNRESOLVED else result

    if value("no_cli") is True:
        return None
    cli_name = value("cli_name") or "--" + name.replace("_", "-")
    names = [cli_name] + list(value("aliases") or [])
    source = "%s:%d" % (module.rel_path, annotation.lineno)
    choices = _evaluate(module, meta["choices"]) if "choices" in meta else None
    note, expr = _choices_facts(module, meta.get("choices"), choices)
    if "action" in meta:
        action_node = meta["action"]
        if isinstance(action_node, ast.Constant) and isinstance(action_node.value, str):
            action, nargs = action_node.value, None
        else:
            action = action_node.attr if isinstance(action_node, ast.Attribute) else _unparse(action_node)
            nargs = _action_nargs(module, action_node)
        kwargs = value("action_kwargs") or {}
        if kwargs.get("nargs", _UNRESOLVED) is not _UNRESOLVED:
            nargs = kwargs["nargs"]
        return _make_option(names, name, action, nargs, "str", None, choices, False, source, None, note, expr)

    type_parser = meta.get("type_parser")
    inner = _unwrap_optional(type_node)
    kind, args = _subscript_parts(inner)
    if kind == "Literal":
        literals = [_evaluate(module, a) for a in args]
        if "choices" not in meta:
            choices = literals
        first = literals[0] if literals else ""
        if type_parser is None:
            # _infer_type_func maps anything but str/int/float to str
            type_name = type(first).__name__ if type(first).__name__ in _BUILTIN_TYPES else "str"
        else:
            type_name = _unparse(type_parser)
        type_ = _BUILTIN_TYPES.get(type_name)
        return _make_option(names, name, "store", None, type_, type_name, choices, False, source, None, note,
                            expr, _converter_rules(module, type_parser) if type_ is None else None)
    if kind in ("List", "list") and type_parser is None:
        elem = _subscript_parts(args[0])[0] if args else "str"
        type_name = elem if elem in _BUILTIN_TYPES else "str"
        return _make_option(names, name, "store", value("nargs") or "+", _BUILTIN_TYPES[type_name], type_name,
                            choices, False, source, None, note, expr)
    if kind == "bool":
        return _make_option(names, name, "store_true", 0, None, None, None, False, source)
    if type_parser is not None:
        type_, type_name = _type_from_node(type_parser)
    else:
        type_name = kind if kind in _BUILTIN_TYPES else "str"
        type_ = _BUILTIN_TYPES[type_name]
    required = value("required")
    if required is None:
        required = not has_default
    return _make_option(names, name, "store", value("nargs"), type_, type_name, choices, required is True,
                        source, None, note, expr,
                        _converter_rules(module, type_parser) if type_ is None and type_parser is not None
                        else None)


def _fields_of_class(module, cls, seen=None):
    """[(module, name, annotation node, has_default)] for a class and its bases found in the package."""
    seen = seen if seen is not None else set()
    key = (module.rel_path, cls.name)
    if key in seen:
        return []
    seen.add(key)
    out = []
    for base in cls.bases:
        base_name = _subscript_parts(base)[0]
        owner, base_cls = module.resolve_name(base_name)
        if isinstance(base_cls, ast.ClassDef):
            out.extend(_fields_of_class(owner, base_cls, seen))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append((module, stmt.target.id, stmt.annotation, stmt.value is not None))
    return out


def _dataclass_sources(module, class_name):
    """Classes whose fields make up ``class_name``: its own body, or the namespace classes listed in
    ``_INPUT_NAMESPACES`` (0.5.20+, where ServerArgs is assembled with ``collect_input_fields``)."""
    sources = []
    owner, cls = module.resolve_name(class_name)
    if isinstance(cls, ast.ClassDef):
        sources.append((owner, cls))
    namespaces = module.assignments.get("_INPUT_NAMESPACES")
    if class_name == "ServerArgs" and isinstance(namespaces, (ast.List, ast.Tuple)):
        for elt in namespaces.elts:
            if isinstance(elt, ast.Name):
                ns_owner, ns_cls = module.resolve_name(elt.id)
                if isinstance(ns_cls, ast.ClassDef):
                    sources.append((ns_owner, ns_cls))
    return sources


def _local_mutations(func):
    """``{local name: [(call node, enclosing if-test or None)]}`` for ``name.add/append/extend/update(...)``
    and ``name += ...`` in a function body."""
    out = {}

    def visit(stmts, test):
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                visit(stmt.body, stmt.test)
                visit(stmt.orelse, stmt.test)
                continue
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                    and isinstance(stmt.value.func, ast.Attribute) and isinstance(stmt.value.func.value, ast.Name) \
                    and stmt.value.func.attr in ("add", "append", "extend", "update", "insert"):
                out.setdefault(stmt.value.func.value.id, []).append((stmt.value, test))
            elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
                out.setdefault(stmt.target.id, []).append((stmt, test))
            for field in ("body", "orelse", "finalbody"):
                if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)) and getattr(stmt, field, None):
                    visit(getattr(stmt, field), test)

    visit(func.body, None)
    return out


def _local_additions(module, node, mutations):
    """Values a function adds to the local ``choices=`` variable after building it, with the condition as
    text: ``([values], "envs.X.get()")``; None when it adds nothing; ``_UNRESOLVED`` when the values cannot
    be read."""
    if not isinstance(node, ast.Name) or not mutations or node.id not in mutations:
        return None
    values, tests = [], []
    for change, test in mutations[node.id]:
        if isinstance(change, ast.AugAssign):
            added = _evaluate(module, change.value)
        elif change.func.attr in ("add", "append") and len(change.args) == 1:
            added = [_evaluate(module, change.args[0])]
        elif change.func.attr in ("extend", "update") and len(change.args) == 1:
            added = _evaluate(module, change.args[0])
        else:
            return _UNRESOLVED
        if added is _UNRESOLVED or not isinstance(added, (list, tuple, set, frozenset, dict)) \
                or any(v is _UNRESOLVED for v in added):
            return _UNRESOLVED
        values.extend(added)
        tests.append(_unparse(test) if test is not None else "always")
    return values, " or ".join(sorted(set(tests)))


def _local_assignments(func):
    local = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    local[target.id] = node.value
    return local


def read_static(package_dir):
    """Read the launch options of the SGLang release in ``package_dir`` (the ``sglang/`` directory).

    Returns ``{"options": [option...], "style": "add_argument" | "dataclass", "files": [paths read],
    "allow_abbrev": bool}``; ``options`` is empty when no definitions were recognised (caller may fall
    back to ``--help``). Raises :class:`SglangArgsError` when ``srt/server_args.py`` cannot be read.
    """
    reader = _Reader(package_dir)
    module = reader.module(SERVER_ARGS_REL)
    server_args = module.classes.get("ServerArgs")
    add_cli = None
    if server_args is not None:
        for stmt in server_args.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "add_cli_args":
                add_cli = stmt
    options = []
    style = "add_argument"
    allow_abbrev = True
    funcs = [add_cli] if add_cli is not None else []
    prepare = [n for n in module.tree.body if isinstance(n, ast.FunctionDef) and n.name == "prepare_server_args"]
    for func in prepare:
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and _subscript_parts(node.func)[0] == "ArgumentParser":
                for kw in node.keywords:
                    if kw.arg == "allow_abbrev":
                        allow_abbrev = _evaluate(module, kw.value) is not False
    for func in funcs:
        local = _local_assignments(func)
        mutations = _local_mutations(func)
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            fname = _subscript_parts(node.func)[0]
            if fname == "add_argument":
                option = _option_from_add_argument(module, node, local, mutations)
                if option is not None:
                    options.append(option)
            elif fname == "add_cli_args_from_dataclass" and len(node.args) >= 2:
                style = "dataclass"
                class_name = _subscript_parts(node.args[1])[0]
                for owner, cls in _dataclass_sources(module, class_name):
                    for f_module, name, annotation, has_default in _fields_of_class(owner, cls):
                        option = _option_from_field(f_module, name, annotation, has_default)
                        if option is not None:
                            options.append(option)
    return {"options": options, "style": style, "files": sorted(set(reader.files_read)),
            "allow_abbrev": allow_abbrev}


def read_speculative_algorithms(package_dir):
    """Built-in ``--speculative-algorithm`` names of the release, upper case, or None if not found.

    From 0.5.14 the flag is a free string (no argparse ``choices``); SGLang checks it later with
    ``SpeculativeAlgorithm.from_string`` (``srt/speculative/spec_info.py``), which takes the enum's member
    names case-insensitively, the ``_RESERVED_ALIASES`` (``NEXTN``) and plugin-registered names, and
    raises ``Unknown speculative algorithm name`` otherwise — after the old server has been stopped.
    """
    reader = _Reader(package_dir)
    rel = os.path.join("srt", "speculative", "spec_info.py")
    if not os.path.isfile(os.path.join(package_dir, rel)):
        return None
    try:
        module = reader.module(rel)
    except SglangArgsError:
        return None
    cls = module.classes.get("SpeculativeAlgorithm")
    if cls is None:
        return None
    names = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name) and target.id.isupper() and target.id != "NONE":
                    names.add(target.id)
    # NEXTN is translated to EAGLE before from_string; 0.5.14+ list it in spec_registry.py.
    for owner in (module, reader.module_for("sglang.srt.speculative.spec_registry")):
        if owner is None:
            continue
        aliases = _evaluate(owner, ast.Name(id="_RESERVED_ALIASES", ctx=ast.Load()))
        if aliases is not _UNRESOLVED:
            names.update(str(a).upper() for a in aliases)
    names.update(_speculative_aliases(reader, names))
    return sorted(names) or None


def _speculative_aliases(reader, builtins):
    """Names that ``srt/server_args.py`` maps onto a built-in algorithm before ``from_string`` runs.

    0.5.12 and 0.5.12.post1 have no ``_RESERVED_ALIASES``: ``ServerArgs._handle_speculative_decoding``
    upper-cases the value, then ``_resolve_speculative_algorithm_alias`` returns ``"EAGLE"`` (or
    ``"FROZEN_KV_MTP"`` for a Gemma4 draft) when it is ``"NEXTN"`` or ``"EAGLE"``. Read: a module
    function with a ``speculative_algorithm`` parameter, called in the file, whose ``if`` compares that
    parameter with string constants and returns a built-in name.
    """
    try:
        module = reader.module(SERVER_ARGS_REL)
    except SglangArgsError:
        return set()
    candidates = [f for f in module.functions.values()
                  if f.args.args and f.args.args[0].arg == "speculative_algorithm"]
    if not candidates:
        return set()
    called = set(_subscript_parts(n.func)[0] for n in ast.walk(module.tree) if isinstance(n, ast.Call))
    aliases = set()
    for func in candidates:
        if func.name not in called:
            continue
        for node in ast.walk(func):
            if not isinstance(node, ast.If):
                continue
            returned = set(
                r.value.value.upper() for r in ast.walk(node) if isinstance(r, ast.Return)
                and isinstance(r.value, ast.Constant) and isinstance(r.value.value, str))
            if not returned & set(builtins):
                continue
            tests = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(
                node.test.op, ast.Or) else [node.test]
            for test in tests:
                for value in _compared_constants(module, test, "speculative_algorithm") or []:
                    aliases.add(value.upper())
    return aliases


# --------------------------------------------------------------------------------------------------
# --help output
# --------------------------------------------------------------------------------------------------

_HELP_LINE = re.compile(r"^\s{1,8}(-{1,2}[A-Za-z0-9][^\s,]*)(.*)$")


def parse_help(text):
    """Options listed by argparse's ``--help`` output (``options:``/``optional arguments:`` section).

    Only names, arity and choices are visible there: ``type`` is None (values are not type-checked in
    help mode). An invocation reads ``--tp-size TP_SIZE, --tensor-parallel-size TP_SIZE``, ``--x {a,b}``,
    ``--y Y [Y ...]`` (nargs "+"), ``--z [Z ...]`` ("*"), ``--w [W]`` ("?") or just ``--flag`` (no value).
    """
    options = []
    for line in text.splitlines():
        match = _HELP_LINE.match(line)
        if not match:
            continue
        invocation = match.group(1) + match.group(2)
        # help text follows the invocation after two or more spaces
        invocation = re.split(r"\s{2,}", invocation.strip(), maxsplit=1)[0]
        names, metavar = [], None
        for part in invocation.split(", "):
            tokens = part.split(" ", 1)
            if not tokens[0].startswith("-"):
                break
            names.append(tokens[0])
            if len(tokens) > 1:
                metavar = tokens[1]
        if not names:
            continue
        nargs, choices = 0, None
        if metavar:
            nargs = None
            head = metavar.split(" ")[0]
            if metavar.startswith("[") and metavar.endswith("...]"):
                nargs = "*"
            elif metavar.endswith("...]"):
                nargs = "+"
            elif metavar.startswith("[") and metavar.endswith("]"):
                nargs = "?"
            elif len(metavar.split(" ")) > 1:
                nargs = len(metavar.split(" "))
            brace = head.strip("[]")
            if brace.startswith("{") and brace.endswith("}"):
                choices = brace[1:-1].split(",")
        action = "store" if nargs != 0 else "store_true"
        if "--help" in names:
            action = "help"
        options.append(_make_option(names, None, action, nargs, None, None, choices, False, "--help"))
    return options


# --------------------------------------------------------------------------------------------------
# Checking launch flags with argparse's rules
# --------------------------------------------------------------------------------------------------

def _index(options):
    index = {}
    for option in options:
        for name in option["option_strings"]:
            index.setdefault(name, option)
    if "--help" not in index:
        for name in _HELP_OPTION["option_strings"]:
            index.setdefault(name, _HELP_OPTION)
    return index


def resolve_flag(name, index, allow_abbrev=True):
    """Resolve ``--name`` as argparse does. Returns ``(option string, option, error message)``.

    Exact option strings win; with ``allow_abbrev`` a prefix of exactly one long option string is that
    option; a prefix of several is ambiguous (argparse: ``ambiguous option: --x could match --x-a,
    --x-b``); anything else is unrecognized, with close spellings suggested (difflib).
    """
    if name in index:
        return name, index[name], None
    if allow_abbrev and name.startswith("--"):
        matches = [s for s in index if abbreviates(name, s)]
        if len(matches) == 1:
            return matches[0], index[matches[0]], None
        if len(matches) > 1:
            return None, None, "ambiguous option: %s could match %s" % (name, ", ".join(matches))
    longs = [s for s in index if s.startswith("--")]
    return None, None, "unrecognized argument %s in this SGLang release%s" % (name, did_you_mean(name, longs))


def did_you_mean(word, candidates, quote=False):
    """``"; did you mean X or Y?"`` for the close spellings of ``word`` among ``candidates`` (difflib,
    cutoff 0.75), or ``""``. Used for unknown flags and for values outside a flag's choices."""
    close = difflib.get_close_matches(word, [str(c) for c in candidates], n=3, cutoff=0.75)
    if not close:
        return ""
    return "; did you mean %s?" % " or ".join(repr(c) if quote else c for c in close)


def _render_scalar(value):
    if isinstance(value, bool):
        raise ValueError("a boolean is not a value for this option")
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if isinstance(value, float) and value.is_integer():
        return repr(value)
    return str(value)


def _check_value(option, text, extra=()):
    """Error message for one rendered value (argparse applies ``type`` then checks ``choices``), or None.

    ``extra``: values accepted beyond the choices read from source (names plugins register at run time).
    A choice error uses argparse's wording (``invalid choice: 'x' (choose from 'a', 'b')``), then the close
    spellings, then how the release can add names at run time (``choices_note``).
    """
    converted = text
    if option["type"] == "int":
        try:
            converted = int(text)
        except ValueError:
            return "invalid int value: %r" % text
    elif option["type"] == "float":
        try:
            converted = float(text)
        except ValueError:
            return "invalid float value: %r" % text
    elif option["type"] is None and option["type_name"] is not None:
        converter = option.get("converter")
        if converter is None:
            return None  # the release's own converter decides; compare nothing we cannot reproduce
        if text in converter["rejects"]:
            return converter["rejects"][text]
    choices = option["choices"]
    if choices is not None and option["choices_known"]:
        if converted not in choices and text not in [str(c) for c in choices] and text not in extra:
            message = "invalid choice: %r (choose from %s)%s" % (
                text, ", ".join(repr(c) for c in choices), did_you_mean(text, choices, quote=True))
            if option.get("choices_note"):
                message += " (these are the names in the release's source; %s: a name added that way is " \
                           "not visible here; list it in sglang_preflight_extra_choices, module option " \
                           "extra_choices)" % option["choices_note"]
            return message
    return None


def unchecked_reason(option, known_values=None, canonical=None):
    """Why preflight cannot check the value of ``option``, or None when it can (or it takes no value)."""
    if option["nargs"] == 0:
        return None
    if not option["choices_known"]:
        expr = option.get("choices_expr")
        return "choices computed at run time" + (" (%s)" % expr if expr else "")
    if option["type"] is None and option["type_name"] is not None and option.get("converter") is None:
        return "SGLang converts the value with %s, which preflight does not run" % option["type_name"]
    if option["type"] is None and option["type_name"] is None and not option["choices"]:
        return "value type not shown by --help"
    if canonical and known_values is not None and canonical in known_values \
            and known_values[canonical] is None and not option["choices"]:
        return "SGLang checks this value after parsing the command line, against names preflight found " \
               "nowhere in this release"
    return None


_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def check_launch_args(options, launch_args, host=None, port=None, allow_abbrev=True, known_values=None,
                      extra_choices=None):
    """Check ``launch_args`` (flag name without dashes → value) against ``options`` and render argv.

    Values: ``True`` → bare flag (only for options that take no value); ``False``/``None`` → omitted;
    a list → several values (``nargs`` "+"/"*"/N) or the flag repeated (``append`` action); a mapping →
    compact JSON. ``host``/``port`` (when given) are rendered as ``--host``/``--port`` and must not also
    be in ``launch_args``.

    Returns ``{"valid": bool, "errors": [{"flag", "message"}], "warnings": [{"flag", "message"}],
    "resolved": {given name: canonical option string}, "values": {canonical: value},
    "dest_values": {argparse dest: value}, "argv": [str], "unchecked": [{"flag", "option", "why",
    "message"}]}``; ``unchecked`` lists the flags given whose value was accepted without a check (a
    converter function of the release, choices computed at run time; see :func:`unchecked_reason`).
    The canonical option string of a flag is the one argparse matches it to: the flag itself when the
    release defines it, else the one long option it abbreviates (``tp`` → ``--tp-size``); ``argv`` uses it.
    ``known_values`` maps a canonical option string to the upper-case names the release accepts beyond
    argparse (``--speculative-algorithm``, see :func:`read_speculative_algorithms`); other values are
    errors there too; ``None`` there means the release checks the value later against names not found.
    ``extra_choices`` maps a flag name (without dashes, any spelling the release accepts) to values that
    pass its choices too: names plugins add at run time.
    """
    index = _index(options)
    errors, warnings, resolved, values, argv, dest_values = [], [], {}, {}, [], {}
    unchecked = []
    seen = {}

    def add_error(flag, message):
        errors.append({"flag": flag, "message": message})

    extra_by_dest = {}
    for key, extra_values in (extra_choices or {}).items():
        flag = "--" + str(key).lstrip("-")
        _canonical, option, message = resolve_flag(flag, index, allow_abbrev)
        if option is None:
            add_error(flag, "sglang_preflight_extra_choices (module option extra_choices): %s" % message)
            continue
        extra_by_dest.setdefault(option["dest"], set()).update(str(v) for v in (extra_values or []))

    # (name, value, from the inventory's launch_args): host/port come from their own variables, and a
    # launch_args key of the same name must not make those count as inventory entries (one error, not two).
    items = [(key, value, True) for key, value in (launch_args or {}).items()]
    for fixed, fixed_value in (("host", host), ("port", port)):
        if fixed_value is not None:
            items.append((fixed, fixed_value, False))
    for key, value, from_inventory in items:
        flag = "--" + str(key).lstrip("-")
        if from_inventory and str(key).lstrip("-") in ("host", "port") and \
                {"host": host, "port": port}[str(key).lstrip("-")] is not None:
            add_error(flag, "%s is rendered from sglang_%s; remove %r from sglang_launch_args"
                      % (flag, flag[2:], key))
            continue
        if value is None or value is False:
            continue
        canonical, option, message = resolve_flag(flag, index, allow_abbrev)
        if option is None:
            add_error(flag, message)
            continue
        if option["action"] == "help":
            add_error(flag, "%s resolves to argparse's --help, which prints help and exits" % flag)
            continue
        resolved[str(key)] = canonical
        if option["dest"] in seen and from_inventory:
            add_error(flag, "%s sets the same option as %s; give it once" % (flag, seen[option["dest"]]))
            continue
        seen[option["dest"]] = flag
        if option["deprecated"]:
            hint = " use %s instead" % option["new_flag"] if option["new_flag"] else " it may go away"
            warnings.append({"flag": flag, "message": "%s is deprecated in this SGLang release;%s"
                             % (canonical, hint)})
        nargs = option["nargs"]
        if nargs == 0:
            if value is not True:
                add_error(flag, "%s is a switch: give true to set it, false or null to leave it out (got %r)"
                          % (canonical, value))
                continue
            argv.append(canonical)
            values[canonical] = True
            # What argparse stores: False for store_false and the --no- form of a BooleanOptionalAction.
            dest_values[option["dest"]] = not (option["action"] == "store_false" or (
                option["action"] == "BooleanOptionalAction" and canonical.startswith("--no-")))
            continue
        if value is True:
            if nargs == "?":
                argv.append(canonical)
                values[canonical] = dest_values[option["dest"]] = True
                continue
            add_error(flag, "%s expects a value%s; true would render it as a bare flag"
                      % (canonical, " (%s)" % option["type"] if option["type"] else ""))
            continue
        many = nargs in ("+", "*") or (isinstance(nargs, int) and nargs > 1)
        repeated = option["action"] in ("append", "extend")
        seq = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not (many or repeated):
            add_error(flag, "%s takes one value, got a list of %d" % (canonical, len(value)))
            continue
        if isinstance(nargs, int) and nargs > 1 and len(seq) != nargs:
            add_error(flag, "%s takes exactly %d values, got %d" % (canonical, nargs, len(seq)))
            continue
        if nargs == "+" and not seq:
            add_error(flag, "%s expects at least one value" % canonical)
            continue
        rendered, bad = [], False
        for item in seq:
            try:
                text = _render_scalar(item)
            except ValueError as exc:
                add_error(flag, "%s: %s (got %r)" % (canonical, exc, item))
                bad = True
                break
            extra = extra_by_dest.get(option["dest"], ())
            problem = _check_value(option, text, extra)
            if problem:
                add_error(flag, "argument %s: %s" % (canonical, problem))
                bad = True
                break
            allowed = (known_values or {}).get(canonical)
            if allowed and not option["choices"] and text.upper() not in allowed and text not in extra:
                add_error(flag, "argument %s: unknown value %r; this SGLang release knows %s%s (SGLang "
                          "refuses other names after parsing the command line, unless a plugin registered "
                          "them: extra_speculative_algorithms accepts those)"
                          % (canonical, text, ", ".join(allowed), did_you_mean(text.upper(), allowed, True)))
                bad = True
                break
            rendered.append(text)
        if bad:
            continue
        why = unchecked_reason(option, known_values, canonical)
        if why:
            unchecked.append({"flag": flag, "option": canonical, "why": why, "message": "%s (%s)" % (
                flag, why if flag == canonical else "%s: %s" % (canonical, why))})
        values[canonical] = dest_values[option["dest"]] = value
        if repeated:
            for text in rendered:
                argv.extend([canonical, text])
        elif len(rendered) == 1 and not many and rendered[0].startswith("-") \
                and not _NEGATIVE_NUMBER.match(rendered[0]):
            # argparse would take "-x" for an option; the "=" form keeps it a value.
            argv.append("%s=%s" % (canonical, rendered[0]))
        else:
            for text in rendered:
                if text.startswith("-") and not _NEGATIVE_NUMBER.match(text):
                    add_error(flag, "%s: value %r starts with '-', which argparse reads as an option"
                              % (canonical, text))
                    bad = True
                    break
            if bad:
                continue
            argv.append(canonical)
            argv.extend(rendered)

    given = set(o["dest"] for o in options if o["option_strings"][0] in values or
                any(s in values for s in o["option_strings"]))
    for option in options:
        if option["required"] and option["dest"] not in given:
            add_error(option["option_strings"][0], "the following arguments are required: %s"
                      % option["option_strings"][0])
    return {"valid": not errors, "errors": errors, "warnings": warnings, "resolved": resolved,
            "values": values, "dest_values": dest_values, "argv": argv, "unchecked": unchecked}
