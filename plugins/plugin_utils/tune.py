"""The tune loop's decisions (playbooks/tune.yml, role sglang_tune; controller side): which candidates a run may
try, the effective values of a candidate, the interleaved order of the rounds, the statistics of the measured
figures, the honest decision between the best candidate and the baseline, the report (JSON) and its table.

Plain functions (no Ansible needed), re-exported as the ``gpufleet_tune_<name>`` filters of
plugins/filter/gpufleet_tune.py; unit tests: tests/unit/test_plugin_utils_tune.py; how the winner is chosen:
docs/tune.md.

A candidate is a mapping: ``name`` (:data:`NAME_RE`, unique, not ``baseline``), ``sglang_nccl_env`` (NCCL variable
name -> str/int, or null = remove that variable), ``sglang_launch_args`` (SGLang flag name without dashes -> value,
or null = remove that flag), ``note`` (str). Its values override the canary's own, key by key
(:func:`apply_overrides`). The baseline, named ``baseline``, is the canary's own values, measured like any
candidate.

- ``check_candidates(candidates, unchecked=())`` -> [str]: why ``gpufleet_tune_candidates`` cannot be tried.
- ``apply_overrides(own, overrides)`` -> dict: own values with a candidate's overrides.
- ``schedule(names, repeats)`` -> [{"round", "repeat", "name"}]: every repeat visits every name once, in an order
  that changes from repeat to repeat (a balanced Latin square), so slow drift of the host favours no one.
- ``summarize(values)``, ``round_result(...)``, ``report(...)``, ``table(report)``, ``progress_line(...)``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl_plan import PatchError, normalise_env

# Metric -> which way is better. *_tok_s: SGLang bench_serving's output tokens per second (single stream: max
# concurrency 1; throughput: at gpufleet_tune_concurrency); *_ms: median time to first token / inter-token latency
# of the single-stream run.
METRICS = {"single_stream_tok_s": "higher", "throughput_tok_s": "higher", "ttft_ms": "lower", "itl_ms": "lower"}
BASELINE = "baseline"
MAX_CANDIDATES = 32
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
FLAG_RE = re.compile(r"^[a-z0-9][a-z0-9-]*\Z")
KEYS = ("name", "sglang_nccl_env", "sglang_launch_args", "note")
# Flags gpufleet renders itself (sglang_host, sglang_port) and flags that carry a secret (sglang_api_key): a
# candidate cannot move the canary's address or put a key into the report, the history and the profile.
_RESERVED_FLAGS = {"host": "sglang_host", "port": "sglang_port"}
_KEY_FLAG_RE = re.compile(r"^(admin-)?api-key\Z")


def _kind(value):
    """What ``value`` is, in words (Ansible's own string, list and mapping types are subclasses)."""
    for kind, word in ((bool, "a boolean"), (str, "a string"), (Mapping, "a mapping"), ((list, tuple), "a list"),
                       ((int, float), "a number")):
        if isinstance(value, kind):
            return word
    if value is None:
        return "null"
    return "a " + type(value).__name__


def _label(index, entry):
    """How a message names a candidate: its position (1-based) and, when it has a usable one, its name."""
    name = entry.get("name") if isinstance(entry, Mapping) else None
    if isinstance(name, str) and name:
        return "candidate %d (%s)" % (index + 1, name)
    return "candidate %d" % (index + 1)


def _env_problems(label, env, unchecked):
    if env is None:
        return []
    if not isinstance(env, Mapping):
        return ["%s: sglang_nccl_env is %s; give a mapping of variable name to value, e.g. {NCCL_PROTO: LL, "
                "NCCL_MAX_NCHANNELS: 16} (null for a variable removes it from the canary's own)"
                % (label, _kind(env))]
    # null = remove: nothing to check for those; the rest is judged like the inventory's sglang_nccl_env (the NCCL
    # patch's own rules: names, value types, values NCCL would refuse or misread).
    names = [name for name in env if not isinstance(name, str)]
    if names:
        return ["%s: sglang_nccl_env has variable names that are not text: %s" % (label, ", ".join(map(repr, names)))]
    given = dict((name, value) for name, value in env.items() if value is not None)
    try:
        normalise_env(given, unchecked)
    except PatchError as exc:
        message = str(exc)
        message = message.replace("invalid env: ", "", 1).replace(" (module option unchecked)", "")
        return ["%s: sglang_nccl_env: %s" % (label, message)]
    return []


def _args_problems(label, args):
    if args is None:
        return []
    if not isinstance(args, Mapping):
        return ["%s: sglang_launch_args is %s; give a mapping of SGLang flag name (without dashes) to value, e.g. "
                "{speculative-num-steps: 2} (null for a flag removes it from the canary's own)" % (label, _kind(args))]
    out = []
    for flag in args:
        text = flag if isinstance(flag, str) else repr(flag)
        if not isinstance(flag, str) or not FLAG_RE.match(flag):
            bare = flag.lstrip("-").replace("_", "-").lower() if isinstance(flag, str) else ""
            hint = "write %s" % bare if FLAG_RE.match(bare) else "e.g. speculative-num-steps"
            out.append("%s: sglang_launch_args key %s is not an SGLang flag name as gpufleet writes it (lower case, "
                       "digits and dashes, without the leading dashes): %s" % (label, text, hint))
        elif flag in _RESERVED_FLAGS:
            out.append("%s: sglang_launch_args must not set %s: gpufleet renders --%s from %s, and a candidate "
                       "cannot move the canary's server" % (label, flag, flag, _RESERVED_FLAGS[flag]))
        elif _KEY_FLAG_RE.match(flag):
            out.append("%s: sglang_launch_args must not set %s: the key would show in the report, the history and "
                       "the profile; the canary's sglang_api_key is used as it is" % (label, flag))
    return out


def check_candidates(candidates, unchecked=()):
    """Why ``candidates`` (``gpufleet_tune_candidates``) cannot be tried, one message per problem in the user's
    words; [] when they can.

    Refused: anything but a list of 1 to :data:`MAX_CANDIDATES` mappings; keys other than :data:`KEYS`; a name
    that is missing, does not match :data:`NAME_RE`, is ``baseline`` (any case: the canary's own values) or is
    given twice (names compared without case: they become profile file names); ``sglang_nccl_env`` that is not a
    mapping or has a name or value the NCCL patch would refuse (the same rules as the inventory's
    ``sglang_nccl_env``; ``unchecked``: the names of ``sglang_nccl_env_unchecked``, whose values are not checked);
    ``sglang_launch_args`` that is not a mapping, a flag name that is not a dash-less SGLang flag name
    (:data:`FLAG_RE`; whether the installed release knows it is the preflight's job), ``host``/``port`` or an
    API key flag; a ``note`` that is not text; a candidate that overrides nothing (it would be the baseline
    again).
    """
    if candidates is None or isinstance(candidates, (str, Mapping)) or not isinstance(candidates, (list, tuple)):
        return ["gpufleet_tune_candidates must be a list of candidates, each a mapping with a name and "
                "sglang_nccl_env and/or sglang_launch_args overrides (e.g. -e @candidates.yml), got %s"
                % _kind(candidates)]
    if not candidates:
        return ["gpufleet_tune_candidates is empty: give at least one candidate to measure against the baseline"]
    if len(candidates) > MAX_CANDIDATES:
        return ["gpufleet_tune_candidates has %d candidates; at most %d are tried in one run (each costs a restart "
                "per repeat)" % (len(candidates), MAX_CANDIDATES)]
    unchecked = list(unchecked or ())
    out = []
    seen = {}
    for index, entry in enumerate(candidates):
        label = _label(index, entry)
        if not isinstance(entry, Mapping):
            out.append("%s is %s; each candidate is a mapping with name, sglang_nccl_env, sglang_launch_args, note"
                       % (label, _kind(entry)))
            continue
        unknown = [str(key) for key in entry if key not in KEYS]
        if unknown:
            out.append("%s: unknown key(s) %s; a candidate has only %s"
                       % (label, ", ".join(sorted(unknown)), ", ".join(KEYS)))
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            out.append("%s has no name: give each candidate a name (letters, digits, '.', '_', '-'), e.g. "
                       "name: eagle-2step" % label)
        elif not NAME_RE.match(name):
            out.append("%s: name %r must start with a letter or digit and hold only letters, digits, '.', '_' "
                       "and '-', at most 64 characters (it names the profile file)" % (label, name))
        elif name.lower() == BASELINE:
            out.append("%s: the name %s is taken by the canary's own values, which every run measures; give the "
                       "candidate another name" % (label, BASELINE))
        elif name.lower() in seen:
            out.append("%s: the name %s is already candidate %d's" % (label, name, seen[name.lower()] + 1))
        else:
            seen[name.lower()] = index
        env = entry.get("sglang_nccl_env")
        args = entry.get("sglang_launch_args")
        out.extend(_env_problems(label, env, unchecked))
        out.extend(_args_problems(label, args))
        note = entry.get("note")
        if note is not None and not isinstance(note, str):
            out.append("%s: note is %s; give text" % (label, _kind(note)))
        if not env and not args and (env is None or isinstance(env, Mapping)) \
                and (args is None or isinstance(args, Mapping)):
            out.append("%s overrides nothing: give sglang_nccl_env and/or sglang_launch_args values that differ "
                       "from the canary's own (the baseline is measured anyway)" % label)
    return out


def apply_overrides(own, overrides):
    """A new dict: ``own`` (the canary's values; None = none) with ``overrides`` (a candidate's; None = none)
    applied key by key; an override of null removes that key. Neither argument is changed."""
    out = dict(own or {})
    for key, value in (overrides or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def _williams(size):
    """The first row of a Williams design of ``size`` symbols: 0, 1, size-1, 2, size-2, ... Its rotations (row i:
    each entry + i mod size) put every symbol once in every position; the steps between neighbours are +1, -2,
    +3, -4, ... (mod size), all different when ``size`` is even (a balanced Latin square: each symbol directly after
    each other symbol exactly once), each taken at most twice when it is odd."""
    row = [0]
    low, high = 1, size - 1
    while len(row) < size:
        row.append(low)
        low += 1
        if len(row) < size:
            row.append(high)
            high -= 1
    return row


def schedule(names, repeats):
    """The rounds of a tune run: ``[{"round": 1.., "repeat": 1.., "name": name}]``, ``len(names) * repeats`` of
    them; repeat r visits every name once.

    The order of repeat r is row r of a Williams design over ``names`` (a rotation of 0, 1, n-1, 2, n-2, ...):
    within ``len(names)`` repeats every name runs in a different position each time (then the rows start over),
    and its neighbours change too: with an even number of names each name follows each other name once per
    ``len(names)`` repeats; with an odd number a name can keep the same neighbour for two repeats (with three
    names no pair of orders avoids that) but never for three. So the host's slow drift (warming, other load)
    favours no name. Repeat 1 starts with ``names[0]`` (tune.yml puts the baseline there: the canary serves it
    already).
    """
    names = list(names)
    repeats = int(repeats)
    if not names or repeats < 1:
        return []
    size = len(names)
    first = _williams(size)
    rounds = []
    for repeat in range(repeats):
        for symbol in first:
            rounds.append({"round": len(rounds) + 1, "repeat": repeat + 1,
                           "name": names[(repeat + symbol) % size]})
    return rounds
