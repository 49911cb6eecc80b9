"""Run a real SGLang ``_set_envs_and_config`` against a given environment, without torch or CUDA.

``run_set_envs_and_config(source_path, environ, server_args=None)`` parses the file with :mod:`ast`, takes the
module-level ``def _set_envs_and_config`` node and compiles only that function (nothing else of the file runs:
no imports, no module-level code). It is executed with stub globals:

* ``os``: a proxy whose ``environ`` *is* the given dict (``getenv``/``putenv``/``unsetenv`` act on it too);
  other attributes are the real :mod:`os` ones (``getpid``, ``WNOHANG``, ...).
* ``mp``: records ``set_start_method`` calls (method, force) instead of changing this process.
* ``server_args``: :class:`StubServerArgs` -- SGLang's defaults for the attributes the function reads in
  0.3.6 to 0.5.23 (``tp_size=1``, ``nnodes=1``, ``enable_symm_mem=False``, ...), overrides from the caller,
  and :data:`NEUTRAL` for anything else.
* ``resolving_view`` / ``resolved_view`` (0.5.20+) return their argument; ``get_bool_env_var`` and
  ``attention_backends_of`` behave like SGLang's on the stub environment and arguments.
* every other free name of the function (``torch``, ``signal``, ``logger``, ``envs``, ``set_ulimit``,
  ``assert_pkg_version``, ``threading``, ``gc``, ...) is :data:`NEUTRAL`: falsy, callable, any attribute, empty
  when iterated, ``in`` is False, comparisons are False, ``int()`` is 0. So no handler is installed, no limit
  raised and no package checked in the test process.

The resulting environment comes back as a new dict. The function's own code (the environment writes and
the gpufleet block, if the file is patched) runs for real, which is the point: a test can show a variable
survives -- or is overwritten by -- the release's own writes.
"""
import ast
import builtins
import os as _real_os

FUNCTION_NAME = "_set_envs_and_config"

# Attributes _set_envs_and_config reads from server_args in the releases 0.3.6 .. 0.5.23, with ServerArgs'
# defaults (a single-node, single-GPU launch; the value matters only for branches, not for the test).
SERVER_ARGS_DEFAULTS = {
    "tp_size": 1,
    "dp_size": 1,
    "nnodes": 1,
    "dcp_size": 1,
    "enable_metrics": False,
    "enable_symm_mem": False,
    "enable_nccl_nvls": False,
    "enable_kv_cache_sharding": False,
    "enable_memory_saver": False,
    "attention_backend": None,
    "dsa_topk_backend": None,
    "speculative_dsa_topk_backend": None,
    "gc_threshold": None,
    "custom_sigquit_handler": None,
}


