# -*- coding: utf-8 -*-
# gpufleet: the NCCL variables SGLang sets on purpose for some launch flags, which sglang_nccl_env must not undo.
"""Which ``sglang_nccl_env`` values would silently replace an NCCL variable SGLang sets on purpose.

gpufleet writes ``sglang_nccl_env`` into SGLang's ``_set_envs_and_config`` just before
``mp.set_start_method(...)`` and puts it in the server's environment, so its values are the last word for every
TP worker. That is the point for SGLang's unconditional defaults (``CUDA_DEVICE_MAX_CONNECTIONS``, and
``NCCL_CUMEM_ENABLE=0`` / ``NCCL_NVLS_ENABLE=0`` up to 0.5.4). But for some launch flags SGLang sets NCCL
variables on purpose, while it resolves its server arguments (before that function) or inside it, and the
user's value then replaces SGLang's in silence: ``--enable-deterministic-inference`` with tp > 1 sets
``NCCL_ALGO=allreduce:tree`` and pins the channel count, and a patched 0.5.22 ran with ``NCCL_ALGO=Ring``,
``NCCL_MAX_NCHANNELS=16`` from the inventory: the user asked for deterministic results and lost them.

:data:`WRITES` lists every NCCL write of ``srt/server_args.py``, ``srt/arg_groups/*.py`` and
``_set_envs_and_config`` in the releases of :data:`SURVEYED` (PyPI wheels, read with
``tests/support/sglang_nccl_writes.py``; ``tests/unit/test_gpufleet_sglang_nccl_owned.py`` re-checks the table
against every release the test suite covers). :func:`nccl_conflicts` names the ones a launch would undo.

A write SGLang makes with ``os.environ.setdefault`` (or under ``if NAME not in os.environ``) keeps a value already
in the environment; gpufleet puts ``sglang_nccl_env`` there, so the user's value wins in that case too, only with
SGLang's knowledge (it may log it). Either way the flag runs without the value SGLang chose for it, so both count;
``sglang_nccl_env_overrides`` (``overrides``) names the variables whose value replaces SGLang's on purpose.

Nothing here needs Ansible or third-party packages.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl import strtoll

__metaclass__ = type

OVERRIDES_VAR = "sglang_nccl_env_overrides"

# Releases whose NCCL writes the table was checked against (file and line in WRITES); between two of them a
# write counts from the first release past its "after" (the newest surveyed release without it).
SURVEYED = ("0.3.6", "0.4.1.post6", "0.4.1.post7", "0.4.5", "0.4.6", "0.5.2", "0.5.3", "0.5.4", "0.5.5", "0.5.6",
            "0.5.10", "0.5.11", "0.5.12", "0.5.14", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22",
            "0.5.23")
NEWEST = SURVEYED[-1]

# SGLang's spellings of the flags the rules read (option strings without dashes, 0.5.23; older releases have a
# subset). A launch-args key is one of them, ``no-`` + a BooleanOptionalAction flag, or a unique prefix of one
# (argparse's abbreviations: ``tp`` -> ``tp-size``).
SPELLINGS = {
    "tp_size": ("tp-size", "tensor-parallel-size"),
    "pp_size": ("pp-size", "pipeline-parallel-size"),
    "dp_size": ("dp-size", "data-parallel-size"),
    "ep_size": ("ep-size", "expert-parallel-size", "ep"),
    "dcp_size": ("dcp-size", "decode-context-parallel-size"),
    "attn_dp_size": ("attn-dp-size", "attention-data-parallel-size"),
    "nnodes": ("nnodes",),
    "enable_deterministic_inference": ("enable-deterministic-inference",),
    "enable_symm_mem": ("enable-symm-mem",),
    "enable_nccl_nvls": ("enable-nccl-nvls",),
    "enable_kv_cache_sharding": ("enable-kv-cache-sharding",),
    "enable_memory_saver": ("enable-memory-saver",),
    "enable_dp_attention": ("enable-dp-attention",),
    "enable_dp_lm_head": ("enable-dp-lm-head",),
    "enable_tp_lm_head_all_to_all": ("enable-tp-lm-head-all-to-all",),
    "disaggregation_mode": ("disaggregation-mode",),
    "disable_cuda_graph": ("disable-cuda-graph",),
    "moe_a2a_backend": ("moe-a2a-backend",),
}
_NEGATABLE = ("enable_tp_lm_head_all_to_all",)  # BooleanOptionalAction (0.5.19+): --no-enable-...
_TRUE_WORDS = ("1", "true", "yes", "on", "y", "t")
_FALSE_WORDS = ("0", "false", "no", "off", "n", "f", "")


class LaunchView:
    """The launch flags the rules read, keyed by SGLang's argparse destination (``tp_size``)."""

    def __init__(self, values, env):
        self.values, self.env = values, env

    def value(self, dest):
        return self.values.get(dest)

    def on(self, dest):
        """Whether a switch is on: ``true`` (a bare flag), 1, or yes/true/on."""
        value = self.values.get(dest)
        if isinstance(value, str):
            return value.strip().lower() in _TRUE_WORDS
        return bool(value) if isinstance(value, (bool, int)) else False

    def size(self, dest):
        """A size flag as an int (1 when unset or not a whole number: the flag check refuses such a value)."""
        try:
            return int(str(self.values.get(dest)).strip())
        except (TypeError, ValueError):
            return 1

    def env_on(self, name, default):
        """An SGLang EnvBool read from the server's environment (sglang_nccl_env is part of it)."""
        if name not in self.env:
            return default
        return str(self.env[name]).strip().lower() not in _FALSE_WORDS


