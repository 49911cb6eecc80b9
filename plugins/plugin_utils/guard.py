"""The command-line guard's decisions (playbooks/tasks/guards.yml, the first play of every playbook): plain
functions over the values a run was given, with the schema of :mod:`.schema` (types from the roles' argument specs,
ranges from ``schema.RANGES``). Filters in plugins/filter/gpufleet_run.py are thin wrappers; unit-tested in
tests/unit/test_guard.py.

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
- ``gpufleet_guard_errors(values, host=None)`` → list of str: errors of survey variables, each naming the
  variable the user set.
- ``gpufleet_guard_argument_specs(hostvars, hosts)`` → list of dict: what ``ansible.builtin.validate_argument_spec``
  checks (the types and choices of the set variables the messages here do not cover).
- ``gpufleet_guard_report(hostvars, hosts, validated=None)`` → list of str: those errors over the targeted hosts,
  de-duplicated, with validate_argument_spec's.
- ``gpufleet_guard_deprecations(hostvars, hosts)`` → list of str: deprecated variables in use.
- ``gpufleet_guard_notes(hostvars, hosts)`` → list of str: valid values the run does not take as written.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import schema, workflow

_INT = re.compile(r"^\s*[0-9]+\s*$")
_PCT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")
_BOOL_WORDS = ("yes", "no", "true", "false", "on", "off", "y", "n", "t", "f", "1", "0")
# Switches a user sets (inventory, -e, an AWX survey) that the playbooks read with ``| bool`` or pass to a role's
# bool option: every variable the roles' argument specs declare as bool (schema.switches). ``| bool`` reads a typo
# ('ture') as false in silence, and a role's argument check fails only when that role runs: after the stop for the
# launch and rollback (gpufleet_rollback=ture left a host down with no rollback). So each is checked before any
# host is touched.
# What leaving a switch unset means, where the message says more than "the default".
_BOOL_UNSET = {"sglang_verify_throughput": "leave it empty for false"}


def _is_bool_like(value):
    """A bool, the integer 0 or 1, or one of :data:`_BOOL_WORDS` (what Ansible's boolean conversion takes, less
    floats: 1.0 written for a switch is refused)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return value in (0, 1)
    return isinstance(value, str) and value.strip().lower() in _BOOL_WORDS


def gpufleet_unset(value):
    """True when a variable counts as not set: None, or a string that is empty after stripping whitespace."""
    if value is None:
        return True
    return isinstance(value, str) and not value.strip()


# A count written as more digits than Python turns into an int (sys.int_info.default_max_str_digits) stands for
# "more hosts than any inventory holds": it is capped like any other count above the targeted hosts.
_HUGE_COUNT = 10 ** 18


def _count(text):
    """The whole number ``text`` (digits, maybe blank around) as an int; :data:`_HUGE_COUNT` when it is too long for
    Python to read (thousands of digits)."""
    try:
        return int(str(text).strip())
    except ValueError:
        return _HUGE_COUNT


def _serial_item_error(item):
    if isinstance(item, bool):
        return "%r is a boolean" % (item,)
    if isinstance(item, int):
        return "" if item >= 1 else "%d is below 1" % item
    if isinstance(item, float):
        if math.isnan(item) or item in (float("inf"), float("-inf")):
            return "%r is not a whole number" % (item,)
        return "%r is not a whole number (write %d or a percentage like \"25%%\")" % (item, int(item))
    if isinstance(item, str):
        if _INT.match(item):
            return "" if _count(item) >= 1 else "%r is below 1" % item
        match = _PCT.match(item)
        if match:
            pct = float(match.group(1))
            if pct <= 0:
                return "%r is no hosts: a percentage must be above 0 (at most 100)" % item
            return "" if pct <= 100 else "%r is above 100 %%" % item
        return "%r is neither a number of hosts nor a percentage" % item
    return "%r is a %s" % (item, type(item).__name__)


