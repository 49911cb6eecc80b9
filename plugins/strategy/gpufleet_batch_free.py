# gpufleet: each host of a serial batch moves through its phases on its own; a failed batch still ends the roll.
from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_batch_free
short_description: The C(free) strategy inside each serial batch, with C(max_fail_percentage) between batches
description:
  - "Inside a batch (C(serial)), Ansible's C(free) strategy: a host is given its next task as soon as it has
    finished the last one, without waiting for the other hosts of the batch. In C(playbooks/restart.yml) a host
    whose stop, memory wait or launch is quick is serving again while a slow host of the same batch is still
    loading, so its downtime is its own, not the batch's slowest (issue 14)."
  - "Between batches, C(max_fail_percentage) as the C(linear) strategy applies it: when more than that
    percentage of the batch's hosts failed (or became unreachable), no further batch starts and the play
    ends. C(free) alone only warns that it does not support C(max_fail_percentage) and would go on with the
    next batch unless every host of the batch failed."
  - "As with C(linear), every host of that batch then counts as failed for C(ansible-playbook) (that is what
    ends the play; the recap's per-host figures are unchanged)."
  - "Unlike C(linear), which marks the batch's other hosts failed as soon as one fails, the other hosts of a failed
    batch are not stopped where they are: each finishes its own
    tasks (its restart, or its own rescue and always sections), so a healthy host is not left half restarted.
    The decision is taken when the whole batch is done."
  - "Unreachable hosts count as failed here (C(linear) counts only failed hosts): a rolling restart that lost a
    host mid-restart must not take the next hosts out."
  - "What C(free) does not support holds here too: C(run_once) runs on every host of the batch, and
    C(any_errors_fatal) only warns. The rolling play of C(restart.yml) uses neither."
author: gpufleet maintainers
notes:
  - "Set per play: C(strategy: gpufleet.fleet.gpufleet_batch_free) (the collection's FQCN; this repository is
    the collection through C(collections/ansible_collections/gpufleet/fleet))."
"""

from ansible.plugins.strategy.free import StrategyModule as FreeStrategyModule
from ansible.utils.display import Display

display = Display()


def batch_stops_play(max_fail_percentage, batch_size, failed_count):
    """True when ``failed_count`` of ``batch_size`` hosts is more than ``max_fail_percentage`` percent: the
    comparison the linear strategy makes (``failed / batch_size > percentage / 100``). None (not set) never
    stops the play; 0 stops it on the first failure."""
    if max_fail_percentage is None or batch_size <= 0:
        return False
    return failed_count / float(batch_size) > float(max_fail_percentage) / 100.0


class StrategyModule(FreeStrategyModule):
    """``free`` for one batch, then the batch's failures against the play's ``max_fail_percentage``."""

    def run(self, iterator, play_context):
        play = iterator._play
        max_fail = play.max_fail_percentage
        unreachable_before = set(self._tqm._unreachable_hosts)
        # free warns that it ignores max_fail_percentage; it is honoured below, after the batch.
        play.max_fail_percentage = None
        try:
            result = super(StrategyModule, self).run(iterator, play_context)
        finally:
            play.max_fail_percentage = max_fail
        # The task queue manager clears _failed_hosts when a batch starts (TaskQueueManager.run): what is
        # there now failed in this batch. A host that failed in a rescue with an always section to run is
        # not put there (StrategyBase only records a failed host whose iterator state is complete), but the
        # iterator has it failed. Unreachable hosts accumulate over batches: count the new ones.
        failed = (set(self._tqm._failed_hosts) | set(iterator.get_failed_hosts())
                  | (set(self._tqm._unreachable_hosts) - unreachable_before))
        if batch_stops_play(max_fail, iterator.batch_size, len(failed)):
            display.display("gpufleet_batch_free: %d of %d hosts of this batch failed (%s), more than "
                            "max_fail_percentage %g%%: no further batch starts"
                            % (len(failed), iterator.batch_size, ", ".join(sorted(failed)), max_fail),
                            color="bright red")
            self._tqm.send_callback("v2_playbook_on_no_hosts_remaining")
            # What ends the play is what linear does too: every host of the batch counted as failed, so that
            # PlaybookExecutor sees a wholly failed batch and starts no other. Its RUN_FAILED_BREAK_PLAY test
            # (`result & self._tqm.RUN_FAILED_BREAK_PLAY != 0`) binds as `result & True` in ansible-core
            # 2.19 and 2.21 and never fires on that bit alone. Unreachable hosts are counted there already;
            # marking them too would count them twice. The recap's figures (stats) are not touched: a
            # healthy host still shows failed=0 and its own summary row.
            for name in self._hosts_cache:
                if name not in self._tqm._unreachable_hosts:
                    self._tqm._failed_hosts[name] = True
            result = int(result) | self._tqm.RUN_FAILED_BREAK_PLAY
        return result