class _Neutral:
    """A harmless stand-in: falsy, callable, any attribute, never equal or ordered, int() == 0."""

    def __init__(self, name="stub"):
        object.__setattr__(self, "_name", name)

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self

    def __setattr__(self, attr, value):
        pass

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __contains__(self, item):
        return False

    def __len__(self):
        return 0

    def __int__(self):
        return 0

    __index__ = __int__

    def __float__(self):
        return 0.0

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __lt__(self, other):
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(self):
        return id(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __repr__(self):
        return "<stub %s>" % self._name

    def __str__(self):
        return "stub"

    def __format__(self, spec):
        return "stub"


NEUTRAL = _Neutral()


class StubServerArgs:
    """``server_args`` for the function: SGLang defaults, caller overrides, :data:`NEUTRAL` for the rest."""

    def __init__(self, **overrides):
        values = dict(SERVER_ARGS_DEFAULTS)
        values.update(overrides)
        self.__dict__.update(values)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return NEUTRAL


class _OsProxy:
    """``os`` with ``environ`` replaced by the given dict."""

    def __init__(self, environ):
        self.environ = environ

    def getenv(self, key, default=None):
        return self.environ.get(key, default)

    def putenv(self, key, value):
        self.environ[key] = value

    def unsetenv(self, key):
        self.environ.pop(key, None)

    def __getattr__(self, attr):
        return getattr(_real_os, attr)


class _MultiprocessingRecorder:
    """``mp`` (torch.multiprocessing): records ``set_start_method`` calls."""

    def __init__(self):
        self.start_method_calls = []

    def set_start_method(self, method, force=False):
        self.start_method_calls.append((method, force))

    def __getattr__(self, attr):
        return NEUTRAL


def _get_bool_env_var_factory(environ):
    # sglang.srt.utils.get_bool_env_var: value.lower() in ("true", "1"); default "false".
    def get_bool_env_var(name, default="false"):
        return str(environ.get(name, default)).lower() in ("true", "1")
    return get_bool_env_var


def _attention_backends_of(cfg):
    return {b for b in (getattr(cfg, "attention_backend", None), getattr(cfg, "prefill_attention_backend", None),
                        getattr(cfg, "decode_attention_backend", None)) if isinstance(b, str)}


def extract_function(source, filename="<source>", name=FUNCTION_NAME):
    """The module-level ``def name`` node of ``source`` (str or bytes). Raises LookupError if absent."""
    tree = ast.parse(source, filename=filename)
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        raise LookupError("%s defines %s() %d times (expected once)" % (filename, name, len(found)))
    return found[0]


def free_names(function_node):
    """Names the function (and functions nested in it) loads but never binds, minus builtins (sorted list)."""
    bound = {a.arg for a in ast.walk(function_node) if isinstance(a, ast.arg)}
    loaded = set()
    for node in ast.walk(function_node):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                loaded.add(node.id)
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not function_node:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return sorted(loaded - bound - set(dir(builtins)))


def execute_set_envs_and_config(source_path, environ, server_args=None):
    """Run the function from ``source_path`` with ``environ`` (dict, mutated in place).

    ``server_args``: None (SGLang defaults), a dict of overrides, or an object used as is.
    Returns a dict: ``env`` (a copy of the environment afterwards), ``start_method_calls`` (list of
    ``(method, force)``), ``stubbed`` (sorted names replaced by :data:`NEUTRAL`).
    """
    with open(source_path, "rb") as handle:
        source = handle.read()
    node = extract_function(source, filename=str(source_path))
    module = ast.Module(body=[node], type_ignores=[])
    code = compile(module, str(source_path), "exec", dont_inherit=True)
    if server_args is None or isinstance(server_args, dict):
        server_args = StubServerArgs(**(server_args or {}))
    mp = _MultiprocessingRecorder()
    specific = {
        "os": _OsProxy(environ),
        "mp": mp,
        "resolving_view": lambda cfg: cfg,
        "resolved_view": lambda cfg: cfg,
        "get_bool_env_var": _get_bool_env_var_factory(environ),
        "attention_backends_of": _attention_backends_of,
    }
    namespace = {"__name__": "sglang_set_envs_exec", "__builtins__": builtins}
    stubbed = []
    for name in free_names(node):
        if name in specific:
            namespace[name] = specific[name]
        else:
            namespace[name] = _Neutral(name)
            stubbed.append(name)
    exec(code, namespace)
    namespace[FUNCTION_NAME](server_args)
    return {"env": dict(environ), "start_method_calls": list(mp.start_method_calls), "stubbed": stubbed}


def run_set_envs_and_config(source_path, environ, server_args=None, start_method_calls=1):
    """Run ``_set_envs_and_config`` of ``source_path`` on a copy of ``environ``; return the env afterwards (dict).

    Raises AssertionError unless the function ran to its end through ``start_method_calls`` calls of
    ``mp.set_start_method`` (1: the point before which the TP workers' environment is final; ``"spawn"`` up to
    0.5.23, ``envs.SGLANG_MP_START_METHOD.get()`` -- a stub here -- after it; 0 for a function without one).
    """
    result = execute_set_envs_and_config(source_path, dict(environ), server_args)
    calls = result["start_method_calls"]
    assert len(calls) == start_method_calls and all(force is True for _, force in calls), calls
    return result["env"]


def set_envs_source(package_dir, environ=None):
    """The file whose ``_set_envs_and_config`` SGLang runs, in an installed ``sglang/`` package directory (str).

    ``srt/entrypoints/engine.py`` from 0.4.1.post7, ``srt/server.py`` up to 0.4.1.post6 (0.4.1.post7-0.4.5
    keep a re-exporting ``srt/server.py`` shim, so the engine file is tried first). On SGLang's development branch
    after 0.5.23, ``prespawn.maybe_prespawn()`` runs the copy in ``srt/entrypoints/worker_launch.py`` instead when
    ``SGLANG_PRESPAWN_WORKERS=1`` is in ``environ`` (default: this process's environment) and that file defines it.
    """
    environ = _real_os.environ if environ is None else environ
    candidates = ["engine.py"]
    if environ.get("SGLANG_PRESPAWN_WORKERS") == "1":
        candidates.insert(0, "worker_launch.py")
    for name in candidates:
        path = _real_os.path.join(package_dir, "srt", "entrypoints", name)
        if _real_os.path.exists(path):
            with open(path, "rb") as handle:
                try:
                    extract_function(handle.read(), filename=path)
                    return path
                except LookupError:
                    pass
    return _real_os.path.join(package_dir, "srt", "server.py")
