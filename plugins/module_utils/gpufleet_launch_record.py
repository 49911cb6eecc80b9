# -*- coding: utf-8 -*-
# gpufleet: the launch record (launch.json) read back as untrusted input (issue 31).
"""Check a launch record (``sglang_launch_record_file``, written by roles/sglang_launch/tasks/record.yml) before
the rollback relaunches from it.

The rollback writes the record's ``unit_text`` as root and starts it, or starts its ``argv``: a record another
hand wrote (or one an earlier release wrote from an injected inventory value, issue 31) would run as root. So
:func:`check_record` accepts only what gpufleet itself writes:

* the JSON text at most :data:`MAX_RECORD_BYTES`, an object;
* every key the rollback reads with its type and bounds: ``method`` systemd|process, ``port`` 1-65535, ``host``,
  ``argv`` (list of strings), ``env``/``nccl_env`` (names ``[A-Za-z_][A-Za-z0-9_]*``, string or integer values),
  ``log_file``/``pid_file``/``chdir`` absolute normalised paths, ``unit_name`` a plain ``*.service`` name
  (``gpufleet_unit_values.UNIT_NAME``); no control characters anywhere (``gpufleet_unit_values.is_control``);
* ``unit_text`` (systemd) only with the directives roles/sglang_launch/templates/sglang.service.j2 writes, each in
  its section, one ``ExecStart=`` without a prefix (``+``/``!`` run it with privileges, ``-``/``@``/``:``/``|`` change
  how it runs), ``User=`` a user name other than root (without ``User=`` systemd runs the server as root);
* the unit goes to ``<unit_dir>/<unit_name>``: the record's own ``unit_path`` is never used.

Records of every earlier release (format 1, units without ``UMask=``) pass. Nothing here needs Ansible.
"""
from __future__ import annotations

import json
import os
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_unit_values

MAX_RECORD_BYTES = 1 << 20
MAX_UNIT_TEXT = 64 << 10
MAX_ARGV = 1024
MAX_ENV = 256
MAX_VALUE = 8192
MAX_PATH = 4096

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The names and control characters of the values gpufleet renders (one rule: gpufleet_unit_values).
UNIT_NAME = gpufleet_unit_values.UNIT_NAME
USER_NAME = gpufleet_unit_values.USER_NAME


def _has_control(text, allowed=""):
    return any(gpufleet_unit_values.is_control(char) and char not in allowed for char in text)


# Directives the unit template (roles/sglang_launch/templates/sglang.service.j2) writes, per section, in every
# release (UMask= from issue 31 on).
UNIT_DIRECTIVES = {
    "Unit": frozenset(["Description", "After", "Wants", "StartLimitIntervalSec", "StartLimitBurst"]),
    "Service": frozenset(["Type", "User", "WorkingDirectory", "Environment", "EnvironmentFile", "ExecStart",
                          "KillMode", "KillSignal", "TimeoutStopSec", "SuccessExitStatus", "Restart", "RestartSec",
                          "StandardOutput", "StandardError", "LimitNOFILE", "LimitMEMLOCK", "UMask"]),
    "Install": frozenset(["WantedBy"]),
}
# systemd.service(5), "Table 1. Special executable prefixes".
EXEC_PREFIXES = "@-:+!|"
OUTPUT_WORDS = frozenset(["inherit", "journal", "null", "kmsg", "journal+console", "kmsg+console"])


class RecordError(ValueError):
    """The record is refused; the message says which key and why."""


def _text(value, key, limit=MAX_VALUE, allow_empty=True):
    if not isinstance(value, str):
        raise RecordError("%s is %s, not a string" % (key, type(value).__name__))
    if len(value) > limit:
        raise RecordError("%s is longer than %d characters" % (key, limit))
    if _has_control(value):
        raise RecordError("%s holds a control character" % key)
    if not allow_empty and not value:
        raise RecordError("%s is empty" % key)
    return value


def _int(value, key, low, high):
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError("%s is %s, not an integer" % (key, type(value).__name__))
    if not low <= value <= high:
        raise RecordError("%s is %d, outside %d-%d" % (key, value, low, high))
    return value


def _path(value, key):
    _text(value, key, MAX_PATH, allow_empty=False)
    if not value.startswith("/") or os.path.normpath(value) != value or value.startswith("//"):
        raise RecordError("%s %r is not an absolute normalised path" % (key, value))
    return value


def _env(value, key):
    if not isinstance(value, dict):
        raise RecordError("%s is %s, not an object" % (key, type(value).__name__))
    if len(value) > MAX_ENV:
        raise RecordError("%s has more than %d variables" % (key, MAX_ENV))
    for name, item in value.items():
        if not ENV_NAME.match(name):
            raise RecordError("%s has a variable name %r that is not [A-Za-z_][A-Za-z0-9_]*" % (key, name[:80]))
        if isinstance(item, int) and not isinstance(item, bool):
            continue
        _text(item, "%s[%s]" % (key, name))
    return value


def _argv(value, key):
    if not isinstance(value, list) or not value:
        raise RecordError("%s is not a non-empty list" % key)
    if len(value) > MAX_ARGV:
        raise RecordError("%s has more than %d elements" % (key, MAX_ARGV))
    for index, item in enumerate(value):
        _text(item, "%s[%d]" % (key, index))
    return value


