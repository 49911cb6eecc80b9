"""Named launch profiles (issue 34): a tune winner kept as a YAML file on the controller, launched on any host with
``restart.yml -e gpufleet_profile=NAME``.

A profile is ``<gpufleet_profile_dir>/<name>.yml``::

    name: tune-gpu-01
    sglang_nccl_env: {NCCL_PROTO: LL, NCCL_ALGO: Ring}     # overrides of the host's own values; null removes one
    sglang_launch_args: {speculative-num-steps: 2}
    source: {canary: gpu-01, run_id: ..., metric: single_stream_tok_s, medians: {...}, sglang_version: ..., time: ...}
    note: "..."                                              # optional

Its overrides are applied to each targeted host's OWN inventory values key by key (:func:`apply_profile`, the same
rule as a tune candidate: tune.apply_overrides), so a profile found on one canary carries only what was tuned, not
that canary's model path or port. Filters: plugins/filter/gpufleet_profile.py. Tests:
tests/unit/plugins/plugin_utils/test_profile.py.
"""
from __future__ import annotations

import math
import os
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import inventory_flag

# \Z, not $: "$" also matches before a trailing newline ("tune-x\n" would become a file name with a newline).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
FLAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*\Z")
KEYS = ("name", "sglang_nccl_env", "sglang_launch_args", "source", "note")
OVERRIDES = ("sglang_nccl_env", "sglang_launch_args")
# Launch flags a profile may not carry, nor any abbreviation SGLang's parser reads as one of them
# (gpufleet_redact.inventory_flag): the host's own identity and secrets stay in the inventory.
FOREIGN_FLAGS = ("host", "port", "api-key", "admin-api-key")
MAX_BYTES = 64 << 10


def _scalar(value):
    return value is None or (isinstance(value, (str, int, float, bool)))


def _json(value, depth=0):
    """True when ``value`` is plain JSON data (str keys; what the launch role's sglang_argv filter renders as compact
    JSON for a mapping-valued flag such as json-model-override-args), at most 32 levels deep."""
    if depth > 32:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_json(v, depth + 1) for v in value)
    return _scalar(value) and not (isinstance(value, float) and not math.isfinite(value))


def _launch_value(value):
    """A value sglang_argv (plugins/filter/gpufleet.py) renders: a scalar (true: the bare flag; false/null: omitted),
    a mapping (compact JSON: ``{json-model-override-args: {rope_scaling: {factor: 2}}}``), or a list of scalars
    (no boolean: sglang_argv refuses one inside a list) and mappings (``--flag v1 v2``)."""
    if _scalar(value) or (isinstance(value, dict) and _json(value)):
        return True
    return isinstance(value, list) and all(
        (_scalar(v) and not isinstance(v, bool)) or (isinstance(v, dict) and _json(v)) for v in value)


def check_name(name):
    """None when ``name`` is a profile name (:data:`NAME`: letters, digits, ``_ . -``, up to 64, starting with a
    letter or digit; it becomes ``<name>.yml``), else the message saying why not (filter
    ``gpufleet_profile_check_name``: tune.yml's first play checks gpufleet_tune_profile with it)."""
    if isinstance(name, str) and NAME.match(name):
        return None
    return ("profile name %r is not a profile name (letters, digits, _ . -, up to 64, starting with a letter or "
            "digit; it becomes the file name <name>.yml)" % (name,))


