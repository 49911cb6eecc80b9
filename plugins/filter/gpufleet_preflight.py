"""gpufleet filter for the restart preflight's decision (plugins/plugin_utils/preflight.py does the work).

- ``gpufleet_preflight(read, settings)`` -> dict: the problems that refuse the host, the notes, the facts the run
  keeps (server_ran, gpu_baseline_mib, server_gpus), the refusal line and the failure message.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.preflight import judge


def gpufleet_preflight(read, settings):
    """:func:`judge` of one host's sglang_preflight_info read with the role's settings; see there."""
    return judge(read if isinstance(read, dict) else {}, settings if isinstance(settings, dict) else {})


class FilterModule(object):
    """gpufleet preflight filters."""

    def filters(self):
        return {"gpufleet_preflight": gpufleet_preflight}
