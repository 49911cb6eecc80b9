"""gpufleet run filters: the guards every playbook runs first, and restart.yml's summary rows.

Used by playbooks/tasks/guards.yml (the first play of every playbook). Plain functions, unit-tested in
tests/unit/test_filter_gpufleet_run.py.

AWX surveys pass every answer as an extra variable, and an optional question left blank arrives as ``""``.
Extra variables win over every other source (inventory, play vars, set_fact), so a blank answer cannot be
replaced by the inventory's value: ``""`` (and null) count as *unset*, i.e. the variable's documented
default.

- ``gpufleet_unset(value)`` → bool: None, ``""`` or only whitespace.
- ``gpufleet_serial_error(value)`` → str: why ``gpufleet_serial`` is not a valid ``serial`` ('' when valid).
- ``gpufleet_serial_value(value, n_hosts=None)`` → int|str|list: what ``serial:`` gets (1 when unset or invalid, so
  the play's ``serial`` never raises; the guard play has failed already in that case; counts capped at the play's
  hosts, percentages whole: what ansible-core's batching takes without hanging or raising).
- ``gpufleet_serial_notes(value, n_hosts)`` → list of str: a count above the targeted hosts means all of them.
- ``gpufleet_batch_size(value, n_hosts)`` → int: the most hosts one ``serial`` batch takes out of ``n_hosts``.
- ``gpufleet_capacity_error(serial, max_unavailable, n_hosts)`` → str: why ``gpufleet_serial`` takes out more hosts
  than ``gpufleet_max_unavailable`` allows ('' when it does not, or when either is unset or invalid).
- ``gpufleet_guard_errors(values, host=None)`` → list of str: type errors of survey variables, each naming the
  variable the user set.
- ``gpufleet_guard_report(hostvars, hosts)`` → list of str: those errors over the targeted hosts, de-duplicated.
- ``gpufleet_guard_deprecations(hostvars, hosts)`` → list of str: deprecated variables in use.
- ``gpufleet_guard_notes(hostvars, hosts)`` → list of str: valid values the run does not take as written.
- ``gpufleet_rows(hosts, result, cause, phase, advice)`` → dict: summary rows for hosts not restarted.
- ``gpufleet_restart_row(facts)`` → dict: one host's row from its facts (restart.yml's always: section).
- ``gpufleet_preflight_rows(hostvars, targets, play_hosts_all, play_hosts)`` → dict: rows after a refusal.
- ``gpufleet_not_started_rows(hostvars, play_hosts_all, batch, stopped_at, result)`` → dict: later hosts.
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
