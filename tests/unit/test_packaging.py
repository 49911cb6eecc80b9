"""Packaging: galaxy.yml is the one version source, the license is said the same way everywhere, Galaxy's metadata
rules hold, the changelog's history agrees with galaxy.yml, and a release sets the version safely.
(tests/integration/test_collection.py builds the tarball and checks what it ships.)"""
import glob
import os
import re
import runpy
import subprocess
import sys
import tomllib
import types
from importlib import metadata

import pytest
import yaml
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import release_version  # noqa: E402

GALAXY = yaml.safe_load(open(os.path.join(ROOT, "galaxy.yml"), encoding="utf-8"))
VERSION = str(GALAXY["version"])

# gpufleet's version written down as such: tarball names and image tags anywhere; a Python __version__ or a YAML
# `version: x.y.z` outside tests/ (the lab's stand-ins carry versions of the software they stand in for).
# (version_added marks history, as do the changelog files: they stay. pyproject.toml: the test below.)
_WRITTEN = [
    re.compile(r"gpufleet-fleet-\d+\.\d+\.\d+"),
    re.compile(r"gpufleet-ee:\d+\.\d+\.\d+"),
]
_WRITTEN_OUTSIDE_TESTS = [
    re.compile(r"^\s*__version__\s*=\s*[\"']\d", re.M),
    re.compile(r"^version:\s*[\"']?\d+\.\d+\.\d+", re.M),
]
_HISTORY = ("changelogs/", "CHANGELOG.md", "LICENSE")
# Issue 33: parts merged after this one rewrite these (the ee part derives the EE's version from galaxy.yml, the
# readme part rewrites README.md); drop each from here once its part is merged.
_OWNED_ELSEWHERE = set()


def _tracked():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.split("\0") if p]


