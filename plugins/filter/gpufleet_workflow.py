"""gpufleet workflow filters: which targeted hosts restart.yml restarts after a fleet check (an AWX workflow's check
node passes check.yml's set_stats gpufleet_check on to the restart).

The decisions live in plugins/plugin_utils/workflow.py (tests: tests/unit/plugins/plugin_utils/test_workflow.py);
these are their names in restart.yml.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import workflow

gpufleet_restart_skips = workflow.restart_skips
gpufleet_skip_rows = workflow.skip_rows
gpufleet_restart_hosts = workflow.restart_hosts


class FilterModule(object):
    """gpufleet workflow filters."""

    def filters(self):
        return {
            "gpufleet_restart_skips": gpufleet_restart_skips,
            "gpufleet_skip_rows": gpufleet_skip_rows,
            "gpufleet_restart_hosts": gpufleet_restart_hosts,
        }
