# -*- coding: utf-8 -*-
# gpufleet: which process is the managed SGLang server (pid file or systemd unit), whether it runs, and since when.
# Plain functions: sglang_host_info and sglang_fleet_check_info call them.
from __future__ import absolute_import, division, print_function

import errno
import os
import time

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_pid_file import UNREADABLE, read_pid_file

try:
    import psutil
    HAS_PSUTIL = True
    PSUTIL_IMPORT_ERROR = None
except ImportError as exc:  # pid_running falls back to kill(pid, 0); process_start needs psutil
    psutil = None
    HAS_PSUTIL = False
    PSUTIL_IMPORT_ERROR = exc


class ServerFindError(Exception):
    """The managed server's pid cannot be read; ``kwargs`` are extra fail_json arguments (rc, stdout, stderr)."""

    def __init__(self, msg, **kwargs):
        super(ServerFindError, self).__init__(msg)
        self.msg = msg
        self.kwargs = kwargs


def systemd_main_pid(run_command, systemctl, unit):
    """MainPID of ``unit`` (None when 0: not running) from ``systemctl show``; ``run_command(argv)`` returns
    (rc, stdout, stderr) as ``AnsibleModule.run_command`` does. Raises :class:`ServerFindError`."""
    rc, stdout, stderr = run_command([systemctl, "show", "--property", "MainPID", "--value", unit])
    if rc != 0:
        raise ServerFindError("could not read MainPID of %s" % unit, rc=rc, stdout=stdout, stderr=stderr)
    try:
        pid = int(stdout.strip() or 0)
    except ValueError:
        raise ServerFindError("unexpected MainPID of %s: %r" % (unit, stdout), rc=rc, stdout=stdout, stderr=stderr)
    return pid or None


def pid_running(pid):
    if pid is None:
        return False
    if HAS_PSUTIL:
        return psutil.pid_exists(pid)
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def find_managed_server(pid_file=None, systemd_unit=None, run_command=None, systemctl=None):
    """``{"managed_pid", "managed_running"}`` (sglang_host_info's keys) of the server named by ``pid_file`` or
    ``systemd_unit``. Raises :class:`ServerFindError` when the pid file or the unit's MainPID cannot be read."""
    managed_pid = None
    if pid_file:
        read = read_pid_file(pid_file)
        if read.problem == UNREADABLE:
            raise ServerFindError("cannot read pid file %s: %s" % (pid_file, read.error))
        managed_pid = read.pid  # None when missing, empty or garbage: no managed server
    if systemd_unit:
        managed_pid = systemd_main_pid(run_command, systemctl, systemd_unit)
    return {"managed_pid": managed_pid, "managed_running": pid_running(managed_pid)}


def process_start(pid, now=time.time):
    """When process ``pid`` started and when that was read, both Unix time from this host's clock (psutil
    ``create_time``): ``{"create_time", "now"}``; ``{"error"}`` when it cannot be read (gone, psutil missing)."""
    if not HAS_PSUTIL:
        return {"error": "psutil is not installed: %s" % PSUTIL_IMPORT_ERROR}
    try:
        return {"create_time": psutil.Process(int(pid)).create_time(), "now": now()}
    except (psutil.Error, ValueError, TypeError) as exc:
        return {"error": "cannot read the start of pid %s: %s" % (pid, exc)}
