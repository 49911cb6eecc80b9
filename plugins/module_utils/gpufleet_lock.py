# -*- coding: utf-8 -*-
# gpufleet: the per-host restart lock as a lease, shared by the gpufleet_lock module and any module that
# waits long while a restart holds the lock (sglang_process's readiness wait renews it).
"""Per-host restart lock held as a renewable lease, judged on the host's own clock.

Layout (unchanged from the mkdir lock of earlier releases, so either release sees the other's lock):
``<lock_dir>/`` (default ``<sglang_state_dir>/restart.lock``) holding ``owner.json``::

    {"run_id": "awx-4711", "controller": "awx-job-4711-abcde", "pid": 12, "user": "runner",
     "started": "2026-11-30T19:20:00Z", "started_epoch": 1796066400.0,
     "renewed": "2026-11-30T19:21:40Z", "renewed_at": 1796066500.0,
     "lease_s": 300, "expires": "2026-11-30T19:26:40Z", "expires_at": 1796066800.0}

``run_id``/``controller``/``pid``/``user`` describe the run on the controller (the caller passes them);
every time (``*_epoch``, ``renewed_at``, ``expires_at``: seconds since the epoch) is taken from the host's
``time.time()`` by the code that writes the file, so no two machines' clocks are ever compared: the lease
expires at ``renewed_at + lease_s`` on the host, whichever controller asks.

A lock without lease fields (written by an earlier release, or by hand) expires ``lease_s`` (the caller's)
after the newest mtime of the directory and ``owner.json``.

Every read-modify-write runs under ``flock(2)`` on ``<lock_dir>.guard`` (a sibling file that is never
removed), so a take-over, a renewal and a release on the same host never interleave; the kernel drops the
flock when the process dies, so the guard never outlives its holder. The lock directory is still created
with ``mkdir(2)``, which also keeps a run of an earlier release (mkdir only) out.

Nothing here needs Ansible or third-party packages.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time

OWNER_FILE = "owner.json"
DEFAULT_LEASE_S = 300


class LockError(Exception):
    """The lock could not be read or written (permissions, a file where a directory belongs, bad JSON)."""


class LockLost(LockError):
    """This run no longer holds the lock: it is gone (removed by unlock.yml) or another run took it over
    after the lease expired. ``.holder`` is the current owner record (dict) or None when there is no lock."""

    def __init__(self, msg, holder=None):
        super().__init__(msg)
        self.holder = holder


def _iso(epoch):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


class _Guard(object):
    """Exclusive flock on ``<lock_dir>.guard`` for the duration of a ``with`` block."""

    def __init__(self, lock_dir):
        self.path = lock_dir.rstrip("/") + ".guard"
        self.fd = None

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o640)  # state files: owner and group (issue 31)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as exc:
            if self.fd is not None:
                os.close(self.fd)
            raise LockError("cannot open or flock %s: %s" % (self.path, exc))
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # closing drops the flock
        return False


class _NoGuard(object):
    """Stands in for _Guard where nothing is written (check mode, no state directory yet)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _guard(lock_dir, check_mode=False):
    parent = os.path.dirname(lock_dir.rstrip("/")) or "."
    if check_mode or not os.path.isdir(parent):
        return _NoGuard()
    return _Guard(lock_dir)


def read_holder(lock_dir, lease_s=DEFAULT_LEASE_S, now=None):
    """The current holder of ``lock_dir``, or None when there is no lock directory.

    Returns the owner record (see the module docstring) plus ``expires_at`` (float, host epoch s),
    ``expires``, ``expired`` (bool), ``remaining_s`` (float, s; negative once expired), ``legacy`` (bool: no
    lease fields, expiry from mtime + ``lease_s``) and ``unreadable`` (str or absent: why owner.json could
    not be read; such a lock is judged by its mtime like a legacy one).
    ``now`` (host epoch s) defaults to ``time.time()``. Raises LockError when ``lock_dir`` exists but is not a
    directory.
    """
    now = time.time() if now is None else now
    try:
        dir_stat = os.stat(lock_dir)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LockError("cannot stat %s: %s" % (lock_dir, exc))
    if not os.path.isdir(lock_dir):
        raise LockError("%s exists and is not a directory; remove it (playbooks/unlock.yml)" % lock_dir)
    path = os.path.join(lock_dir, OWNER_FILE)
    record = {}
    mtime = dir_stat.st_mtime
    try:
        with open(path) as handle:
            record = json.load(handle)
        mtime = max(mtime, os.stat(path).st_mtime)
        if not isinstance(record, dict):
            record = {"unreadable": "owner.json holds no JSON object"}
    except FileNotFoundError:
        record = {"unreadable": "no owner.json"}
    except (OSError, ValueError) as exc:
        record = {"unreadable": "owner.json: %s" % exc}
    try:
        renewed_at = float(record["renewed_at"])
        held_lease_s = float(record["lease_s"])
        legacy = False
    except (KeyError, TypeError, ValueError):
        renewed_at = mtime
        held_lease_s = float(lease_s)
        legacy = True
    expires_at = renewed_at + held_lease_s
    record.setdefault("run_id", "unknown")
    record.update({
        "expires_at": expires_at,
        "expires": _iso(expires_at),
        "expired": now >= expires_at,
        "remaining_s": round(expires_at - now, 1),
        "legacy": legacy,
    })
    if legacy:
        record.setdefault("renewed", _iso(renewed_at))
        record["renewed_at"] = renewed_at
        record["lease_s"] = held_lease_s
    return record


