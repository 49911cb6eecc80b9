"""The launch history's controller side (issue 34): the entry a verified launch appends, and the table
``gpufleet history`` and playbooks/history.yml print.

roles/sglang_launch/tasks/history.yml hands :func:`history_entry` what the run knows (argv, environment, what
sglang_verify read from the workers, the release preflight read, figures); the module
``gpufleet_launch_history`` writes it on the host (and refuses it, should a secret get through). Filters:
plugins/filter/gpufleet_history.py. Tests: tests/unit/plugins/plugin_utils/test_history.py.
"""
from __future__ import annotations

import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_launch_history import REDACTED, SECRET_KEY
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_argv, redact_data

FORMAT = 1
# The figures the table knows, in this order, with how it prints them; any other figure prints as name=value.
FIGURES = (
    ("tokens_per_s", "%.1f tok/s"),            # sglang_verify's throughput smoke (sglang_verify_throughput)
    ("single_stream_tok_s", "%.1f tok/s 1x"),  # tune: bench_serving at max concurrency 1
    ("throughput_tok_s", "%.1f tok/s thru"),   # tune: bench_serving at gpufleet_tune_concurrency
    ("ttft_ms", "TTFT %.0f ms"),
    ("itl_ms", "ITL %.1f ms"),
)
COLUMNS = ("time", "host", "run id", "playbook", "profile/candidate", "release", "NCCL", "figures")
MIB = 1 << 20


def _flag(launch_args, name):
    """A flag's value from ``sglang_launch_args`` (dash-less names as the inventory writes them; ``model_path``
    too), else None."""
    if not isinstance(launch_args, dict):
        return None
    for key in (name, name.replace("-", "_"), "--" + name):
        value = launch_args.get(key)
        if value not in (None, False, ""):
            return value
    return None


def hide_secrets(env):
    """``env`` (name -> value) with every value whose name names a secret (``HF_TOKEN``, ``*_API_KEY``,
    ``*PASSWORD*``) replaced by ``********``; None for None."""
    if env is None:
        return None
    return {name: (REDACTED if SECRET_KEY.search(str(name)) and value not in (None, "") else value)
            for name, value in redact_data(dict(env)).items()}


def worker_nccl_values(workers, expected=None):
    """The NCCL values sglang_verify READ from the GPU workers (``sglang_verify_workers``: the module's
    ``workers`` list, each with ``env``), not the ones gpufleet meant to set: name -> value where every worker
    read agrees, name -> sorted list of the distinct values where they differ. Names only some workers carry are
    listed with the value of those that do. ``expected`` (sglang_nccl_env) only orders the names. {} when no
    worker was read."""
    rows = (workers or {}).get("workers") if isinstance(workers, dict) else workers
    seen = {}
    for worker in rows or []:
        for name, value in ((worker or {}).get("env") or {}).items():
            seen.setdefault(name, set()).add(str(value))
    order = [n for n in (expected or {}) if n in seen] + sorted(n for n in seen if n not in (expected or {}))
    return {name: (next(iter(seen[name])) if len(seen[name]) == 1 else sorted(seen[name])) for name in order}