def gpufleet_serial_error(value):
    """Why ``value`` is not a valid ``gpufleet_serial`` ('' when it is valid or unset).

    Valid: a whole number ≥ 1 (``2``, ``"2"``), a percentage of the targeted hosts ``"25%"`` (0 < p ≤ 100;
    Ansible rounds down, at least 1 host), or a non-empty list of those (batch sizes in order, the last one
    repeats: Ansible's ``serial`` list).
    """
    if gpufleet_unset(value):
        return ""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, dict):
        items = [value]
    if not items:
        return "gpufleet_serial is an empty list; give a number of hosts (1), a percentage (\"25%\") or a list of those"
    problems = [p for p in (_serial_item_error(i) for i in items) if p]
    if not problems:
        return ""
    return ("gpufleet_serial=%s is not valid: %s. Give a number of hosts per batch (1, 2, ...), a percentage of "
            "the targeted hosts (\"25%%\") or a list of those (JSON extra vars: -e '{\"gpufleet_serial\": "
            "[1, \"50%%\"]}'); leave it empty for 1" % (_show(value), "; ".join(problems)))


# What gpufleet_serial_value gives for a count when the play's host count is not known (no host list): no play
# holds more hosts, and Ansible's batching loops once per unit of ``serial`` (range(serial)), so a 20-digit count
# passed through would hang the run before its first host.
_SERIAL_CAP = 100000


def gpufleet_serial_value(value, n_hosts=None):
    """``serial:`` for the rolling play: ``value`` when valid, else 1 (unset, empty survey answer, or invalid).

    With ``n_hosts`` (the play's hosts, ``ansible_play_hosts_all | length``) every item becomes the count of hosts
    Ansible's batching would take for it (a percentage of ``n_hosts`` rounded down, at least 1; a count above
    ``n_hosts`` is ``n_hosts``: "all"). Without it a count is capped at ``_SERIAL_CAP`` and a percentage is
    written whole (rounded down, at least 1 %). Either way ``serial:`` gets only what ansible-core's batching
    takes: a bounded count (it loops once per unit) and whole percentages (``"0.5%"`` made it raise)."""
    if gpufleet_unset(value) or gpufleet_serial_error(value):
        return 1
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        n_hosts = int(n_hosts) if n_hosts is not None and not isinstance(n_hosts, bool) else 0
    except (TypeError, ValueError):
        n_hosts = 0
    if n_hosts > 0:
        out = [_hosts_of(i, n_hosts) for i in items]
    else:
        out = []
        for item in items:
            match = _PCT.match(item) if isinstance(item, str) else None
            if match:
                out.append("%d%%" % max(1, int(float(match.group(1)))))
            else:
                out.append(min(_count(item), _SERIAL_CAP))
    return out if isinstance(value, (list, tuple)) else out[0]


def _hosts_of(item, n_hosts):
    """Hosts one ``serial`` item (a valid count or percentage) stands for out of ``n_hosts`` (Ansible: a
    percentage rounds down, at least 1; a count above n_hosts is n_hosts)."""
    match = _PCT.match(item) if isinstance(item, str) else None
    if match:
        return max(1, int(float(match.group(1)) * n_hosts / 100.0))
    return min(_count(item), n_hosts)


def gpufleet_batch_size(value, n_hosts):
    """The most hosts one batch of ``serial: value`` takes out of ``n_hosts`` (int ≥ 1; 1 when ``value`` is unset
    or invalid, as :func:`gpufleet_serial_value` makes the play run)."""
    n_hosts = max(1, int(n_hosts or 1))
    value = gpufleet_serial_value(value, n_hosts)
    items = value if isinstance(value, list) else [value]
    return max(items)


