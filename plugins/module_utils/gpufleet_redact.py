"""Secrets out of everything gpufleet returns: one place for the redaction of SGLang's API keys (issue 31).

SGLang takes its API keys only on the command line (``--api-key``, ``--admin-api-key``; FIELD-NOTES) and logs them
back: 0.5.23 ``entrypoints/engine.py`` logs ``server_args={...}`` (a dict repr, ``'api_key': 'K'``), older releases
``server_args=ServerArgs(... api_key='K', ...)``, with only the watermark secrets redacted. A module result lands in
AWX's job events, ansible-runner's artifacts and ``-v`` output, where anyone who may read the job reads it; so every
command line, process title, log tail and journal line a module or filter returns goes through :func:`redact_text`
(one str), :func:`redact_argv` (a list of arguments) or :func:`redact_data` (a whole result).

None of this needs the key: the forms are recognised by their shape, so a module that never saw the key
(sglang_host_info, the fleet check) hides it as well. Forms recognised:

- a flag and its value (smg's ``--control-plane-api-keys`` too): ``--api-key K`` (two argv elements, or one string such as a setproctitle title holding the
  whole command line), ``--api-key=K``, the same for ``--admin-api-key``, and a list repr ``'--api-key', 'K'``;
  SGLang's two key flags also abbreviated as its argparse parser takes them (``--api-ke K``, ``--admin-api-k=K``,
  down to two letters: :func:`abbreviates`);
- a field and its value: ``api_key='K'``, ``api_key="K"``, ``'api_key': 'K'``, ``"api_key": "K"``, ``api_key=K``, for
  any field name ending in ``api_key`` (``admin_api_key``, ``OPENAI_API_KEY``), any case; ``None``/``null``/empty
  values stay as they are (they say there is no key);
- an HTTP bearer token: ``Authorization: Bearer K`` (or ``Bearer K`` alone).

Left alone: ``--api-key-file PATH`` and other flags that only begin with a secret flag's name (a path is not a
secret, and SGLang 0.5.23 has no such flag), a secret flag with no value (``--api-key --port 1``).
"""
from __future__ import annotations

import re

# smg (the router) takes its control-plane keys as --control-plane-api-keys id:name:role:KEY.
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--control-plane-api-keys")
REDACTED = "********"
# SGLang reads its command line with argparse's allow_abbrev on (gpufleet_sglang_args.resolve_flag): a prefix of a
# long option is that option, so ``--api-ke K`` hands SGLang a key as ``--api-key K`` does. SGLang's flags (without
# dashes) that carry a secret, and the ones gpufleet renders from the inventory (sglang_host, sglang_port,
# sglang_api_key, sglang_admin_api_key), which no tune candidate or launch profile may set, abbreviated or not.
SGLANG_SECRET_FLAGS = ("api-key", "admin-api-key")
INVENTORY_FLAGS = ("api-key", "admin-api-key", "host", "port")
# The shortest abbreviation counted (one letter is ambiguous in every SGLang release: --a, --h, --p).
MIN_ABBREV = 2


def abbreviates(word, option):
    """True when ``word`` is ``option`` or a prefix of it, the way argparse's allow_abbrev reads a long option (both
    with their dashes: ``--tp`` abbreviates ``--tp-size``; gpufleet_sglang_args.resolve_flag). argparse also wants
    the prefix to match no other option of the parser; that needs the release's option list, so here a prefix is
    enough: a flag that may be read as ``option`` is treated as it."""
    return isinstance(word, str) and isinstance(option, str) and word.startswith("--") and option.startswith(word)


def inventory_flag(name, flags=INVENTORY_FLAGS):
    """The flag of ``flags`` (default :data:`INVENTORY_FLAGS`: api-key, admin-api-key, host, port; without dashes)
    that the launch flag name ``name`` (without dashes, as sglang_launch_args writes it; leading dashes, case and
    ``_`` for ``-`` are forgiven) is or abbreviates with at least :data:`MIN_ABBREV` characters (``api-ke`` ->
    ``api-key``, ``ho`` -> ``host``), else None."""
    if not isinstance(name, str):
        return None
    word = name.lstrip("-").replace("_", "-").lower()
    if len(word) < MIN_ABBREV:
        return None
    for flag in flags:
        if abbreviates("--" + word, "--" + flag):
            return flag
    return None


def _prefixes(word):
    """A regex alternative matching ``word`` and each of its prefixes of at least :data:`MIN_ABBREV` characters."""
    text = re.escape(word[:MIN_ABBREV])
    tail = word[MIN_ABBREV:]
    nested = ""
    for char in reversed(tail):
        nested = "(?:%s%s)?" % (re.escape(char), nested)
    return text + nested


# --api-key, --admin-api-key (and their abbreviations), --control-plane-api-keys (smg; clap takes no abbreviation)
_FLAG_WORDS = r"(?:%s|%s|control-plane-api-keys)" % tuple(_prefixes(flag) for flag in SGLANG_SECRET_FLAGS)