def history_entry(raw):
    """The entry one verified launch appends (dict), from ``raw`` (what roles/sglang_launch/tasks/history.yml
    knows): ``time`` (UTC ISO), ``run_id``, ``host``, ``candidate`` (tune's candidate name; None for restart.yml),
    ``profile`` (gpufleet_profile; '' = none), ``argv`` (sglang_launch_argv: never the API key; redacted again),
    ``env`` (sglang_launch_env), ``api_key_set``, ``workers`` (sglang_verify_workers), ``expected``
    (sglang_nccl_env, only for the order of names), ``sglang_version``, ``launch_args`` (sglang_launch_args: the
    model paths), ``figures`` (dict of numbers), ``tokens_per_s`` (verify's throughput smoke; None when it did not
    measure). ``playbook`` is ``tune`` when a candidate is named, else ``restart``."""
    raw = raw or {}
    figures = {k: v for k, v in dict(raw.get("figures") or {}).items() if v is not None}
    if raw.get("tokens_per_s") not in (None, ""):
        figures.setdefault("tokens_per_s", float(raw["tokens_per_s"]))
    workers = raw.get("workers") or {}
    candidate = raw.get("candidate") or None
    return {
        "format": FORMAT,
        "time": raw.get("time"),
        "run_id": None if raw.get("run_id") is None else str(raw["run_id"]),
        "host": raw.get("host"),
        "playbook": "tune" if candidate else "restart",
        "profile": raw.get("profile") or None,
        "candidate": candidate,
        "argv": redact_argv([str(a) for a in raw.get("argv") or []]),
        "env": hide_secrets(raw.get("env") or {}),
        "api_key_set": bool(raw.get("api_key_set")),
        "nccl_env": worker_nccl_values(workers, raw.get("expected")),
        "nccl_workers": int((workers.get("worker_count") if isinstance(workers, dict) else 0) or 0),
        "sglang_version": raw.get("sglang_version") or None,
        "model_path": _flag(raw.get("launch_args"), "model-path"),
        "speculative_draft_model_path": _flag(raw.get("launch_args"), "speculative-draft-model-path"),
        "figures": figures,
    }


def _short_value(value):
    if isinstance(value, list):
        return "|".join(_short_value(v) for v in value)
    text = str(value)
    if text.isdigit() and int(text) >= MIB and int(text) % MIB == 0:
        return "%dM" % (int(text) // MIB)
    return text


def nccl_short(nccl_env):
    """``PROTO=LL ALGO=Ring BUFFSIZE=16M`` for {NCCL_PROTO: LL, ...}: the prefix dropped, whole MiB as ``M``,
    workers that disagree as ``a|b``; ``-`` for none."""
    if not nccl_env:
        return "-"
    return " ".join("%s=%s" % (re.sub(r"^NCCL_", "", name), _short_value(value))
                    for name, value in nccl_env.items())


def figures_short(figures):
    """``94.1 tok/s 1x, TTFT 41 ms`` for an entry's figures (:data:`FIGURES` first, others as name=value);
    ``-`` for none."""
    figures = dict(figures or {})
    parts = []
    for name, fmt in FIGURES:
        value = figures.pop(name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(fmt % value)
    parts += ["%s=%s" % (name, value) for name, value in sorted(figures.items()) if value is not None]
    return ", ".join(parts) or "-"


def history_row(entry):
    """One row of the table (list of str, :data:`COLUMNS`)."""
    entry = entry if isinstance(entry, dict) else {}
    who = " / ".join(str(v) for v in (entry.get("profile"), entry.get("candidate")) if v) or "-"
    return [str(entry.get("time") or "-"), str(entry.get("host") or "-"), str(entry.get("run_id") or "-"),
            str(entry.get("playbook") or "-"), who, str(entry.get("sglang_version") or "-"),
            nccl_short(entry.get("nccl_env")), figures_short(entry.get("figures"))]


def history_table(entries):
    """The launch history as a text table (str): a header and one row per entry in the order given (oldest
    first), columns :data:`COLUMNS`; ``no launch recorded`` when there is none."""
    rows = [history_row(e) for e in entries or []]
    if not rows:
        return "no launch recorded"
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def fleet_entries(per_host):
    """All hosts' entries (``{host: [entry, ...]}``, what playbooks/history.yml publishes as ``gpufleet_history``)
    as one list, oldest first (by time, then host), each with its ``host`` set."""
    out = []
    for host, entries in sorted((per_host or {}).items()):
        for entry in entries or []:
            if isinstance(entry, dict):
                out.append(dict(entry, host=entry.get("host") or host))
    return sorted(out, key=lambda e: (str(e.get("time") or ""), str(e.get("host") or "")))