def _write_record(lock_dir, record):
    path = os.path.join(lock_dir, OWNER_FILE)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        with open(tmp, "w") as handle:
            json.dump(record, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o640)  # state files: owner and group only (issue 31)
        os.replace(tmp, path)  # readers see the old or the new record, never half of one
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise LockError("cannot write %s: %s" % (path, exc))


def _renewed(record, lease_s, now):
    out = dict(record)
    for key in ("expired", "remaining_s", "legacy", "unreadable"):
        out.pop(key, None)
    out.update({"lease_s": int(lease_s), "renewed_at": now, "renewed": _iso(now),
                "expires_at": now + lease_s, "expires": _iso(now + lease_s)})
    return out


def take_lease(lock_dir, owner, lease_s=DEFAULT_LEASE_S, take_over_run_id=None, check_mode=False, now=None,
               legacy_lease_s=None):
    """Take the lock for ``owner`` unless another run holds an unexpired lease.

    ``owner``: dict with at least ``run_id`` (str; the identity renewals and the release are checked
    against), usually also ``controller``, ``pid``, ``user`` (the controller side of the run).
    ``lease_s`` (int, s): how long the lock stays valid without a renewal. ``take_over_run_id``: take the lock
    even if unexpired when its holder's run_id is exactly this (the caller proved that run dead; a lock that
    changed hands meanwhile is not touched). ``legacy_lease_s`` (s; default ``lease_s``): how long a lock without
    lease fields (an earlier release's) counts as held after its mtime. Creates the parent directory (0755)
    when missing.

    Returns ``(result, holder)``: result is ``"taken"`` (no lock, or it was ours already: renewed),
    ``"taken_over"`` (expired or named by ``take_over_run_id``: ``holder`` is the previous owner) or
    ``"refused"`` (``holder`` holds it: its record from :func:`read_holder`). In ``check_mode`` nothing is
    written and the result says what would happen. Raises LockError on I/O errors.
    """
    now = time.time() if now is None else now
    lease_s = int(lease_s)
    parent = os.path.dirname(lock_dir.rstrip("/"))
    if not check_mode and parent and not os.path.isdir(parent):
        try:
            os.makedirs(parent, 0o755)
        except OSError as exc:
            raise LockError("cannot create the state directory %s: %s" % (parent, exc))
    with _guard(lock_dir, check_mode):
        holder = read_holder(lock_dir, legacy_lease_s or lease_s, now)
        result = "taken"
        if holder is not None:
            if holder.get("run_id") == str(owner["run_id"]) and not holder.get("legacy"):
                result = "taken"  # a rerun of the same task, e.g. a retried play: renew
            elif holder["expired"] or (take_over_run_id is not None
                                       and holder.get("run_id") == str(take_over_run_id)):
                result = "taken_over"
            else:
                return "refused", holder
        if check_mode:
            return result, holder
        if result == "taken_over":
            shutil.rmtree(lock_dir, ignore_errors=True)
        if result == "taken_over" or holder is None:
            try:
                os.mkdir(lock_dir, 0o755)
            except OSError as exc:
                if exc.errno == errno.EEXIST:
                    # An earlier release (mkdir, no flock) created it between our read and mkdir.
                    return "refused", read_holder(lock_dir, legacy_lease_s or lease_s, now)
                raise LockError("cannot create %s: %s" % (lock_dir, exc))
        record = dict((k, v) for k, v in owner.items() if v is not None)
        record["run_id"] = str(owner["run_id"])
        if holder is not None and result == "taken":
            record["started"] = holder.get("started")
            record["started_epoch"] = holder.get("started_epoch")
        else:
            record["started"] = _iso(now)
            record["started_epoch"] = now
        _write_record(lock_dir, _renewed(record, lease_s, now))
        return result, holder


