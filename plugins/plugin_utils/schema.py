"""The restart's variables in one schema: the roles' ``meta/argument_specs.yml`` declare each variable's type,
choices, elements and default (once, there); this module reads them and adds the ranges (``RANGES``: the one
place for them). Plain Python, unit-tested in tests/unit/test_schema.py; the guard (:mod:`.guard`) uses it.

Ranges live here, keyed by variable name, and not in the argument specs under a key of our own: ansible-core's
role argument validation and ansible-lint's schema for ``meta/argument_specs.yml`` both read those files, and an
option key neither knows is a schema error for ansible-lint (and for ``ansible-doc``'s role docs a key it does not
render). A unit test keeps this table honest: every name in it must be declared, as an int or a float, in some
role's argument spec (tests/unit/test_schema.py).

- ``load(roles_dir=None)`` -> {name: :class:`Variable`}: every option of every entry point of every role; raises
  :class:`SchemaError` when two entry points declare one name with a different type, choices or elements.
- ``RANGES``: name -> :class:`Range` (least, most, whether 0 is a meaning, unit, empty = default).
- ``switches(variables)`` -> names the guard reads as booleans (type bool, and ``SWITCHES_RAW``).
- ``argument_spec(names, variables)`` -> the argument_spec ``ansible.builtin.validate_argument_spec`` takes for
  those names: type, choices, elements and sub-options, without defaults and without ``required`` (the guard checks
  what a run was given; a role's own entry point says what it needs).
"""
from __future__ import annotations

import os
from collections import namedtuple

import yaml

ROLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "roles")


class SchemaError(ValueError):
    """Two argument specs disagree on one variable."""


# type (Ansible's name; str when the spec gives none), choices (list or None), elements, options (sub-options as
# declared), no_log, default (None when the spec gives none; has_default says whether it gives one), where
# ("role/entry point" declaring it, in file order).
Variable = namedtuple("Variable", "name type choices elements options no_log default has_default where")

# What a number may be, beyond its type: ``low`` the least (for a float ``low`` is 0 and ``zero_ok`` says whether 0
# itself is a meaning: no grace, no wait), ``high`` the most, ``unit`` what it counts where its name's suffix (_s,
# _ms, _mib) does not say, ``empty_is_default`` when its role maps an empty value (an unanswered AWX survey
# question) to the default; for the others an empty value reaches the role's argument spec, which refuses it after
# the stop.
Range = namedtuple("Range", "low high zero_ok unit empty_is_default", defaults=(False, None, False))

_DAY_S = 86400
_HOUR_S = 3600
_MINUTE_MS = 60000

# The restart's timeouts, slices, poll intervals and the launch's and verification's numeric settings: the roles'
# argument specs validate them only when the role runs, which for the launch, wait and verify roles is after the
# old server was stopped, and a negative or zero timeout passes those specs and gives up at once
# (-e sglang_launch_ready_timeout_s=-1 took a serving host down: the launch and the rollback's relaunch both
# "timed out" after their first probe; -e sglang_verify_max_new_tokens=-5 stopped a serving host, and its verify
# failed on the new server without naming the variable).
# The most: the ones the roles' modules enforce (sglang_stop's poll_interval_ms: 1-100), a fraction's 1 (30 written
# for 30 % would switch the regression check off without a word), and for every other count a sane most, so that a
# typo or a 20-digit number is refused before any host is touched instead of waiting for days, holding the lock as
# long, or overflowing (a lease of 1e20 s has no date; int(1e400) raises): a day for a timeout, an hour for a slice
# or a start-up watch, a minute for a poll interval, 1 TiB for GPU memory, and request and token counts far beyond
# what a verification sends.
TUNABLES = {
    "sglang_launch_ready_timeout_s": Range(1, _DAY_S),
    "sglang_launch_ready_slice_s": Range(0, _HOUR_S),
    "sglang_launch_ready_poll_interval_ms": Range(1, _MINUTE_MS),
    "sglang_stop_grace_s": Range(0, _DAY_S, zero_ok=True),  # 0: no grace, SIGKILL at once
    "sglang_stop_slice_s": Range(0, _HOUR_S),
    "sglang_stop_kill_timeout_s": Range(0, _DAY_S),
    "sglang_stop_poll_interval_ms": Range(1, 100),
    "gpu_memory_wait_timeout_s": Range(0, _DAY_S),
    "gpu_memory_wait_slice_s": Range(0, _HOUR_S),
    "gpu_memory_wait_poll_interval_ms": Range(1, _MINUTE_MS),
    "gpu_memory_wait_max_used_mib": Range(0, 1048576),
    "sglang_verify_request_timeout_s": Range(1, _DAY_S),
    # 0: no drain wait; empty: the role's default
    "gpufleet_router_drain_timeout_s": Range(0, _DAY_S, zero_ok=True, empty_is_default=True),
    "gpufleet_router_ready_timeout_s": Range(0, _DAY_S, empty_is_default=True),
    "sglang_launch_startup_check_s": Range(0, _HOUR_S, zero_ok=True),  # 0: no start-up watch
    "sglang_launch_start_wait_s": Range(0, _HOUR_S, zero_ok=True),
    "sglang_launch_log_tail_lines": Range(1, 100000, unit="log lines"),
    "sglang_launch_systemd_restart_sec": Range(0, _HOUR_S, unit="seconds"),
    "sglang_verify_max_new_tokens": Range(1, 65536, unit="tokens"),
    "sglang_verify_min_workers": Range(0, 65536, unit="worker processes"),
    "sglang_verify_throughput_requests": Range(1, 100000, unit="requests"),
    "sglang_verify_throughput_concurrency": Range(1, 4096, unit="requests"),
    "sglang_verify_throughput_max_new_tokens": Range(1, 65536, unit="tokens"),
    "sglang_verify_min_tokens_per_s": Range(0, 10 ** 9, zero_ok=True, unit="tokens/s"),  # 0: no floor
    "sglang_verify_max_regression_fraction": Range(0, 1, zero_ok=True, unit="a fraction of the last good figure"),
    # 0 = no burst (module_utils gpufleet_burst: MAX_REQUESTS, MAX_CONCURRENCY bound them).
    "sglang_verify_burst_requests": Range(0, 1000, unit="requests"),
    "sglang_verify_burst_concurrency": Range(1, 64, unit="requests"),
    "sglang_verify_burst_max_new_tokens": Range(1, 65536, unit="tokens"),
    "sglang_verify_burst_timeout_s": Range(0, _HOUR_S),
    # The weight prefetch (role sglang_prefetch): 0 MiB of reserve keeps only the kernel's watermarks free; a rate
    # of 0 is no rate bound; 16 TiB is past any host's memory, 1 TiB/s past any disk.
    "sglang_prefetch_reserve_mib": Range(0, 16 * 1048576, zero_ok=True),
    "sglang_prefetch_rate_mib_s": Range(0, 1048576, zero_ok=True, unit="MiB/s"),
    "sglang_prefetch_timeout_s": Range(0, _DAY_S),
    "sglang_prefetch_slice_s": Range(0, _HOUR_S),
}
# Every range: the tunables, the port and the restart lock's seconds (a week of lease; an hour of margin), which the
# guard checks with messages of their own.
RANGES = dict(TUNABLES, **{
    "sglang_port": Range(1, 65535),
    "gpufleet_lock_lease_s": Range(1, 7 * _DAY_S),
    "gpufleet_lock_stale_s": Range(1, 7 * _DAY_S),
    "gpufleet_lock_margin_s": Range(0, _HOUR_S),
})