def check_profile(data):
    """Problems of a profile's content (list of str in the user's words; empty = fine): a mapping with a valid
    ``name`` and only :data:`KEYS`; ``sglang_nccl_env`` a mapping of variable names to a string, an integer or null;
    ``sglang_launch_args`` a mapping of SGLang flag names without dashes to what the launch role's sglang_argv
    renders (:func:`_launch_value`: a scalar, a JSON mapping, a list of scalars and mappings) or null, never
    host, port or an API key, nor an abbreviation of one (``api-ke``, ``ho``); ``source`` a mapping; ``note`` a
    string."""
    if not isinstance(data, dict):
        return ["the profile must be a mapping (name, sglang_nccl_env, sglang_launch_args), not %s"
                % type(data).__name__]
    problems = []
    unknown = sorted(str(k) for k in data if k not in KEYS)
    if unknown:
        problems.append("unknown key(s) %s (a profile holds %s)" % (", ".join(unknown), ", ".join(KEYS)))
    name = data.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        problems.append("name %r is not a profile name (letters, digits, _ . -, up to 64, starting with a letter "
                        "or digit)" % (name,))
    env = data.get("sglang_nccl_env")
    if env is not None and not isinstance(env, dict):
        problems.append("sglang_nccl_env must be a mapping of variable names to values")
    for key, value in (env or {}).items() if isinstance(env, dict) else ():
        if not isinstance(key, str) or not ENV_NAME.match(key):
            problems.append("sglang_nccl_env: %r is not an environment variable name" % (key,))
        elif isinstance(value, bool) or not (value is None or isinstance(value, (str, int))):
            problems.append("sglang_nccl_env.%s must be a string, an integer or null (null removes it)" % key)
    args = data.get("sglang_launch_args")
    if args is not None and not isinstance(args, dict):
        problems.append("sglang_launch_args must be a mapping of SGLang flags (without dashes) to values")
    for key, value in (args or {}).items() if isinstance(args, dict) else ():
        if not isinstance(key, str) or not FLAG_NAME.match(key):
            problems.append("sglang_launch_args: %r is not an SGLang flag name without dashes" % (key,))
        elif inventory_flag(key, FOREIGN_FLAGS):
            full = inventory_flag(key, FOREIGN_FLAGS)
            problems.append("sglang_launch_args.%s%s belongs to the host's inventory, not to a profile"
                            % (key, "" if key.replace("_", "-") == full else " (--%s abbreviated)" % full))
        elif not _launch_value(value):
            problems.append("sglang_launch_args.%s must be a value, a mapping (rendered as JSON), a list of values "
                            "or mappings (no true/false inside), or null" % key)
    if data.get("source") is not None and not isinstance(data.get("source"), dict):
        problems.append("source must be a mapping")
    if data.get("note") is not None and not isinstance(data.get("note"), str):
        problems.append("note must be a string")
    return problems


def profile_path(directory, name):
    """``<directory>/<name>.yml``."""
    return os.path.join(str(directory), "%s.yml" % name)


def read_profile(name, directory):
    """Load profile ``name`` from ``directory`` on the controller: ``{"ok": bool, "path", "msg", "profile"}``.
    ``msg`` names the file and says what is wrong and what to do: a bad name, a missing file (with the profiles
    that exist), YAML that does not parse, content :func:`check_profile` refuses, a ``name`` inside that is not the
    file's. ``profile`` is the loaded mapping (None unless ok)."""
    import yaml
    name = "" if name is None else str(name).strip()
    if not NAME.match(name):
        return {"ok": False, "path": None, "profile": None,
                "msg": "gpufleet_profile=%r is not a profile name (letters, digits, _ . -, up to 64); nothing was "
                       "changed on any host" % name}
    path = profile_path(directory, name)
    if not os.path.isfile(path):
        have = sorted(f[:-4] for f in os.listdir(directory) if f.endswith(".yml")) if os.path.isdir(directory) else []
        return {"ok": False, "path": path, "profile": None,
                "msg": "profile %s: no such file (gpufleet_profile_dir=%s holds %s); nothing was changed on any host"
                       % (path, directory, ", ".join(have) or "no profile")}
    try:
        if os.path.getsize(path) > MAX_BYTES:
            raise ValueError("larger than %d bytes" % MAX_BYTES)
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()
        return {"ok": False, "path": path, "profile": None,
                "msg": "profile %s cannot be read: %s; nothing was changed on any host"
                       % (path, " ".join(first)[:300])}
    problems = check_profile(data)
    if not problems and data.get("name") != name:
        problems.append("its name is %r, not %r (the file name)" % (data.get("name"), name))
    if problems:
        return {"ok": False, "path": path, "profile": None,
                "msg": "profile %s is malformed: %s; nothing was changed on any host" % (path, "; ".join(problems))}
    return {"ok": True, "path": path, "msg": "profile %s" % path, "profile": data}


