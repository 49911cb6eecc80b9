"""Values gpufleet renders into a systemd unit, runs as root or uses as a path or a user name: the one rule.

Issue 31: ``-e '{"sglang_service_user":"sglang\\nExecStartPre=+/bin/sh -c \\"id > /tmp/pwned\\""}'`` was rendered
into ``User=`` and the line break made the rest a directive that systemd ran as root. Every such value an
inventory, an AWX survey answer or ``-e`` sets is checked here, by the command-line guard before any host is
touched (plugins/filter/gpufleet_values.py ``gpufleet_unit_value_report``), again by preflight with the values
the roles resolved (``gpufleet_unit_value_problems``), and when the unit is rendered (plugins/filter/gpufleet.py
``systemd_value``/``systemd_path`` raise on what should have been refused). Stdlib only.

Facts used (systemd 252, Debian bookworm's and the lab's; tests/integration/test_systemd_method.py reads a unit
written by these filters back through it):

- systemd.syntax(7): a line ending in a backslash continues on the next line; white space at both ends of a
  value is dropped. So a line break (or a trailing backslash) in a value is a new directive, and a value with
  white space at an end is not read back as written.
- systemd.unit(5) "Specifiers": ``%`` starts a specifier in most settings (Description=, User=,
  WorkingDirectory=, EnvironmentFile=, StandardOutput=, Environment=, ExecStart=); ``%%`` is a literal ``%``.
- systemd.exec(5): ``WorkingDirectory=`` takes a leading ``-`` (a missing directory is no error) and ``~`` (the
  user's home); ``EnvironmentFile=`` a leading ``-`` and a *wildcard expression* (``*``, ``?``, ``[`` are glob
  characters); ``StandardOutput=append:PATH`` a path; ``User=`` a user name or a numeric uid.
  systemd.service(5): ``ExecStart=``'s first word may carry the prefixes ``@ - : + ! !!`` (``+`` runs it with full
  privileges, i.e. as root), read before any quote.
- A path here must therefore be absolute (no ``-``/``~`` prefix is possible), and hold no backslash, quote, white
  space or glob character: those are read differently by at least one of the settings or by systemd's
  ExecStart= splitting, and no real state directory needs them. ``%`` and ``$`` are fine: the unit filters double
  ``%`` everywhere and ``$`` in ExecStart= (other settings keep ``$`` literally).

Control characters: C0 (U+0000-U+001F), DEL (U+007F), C1 (U+0080-U+009F, NEL U+0085 among them) and the line
and paragraph separators U+2028/U+2029 are refused in every value checked here, and every message shows a value
escaped (``\\n``, ``\\x1b``, ``\\u2028``), never raw.
"""
from __future__ import annotations

import ipaddress
import posixpath
import re

from collections.abc import Mapping

# POSIX user names (IEEE Std 1003.1, 3.437: the portable filename characters A-Z a-z 0-9 . _ -, no leading -),
# starting with a letter or _ (an all-digit name is a uid to systemd's User=), 32 at most as useradd takes them.
# systemd's User= takes these (dots with its relaxed check, e.g. LDAP's first.last). A trailing "$"
# (Samba machine accounts) is refused: no service user is one, and "$" is an expansion in command lines.
USER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")
# A unit name (systemd.unit(5): letters, digits, ":", "-", "_", ".", "\\"; "@" before an instance) ending .service.
# The backslash (systemd's own escaping) is left out: the name is also joined into a path and passed to systemctl.
UNIT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9:_.-]*(@[A-Za-z0-9:_.-]+)?\.service\Z")
# A command name systemd finds in its search path (no slash); not starting with an ExecStart= prefix character.
COMMAND_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*\Z")
HOST_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")
PATH_MAX = 4095
# An RFC 6750 bearer token (b64token: ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/", then "="s): what the
# Authorization header carries and what the key file's one NAME=value line can hold. \Z, not $: "$" also matches
# before a final new line, and a new line in the key adds a line (a variable such as LD_PRELOAD=) to that file.
BEARER_TOKEN = re.compile(r"^[A-Za-z0-9._~+/-]+=*\Z")