def _key(name):
    return str(name).strip().lstrip("-").replace("_", "-")


def _resolve(key, exact=False):
    """(dest, negated) for a launch-args key, or (None, False) when it names no flag the rules read. ``exact``:
    no abbreviations (the key is an option string the release itself resolved)."""
    for dest, spellings in SPELLINGS.items():
        if key in spellings:
            return dest, False
        if dest in _NEGATABLE and key in ("no-" + s for s in spellings):
            return dest, True
    matches = {dest for dest, spellings in SPELLINGS.items() for s in spellings if s.startswith(key)}
    if key and not exact and len(matches) == 1:
        return matches.pop(), False
    return None, False


def launch_view(launch_args, nccl_env=None, resolved=None):
    """A :class:`LaunchView` of ``launch_args`` (the inventory's ``sglang_launch_args``: flag names without
    dashes, ``true`` for a bare flag). ``resolved``: launch-args key -> the option string the installed release
    resolved it to (module ``sglang_server_args_info``'s ``resolved``, which knows every abbreviation that release
    takes: ``tp`` -> ``--tp-size``); keys it lacks are read by :data:`SPELLINGS` and unique prefixes. ``nccl_env``:
    the server's extra environment, for the rules that read an SGLang environment variable."""
    env = {str(k): v for k, v in nccl_env.items()} if isinstance(nccl_env, Mapping) else {}
    resolved = resolved if isinstance(resolved, Mapping) else {}
    values = {}
    for name, value in (launch_args.items() if isinstance(launch_args, Mapping) else ()):
        option = resolved.get(name)
        if isinstance(option, str) and option:
            dest, negated = _resolve(_key(option), exact=True)
        else:
            dest, negated = _resolve(_key(name))
        if dest is None or value is None or value is False:
            continue
        values[dest] = (not LaunchView({"x": value}, {}).on("x")) if negated else value
    return LaunchView(values, env)


# -- the rules: when SGLang sets a variable on purpose --------------------------------------------------------
# Each returns None when the launch does not trigger it, else (the flag, what triggers it in the user's terms,
# whether SGLang overwrites a value already in the environment).

def _deterministic(view):
    if view.on("enable_deterministic_inference") and view.size("tp_size") > 1:
        return ("--enable-deterministic-inference",
                "--enable-deterministic-inference with tp-size %d" % view.size("tp_size"), True)
    return None


