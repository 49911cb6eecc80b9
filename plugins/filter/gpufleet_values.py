"""gpufleet value filters: the values rendered into the systemd unit, run as root or used as paths and user names.

The rule lives in plugins/module_utils/gpufleet_unit_values.py (one home, unit-tested in
tests/unit/test_gpufleet_unit_values.py); these filters apply it where the playbooks check values:

- ``gpufleet_unit_value_report(hostvars, hosts)`` → list of str: the command-line guard (playbooks/tasks/guards.yml),
  over the targeted hosts' inventory values (role defaults not applied), before any host is touched.
- ``gpufleet_unit_value_problems(values)`` → list of str: preflight's check (roles/sglang_preflight/tasks/
  variables.yml) of the values the roles resolved, keyed by the variable names a user sets.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.guard import hosts_report
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_unit_values import unit_value_problems


class _Readable(object):
    """A host's hostvars read with ``.get``, None for a value that cannot be templated here (an undefined
    variable inside it: the roles report that one when they template it)."""

    def __init__(self, values):
        self._values = values

    def get(self, name, default=None):
        try:
            return self._values.get(name, default)
        except Exception:  # noqa: BLE001 - hostvars template on read; any templating error: not readable here
            return default


def gpufleet_unit_value_report(hostvars, hosts):
    """Problems of the :data:`VARIABLES` of every host in ``hosts`` (list of names) read from ``hostvars``: one
    message per distinct problem, suffixed with the hosts it concerns when it does not concern them all."""
    hosts = list(hosts or [])
    seen = {}
    for host in hosts:
        for message in unit_value_problems(_Readable(hostvars[host])):
            seen.setdefault(message, []).append(host)
    return hosts_report(seen, hosts)


def gpufleet_unit_value_problems(values):
    """Problems of the variables in ``values`` (mapping: variable name as a user sets it → the value the roles
    use; names outside :data:`VARIABLES` are checked for control characters only)."""
    values = values or {}
    return unit_value_problems(values, names=list(values))


class FilterModule(object):
    """gpufleet value filters."""

    def filters(self):
        return {
            "gpufleet_unit_value_report": gpufleet_unit_value_report,
            "gpufleet_unit_value_problems": gpufleet_unit_value_problems,
        }
