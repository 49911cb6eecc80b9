"""gpufleet tune filters: the decisions of playbooks/tune.yml (role sglang_tune) as Jinja filters.

The decisions live in plugins/plugin_utils/tune.py (tests: tests/unit/test_plugin_utils_tune.py; how the winner
is chosen: docs/tune.md); these are their names in the role, each ``gpufleet_tune_<function>``.
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import tune

gpufleet_tune_check_candidates = tune.check_candidates
gpufleet_tune_apply_overrides = tune.apply_overrides
gpufleet_tune_schedule = tune.schedule
gpufleet_tune_summarize = tune.summarize
gpufleet_tune_round_result = tune.round_result
gpufleet_tune_table = tune.table
gpufleet_tune_progress_line = tune.progress_line
gpufleet_tune_check_settings = tune.check_settings
gpufleet_tune_serving_after = tune.serving_after
gpufleet_tune_end_failure = tune.end_failure


def gpufleet_tune_report(rounds, candidates, baseline_values, metric):
    """:func:`tune.report`; an unknown metric is a filter error naming gpufleet_tune_metric."""
    try:
        return tune.report(rounds, candidates, baseline_values, metric)
    except ValueError as exc:
        raise AnsibleFilterError(str(exc))


class FilterModule(object):
    """gpufleet tune filters."""

    def filters(self):
        return {
            "gpufleet_tune_check_candidates": gpufleet_tune_check_candidates,
            "gpufleet_tune_apply_overrides": gpufleet_tune_apply_overrides,
            "gpufleet_tune_schedule": gpufleet_tune_schedule,
            "gpufleet_tune_summarize": gpufleet_tune_summarize,
            "gpufleet_tune_round_result": gpufleet_tune_round_result,
            "gpufleet_tune_report": gpufleet_tune_report,
            "gpufleet_tune_table": gpufleet_tune_table,
            "gpufleet_tune_check_settings": gpufleet_tune_check_settings,
            "gpufleet_tune_serving_after": gpufleet_tune_serving_after,
            "gpufleet_tune_end_failure": gpufleet_tune_end_failure,
            "gpufleet_tune_progress_line": gpufleet_tune_progress_line,
        }