def _nccl_nvls(view):
    # 0.5.2-0.5.4 write NCCL_NVLS_ENABLE only without --enable-symm-mem.
    if view.on("enable_nccl_nvls") and not view.on("enable_symm_mem"):
        return "--enable-nccl-nvls", "--enable-nccl-nvls", True
    return None


def _nvls_or_symm(view):
    given = [flag for flag, dest in (("--enable-nccl-nvls", "enable_nccl_nvls"), ("--enable-symm-mem", "enable_symm_mem"))
             if view.on(dest)]
    return (given[0], " with ".join(given), True) if given else None


def _symm_mem(view):
    return ("--enable-symm-mem", "--enable-symm-mem", True) if view.on("enable_symm_mem") else None


def _kv_shard(view):
    # 0.5.23 engine.py kv_shard_symmetric_scratch: one node, no memory saver, and SGLang's defaults
    # SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER=true, SGLANG_MOONCAKE_CUSTOM_MEM_POOL unset (srt/environ.py).
    if (view.on("enable_kv_cache_sharding") and view.size("nnodes") <= 1 and not view.on("enable_memory_saver")
            and view.env_on("SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER", True)
            and "SGLANG_MOONCAKE_CUSTOM_MEM_POOL" not in view.env):
        return "--enable-kv-cache-sharding", "--enable-kv-cache-sharding on one node", False
    return None


def _mnnvl(view):
    # is_mnnvl_fabric_device() is asked on the host when SGLang starts; the controller cannot know it.
    if view.size("nnodes") > 1:
        return ("--nnodes", "--nnodes %d on an MNNVL fabric (GB200/GB300 NVL; elsewhere SGLang leaves them alone)"
                % view.size("nnodes"), False)
    return None


def _dcp(view):
    if view.size("dcp_size") > 1:
        return "--dcp-size", "--dcp-size %d" % view.size("dcp_size"), view.on("enable_symm_mem")
    return None


def _deepep_v2(view):
    if str(view.value("moe_a2a_backend") or "") == "deepep_v2":
        return "--moe-a2a-backend", "--moe-a2a-backend deepep_v2", False
    return None


def _tp_lm_head_all_to_all(view):
    # 0.5.20-0.5.22 parallel_hook.py; its default (overrides.py _tp_lm_head_all_to_all_default) is on for a
    # decode node whose tp-size equals its attention DP size: counted here for any decode node with attention DP.
    flag = "--enable-tp-lm-head-all-to-all"
    if view.value("enable_tp_lm_head_all_to_all") is not None:
        return (flag, flag, False) if view.on("enable_tp_lm_head_all_to_all") else None
    attn_dp = view.size("attn_dp_size") > 1 or (view.on("enable_dp_attention") and view.size("dp_size") > 1)
    if str(view.value("disaggregation_mode") or "") == "decode" and attn_dp and not view.on("enable_dp_lm_head"):
        return (flag, "--disaggregation-mode decode with attention DP (%s is on by default there)" % flag, False)
    return None


def _pausable_graph_pool(view):
    if view.on("enable_memory_saver") and view.env_on("SGLANG_MEMORY_SAVER_CUDA_GRAPH", False):
        return "--enable-memory-saver", "--enable-memory-saver with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1", False
    return None


def _graph_collectives(view):
    # 0.5.23 parallel_hook.py _graph_may_capture_collectives: tp, ep or dp size > 1 and a CUDA graph phase on.
    multi = ["--%s %d" % (flag, view.size(dest)) for flag, dest in (("tp-size", "tp_size"), ("ep-size", "ep_size"),
                                                                    ("dp-size", "dp_size")) if view.size(dest) > 1]
    if multi and not view.on("disable_cuda_graph"):
        return multi[0].split()[0], "%s with CUDA graphs on" % " and ".join(multi), False
    return None


