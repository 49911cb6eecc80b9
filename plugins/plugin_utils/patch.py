"""The NCCL patch's words on the controller: one line per hand-typed line the patch module found, and what it did
with it. Called by the gpufleet_hand_edit_lines filter (plugins/filter/gpufleet_patch.py) and the preflight core.
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError


HAND_EDIT_ACTIONS = {
    "taken_over": "taken over by this run: removed; the backup keeps the original and the block records it, so "
                  "sglang_nccl_patch_state=absent puts it back",
    "kept": "taken over by an earlier run (recorded in the block, not in effect)",
    "refused": "writes a variable of sglang_nccl_env outside the block: refused",
    "reported": "left as it is (sglang_nccl_env does not set %s): it still applies to the workers",
}


def gpufleet_hand_edit_lines(hand_edits):
    """One line per entry of the patch module's RV ``hand_edits``: ``<file>:<line>: <text> -- <what happened>``."""
    if not isinstance(hand_edits, (list, tuple)):
        raise AnsibleFilterError("gpufleet_hand_edit_lines: expected the patch module's hand_edits list, got %r"
                                 % (hand_edits,))
    lines = []
    for entry in hand_edits:
        if not isinstance(entry, dict):
            continue
        action = HAND_EDIT_ACTIONS.get(entry.get("action"), str(entry.get("action")))
        if "%s" in action:
            action = action % (", ".join(n or "a computed name" for n in entry.get("names") or []) or "it")
        lines.append("%s:%s: %s -- %s%s" % (
            entry.get("path"), entry.get("line"), entry.get("text"),
            "after the start-method call; " if entry.get("after_anchor") else "", action))
    return lines
