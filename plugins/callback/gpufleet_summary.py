# gpufleet: print the restart summary table at the end of a run, whatever happened on the way.
from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_summary
type: aggregate
short_description: Print gpufleet's per-host restart summary at the end of the run
description:
  - Collects the C(gpufleet_summary_row) fact that playbooks/restart.yml sets for each host (in an C(always)
    section, so failed hosts report too) and prints one table at the end of the run, also when the rolling
    restart stopped early. Hosts that failed before their row was set (preflight, lock) are listed as failed
    with the failing task. Prints nothing for playbooks that set no row.
  - "Columns: host, result (ok|failed|check), downtime_s (s, stop start → ready), release_wait_ms (ms, GPU memory
    release after the stop), tokens_per_s (output tokens/s of the throughput smoke test), nccl (ok|fail: every
    GPU worker's environ carries sglang_nccl_env), old_pid, new_pid."
  - Needs no enabling (it is always on); the callback directory must be on the plugin path
    (ansible.cfg C(callback_plugins), or playbooks/callback_plugins/ under ansible-runner/AWX).
"""

import importlib.util
import os

from ansible.plugins.callback import CallbackBase


def _load_table():
    """gpufleet_summary_table from plugins/filter/gpufleet.py (one implementation for filter and callback)."""
    here = os.path.dirname(os.path.realpath(__file__))
    path = os.path.join(here, "..", "filter", "gpufleet.py")
    spec = importlib.util.spec_from_file_location("gpufleet_filter_for_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.gpufleet_summary_table


def _plain(value):
    """Native Python value (ansible-core 2.19+ hands tagged str/int subclasses to callbacks)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    text = str(value).strip()
    if text in ("", "None", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "gpufleet_summary"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self):
        super().__init__()
        self._rows = {}
        self._failures = {}
        self._seen_restart = False

    def v2_playbook_on_play_start(self, play):
        # Only restart-shaped playbooks print a table; a play named like ours marks it.
        if "host by host" in (play.get_name() or ""):
            self._seen_restart = True

    def v2_runner_on_ok(self, result):
        facts = result._result.get("ansible_facts") or {}
        row = facts.get("gpufleet_summary_row")
        if row:
            self._rows[result._host.get_name()] = {k: _plain(v) for k, v in dict(row).items()}

    def v2_runner_on_failed(self, result, ignore_errors=False):
        if not ignore_errors:
            self._failures.setdefault(result._host.get_name(), result._task.get_name())

    def v2_runner_on_unreachable(self, result):
        self._failures.setdefault(result._host.get_name(), "unreachable")

    def v2_playbook_on_stats(self, stats):
        if not self._rows and not (self._seen_restart and self._failures):
            return
        rows = dict(self._rows)
        for host, task in self._failures.items():
            rows.setdefault(host, {"host": host, "result": "failed", "failed_task": task})
            if rows[host].get("result") != "failed":
                rows[host]["result"] = "failed"
        ordered = [rows[h] for h in sorted(rows)]
        table = _load_table()(ordered)
        failed = ["%s: %s" % (r["host"], r.get("failed_task")) for r in ordered
                  if r.get("result") == "failed" and r.get("failed_task")]
        self._display.banner("GPUFLEET SUMMARY")
        self._display.display(table)
        for line in failed:
            self._display.display("failed " + line)
