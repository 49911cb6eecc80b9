# -*- coding: utf-8 -*-
# gpufleet: Xid events of the NVIDIA driver from the kernel log (/dev/kmsg, or journalctl -k).
"""Xid events (``NVRM: Xid (PCI:0000:1b:00): 79, pid=..., GPU has fallen off the bus.``) from the kernel log.

NVML keeps no Xid history (FIELD-NOTES): the kernel log is the record. Sources, in order:

1. ``/dev/kmsg`` (or the file ``kmsg_path`` names), opened non-blocking and read one record per ``read``
   until EAGAIN (a plain ``head -c`` fails with EINVAL there: recordings/h200x1-health-driver580).
   Record format (Documentation/ABI/testing/dev-kmsg): ``<prio>,<seq>,<usec since boot>,<flags>;<text>``,
   continuation lines start with a space. A regular file in that format works the same (the lab's log).
2. ``journalctl -k -o json --since=-<N>min`` when /dev/kmsg cannot be opened.

Where ``kernel.dmesg_restrict=1`` both need root or CAP_SYSLOG. The caller then runs the module with
``become`` for that read when it may; otherwise the answer is *unknown* (``xid_events`` null, with the
reason), never an empty list, so "no Xid" is only said when the log was really read.
"""
from __future__ import annotations

import errno
import json
import os
import re
import time

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_errors import CallTimedOut, bounded_run

DEFAULT_KMSG_PATH = "/dev/kmsg"
XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),\s*(.*)$")
_JOURNAL_DENIED_RE = re.compile(r"not seeing messages from other users|No journal files were|"
                                r"Permission denied|insufficient permissions", re.I)
_READ_SIZE = 8192  # a /dev/kmsg record is at most ~1 KiB; a larger buffer never hits EINVAL
_MAX_RECORDS = 200000


def parse_xid(text):
    """``(pci_bus_id, xid, rest)`` of one kernel-log message, or None when it is not an Xid line.

    ``pci_bus_id`` is normalised to nvidia-smi's form (``00000000:1B:00.0``) so it matches ``pci_bus_id``
    of the GPU; the driver prints ``0000:1b:00`` (no function) in the Xid line.
    """
    m = XID_RE.search(text)
    if not m:
        return None
    return normalise_bus_id(m.group(1)), int(m.group(2)), m.group(3).strip()


def normalise_bus_id(text):
    """``0000:1b:00`` / ``0000:1b:00.0`` / ``00000000:1B:00.0`` -> ``00000000:1B:00.0``."""
    parts = text.strip().split(":")
    if len(parts) == 2:
        parts = ["0"] + parts
    if len(parts) != 3:
        return text.strip()
    dom, bus, devfn = parts
    if "." not in devfn:
        devfn += ".0"
    try:
        return "%08X:%02X:%s" % (int(dom, 16), int(bus, 16), devfn.upper())
    except ValueError:
        return text.strip()


def _iso(epoch):
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + ".%03dZ" % int((epoch % 1) * 1000)