def gpufleet_serial_notes(value, n_hosts):
    """What the run makes of a valid ``gpufleet_serial`` that is not taken as written, one line each (``[]`` when
    every item is taken as written): a count above the ``n_hosts`` targeted hosts means all of them."""
    if gpufleet_unset(value) or gpufleet_serial_error(value):
        return []
    n_hosts = max(1, int(n_hosts or 1))
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    big = [i for i in items if not (isinstance(i, str) and _PCT.match(i)) and _count(i) > n_hosts]
    if not big:
        return []
    return ["gpufleet_serial=%s: %s more than the %d targeted host(s), so a batch takes all %d of them"
            % (_show(value, 40), "a count is" if len(big) == 1 else "counts are", n_hosts, n_hosts)]


def gpufleet_max_unavailable_error(value):
    """Why ``gpufleet_max_unavailable`` is not a count ≥ 1 or a percentage 0 < p ≤ 100 ('' when valid or unset)."""
    if gpufleet_unset(value):
        return ""
    problem = _serial_item_error(value)
    if not problem:
        return ""
    return ("gpufleet_max_unavailable=%s is not valid: %s. Give the most hosts that may be out of service at once "
            "(1, 2, ...) or a percentage of the targeted hosts (\"25%%\"); leave it empty for no limit"
            % (_show(value), problem))


def gpufleet_capacity_error(serial, max_unavailable, n_hosts):
    """Why a rolling restart with ``serial`` over ``n_hosts`` hosts would take out more hosts at once than
    ``max_unavailable`` (a count, or a percentage of ``n_hosts`` rounded down, at least 1) allows; '' when it
    would not, or when either value is unset or invalid (their own errors say so)."""
    if gpufleet_unset(max_unavailable) or gpufleet_max_unavailable_error(max_unavailable) or gpufleet_serial_error(serial):
        return ""
    n_hosts = max(1, int(n_hosts or 1))
    allowed = _hosts_of(max_unavailable.strip() if isinstance(max_unavailable, str) else max_unavailable, n_hosts)
    batch = gpufleet_batch_size(serial, n_hosts)
    if batch <= allowed:
        return ""
    return ("gpufleet_serial=%s takes %d of the %d targeted hosts out of service at once, more than "
            "gpufleet_max_unavailable=%s allows (%d); lower gpufleet_serial to %d or less, or raise "
            "gpufleet_max_unavailable" % (_show(serial) if not gpufleet_unset(serial) else "1 (default)", batch, n_hosts,
                                          _show(max_unavailable), allowed, allowed))


def _show(value, limit=60):
    """``value`` as a message shows it: a string quoted, anything cut to ``limit`` characters (a 20-digit or a
    thousand-digit number stays readable; one Python will not print in full is named by its size)."""
    try:
        text = repr(value) if isinstance(value, str) else str(value)
    except ValueError:  # an int of more digits than sys.int_info.default_max_str_digits
        return "a number of about %d digits" % int(value.bit_length() * 0.30103)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _int_error(name, value, low, high, hint, point_ok=False):
    """Why ``value`` is not a whole number in ``low``..``high`` ('' when it is); ``point_ok``: "900.0" is 900."""
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        return "%s=%s is not a whole number; %s" % (name, _show(value), hint)
    try:
        text = str(value).strip()
        if isinstance(value, (int, float)):
            number = int(value)
        elif point_ok and float(text).is_integer():
            number = int(float(text))
        else:
            number = int(text)
    except (ValueError, OverflowError):
        return "%s=%s is not a whole number; %s" % (name, _show(value), hint)
    if number < low or (high is not None and number > high):
        return "%s=%s is out of range (%d%s); %s" % (
            name, _show(value), low, "-%d" % high if high is not None else " or more", hint)
    return ""


def _high(name):
    """The most ``name`` may be (schema.RANGES), None when it has no most."""
    rng = schema.RANGES.get(name)
    return rng.high if rng else None


def _zero_ok(name):
    """Whether 0 is a meaning for the number ``name`` (no grace, no wait: schema.RANGES)."""
    rng = schema.RANGES.get(name)
    return bool(rng and rng.zero_ok)


