"""gpufleet filters for the GPU memory wait's decisions (module_utils/gpufleet_gpu_memory.py does the work).

- ``gpufleet_gpu_unreadable_refusal(entries)`` -> str: preflight's refusal for fields the wait cannot read ('' none).
- ``gpufleet_gpu_baseline_text(baseline_mib)`` -> str: "GPU 3: 20018 MiB, ..." for memory others hold.
- ``gpufleet_rollback_unreadable(wait_result)`` -> str: the rollback's note when its GPU memory wait could not
  read memory (the relaunch then goes ahead without a memory check); '' otherwise.
- ``gpufleet_rollback_fit(wait_result, server)`` -> {fits, text}: whether the rollback relaunches the previous
  server beside GPU memory others took after preflight (its wait ran out), and the note's sentence.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_memory import (
    baseline_text,
    unreadable_refusal,
)
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import rollback


def gpufleet_gpu_unreadable_refusal(entries):
    """Preflight's refusal naming each GPU, field and value read (sglang_host_info's gpu_after_stop.unreadable)."""
    return unreadable_refusal(list(entries or []))


def gpufleet_gpu_baseline_text(baseline_mib):
    """"GPU 3: 20018 MiB" per GPU of a baseline (gpu_after_stop.baseline_mib), in index order."""
    return baseline_text(baseline_mib if isinstance(baseline_mib, dict) else {})


def gpufleet_rollback_unreadable(wait_result):
    """The rollback's sentence when its nvidia_gpu_wait (``wait_result``, registered) failed because a GPU's
    memory could not be read (error_class field_unavailable); '' for any other result (plugin_utils
    rollback.unreadable_note)."""
    return rollback.unreadable_note(wait_result)


def gpufleet_rollback_fit(wait_result, server):
    """Whether the rollback relaunches the previous server although its nvidia_gpu_wait (``wait_result``, registered)
    ran out (error_class not_released), and the sentence for its note (plugin_utils rollback.fit). ``server``:
    sglang_preflight_server_gpus. Any other wait result: ``{fits: False, text: ''}``."""
    return rollback.fit(wait_result, server)


class FilterModule(object):
    """gpufleet GPU memory filters."""

    def filters(self):
        return {"gpufleet_gpu_unreadable_refusal": gpufleet_gpu_unreadable_refusal,
                "gpufleet_gpu_baseline_text": gpufleet_gpu_baseline_text,
                "gpufleet_rollback_unreadable": gpufleet_rollback_unreadable,
                "gpufleet_rollback_fit": gpufleet_rollback_fit}
