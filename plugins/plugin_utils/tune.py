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

import math
import re
from collections.abc import Mapping

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl_plan import PatchError, normalise_env
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import SGLANG_SECRET_FLAGS, inventory_flag
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import profile

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
# candidate cannot move the canary's address or put a key into the report, the history and the profile, neither
# with the flag nor with an abbreviation SGLang's parser takes for it (gpufleet_redact.inventory_flag: api-ke, ho).
_RESERVED_FLAGS = {"host": "sglang_host", "port": "sglang_port"}


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


def _abbreviation(flag, full):
    """`` (SGLang reads it as --FULL)`` when ``flag`` abbreviates ``full``, else ``""``."""
    return "" if flag == full else " (SGLang's parser reads it as --%s)" % full


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
        elif inventory_flag(flag) in _RESERVED_FLAGS:
            reserved = inventory_flag(flag)
            out.append("%s: sglang_launch_args must not set %s%s: gpufleet renders --%s from %s, and a candidate "
                       "cannot move the canary's server" % (label, flag, _abbreviation(flag, reserved), reserved,
                                                            _RESERVED_FLAGS[reserved]))
        elif inventory_flag(flag, SGLANG_SECRET_FLAGS):
            out.append("%s: sglang_launch_args must not set %s%s: the key would show in the report, the history "
                       "and the profile; the canary's sglang_api_key is used as it is"
                       % (label, flag, _abbreviation(flag, inventory_flag(flag, SGLANG_SECRET_FLAGS))))
    return out