# variable -> rule, the variables a user sets (inventory, AWX survey, -e) that end up in the unit, in a root
# command or as a path the roles write as root.
VARIABLES = {
    "sglang_service_user": "user",
    "sglang_state_dir": "path",
    "sglang_launch_log_file": "path",
    "sglang_launch_pid_file": "path",
    "sglang_launch_chdir": "path",
    "sglang_launch_api_key_file": "path",
    "sglang_launch_record_file": "path",
    "sglang_launch_unit_dir": "path",
    "sglang_stop_pid_file": "path",
    "gpufleet_lock_dir": "path",
    "sglang_python": "path",
    "sglang_nccl_patch_path": "path",
    "sglang_launch_unit_name": "unit_name",
    "sglang_host": "host",
    "sglang_launcher": "argv",
    "sglang_nccl_env": "env",
    "sglang_launch_extra_env": "env",
    "sglang_launch_args": "args",
    "sglang_api_key": "secret",
}

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\", "'": "\\'"}


def is_control(char):
    """True for C0, DEL, C1 and U+2028/U+2029."""
    code = ord(char)
    return code < 0x20 or 0x7F <= code <= 0x9F or code in (0x2028, 0x2029)


def escape(text, quoted=True):
    """``text`` with every character that is not printable written as an escape (\\n, \\x1b, \\u2028); with
    ``quoted`` also backslashes and single quotes (for a value shown between single quotes)."""
    out = []
    for char in text:
        if char in _ESCAPES and (quoted or char not in "\\'"):
            out.append(_ESCAPES[char])
        elif is_control(char) or not char.isprintable() and char != " ":
            code = ord(char)
            out.append("\\x%02x" % code if code < 0x100 else "\\u%04x" % code if code < 0x10000 else "\\U%08x" % code)
        else:
            out.append(char)
    return "".join(out)


