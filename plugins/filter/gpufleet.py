"""gpufleet Jinja2 filters: SGLang argv rendering, systemd quoting, the restart summary table.

Presentation only: nothing here touches a host. Every filter is a plain function, unit-tested in
tests/unit/test_filter_gpufleet.py.

- ``sglang_argv(launch_args, launcher, host, port)`` → list of str: the argv that starts SGLang.
- ``systemd_quote(word)`` → str: one argv element quoted for a systemd ``ExecStart=`` line.
- ``systemd_env_assignment(value, name)`` → str: one ``Environment=`` value (``"NAME=value"``), escaped.
- ``systemd_value(value, name, rule=None)`` → str: a one-value setting (Description=, User=) as systemd reads it back.
- ``systemd_path(value, name)`` → str: a path setting (WorkingDirectory=, EnvironmentFile=, StandardOutput=append:).
- ``gpufleet_lock_owner(run_id)`` → dict: who takes a host lock (run id, controller host, pid, user).
- ``gpufleet_summary_table(rows)`` → str: the fixed-width restart summary.
"""
from __future__ import annotations

import datetime
import getpass
import json
import os
import re
import socket

from ansible.errors import AnsibleFilterError
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import inventory_flag
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_unit_values import command_problem, systemd_setting
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.lock import gpufleet_lock_holder_gone  # noqa: F401 (re-exported) pylint: disable=unused-import
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.run import gpufleet_summary_table  # noqa: F401 (re-exported) pylint: disable=unused-import