# rule -> (why SGLang sets the variables, what decides it)
RULES = {
    "deterministic": ("for deterministic results", _deterministic),
    "nccl_nvls": ("to turn NCCL NVLS on", _nccl_nvls),
    "nvls_or_symm": ("to turn NCCL NVLS on", _nvls_or_symm),
    "symm_mem": ("for NCCL symmetric memory (cuMem buffers)", _symm_mem),
    "kv_shard": ("for the KV-shard gather's symmetric window, which needs cuMem", _kv_shard),
    "mnnvl": ("for cross-node NVLink (cuMem buffers, MNNVL transport)", _mnnvl),
    "dcp": ("for decode context parallelism's symmetric kernels", _dcp),
    "deepep_v2": ("because DeepEP v2's ElasticBuffer requires cuMem", _deepep_v2),
    "tp_lm_head_all_to_all": ("because the graph-captured TP LM-head all-to-all can deadlock with registered "
                              "buffers", _tp_lm_head_all_to_all),
    "pausable_graph_pool": ("because graph replay can hang once the memory saver remaps the graph pool",
                            _pausable_graph_pool),
    "graph_collectives": ("because replaying captured cross-rank collectives can hang with registered buffers",
                          _graph_collectives),
}


def _w(rule, file, function, variable, kind, value, exprs, lines, after=None, gone_in=None, value_env=None):
    """One write site of WRITES (see there)."""
    return {"rule": rule, "file": file, "function": function, "variable": variable, "kind": kind, "value": value,
            "value_env": value_env, "exprs": tuple(exprs), "lines": lines, "after": after, "gone_in": gone_in}


_SERVER = "srt/server.py"
_ENGINE = "srt/entrypoints/engine.py"
_ARGS = "srt/server_args.py"
_ATTN = "srt/arg_groups/attention_hook.py"
_SET_ENVS = "_set_envs_and_config"
_DET = "ServerArgs._handle_deterministic_inference"
_DET_HOOK = "handle_deterministic_inference"
_SYMM_EXPRS = ("computed: str(int(server_args.enable_symm_mem))", "computed: str(int(cfg.enable_symm_mem))")
_NVLS_EXPRS = ("computed: str(int(server_args.enable_nccl_nvls or server_args.enable_symm_mem))",
               "computed: str(int(cfg.enable_nccl_nvls or cfg.enable_symm_mem))")
_NCHANNELS = "SGLANG_DETERMINISTIC_NCCL_NCHANNELS"  # srt/environ.py EnvInt(8), 0.5.18-0.5.23

