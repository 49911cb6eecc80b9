# gpufleet test equipment: wall-clock start and end of every task per host, for tests/gpu/real_restart.sh.
from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_task_times
type: aggregate
short_description: Write each task's start and end time per host as JSON lines (benchmark equipment)
description:
  - Appends one JSON object per task result to the file named by the environment variable
    C(GPUFLEET_TASK_TIMES_FILE) (nothing when it is unset), with keys C(run), C(play), C(task), C(role), C(host),
    C(status) (ok|changed|failed|skipped|unreachable), C(start) (task start), C(runner_start) (the host's worker began the task) and C(end) (Unix time, s, controller clock) and,
    for C(nvidia_gpu_wait), C(elapsed_ms), C(polls) and C(started_at) (target clock) from its result.
  - ansible-core has no per-task timer (profile_tasks lives in ansible.posix); tests/gpu/real_restart.py
    turns these lines into per-phase times.
  - At the end of the run, appends one JSON object C({"run", "custom_stats"}) to the file named by
    C(GPUFLEET_RUN_STATS_FILE) (nothing when it is unset) - what the playbook published with C(set_stats), as AWX
    receives it (C(gpufleet_restart) holds the summary rows) - so a script reads the rows while the human-readable
    output still goes to the terminal (tests/gpu/prefetch_h200.sh).
"""

import json
import os
import time

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "gpufleet_task_times"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self):
        super().__init__()
        self._path = os.environ.get("GPUFLEET_TASK_TIMES_FILE")
        self._stats_path = os.environ.get("GPUFLEET_RUN_STATS_FILE")
        self._run = os.environ.get("GPUFLEET_TASK_TIMES_RUN", "")
        self._play = None
        self._task_start = {}
        self._runner_start = {}

    def v2_playbook_on_play_start(self, play):
        self._play = str(play.get_name())

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._task_start[task._uuid] = time.time()

    def v2_playbook_on_handler_task_start(self, task):
        self._task_start[task._uuid] = time.time()

    def v2_runner_on_start(self, host, task):
        self._runner_start[(task._uuid, host.get_name())] = time.time()

    def _write(self, result, status):
        if not self._path:
            return
        task = result.task
        # Task has no public role or uuid attribute (ansible-core's own callbacks read _role and _uuid too).
        role = task._role.get_name() if task._role else None
        row = {"run": self._run, "play": self._play, "task": str(task.get_name()), "role": role,
               "action": str(task.action), "host": str(result.host.get_name()), "status": status,
               "start": self._task_start.get(task._uuid),
               "runner_start": self._runner_start.get((task._uuid, str(result.host.get_name()))), "end": time.time()}
        res = result.result
        if str(task.action).endswith("nvidia_gpu_wait"):
            row["elapsed_ms"] = res.get("elapsed_ms")
            row["polls"] = res.get("polls")
            row["started_at"] = res.get("started_at")
        with open(self._path, "a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")

    def v2_runner_on_ok(self, result):
        self._write(result, "changed" if result.result.get("changed") else "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._write(result, "failed")

    def v2_runner_on_skipped(self, result):
        self._write(result, "skipped")

    def v2_runner_on_unreachable(self, result):
        self._write(result, "unreachable")

    def v2_playbook_on_stats(self, stats):
        if not self._stats_path:
            return
        with open(self._stats_path, "a") as fh:
            fh.write(json.dumps({"run": self._run, "custom_stats": stats.custom}, default=str) + "\n")
