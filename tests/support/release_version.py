"""Set galaxy.yml's version for a release (``make changelog VERSION=x.y.z``; docs/releasing.md).

galaxy.yml is the one version source: the collection's MANIFEST.json, antsibull-changelog's release, the gpufleet
pip package (setup.py) and the CLI's ``--version`` read it. Only its top-level ``version:`` line changes (comments and
layout stay). Refuses, changing nothing, a version that is not semantic (Galaxy requires x.y.z) or not newer than
the current one: a release never goes back.
"""
import os
import re
import sys

import yaml
from packaging.version import InvalidVersion, Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GALAXY = os.path.join(ROOT, "galaxy.yml")
# semantic versioning as Galaxy takes it: x.y.z, optionally -prerelease and +build
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
_LINE = re.compile(r"^version:[^\n]*$", re.M)


class ReleaseError(ValueError):
    """The version cannot be released."""


def set_version(text, new):
    """galaxy.yml's text with its version set to ``new``; raises :class:`ReleaseError` saying why not."""
    if not SEMVER.match(new):
        raise ReleaseError("%r is not a semantic version x.y.z (Galaxy requires one)" % new)
    current = str(yaml.safe_load(text)["version"])
    try:
        newer = Version(new) > Version(current)
    except InvalidVersion:
        newer = True  # the current one is unreadable: the new one replaces it
    if not newer:
        raise ReleaseError("version %s is not newer than galaxy.yml's %s" % (new, current))
    if len(_LINE.findall(text)) != 1:
        raise ReleaseError("galaxy.yml has no single top-level version: line")
    out = _LINE.sub("version: %s" % new, text)
    if str(yaml.safe_load(out)["version"]) != new:
        raise ReleaseError("galaxy.yml would not read back version %s" % new)
    return out


def main(argv):
    if len(argv) != 1:
        sys.exit("usage: release_version.py x.y.z")
    with open(GALAXY, encoding="utf-8") as fh:
        text = fh.read()
    try:
        out = set_version(text, argv[0])
    except ReleaseError as exc:
        sys.exit("make changelog: %s; nothing changed" % exc)
    with open(GALAXY, "w", encoding="utf-8") as fh:
        fh.write(out)


if __name__ == "__main__":
    main(sys.argv[1:])
