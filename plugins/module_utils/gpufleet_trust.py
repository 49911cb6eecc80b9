# -*- coding: utf-8 -*-
# gpufleet: which files on a host gpufleet may trust (issue 31): state files root reads and writes, and the code
# root runs (an interpreter and what it loads at start).
"""Ownership and modes of the paths gpufleet trusts, judged the way sshd's StrictModes judges ~/.ssh.

A path is trusted by a user when no other user can change what it holds or what it names:

* the path itself (when it exists) belongs to a trusted user (root, or the user gpufleet runs as there) and is not
  writable by group or others (``mode & 0o022``);
* every directory above it belongs to a trusted user and is not writable by group or others, except that a
  directory with the sticky bit (``/tmp``) may be writable by others: the kernel lets only the owner of an entry
  (or of the directory, trusted here) rename or remove it, so nobody else can replace the trusted entry below it.
  sshd's ``safe_path()`` has no such exception; without it every state directory or virtualenv under ``/tmp`` (the
  lab's) would be refused for a risk the kernel already rules out;
* a path that does not exist yet (a first run) is fine, unless its nearest existing directory is writable by group
  or others even with the sticky bit: another user could create it first, and gpufleet would then use theirs;
* symbolic links are followed: the link's own directory chain and owner are judged, and so is the chain of what it
  resolves to (the real path), since either can be swapped.

Groups are not trusted (StrictModes neither): a group-writable directory is writable by every member, and which
users those are is not known here.

Nothing here runs the interpreter it judges, reads more than ``pyvenv.cfg`` and ``.pth`` files, or needs Ansible.
"""
from __future__ import annotations

import glob
import os
import pwd
import re
import stat

MAX_PTH_BYTES = 1 << 16


