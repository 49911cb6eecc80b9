"""The restart lock's controller-side decisions: whether the run that wrote a host lock certainly died.

Plain functions (no Ansible needed); the filter of the same name (plugins/filter/gpufleet.py) and the preflight core
call them. ``lock_plan`` (which phases renew the lease) is in :mod:`phases`.
"""
from __future__ import annotations

import os
import socket


# Hostnames that many machines share: a lock naming one of them may come from another controller.
_SHARED_HOSTNAMES = ("", "localhost", "localhost.localdomain")


def gpufleet_lock_holder_gone(holder):
    """True when the run that wrote a host lock (``holder``, from :func:`gpufleet_lock_owner`) certainly died.

    That is: it names this controller (``socket.gethostname()``, not a hostname many machines share) and
    its ``pid`` is no running ansible process here (``/proc/<pid>/cmdline``; a reused pid running something
    else counts as gone). A lock from another controller, or without a pid, is never judged gone: only
    ``gpufleet_lock_stale_s`` or a person can release it. Runs on the controller (filters do).
    """
    if not isinstance(holder, dict):
        return False
    controller = str(holder.get("controller") or "")
    if controller in _SHARED_HOSTNAMES or controller != socket.gethostname():
        return False
    try:
        pid = int(holder.get("pid"))
    except (TypeError, ValueError):
        return False
    if pid <= 1 or pid == os.getpid() or pid == os.getppid():
        return False
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            cmdline = handle.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return b"ansible" not in cmdline