def _profile_problems(label, env, args):
    """What profile.check_profile would refuse in the candidate's overrides when tune.yml saves it as the winner's
    profile after every restart (a value sglang_argv cannot render: a list inside a list, true inside a list):
    refused here, before the first restart."""
    from ansible_collections.gpufleet.fleet.plugins.plugin_utils.profile import check_profile
    problems = check_profile({"name": "candidate", "sglang_nccl_env": env, "sglang_launch_args": args})
    return ["%s: %s" % (label, problem) for problem in problems]


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
    API key flag, or an abbreviation SGLang's parser would read as one of them (gpufleet_redact.inventory_flag),
    a value the winner's profile could not hold (profile.check_profile: what sglang_argv cannot render); a
    ``note`` that is not text; a candidate that overrides nothing (it would be the baseline again).
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
        found = _env_problems(label, env, unchecked) + _args_problems(label, args)
        if not found:
            found = _profile_problems(label, env, args)
        out.extend(found)
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
    """The rounds of a tune run: ``[{"round": 1.., "repeat": 1.., "repeats": repeats, "name": name}]``,
    ``len(names) * repeats`` of them; repeat r visits every name once.

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
            rounds.append({"round": len(rounds) + 1, "repeat": repeat + 1, "repeats": repeats,
                           "name": names[(repeat + symbol) % size]})
    return rounds


# --- figures -----------------------------------------------------------------------------------------------------

def _figure(value):
    """A measured figure as a float rounded to 2 decimals (what the report and the table show), or None when
    ``value`` is not a finite number."""
    if isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return round(value, 2) if math.isfinite(value) else None


def summarize(values):
    """``{"median", "min", "max", "runs"}`` of the measured ``values`` (numbers; None entries are left out),
    rounded to 2 decimals; the median of an even count is the mean of the middle two. With no values every field
    is None and ``runs`` is []."""
    runs = [figure for figure in (_figure(v) for v in (values or []) if v is not None) if figure is not None]
    if not runs:
        return {"median": None, "min": None, "max": None, "runs": []}
    ordered = sorted(runs)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2.0
    return {"median": round(median, 2), "min": ordered[0], "max": ordered[-1], "runs": runs}


def _spread(summary):
    return round(summary["max"] - summary["min"], 2)


def _bench_problem(what, result):
    """Why a sglang_bench_serving result cannot count, or None."""
    if not isinstance(result, Mapping):
        return "no %s measurement" % what
    if result.get("failed"):
        return "%s benchmark failed: %s" % (what, result.get("msg") or "no message")
    if _figure(result.get("output_tok_s")) is None or _figure(result.get("output_tok_s")) <= 0:
        return "%s benchmark gave no output tok/s" % what
    completed, prompts = result.get("completed"), result.get("num_prompts")
    if isinstance(completed, int) and isinstance(prompts, int) and completed < prompts:
        return "%s benchmark: only %d of %d requests completed" % (what, completed, prompts)
    return None


def round_result(name, repeat, single, throughput, failure):
    """One round's record: ``{"name", "repeat", "ok", "note", "single_stream_tok_s", "throughput_tok_s",
    "ttft_ms", "itl_ms", "concurrency"}`` from the two sglang_bench_serving results of the round (``single``: max
    concurrency 1; ``throughput``: at gpufleet_tune_concurrency) and ``failure`` (why the round's restart or
    measurement failed, None when it did not).

    The figures are ``output_tok_s`` of each run and ``median_ttft_ms`` / ``median_itl_ms`` of the single-stream
    run, rounded to 2 decimals. The round is ok only when nothing failed and both runs completed every request
    with an output rate; otherwise ``note`` says why and the figures that were measured are kept (shown, never
    judged)."""
    problems = []
    if failure:
        problems.append(str(failure))
    else:
        problems.extend(filter(None, (_bench_problem("single-stream", single),
                                      _bench_problem("throughput", throughput))))
    single = single if isinstance(single, Mapping) and not single.get("failed") else {}
    throughput = throughput if isinstance(throughput, Mapping) and not throughput.get("failed") else {}
    record = {
        "name": name,
        "repeat": repeat,
        "ok": not problems,
        "note": "; ".join(problems),
        "single_stream_tok_s": _figure(single.get("output_tok_s")),
        "throughput_tok_s": _figure(throughput.get("output_tok_s")),
        "ttft_ms": _figure(single.get("median_ttft_ms")),
        "itl_ms": _figure(single.get("median_itl_ms")),
        "concurrency": throughput.get("max_concurrency"),
    }
    if record["ok"] and (record["ttft_ms"] is None or record["itl_ms"] is None):
        record["ok"] = False
        record["note"] = "single-stream benchmark gave no TTFT/ITL medians"
    return record


# --- the decision and the report ---------------------------------------------------------------------------------

_UNITS = {"single_stream_tok_s": "tok/s", "throughput_tok_s": "tok/s", "ttft_ms": "ms", "itl_ms": "ms"}
_HEADERS = {"single_stream_tok_s": "single tok/s", "throughput_tok_s": "throughput tok/s", "ttft_ms": "TTFT ms",
            "itl_ms": "ITL ms"}


def _num(value):
    """A figure as the report holds it (2 decimals at most), with at least one decimal: 93.1, 612.0, 10.73."""
    if value is None:
        return "-"
    text = "%.2f" % value
    return text[:-1] if text.endswith("0") else text


def _entry_note(records, repeats, user_note):
    """(ok, note) of one entry from its round records: ok when every repeat of the run measured and none failed."""
    if not records:
        return False, "not measured"
    failed = [r for r in records if not r.get("ok")]
    notes = ["repeat %s failed: %s" % (r.get("repeat"), r.get("note") or "no reason given") for r in failed]
    done = len({r.get("repeat") for r in records})
    if done < repeats:
        notes.append("measured in %d of %d repeats" % (done, repeats))
    ok = not failed and done >= repeats
    if ok and user_note:
        notes.append(str(user_note))
    return ok, "; ".join(notes)


def _decide(entries, metric):
    """(winner name, reason) by the rule of :func:`report`."""
    direction = METRICS[metric]
    unit = _UNITS[metric]
    base = entries[0]
    others = entries[1:]
    unjudged = [e["name"] for e in others if not e["ok"]]
    tail = ("; not judged (a round failed or did not run): %s" % ", ".join(unjudged)) if unjudged else ""
    if not base["ok"] or base[metric]["median"] is None:
        return BASELINE, ("the baseline did not measure in every round (%s): no honest judgement was possible, "
                          "the canary stays on its baseline%s" % (base["note"] or "no figures", tail))
    judged = [e for e in others if e["ok"] and e[metric]["median"] is not None]
    if not judged:
        return BASELINE, "no candidate measured in every round: the baseline stays" + tail
    sign = 1 if direction == "higher" else -1
    best = judged[0]
    for entry in judged[1:]:
        if sign * entry[metric]["median"] > sign * best[metric]["median"]:
            best = entry
    gain = round(sign * (best[metric]["median"] - base[metric]["median"]), 2)
    spread = max(_spread(best[metric]), _spread(base[metric]))
    spread_of = "the baseline's" if _spread(base[metric]) >= _spread(best[metric]) else "%s's" % best["name"]
    if direction == "higher":
        gain_text = "%s%s %s" % ("-" if gain < 0 else "+", _num(abs(gain)), unit)
    else:
        gain_text = "%s %s %s" % (_num(abs(gain)), unit, "worse" if gain < 0 else "better")
    figures = "%s %s %s vs baseline %s (%s medians%s)" % (
        best["name"], _num(best[metric]["median"]), unit, _num(base[metric]["median"]), metric,
        ", lower is better" if direction == "lower" else "")
    if gain > spread:
        return best["name"], "%s: %s > spread %s (%s max - min)%s" % (
            figures, gain_text, _num(spread), spread_of, tail)
    return BASELINE, "best %s: %s is not more than the spread %s (%s max - min): the baseline stays%s" % (
        figures, gain_text, _num(spread), spread_of, tail)


def report(rounds, candidates, baseline_values, metric):
    """The tune run's report: ``{"baseline": "baseline", "winner": name, "metric": metric, "reason": str,
    "candidates": [entry, ...]}``, the baseline's entry first, then the candidates in their given order.

    ``rounds``: the :func:`round_result` records of the run; ``candidates``: ``gpufleet_tune_candidates``;
    ``baseline_values``: ``{"sglang_nccl_env", "sglang_launch_args"}``, the canary's own; ``metric``: a key of
    :data:`METRICS`. An entry: ``{"name", "sglang_nccl_env", "sglang_launch_args"`` (a candidate's overrides, nulls
    kept: they remove a value; the baseline's: the canary's own values), one :func:`summarize` per metric over the
    rounds that measured, ``"ok"`` (every repeat of the run measured, none failed), ``"note"`` (why not ok, else the
    candidate's own note)``}``.

    The decision: best = the ok candidate (baseline excluded) with the best median of ``metric`` (higher is better
    for *_tok_s, lower for *_ms; a tie goes to the first in the list); the winner is best only when its gain over
    the baseline's median is MORE than the larger of the two spreads (max - min over the runs), else the baseline.
    When the baseline itself did not measure in every round the winner is the baseline: there is nothing honest
    to compare with. ``reason`` says in words and figures why.
    """
    if metric not in METRICS:
        raise ValueError("gpufleet_tune_metric must be one of %s, got %r" % (", ".join(METRICS), metric))
    rounds = [r for r in (rounds or []) if isinstance(r, Mapping)]
    repeats = max([r.get("repeat") for r in rounds if isinstance(r.get("repeat"), int)] or [0])
    baseline_values = baseline_values or {}
    sources = [(BASELINE, baseline_values.get("sglang_nccl_env"), baseline_values.get("sglang_launch_args"), None)]
    sources.extend((c.get("name"), c.get("sglang_nccl_env"), c.get("sglang_launch_args"), c.get("note"))
                   for c in (candidates or []))
    entries = []
    for name, env, args, user_note in sources:
        records = [r for r in rounds if r.get("name") == name]
        ok, note = _entry_note(records, repeats, user_note)
        entry = {"name": name, "sglang_nccl_env": dict(env or {}), "sglang_launch_args": dict(args or {})}
        for key in METRICS:
            entry[key] = summarize([r.get(key) for r in records if r.get("ok")] or
                                   [r.get(key) for r in records])
        entry["ok"] = ok
        entry["note"] = note
        entries.append(entry)
    winner, reason = _decide(entries, metric)
    return {"baseline": BASELINE, "winner": winner, "metric": metric, "reason": reason, "candidates": entries}


def _cell(summary):
    if not summary or summary.get("median") is None:
        return "-"
    if summary["min"] == summary["max"]:
        return _num(summary["median"])
    return "%s (%s-%s)" % (_num(summary["median"]), _num(summary["min"]), _num(summary["max"]))


def table(result):
    """The end-of-run table of :func:`report`'s ``result``: a head line (metric, winner, reason), then one row per
    entry in the report's order: the role (``winner``, ``baseline``, ``winner, baseline`` when the baseline
    stays), the name, each metric as ``median (min-max)`` (the report's numbers), ok, and the note."""
    winner = result.get("winner")
    head = "tune: the winner on %s is %s\nwhy: %s" % (result.get("metric"), winner, result.get("reason", ""))
    head += serving_line(result)
    columns = ["", "candidate"] + [_HEADERS[m] for m in METRICS] + ["ok", "note"]
    rows = []
    for entry in result.get("candidates") or []:
        name = entry.get("name")
        role = ", ".join(word for word, mine in (("winner", name == winner),
                                                 ("baseline", name == result.get("baseline"))) if mine)
        rows.append([role, str(name)] + [_cell(entry.get(m)) for m in METRICS]
                    + ["yes" if entry.get("ok") else "NO", entry.get("note") or ""])
    widths = [max(len(row[i]) for row in [columns] + rows) for i in range(len(columns))]
    lines = head.split("\n")
    for row in [columns] + rows:
        cells = [row[i].rjust(widths[i]) if 2 <= i < 2 + len(METRICS) else row[i].ljust(widths[i])
                 for i in range(len(columns))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def progress_line(round, total, result):  # pylint: disable=redefined-builtin
    """One line per measured round, e.g. ``round 4/15 cand-a (repeat 2/3): 93.4 tok/s single stream, 612.0 tok/s
    at 8, TTFT 41 ms, ITL 10.7 ms``; a failed round says ``FAILED: <note>``. ``round``: a :func:`schedule` entry
    (its ``repeats``, when there, gives the /3), ``total``: the number of rounds, ``result``: the
    :func:`round_result` record."""
    repeats = round.get("repeats")
    where = "round %s/%s %s (repeat %s%s)" % (
        round.get("round"), total, round.get("name"), round.get("repeat"), "/%s" % repeats if repeats else "")
    result = result or {}
    if not result.get("ok"):
        return "%s: FAILED: %s" % (where, result.get("note") or "no measurement")

    def fmt(key, pattern):
        value = result.get(key)
        return pattern % value if value is not None else "-"

    at = " at %s" % result["concurrency"] if result.get("concurrency") is not None else ""
    return "%s: %s tok/s single stream, %s tok/s%s, TTFT %s ms, ITL %s ms" % (
        where, fmt("single_stream_tok_s", "%.1f"), fmt("throughput_tok_s", "%.1f"), at, fmt("ttft_ms", "%.0f"),
        fmt("itl_ms", "%.1f"))


# The run's settings, checked before the canary is touched, and what the canary serves after each restart.
COUNTS = ("gpufleet_tune_repeats", "gpufleet_tune_concurrency", "gpufleet_tune_num_prompts",
          "gpufleet_tune_input_len", "gpufleet_tune_output_len")
_DIGITS = re.compile(r"^\s*[0-9]+\s*\Z")


def check_settings(settings, canary):
    """Problems (a list of strings, empty when fine) of the run's settings ``settings`` (a mapping of the
    ``gpufleet_tune_*`` variables given; an absent or null one is left to the role's default): each of
    :data:`COUNTS` an integer >= 1 (an int, or digits as ``-e key=value`` gives them), ``gpufleet_tune_metric`` a key
    of :data:`METRICS`, ``gpufleet_tune_profile`` a profile name (plugins/plugin_utils/profile.py's NAME); when it
    is not given, the role's default ``tune-<canary>`` is checked, ``canary`` being the canary's inventory name."""
    settings = settings if isinstance(settings, Mapping) else {}
    problems = []
    for key in COUNTS:
        value = settings.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and _DIGITS.match(value))) \
                or int(value) < 1:
            problems.append("%s must be an integer of 1 or more, got %r" % (key, value))
    metric = settings.get("gpufleet_tune_metric")
    if metric is not None and metric not in METRICS:
        problems.append("gpufleet_tune_metric must be one of %s, got %r" % (", ".join(METRICS), metric))
    name = settings.get("gpufleet_tune_profile")
    default = name is None
    if default:
        name = "tune-%s" % canary
    # The profile module's own check (profile.NAME, anchored with \Z: a trailing newline is refused too).
    if profile.check_name(name) is not None:
        problems.append("gpufleet_tune_profile %r%s is not a profile name (%s): it names the winner's profile file%s"
                        % (name, " (the default, tune-<canary>)" if default else "", profile.NAME.pattern,
                           "; name one with -e gpufleet_tune_profile=NAME" if default else ""))
    return problems


def serving_after(previous, name, verified, rollback):
    """The entry name the canary serves after one restart of the run to entry ``name``, or None when unknown.

    ``verified``: the restart verified (the canary serves ``name``). After a failed restart, ``previous`` (what the
    canary served before it: this run's last verified launch, or None when unknown) when restart_host.yml's rollback
    relaunched the last verified launch or had nothing to undo (``rollback``: its ``_gpufleet_rollback``, state
    ``rolled_back`` or ``not_needed``; None: the restart failed before restart_host.yml, in its preflight, which
    changes nothing); after any other rollback state (failed, file_only) None: no server is known to serve."""
    if verified:
        return name
    if rollback is None:
        return previous
    state = rollback.get("state") if isinstance(rollback, Mapping) else None
    return previous if state in ("rolled_back", "not_needed") else None


def serving_line(result):
    """The table's line on what the canary serves at the end, when the report's ``serving`` is not its winner
    (empty when it is, or when the report has no ``serving``)."""
    if not isinstance(result, Mapping) or "serving" not in result or result.get("serving") == result.get("winner"):
        return ""
    serving = result.get("serving")
    if serving is None:
        return "\nnow: NOT the winner: no server of this run is known to serve on the canary (see the restart row above)"
    return "\nnow: NOT the winner: the canary serves %s" % serving


def end_failure(host, winner, serving):
    """The message that fails a tune run whose restart to the winner ``winner`` failed at its end, saying what the
    canary ``host`` serves: ``serving`` as :func:`serving_after` gave it after the end's restarts (the baseline
    after a restart with it worked; the run's last verified launch put back by a rollback; None: unknown)."""
    text = "The restart of %s to the winner %s failed (see the restart's messages above)" % (host, winner)
    if winner != BASELINE:
        text += "; the restart with its baseline %s" % ("worked" if serving == BASELINE else "failed too")
    if serving == BASELINE:
        text += ": the canary serves its baseline (its own values)"
    elif serving is not None:
        text += ": the canary serves %s (this run's last verified launch, put back by the rollback)" % serving
    else:
        text += ": no server of this run is known to serve on the canary (see the rollback above)"
    return text + ". The report (serving: %s) and the table say so; no profile was saved." % (
        "null" if serving is None else serving)