def owner_name(uid):
    """The user name of ``uid`` (str), or the number as text when the host has no such user."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _problem(path, st, reason):
    return {"path": path, "uid": st.st_uid if st else None, "owner": owner_name(st.st_uid) if st else None,
            "mode": ("%04o" % stat.S_IMODE(st.st_mode)) if st else None, "reason": reason}


def _components(path):
    """``/a/b/c`` -> ``["/", "/a", "/a/b", "/a/b/c"]``."""
    parts = [p for p in path.split("/") if p]
    return ["/"] + ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def _chain_problems(path, trusted_uids, lstat):
    """Problems of one chain (``path`` absolute and normalised), each component judged by :func:`lstat`."""
    problems = []
    components = _components(path)
    parent = None
    for component in components:
        is_target = component == components[-1]
        try:
            st = lstat(component)
        except FileNotFoundError:
            if parent is not None and stat.S_IMODE(parent[1].st_mode) & 0o022:
                problems.append(_problem(parent[0], parent[1],
                                         "%s does not exist, and this directory is writable by group or others: "
                                         "another user could create it first" % path))
            return problems
        except OSError as exc:
            problems.append(_problem(component, None, "cannot be examined: %s" % exc.strerror))
            return problems
        if st.st_uid not in trusted_uids:
            problems.append(_problem(component, st, "belongs to another user"))
        elif stat.S_ISLNK(st.st_mode):
            pass  # a link's own mode means nothing; what it names is judged on the real chain
        elif stat.S_IMODE(st.st_mode) & 0o022 and (is_target or not st.st_mode & stat.S_ISVTX):
            problems.append(_problem(component, st, "is writable by group or others"))
        parent = (component, st)
    return problems


def path_problems(path, trusted_uids, lstat=os.lstat, realpath=os.path.realpath):
    """Why ``path`` (str) cannot be trusted by ``trusted_uids`` (set of int), per the module's docstring.

    Returns a list of dicts ``{path, uid, owner, mode, reason}`` (``path``: the component at fault; empty list: the
    path can be trusted, or does not exist in a directory only trusted users can write). ``lstat``/``realpath``
    are injectable for tests.
    """
    path = os.path.normpath(os.path.abspath(path))
    problems = _chain_problems(path, trusted_uids, lstat)
    real = os.path.normpath(realpath(path))
    if real != path:
        seen = {p["path"] for p in problems}
        problems += [p for p in _chain_problems(real, trusted_uids, lstat) if p["path"] not in seen]
    return problems


def _entry_problems(directory, trusted_uids, lstat, listdir):
    """Top-level entries of ``directory`` another user owns or can write (each one an importable name)."""
    problems = []
    try:
        names = sorted(listdir(directory))
    except OSError:
        return problems
    for name in names:
        entry = os.path.join(directory, name)
        try:
            st = lstat(entry)
        except OSError:
            continue
        if st.st_uid not in trusted_uids:
            problems.append(_problem(entry, st, "belongs to another user"))
        elif not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o022:
            problems.append(_problem(entry, st, "is writable by group or others"))
    return problems


def _pyvenv_cfg(venv_root):
    """``pyvenv.cfg`` of a virtualenv as a dict of lower-case keys, or None when ``venv_root`` is none."""
    cfg = os.path.join(venv_root, "pyvenv.cfg")
    try:
        with open(cfg) as handle:
            text = handle.read(MAX_PTH_BYTES)
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip().lower()] = value.strip()
    return values


def _pth_dirs(site_dir):
    """Directories the ``.pth`` files of ``site_dir`` add to ``sys.path`` (``site.addpackage``'s rules)."""
    dirs = []
    for pth in sorted(glob.glob(os.path.join(glob.escape(site_dir), "*.pth"))):
        try:
            with open(pth) as handle:
                text = handle.read(MAX_PTH_BYTES)
        except (OSError, UnicodeDecodeError):
            continue
        for line in text.splitlines():
            line = line.rstrip()
            if not line or line.startswith("#") or line.startswith(("import ", "import\t")):
                continue  # an import line runs code, which comes from sys.path: judged there
            target = os.path.normpath(os.path.join(site_dir, line))
            if os.path.isdir(target) and target not in dirs:
                dirs.append(target)
    return dirs


def _version_of(name):
    match = re.match(r"^python(\d+\.\d+)", name)
    return match.group(1) if match else None


def interpreter_paths(python, realpath=os.path.realpath):
    """Where interpreter ``python`` (str path) takes the code it runs at start, found without running it.

    Returns ``{"chains": [...], "entries": [...]}``: paths whose chain (the path and every directory above it) must
    be trusted, and directories whose top-level entries must be too (each is a name ``import`` may load, and a
    ``.pth`` file among them runs at every start: site.py reads every ``*.pth`` in each site directory).

    * the interpreter as given (a virtualenv's ``bin/python`` is usually a link: its ``bin/`` can swap it) and the
      file it resolves to;
    * a virtualenv's root (``<root>/pyvenv.cfg`` beside ``bin/``, read at start: ``home``,
      ``include-system-site-packages``) and its ``lib*/pythonX.Y/site-packages``;
    * the base installation's standard library (``<prefix>/lib/pythonX.Y``, where ``prefix`` is two levels above
      the real interpreter file: ``os``, ``site``, ``encodings`` load from there), and its site directories
      (``site-packages``, Debian's ``dist-packages``) when they are read: no virtualenv, or one that includes the
      system site packages;
    * every directory a ``.pth`` file of those site directories adds to ``sys.path``.

    X.Y comes from the real file's name (``python3.11``) where it says, else every ``python3*`` directory is taken.
    Deeper files (a package's own modules) are not walked: a tree like torch holds tens of thousands, and a
    directory chain nobody else can write, with top-level entries nobody else owns, is what a root-owned install
    leaves. root's user site (``~root/.local``) is root's own.
    """
    python = os.path.normpath(os.path.abspath(python))
    real = os.path.normpath(realpath(python))
    chains, entries = [python], []
    if real != python:
        chains.append(real)
    version = _version_of(os.path.basename(real)) or _version_of(os.path.basename(python))
    pattern = ("python" + version) if version else "python3*"
    bin_dir = os.path.dirname(python)
    venv_root = os.path.dirname(bin_dir)
    cfg = _pyvenv_cfg(venv_root) if os.path.basename(bin_dir) == "bin" else None
    site_dirs = []
    if cfg is not None:
        chains.append(os.path.join(venv_root, "pyvenv.cfg"))
        site_dirs += sorted(glob.glob(os.path.join(glob.escape(venv_root), "lib*", pattern, "site-packages")))
    prefix = os.path.dirname(os.path.dirname(real))
    stdlib = sorted(d for d in glob.glob(os.path.join(glob.escape(prefix), "lib", pattern)) if os.path.isdir(d))
    entries += stdlib
    if cfg is None or cfg.get("include-system-site-packages", "false").lower() == "true":
        for sub in (os.path.join("lib", pattern, "site-packages"), os.path.join("lib", pattern, "dist-packages"),
                    os.path.join("lib", "python3", "dist-packages"),
                    os.path.join("local", "lib", pattern, "dist-packages")):
            site_dirs += sorted(glob.glob(os.path.join(glob.escape(prefix), sub)))
    for site_dir in site_dirs:
        real_site = os.path.normpath(realpath(site_dir))
        if real_site not in entries:
            entries.append(real_site)
        for extra in _pth_dirs(real_site):
            if extra not in entries:
                entries.append(extra)
    for directory in site_dirs + entries:
        if directory not in chains:
            chains.append(directory)
    return {"chains": chains, "entries": entries}


def interpreter_problems(python, trusted_uids=frozenset([0]), lstat=os.lstat, listdir=os.listdir,
                         realpath=os.path.realpath):
    """Why root must not run interpreter ``python``: paths other users own or can write (see
    :func:`interpreter_paths`). A list of ``{path, uid, owner, mode, reason}``, each path once; empty: trusted.

    A missing interpreter is a problem of its own (nothing to judge; the task running it would fail anyway)."""
    if not os.path.lexists(python):
        return [{"path": python, "uid": None, "owner": None, "mode": None, "reason": "does not exist"}]
    where = interpreter_paths(python, realpath=realpath)
    problems, seen = [], set()
    for path in where["chains"]:
        for problem in path_problems(path, trusted_uids, lstat=lstat, realpath=realpath):
            if problem["path"] not in seen:
                seen.add(problem["path"])
                problems.append(problem)
    for directory in where["entries"]:
        for problem in _entry_problems(directory, trusted_uids, lstat, listdir):
            if problem["path"] not in seen:
                seen.add(problem["path"])
                problems.append(problem)
    return problems


def describe(problem):
    """One phrase for a problem: ``/x/site-packages (owner sglang, mode 0755) belongs to another user``."""
    if problem.get("owner") is None:
        return "%s %s" % (problem["path"], problem["reason"])
    return "%s (owner %s, mode %s) %s" % (problem["path"], problem["owner"], problem["mode"], problem["reason"])


def root_code_check(variable, python):
    """An RV(root_code) entry for interpreter ``python`` (None when root may run it)."""
    problems = interpreter_problems(python)
    if not problems:
        return None
    text = ("%s %s runs as root, but %s: a .pth file or module another user puts there would run as root. Make "
            "that virtualenv root's (chown -R root: on it, writable by root only), or run gpufleet without become "
            "for it (sglang_nccl_patch_become=false, sglang_launch_method=process) with a virtualenv the login user "
            "owns" % (variable, python, "; ".join(describe(p) for p in problems[:5])
                      + ("; and %d more" % (len(problems) - 5) if len(problems) > 5 else "")))
    return {"variable": variable, "interpreter": python, "problems": problems, "text": text}
