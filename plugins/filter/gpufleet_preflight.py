"""gpufleet filter for the restart preflight's decision (plugins/plugin_utils/preflight.py does the work).

- ``gpufleet_preflight(read, settings)`` -> dict: the problems that refuse the host, the notes, the facts the run
  keeps (server_ran, gpu_baseline_mib, server_gpus), the refusal line and the failure message.
- ``gpufleet_preflight_variable_problems(values)`` -> list of str: the inventory problems that refuse a host before
  anything is read.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.preflight import judge, variable_problems


def gpufleet_preflight(read, settings):
    """:func:`judge` of one host's sglang_preflight_info read with the role's settings; see there."""
    return judge(read if isinstance(read, dict) else {}, settings if isinstance(settings, dict) else {})


def gpufleet_preflight_variable_problems(values):
    """:func:`variable_problems` of the role's values by the name a user sets; see there."""
    return variable_problems(values if isinstance(values, dict) else {})


class FilterModule(object):
    """gpufleet preflight filters."""

    def filters(self):
        return {"gpufleet_preflight": gpufleet_preflight,
                "gpufleet_preflight_variable_problems": gpufleet_preflight_variable_problems}
