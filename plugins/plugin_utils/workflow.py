"""restart.yml after a fleet check (an AWX workflow: check -> restart -> check): which targeted hosts to restart.

check.yml publishes its verdicts with ``set_stats`` as ``gpufleet_check`` (host -> {verdict, reasons, gpus_ok,
gpus_total}: :func:`.check.gpufleet_check_stats`). AWX keeps them as the check job's artifacts and passes them to
the workflow's next node as extra variables, so the restart job is given ``gpufleet_check``; run by hand it is
``-e @check-stats.json`` or nothing. Restarting a host the check found CRIT (a lost GPU, uncorrected ECC errors, an
Xid) would take down a server that still serves for a launch that cannot work; such a host is left untouched and
its summary row says why.

Plain functions, unit-tested in tests/unit/plugins/plugin_utils/test_workflow.py; the filters of
plugins/filter/gpufleet_workflow.py are their names in restart.yml, and the guard (:mod:`.guard`) refuses a
malformed ``gpufleet_check`` with :func:`check_errors`.

- ``check_errors(check, verdicts=None)`` -> list of str: why ``gpufleet_check`` / ``gpufleet_restart_verdicts`` are
  not what a run can act on ([] when unset or fine).
- ``restart_skips(targets, check, verdicts=None)`` -> {host: reason}: the targeted hosts not to restart.
- ``skip_rows(skips)`` -> {host: summary row} (result ``skipped``).
- ``restart_hosts(pattern, groups)`` -> the host pattern of restart.yml's preflight and rolling plays: the targets
  less the hosts of :data:`SKIPPED_GROUP`.
"""
from __future__ import annotations

from collections.abc import Mapping

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.check import SEVERITY_RANK, short_reasons
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.run import summary_rows

# The verdicts a check gives (plugins/plugin_utils/check.py) and the ones that let a host be restarted by default.
VERDICTS = tuple(sorted(SEVERITY_RANK, key=SEVERITY_RANK.get))
DEFAULT_VERDICTS = ("OK",)
# The in-memory inventory group restart.yml's guard play puts the skipped hosts in (ansible.builtin.add_host); the
# later plays' host pattern excludes it.
SKIPPED_GROUP = "gpufleet_restart_skipped"
SKIP_RESULT = "skipped"
_SHOWN = 5


