# -*- coding: utf-8 -*-
# gpufleet: the checks sglang_nccl_patch makes before it writes (the patched source compiles; the copies fit on
# their filesystems), and its check-mode answer as a function: sglang_nccl_patch and sglang_preflight_info use
# the same code (space_needs, space_problems and filesystem_of moved here from sglang_nccl_patch, unchanged).
from __future__ import absolute_import, division, print_function

import os

from ansible.module_utils.common.text.converters import to_text
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl import env_value_problems
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl_plan import file_result, plan_block

# Room left beyond the bytes the patch writes (directory entries, metadata of the new files, a block rounding).
SPACE_MARGIN_BYTES = 64 * 1024


def space_needs(changing, backup, previous_for):
    """What the run writes, as ``(directory, bytes, what)``: for each changing file (planned entries) its patched
    copy beside it (written whole before the rename frees the old bytes), its backup when ``backup``, and its
    rollback copy in ``previous_for(entry)``'s directory (a path or None)."""
    needs = []
    for entry in changing:
        directory = os.path.dirname(entry["path"]) or "."
        name = os.path.basename(entry["path"])
        needs.append((directory, len(entry["data"]), "the patched copy of %s" % name))
        if backup:
            needs.append((directory, len(entry["raw"]), "the backup of %s" % name))
        previous = previous_for(entry)
        if previous:
            needs.append((os.path.dirname(previous) or ".", len(entry["raw"]), "the rollback copy of %s" % name))
    return needs


def space_problems(needs, stat_fs, margin=SPACE_MARGIN_BYTES):
    """Filesystems the writes in ``needs`` (:func:`space_needs`) do not fit on, in words (list of str).

    ``stat_fs(directory)`` gives ``{"device", "mount", "block", "free", "inodes"}`` (free bytes and inodes for the
    user the module runs as; :func:`filesystem_of`). Per filesystem the files' sizes, each rounded up to whole
    blocks, plus ``margin`` must fit in its free bytes, and one inode per file in its free inodes.
    """
    by_fs, order = {}, []
    for directory, size, what in needs:
        fs = stat_fs(directory)
        if fs["device"] not in by_fs:
            by_fs[fs["device"]] = {"fs": fs, "bytes": margin, "files": 0, "what": []}
            order.append(fs["device"])
        block = max(int(fs["block"] or 1), 1)
        entry = by_fs[fs["device"]]
        entry["bytes"] += -(-size // block) * block
        entry["files"] += 1
        entry["what"].append("%s, %d bytes" % (what, size))
    problems = []
    for device in order:
        entry = by_fs[device]
        fs = entry["fs"]
        if fs["free"] >= entry["bytes"] and (fs["inodes"] is None or fs["inodes"] >= entry["files"]):
            continue
        short = ("%d bytes free" % fs["free"]) if fs["free"] < entry["bytes"] else (
            "%d free inodes for %d new files" % (fs["inodes"], entry["files"]))
        problems.append("not enough room on the filesystem mounted at %s for the NCCL patch: it needs %d bytes (%s, "
                        "and %d bytes to spare) and has %s; free space there (or, when the backup is what does not "
                        "fit, turn it off: gpufleet_patch_backup=false for restart.yml, sglang_nccl_patch_backup=false)" % (
                            fs["mount"], entry["bytes"], "; ".join(entry["what"]), margin, short))
    return problems


def filesystem_of(directory):
    """``stat_fs`` for :func:`space_problems`: the filesystem of ``directory`` (or of its nearest existing parent,
    for a directory the run would create): ``device``, ``mount`` (its mount point), ``block`` (fragment size),
    ``free`` and ``inodes`` as the user running the module may use them (root may use the reserved blocks)."""
    path = os.path.abspath(directory)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    vfs = os.statvfs(path)
    root = os.geteuid() == 0
    mount = path
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return {"device": os.stat(path).st_dev, "mount": mount, "block": vfs.f_frsize or vfs.f_bsize,
            "free": (vfs.f_bfree if root else vfs.f_bavail) * (vfs.f_frsize or vfs.f_bsize),
            # A filesystem without an inode count (btrfs, some FUSE) reports 0 files in all.
            "inodes": (vfs.f_ffree if root else vfs.f_favail) if vfs.f_files else None}


def write_refusal(changing, backup, keep_path, release):
    """Why the patch would not write the planned ``changing`` entries, in words, or None: the patched source does
    not compile, or the copies (and the backup, and the rollback copy in ``keep_path(entry)``) do not fit."""
    for entry in changing:
        try:
            # Compile the exact bytes that will be written (the coding cookie, if any, is honoured).
            compile(entry["data"], entry["path"], "exec", dont_inherit=True)
        except SyntaxError as exc:
            return ("refusing to write %s (%s): the patched source does not compile (%s); no file was "
                    "changed" % (entry["path"], release, to_text(exc)))
    # Before anything is written (in check mode too, so preflight refuses before the stop): the patched copies,
    # backups and rollback copies must fit, or a write fails half way (a full disk).
    try:
        short = space_problems(space_needs(changing, backup, keep_path), filesystem_of)
    except OSError as exc:
        short = ["cannot measure the free space for the NCCL patch: %s" % exc]
    if short:
        return "%s. No file was changed." % " | ".join(short)
    return None


def unchecked_warnings(items, unchecked):
    """The warnings for values let through by ``unchecked`` (written, but said at every verbosity)."""
    waived = set(unchecked or ())
    return ["%s; written anyway because it is in unchecked (sglang_nccl_env_unchecked): make sure your NCCL "
            "release takes it" % problem for problem in env_value_problems([(n, v) for n, v in items if n in waived])]


def preview_patch(python=None, path=None, env=None, unchecked=(), hand_edits="refuse", backup=False, run=None,
                  here=False, package=None):
    """sglang_nccl_patch's answer in check mode (state present, no previous copy): ``changed``, ``path``,
    ``paths``, ``files``, ``sglang_version``, ``hand_edits``, ``line``, ``env``; ``failed`` and ``msg`` where the
    module would fail; ``warnings`` the module's warnings. ``here``, ``package``: as for :func:`plan_block`."""
    plan = plan_block(python, path, env, unchecked, "present", hand_edits, run, here, package)
    result = dict(line=None, env={}, backup_file=None, previous=None, sha256=None)
    result.update(plan["result"])
    result["warnings"] = unchecked_warnings(plan["items"], unchecked) if plan["items"] else []
    if result.get("failed"):
        return result
    planned = plan["planned"]
    changing = [entry for entry in planned if entry["plan"]["changed"]]
    result.update(changed=bool(changing), line=planned[0]["plan"]["line"],
                  env=dict(plan["items"]) if any(e["plan"]["line"] for e in planned) else {},
                  files=[file_result(entry, False) for entry in planned])
    release = "sglang %s" % (result["sglang_version"] or "version unknown")
    refusal = write_refusal(changing, backup, lambda entry: None, release)
    if refusal:
        result.update(failed=True, msg=refusal)
        return result
    result["sha256"] = result["files"][0]["sha256"]
    return result
