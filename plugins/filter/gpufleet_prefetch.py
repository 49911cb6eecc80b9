"""gpufleet prefetch filters: the controller-side decisions of role sglang_prefetch as Jinja filters.

The decisions live in plugins/plugin_utils/prefetch.py (tests: tests/unit/plugins/plugin_utils/test_prefetch.py);
these are their names in the role, each ``gpufleet_prefetch_<function>``.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import prefetch

gpufleet_prefetch_paths = prefetch.paths
gpufleet_prefetch_outcome = prefetch.outcome


class FilterModule(object):
    """gpufleet prefetch filters."""

    def filters(self):
        return {
            "gpufleet_prefetch_paths": gpufleet_prefetch_paths,
            "gpufleet_prefetch_outcome": gpufleet_prefetch_outcome,
        }
