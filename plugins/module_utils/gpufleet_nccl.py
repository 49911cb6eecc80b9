# -*- coding: utf-8 -*-
# gpufleet: the values NCCL accepts for the tuning variables gpufleet writes into SGLang's engine.py.
"""Check the value of an NCCL tuning variable against what NCCL itself accepts, before it reaches a worker.

A value NCCL does not understand is either refused when the first communicator is created (the TP workers
die, the server never serves) or, worse, silently replaced by a default (the server serves, 30 % slower).
Both happen long after the patch, on every host of the batch. The rules below are read from NCCL's own
parsers (github.com/NVIDIA/nccl, ``src/graph/tuning.cc``, ``src/graph/paths.cc``, ``src/misc/param.cc``,
``src/debug.cc``; 2.24.3 and the master of 2026-06):

- ``NCCL_PROTO`` / ``NCCL_ALGO`` (``parseList``): ``[^]NAME[,NAME...]``, names case-insensitive; since 2.24 also
  per collective, ``Func:[^]NAME[,...][;Func:...]`` (only the first entry may lack ``Func:``). An unknown name
  makes ``ncclCommInitRank`` fail with ncclInvalidUsage (before 2.24 it was dropped, so ``NCCL_PROTO=5``
  disabled every protocol).
- ``NCCL_P2P_LEVEL`` / ``NCCL_NET_GDR_LEVEL`` (``ncclGetLevel``): a path type, compared case-sensitively, or an
  old-style number; anything else is ignored without a warning (``nvl`` means "let NCCL choose").
- Integer parameters (``NCCL_PARAM``, read with ``strtoll(s, NULL, 0)``): only the leading number counts, also
  without a warning (``NCCL_BUFFSIZE=4M`` is 4 bytes, ``NCCL_MAX_NCHANNELS=abc`` is 0 channels).
- ``NCCL_NTHREADS``: a multiple of 32 from 64 to 512; other values are replaced by the nearest limit.
- ``NCCL_DEBUG``: one of the log levels; anything else means no logging.

Variables not listed here (``NCCL_IB_HCA``, ``NCCL_SOCKET_IFNAME``, any non-NCCL name) are not checked: their
syntax is free text or site-specific. A name in ``unchecked`` is not checked either, for an NCCL release that
accepts a value this table does not know (a new algorithm name).

Nothing here needs Ansible or third-party packages.
"""
from __future__ import annotations

import re

# NCCL's ncclFuncStr, ncclProtoStr, ncclAlgoStr (src/init.cc).
COLLECTIVES = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
# topoPathTypeStr up to PATH_SYS (src/graph/topo.cc; C2C, P2C and PXN are in newer releases only).
PATH_LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")
DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "ABORT", "TRACE")

# What strtoll(s, NULL, 0) reads whole: a sign, then 0x hex, 0 octal or decimal.
_HEX = re.compile(r"[+-]?0[xX][0-9a-fA-F]+")
_OCTAL = re.compile(r"[+-]?0[0-7]*")
_DECIMAL = re.compile(r"[+-]?[1-9][0-9]*")

# name -> smallest value that means something (None: any integer, e.g. a 0/1 switch).
INTEGER_PARAMS = {
    "NCCL_MAX_NCHANNELS": 1,
    "NCCL_MIN_NCHANNELS": 1,
    "NCCL_MAX_CTAS": 1,
    "NCCL_MIN_CTAS": 1,
    "NCCL_NCHANNELS_PER_NET_PEER": 1,
    "NCCL_BUFFSIZE": 1,
    "NCCL_LL_BUFFSIZE": 1,
    "NCCL_LL128_BUFFSIZE": 1,
    "NCCL_P2P_NET_CHUNKSIZE": 1,
    "NCCL_P2P_NVL_CHUNKSIZE": 1,
    "NCCL_P2P_PCI_CHUNKSIZE": 1,
    "NCCL_SOCKET_NTHREADS": 1,
    "NCCL_NSOCKS_PERTHREAD": 1,
    "NCCL_IB_QPS_PER_CONNECTION": 1,
    "NCCL_IB_TIMEOUT": 1,
    "NCCL_IB_RETRY_CNT": 0,
    "NCCL_P2P_DISABLE": None,
    "NCCL_SHM_DISABLE": None,
    "NCCL_IB_DISABLE": None,
    "NCCL_NVLS_ENABLE": None,
    "NCCL_CUMEM_ENABLE": None,
    "NCCL_NET_GDR_READ": None,
    "NCCL_CROSS_NIC": None,
    "NCCL_PXN_DISABLE": None,
    "NCCL_P2P_PXN_LEVEL": None,
    "NCCL_NVB_DISABLE": None,
    "NCCL_COLLNET_ENABLE": None,
    "NCCL_GRAPH_REGISTER": None,
    "NCCL_DMABUF_ENABLE": None,
    "NCCL_IGNORE_CPU_AFFINITY": None,
}

NTHREADS_MIN, NTHREADS_MAX, WARP_SIZE = 64, 512, 32


