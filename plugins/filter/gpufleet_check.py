"""gpufleet check filters: the per-host health verdict of playbooks/check.yml, the fleet view, the table, metrics.

The decisions live in plugins/plugin_utils/check.py (reason codes, thresholds, the verdict's shape); this file
makes them Jinja filters. The fleet_check role feeds gpufleet_check_verdict the sglang_fleet_check_info result.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.check import (  # noqa: F401 (re-exported) pylint: disable=unused-import
    DEFAULT_CONFIG,
    SEVERITY_RANK,
    check_reads,
    gpu_reasons,
    group_reasons,
    gpufleet_check_failing,
    gpufleet_check_fleet,
    gpufleet_check_line,
    gpufleet_check_pending,
    gpufleet_check_report,
    gpufleet_check_report_rows,
    gpufleet_check_root_code,
    gpufleet_check_stats,
    gpufleet_check_table,
    gpufleet_check_unreachable,
    gpufleet_check_verdict,
    merge_reads,
    sglang_reasons,
    short_reasons,
    worker_difference,
)
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.metrics import gpufleet_check_prom  # noqa: F401 (re-exported)


def gpufleet_check_reads(run_tags=None, skip_tags=None, become=False):
    """sglang_fleet_check_info's ``gather`` for check.yml's call as the login user and its call with become
    (:func:`check_reads`)."""
    return check_reads(run_tags, skip_tags, become)


class FilterModule(object):
    """gpufleet check filters."""

    def filters(self):
        return {
            "gpufleet_check_verdict": gpufleet_check_verdict,
            "gpufleet_check_unreachable": gpufleet_check_unreachable,
            "gpufleet_check_root_code": gpufleet_check_root_code,
            "gpufleet_check_fleet": gpufleet_check_fleet,
            "gpufleet_check_pending": gpufleet_check_pending,
            "gpufleet_check_stats": gpufleet_check_stats,
            "gpufleet_check_report": gpufleet_check_report,
            "gpufleet_check_report_rows": gpufleet_check_report_rows,
            "gpufleet_check_failing": gpufleet_check_failing,
            "gpufleet_check_table": gpufleet_check_table,
            "gpufleet_check_prom": gpufleet_check_prom,
            "gpufleet_check_reads": gpufleet_check_reads,
            "gpufleet_check_line": gpufleet_check_line,
        }
