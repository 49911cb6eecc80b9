# -*- coding: utf-8 -*-
# Test equipment: a machine-readable stdout callback for the lab tests, standing in for ansible.posix.json
# (not installable from PyPI alone). Prints one JSON document at the end of the run and nothing before it.
from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_test_json
type: stdout
short_description: One JSON document on stdout at the end of the run (test equipment)
description:
  - Collects per-host task results and the run's custom stats (set_stats) and prints them as one JSON
    document when the playbook ends, like ansible.posix.json. Used by the lab tests to show that gpufleet's
    summary callback never writes into a machine-readable stdout.
"""

import json

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "gpufleet_test_json"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._results = []

    def _record(self, status, result):
        self._results.append({"host": result.host.get_name(), "task": result.task.get_name(),
                              "status": status, "msg": result.result.get("msg")})

    def v2_runner_on_ok(self, result):
        self._record("ok", result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._record("failed", result)

    def v2_runner_on_unreachable(self, result):
        self._record("unreachable", result)

    def v2_playbook_on_stats(self, stats):
        hosts = sorted(stats.processed)
        doc = {"results": self._results,
               "stats": {h: stats.summarize(h) for h in hosts},
               "global_custom_stats": stats.custom.get("_run", {})}
        self._display.display(json.dumps(doc, default=str, sort_keys=True))
