"""gpufleet run filters: thin wrappers over the controller-side core, under the names playbooks use.

- The command-line guard (playbooks/tasks/guards.yml, the first play of every playbook): its functions and their
  contracts are documented in plugins/plugin_utils/guard.py (tests: tests/unit/test_guard.py).
- restart.yml's summary rows and what a cut-short run left: plugins/plugin_utils/run.py; the lock lease plan and the
  unreachable-host advice: plugins/plugin_utils/phases.py (tests: tests/unit/plugins/plugin_utils/).
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import phases, run

# The guard's decisions live in plugins/plugin_utils/guard.py (the schema in plugin_utils/schema.py); these filters
# are thin wrappers over them.
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.guard import (  # noqa: F401 re-exported; pylint: disable=unused-import
    gpufleet_batch_size, gpufleet_capacity_error, gpufleet_guard_argument_specs, gpufleet_guard_deprecations,
    gpufleet_guard_errors, gpufleet_guard_notes, gpufleet_guard_report, gpufleet_max_unavailable_error,
    gpufleet_serial_error, gpufleet_serial_notes, gpufleet_serial_value, gpufleet_tp_pp_size, gpufleet_unset,
    hosts_report)


# restart.yml's summary rows and what a cut-short run left: plugins/plugin_utils/run.py (the controller-side core
# the summary callback and the gpufleet CLI import too); the lock lease plan and the unreachable advice:
# plugins/plugin_utils/phases.py. The filters below are their names in the playbooks.
gpufleet_rows = run.summary_rows
gpufleet_restart_row = run.restart_row
gpufleet_preflight_rows = run.preflight_rows
gpufleet_not_started_rows = run.not_started_rows


def gpufleet_lock_plan(stretches):
    """restart.yml's lease plan (:func:`phases.lock_plan`) from ``stretches``: a mapping with ``stop_s``,
    ``wait_s``, ``slice_s``, ``verify_s``, ``margin_s``, ``lease_s`` and optionally ``start_wait_s``,
    ``startup_check_s``."""
    names = ("stop_s", "wait_s", "slice_s", "verify_s", "margin_s", "lease_s", "start_wait_s", "startup_check_s")
    return phases.lock_plan(**{k: stretches[k] for k in names if k in stretches})


def gpufleet_unreachable_advice(phase, host=None, state_dir=None, lease_s=None, start_with_stop=None,
                                stop_result=None):
    """What a host lost in ``phase`` may be doing (:func:`phases.unreachable_advice`)."""
    return phases.unreachable_advice(phase, host=host, state_dir=state_dir, lease_s=lease_s,
                                     start_with_stop=start_with_stop, stop_result=stop_result)


class FilterModule(object):
    """gpufleet guard filters."""

    def filters(self):
        return {
            "gpufleet_unset": gpufleet_unset,
            "gpufleet_serial_error": gpufleet_serial_error,
            "gpufleet_serial_value": gpufleet_serial_value,
            "gpufleet_batch_size": gpufleet_batch_size,
            "gpufleet_capacity_error": gpufleet_capacity_error,
            "gpufleet_guard_errors": gpufleet_guard_errors,
            "gpufleet_tp_pp_size": gpufleet_tp_pp_size,
            "gpufleet_guard_report": gpufleet_guard_report,
            "gpufleet_guard_argument_specs": gpufleet_guard_argument_specs,
            "gpufleet_rows": gpufleet_rows,
            "gpufleet_restart_row": gpufleet_restart_row,
            "gpufleet_preflight_rows": gpufleet_preflight_rows,
            "gpufleet_not_started_rows": gpufleet_not_started_rows,
            "gpufleet_lock_plan": gpufleet_lock_plan,
            "gpufleet_unreachable_advice": gpufleet_unreachable_advice,
            "gpufleet_guard_deprecations": gpufleet_guard_deprecations,
            "gpufleet_guard_notes": gpufleet_guard_notes,
        }
