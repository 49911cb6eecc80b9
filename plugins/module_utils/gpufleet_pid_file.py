# -*- coding: utf-8 -*-
# gpufleet: the one reader of a server's pid file (sglang_process, sglang_stop, sglang_host_info,
# sglang_worker_env_info and the fleet check all read it through read_pid_file).
"""Read a pid file once, and say what it holds.

A pid file (written by gpufleet_spawn.write_pid_file: the decimal pid and a newline) holds a pid when its
content, stripped of surrounding whitespace, is a decimal number greater than zero. Anything else is reported,
not guessed at: each caller decides what a missing, empty, garbage or unreadable file means for it (the stop
refuses garbage, the host read reports no server, the launch starts a new one).
"""
from __future__ import absolute_import, division, print_function

import errno
import os
import re
from collections import namedtuple

__metaclass__ = type

# What read_pid_file found besides a pid (``problem``); None when the file holds a pid.
MISSING = "missing"        # no such file (or a path component is not a directory)
EMPTY = "empty"            # the file is empty or only whitespace
GARBAGE = "garbage"        # not a decimal number > 0 ("abc", "-5", "0", "12 34")
UNREADABLE = "unreadable"  # it exists but cannot be read (permissions, a directory, I/O error)

_PID_RE = re.compile(r"[0-9]+\Z")


class PidFile(namedtuple("PidFile", "path pid mtime problem error")):
    """What a pid file holds: ``pid`` (int > 0, else None), ``mtime`` (its modification time, Unix seconds;
    None when it could not be read), ``problem`` (None, or MISSING, EMPTY, GARBAGE, UNREADABLE) and ``error``
    (None, or the text that says so: the OS error for MISSING/UNREADABLE, ``pid file P does not hold a pid:
    'text'`` for EMPTY/GARBAGE)."""

    __slots__ = ()

    @property
    def ok(self):
        return self.problem is None


def read_pid_file(path):
    """Read ``path`` once; returns a :class:`PidFile` and never raises for a missing or bad file."""
    try:
        with open(path) as handle:
            text = handle.read()
            mtime = os.fstat(handle.fileno()).st_mtime
    except (IOError, OSError) as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return PidFile(path, None, None, MISSING, str(exc))
        return PidFile(path, None, None, UNREADABLE, str(exc))
    except UnicodeDecodeError as exc:
        return PidFile(path, None, None, GARBAGE, "pid file %s does not hold a pid: %s" % (path, exc))
    text = text.strip()
    if not text:
        return PidFile(path, None, mtime, EMPTY, "pid file %s does not hold a pid: %r" % (path, text))
    if not _PID_RE.match(text) or int(text) <= 0:
        return PidFile(path, None, mtime, GARBAGE, "pid file %s does not hold a pid: %r" % (path, text[:80]))
    return PidFile(path, int(text), mtime, None, None)
