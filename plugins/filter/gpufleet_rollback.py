"""gpufleet filters for the rollback after a failed restart (roles/sglang_launch/tasks/rollback.yml).

Thin wrappers: the decisions are plain functions in plugins/plugin_utils/rollback.py (unit-tested in
tests/unit/test_plugin_utils_rollback.py).

- ``gpufleet_rollback_plan(record_read, ...)`` -> dict: what can be restored, whether to relaunch, which steps run.
- ``gpufleet_rollback_wait(wait_result, server)`` -> {relaunch, note}: what the rollback's GPU memory wait lets through.
- ``gpufleet_rollback_relaunched(method, process, unit, unit_after, log_stat)`` -> {pid, started, log_offset}.
- ``gpufleet_rollback_step(task_name)`` -> str: the rollback step a failed task belongs to.
- ``gpufleet_rollback_report(facts, failure=None)`` -> {state, pid, detail}: sglang_launch_rollback.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import rollback


def gpufleet_rollback_plan(record_read, phase="launch", stopped=True, enabled=True, error_class=None,
                           host_wide_classes=(), record_file="", old_pid=None, stop_signalled=False, engine=None):
    """The rollback's plan from the registered sglang_host_info read of the launch record (rollback.plan)."""
    return rollback.plan(record_read, phase=phase, stopped=stopped, enabled=enabled, error_class=error_class,
                         host_wide_classes=host_wide_classes, record_file=record_file, old_pid=old_pid,
                         stop_signalled=stop_signalled, engine=engine)


def gpufleet_rollback_wait(wait_result, server):
    """Whether a relaunch follows the rollback's nvidia_gpu_wait, and the note's sentence (rollback.wait_outcome)."""
    return rollback.wait_outcome(wait_result, server)


def gpufleet_rollback_relaunched(method, process=None, unit=None, unit_after=None, log_stat=None):
    """The relaunched server's pid, whether the rollback started it, and its log offset (rollback.relaunched)."""
    return rollback.relaunched(method, process, unit, unit_after, log_stat)


def gpufleet_rollback_step(task_name):
    """The rollback step a failed task (ansible_failed_task.name) belongs to (rollback.step_of)."""
    return rollback.step_of(task_name)


def gpufleet_rollback_report(facts, failure=None):
    """sglang_launch_rollback = {state, pid, detail} (rollback.report)."""
    return rollback.report(facts if isinstance(facts, dict) else {}, failure)


class FilterModule(object):
    """gpufleet rollback filters."""

    def filters(self):
        return {
            "gpufleet_rollback_plan": gpufleet_rollback_plan,
            "gpufleet_rollback_wait": gpufleet_rollback_wait,
            "gpufleet_rollback_relaunched": gpufleet_rollback_relaunched,
            "gpufleet_rollback_step": gpufleet_rollback_step,
            "gpufleet_rollback_report": gpufleet_rollback_report,
        }
