"""List the environment writes SGLang makes while it resolves its server arguments, read statically with ``ast``.

gpufleet's NCCL patch writes ``sglang_nccl_env`` into ``_set_envs_and_config`` just before
``mp.set_start_method(...)``, so it overwrites whatever SGLang set before: also the NCCL variables SGLang sets on
purpose for some launch flags (``--enable-deterministic-inference`` with tp > 1 sets ``NCCL_ALGO``). This script
finds those writes in a release's source so that the table in
``plugins/module_utils/gpufleet_sglang_nccl_owned.py`` can be re-checked, release by release::

    .venv/bin/python tests/support/sglang_nccl_writes.py 0.5.23            # a release (wheel cached in .cache/)
    .venv/bin/python tests/support/sglang_nccl_writes.py /path/to/sglang   # an installed or unpacked package
    .venv/bin/python tests/support/sglang_nccl_writes.py --all 0.5.23      # every variable, not only NCCL_*

Files read (paths relative to the ``sglang`` package directory):

- ``srt/server_args.py`` and every ``srt/arg_groups/**/*.py`` (from 0.5.19 the resolution hooks live there),
  every function;
- the file defining ``_set_envs_and_config`` (``srt/server.py`` up to 0.4.1.post6, then
  ``srt/entrypoints/engine.py``; the development branch also has ``srt/entrypoints/worker_launch.py``), only that
  function: its unconditional writes are what the patch is meant to override, its flag-conditioned ones are not.

Writes recognised: ``os.environ[NAME] = v`` (also ``+=``), ``os.environ.setdefault(NAME, v)``,
``os.environ.update({NAME: v})`` / ``update(NAME=v)``, ``os.putenv(NAME, v)``, ``os.environ.pop(NAME)``,
``del os.environ[NAME]``, ``os.unsetenv(NAME)`` (``environ`` imported from ``os`` too). A name that is not a
string literal (nor a local or module-level constant) is reported with ``variable`` None, so a write through a
computed name is never missed. Writes through a helper function (``set_env(name, v)``) are not seen.

Nothing here imports SGLang; the standard library only (plus ``tests/support/sglang_wheels.py`` for a version).
"""
import ast
import os
import pathlib
import sys

SERVER_ARGS = "srt/server_args.py"
ARG_GROUPS = "srt/arg_groups"
SET_ENVS_FILES = ("srt/server.py", "srt/entrypoints/engine.py", "srt/entrypoints/worker_launch.py")
SET_ENVS_FUNC = "_set_envs_and_config"