# SGLang flag names are argparse long options: letters, digits, dashes (e.g. "tp-size",
# "speculative-draft-model-path"); underscores are accepted for users who copy Python attribute names.
_FLAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
# Flags that gpufleet renders itself from sglang_host / sglang_port.
_RESERVED_FLAGS = ("host", "port")
# Characters that need no quoting in a systemd command line (after % and $ doubling).
_SYSTEMD_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./$-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OTHER_CONTROLS = re.compile(r"[\x01-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _scalar_text(flag, value):
    if isinstance(value, bool):  # bool is handled by the caller; never render "True"
        raise AnsibleFilterError("sglang_launch_args[%r]: a boolean inside a list is ambiguous" % flag)
    if isinstance(value, (dict,)):
        # SGLang takes JSON for dict-shaped flags (e.g. --json-model-override-args).
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if isinstance(value, float) and value.is_integer():
        return repr(value)
    return str(value)


def sglang_argv(launch_args, launcher, host="127.0.0.1", port=30000):
    """Render the SGLang argv as a list of strings (never a shell string).

    ``launch_args``: mapping of SGLang flag names without leading dashes → value. ``true`` renders the bare
    flag, ``false``/``None`` omits it, a list renders ``--flag v1 v2 …`` (SGLang's list flags are argparse
    ``nargs``), a mapping renders as compact JSON, anything else as ``str(value)``.
    ``launcher``: argv prefix (list of str), e.g. ``[python, -m, sglang.launch_server]``.
    ``host``/``port`` are appended as ``--host``/``--port``.

    Raises AnsibleFilterError for a launcher that is not a non-empty list or whose first word is neither an
    absolute, normalised path nor a command name (module_utils gpufleet_unit_values), a flag name that is not an
    option name, or ``host``/``port`` inside launch_args (use sglang_host / sglang_port).
    """
    if isinstance(launcher, str) or not isinstance(launcher, (list, tuple)) or not launcher:
        raise AnsibleFilterError("sglang_launcher must be a non-empty list of strings (argv prefix), got %r"
                                 % (launcher,))
    argv = [str(part) for part in launcher]
    # ExecStart= reads a leading + - @ : ! of its first word as a prefix (+ runs it as root), before any quote.
    problem = command_problem("sglang_launcher[0]", argv[0])
    if problem:
        raise AnsibleFilterError(problem)
    if launch_args is None:
        launch_args = {}
    if not isinstance(launch_args, dict):
        raise AnsibleFilterError("sglang_launch_args must be a mapping of flag name → value, got %s"
                                 % type(launch_args).__name__)
    for raw_name, value in launch_args.items():
        name = str(raw_name)
        if name.startswith("-"):
            raise AnsibleFilterError("sglang_launch_args key %r: write flag names without leading dashes "
                                     "(e.g. 'tp-size')" % name)
        if not _FLAG_NAME.match(name):
            raise AnsibleFilterError("sglang_launch_args key %r is not an option name" % name)
        # An abbreviation SGLang's parser takes for --host or --port (ho, por) too: the --host/--port appended
        # below would silently win over it.
        reserved = inventory_flag(name, _RESERVED_FLAGS)
        if reserved:
            raise AnsibleFilterError("sglang_launch_args must not contain %r%s: set sglang_%s instead"
                                     % (name, "" if reserved == name.replace("_", "-") else
                                        " (SGLang reads it as --%s)" % reserved, reserved))
        flag = "--" + name
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if not value:
                continue
            argv.append(flag)
            argv.extend(_scalar_text(name, item) for item in value)
        else:
            argv.extend([flag, _scalar_text(name, value)])
    argv.extend(["--host", str(host), "--port", str(int(port))])
    return argv


def _systemd_escape_body(text):
    # systemd.service(5) "Command lines": C-style escapes inside quotes; "%" starts a specifier
    # (systemd.unit(5)) and "$" an environment substitution, so both are doubled to stay literal.
    out = text.replace("\\", "\\\\").replace('"', '\\"')
    out = out.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    # Every other C0 control and DEL as \xNN (systemd unescapes it), so no raw control byte reaches the unit file;
    # the command-line guard refuses them in launch values anyway (issue 31).
    out = _OTHER_CONTROLS.sub(lambda m: "\\x%02x" % ord(m.group()), out)
    return out.replace("%", "%%")


def systemd_quote(word):
    """Quote one argv element for ``ExecStart=`` so systemd passes it through unchanged.

    Plain words stay bare; anything with whitespace, quotes, backslashes, ``;`` or an empty string is
    double-quoted with C escapes. ``%`` → ``%%`` (specifiers) and ``$`` → ``$$`` (variable expansion) always.
    Raises AnsibleFilterError for NUL bytes, which no argv can carry.
    """
    text = str(word)
    if "\x00" in text:
        raise AnsibleFilterError("an argv element cannot contain a NUL byte: %r" % text)
    body = _systemd_escape_body(text).replace("$", "$$")
    if text and text != ";" and _SYSTEMD_SAFE.match(text):
        return body
    return '"%s"' % body


def systemd_env_assignment(value, name):
    """One ``Environment=`` operand, quoted: ``"NAME=value"``.

    ``$`` is not expanded in ``Environment=`` (systemd.exec(5)), but ``%`` specifiers are, so ``%`` is doubled.
    Raises AnsibleFilterError for a name that is not a shell-style variable name or a NUL byte in the value.
    """
    key = str(name)
    if not _ENV_NAME.match(key):
        raise AnsibleFilterError("environment variable name %r is not valid ([A-Za-z_][A-Za-z0-9_]*)" % key)
    text = "" if value is None else str(value)
    if isinstance(value, bool):
        text = "1" if value else "0"
    if "\x00" in text:
        raise AnsibleFilterError("value of %s contains a NUL byte" % key)
    return '"%s=%s"' % (key, _systemd_escape_body(text))


def systemd_value(value, name, rule=None):
    """One value of a one-value unit setting (``Description=``, ``User=``) written so that systemd reads back
    exactly ``value``: ``%`` doubled (specifiers, systemd.unit(5)). ``name``: the variable, for the error.
    ``rule``: also check the value as a ``user``, ``host``, ``unit_name`` or ``path``
    (plugins/module_utils/gpufleet_unit_values.py). Raises AnsibleFilterError, naming ``name``, for a control
    character, a trailing backslash, white space at an end, or a value that breaks ``rule``: the command-line
    guard and preflight refuse those before any host is touched, so this error means a role ran on its own.
    """
    try:
        return systemd_setting(value, name, rule)
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from None


def systemd_path(value, name):
    """A path for ``WorkingDirectory=``, ``EnvironmentFile=`` or ``StandardOutput=append:``: absolute and
    normalised, no backslash, quote, white space or glob character, ``%`` doubled (see :func:`systemd_value`)."""
    return systemd_value(value, name, "path")


def gpufleet_lock_owner(run_id):
    """Identity written into a host lock: ``{run_id, controller, pid, user, taken_at}``.

    ``pid`` is the ansible-playbook process (the parent of the worker that templates this filter).
    """
    return {
        "run_id": str(run_id),
        "controller": socket.gethostname(),
        "pid": os.getppid(),
        "user": getpass.getuser(),
        "taken_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


class FilterModule(object):
    """gpufleet filters."""

    def filters(self):
        return {
            "sglang_argv": sglang_argv,
            "systemd_quote": systemd_quote,
            "systemd_env_assignment": systemd_env_assignment,
            "systemd_value": systemd_value,
            "systemd_path": systemd_path,
            "gpufleet_lock_owner": gpufleet_lock_owner,
            "gpufleet_lock_holder_gone": gpufleet_lock_holder_gone,
            "gpufleet_summary_table": gpufleet_summary_table,
        }