def _positive_error(name, value, whole, low, hint):
    """Why ``value`` is not a number (a whole one when ``whole``) of at least ``low`` ('' when it is)."""
    if whole:
        # "900.0" is a whole number to the roles' argument specs and modules (type int takes it), so here too.
        return _int_error(name, value, low, _high(name), hint, point_ok=True)
    if isinstance(value, bool):
        return "%s=%s is not a number; %s" % (name, _show(value), hint)
    try:
        number = float(str(value).strip()) if not isinstance(value, (int, float)) else float(value)
    except OverflowError:  # an int beyond a float (hundreds of digits): far above any bound
        number = float("inf")
    except ValueError:
        return "%s=%s is not a number; %s" % (name, _show(value), hint)
    high, zero_ok = _high(name), _zero_ok(name)
    if math.isnan(number) or number in (float("inf"), float("-inf")) or number < low or (
            low == 0 and number <= 0 and not zero_ok) or (high is not None and number > high):
        return "%s=%s is out of range (%s%s); %s" % (
            name, _show(value), "0" if zero_ok else "more than 0",
            (" to %s" % high) if high is not None else (" or more" if zero_ok else ""), hint)
    return ""


# The restart's timeouts, slices, poll intervals and the launch's and verification's numeric settings, and their
# ranges: schema.TUNABLES (whole numbers where the roles' argument specs declare an int).


def _tunable_wanted(name, whole, low):
    """What a schema.TUNABLES variable takes, in words: 'a whole number of ms (1-100)', 'seconds (more than 0)'."""
    rng = schema.RANGES.get(name)
    unit = (rng and rng.unit) or ("MiB" if name.endswith("_mib") else "ms" if name.endswith("_ms") else "seconds")
    high, zero_ok = _high(name), _zero_ok(name)
    if whole:
        return "a whole number of %s (%d%s)" % (unit, low, "-%d" % high if high is not None else " or more")
    return "%s (%s%s)" % (unit, "0" if zero_ok else "more than 0",
                          (" to %s" % high) if high is not None else (" or more" if zero_ok else ""))


# SGLang's spellings of the parallel sizes (launch-arg keys, without the dashes).
_SIZE_FLAGS = (("tp-size", "tensor-parallel-size", "tp"), ("pp-size", "pipeline-parallel-size"),
               ("dp-size", "data-parallel-size", "dp"))


def _launch_sizes(args):
    """(tp, pp, dp) sizes of an ``sglang_launch_args`` mapping (each 1 when unset; every spelling SGLang takes:
    --tp-size/--tensor-parallel-size/--tp, --pp-size/--pipeline-parallel-size, --dp-size/--data-parallel-size/
    --dp). None when they cannot be known here: not a mapping, a size that is no whole number, two spellings of
    one size, or a key that abbreviates a size flag (argparse takes a unique prefix; which one is unique depends
    on the release, which preflight knows and this filter does not)."""
    if not isinstance(args, Mapping):
        return None
    keys = [str(k).lstrip("-").replace("_", "-") for k in args]
    names = [n for group in _SIZE_FLAGS for n in group]
    if any(k not in names and any(n.startswith(k) for n in names) for k in keys if k):
        return None
    sizes = []
    for group in _SIZE_FLAGS:
        values = [v for k, v in zip(keys, args.values()) if k in group and not gpufleet_unset(v)]
        if len(values) > 1:
            return None  # two spellings of one size: preflight names the conflict
        try:
            sizes.append(max(int(str(values[0]).strip()), 1) if values else 1)
        except (TypeError, ValueError):
            return None  # the launch role's own checks name a size that is not a number
    return tuple(sizes)


def gpufleet_tp_pp_size(args):
    """tp-size × pp-size of ``sglang_launch_args`` (any SGLang spelling; see :func:`_launch_sizes`): the GPU
    worker processes one server starts without data parallelism, sglang_verify_min_workers' default. 1 when the
    sizes cannot be read here."""
    sizes = _launch_sizes(args)
    return sizes[0] * sizes[1] if sizes else 1