# Every NCCL_* write of srt/server_args.py, srt/arg_groups/**/*.py and _set_envs_and_config in the SURVEYED
# releases (PyPI wheels; tests/support/sglang_nccl_writes.py lists them). rule None: unconditional, the defaults the
# patch is there to override (never a conflict). kind: set (os.environ[...] =) or setdefault, as written; value:
# what SGLang sets when the rule applies (value_env: read from that SGLang variable, value its default); exprs: the
# value as the lister prints it; lines: release -> line; after/gone_in: the newest surveyed release without it
# before, the first without it after (exclusive bounds, None = open).
WRITES = (
    # 0.3.6-0.4.1.post6 srt/server.py: NCCL switched off, whatever the flags.
    _w(None, _SERVER, _SET_ENVS, "NCCL_CUMEM_ENABLE", "set", "0", ["0"], {"0.3.6": 526, "0.4.1.post6": 621},
       gone_in="0.4.1.post7"),
    _w(None, _SERVER, _SET_ENVS, "NCCL_NVLS_ENABLE", "set", "0", ["0"], {"0.3.6": 527, "0.4.1.post6": 622},
       gone_in="0.4.1.post7"),
    _w(None, _ENGINE, _SET_ENVS, "NCCL_CUMEM_ENABLE", "set", "0", ["0"],
       {"0.4.1.post7": 298, "0.4.5": 396, "0.4.6": 428}, after="0.4.1.post6", gone_in="0.5.2"),
    _w(None, _ENGINE, _SET_ENVS, "NCCL_NVLS_ENABLE", "set", "0", ["0"], {"0.4.1.post7": 299},
       after="0.4.1.post6", gone_in="0.4.5"),
    # NCCL_NVLS_ENABLE=str(int(enable_nccl_nvls)): 0 (a default) without the flag, 1 with it; 0.5.2-0.5.4 only
    # without --enable-symm-mem.
    _w("nccl_nvls", _ENGINE, _SET_ENVS, "NCCL_NVLS_ENABLE", "set", "1",
       ["computed: str(int(server_args.enable_nccl_nvls))"],
       {"0.4.5": 397, "0.4.6": 429, "0.5.2": 654, "0.5.3": 676, "0.5.4": 674}, after="0.4.1.post7", gone_in="0.5.5"),
    # NCCL_CUMEM_ENABLE=str(int(enable_symm_mem)): always up to 0.5.4; from 0.5.5 when unset or with the flag.
    _w("symm_mem", _ENGINE, _SET_ENVS, "NCCL_CUMEM_ENABLE", "set", "1", _SYMM_EXPRS,
       {"0.5.2": 652, "0.5.3": 674, "0.5.4": 672, "0.5.5": 680, "0.5.6": 692, "0.5.10": 1090, "0.5.11": 1124,
        "0.5.12": 1223, "0.5.14": 1240, "0.5.17": 1583, "0.5.18": 1660, "0.5.19": 1659, "0.5.20": 1678,
        "0.5.21": 1802, "0.5.22": 1876}, after="0.4.6", gone_in="0.5.23"),
    # 0.5.23: str(int(enable_symm_mem or kv_shard_symmetric_scratch)), when unset or with --enable-symm-mem.
    _w("symm_mem", _ENGINE, _SET_ENVS, "NCCL_CUMEM_ENABLE", "set", "1",
       ["computed: str(int(cfg.enable_symm_mem or kv_shard_symmetric_scratch))"], {"0.5.23": 1905}, after="0.5.22"),
    _w("kv_shard", _ENGINE, _SET_ENVS, "NCCL_CUMEM_ENABLE", "set", "1",
       ["computed: str(int(cfg.enable_symm_mem or kv_shard_symmetric_scratch))"], {"0.5.23": 1905}, after="0.5.22"),
    # From 0.5.5: when unset, or with either flag (then overwritten).
    _w("nvls_or_symm", _ENGINE, _SET_ENVS, "NCCL_NVLS_ENABLE", "set", "1", _NVLS_EXPRS,
       {"0.5.5": 686, "0.5.6": 698, "0.5.10": 1096, "0.5.11": 1130, "0.5.12": 1229, "0.5.14": 1246, "0.5.17": 1589,
        "0.5.18": 1666, "0.5.19": 1665, "0.5.20": 1684, "0.5.21": 1808, "0.5.22": 1882, "0.5.23": 1913},
       after="0.5.4"),
    # --enable-deterministic-inference with tp > 1 (not on ROCm from 0.5.10): server_args.py up to 0.5.18.
    _w("deterministic", _ARGS, _DET, "NCCL_ALGO", "set", "allreduce:tree", ["allreduce:tree"],
       {"0.5.3": 1278, "0.5.4": 1554, "0.5.5": 1842, "0.5.6": 2000, "0.5.10": 3512, "0.5.11": 4057,
        "0.5.12": 4396, "0.5.14": 6054, "0.5.17": 7881, "0.5.18": 8270}, after="0.5.2", gone_in="0.5.19"),
    _w("deterministic", _ARGS, _DET, "NCCL_MIN_NCHANNELS", "set", "8", ["computed: nchannels"], {"0.5.18": 8280},
       after="0.5.17", gone_in="0.5.19", value_env=_NCHANNELS),
    _w("deterministic", _ARGS, _DET, "NCCL_MAX_NCHANNELS", "set", "8", ["computed: nchannels"], {"0.5.18": 8281},
       after="0.5.17", gone_in="0.5.19", value_env=_NCHANNELS),
    # ... then srt/arg_groups/attention_hook.py.
    _w("deterministic", _ATTN, _DET_HOOK, "NCCL_ALGO", "set", "allreduce:tree", ["allreduce:tree"],
       {"0.5.19": 609, "0.5.20": 589, "0.5.21": 586, "0.5.22": 674, "0.5.23": 676}, after="0.5.18"),
    _w("deterministic", _ATTN, _DET_HOOK, "NCCL_MIN_NCHANNELS", "set", "8", ["computed: nchannels"],
       {"0.5.19": 630, "0.5.20": 610, "0.5.21": 607, "0.5.22": 695, "0.5.23": 697}, after="0.5.18",
       value_env=_NCHANNELS),
    _w("deterministic", _ATTN, _DET_HOOK, "NCCL_MAX_NCHANNELS", "set", "8", ["computed: nchannels"],
       {"0.5.19": 631, "0.5.20": 611, "0.5.21": 608, "0.5.22": 696, "0.5.23": 698}, after="0.5.18",
       value_env=_NCHANNELS),
    # nnodes > 1 on an MNNVL fabric (is_mnnvl_fabric_device()).
    _w("mnnvl", _ENGINE, _SET_ENVS, "NCCL_CUMEM_ENABLE", "setdefault", "1", ["1"],
       {"0.5.17": 1580, "0.5.18": 1657, "0.5.19": 1656, "0.5.20": 1675, "0.5.21": 1799, "0.5.22": 1873,
        "0.5.23": 1885}, after="0.5.14"),
    _w("mnnvl", _ENGINE, _SET_ENVS, "NCCL_MNNVL_ENABLE", "setdefault", "1", ["1"],
       {"0.5.17": 1581, "0.5.18": 1658, "0.5.19": 1657, "0.5.20": 1676, "0.5.21": 1800, "0.5.22": 1874,
        "0.5.23": 1886}, after="0.5.14"),
    # dcp_size > 1: when unset, or with --enable-symm-mem (then overwritten).
    _w("dcp", _ENGINE, _SET_ENVS, "NCCL_GRAPH_MIXING_SUPPORT", "set", "0", ["0"],
       {"0.5.17": 1596, "0.5.18": 1673, "0.5.19": 1672, "0.5.20": 1691, "0.5.21": 1815, "0.5.22": 1889,
        "0.5.23": 1920}, after="0.5.14"),
    _w("deepep_v2", "srt/arg_groups/moe_hook.py", "handle_a2a_moe", "NCCL_CUMEM_ENABLE", "setdefault", "1", ["1"],
       {"0.5.19": 192, "0.5.20": 336, "0.5.21": 334, "0.5.22": 339, "0.5.23": 403}, after="0.5.18"),
    # srt/arg_groups/parallel_hook.py _disable_nccl_graph_buffer_registration: one write, callers per release.
    _w("tp_lm_head_all_to_all", "srt/arg_groups/parallel_hook.py", "_disable_nccl_graph_buffer_registration",
       "NCCL_GRAPH_REGISTER", "setdefault", "0", ["0"], {"0.5.20": 258, "0.5.21": 326, "0.5.22": 402},
       after="0.5.19", gone_in="0.5.23"),
    _w("pausable_graph_pool", "srt/arg_groups/parallel_hook.py", "_disable_nccl_graph_buffer_registration",
       "NCCL_GRAPH_REGISTER", "setdefault", "0", ["0"], {"0.5.22": 402}, after="0.5.21", gone_in="0.5.23"),
    _w("graph_collectives", "srt/arg_groups/parallel_hook.py", "_disable_nccl_graph_buffer_registration",
       "NCCL_GRAPH_REGISTER", "setdefault", "0", ["0"], {"0.5.23": 425}, after="0.5.22"),
)

