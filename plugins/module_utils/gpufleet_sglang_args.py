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
     "required": bool, "deprecated": bool, "new_flag": str | None, "source": "srt/server_args.py:1234"}

``type`` is ``None`` when the release converts the value with its own function (``human_readable_int``,
``json.loads``…): such values are not type-checked here. ``choices_known`` is false when the choices are
computed at run time (plugin registries): such values are not choice-checked here.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re

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

class _Module(object):
    """One parsed source file of the package, with its imports from the package resolved lazily."""

    def __init__(self, reader, rel_path):
        self.reader = reader
        self.rel_path = rel_path
        path = os.path.join(reader.package_dir, rel_path)
        try:
            with open(path, "rb") as handle:
                source = handle.read().decode("utf-8")
        except (IOError, OSError) as exc:
            raise SglangArgsError("cannot read %s: %s" % (path, exc))
        try:
            self.tree = ast.parse(source, filename=path)
        except SyntaxError as exc:
            raise SglangArgsError("cannot parse %s: %s" % (path, exc))
        reader.files_read.append(path)
        self.assignments = {}
        self.classes = {}
        self.imports = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.assignments[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                self.assignments[node.target.id] = node.value
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang."):
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Try):
                # Optional imports sit in try blocks; their names still resolve when the file exists.
                for sub in node.body:
                    if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("sglang."):
                        for alias in sub.names:
                            self.imports.setdefault(alias.asname or alias.name, (sub.module, alias.name))

    def resolve_name(self, name, depth=0):
        """(module, node) that defines ``name`` (an assignment value or a ClassDef), or (None, None)."""
        if depth > 8:
            return None, None
        if name in self.assignments:
            return self, self.assignments[name]
        if name in self.classes:
            return self, self.classes[name]
        if name in self.imports:
            module_name, original = self.imports[name]
            other = self.reader.module_for(module_name)
            if other is not None:
                return other.resolve_name(original, depth + 1)
        return None, None


class _Reader(object):
    def __init__(self, package_dir):
        self.package_dir = package_dir
        self.files_read = []
        self._modules = {}

    def module(self, rel_path):
        if rel_path not in self._modules:
            self._modules[rel_path] = _Module(self, rel_path)
        return self._modules[rel_path]

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


def _evaluate(module, node, local=None, depth=0):
    """Value of a constant expression (lists of literals, names bound to them, ``a + b``, ``list(x)``,
    ``Class.ATTR``), or ``_UNRESOLVED`` when it needs run time (plugin registries, comprehensions)."""
    if node is None or depth > 12:
        return _UNRESOLVED
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.Name):
        if local and node.id in local:
            return _evaluate(module, local[node.id], None, depth + 1)
        owner, value = module.resolve_name(node.id)
        if owner is None or isinstance(value, ast.ClassDef):
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
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _evaluate(module, node.left, local, depth + 1)
        right = _evaluate(module, node.right, local, depth + 1)
        if left is _UNRESOLVED or right is _UNRESOLVED:
            return _UNRESOLVED
        try:
            return list(left) + list(right)
        except TypeError:
            return _UNRESOLVED
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1 \
            and node.func.id in ("list", "tuple", "set", "sorted", "frozenset") and not node.keywords:
        inner = _evaluate(module, node.args[0], local, depth + 1)
        if inner is _UNRESOLVED:
            return _UNRESOLVED
        return sorted(inner, key=str) if node.func.id == "sorted" else list(inner)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        owner, cls = module.resolve_name(node.value.id)
        if isinstance(cls, ast.ClassDef):
            for stmt in cls.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else (
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value else [])
                for target in targets:
                    if isinstance(target, ast.Name) and target.id == node.attr:
                        return _evaluate(owner, stmt.value, None, depth + 1)
    return _UNRESOLVED


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
                 new_flag=None):
    if dest is None:
        longs = [s for s in option_strings if s.startswith("--")]
        dest = (longs or option_strings)[0].lstrip("-").replace("-", "_")
    if action == "BooleanOptionalAction":
        # argparse adds the negative form for every long option string.
        option_strings = list(option_strings) + [
            "--no-" + s[2:] for s in option_strings if s.startswith("--")]
    if action in _ZERO_ARG_ACTIONS:
        nargs = 0
    known = choices is not _UNRESOLVED
    return {
        "option_strings": list(option_strings), "dest": dest, "nargs": nargs,
        "type": None if nargs == 0 else type_, "type_name": None if nargs == 0 else type_name,
        "choices": list(choices) if known and choices is not None else None,
        "choices_known": known, "action": action, "required": bool(required),
        "deprecated": action.startswith("Deprecated") or new_flag is not None, "new_flag": new_flag,
        "source": source,
    }