def _min_workers_error(values):
    """Why ``sglang_verify_min_workers`` can never be met ('' when it can): more than tp-size × pp-size × dp-size
    worker processes of ``sglang_launch_args``. Such a value passed the guard and failed every verify on a healthy
    new server, after the stop (an outage, then a rollback). '' too when either cannot be read here."""
    wanted = values.get("sglang_verify_min_workers")
    if gpufleet_unset(wanted) or _positive_error("sglang_verify_min_workers", wanted, True, 0, ""):
        return ""  # unset, or a value the tunables check already refuses
    try:
        sizes = _launch_sizes(values.get("sglang_launch_args"))
        bound = sizes[0] * sizes[1] * sizes[2] if sizes else None
        text = str(wanted).strip()
        number = int(wanted) if isinstance(wanted, (int, float)) else int(text) if _INT.match(text) else int(float(text))
    except Exception:  # noqa: BLE001 - a launch arg that cannot be templated here is preflight's to name
        return ""
    if bound is None or number <= bound:
        return ""
    return ("sglang_verify_min_workers=%s is more than the %s GPU worker processes the server starts (tp-size × "
            "pp-size × dp-size of sglang_launch_args), so the verification of a healthy server would fail; give "
            "%s or less, or do not set it for tp-size × pp-size" % (_show(wanted), bound, bound))


def gpufleet_guard_errors(values, host=None):
    """Type errors of the survey variables in ``values`` (mapping variable name → value, e.g. a host's
    ``hostvars[host]``), each naming the
    variable as the user set it and saying what to set instead. Unset values (None, ``""``) are fine.

    Checked: ``gpufleet_serial`` (see :func:`gpufleet_serial_error`), ``gpufleet_max_unavailable`` (see
    :func:`gpufleet_max_unavailable_error`), ``sglang_port`` (whole number 1-65535),
    ``gpufleet_lock_lease_s`` and the deprecated ``gpufleet_lock_stale_s`` (whole number of seconds ≥ 1),
    the switches (``schema.switches()``: type bool in the roles' argument specs) such as ``sglang_verify_throughput`` and ``gpufleet_rollback`` (a boolean or
    yes/no/true/false/on/off/1/0), ``target`` (a string: a host,
    group or pattern), and the restart's timeouts, slices, poll intervals and the launch's and verification's
    numeric settings (``schema.TUNABLES``: a number, whole where the role wants an int, in its range; checked here because
    their roles run after the stop), a fleet check's ``gpufleet_check`` and ``gpufleet_restart_verdicts``
    (:func:`.workflow.check_errors`), and ``sglang_verify_min_workers`` against the worker processes
    ``sglang_launch_args`` starts (see :func:`_min_workers_error`). ``host`` (str) prefixes each message when given.
    """
    # .get only: ``values`` may be a host's hostvars, whose other entries are templated only when read.
    values = values if values is not None else {}
    errors = []
    serial = gpufleet_serial_error(values.get("gpufleet_serial"))
    if serial:
        errors.append(serial)
    max_unavailable = gpufleet_max_unavailable_error(values.get("gpufleet_max_unavailable"))
    if max_unavailable:
        errors.append(max_unavailable)
    port = values.get("sglang_port")
    if not gpufleet_unset(port):
        rng = schema.RANGES["sglang_port"]
        problem = _int_error("sglang_port", port, rng.low, rng.high, "give the HTTP port SGLang listens on where it is "
                             "set (host_vars, group_vars or -e), or leave it empty for 30000")
        if problem:
            errors.append(problem)
    for name in ("gpufleet_lock_lease_s", "gpufleet_lock_stale_s", "gpufleet_lock_margin_s"):
        low = schema.RANGES[name].low
        lease = values.get(name)
        if not gpufleet_unset(lease):
            problem = _int_error(name, lease, low, _high(name), "give seconds (e.g. %d), or leave it empty for the "
                                 "default" % (300 if low else 60))
            if problem:
                errors.append(problem)
    for name, rng in schema.TUNABLES.items():
        whole, low = schema.is_whole(name), rng.low
        value = values.get(name)
        if isinstance(value, str) and not value.strip() and not rng.empty_is_default:
            errors.append("%s is empty; give a value, or do not set it at all (no -e, nothing in the inventory) "
                          "for the role's default" % name)
            continue
        if not gpufleet_unset(value):
            problem = _positive_error(name, value, whole, low, "give %s, or do not set it for the role's default"
                                      % _tunable_wanted(name, whole, low))
            if problem:
                errors.append(problem)
    workers = _min_workers_error(values)
    if workers:
        errors.append(workers)
    for name in schema.switches():
        value = values.get(name)
        if not gpufleet_unset(value) and not _is_bool_like(value):
            errors.append("%s=%s is not a boolean; give true or false (yes/no), or %s"
                          % (name, _show(value), _BOOL_UNSET.get(name, "do not set it for the default")))
    target = values.get("target")
    if not gpufleet_unset(target) and not isinstance(target, str):
        errors.append("target=%s is a %s; give a host, a group or an Ansible host pattern as text "
                      "(e.g. gpu-01 or 'gpu_hosts:!gpu-07')" % (_show(target), type(target).__name__))
    # A fleet check's verdicts (an AWX workflow passes check.yml's gpufleet_check on): plugin_utils/workflow.py
    errors.extend(workflow.check_errors(values.get("gpufleet_check"), values.get("gpufleet_restart_verdicts")))
    if host:
        errors = ["%s: %s" % (host, e) for e in errors]
    return errors


