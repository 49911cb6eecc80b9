"""gpufleet filters for the NCCL patch's files: what a rollback restores, and what it says it did.

The patch (module sglang_nccl_patch) changes every file of the installed SGLang that defines
``_set_envs_and_config``: ``srt/entrypoints/engine.py`` in every release up to 0.5.23, and on SGLang's development
branch after it also ``srt/entrypoints/worker_launch.py``. Plain functions, unit-tested in
tests/unit/test_filter_gpufleet_patch.py; nothing here touches a host.

- ``gpufleet_patch_kept(files)`` -> list: the module's RV ``files`` entries that have a rollback copy, as
  ``{path, previous_file, sha256}`` (``sglang_nccl_patch_previous.files``).
- ``gpufleet_patch_record(files)`` -> list: ``{path, sha256}`` of each patched file, for the launch record.
- ``gpufleet_rollback_serves(workers, recorded)`` -> str: what the host serves after the rollback relaunched the
  recorded launch: "the previous configuration" only when the relaunched workers carry the recorded NCCL values.
- ``gpufleet_hand_edit_lines(hand_edits)`` -> list of str: the patch module's RV ``hand_edits`` in words, one line
  each (file:line: text, then what happened to it), for the run's output and preflight.
- ``gpufleet_patch_restore(stat_results)`` -> dict: from the rollback's ``stat`` of each kept file (a loop over
  ``sglang_nccl_patch_previous.files``), ``restore`` (the kept entries whose file differs from its copy) and
  ``note`` (one sentence saying what the rollback did to each file).
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import rollback
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.patch import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    HAND_EDIT_ACTIONS,
    gpufleet_hand_edit_lines,
)

NOT_CHANGED = rollback.NOT_CHANGED


def gpufleet_patch_kept(files):
    """``{path, previous_file, sha256}`` for each entry of the patch module's RV ``files`` with a rollback copy
    (``previous_file`` set; ``sha256`` is that copy's, ``previous_sha256``)."""
    if not isinstance(files, (list, tuple)):
        raise AnsibleFilterError("gpufleet_patch_kept: expected the patch module's files list, got %r" % (files,))
    return [{"path": f["path"], "previous_file": f["previous_file"], "sha256": f.get("previous_sha256")}
            for f in files if isinstance(f, dict) and isinstance(f.get("previous_file"), str) and f.get("path")]


def gpufleet_patch_record(files):
    """``{path, sha256}`` of each entry of the patch module's RV ``files`` (what the launched server runs with)."""
    if not isinstance(files, (list, tuple)):
        raise AnsibleFilterError("gpufleet_patch_record: expected the patch module's files list, got %r" % (files,))
    return [{"path": f.get("path"), "sha256": f.get("sha256")} for f in files if isinstance(f, dict)]


def gpufleet_patch_restore(stat_results):
    """What the rollback restores and says, from its ``stat`` loop over the kept files (plugin_utils rollback.restore).

    ``stat_results``: the ``results`` list of ``ansible.builtin.stat`` (``checksum_algorithm: sha256``) looped over
    ``sglang_nccl_patch_previous.files``; each result carries its ``item`` (path, previous_file, sha256).
    Returns ``{"restore": [items to copy back], "note": str}``: a file is restored when its bytes differ from the
    copy (missing counts as differing); one that equals it was not written by this run's patch.
    """
    return rollback.restore(stat_results)


def gpufleet_rollback_serves(workers, recorded):
    """What the host serves once the rollback's relaunch answers, in the words of its note (str, no final stop):
    "the previous configuration" only when the relaunched workers carry the recorded NCCL values
    (plugin_utils rollback.serves)."""
    return rollback.serves(workers, recorded)


class FilterModule(object):
    """gpufleet NCCL patch filters."""

    def filters(self):
        return {
            "gpufleet_hand_edit_lines": gpufleet_hand_edit_lines,
            "gpufleet_patch_kept": gpufleet_patch_kept,
            "gpufleet_patch_record": gpufleet_patch_record,
            "gpufleet_patch_restore": gpufleet_patch_restore,
            "gpufleet_rollback_serves": gpufleet_rollback_serves,
        }
