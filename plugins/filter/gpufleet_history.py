"""gpufleet launch history filters: the entry a verified launch appends and the table of the history (issue 34).

The decisions live in plugins/plugin_utils/history.py (tests: tests/unit/plugins/plugin_utils/test_history.py);
these are their names in roles/sglang_launch/tasks/history.yml and playbooks/history.yml.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import history

gpufleet_history_entry = history.history_entry
gpufleet_history_table = history.history_table


class FilterModule(object):
    """gpufleet launch history filters."""

    def filters(self):
        return {
            "gpufleet_history_entry": gpufleet_history_entry,
            "gpufleet_history_table": gpufleet_history_table,
        }