_VERSION = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(?:[.-]?(a|b|rc|dev|post)\.?(\d*))?")
_PHASES = {"dev": -4, "a": -3, "b": -2, "rc": -1, None: 0, "post": 1}


def version_key(version):
    """A sortable key of an SGLang version (``0.5.23``, ``0.5.0rc2``, ``0.5.24.dev3+g1a2b``, ``0.5.6.post1``), or
    None when ``version`` is none of those."""
    match = _VERSION.match(str(version)) if version is not None else None
    if not match:
        return None
    numbers = tuple(int(part) for part in match.group(1).split("."))
    numbers += (0,) * (4 - len(numbers))
    return numbers, _PHASES[match.group(2)], int(match.group(3) or 0)


def rules_release(version):
    """(the release whose rules apply, a note or '') for ``version``: newer or unknown releases get the newest
    surveyed release's rules, and the note says so."""
    key = version_key(version)
    if key is None:
        return NEWEST, ("sglang release %s: the rules of %s, the newest release gpufleet has checked, were used"
                        % ("unknown" if version in (None, "") else repr(str(version)), NEWEST))
    if key > version_key(NEWEST):
        return NEWEST, ("sglang %s is newer than %s, the newest release gpufleet has checked: its rules were used"
                        % (version, NEWEST))
    return str(version), ""