def strtoll(text):
    """The int NCCL's ``strtoll(text, NULL, 0)`` reads from ``text`` (str), or None when text is left over.

    ``"0x10"`` is 16, ``"010"`` is 8 (octal) and ``" 16"`` is 16, as in C; ``"09"``, ``"16 "`` and ``"abc"`` give
    None.
    """
    text = text.lstrip(" \t\n\v\f\r")  # strtoll skips leading white space (isspace)
    if _HEX.fullmatch(text):
        return int(text, 16)
    if _OCTAL.fullmatch(text):
        return int(text, 8)
    if _DECIMAL.fullmatch(text):
        return int(text, 10)
    return None


def _list_problem(text, elements):
    """Problem text for a parseList value (NCCL_PROTO, NCCL_ALGO), or None when NCCL accepts it.

    Empty tokens are skipped, as NCCL's strtok does; an entry that names nothing ("^", "AllReduce:") is a
    problem, because it enables or excludes nothing or every element.
    """
    known = {element.lower() for element in elements}
    funcs = {func.lower() for func in COLLECTIVES}
    unknown = []
    for index, entry in enumerate(part for part in text.split(";") if part):
        prefix, sep, items = entry.partition(":")
        if not sep:
            if index > 0:
                return ("only the first ';' entry may leave out the collective; write e.g. "
                        "'AllReduce:%s;Broadcast:%s'" % (elements[0], elements[-1]))
            items = entry
        elif prefix.lower() not in funcs:
            unknown.append(prefix)
        names = [item for item in (items[1:] if items.startswith("^") else items).split(",") if item]
        if not names:
            return "%r names no %s" % (entry, "protocol" if elements is PROTOCOLS else "algorithm")
        unknown.extend(item for item in names if item.lower() not in known)
    if not unknown:
        return None
    return "%s not known to NCCL" % ", ".join(repr(word) for word in unknown)


def value_problem(name, text):
    """Why NCCL would not take ``text`` (str) for variable ``name`` as meant, or None when it would.

    Returns one sentence ending in what NCCL accepts; variables without a rule here always give None.
    """
    if name in ("NCCL_PROTO", "NCCL_ALGO"):
        elements = PROTOCOLS if name == "NCCL_PROTO" else ALGORITHMS
        problem = _list_problem(text, elements)
        if problem is None:
            return None
        return ("%s=%r: %s. NCCL takes a comma-separated list of %s (any case), '^' first to exclude them, or per "
                "collective as 'AllReduce:%s;Broadcast:%s'; NCCL 2.24+ refuses anything else when the "
                "workers start (ncclInvalidUsage), older releases drop the names they do not know"
                % (name, text, problem, ", ".join(elements), elements[0], elements[-1]))
    if name in ("NCCL_P2P_LEVEL", "NCCL_NET_GDR_LEVEL", "NCCL_IB_GDR_LEVEL"):
        if text in PATH_LEVELS or re.fullmatch(r"[0-9]+", text):
            return None
        return ("%s=%r: NCCL takes a path type in capitals (%s) or an old-style number, and ignores anything "
                "else without a warning" % (name, text, ", ".join(PATH_LEVELS)))
    if name == "NCCL_DEBUG":
        if text.upper() in DEBUG_LEVELS:
            return None
        return "%s=%r: NCCL takes one of %s; anything else turns its logging off" % (
            name, text, ", ".join(DEBUG_LEVELS))
    if name == "NCCL_NTHREADS":
        number = strtoll(text)
        if number is not None and NTHREADS_MIN <= number <= NTHREADS_MAX and number % WARP_SIZE == 0:
            return None
        return ("%s=%r: NCCL takes a multiple of %d from %d to %d (e.g. 256 or 512) and replaces anything else by "
                "its limit" % (name, text, WARP_SIZE, NTHREADS_MIN, NTHREADS_MAX))
    if name in INTEGER_PARAMS:
        minimum = INTEGER_PARAMS[name]
        number = strtoll(text)
        if number is None:
            return ("%s=%r: NCCL reads only the leading number of this variable, without a warning ('4M' is 4, "
                    "'abc' is 0); give a plain integer (decimal or 0x hex)" % (name, text))
        if minimum is not None and number < minimum:
            return "%s=%r: must be %d or more" % (name, text, minimum)
        return None
    return None


def name_problem(name):
    """Why NCCL would never read variable ``name`` (str), or None: NCCL's getenv is case-sensitive, so
    ``nccl_proto`` is a variable nothing reads (``sglang_nccl_env_unchecked`` does not change that)."""
    if name.upper().startswith("NCCL_") and name != name.upper():
        return "%s: NCCL reads %s (capitals) and never looks at %s" % (name, name.upper(), name)
    return None


def env_value_problems(items, unchecked=()):
    """Problems with the values of ``items`` (iterable of ``(name, str value)``), one sentence per bad value
    (names with a :func:`name_problem` are left to that).

    ``unchecked`` (iterable of names) are left out. Returns a list of str, empty when every value is one NCCL
    takes as meant.
    """
    skip = set(unchecked or ())
    problems = []
    for name, text in items:
        if name in skip or name_problem(name):
            continue
        problem = value_problem(name, text)
        if problem:
            problems.append(problem)
    return problems