def show(value, limit=160):
    """``value`` as a message shows it: a string quoted and escaped, cut to about ``limit`` characters. A cut keeps
    the first control character in view (a long path's line break would otherwise fall behind the "...")."""
    if isinstance(value, str):
        text = escape(value)
        if len(text) <= limit:
            return "'%s'" % text
        first = next((i for i, char in enumerate(value) if is_control(char)), None)
        at = len(escape(value[:first])) if first is not None else 0
        if at + 15 <= limit - 3:
            return "'%s...'" % text[:limit - 3]
        start = at - 15
        window = text[start:start + limit - 26]
        return "'%s...%s%s'" % (text[:20], window, "..." if start + len(window) < len(text) else "")
    text = escape(repr(value), quoted=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def controls(text):
    """The distinct control characters of ``text``, escaped, in order of appearance."""
    seen = []
    for char in text:
        if is_control(char) and escape(char) not in seen:
            seen.append(escape(char))
    return seen


def control_problem(name, value):
    """Why the string ``value`` of ``name`` is refused for a control character ('' when it holds none)."""
    found = controls(value) if isinstance(value, str) else []
    if not found:
        return ""
    return ("%s=%s holds a control character (%s): refused: a line break in a systemd unit starts a new "
            "directive (run as root), and no control character belongs in a unit, a path or a name; remove it"
            % (name, show(value), ", ".join(found[:5])))


def _text_problem(name, value, wanted):
    """The problem every rule starts with ('' when there is none): ``value`` is no str ("is a <type>, not
    <wanted>"), or it holds a control character (:func:`control_problem`)."""
    if not isinstance(value, str):
        return "%s=%s is a %s, not %s" % (name, show(value), type(value).__name__, wanted)
    return control_problem(name, value)


def path_problem(name, value):
    """Why ``value`` is no absolute, normalised path a systemd path setting keeps as written ('' when it is)."""
    problem = _text_problem(name, value, "a path; give an absolute path")
    if problem:
        return problem
    if not value.startswith("/"):
        return ("%s=%s is not an absolute path (systemd reads a leading - or ~ of WorkingDirectory= and "
                "EnvironmentFile= as an option); give one starting with /" % (name, show(value)))
    bad = []
    if "\\" in value:
        bad.append("a backslash (a unit line ending in one continues on the next)")
    if any(c.isspace() for c in value):
        bad.append("white space (systemd drops it at the ends of a setting and splits ExecStart= at it)")
    if "'" in value or '"' in value:
        bad.append("a quote (systemd unquotes ExecStart= words)")
    if any(c in value for c in "*?["):
        bad.append("a glob character (EnvironmentFile= expands * ? [ as a wildcard)")
    if any(not c.isprintable() for c in value if not c.isspace()):
        bad.append("a character that is not printable")
    if bad:
        return "%s=%s holds %s: refused; give a path without it" % (name, show(value), " and ".join(bad))
    if len(value) > PATH_MAX:
        return "%s is %d characters long, more than a path may be (%d); give a shorter path" % (
            name, len(value), PATH_MAX)
    normal = posixpath.normpath(value)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    if normal != value:
        return ("%s=%s is not a normalised path (no '.', '..' or '//' component, no trailing /): refused; write "
                "the path it means, e.g. %s (and check that it is the one meant where '..' follows a link)"
                % (name, show(value), show(normal)))
    return ""


def user_problem(name, value, unprivileged=True):
    """Why ``value`` is no POSIX user name (of an unprivileged user when ``unprivileged``: the systemd method's
    User=) ('' when it is)."""
    problem = _text_problem(name, value, "a user name; give the name of the unprivileged user the server runs as "
                                         "(e.g. sglang)")
    if problem:
        return problem
    if not USER_NAME.match(value):
        return ("%s=%s is not a user name: refused; give the unprivileged user the server runs as: letters, "
                "digits, . _ and -, starting with a letter or _, at most 32 (e.g. sglang)" % (name, show(value)))
    if unprivileged and value == "root":
        return ("%s=root: refused, the server runs unprivileged (its unit has User=); give a system user that owns "
                "the model and the SGLang install read-only (e.g. sglang)" % name)
    return ""


def unit_name_problem(name, value):
    """Why ``value`` is no plain ``.service`` unit name ('' when it is)."""
    problem = _text_problem(name, value, "a unit name; give e.g. sglang.service")
    if problem:
        return problem
    if not UNIT_NAME.match(value) or len(value) > 255:
        return ("%s=%s is not a service unit name: refused; give letters, digits and : _ . - (an @instance "
                "allowed), no slash, ending .service (e.g. sglang.service)" % (name, show(value)))
    return ""


def host_problem(name, value):
    """Why ``value`` is no IP address or host name to bind ('' when it is)."""
    problem = _text_problem(name, value, "an address; give the bind address, e.g. 127.0.0.1 or 0.0.0.0")
    if problem:
        return problem
    try:
        ipaddress.ip_address(value)
        return ""
    except ValueError:
        pass
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if len(value) <= 253 and all(HOST_LABEL.match(label) for label in labels):
        return ""
    return ("%s=%s is neither an IP address nor a host name: refused; give the bind address, e.g. 127.0.0.1, "
            "0.0.0.0 or ::" % (name, show(value)))


def command_problem(name, value):
    """Why ``value`` cannot be ExecStart='s first word: an absolute path (see :func:`path_problem`) or a command
    name without a slash that systemd finds in its search path ('' when it can)."""
    if isinstance(value, str) and not value.startswith("/"):
        problem = control_problem(name, value)
        if problem:
            return problem
        if COMMAND_NAME.match(value):
            return ""
        return ("%s=%s is neither an absolute path nor a command name: refused (systemd reads a leading + - @ : ! "
                "of ExecStart= as a prefix; + runs it as root); give the interpreter's absolute path"
                % (name, show(value)))
    return path_problem(name, value)


def argv_problems(name, value):
    """Problems of an argv prefix (list of str): [0] by :func:`command_problem`, the rest control characters.
    A value that is no list is left to the roles' type checks."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        return []
    problems = [command_problem("%s[0]" % name, value[0])] if isinstance(value[0], str) else []
    problems += [control_problem("%s[%d]" % (name, i), v) for i, v in enumerate(value) if i and isinstance(v, str)]
    return [p for p in problems if p]


def nested_problems(name, value):
    """Control characters in any key or string value of a mapping or list, at any depth, each problem naming
    the place (``sglang_launch_args[served-model-name]``)."""
    problems = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = "%s[%s]" % (name, escape(str(key)))
            if isinstance(key, str) and controls(key):
                problems.append("%s has a key %s that holds a control character (%s): refused; remove it"
                                % (name, show(key), ", ".join(controls(key))))
            problems += nested_problems(where, item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            problems += nested_problems("%s[%d]" % (name, i), item)
    elif isinstance(value, str):
        problem = control_problem(name, value)
        if problem:
            problems.append(problem)
    return problems


def secret_problem(name, value):
    """The problem (str) of a secret that is not one bearer token (:data:`BEARER_TOKEN`), else None. The message
    never shows the value, not even escaped: a refused key is still somebody's key."""
    if BEARER_TOKEN.match(str(value)):
        return None
    return ("%s must be one bearer token: letters, digits and . _ ~ + / - with optional trailing = (no spaces, "
            "quotes or line breaks); the value is not shown here" % name)


_RULES = {"secret": secret_problem, "path": path_problem, "user": user_problem, "unit_name": unit_name_problem, "host": host_problem}


def value_problems(name, value, rule=None, systemd=True):
    """Problems (list of str) of one variable's ``value`` under ``rule`` (:data:`VARIABLES` names the rule of
    each known variable); an unset value (None, ``""``) has none: the roles' defaults or type checks apply.
    ``systemd``: the systemd launch method, whose unit runs the server as the user (root refused); the process
    method runs it as the login user and only reads the name for the stop."""
    rule = rule or VARIABLES.get(name, "text")
    if value is None or (isinstance(value, str) and value == ""):
        return []
    if rule == "user":
        problem = user_problem(name, value, unprivileged=systemd)
        return [problem] if problem else []
    if rule in _RULES:
        problem = _RULES[rule](name, value)
        return [problem] if problem else []
    if rule == "argv":
        return argv_problems(name, value)
    return nested_problems(name, value)


def unit_value_problems(values, names=None):
    """Problems (list of str, each naming the variable and escaping the value) of every variable of
    :data:`VARIABLES` (or ``names``) in ``values`` (a mapping such as a host's hostvars; read with ``.get``).

    A value that starts with a value already refused (sglang_launch_log_file's default under a refused
    sglang_state_dir, the default launcher's sglang_python) is not reported again: the message names the
    variable the user set, once."""
    problems = []
    refused = []
    systemd = (values.get("sglang_launch_method") or "systemd") == "systemd"
    for name in names or VARIABLES:
        value = values.get(name)
        first = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(first, str) and any(first.startswith(r) for r in refused):
            continue
        found = value_problems(name, value, systemd=systemd)
        if found and isinstance(first, str) and first and VARIABLES.get(name) != "secret":
            refused.append(first)
        problems += found
    return problems


def systemd_setting(value, name, rule=None):
    """``value`` written for a one-value unit setting (Description=, User=, WorkingDirectory=, EnvironmentFile=,
    StandardOutput=append:) so that systemd reads back exactly ``value``: ``%`` doubled (specifiers). Raises
    ValueError, naming ``name``, for what no setting keeps as written: a control character (a new line), a
    trailing backslash (line continuation) or white space at either end (dropped), and for a value that breaks
    ``rule`` (path, user, unit_name, host; see :data:`VARIABLES`)."""
    text = "" if value is None else str(value)
    problems = value_problems(name, value, rule) if rule else []
    if not problems:
        problem = control_problem(name, text)
        if problem:
            problems = [problem]
        elif text.endswith("\\"):
            problems = ["%s=%s ends in a backslash, which continues a unit line on the next: refused"
                        % (name, show(text))]
        elif text != text.strip():
            problems = ["%s=%s has white space at an end, which systemd drops: refused" % (name, show(text))]
    if problems:
        raise ValueError(problems[0])
    return text.replace("%", "%%")