def writes_for(version):
    """The entries of :data:`WRITES` present in ``version`` (a release as :func:`rules_release` gives it)."""
    key = version_key(version)
    return [w for w in WRITES
            if (w["after"] is None or key > version_key(w["after"]))
            and (w["gone_in"] is None or key < version_key(w["gone_in"]))]


def _cite(write, version):
    """(release, line) of ``write``: in ``version`` or the nearest surveyed release before it (else the newest)."""
    key = version_key(version)
    known = sorted(write["lines"], key=version_key)
    before = [v for v in known if version_key(v) <= key]
    release = before[-1] if before else known[-1]
    return release, write["lines"][release]


def _same(mine, sglang):
    """Whether the user's value ``mine`` is the one SGLang sets: integers as NCCL reads them, names (NCCL_ALGO)
    without regard to case, as NCCL compares them."""
    mine, sglang = str(mine).strip(), str(sglang).strip()
    if mine.lower() == sglang.lower():
        return True
    a, b = strtoll(mine), strtoll(sglang)
    return a is not None and a == b


def _sglang_value(write, env):
    if write["value_env"] and write["value_env"] in env:
        return str(env[write["value_env"]]).strip()
    return write["value"]


def _show(items):
    return ", ".join("%s=%s" % (name, value) for name, value in items)


def nccl_conflicts(sglang_version, launch_args, nccl_env, overrides=(), resolved=None, server_env=None):
    """The variables of ``nccl_env`` that would replace a value SGLang sets on purpose for this launch.

    ``sglang_version``: the installed release (str; a dev build, or None when unknown: the newest surveyed rules
    then apply and each message says so). ``launch_args``: the inventory's ``sglang_launch_args`` (flag names
    without dashes, ``true`` for a bare flag; ``tp``, ``tp-size`` or ``tensor-parallel-size``, ``pp``, ``pp-size``
    or ``pipeline-parallel-size``; a unique prefix as argparse takes it). ``resolved``: the option string the
    release resolved each key to (module ``sglang_server_args_info``'s ``resolved``), which wins over this module's
    own reading of the key (see :func:`launch_view`).
    ``nccl_env``: the inventory's ``sglang_nccl_env``. ``overrides``: names whose value replaces SGLang's on purpose
    (``sglang_nccl_env_overrides``; a comma-separated string counts as a list; any other type gives one entry whose
    message says so, and nothing else is judged). ``server_env``: the rest of the server's environment
    (``sglang_launch_extra_env``), read for what SGLang takes from it (``SGLANG_DETERMINISTIC_NCCL_NCHANNELS``).

    Returns a list of dicts, one per rule the launch triggers with at least one differing variable: ``flag``,
    ``condition`` (what triggers it, e.g. ``--enable-deterministic-inference with tp-size 8``), ``variables`` (names
    in ``nccl_env``), ``sglang_sets`` (name -> SGLang's value, ``computed`` when not known here), ``yours`` (name ->
    the value in ``nccl_env``), ``where`` (``sglang <release> <file>:<lines>``), ``rules_from`` (the release whose
    rules were used) and ``message`` (naming the flag, the variables, SGLang's values and
    ``sglang_nccl_env_overrides``). Empty when nothing conflicts.
    """
    if not isinstance(nccl_env, Mapping) or not nccl_env:
        return []
    allowed, problem = override_names(overrides)
    if problem:
        return [{"flag": None, "condition": None, "variables": [], "sglang_sets": {}, "yours": {}, "where": None,
                 "rules_from": None, "message": problem}]
    env = {str(k): v for k, v in nccl_env.items()}
    # What SGLang reads at start (its EnvBool switches, SGLANG_DETERMINISTIC_NCCL_NCHANNELS): the server's whole
    # environment, sglang_nccl_env over sglang_launch_extra_env, as the launch renders it.
    seen = dict(((str(k), v) for k, v in (server_env or {}).items()), **env) if isinstance(server_env, Mapping) else env
    view = launch_view(launch_args, seen, resolved)
    release, note = rules_release(sglang_version)
    present = writes_for(release)
    conflicts = []
    for rule_id, (purpose, decide) in RULES.items():
        writes = [w for w in present if w["rule"] == rule_id]
        decision = decide(view) if writes else None
        if decision is None:
            continue
        differing, where = {}, {}
        for write in writes:
            name = write["variable"]
            if name not in env or name in allowed or name in differing:
                continue
            value = _sglang_value(write, seen)
            if value is not None and _same(env[name], value):
                continue
            differing[name] = write
            cited, line = _cite(write, release)
            where.setdefault((cited, write["file"]), []).append(str(line))
        if differing:
            conflicts.append(_conflict(decision, purpose, differing, seen, where, release, note))
    unused = sorted(name for name in allowed if name not in env)
    if conflicts and unused:
        # A misspelt override lets nothing through: say so where the refusal tells the user to list the names.
        for conflict in conflicts:
            conflict["message"] += "; %s names %s, which sglang_nccl_env does not set" % (
                OVERRIDES_VAR, ", ".join(unused))
    return conflicts