def _option_from_add_argument(module, call, local):
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
    return _make_option(names, dest if isinstance(dest, str) else None, action, nargs, type_, type_name,
                        choices, required is True, "%s:%d" % (module.rel_path, call.lineno),
                        new_flag if isinstance(new_flag, str) else None)


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
    if "action" in meta:
        action_node = meta["action"]
        if isinstance(action_node, ast.Constant) and isinstance(action_node.value, str):
            action, nargs = action_node.value, None
        else:
            action = action_node.attr if isinstance(action_node, ast.Attribute) else _unparse(action_node)
            nargs = _action_nargs(module, action_node)
        kwargs = value("action_kwargs") or {}
        if "nargs" in kwargs:
            nargs = kwargs["nargs"]
        return _make_option(names, name, action, nargs, "str", None, choices, False, source)

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
        return _make_option(names, name, "store", None, _BUILTIN_TYPES.get(type_name), type_name, choices,
                            False, source)
    if kind in ("List", "list") and type_parser is None:
        elem = _subscript_parts(args[0])[0] if args else "str"
        type_name = elem if elem in _BUILTIN_TYPES else "str"
        return _make_option(names, name, "store", value("nargs") or "+", _BUILTIN_TYPES[type_name], type_name,
                            choices, False, source)
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
                        source)


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
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            fname = _subscript_parts(node.func)[0]
            if fname == "add_argument":
                option = _option_from_add_argument(module, node, local)
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
    return sorted(names) or None


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
        matches = [s for s in index if s.startswith(name)]
        if len(matches) == 1:
            return matches[0], index[matches[0]], None
        if len(matches) > 1:
            return None, None, "ambiguous option: %s could match %s" % (name, ", ".join(matches))
    longs = [s for s in index if s.startswith("--")]
    close = difflib.get_close_matches(name, longs, n=3, cutoff=0.75)
    message = "unrecognized argument %s in this SGLang release" % name
    if close:
        message += "; did you mean %s?" % " or ".join(close)
    return None, None, message


def _render_scalar(value):
    if isinstance(value, bool):
        raise ValueError("a boolean is not a value for this option")
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if isinstance(value, float) and value.is_integer():
        return repr(value)
    return str(value)


def _check_value(option, text):
    """Error message for one rendered value (argparse applies ``type`` then checks ``choices``), or None."""
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
    choices = option["choices"]
    if choices is not None and option["choices_known"]:
        if option["type"] is None and option["type_name"] is not None:
            return None  # the release's own converter decides; compare nothing we cannot reproduce
        if converted not in choices and text not in [str(c) for c in choices]:
            return "invalid choice: %r (choose from %s)" % (text, ", ".join(repr(c) for c in choices))
    return None


_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def check_launch_args(options, launch_args, host=None, port=None, allow_abbrev=True, known_values=None):
    """Check ``launch_args`` (flag name without dashes → value) against ``options`` and render argv.

    Values: ``True`` → bare flag (only for options that take no value); ``False``/``None`` → omitted;
    a list → several values (``nargs`` "+"/"*"/N) or the flag repeated (``append`` action); a mapping →
    compact JSON. ``host``/``port`` (when given) are rendered as ``--host``/``--port`` and must not also
    be in ``launch_args``.

    Returns ``{"valid": bool, "errors": [{"flag", "message"}], "warnings": [{"flag", "message"}],
    "resolved": {given name: canonical option string}, "values": {canonical: value},
    "dest_values": {argparse dest: value}, "argv": [str]}``.
    The canonical option string of a flag is the one argparse matches it to: the flag itself when the
    release defines it, else the one long option it abbreviates (``tp`` → ``--tp-size``); ``argv`` uses it.
    ``known_values`` maps a canonical option string to the upper-case names the release accepts beyond
    argparse (``--speculative-algorithm``, see :func:`read_speculative_algorithms`); other values are
    errors there too.
    """
    index = _index(options)
    errors, warnings, resolved, values, argv, dest_values = [], [], {}, {}, [], {}
    seen = {}

    def add_error(flag, message):
        errors.append({"flag": flag, "message": message})

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
            values[canonical] = dest_values[option["dest"]] = True
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
            problem = _check_value(option, text)
            if problem:
                add_error(flag, "argument %s: %s" % (canonical, problem))
                bad = True
                break
            allowed = (known_values or {}).get(canonical)
            if allowed and not option["choices"] and text.upper() not in allowed:
                add_error(flag, "argument %s: unknown value %r; this SGLang release knows %s"
                          % (canonical, text, ", ".join(allowed)))
                bad = True
                break
            rendered.append(text)
        if bad:
            continue
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
            "values": values, "dest_values": dest_values, "argv": argv}