# A value in quotes (backslash escapes as in a Python repr or JSON; the closing quote may be cut off by a
# shortened line) or a bare word.
_QUOTED = r"'(?:[^'\\\n]|\\.)*'?|\"(?:[^\"\\\n]|\\.)*\"?"
_FLAG = r"(?<![\w-])(--" + _FLAG_WORDS + r")"
_PATTERNS = (
    # --api-key=K (any value, a dash included: "=" binds it)
    re.compile(_FLAG + r"(=)(" + _QUOTED + r"|[^\s'\",;)\]}]+)"),
    # --api-key K: a value that is not the next flag (argparse would refuse "--api-key --port")
    re.compile(_FLAG + r"([ \t]+)(?!--)(" + _QUOTED + r"|[^\s'\",;)\]}]+)"),
    # '--api-key', 'K' (a list repr, JSON array)
    re.compile(r"(['\"]--" + _FLAG_WORDS + r"['\"]\s*,\s*)()(" + _QUOTED + r")"),
    # api_key='K', 'api_key': 'K', "api_key": "K", API_KEY=K; None / null / '' / "" are kept
    re.compile(r"(?i)(\b\w*api_key['\"]?\s*)([=:]\s*)(?!(?:None|null|''|\"\")(?![\w-]))(" + _QUOTED
               + r"|[^\s'\",;)\]}]+)"),
    # Authorization: Bearer K, Bearer K
    re.compile(r"(\bBearer)([ \t]+)([A-Za-z0-9._~+/=-]+)"),
)


# A reference to a variable (``--api-key ${GPUFLEET_SGLANG_API_KEY}``: the systemd unit's ExecStart=, which systemd
# expands from the root-only EnvironmentFile=) names where the key is, not the key: an API key is a token68 word
# (roles/sglang_launch/tasks/checks.yml), never one with "$". Kept, so the unit text reads back as written.
_REFERENCE = re.compile(r"^\$\{?[A-Za-z_][A-Za-z0-9_]*\}?$")


def _hide(match):
    value = match.group(3)
    if _REFERENCE.match(value):
        return match.group(0)
    quote = value[0] if value[:1] in ("'", '"') and len(value) > 1 and value[-1] == value[0] else ""
    return match.group(1) + match.group(2) + quote + REDACTED + quote


def redact_text(text, known=()):
    """``text`` (one str: a command line, a title, a log tail, a journal line, a message) with the value of each
    secret form (module docstring) replaced by ``********``, quotes kept. ``known``: secrets to hide wherever they
    appear as well (the key a task was given; optional, never needed for the forms above). A non-str is returned
    unchanged."""
    if not isinstance(text, str) or not text:
        return text
    for pattern in _PATTERNS:
        text = pattern.sub(_hide, text)
    for secret in known or ():
        if isinstance(secret, str) and secret.strip():
            text = text.replace(secret, REDACTED)
    return text


def redact_argv(argv, known=()):
    """``argv`` (list of str) with the element after each secret flag (:data:`SECRET_FLAGS`, and any abbreviation
    of SGLang's ``--api-key``/``--admin-api-key``: ``--api-ke``) replaced by ``********``, and every element
    redacted as :func:`redact_text` does (``--api-key=K``; one element holding a whole command line, as a
    setproctitle title leaves it). None stays None."""
    if argv is None:
        return None
    out, hide_next = [], False
    for arg in argv:
        if hide_next and isinstance(arg, str):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = isinstance(arg, str) and (arg in SECRET_FLAGS or (
            arg.startswith("--") and inventory_flag(arg, SGLANG_SECRET_FLAGS) is not None))
        out.append(redact_text(arg, known))
    return out


def _secret_name(name):
    """A dict key that names an API key: ``api_key``, ``--api-key``, ``admin_api_key``, ``OPENAI_API_KEY``."""
    return isinstance(name, str) and name.lstrip("-").replace("-", "_").lower().endswith("api_key")


def redact_data(value, known=()):
    """A copy of ``value`` (a module result: dicts, lists, str, numbers) with every secret hidden: str through
    :func:`redact_text`, lists of str through :func:`redact_argv`, and the non-empty str value of a dict key that
    names an API key (``api_key``, ``--api-key``, ``admin_api_key``) replaced by ``********``."""
    if isinstance(value, str):
        return redact_text(value, known)
    if isinstance(value, dict):
        return {k: (REDACTED if _secret_name(k) and isinstance(v, str) and v else redact_data(v, known))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if all(isinstance(item, str) for item in value):
            return redact_argv(list(value), known)
        return [redact_data(item, known) for item in value]
    return value


def redact_module(module):
    """Make ``module`` (an AnsibleModule) hide secrets in everything it returns: ``exit_json``, ``fail_json`` and
    ``warn`` pass their results through :func:`redact_data` first. Called once, right after the module is built, by
    every module that returns process data or log lines; the readers redact at the source as well, so this is the
    net under messages assembled from them. Returns ``module``."""
    exit_json, fail_json, warn = module.exit_json, module.fail_json, module.warn

    def redacted_exit_json(**kwargs):
        return exit_json(**redact_data(kwargs))

    def redacted_fail_json(msg, **kwargs):
        return fail_json(redact_text(msg), **redact_data(kwargs))

    def redacted_warn(warning):
        return warn(redact_text(warning))

    module.exit_json, module.fail_json, module.warn = redacted_exit_json, redacted_fail_json, redacted_warn
    return module