def test_no_file_but_galaxy_yml_writes_the_version():
    found = []
    for path in _tracked():
        if path == "galaxy.yml" or path.startswith(_HISTORY) or path in _OWNED_ELSEWHERE:
            continue
        full = os.path.join(ROOT, path)
        if os.path.islink(full) or not os.path.isfile(full):
            continue
        try:
            text = open(full, encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        for pattern in _WRITTEN + ([] if path.startswith("tests/") else _WRITTEN_OUTSIDE_TESTS):
            found += ["%s: %s" % (path, m.group(0).strip()) for m in pattern.finditer(text)]
    assert not found, "versions written outside galaxy.yml (read it instead): %s" % found


def test_the_pip_package_reads_its_version_from_galaxy_yml(tmp_path, monkeypatch):
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    # setup.py, run as setuptools runs it, beside a galaxy.yml of another version
    (tmp_path / "galaxy.yml").write_text(open(os.path.join(ROOT, "galaxy.yml")).read().replace(
        "version: %s\n" % VERSION, "version: 9.8.7\n"))
    (tmp_path / "setup.py").write_text(open(os.path.join(ROOT, "setup.py")).read())
    seen = {}
    # setuptools as the build backend hands it to setup.py (venvs of Python >= 3.12 have none of their own)
    monkeypatch.setitem(sys.modules, "setuptools", types.SimpleNamespace(setup=lambda **kw: seen.update(kw)))
    runpy.run_path(str(tmp_path / "setup.py"))
    assert seen == {"version": "9.8.7"}


def test_the_installed_cli_says_galaxy_yml_s_version(capsys):
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import gpufleet_cli
    from gpufleet_cli import cli
    installed = metadata.version("gpufleet")
    assert installed == VERSION, "the venv's gpufleet is %s, galaxy.yml says %s: make venv" % (installed, VERSION)
    assert gpufleet_cli.__version__ == VERSION
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == "gpufleet " + VERSION


def test_one_license_said_the_same_way_everywhere():
    assert GALAXY["license"] == ["GPL-3.0-or-later"] and "license_file" not in GALAXY
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    assert project["license"] == "GPL-3.0-or-later" and project["license-files"] == ["LICENSE"]
    text = open(os.path.join(ROOT, "LICENSE"), encoding="utf-8").read()
    assert "GNU GENERAL PUBLIC LICENSE" in text and "Version 3, 29 June 2007" in text
    # "or later" is said where it is granted: the house's page on it
    assert "GPL-3.0-or-later" in open(os.path.join(ROOT, "docs", "releasing.md"), encoding="utf-8").read()


def test_galaxy_metadata_follows_galaxy_rules():
    tags = GALAXY["tags"]
    # a tag takes the characters of a collection name; at most 20; one of Galaxy's categories (ansible-lint)
    assert all(re.fullmatch(r"[a-z][a-z0-9_]{0,63}", t) for t in tags), tags
    assert len(tags) <= 20 and len(set(tags)) == len(tags)
    assert {"infrastructure", "monitoring"} & set(tags)
    for key in ("repository", "documentation", "homepage", "issues"):
        assert GALAXY[key].startswith("https://"), key
    assert release_version.SEMVER.match(VERSION)
    # what the tarball must carry is not build_ignore'd
    ignored = GALAXY["build_ignore"]
    for shipped in ("LICENSE", "CHANGELOG.md", "changelogs/changelog.yaml", "README.md"):
        assert shipped not in ignored and os.path.dirname(shipped) not in ignored, shipped


def test_the_changelog_history_ends_at_or_before_galaxy_yml_s_version():
    changes = yaml.safe_load(open(os.path.join(ROOT, "changelogs", "changelog.yaml"), encoding="utf-8"))
    released = sorted(Version(v) for v in changes["releases"])
    assert released and released[0] == Version("0.1.0")
    assert released[-1] <= Version(VERSION)
    assert os.path.isdir(os.path.join(ROOT, "changelogs", "fragments"))


def _version_added():
    """(file, value) for every version_added in the plugins' documentation (modules, filter pages)."""
    for path in glob.glob(os.path.join(ROOT, "plugins", "modules", "*.py")) + \
            glob.glob(os.path.join(ROOT, "plugins", "filter", "*.yml")):
        for m in re.finditer(r"^\s*version_added:\s*[\"']?([^\"'\s]+)", open(path, encoding="utf-8").read(), re.M):
            yield os.path.relpath(path, ROOT), m.group(1)


def test_version_added_names_a_release_or_the_next_one():
    # antsibull-changelog lists a plugin as new in the release its version_added names: a version that was never
    # released and is not the next one (1.4.0 in a 0.1.0 collection) puts it under the wrong release.
    major, minor, _ = Version(VERSION).release
    allowed = {str(v) for v in yaml.safe_load(open(os.path.join(ROOT, "changelogs", "changelog.yaml")))["releases"]}
    allowed |= {VERSION, "%d.%d.0" % (major, minor + 1), "%d.0.0" % (major + 1)}
    seen = list(_version_added())
    assert len(seen) > 40
    assert not [(f, v) for f, v in seen if v not in allowed], allowed


@pytest.mark.parametrize("new, error", [
    ("0.2.0", None),
    ("1.0.0-rc.1", None),
    ("0.1.0", "not newer"),
    ("0.0.9", "not newer"),
    ("0.2", "not a semantic version"),
    ("v0.2.0", "not a semantic version"),
    ("", "not a semantic version"),
])
def test_a_release_sets_only_the_version_line(new, error):
    text = "# keep me\nnamespace: gpufleet\nname: fleet\nversion: 0.1.0  # a comment goes\nreadme: README.md\n" \
           "dependencies: {}\n"
    if error:
        with pytest.raises(release_version.ReleaseError, match=error):
            release_version.set_version(text, new)
        return
    out = release_version.set_version(text, new)
    assert out == text.replace("version: 0.1.0  # a comment goes", "version: " + new)
    assert str(yaml.safe_load(out)["version"]) == new


def test_a_refused_release_changes_nothing(tmp_path):
    # the script as make changelog runs it, on a copy of galaxy.yml: refused, the file is byte for byte the same
    script = os.path.join(ROOT, "tests", "support", "release_version.py")
    text = open(os.path.join(ROOT, "galaxy.yml"), encoding="utf-8").read()
    probe = tmp_path / "release_version.py"
    probe.write_text(open(script).read().replace(
        'GALAXY = os.path.join(ROOT, "galaxy.yml")', 'GALAXY = %r' % str(tmp_path / "galaxy.yml")))
    (tmp_path / "galaxy.yml").write_text(text)
    res = subprocess.run([sys.executable, str(probe), VERSION], capture_output=True, text=True)
    assert res.returncode != 0 and "not newer" in res.stderr and "nothing changed" in res.stderr
    assert (tmp_path / "galaxy.yml").read_text() == text
    ok = subprocess.run([sys.executable, str(probe), "%d.%d.0" % (Version(VERSION).major, Version(VERSION).minor + 1)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    after = (tmp_path / "galaxy.yml").read_text()
    assert [a for a, b in zip(after.splitlines(), text.splitlines()) if a != b] == \
        ["version: %d.%d.0" % (Version(VERSION).major, Version(VERSION).minor + 1)]


def test_indent_sequences_moves_only_whitespace_and_the_filter_pages_need_none():
    import indent_sequences
    old = ("DOCUMENTATION:\n  name: x\n  description:\n  - 'first: a long line\n    continued'\n  - second\n"
           "  options:\n    _input:\n      description:\n      - the input.\n      type: dict\n"
           "EXAMPLES: |\n  - not: a sequence, a literal\n")
    new = indent_sequences.indent_sequences(old)
    assert yaml.safe_load(new) == yaml.safe_load(old)
    assert new.split() == old.split()  # the same tokens: only indentation moved
    assert "\n    - 'first: a long line\n      continued'\n    - second\n" in new
    assert "\n        - the input.\n      type: dict\n" in new
    assert new.endswith("EXAMPLES: |\n  - not: a sequence, a literal\n")
    assert indent_sequences.indent_sequences(new) == new
    # every filter page is written the way ansible-lint wants already (make lint)
    for path in glob.glob(os.path.join(ROOT, "plugins", "filter", "*.yml")):
        text = open(path, encoding="utf-8").read()
        assert indent_sequences.indent_sequences(text) == text, path
