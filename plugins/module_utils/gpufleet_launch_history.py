# -*- coding: utf-8 -*-
# gpufleet: the launch history on the host (issue 34), one JSON object per line.
"""Append to and read a host's launch history (``sglang_launch_history_file``, default
``<sglang_state_dir>/history.jsonl``): one line per verified launch (restart.yml, tune.yml), oldest first.

Writing (:func:`append_entry`) reads what is there, adds the new entry, keeps the ``max_entries`` newest and replaces
the file atomically (temporary file in the same directory, fsync, rename), so a reader never sees half a line and a
crash never loses the older entries. The file is created by the user writing it with mode 0600: the history holds
argv and environment, which are nobody else's business. An entry holding a key that names a secret (``api_key``,
``token``, ``password``, ``secret`` ...) with a value that is not the redaction mark is refused
(:func:`secret_keys`): the history is kept for months and read by ``gpufleet history``; the launch record's rule
(never the key, only whether one was set) holds here too.

Reading (:func:`read_entries`) skips lines that are not JSON objects and counts them. Nothing here needs Ansible.
"""
from __future__ import annotations

import json
import os
import re
import tempfile

FILE_MODE = 0o600
DEFAULT_MAX_ENTRIES = 200
MAX_LINE_BYTES = 1 << 20
REDACTED = "********"
# A key naming a secret: api_key, --api-key, OPENAI_API_KEY, HF_TOKEN, password, client_secret, authorization; as a
# whole word between _ or - (tokens_per_s, a figure, names no secret).
SECRET_KEY = re.compile(r"(?i)(^|[_-])(api[_-]?key|token|passw(or)?d|secret|authorization|credentials?)($|[_-])")
# Values that say there is no secret (or hide it).
HIDDEN = (None, "", REDACTED, True, False)


class HistoryError(ValueError):
    """The entry or the file cannot be used; the message says why."""


def secret_keys(value, path="entry"):
    """Paths (``entry.env.HF_TOKEN``) of every dict key in ``value`` that names a secret (:data:`SECRET_KEY`) and
    holds a value other than None, '', a bool or ``********``, in order. Empty list: nothing to refuse."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            where = "%s.%s" % (path, key)
            if isinstance(key, str) and SECRET_KEY.search(key) and not isinstance(item, (dict, list)) \
                    and item not in HIDDEN:
                found.append(where)
            else:
                found += secret_keys(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += secret_keys(item, "%s[%d]" % (path, index))
    return found


def mask_secrets(value):
    """A copy of ``value`` with the value of every key :func:`secret_keys` would name replaced by ``********``: what
    the module echoes of a refused entry (its invocation) must not carry the secret it refused."""
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(k, str) and SECRET_KEY.search(k) and not isinstance(v, (dict, list))
                    and v not in HIDDEN else mask_secrets(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    return value


def parse_lines(text):
    """``(entries, bad)``: the JSON objects of ``text`` (one per line, in file order) and the count of lines that
    are not one (blank lines are neither)."""
    entries, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(item, dict):
            entries.append(item)
        else:
            bad += 1
    return entries, bad


def read_entries(path):
    """``(entries, bad)`` of the file at ``path``; ``([], 0)`` when it does not exist. Raises OSError when it
    exists but cannot be read."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return [], 0
    return parse_lines(data.decode("utf-8", "replace"))


def last(entries, count):
    """The ``count`` newest of ``entries`` (oldest first); every entry when ``count`` is 0 or less."""
    count = int(count or 0)
    return list(entries) if count <= 0 else list(entries)[-count:]


def plan(entries, entry, max_entries):
    """``(kept, dropped)``: the entries the file holds after ``entry`` is added (the ``max_entries`` newest, oldest
    first) and how many older ones fall out."""
    if max_entries < 1:
        raise HistoryError("max_entries is %d; keep at least 1 entry" % max_entries)
    merged = list(entries) + [entry]
    dropped = max(0, len(merged) - max_entries)
    return merged[dropped:], dropped


def check_entry(entry):
    """Refuse an entry that is not a mapping, holds a secret (:func:`secret_keys`) or is not JSON-serialisable.
    Returns its JSON line (no newline)."""
    if not isinstance(entry, dict) or not entry:
        raise HistoryError("entry must be a non-empty mapping")
    secrets = secret_keys(entry)
    if secrets:
        raise HistoryError("entry holds what looks like a secret at %s: refused, nothing written (the history "
                           "keeps only whether a key was set; redact the value or drop the key)"
                           % ", ".join(secrets))
    try:
        line = json.dumps(entry, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise HistoryError("entry is not JSON: %s" % exc)
    if len(line.encode("utf-8")) > MAX_LINE_BYTES:
        raise HistoryError("entry is larger than %d bytes" % MAX_LINE_BYTES)
    return line


def write_entries(path, entries):
    """Replace ``path`` with ``entries`` (one JSON line each) atomically: a temporary file in the same directory,
    created by this user with mode 0600, fsync, rename over ``path``, fsync of the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".history.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for item in entries:
                handle.write(json.dumps(item, sort_keys=True, separators=(",", ":")) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def append_entry(path, entry, max_entries=DEFAULT_MAX_ENTRIES, check_mode=False):
    """Add ``entry`` to the history at ``path`` (its directory must exist), keeping the ``max_entries`` newest.
    Returns ``{"changed", "path", "entries" (count after), "dropped", "mode"}``; with ``check_mode`` nothing is
    written. Raises :class:`HistoryError` (a refused entry, a missing directory) or OSError."""
    check_entry(entry)
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise HistoryError("the directory of %s does not exist (sglang_state_dir is created by the launch)" % path)
    entries, _bad = read_entries(path)
    kept, dropped = plan(entries, entry, max_entries)
    if not check_mode:
        write_entries(path, kept)
    return {"changed": True, "path": path, "entries": len(kept), "dropped": dropped, "mode": "0600"}