# Variables whose messages here say more than validate_argument_spec's: the serial and the capacity, the target,
# every number with a range and every switch. Every other variable a run was given is checked against its type and
# choices by ansible.builtin.validate_argument_spec (gpufleet_guard_argument_specs).
_OWN_MESSAGES = ("gpufleet_serial", "gpufleet_max_unavailable", "target", "gpufleet_check",
                 "gpufleet_restart_verdicts")


def _given(values, variables):
    """{name: value} of the schema's variables set in ``values`` (a host's hostvars: only the names it holds are
    read, so nothing else is templated) that the messages here do not cover: not unset, not a raw type without
    choices. A value that cannot be templated here is left to the role that reads it."""
    own = set(_OWN_MESSAGES) | set(schema.RANGES) | set(schema.switches(variables))
    given = {}
    for name, var in variables.items():
        if name in own or name not in values or (var.type == "raw" and not var.choices):
            continue
        try:
            value = values[name]
        except Exception:  # noqa: BLE001 - e.g. a value templated from facts not gathered yet
            continue
        if not gpufleet_unset(value):
            given[name] = _stand_in(value) if var.no_log else value
    return given


def _stand_in(value):
    """A secret's stand-in of the same type, so validate_argument_spec checks its type while the value itself never
    reaches the task's arguments, its loop item or the job events (the registered result holds both)."""
    for kind, stand_in in ((bool, False), (str, "********"), (int, 0), (float, 0.0), (Mapping, {}), (list, [])):
        if isinstance(value, kind):
            return stand_in
    return "********"


def gpufleet_guard_argument_specs(hostvars, hosts):
    """What ``ansible.builtin.validate_argument_spec`` checks for a run over ``hosts`` (list of names) read from
    ``hostvars``: a list with one entry per distinct set of given values (usually one: extra variables and group
    variables are alike on every host), each ``{"hosts": [...], "argument_spec": {...}, "provided_arguments":
    {...}}``; the spec is the schema's (types, choices, elements; no defaults, nothing required) for the names
    given. [] when no host was given such a variable."""
    variables = schema.load()
    groups = []
    for host in hosts or []:
        given = _given(hostvars[host], variables)
        if not given:
            continue
        for group in groups:
            if group["provided_arguments"] == given:
                group["hosts"].append(host)
                break
        else:
            groups.append({"hosts": [host], "argument_spec": schema.argument_spec(given, variables),
                           "provided_arguments": given})
    return groups


