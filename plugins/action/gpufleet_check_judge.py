# -*- coding: utf-8 -*-
# gpufleet: the fleet check's verdict for one host, made on the controller (no connection to the host).
"""Action plugin of :mod:`gpufleet_check_judge` (the documentation is in plugins/modules/gpufleet_check_judge.py):
the verdict of :func:`plugins.plugin_utils.check.gpufleet_check_verdict` over what sglang_fleet_check_info read,
returned to be registered, with its one-line summary as ``msg``."""
from __future__ import absolute_import, division, print_function

__metaclass__ = type

from ansible.plugins.action import ActionBase
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.check import (
    gpufleet_check_line,
    gpufleet_check_verdict,
    pending_steps,
)
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.metrics import textfile_requirement

ARGUMENT_SPEC = dict(
    reads=dict(type="list", elements="raw", required=True),
    config=dict(type="dict", default={}),
    become_reads=dict(type="list", elements="str", default=[]),
    textfile_dir=dict(type="str", default=""),
)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)

    def run(self, tmp=None, task_vars=None):
        result = super(ActionModule, self).run(tmp, task_vars)
        del tmp  # not used: nothing runs on the host
        validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        del validation
        verdict = gpufleet_check_verdict(args["reads"], args["config"] or None)
        pending = pending_steps(args["reads"], args["become_reads"], args["textfile_dir"],
                                bool(self._play_context.check_mode))
        verdict, pending = textfile_requirement(verdict, pending)
        result.update(verdict)
        result.update(changed=False, msg=gpufleet_check_line(verdict), pending=pending)
        return result