# Switches whose argument spec type is raw because an empty value has a meaning of its own (sglang_verify_throughput:
# empty is false), read by the guard as booleans all the same.
SWITCHES_RAW = ("sglang_verify_throughput",)

_CACHE = {}


def _options(spec):
    return (spec or {}).get("options") or {}


def load(roles_dir=None):
    """{name: Variable} for every option of every entry point of every role under ``roles_dir`` (default: this
    collection's roles/), in role and file order. Raises :class:`SchemaError` when two entry points declare one
    name with a different type, choices or elements (a default may differ: entry points are run on their own)."""
    roles_dir = roles_dir or ROLES_DIR
    if roles_dir in _CACHE:
        return _CACHE[roles_dir]
    found = {}
    problems = []
    for role in sorted(os.listdir(roles_dir)):
        path = os.path.join(roles_dir, role, "meta", "argument_specs.yml")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as handle:
            specs = (yaml.safe_load(handle) or {}).get("argument_specs") or {}
        for entry, spec in specs.items():
            for name, option in _options(spec).items():
                option = option or {}
                var = Variable(name, option.get("type", "str"), option.get("choices"), option.get("elements"),
                               option.get("options"), bool(option.get("no_log")), option.get("default"),
                               "default" in option, ["%s/%s" % (role, entry)])
                seen = found.get(name)
                if seen is None:
                    found[name] = var
                    continue
                for field in ("type", "choices", "elements"):
                    if getattr(seen, field) != getattr(var, field):
                        problems.append("%s: %s is %r in %s but %r in %s/%s" % (
                            name, field, getattr(seen, field), ", ".join(seen.where), getattr(var, field), role, entry))
                seen.where.append("%s/%s" % (role, entry))
    if problems:
        raise SchemaError("the roles' argument specs disagree: " + "; ".join(problems))
    _CACHE[roles_dir] = found
    return found


def switches(variables=None):
    """Names the guard reads as booleans: every variable of type bool, and ``SWITCHES_RAW``, in schema order."""
    variables = load() if variables is None else variables
    return tuple(n for n, v in variables.items() if v.type == "bool" or n in SWITCHES_RAW)


def is_whole(name, variables=None):
    """Whether ``name`` is declared as an int (else a float): what the guard asks of a number in ``RANGES``."""
    variables = load() if variables is None else variables
    return variables[name].type == "int"


def _strip(option):
    """One option as validate_argument_spec takes it for a value given on the command line: no default, not
    required, no documentation; sub-options the same."""
    out = {}
    for key in ("type", "choices", "elements", "no_log"):
        if option.get(key) is not None:
            out[key] = option[key]
    if option.get("options"):
        out["options"] = {n: _strip(o or {}) for n, o in option["options"].items()}
    return out


def argument_spec(names, variables=None):
    """The argument_spec ``ansible.builtin.validate_argument_spec`` takes for ``names`` (those the schema declares;
    others are left out): type, choices, elements, sub-options and no_log as declared, no default, not required."""
    variables = load() if variables is None else variables
    spec = {}
    for name in names:
        var = variables.get(name)
        if var is None:
            continue
        spec[name] = _strip({"type": var.type, "choices": var.choices, "elements": var.elements,
                             "options": var.options, "no_log": var.no_log or None})
    return spec