def _records_from_kmsg(path, deadline_s):
    """Yield ``(usec_since_boot, text)`` for each record of a /dev/kmsg-format source."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        pending = b""
        count = 0
        started = time.monotonic()
        while count < _MAX_RECORDS and time.monotonic() - started < deadline_s:
            try:
                chunk = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                break  # EAGAIN: no more records now (the device never reports EOF)
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten while we read: the next read resumes at the oldest
                raise
            if not chunk:
                break  # a regular file: EOF
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            rec = None
            for raw in lines:
                if raw.startswith(b" ") and rec is not None:
                    continue  # continuation (KEY=value dictionary) lines
                line = raw.decode("utf-8", "replace")
                head, sep, text = line.partition(";")
                if not sep:
                    continue
                fields = head.split(",")
                try:
                    usec = int(fields[2])
                except (IndexError, ValueError):
                    continue
                rec = (usec, text)
                count += 1
                yield rec
    finally:
        os.close(fd)


def read_xid_kmsg(path=DEFAULT_KMSG_PATH, window_min=60, now_mono=None, now_wall=None, deadline_s=5.0):
    """Xid events of the last ``window_min`` minutes from a /dev/kmsg-format source.

    Returns ``[{"xid": int, "pci_bus_id": str, "time": ISO-8601 UTC str, "uptime_s": float, "text": str}]``
    in log order. ``time`` is the record's boot-relative time turned into wall time with this host's
    ``time.time() - time.monotonic()`` (printk uses the monotonic clock; a suspended laptop would drift,
    a server does not). Raises OSError (EACCES/EPERM under dmesg_restrict, ENOENT) for the caller.
    """
    now_mono = time.monotonic() if now_mono is None else now_mono
    now_wall = time.time() if now_wall is None else now_wall
    since_usec = (now_mono - window_min * 60.0) * 1e6
    boot_wall = now_wall - now_mono
    events = []
    for usec, text in _records_from_kmsg(path, deadline_s):
        if usec < since_usec:
            continue
        xid = parse_xid(text)
        if xid:
            bus, code, rest = xid
            events.append({"xid": code, "pci_bus_id": bus, "time": _iso(boot_wall + usec / 1e6),
                           "uptime_s": round(usec / 1e6, 3), "text": text.strip()})
    return events


def read_xid_journal(window_min=60, journalctl="journalctl", timeout_s=10.0, runner=bounded_run):
    """Xid events from ``journalctl -k -o json --since=-<N>min --no-pager`` (same dicts as
    :func:`read_xid_kmsg`, ``uptime_s`` from ``_SOURCE_MONOTONIC_TIMESTAMP`` when present).

    Raises OSError when journalctl is missing, fails, or says it shows only part of the journal (a user
    outside the systemd-journal group sees no kernel messages and would otherwise read as "no Xid").
    """
    argv = [journalctl, "-k", "-o", "json", "--no-pager", "--since=-%dmin" % max(1, int(window_min))]
    try:
        rc, out, err = runner(argv, timeout_s)
    except CallTimedOut as exc:
        raise OSError(errno.ETIMEDOUT, "journalctl -k did not answer in %.0f s" % exc.seconds)
    if rc == 127:
        raise OSError(errno.ENOENT, "journalctl is not installed (%s)" % err.strip())
    if rc != 0 or _JOURNAL_DENIED_RE.search(err or ""):
        raise OSError(errno.EACCES, "journalctl -k rc %s: %s" % (rc, (err or out).strip()[:300]))
    events = []
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        msg = rec.get("MESSAGE")
        if isinstance(msg, list):  # journald gives bytes as a list of ints
            msg = bytes(msg).decode("utf-8", "replace")
        if not isinstance(msg, str):
            continue
        xid = parse_xid(msg)
        if not xid:
            continue
        bus, code, dummy = xid
        try:
            wall = int(rec.get("__REALTIME_TIMESTAMP")) / 1e6
        except (TypeError, ValueError):
            wall = None
        try:
            up = round(int(rec.get("_SOURCE_MONOTONIC_TIMESTAMP")) / 1e6, 3)
        except (TypeError, ValueError):
            up = None
        events.append({"xid": code, "pci_bus_id": bus, "time": _iso(wall) if wall is not None else None,
                       "uptime_s": up, "text": msg.strip()})
    if not out.strip():
        # Nothing in the window: only "none" when the journal holds kernel messages at all (a container
        # without journald, or a user without access, gets an empty answer with rc 0).
        try:
            rc, any_out, err = runner([journalctl, "-k", "-n", "1", "-o", "json", "--no-pager"], timeout_s)
        except CallTimedOut:
            raise OSError(errno.ETIMEDOUT, "journalctl -k did not answer in %.0f s" % timeout_s)
        if rc != 0 or not any_out.strip():
            raise OSError(errno.ENODATA, "the journal holds no kernel messages of this boot (journald does not "
                                         "collect the kernel log here, or this user may not read it)")
    return events


def xid_report(window_min=60, kmsg_path=DEFAULT_KMSG_PATH, journal=True, runner=bounded_run,
               journalctl="journalctl"):
    """Read the Xid events of the last ``window_min`` minutes; never raises.

    Returns ``{"xid_events": [event] | None, "xid_status": "ok" | "unknown" | "skipped",
    "xid_source": "/dev/kmsg" (the path read) | "journalctl" | None, "xid_reason": str | None}``.
    ``window_min`` 0 skips the read. ``xid_events`` is None exactly when the log could not be read; then
    ``xid_reason`` says why (e.g. dmesg_restrict) and how to read it (become).
    """
    if not window_min:
        return {"xid_events": None, "xid_status": "skipped", "xid_source": None,
                "xid_reason": "xid_window_min is 0"}
    try:
        return {"xid_events": read_xid_kmsg(kmsg_path, window_min), "xid_status": "ok",
                "xid_source": kmsg_path, "xid_reason": None}
    except OSError as exc:
        first = "%s: %s" % (kmsg_path, exc.strerror or exc)
        if exc.errno in (errno.EACCES, errno.EPERM):
            first += " (kernel.dmesg_restrict=1 allows it only to root or CAP_SYSLOG: run this task with become)"
    if journal and kmsg_path == DEFAULT_KMSG_PATH:
        try:
            return {"xid_events": read_xid_journal(window_min, journalctl=journalctl, runner=runner),
                    "xid_status": "ok", "xid_source": "journalctl", "xid_reason": None}
        except OSError as exc:
            first += "; journalctl -k: %s" % (exc.strerror or exc)
    return {"xid_events": None, "xid_status": "unknown", "xid_source": None,
            "xid_reason": "kernel log not readable, Xid events unknown (not 'none'): " + first}
