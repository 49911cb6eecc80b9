#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: put NCCL (and other) environment variables into SGLang's _set_envs_and_config().
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_nccl_patch
short_description: Make environment variables reach every SGLang TP worker by patching _set_envs_and_config()
description:
  - SGLang's C(_set_envs_and_config) writes environment variables itself (for example
    C(CUDA_DEVICE_MAX_CONNECTIONS) always, C(NCCL_CUMEM_ENABLE) and C(NCCL_NVLS_ENABLE) always up to 0.5.4),
    overwriting values exported before the launch; TP workers are spawned afterwards and inherit the result.
  - This module inserts one managed block of C(os.environ[NAME] = VALUE) lines into that function in every file
    of the installed C(sglang) package that defines it, just before the function's own top-level
    C(mp.set_start_method(...)) statement, whatever its arguments (V("spawn") up to 0.5.23,
    C(envs.SGLANG_MP_START_METHOD.get()) or a variable after it). No environment write follows that statement in
    any release, so the block's values are the ones the workers see. A function without such a statement gets
    the block at the end of its body (before a final C(return)).
  - The whole package is searched (a text pre-filter, then C(ast) on the few files that name the function), finding
    C(sglang/srt/entrypoints/engine.py) from 0.4.1.post7, C(sglang/srt/server.py) up to 0.4.1.post6 (0.4.1.post7
    to 0.4.5 ship a C(server.py) that only re-exports, and is skipped), and, on SGLang's development branch after
    0.5.23, also C(sglang/srt/entrypoints/worker_launch.py), whose copy runs instead of engine.py's when
    C(SGLANG_PRESPAWN_WORKERS=1). The search adds about 100 ms on 0.5.23's 4,717 files (RV(scan)).
  - The module refuses, naming the file and line and changing no file, a function whose shape is ambiguous (two
    such statements, one nested in a branch, loop, C(with) or C(try), or a C(return) before the insertion point).
  - Every file gets the same guarantees; all are planned and compiled before the first is written, and when a
    later write fails the files already written are put back.
  - The block sits between two marker lines (C(# BEGIN gpufleet managed block ...) and
    C(# END gpufleet managed block ...)), indented like the anchor statement, and is made of whole lines and
    nothing else, so O(state=absent) restores the original file byte for byte. Line endings follow the anchor
    line (CRLF files stay CRLF).
  - Values are written as ASCII-only Python string literals, so any text (quotes, backslashes, newlines,
    non-ASCII) arrives unchanged and the file always compiles. The new source is compiled before it replaces
    the file; the write goes to a temporary file in the same directory, is flushed to disk and renamed over
    the original, keeping mode and owner. Stale byte-code of the patched file (C(__pycache__)) is removed.
  - The installed package is found without importing sglang (importing it loads torch and CUDA).
  - A running server is not affected; the values apply from the next start.
version_added: "0.1.0"
author:
  - gpufleet maintainers (!UNKNOWN)
options:
  path:
    description:
      - One file to patch (it must define C(_set_envs_and_config)); only this file is changed.
      - Mutually exclusive with O(python). One of them is required.
    type: path
  python:
    description:
      - Interpreter whose sglang to patch, usually the SGLang virtualenv's python (inventory C(sglang_python)).
      - The module runs the interpreter with C(-c) and a short script that calls C(importlib.util.find_spec) for V(sglang) (no import of sglang)
        to find the package and reads the release from C(sglang/_version.py), C(sglang/version.py) or the
        C(dist-info) METADATA.
    type: path
  env:
    description:
      - Variable name to value. Names must match C(^[A-Za-z_][A-Za-z0-9_]*$).
      - Values must be strings or integers (integers are written in decimal). Booleans, floats, lists,
        mappings and null are refused, because their string form is ambiguous (C(true) could mean C(1),
        C(True) or C(true)); quote the value you mean in YAML, for example V('1').
      - Values must not contain NUL (the environment cannot hold it) or lone surrogates.
      - "Values of the NCCL variables whose syntax NCCL fixes are checked against what NCCL accepts (read from
        its parsers): C(NCCL_PROTO) and C(NCCL_ALGO) (a comma-separated list of known names, C(^) to exclude,
        or C(AllReduce:LL128;Broadcast:Simple) per collective, NCCL 2.24+), C(NCCL_P2P_LEVEL) and
        C(NCCL_NET_GDR_LEVEL) (C(LOC), C(NVL), C(NVB), C(C2C), C(PIX), C(PXB), C(P2C), C(PXN), C(PHB), C(SYS) in
        capitals, or a number), C(NCCL_NTHREADS) (a multiple of 32 from 64 to 512), C(NCCL_DEBUG) (a log
        level), and the integer parameters such as C(NCCL_MAX_NCHANNELS), C(NCCL_MIN_NCHANNELS),
        C(NCCL_BUFFSIZE), C(NCCL_NVLS_ENABLE), C(NCCL_CUMEM_ENABLE) (a plain integer, decimal or C(0x) hex;
        counts and sizes 1 or more). NCCL itself refuses a bad C(NCCL_PROTO)/C(NCCL_ALGO) only when the workers
        start, and quietly replaces the others by a default or by C(0). Other variables are not checked. A name
        that spells C(NCCL_...) in other than capitals (C(nccl_proto)) is refused too, O(unchecked) or not: NCCL reads
        only C(NCCL_PROTO)."
      - Written in name order. An empty mapping with O(state=present) leaves no block (same as O(state=absent)).
      - Any invalid name or value fails the module before the file is read or changed.
    type: dict
    default: {}
  unchecked:
    description:
      - Names in O(env) whose value is written without the check above, for an NCCL release that accepts a
        value this module does not know (for example a new C(NCCL_ALGO) name). Inventory
        C(sglang_nccl_env_unchecked).
      - Such a value that the check would have refused is still written, with a warning that says why (printed
        at every verbosity, in the result's C(warnings)).
    type: list
    elements: str
    default: []
  state:
    description:
      - V(present) inserts or replaces the managed block; V(absent) removes it, restoring the original bytes.
    type: str
    choices: [present, absent]
    default: present
  backup:
    description:
      - Keep a copy of the file (C(<path>.<pid>.<timestamp>~)) before changing it.
    type: bool
    default: false
  previous_file:
    description:
      - "Right before the file is changed, write its current bytes to this path (for a rollback to put back).
        Written atomically (temporary file and rename) with the mode of the file; its parent directory is
        created (0755) when missing. Nothing is written when the file needs no change, nor in check mode."
      - "Written by the same user as the patch (C(become) of the task). When the copy cannot be written the
        module fails before the file is touched (RV(previous) is null, the file unchanged)."
      - Only for one file. When more than one file would change the module fails before writing any (use
        O(previous_dir) then). Mutually exclusive with O(previous_dir).
    type: path
  previous_dir:
    description:
      - "Like O(previous_file), for every file that changes: its bytes go to
        C(<previous_dir>/<path inside the package with dots>.prev), for example
        C(srt.entrypoints.engine.py.prev); RV(files) names each copy and its SHA-256. C(restart.yml) uses
        C(<sglang_state_dir>/nccl-patch-prev). When a copy cannot be written no file is changed."
    type: path
  hand_edits:
    description:
      - "What to do with a hand-typed environment write of a variable of O(env), anywhere in
        C(_set_envs_and_config) outside the block: C(os.environ[NAME] = v), C(os.environ.setdefault),
        C(os.putenv), C(os.environ.update), C(del os.environ[NAME]), C(os.environ.pop), C(os.unsetenv), also through
        C(environ) imported from C(os) or C(os) under another name. SGLang's own writes in that function (every
        release from 0.3.6 to 0.5.23 and the development branch after it) are not hand edits."
      - "V(refuse): fail, changing no file (check mode too, so preflight refuses before anything stops), naming
        each file, line and its text. One after the function's C(set_start_method) statement would override the
        block's value; one before it would come back when the variable leaves O(env)."
      - "V(take_over): remove those lines and write the block. Each removed line is recorded in the block (its
        number and exact text), so O(state=absent) puts it back: the file is again byte for byte what it was
        before the patch first touched it (as the O(backup) copy holds it). RV(hand_edits) lists the lines taken
        over. A line that shares its line with other code, is the only statement of a branch, or also writes a
        variable O(env) does not set is refused, naming it."
      - "Hand-typed writes of variables not in O(env) are left as they are and only listed in RV(hand_edits)."
    type: str
    choices: [refuse, take_over]
    default: refuse
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reports what would change and returns the diff; the file is not written.
  diff_mode:
    support: full
    details: Returns the file before and after.
  platform:
    support: full
    platforms: posix
notes:
  - The module refuses a file whose managed block is malformed (a BEGIN marker without END, END before BEGIN,
    or more than one block); fix or remove the markers by hand, or reinstall the sglang wheel.
  - If no file defines C(_set_envs_and_config), or its shape is ambiguous, the module fails naming the file, the
    line, the sglang release and what was looked for, and leaves every file as it was.
  - The module parses SGLang's source with the Python that runs the module; run it with
    C(ansible_python_interpreter) set to the SGLang virtualenv's python (or a Python at least as new).
  - Reinstalling or upgrading sglang replaces the file and removes the block; run the module again afterwards.
  - "Before writing (and in check mode) the module checks that the patched copy of each file, its backup
    (O(backup)) and its rollback copy (O(previous_dir)) fit on their filesystems (statvfs, with 64 KiB to spare)
    and fails naming the filesystem, the bytes needed and free. Every temporary file is removed when a write fails."
seealso:
  - name: SGLang _set_envs_and_config (0.5.23)
    description: Where SGLang sets its own environment before spawning workers.
    link: https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/entrypoints/engine.py
  - name: SGLang worker_launch.py (development branch after 0.5.23)
    description: The copy of the function run when C(SGLANG_PRESPAWN_WORKERS=1).
    link: https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/entrypoints/worker_launch.py
"""

EXAMPLES = r"""
- name: Put NCCL tuning into the SGLang of the server's virtualenv
  gpufleet.fleet.sglang_nccl_patch:
    python: /opt/sglang/venv/bin/python
    env:
      NCCL_IB_HCA: mlx5
      NCCL_MIN_NCHANNELS: 16
      CUDA_DEVICE_MAX_CONNECTIONS: "1"
    backup: true

- name: Patch, keeping each changed file's bytes for a rollback
  gpufleet.fleet.sglang_nccl_patch:
    python: "{{ sglang_python }}"
    env: "{{ sglang_nccl_env }}"
    previous_dir: /var/lib/gpufleet/nccl-patch-prev

- name: Patch one explicit file only (an editable install in a container image)
  gpufleet.fleet.sglang_nccl_patch:
    path: /sgl-workspace/sglang/python/sglang/srt/entrypoints/engine.py
    env: "{{ sglang_nccl_env }}"

- name: A per-collective NCCL_ALGO of NCCL 2.24+, and a new algorithm name this module does not know yet
  gpufleet.fleet.sglang_nccl_patch:
    python: "{{ sglang_python }}"
    env:
      NCCL_ALGO: "AllReduce:NVLSTree,Ring;AllGather:MyNewAlgo"
      NCCL_PROTO: "^LL128"
    unchecked: [NCCL_ALGO]

- name: Show what would change without writing (preflight)
  gpufleet.fleet.sglang_nccl_patch:
    python: "{{ sglang_python }}"
    env: "{{ sglang_nccl_env }}"
  check_mode: true
  register: nccl_patch_plan

- name: Remove the managed block, restoring SGLang's original file
  gpufleet.fleet.sglang_nccl_patch:
    python: "{{ sglang_python }}"
    state: absent
"""

RETURN = r"""
path:
  description: The first file of RV(paths) (C(srt/entrypoints/engine.py) in every release up to 0.5.23).
  returned: always
  type: str
  sample: /opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py
paths:
  description:
    - Every file that defines C(_set_envs_and_config) and is patched, engine.py first (only O(path) when given).
  returned: always
  type: list
  elements: str
  sample: [/opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py,
           /opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/worker_launch.py]
files:
  description:
    - One entry per file of RV(paths), in that order; empty when the module failed before reading them (a bad
      O(env), no sglang found).
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The file.
      type: str
    relative:
      description: Its path inside the sglang package (C(srt/entrypoints/engine.py)); null outside a package.
      type: str
    changed:
      description: Whether this file was (or, in check mode, would be) changed.
      type: bool
    line:
      description: 1-based first line of the block after the run; null without a block.
      type: int
    placement:
      description:
        - Where the block goes. V(start_method) before the function's C(set_start_method) statement,
          V(final_return) before its final C(return), V(end_of_body) after its last statement; null without a block.
      type: str
    block:
      description:
        - What the file held before the run. V(none) no managed block, V(same) a block setting exactly O(env),
          V(other) a block setting other values.
      type: str
    block_env:
      description: The variables the block held before the run (name to value); null without a block.
      type: dict
    mtime:
      description: Modification time of the file after the run (Unix time, host clock).
      type: float
    sha256:
      description: Hex SHA-256 of the file's bytes after the run (in check mode, as they are now).
      type: str
    backup_file:
      description: The backup copy (O(backup)), or null.
      type: str
    previous_file:
      description:
        - Where its bytes before the change were kept (O(previous_file) or O(previous_dir)), or null; in check
          mode where they would be kept.
      type: str
    previous_sha256:
      description: Hex SHA-256 of the bytes in RV(files[].previous_file) (in check mode of the file's bytes now), or null.
      type: str
    error:
      description:
        - Only in a failure result, for a file the module refuses (an ambiguous shape, unreadable), what is wrong;
          such an entry has only C(path), C(relative) and C(error). The other files' entries are complete, so a
          caller can still judge them; no file was changed.
      type: str
scan:
  description:
    - The package search with O(python) (null with O(path)). C(files_scanned) .py files read, C(files_parsed)
      of them named the function and were parsed, C(scan_ms) milliseconds it took.
  returned: always
  type: dict
  sample: {files_scanned: 4717, files_parsed: 2, scan_ms: 61.3}
sglang_version:
  description: The sglang release the file belongs to, read without importing sglang; null if unknown.
  returned: always
  type: str
  sample: 0.5.23
version_source:
  description: Where the release was read (a C(_version.py), C(version.py) or C(METADATA) path, or C(importlib.metadata)).
  returned: always
  type: str
  sample: /opt/sglang/venv/lib/python3.11/site-packages/sglang/_version.py
changed:
  description: Whether any file was (or, in check mode, would be) changed.
  returned: always
  type: bool
line:
  description:
    - 1-based line where the managed block starts in RV(path) after the run; null when no block is present (V(absent) or empty env).
  returned: always
  type: int
  sample: 341
env:
  description: The variables the block sets (name to string value), in the order written. Empty with V(absent).
  returned: always
  type: dict
  sample: {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_IB_HCA": "mlx5"}
sha256:
  description:
    - "Hex SHA-256 of RV(path)'s bytes after the run (in check mode: as they are now, nothing was written);
      null when the module failed before reading the file. The launch record keeps it as C(engine_sha256)."
  returned: always
  type: str
  sample: 3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855a
previous:
  description:
    - "What O(previous_file) holds, when the module wrote it (with O(previous_dir): RV(files[].previous_file)): C(path) (the file patched), C(previous_file),
      C(sha256) (hex SHA-256 of the bytes kept there, which are the file's bytes before this change). Null
      when O(previous_file) is unset, the file needed no change, or in check mode. Also set in the failure
      result when the copy was written and the write of the file then failed (the file is unchanged)."
  returned: always
  type: dict
  sample: {path: /opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py,
           previous_file: /var/lib/gpufleet/engine.py.prev, sha256: 9f2c...e1}
backup_file:
  description: Path of RV(path)'s backup copy when O(backup=true) and it changed; null otherwise (RV(files) has each file's).
  returned: always
  type: str
  sample: /opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py.4242.2026-11-29@20:15:02~
diff:
  description: The file before and after (diff mode); a list of such entries when several files define the function.
  returned: when diff mode is on
  type: raw
  contains:
    before:
      description: File content before.
      type: str
    after:
      description: File content after.
      type: str
hand_edits:
  description:
    - "Hand-typed environment writes in C(_set_envs_and_config) outside the block, SGLang's own writes left out.
      C(action): V(refused) (a variable of O(env), O(hand_edits=refuse)), V(taken_over) (removed by this run),
      V(kept) (taken over by an earlier run, still recorded in the block), V(reported) (a variable not in O(env):
      left as it is)."
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The file.
      type: str
    line:
      description:
        - 1-based line of the statement in the file as it is before this run (its block counted); for V(kept), the
          line it had before it was taken over.
      type: int
    text:
      description: The statement's first line, stripped.
      type: str
    names:
      description: The variables it writes (null for a name computed at run time).
      type: list
      elements: str
    after_anchor:
      description: Whether it comes after the function's C(set_start_method) statement (it would override the block).
      type: bool
    action:
      description: V(refused), V(taken_over), V(kept) or V(reported).
      type: str
  sample: [{path: /opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py, line: 1950,
            text: "os.environ[\"NCCL_PROTO\"] = \"Simple\"", names: [NCCL_PROTO], after_anchor: true,
            action: refused}]
msg:
  description: On failure, what was wrong and what to do (names the file, the sglang release and what was looked for).
  returned: failure
  type: str
"""

import errno
import gc
import hashlib
import os
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl_check import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    SPACE_MARGIN_BYTES,
    filesystem_of,
    space_needs,
    space_problems,
    unchecked_warnings,
    write_refusal,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_hand_edits import HAND_EDIT_MODES
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import FUNCTION_NAME
# The plan (what each file holds, what the patch makes of it) is module_utils' (check.yml reads it too).
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl_plan import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    BEGIN_HINT,
    BEGIN_MARKER,
    END_MARKER,
    NAME_RE,
    HandEditRefused,
    PatchError,
    file_result,
    find_block,
    hand_edit_message,
    normalise_env,
    plan_block,
    plan_files,
    plan_patch,
    previous_name,
    read_block_env,
    refused_message,
    render_block,
)


def _synced_temp(directory, path, data):
    """Write ``data`` (bytes) to a new temporary file in ``directory`` named after ``path``, fsynced; returns its
    path (the caller renames it into place or removes it). Raises OSError; a half-written file is removed."""
    fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(path), suffix=".gpufleet-tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_atomic(module, path, data):
    """Replace ``path`` with ``data`` (bytes): temporary file in the same directory, fsync, rename.

    ``module.atomic_move`` keeps the original's mode, owner and SELinux context.
    """
    directory = os.path.dirname(path)
    tmp = _synced_temp(directory, path, data)
    try:
        module.atomic_move(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass  # best effort: some filesystems refuse fsync on a directory


def backup_name(path, pid=None, now=None):
    """``<path>.<pid>.<YYYY-mm-dd@HH:MM:SS>~``, the name Ansible's ``backup_local`` gives a backup."""
    return "%s.%s.%s" % (path, pid or os.getpid(), time.strftime("%Y-%m-%d@%H:%M:%S~", time.localtime(now)))


def write_backup(path, raw):
    """Keep ``raw`` (the bytes of ``path`` now) as ``path``'s backup (:func:`backup_name`) with its mode, owner and
    times; returns the backup's path. Written to a temporary file and renamed, so a full disk leaves nothing
    behind (Ansible's ``backup_local`` leaves a partial or 0-byte copy under the final name). Raises OSError."""
    dest = backup_name(path)
    stat = os.stat(path)
    tmp = _synced_temp(os.path.dirname(path) or ".", dest, raw)
    try:
        os.chmod(tmp, stat.st_mode & 0o7777)
        try:
            os.chown(tmp, stat.st_uid, stat.st_gid)
        except OSError:
            pass  # not root: the copy is the patch user's, like the patched file itself
        os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def keep_previous(source_path, raw, previous_file):
    """Write ``raw`` (bytes: the current content of ``source_path``) to ``previous_file`` atomically, with the
    mode of ``source_path``; creates the parent directory (0755) when missing.

    Returns ``{"path", "previous_file", "sha256"}`` (sha256: hex of ``raw``). Raises OSError when the copy
    cannot be written (nothing is left behind but an existing older copy).
    """
    directory = os.path.dirname(previous_file) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, 0o755)
    mode = os.stat(source_path).st_mode & 0o7777
    tmp = _synced_temp(directory, previous_file, raw)
    try:
        os.chmod(tmp, mode)
        os.replace(tmp, previous_file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"path": source_path, "previous_file": previous_file, "sha256": hashlib.sha256(raw).hexdigest()}


def remove_stale_bytecode(path):
    """Delete ``__pycache__/<stem>.*.pyc`` of ``path``; returns the removed paths (list of str).

    Python validates a cached .pyc by source mtime (whole seconds) and size; two patches of equal length in
    the same second would otherwise leave the old byte-code in use. Errors are ignored (Python then simply
    recompiles or runs without a cache).
    """
    cache = os.path.join(os.path.dirname(path), "__pycache__")
    stem = os.path.splitext(os.path.basename(path))[0]
    removed = []
    try:
        names = os.listdir(cache)
    except OSError:
        return removed
    for name in names:
        if name.startswith(stem + ".") and name.endswith(".pyc"):
            try:
                os.unlink(os.path.join(cache, name))
                removed.append(os.path.join(cache, name))
            except OSError:
                pass
    return removed


def run_module():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path"),
            python=dict(type="path"),
            env=dict(type="dict", default={}),
            unchecked=dict(type="list", elements="str", default=[]),
            state=dict(type="str", default="present", choices=["present", "absent"]),
            backup=dict(type="bool", default=False),
            previous_file=dict(type="path"),
            previous_dir=dict(type="path"),
            hand_edits=dict(type="str", default="refuse", choices=list(HAND_EDIT_MODES)),
        ),
        mutually_exclusive=[["path", "python"], ["previous_file", "previous_dir"]],
        required_one_of=[["path", "python"]],
        supports_check_mode=True,
    )
    params = module.params
    result = dict(changed=False, path=params["path"], paths=[params["path"]] if params["path"] else [],
                  files=[], sglang_version=None, version_source=None, scan=None,
                  line=None, env={}, backup_file=None, previous=None, sha256=None, hand_edits=[])

    def run(argv):
        return module.run_command(argv, environ_update={"LC_ALL": "C", "LANG": "C"}, cwd="/")

    # The same plan check.yml reads (module_utils gpufleet_nccl_plan): every file judged, none written.
    # here: when the module runs on the SGLang interpreter, SGLang is found in this process.
    plan = plan_block(params["python"], params["path"], params["env"], params["unchecked"], params["state"],
                      params["hand_edits"], run, here=True)
    result.update(plan["result"])
    items = plan["items"]
    if items:
        # A value let through by unchecked is written, but said at every verbosity: it is what NCCL's own parser
        # (as gpufleet knows it) would refuse or misread.
        for warning in unchecked_warnings(items, params["unchecked"]):
            module.warn(warning)
    if result.pop("failed", False):
        module.fail_json(**result)
    planned = plan["planned"]
    release = "sglang %s" % (result["sglang_version"] or "version unknown")

    def keep_path(entry):
        return params["previous_file"] or (
            os.path.join(params["previous_dir"], previous_name(entry)) if params["previous_dir"] else None)

    changing = [entry for entry in planned if entry["plan"]["changed"]]
    if module.check_mode:
        # Where each copy would go and what it would hold (nothing is written): a caller that copies the files
        # as another user (roles/sglang_nccl_patch/tasks/previous.yml) uses the module's own naming.
        for entry in changing:
            entry["previous_file"] = keep_path(entry)
            entry["previous_sha256"] = hashlib.sha256(entry["raw"]).hexdigest() if entry["previous_file"] else None
    first = planned[0]
    result.update(changed=bool(changing), line=first["plan"]["line"],
                  env=dict(items) if any(e["plan"]["line"] for e in planned) else {})
    result["files"] = [file_result(entry, False) for entry in planned]
    if module._diff:
        diffs = [{"before": e["text"], "after": e["plan"]["after"], "before_header": e["path"],
                  "after_header": e["path"]} for e in planned]
        result["diff"] = diffs[0] if len(diffs) == 1 else diffs

    refusal = write_refusal(changing, params["backup"], keep_path, release)
    if refusal:
        module.fail_json(msg=refusal, **result)
    if params["previous_file"] and len(changing) > 1:
        module.fail_json(msg="%d files of %s define %s() and would change (%s): one previous_file cannot keep them "
                             "all; use previous_dir. No file was changed."
                             % (len(changing), release, FUNCTION_NAME, ", ".join(e["path"] for e in changing)),
                         **result)

    if changing and not module.check_mode:
        written = []
        for entry in changing:
            path = entry["path"]
            keep = keep_path(entry)
            if keep:
                try:
                    kept = keep_previous(path, entry["raw"], keep)
                except (IOError, OSError) as exc:
                    _undo(module, written)
                    result["files"] = [file_result(e, e in written) for e in planned]
                    module.fail_json(msg="cannot keep the current bytes of %s (%s) in %s for a rollback: %s. No file "
                                         "is changed; make that directory writable for the user the patch runs as "
                                         "(sglang_nccl_patch_become)." % (path, release, keep, exc), **result)
                entry["previous_file"], entry["previous_sha256"] = keep, kept["sha256"]
                if params["previous_file"]:
                    result["previous"] = kept
            try:
                if params["backup"]:
                    entry["backup_file"] = write_backup(path, entry["raw"])
                write_atomic(module, path, entry["data"])
            except (IOError, OSError) as exc:
                undone = _undo(module, written)
                # A backup of a file that ends as it was is only clutter (and what filled the disk, perhaps).
                for other in [entry] + undone:
                    if other.get("backup_file"):
                        try:
                            os.unlink(other["backup_file"])
                        except OSError:
                            pass
                        other["backup_file"] = None
                result["files"] = [file_result(e, e in written and e not in undone) for e in planned]
                module.fail_json(msg="cannot write %s (%s): %s. %s; %s."
                                 % (path, release, exc, "No file is changed" if len(undone) == len(written) else
                                    "The files written before it could not all be put back: %s"
                                    % ", ".join(e["path"] for e in written if e not in undone),
                                    write_error_hint(exc)), **result)
            written.append(entry)
            remove_stale_bytecode(path)
            try:
                entry["mtime"] = os.stat(path).st_mtime
            except OSError:
                pass
        result["files"] = [file_result(e, e in written) for e in planned]
    result["sha256"] = result["files"][0]["sha256"]
    result["backup_file"] = result["files"][0]["backup_file"]
    module.exit_json(**result)


def write_error_hint(exc):
    """What to do about a failed write (an OSError), by its errno."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the filesystem (or the user's quota) is full: free space there and rerun; no temporary file is left"
    if exc.errno == errno.EROFS:
        return "the filesystem is read-only: remount it read-write, or put the block into the image it comes from"
    return "if it belongs to another user set become (sglang_nccl_patch_become: true)"


def _undo(module, written):
    """Put back the original bytes of the files already written in this call (a later file failed); returns
    the entries put back. Their previous copies stay (a rollback finds the file equal to them: nothing to do)."""
    undone = []
    for entry in reversed(written):
        try:
            write_atomic(module, entry["path"], entry["raw"])
            remove_stale_bytecode(entry["path"])
            entry["mtime"] = os.stat(entry["path"]).st_mtime
            undone.append(entry)
        except (IOError, OSError):
            pass
    return undone


def main():
    run_module()


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