def _is_environ(node):
    """``os.environ`` or a bare ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_os_call(func, names):
    return (isinstance(func, ast.Attribute) and func.attr in names and isinstance(func.value, ast.Name)
            and func.value.id == "os")


class _Lister(ast.NodeVisitor):
    """Collects the writes of one file, tracking the enclosing function and ``if`` tests."""

    def __init__(self, rel, source, only_function=None):
        self.rel, self.source, self.only_function = rel, source, only_function
        self.func_stack, self.cond_stack, self.writes = [], [], []
        self.constants = [{}]  # scopes: name -> str constant (module first)
        self.dict_keys = [{}]  # scopes: name -> str keys of a dict literal assigned to it
        self.loop_keys = {}  # loop variable -> the dict keys it runs over (``for k, v in D.items()``)

    # -- scopes -------------------------------------------------------------------------------------------
    def _visit_function(self, node):
        self.func_stack.append(node.name)
        self.constants.append({})
        self.dict_keys.append({})
        saved, self.cond_stack = self.cond_stack, []
        self.generic_visit(node)
        self.cond_stack = saved
        self.dict_keys.pop()
        self.constants.pop()
        self.func_stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node):
        self.func_stack.append(node.name)
        self.generic_visit(node)
        self.func_stack.pop()

    def _push_cond(self, text, body, orelse):
        self.cond_stack.append(text)
        for child in body:
            self.visit(child)
        self.cond_stack.pop()
        if orelse:
            self.cond_stack.append("not (%s)" % text)
            for child in orelse:
                self.visit(child)
            self.cond_stack.pop()

    def visit_If(self, node):
        self.visit(node.test)
        self._push_cond(ast.unparse(node.test), node.body, node.orelse)

    def visit_For(self, node):
        self.visit(node.iter)
        bound = self._loop_binding(node)
        self.loop_keys.update(bound)
        self._push_cond("for %s in %s" % (ast.unparse(node.target), ast.unparse(node.iter)), node.body, node.orelse)
        for name in bound:
            self.loop_keys.pop(name, None)

    def _loop_binding(self, node):
        """{loop variable: keys} for ``for k in D``, ``for k in D.keys()`` or ``for k, v in D.items()`` over a
        dict literal ``D`` of this file (SGLang 0.5.14+ sets its CUDA core-dump defaults this way)."""
        iterable, target = node.iter, node.target
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Attribute) and not iterable.args:
            method, iterable = iterable.func.attr, iterable.func.value
        else:
            method = "keys"
        if not isinstance(iterable, ast.Name):
            return {}
        keys = next((scope[iterable.id] for scope in reversed(self.dict_keys) if iterable.id in scope), None)
        if keys is None:
            return {}
        if method == "items" and isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name):
            return {target.elts[0].id: keys}
        if method == "keys" and isinstance(target, ast.Name):
            return {target.id: keys}
        return {}

    visit_AsyncFor = visit_For

    def visit_While(self, node):
        self._push_cond("while %s" % ast.unparse(node.test), node.body, node.orelse)

    # -- constants ----------------------------------------------------------------------------------------
    def visit_Assign(self, node):
        for target in node.targets:
            if not isinstance(target, ast.Name):
                continue
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                self.constants[-1][target.id] = node.value.value
            elif isinstance(node.value, ast.Dict) and node.value.keys and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.value.keys):
                self.dict_keys[-1][target.id] = [k.value for k in node.value.keys]
        for target in node.targets:
            if isinstance(target, ast.Subscript) and _is_environ(target.value):
                self._record(node, "set", target.slice, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Subscript) and _is_environ(node.target.value):
            self._record(node, "append", node.target.slice, node.value)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for target in node.targets:
            if isinstance(target, ast.Subscript) and _is_environ(target.value):
                self._record(node, "unset", target.slice, None)
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and _is_environ(func.value):
            if func.attr == "setdefault" and node.args:
                self._record(node, "setdefault", node.args[0], node.args[1] if len(node.args) > 1 else None)
            elif func.attr == "update":
                self._record_update(node)
            elif func.attr == "pop" and node.args:
                self._record(node, "unset", node.args[0], None)
            elif func.attr in ("clear", "popitem"):
                self._record(node, "unset", None, None)
        elif _is_os_call(func, ("putenv",)) and node.args:
            self._record(node, "set", node.args[0], node.args[1] if len(node.args) > 1 else None)
        elif _is_os_call(func, ("unsetenv",)) and node.args:
            self._record(node, "unset", node.args[0], None)
        self.generic_visit(node)

    def _record_update(self, node):
        pairs = [(kw.arg and ast.Constant(kw.arg), kw.value) for kw in node.keywords]
        for arg in node.args:
            if isinstance(arg, ast.Dict):
                pairs.extend(zip(arg.keys, arg.values))
            else:
                pairs.append((None, arg))  # update(mapping): the names are computed
        for key, value in pairs:
            self._record(node, "set", key, value)

    # -- output -------------------------------------------------------------------------------------------
    def _names(self, node):
        """The variable names ``node`` can stand for: one literal or constant, a loop's dict keys, or [None]."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Name):
            if node.id in self.loop_keys:
                return list(self.loop_keys[node.id])
            for scope in reversed(self.constants):
                if node.id in scope:
                    return [scope[node.id]]
        return [None]

    def _record(self, node, kind, name_node, value_node):
        function = ".".join(self.func_stack)
        if self.only_function and self.only_function not in self.func_stack:
            return
        for variable in self._names(name_node) if name_node is not None else [None]:
            self._record_one(node, kind, variable, name_node, value_node, function)

    def _record_one(self, node, kind, variable, name_node, value_node, function):
        if isinstance(value_node, ast.Constant):
            value = str(value_node.value)
        elif value_node is None:
            value = None
        else:
            value = "computed: " + ast.unparse(value_node)
        self.writes.append({
            "file": self.rel, "line": node.lineno, "function": function,
            "variable": variable,
            "name_source": ast.unparse(name_node) if name_node is not None else None,
            "kind": kind, "value": value, "conditions": list(self.cond_stack),
        })


def _files(package_dir):
    """(relative path, only_function) of the files to read in ``package_dir``."""
    package_dir = pathlib.Path(package_dir)
    found = []
    if (package_dir / SERVER_ARGS).is_file():
        found.append((SERVER_ARGS, None))
    groups = package_dir / ARG_GROUPS
    if groups.is_dir():
        found.extend((p.relative_to(package_dir).as_posix(), None) for p in sorted(groups.rglob("*.py")))
    for rel in SET_ENVS_FILES:
        path = package_dir / rel
        if path.is_file() and ("def %s(" % SET_ENVS_FUNC) in path.read_text(encoding="utf-8", errors="replace"):
            found.append((rel, SET_ENVS_FUNC))
    return found


def list_writes(package_dir, prefix="NCCL_"):
    """Environment writes in ``package_dir`` (an ``sglang`` package directory), each a dict: ``file`` (relative
    to the package), ``line``, ``function`` (dotted, class first), ``variable`` (None when computed),
    ``name_source``, ``kind`` (set, setdefault, append, unset), ``value`` (the literal, ``"computed: <expr>"``
    or None), ``conditions`` (the enclosing ``if``/``for`` tests, outermost first).

    ``prefix``: keep variables starting with it and every write whose name is computed; None keeps all.
    """
    writes = []
    for rel, only in _files(package_dir):
        source = (pathlib.Path(package_dir) / rel).read_text(encoding="utf-8")
        lister = _Lister(rel, source, only)
        lister.visit(ast.parse(source, filename=rel))
        writes.extend(lister.writes)
    if prefix:
        writes = [w for w in writes if w["variable"] is None or w["variable"].startswith(prefix)]
    return writes


def _package_dir(arg):
    if os.path.isdir(arg):
        return arg
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from tests.support.sglang_wheels import sglang_package_dir
    return sglang_package_dir(arg)


def main(argv):
    everything = "--all" in argv
    for arg in [a for a in argv if a != "--all"]:
        print("== %s" % arg)
        for w in list_writes(_package_dir(arg), prefix=None if everything else "NCCL_"):
            print("%s:%d %s %s %s=%s%s" % (
                w["file"], w["line"], w["function"], w["kind"], w["variable"] or "<%s>" % w["name_source"],
                w["value"], "".join("\n      if %s" % c for c in w["conditions"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