def _validated_errors(validated, hosts):
    """{message: [hosts]} from the registered results of validate_argument_spec over
    :func:`gpufleet_guard_argument_specs`'s entries (its loop's ``results``, or one result)."""
    seen = {}
    if isinstance(validated, Mapping):
        validated = validated.get("results", [validated])
    for result in validated or []:
        if not isinstance(result, Mapping):
            continue
        item = result.get("item") if isinstance(result.get("item"), Mapping) else {}
        for error in result.get("argument_errors") or []:
            # the values are validated nested under gpufleet_guard_values (playbooks/tasks/guards.yml says why)
            error = str(error).replace(" found in 'gpufleet_guard_values'.", "").replace(
                " found in gpufleet_guard_values", "")
            message = ("%s (the type the roles' argument specs give it); fix it where it is set (host_vars, "
                       "group_vars, an AWX survey or -e), or do not set it for the default" % str(error).rstrip("."))
            seen.setdefault(message, []).extend(h for h in item.get("hosts", hosts) if h in hosts)
    return seen


def gpufleet_guard_report(hostvars, hosts, validated=None):
    """:func:`gpufleet_guard_errors` over ``hosts`` (list of names) read from ``hostvars``, and the errors
    validate_argument_spec found (``validated``: its registered result over
    :func:`gpufleet_guard_argument_specs`): one message per distinct problem, suffixed with the hosts it concerns
    when it does not concern them all."""
    hosts = list(hosts or [])
    seen = {}
    for host in hosts:
        for message in gpufleet_guard_errors(hostvars[host]):
            seen.setdefault(message, []).append(host)
    for message, where in _validated_errors(validated, hosts).items():
        bucket = seen.setdefault(message, [])
        for host in where:
            if host not in bucket:
                bucket.append(host)
    if hosts:
        # The capacity guard concerns the run, not one host: serial and the limit are read from the first target.
        first = hostvars[hosts[0]]
        capacity = gpufleet_capacity_error(first.get("gpufleet_serial"), first.get("gpufleet_max_unavailable"),
                                           len(hosts))
        if capacity:
            seen.setdefault(capacity, list(hosts))
    return hosts_report(seen, hosts)


def hosts_report(seen, hosts):
    """``seen`` (message -> list of the hosts it concerns, in order) as a list of messages, each suffixed with the
    hosts it concerns when it does not concern all of ``hosts`` (at most 10 named)."""
    report = []
    for message, where in seen.items():
        if len(where) < len(hosts):
            message += " (on %s)" % ", ".join(where[:10]) + (" and %d more" % (len(where) - 10) if len(where) > 10 else "")
        report.append(message)
    return report


def gpufleet_guard_deprecations(hostvars, hosts):
    """Deprecation notices for variables set on any of ``hosts``: ``gpufleet_lock_stale_s`` (use
    ``gpufleet_lock_lease_s``; the old value is still used as the lease when the new name is unset)."""
    for host in hosts or []:
        values = hostvars[host]
        if not gpufleet_unset(values.get("gpufleet_lock_stale_s")):
            return ["gpufleet_lock_stale_s is deprecated: set gpufleet_lock_lease_s instead (the restart lock is a "
                    "lease the running restart renews; a stopped run's lock is taken over once the lease expired). "
                    "Its value is used as the lease while gpufleet_lock_lease_s is unset."]
    return []


def gpufleet_guard_notes(hostvars, hosts):
    """Notes on valid values the run does not take as written, over ``hosts`` (list of names) read from
    ``hostvars``: a ``gpufleet_serial`` count above the targeted hosts (see :func:`gpufleet_serial_notes`)."""
    hosts = list(hosts or [])
    if not hosts:
        return []
    return gpufleet_serial_notes(hostvars[hosts[0]].get("gpufleet_serial"), len(hosts))