def _unset(value):
    """None, an empty mapping or list, or a string that is blank: not given (an unanswered AWX survey question
    arrives as "")."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    return isinstance(value, (Mapping, list, tuple)) and not value


def _verdicts(verdicts):
    """``gpufleet_restart_verdicts`` as a tuple of upper-case words (:data:`DEFAULT_VERDICTS` when unset); a string
    (an AWX survey's text answer) is read as words separated by commas or blanks: ``"OK, WARN"``."""
    if verdicts is None or isinstance(verdicts, str) and not verdicts.strip():
        return DEFAULT_VERDICTS
    if isinstance(verdicts, str):
        verdicts = verdicts.replace(",", " ").split()
    return tuple(str(v).strip().upper() for v in verdicts)


def _names(hosts):
    hosts = [str(h) for h in hosts]
    return ", ".join(hosts[:_SHOWN]) + (" and %d more" % (len(hosts) - _SHOWN) if len(hosts) > _SHOWN else "")


def _kind(value):
    """What ``value`` is, in words (Ansible's own string and list types are str and list subclasses)."""
    for kind, word in ((bool, "boolean"), (str, "string"), (Mapping, "mapping"), ((list, tuple), "list"),
                       ((int, float), "number")):
        if isinstance(value, kind):
            return word
    return type(value).__name__


def check_errors(check, verdicts=None):
    """Why ``check`` (``gpufleet_check``) and ``verdicts`` (``gpufleet_restart_verdicts``) cannot decide which hosts
    to restart, one message per problem naming the variable; [] when ``check`` is unset (None, ``""``, ``{}``) or
    is host -> {verdict: OK|WARN|CRIT, ...} and ``verdicts`` is unset or a non-empty list of those words.

    A malformed value is refused before any host is touched rather than read as "no verdict" (every host skipped)
    or "no check" (every host restarted, CRIT ones too)."""
    errors = []
    if not _unset(check):
        if not isinstance(check, Mapping):
            errors.append("gpufleet_check is a %s; give the fleet check's verdicts as a mapping host -> {verdict: "
                          "OK|WARN|CRIT, ...} (check.yml's set_stats gpufleet_check, which an AWX workflow passes "
                          "on), or leave it unset to restart every targeted host" % _kind(check))
        else:
            bad = [h for h, entry in check.items()
                   if not isinstance(entry, Mapping) or str(entry.get("verdict") or "").upper() not in VERDICTS]
            if bad:
                errors.append("gpufleet_check gives no verdict (OK, WARN or CRIT) for %s; give check.yml's set_stats "
                              "gpufleet_check as it published it (host -> {verdict, reasons, gpus_ok, gpus_total}), "
                              "or leave it unset to restart every targeted host" % _names(bad))
    if verdicts is not None and not (isinstance(verdicts, str) and not verdicts.strip()):
        words = _verdicts(verdicts)
        unknown = [w for w in words if w not in VERDICTS]
        if not words:
            errors.append("gpufleet_restart_verdicts is empty, so no host could be restarted; give the verdicts "
                          "that let a host be restarted (e.g. [OK] or [OK, WARN]), or leave it unset for [OK]")
        elif unknown:
            errors.append("gpufleet_restart_verdicts names %s, which is not a verdict of the fleet check; give a "
                          "list of OK, WARN, CRIT (e.g. [OK, WARN]), or leave it unset for [OK]" % ", ".join(unknown))
    return errors


def restart_skips(targets, check, verdicts=None):
    """The targeted hosts a restart leaves untouched because of the fleet check ``check`` (``gpufleet_check``):
    {host: reason} in ``targets`` order, {} when ``check`` is unset (every target is restarted, as without a
    check).

    A host is restarted when its verdict is one of ``verdicts`` (``gpufleet_restart_verdicts``, default OK); a
    host whose verdict is another, and a host the check gave no verdict (it was not checked: another target or
    limit, or the artifact of one slice of a sliced check), is skipped. Input that :func:`check_errors` refuses
    skips nothing here (the guard has failed the run already)."""
    if _unset(check) or check_errors(check, verdicts):
        return {}
    allowed = _verdicts(verdicts)
    wanted = "/".join(allowed)
    skips = {}
    for host in targets or []:
        host = str(host)
        entry = check.get(host)
        if entry is None:
            skips[host] = ("not restarted: the fleet check (gpufleet_check) gave this host no verdict (it judged %d "
                           "other host(s): %s), so whether it is %s is not known"
                           % (len(check), _names(list(check)), wanted))
            continue
        verdict = str(entry.get("verdict")).upper()
        if verdict in allowed:
            continue
        reasons = short_reasons(entry.get("reasons") if isinstance(entry.get("reasons"), list) else [])
        gpus = ""
        if entry.get("gpus_total") not in (None, ""):
            gpus = ", GPUs ok %s/%s" % (entry.get("gpus_ok"), entry.get("gpus_total"))
        skips[host] = ("not restarted: the fleet check found it %s (%s%s); only %s hosts are restarted "
                       "(gpufleet_restart_verdicts)" % (verdict, reasons or "no reason given", gpus, wanted))
    return skips


def skip_rows(skips):
    """Summary rows (``run.ROW_KEYS``) for the hosts of :func:`restart_skips`: result ``skipped``, the reason as the
    cause, and what to do."""
    rows = {}
    for host, reason in (skips or {}).items():
        rows.update(summary_rows(
            [host], SKIP_RESULT, cause=reason,
            advice="nothing was changed on this host (untouched; its server, if one ran, still serves): fix what the "
                   "check names, check it again (playbooks/check.yml -e target=%s), then restart it" % host))
    return rows


def restart_hosts(pattern, groups=None):
    """The host pattern of restart.yml's preflight and rolling plays: ``pattern`` (the target) as it is when no
    host was skipped (no :data:`SKIPPED_GROUP` in ``groups``, the inventory's group -> hosts), else a list of
    ``pattern`` and the exclusion of that group (a list: a comma in ``pattern`` would make Ansible read
    ``a,b:!group`` as the two patterns ``a`` and ``b:!group``)."""
    if isinstance(groups, Mapping) and groups.get(SKIPPED_GROUP):
        return [pattern, "!" + SKIPPED_GROUP]
    return pattern
