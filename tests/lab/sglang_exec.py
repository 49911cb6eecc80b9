"""Execute a real SGLang release's ``_set_envs_and_config`` without importing SGLang (no torch, no CUDA).

``run_set_envs_and_config(source_path, environ, server_args=None)`` reads the file (``srt/entrypoints/
engine.py`` from 0.4.1.post7, ``srt/server.py`` up to 0.4.1.post6 — see ../../shared/FIELD-NOTES.md), takes the
one ``def _set_envs_and_config`` with ``ast``, compiles it alone and calls it with permissive stub globals:
every module-level name the function uses (``ServerArgs``, ``set_ulimit``, ``envs``, ``logger``, ``signal``,
``assert_pkg_version``, ``torch`` …) resolves to a stub that accepts any attribute, call, comparison or
arithmetic and is falsy / 0 / "" — so version checks and optional features stay off — except:

- ``os``: the real module, with ``environ`` replaced by the ``environ`` argument (pass ``os.environ`` to
  change this process's environment, as the stand-in server does before spawning its workers);
- ``time``, ``random``, ``threading``: the real modules (the function builds ``SGLANG_RUN_ID`` from them);
- ``mp`` / ``multiprocessing``: a recorder of ``set_start_method`` calls (nothing global is changed).

``server_args`` may be a mapping (attribute name → value, e.g. ``{"tp_size": 8}``) or an object; missing
attributes are stubs, except ``tp_size``, ``dp_size``, ``pp_size``, ``nnodes``, ``dcp_size`` which default to 1.
Returns a dict ``{"start_method": [args of each set_start_method call], "changed": {name: (before, after)}}``
(``before``/``after`` are None when unset). Raises ``LookupError`` when the file has no such function and
whatever the function itself raises (a broken patch shows up as an exception here, as it would in SGLang).
"""
import ast
import builtins
import os
import random
import threading
import time
import types

_NUMERIC_DEFAULTS = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "nnodes": 1, "dcp_size": 1, "ep_size": 1}


class Stub(str):
    """Permissive stand-in for anything: falsy, empty, 0, callable, subscriptable, never equal to a value."""

    def __new__(cls, name="stub"):
        obj = str.__new__(cls, "")
        obj._name = name
        return obj

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return Stub("%s.%s" % (self._name, item))

    def __call__(self, *args, **kwargs):
        return Stub(self._name + "()")

    def __getitem__(self, key):
        return Stub("%s[]" % self._name)

    def __contains__(self, item):
        return False

    def __eq__(self, other):
        return isinstance(other, Stub)

    def __ne__(self, other):
        return not isinstance(other, Stub)

    __hash__ = str.__hash__

    def __lt__(self, other):
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __float__(self):
        return 0.0

    def _arith(self, *other):
        return Stub(self._name)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _arith
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __and__ = __or__ = __rand__ = __ror__ = _arith
    __neg__ = __pos__ = _arith

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __repr__(self):
        return "<stub %s>" % self._name


class _MpRecorder:
    def __init__(self):
        self.calls = []

    def set_start_method(self, method, force=False):
        self.calls.append(method)

    def __getattr__(self, item):
        return Stub("mp." + item)


class _ServerArgs:
    def __init__(self, values):
        self._values = values

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        if isinstance(self._values, dict):
            if item in self._values:
                return self._values[item]
        elif self._values is not None and hasattr(self._values, item):
            return getattr(self._values, item)
        if item in _NUMERIC_DEFAULTS:
            return _NUMERIC_DEFAULTS[item]
        return Stub("server_args." + item)


def _os_with(environ):
    if environ is os.environ:
        return os
    proxy = types.ModuleType("os")
    proxy.__dict__.update({k: v for k, v in vars(os).items() if not k.startswith("__")})
    proxy.environ = environ
    proxy.getenv = lambda key, default=None: environ.get(key, default)
    return proxy


class _Globals(dict):
    def __missing__(self, name):
        if hasattr(builtins, name):
            raise KeyError(name)  # let the interpreter fall back to the real builtins
        value = Stub(name)
        self[name] = value
        return value


def extract_function(source_path, name="_set_envs_and_config"):
    """(source text of the function, first line number) from a file; LookupError when absent."""
    with open(source_path, encoding="utf-8") as fh:
        src = fh.read()
    tree = ast.parse(src, filename=source_path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return ast.get_source_segment(src, node), node
    raise LookupError("no top-level def %s in %s" % (name, source_path))


def run_set_envs_and_config(source_path, environ, server_args=None):
    """Run the release's ``_set_envs_and_config`` against ``environ`` (see module docstring)."""
    _, node = extract_function(source_path)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    code = compile(module, source_path, "exec", dont_inherit=True)
    mp = _MpRecorder()
    real_import = builtins.__import__
    fake_os = _os_with(environ)
    real_modules = {"os": fake_os, "time": time, "random": random, "threading": threading}

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        # imports inside the function body must not pull in sglang/torch: only a few real modules
        if level == 0 and name in real_modules:
            return real_modules[name]
        if level == 0 and name in ("multiprocessing",):
            return mp
        return Stub(name)

    g = _Globals()
    g["__builtins__"] = dict(vars(builtins), __import__=guarded_import)
    g["__name__"] = "sglang_lab_exec"
    g.update(real_modules)
    g["mp"] = mp
    g["multiprocessing"] = mp
    del real_import
    before = dict(environ)
    exec(code, g)  # defines the function only
    g["_set_envs_and_config"](_ServerArgs(server_args))
    after = dict(environ)
    changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    return {"start_method": list(mp.calls), "changed": changed}


def set_envs_source(package_dir):
    """The file holding ``_set_envs_and_config`` in an installed ``sglang/`` package directory."""
    engine = os.path.join(package_dir, "srt", "entrypoints", "engine.py")
    if os.path.exists(engine):
        try:
            extract_function(engine)
            return engine
        except LookupError:
            pass
    return os.path.join(package_dir, "srt", "server.py")