def renew_lease(lock_dir, owner_id, lease_s=None, now=None):
    """Push this run's lease forward: ``expires_at = now + lease_s`` on the host's clock.

    For modules that wait long while a restart holds the lock (e.g. a readiness poll loop): call it every
    poll, or at least every ``lease_s / 3`` s (cheap: one flock, one small read and one atomic rename; use
    :class:`LeaseRenewer` to throttle). ``lock_dir`` (path): the lock directory the run took
    (``<sglang_state_dir>/restart.lock``). ``owner_id`` (str): the ``run_id`` the run took it with.
    ``lease_s`` (int, s): new lease length; None keeps the one recorded at take time.

    Returns the new owner record (dict, see the module docstring; ``expires_at`` in host epoch s).
    Raises LockLost when the lock is gone or held by another run_id (the caller should stop what it does
    on this host and say so: another run may be restarting it), LockError on I/O errors.
    """
    now = time.time() if now is None else now
    with _guard(lock_dir):
        holder = read_holder(lock_dir, lease_s or DEFAULT_LEASE_S, now)
        if holder is None:
            raise LockLost("the restart lock %s is gone (removed by playbooks/unlock.yml or by hand); this run "
                           "no longer owns the host" % lock_dir)
        if holder.get("run_id") != str(owner_id):
            raise LockLost("the restart lock %s is now held by run %s from %s (this run's lease expired and it "
                           "was taken over); this run no longer owns the host"
                           % (lock_dir, holder.get("run_id"), holder.get("controller", "?")), holder)
        new = _renewed(holder, lease_s if lease_s else holder["lease_s"], now)
        _write_record(lock_dir, new)
        return new


class LeaseRenewer(object):
    """Throttled :func:`renew_lease` for poll loops: ``tick()`` renews when ``every_s`` passed since the last.

    ``every_s`` (s) defaults to a third of the recorded lease (at most 30 s), learnt from the first renewal.
    ``tick()`` returns the new record when it renewed, else None; it raises like :func:`renew_lease`.
    """

    def __init__(self, lock_dir, owner_id, lease_s=None, every_s=None, clock=time.monotonic):
        self.lock_dir = lock_dir
        self.owner_id = owner_id
        self.lease_s = lease_s
        self.every_s = every_s
        self._clock = clock
        self._last = None

    def tick(self):
        now = self._clock()
        if self._last is not None and now - self._last < (self.every_s or 0):
            return None
        record = renew_lease(self.lock_dir, self.owner_id, self.lease_s)
        self._last = now
        if self.every_s is None:
            self.every_s = min(30.0, float(record["lease_s"]) / 3.0)
        return record


def release_lease(lock_dir, owner_id, check_mode=False):
    """Remove the lock if ``owner_id`` (run_id) holds it.

    Returns ``(result, holder)``: ``"released"``, ``"absent"`` (no lock) or ``"not_owner"`` (another run took it
    over after our lease expired: left alone; ``holder`` names it). In ``check_mode`` nothing is removed.
    """
    with _guard(lock_dir, check_mode):
        holder = read_holder(lock_dir)
        if holder is None:
            return "absent", None
        if holder.get("run_id") != str(owner_id):
            return "not_owner", holder
        if not check_mode:
            shutil.rmtree(lock_dir)
        return "released", holder


def remove_lock(lock_dir, check_mode=False):
    """Remove the lock whoever holds it (playbooks/unlock.yml). Returns ``(removed, holder)``: removed is
    False when there was no lock (or in ``check_mode``); holder is the record before removal or None."""
    with _guard(lock_dir, check_mode):
        holder = read_holder(lock_dir)
        if holder is None:
            return False, None
        if not check_mode:
            shutil.rmtree(lock_dir)
        return not check_mode, holder


def describe(holder):
    """One line naming a lock holder (a :func:`read_holder` record, or None) for people: run, controller, pid,
    user, started, renewed, lease and when it expires; the gpufleet_lock module's and sglang_process's messages."""
    if not holder:
        return "nobody"
    if holder.get("remaining_s") is None:
        when = "expires %s" % holder.get("expires", "?")
    elif holder.get("expired"):
        when = "lease expired %s, %.0f s ago" % (holder.get("expires", "?"), -holder["remaining_s"])
    else:
        when = "lease expires %s, in %.0f s" % (holder.get("expires", "?"), holder["remaining_s"])
    text = "run %s from %s (pid %s, user %s, started %s, renewed %s, lease %s s, %s)" % (
        holder.get("run_id", "?"), holder.get("controller", "?"), holder.get("pid", "?"),
        holder.get("user", "?"), holder.get("started") or holder.get("taken_at") or "?",
        holder.get("renewed", "?"), int(float(holder.get("lease_s", 0))), when)
    if holder.get("unreadable"):
        text += " [%s]" % holder["unreadable"]
    return text
