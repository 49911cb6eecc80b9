"""Indent block sequences under their key, as ansible-lint's yaml rule wants (yamllint indentation,
indent-sequences: true), changing nothing else: ``python tests/support/indent_sequences.py plugins/filter/*.yml``.

For the filters' ansible-doc pages written in the older style (``description:`` then ``- ...`` at the key's
column). Only whitespace at the start of lines changes; a file whose data would differ afterwards (yaml.safe_load
before and after) is left as it was and named, exit status 1. ``ansible-lint --fix=yaml`` also re-wraps and
re-quotes every long string; this keeps the diff to indentation (``git diff -w`` shows nothing).
"""
import sys

import yaml


def _indent(line):
    return len(line) - len(line.lstrip(" "))


def _is_item(line):
    stripped = line.lstrip(" ")
    return stripped.startswith("- ") or stripped == "-"


def indent_sequences(text):
    """``text`` with every block sequence that sits at its key's column moved two spaces in, with its items'
    continuation lines."""
    lines = text.split("\n")
    out = []
    open_at = []  # columns of the sequences being shifted, innermost last
    for n, line in enumerate(lines):
        if not line.strip():
            out.append(line)
            continue
        col = _indent(line)
        while open_at and (col < open_at[-1] or (col == open_at[-1] and not _is_item(line))):
            open_at.pop()
        if _is_item(line) and (not open_at or open_at[-1] != col):
            prev = next((p for p in reversed(lines[:n]) if p.strip()), "")
            if prev.rstrip().endswith(":") and _indent(prev) == col and not prev.lstrip().startswith("#"):
                open_at.append(col)
        shift = 2 * sum(1 for c in open_at if col >= c)
        out.append(" " * shift + line)
    return "\n".join(out)


def main(paths):
    bad = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = indent_sequences(text)
        if new == text:
            continue
        if yaml.safe_load(new) != yaml.safe_load(text):
            bad.append(path)
            continue
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    if bad:
        sys.exit("left as they were (their data would change): %s" % ", ".join(bad))


if __name__ == "__main__":
    main(sys.argv[1:])