def check_unit_text(text, key="unit_text"):
    """Refuse a unit text gpufleet's own template never writes (see the module docstring). Returns ``text``."""
    if not isinstance(text, str) or not text.strip():
        raise RecordError("%s is missing or not a string" % key)
    if len(text) > MAX_UNIT_TEXT:
        raise RecordError("%s is longer than %d characters" % (key, MAX_UNIT_TEXT))
    if _has_control(text, "\n\t"):  # a unit's text keeps its newlines (and tabs)
        raise RecordError("%s holds a control character" % key)
    section, seen_sections, counts = None, set(), {}
    for number, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            raise RecordError("%s line %d continues on the next line (a trailing backslash)" % (key, number))
        if line.startswith("["):
            name = line[1:-1] if line.endswith("]") else None
            if name not in UNIT_DIRECTIVES or name in seen_sections:
                raise RecordError("%s line %d: section %s is not one gpufleet writes" % (key, number, line[:80]))
            section = name
            seen_sections.add(name)
            continue
        directive, sep, value = line.partition("=")
        directive, value = directive.strip(), value.strip()
        if not sep or section is None or directive not in UNIT_DIRECTIVES[section]:
            raise RecordError("%s line %d: %s is not a directive gpufleet writes%s"
                              % (key, number, (directive or line)[:80], (" in [%s]" % section) if section else ""))
        counts[directive] = counts.get(directive, 0) + 1
        _unit_value(directive, value, key, number)
    if "Service" not in seen_sections:
        raise RecordError("%s has no [Service] section" % key)
    for directive in ("ExecStart", "User"):
        if counts.get(directive, 0) != 1:
            raise RecordError("%s has %d %s= lines, not one" % (key, counts.get(directive, 0), directive))
    return text


def _unit_value(directive, value, key, number):
    where = "%s line %d: %s=" % (key, number, directive)
    if directive == "ExecStart":
        if not value or value[0] in EXEC_PREFIXES:
            raise RecordError("%s%s starts with %r (systemd reads it as a prefix that changes how or as whom the "
                              "command runs); gpufleet never writes one" % (where, value[:40], value[:1]))
    elif directive == "User":
        if not USER_NAME.match(value) or value == "root":
            raise RecordError("%s%s: the server must run as a named user other than root" % (where, value[:40]))
    elif directive in ("StandardOutput", "StandardError"):
        kind, sep, path = value.partition(":")
        if not (value in OUTPUT_WORDS or (sep and kind in ("append", "file", "truncate") and path.startswith("/"))):
            raise RecordError("%s%s is not a log file or stream gpufleet writes" % (where, value[:80]))
    elif directive == "EnvironmentFile":
        if not value.startswith("/"):
            raise RecordError("%s%s is not an absolute path" % (where, value[:80]))


def check_record(data, unit_dir):
    """Parse and check launch record ``data`` (bytes or str, the file's content) for a rollback.

    ``unit_dir``: where units go (``sglang_launch_unit_dir``). Returns the record (dict) with the keys the rollback
    reads, ``unit_path`` set to ``<unit_dir>/<unit_name>`` (systemd) whatever the record said. Raises
    :class:`RecordError` naming the first key at fault.
    """
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError("the file is larger than %d bytes" % MAX_RECORD_BYTES)
    try:
        record = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError("not valid JSON (%s)" % str(exc)[:200])
    if not isinstance(record, dict):
        raise RecordError("not a JSON object")
    method = record.get("method")
    if method not in ("systemd", "process"):
        raise RecordError("method is %r, not systemd or process" % (str(method)[:40],))
    out = {"method": method}
    if "format" in record:
        out["format"] = _int(record["format"], "format", 1, 1000)
    out["port"] = _int(record.get("port"), "port", 1, 65535)
    out["host"] = _text(record.get("host"), "host", 255)
    if re.search(r"\s", out["host"]):
        raise RecordError("host holds whitespace")
    out["log_file"] = _path(record.get("log_file"), "log_file")
    for key in ("chdir", "pid_file"):
        if method == "process" or record.get(key) is not None:
            out[key] = _path(record.get(key), key)
    if method == "process" or record.get("argv") is not None:
        out["argv"] = _argv(record.get("argv"), "argv")
    out["env"] = _env(record.get("env", {}), "env")
    if "nccl_env" in record:  # records before the NCCL check have none (gpufleet_rollback_serves says so)
        out["nccl_env"] = None if record["nccl_env"] is None else _env(record["nccl_env"], "nccl_env")
    api_key_set = record.get("api_key_set", False)
    if not isinstance(api_key_set, bool):
        raise RecordError("api_key_set is %s, not true or false" % type(api_key_set).__name__)
    out["api_key_set"] = api_key_set
    if record.get("pid") is not None:
        out["pid"] = _int(record["pid"], "pid", 0, 1 << 31)
    if record.get("recorded_at") is not None:
        out["recorded_at"] = _text(record["recorded_at"], "recorded_at", 64)
    if method == "systemd":
        name = _text(record.get("unit_name"), "unit_name", 255, allow_empty=False)
        if len(name) > 255 or not UNIT_NAME.match(name):
            raise RecordError("unit_name %r is not a plain name ending in .service" % name[:80])
        out["unit_name"] = name
        out["unit_path"] = os.path.join(unit_dir, name)
        out["unit_text"] = check_unit_text(record.get("unit_text"))
    return out