def apply_profile(own_nccl_env, own_launch_args, profile):
    """``{"sglang_nccl_env", "sglang_launch_args"}``: a host's own values with the profile's overrides applied key
    by key (tune.apply_overrides: null removes a key). A profile of None or {} leaves them as they are."""
    from ansible_collections.gpufleet.fleet.plugins.plugin_utils.tune import apply_overrides
    profile = profile or {}
    return {"sglang_nccl_env": apply_overrides(own_nccl_env, profile.get("sglang_nccl_env")),
            "sglang_launch_args": apply_overrides(own_launch_args, profile.get("sglang_launch_args"))}


def profile_data(name, candidate_entry, source):
    """The profile mapping for ``name`` from a tune report's candidate entry (its overrides) and ``source``."""
    entry = candidate_entry or {}
    data = {"name": name,
            "sglang_nccl_env": dict(entry.get("sglang_nccl_env") or {}),
            "sglang_launch_args": dict(entry.get("sglang_launch_args") or {}),
            "source": dict(source or {})}
    if entry.get("name") and entry.get("name") != name:
        data["source"].setdefault("candidate", entry.get("name"))
    if entry.get("note"):
        data["note"] = str(entry["note"])
    return data


def render_profile(name, candidate_entry, source):
    """The profile file's text (YAML, str): ``name``, the candidate's overrides (``sglang_nccl_env``,
    ``sglang_launch_args``) and ``source`` (canary, run id, metric medians, SGLang release, time), after a comment
    saying how to use it. Raises ValueError when the result would not pass :func:`check_profile`."""
    import json
    import yaml
    # plain types: a playbook's values are Ansible's tagged str/dict subclasses, which yaml.safe_dump refuses
    data = json.loads(json.dumps(profile_data(name, candidate_entry, source)))
    problems = check_profile(data)
    if problems:
        raise ValueError("profile %s: %s" % (name, "; ".join(problems)))
    head = ("# gpufleet launch profile %s, saved by tune.yml. Launch it on any host with\n"
            "#   ansible-playbook playbooks/restart.yml -e target=HOSTS -e gpufleet_profile=%s\n"
            "# Its values override each host's own inventory values key by key (null removes one).\n" % (name, name))
    return head + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def save_plan(text, path, overwrite=False):
    """Whether profile_save.yml may write ``text`` (a rendered profile) to ``path``:
    ``{"write": bool, "msg"}``. A new file, or an existing one holding the same overrides (only its source
    changes), is written; a different profile there is refused unless ``overwrite`` (gpufleet_profile_overwrite)."""
    import yaml
    if not os.path.exists(path):
        return {"write": True, "msg": "profile %s written" % path}
    new = yaml.safe_load(text) or {}
    try:
        with open(path, encoding="utf-8") as handle:
            old = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError):
        old = None
    same = isinstance(old, dict) and all((old.get(k) or {}) == (new.get(k) or {}) for k in OVERRIDES) \
        and old.get("name") == new.get("name")
    if same:
        return {"write": True, "msg": "profile %s updated (same values, newer source)" % path}
    if overwrite:
        return {"write": True, "msg": "profile %s overwritten (gpufleet_profile_overwrite)" % path}
    return {"write": False,
            "msg": "profile %s exists with other values: not overwritten (pass -e gpufleet_profile_overwrite=true, "
                   "or -e gpufleet_tune_profile=<another name>)" % path}