def override_names(overrides):
    """``(names, problem)``: the set of names in ``sglang_nccl_env_overrides`` and None, or an empty set and a
    message when it is not a list of names. A string is a comma-separated list (as Ansible's ``list`` type reads
    ``-e sglang_nccl_env_overrides=NCCL_ALGO,NCCL_MAX_NCHANNELS``)."""
    if overrides is None:
        return set(), None
    if isinstance(overrides, str):
        overrides = overrides.split(",")
    if isinstance(overrides, (list, tuple)) and all(isinstance(name, str) for name in overrides):
        return {name.strip() for name in overrides if name.strip()}, None
    return set(), ("%s must be a list of variable names of sglang_nccl_env (e.g. [NCCL_ALGO]), got %s %r"
                   % (OVERRIDES_VAR, type(overrides).__name__, overrides))


def _conflict(decision, purpose, differing, env, where, release, note):
    flag, condition, forced = decision
    names = list(differing)
    sglang_sets = {}
    for name, write in differing.items():
        value = _sglang_value(write, env)
        sglang_sets[name] = "computed" if value is None else value
    shown = []
    for name, write in differing.items():
        text = "%s=%s" % (name, sglang_sets[name])
        if write["value_env"]:
            text += " (from %s, default %s)" % (write["value_env"], write["value"])
        shown.append(text)
    yours = {name: str(env[name]) for name in names}
    cites = "; ".join("sglang %s %s:%s" % (cited, path, ",".join(lines)) for (cited, path), lines in where.items())
    them = "it" if len(names) == 1 else "them"
    how = ("the NCCL patch runs after SGLang, so yours would win" if forced else
           "SGLang sets %s only when unset and sglang_nccl_env is in the server's environment, so yours would be "
           "kept" % them)
    message = ("sglang_nccl_env would undo what %s makes SGLang set on purpose, %s: SGLang sets %s in %s; "
               "sglang_nccl_env has %s, and %s. Remove %s from sglang_nccl_env, or list %s in %s to replace "
               "SGLang's %s on purpose"
               % (condition, purpose, ", ".join(shown), cites, _show(yours.items()), how, ", ".join(names), them,
                  OVERRIDES_VAR, "value" if len(names) == 1 else "values"))
    if note:
        message += " (%s)" % note
    return {"flag": flag, "condition": condition, "variables": names, "sglang_sets": sglang_sets, "yours": yours,
            "where": cites, "rules_from": release, "message": message}
