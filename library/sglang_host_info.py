#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: host facts the preflight needs before an SGLang server is stopped.
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_host_info
short_description: Free disk, /dev/shm and the listener on the SGLang port, read before a restart
description:
  - Reports free space (MiB) on the filesystems holding O(paths) (C(os.statvfs); a path that does not exist yet
    is measured on its nearest existing parent), the size and free space of O(shm_path) and the stale
    SGLang/NCCL segments in it (C(nccl-*), C(cuda.shm.*), C(sgl_shm_*); listed, never removed).
  - Reports who listens on TCP O(port) (C(psutil.net_connections(kind="tcp")), status C(LISTEN)) with pid and
    command line, and whether that process is the managed server or one of its descendants, where the managed
    server is the pid in O(pid_file) or the C(MainPID) of O(systemd_unit).
  - Never changes anything.
version_added: "1.0.0"
author: gpufleet
requirements:
  - psutil (on the managed host, in the interpreter Ansible runs there) when O(port) is given
options:
  paths:
    description: Paths whose filesystem's free space is reported.
    type: list
    elements: path
    default: []
  shm_path:
    description: The shared-memory filesystem NCCL and SGLang use.
    type: path
    default: /dev/shm
  port:
    description: TCP port whose listeners are reported (the SGLang HTTP port).
    type: int
  host:
    description:
      - Address the server will bind (C(--host)); decides which listeners conflict. A listener on the same
        address, or either side on a wildcard address (C(0.0.0.0), C(::)), conflicts.
    type: str
    default: 127.0.0.1
  pid_file:
    description: Pid file of the managed server (C(launch_method=process)); a missing file means no managed server.
    type: path
  systemd_unit:
    description: Unit whose C(MainPID) is the managed server (C(launch_method=systemd)), read with C(systemctl show).
    type: str
attributes:
  check_mode:
    support: full
    description: Only reads; identical in check mode.
  diff_mode:
    support: none
    description: Nothing is changed.
  platform:
    support: full
    platforms: linux
notes:
  - Without root, C(psutil) cannot see the pid of sockets owned by other users; such a listener is reported with
    RV(port.listeners[].pid) null and counts as not managed. Run the module with become to see it.
"""

EXAMPLES = r"""
- name: Read disk, /dev/shm and port facts
  sglang_host_info:
    paths: [/var/lib/gpufleet, /models/target]
    port: 30000
    host: 127.0.0.1
    pid_file: /var/lib/gpufleet/sglang.pid
  register: host_facts

- name: The port must be free or held by the server being replaced
  ansible.builtin.assert:
    that: host_facts.port.free or host_facts.port.held_by_managed
"""

RETURN = r"""
disk:
  description: One entry per O(paths) item, in order.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The path asked for.
      type: str
    measured_path:
      description: The existing path measured (the path or its nearest existing parent).
      type: str
    exists:
      description: Whether the path itself exists.
      type: bool
    free_mib:
      description: Space available to unprivileged users (f_bavail), MiB.
      type: int
    total_mib:
      description: Filesystem size, MiB.
      type: int
shm:
  description: The shared-memory filesystem.
  returned: always
  type: dict
  contains:
    path:
      description: "O(shm_path)."
      type: str
    exists:
      description: Whether it exists.
      type: bool
    size_mib:
      description: Size, MiB.
      type: int
    free_mib:
      description: Free space (f_bavail), MiB.
      type: int
    used_mib:
      description: Used space, MiB.
      type: int
    stale_segments:
      description: Entries named like SGLang/NCCL segments (C(nccl-*), C(cuda.shm.*), C(sgl_shm_*)), with size in MiB.
      type: list
      elements: dict
      sample: [{"name": "nccl-a1b2c3", "size_mib": 9.0}]
port:
  description: Listeners on O(port); absent when O(port) is not given.
  returned: when O(port) is given
  type: dict
  contains:
    port:
      description: The port.
      type: int
    free:
      description: No listener conflicts with O(host).
      type: bool
    held_by_managed:
      description: Every conflicting listener is the managed server or its descendant (false when free).
      type: bool
    listeners:
      description: Every TCP listener on the port.
      type: list
      elements: dict
      contains:
        address:
          description: Bound address.
          type: str
        pid:
          description: Owning process, null when not visible.
          type: int
        cmdline:
          description: Its command line (argv).
          type: list
        conflicts:
          description: Whether it blocks binding O(host).
          type: bool
        managed:
          description: It is the managed server or a descendant of it.
          type: bool
managed_pid:
  description: Pid of the managed server from O(pid_file) or O(systemd_unit); null when none.
  returned: always
  type: int
managed_running:
  description: Whether RV(managed_pid) is a live process.
  returned: always
  type: bool
"""

import errno
import fnmatch
import os

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

try:
    import psutil
    HAS_PSUTIL = True
    PSUTIL_IMPORT_ERROR = None
except ImportError as exc:  # reported only when a port is asked for
    psutil = None
    HAS_PSUTIL = False
    PSUTIL_IMPORT_ERROR = exc

MIB = 1024 * 1024
# Left behind in /dev/shm by NCCL (nccl-*), CUDA IPC (cuda.shm.*) and SGLang (sgl_shm_*) when processes die
# by SIGKILL (FIELD-NOTES: a full /dev/shm makes the next start die with SIGBUS).
SEGMENT_PATTERNS = ("nccl-*", "cuda.shm.*", "sgl_shm_*")
WILDCARDS = ("0.0.0.0", "::", "")


def nearest_existing(path):
    """``path`` or its nearest existing parent (str)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def disk_free(path):
    """Free/total MiB of the filesystem holding ``path`` (os.statvfs: f_bavail and f_blocks × f_frsize)."""
    measured = nearest_existing(path)
    st = os.statvfs(measured)
    return {"path": path, "measured_path": measured, "exists": os.path.exists(path),
            "free_mib": st.f_bavail * st.f_frsize // MIB, "total_mib": st.f_blocks * st.f_frsize // MIB}


def shm_info(shm_path):
    """Size/free/used MiB of the shared-memory filesystem and the SGLang/NCCL segments in it."""
    out = {"path": shm_path, "exists": os.path.isdir(shm_path), "size_mib": 0, "free_mib": 0, "used_mib": 0,
           "stale_segments": []}
    if not out["exists"]:
        return out
    st = os.statvfs(shm_path)
    out["size_mib"] = st.f_blocks * st.f_frsize // MIB
    out["free_mib"] = st.f_bavail * st.f_frsize // MIB
    out["used_mib"] = (st.f_blocks - st.f_bfree) * st.f_frsize // MIB
    for name in sorted(os.listdir(shm_path)):
        if any(fnmatch.fnmatch(name, pattern) for pattern in SEGMENT_PATTERNS):
            try:
                size = os.lstat(os.path.join(shm_path, name)).st_size
            except OSError:
                continue
            out["stale_segments"].append({"name": name, "size_mib": round(size / float(MIB), 1)})
    return out


def read_pid_file(path):
    """Pid (int) written in ``path``, or None if the file is missing or holds no number."""
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except (IOError, OSError) as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise
    try:
        pid = int(text.split()[0]) if text else None
    except ValueError:
        return None
    return pid if pid and pid > 0 else None


def _conflicts(bound, wanted):
    """Whether a listener bound to ``bound`` blocks binding ``wanted`` on the same port (no SO_REUSEPORT)."""
    bound, wanted = bound or "", wanted or ""
    if bound in WILDCARDS or wanted in WILDCARDS:
        return True
    return bound == wanted or (bound.startswith("::ffff:") and bound[7:] == wanted)


def is_same_or_descendant(pid, ancestor):
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (psutil parents chain)."""
    if pid is None or ancestor is None:
        return False
    if pid == ancestor:
        return True
    try:
        return any(parent.pid == ancestor for parent in psutil.Process(pid).parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def listeners_on(port, host, managed_pid):
    """TCP listeners on ``port`` (psutil.net_connections(kind="tcp"), status LISTEN), with conflict/managed flags."""
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr[1] != port:
            continue
        cmdline = None
        if conn.pid is not None:
            try:
                cmdline = psutil.Process(conn.pid).cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                cmdline = None
        out.append({"address": conn.laddr[0], "pid": conn.pid, "cmdline": cmdline,
                    "conflicts": _conflicts(conn.laddr[0], host),
                    "managed": is_same_or_descendant(conn.pid, managed_pid)})
    return out


def port_info(port, host, managed_pid):
    listeners = listeners_on(port, host, managed_pid)
    conflicting = [item for item in listeners if item["conflicts"]]
    return {"port": port, "free": not conflicting, "listeners": listeners,
            "held_by_managed": bool(conflicting) and all(item["managed"] for item in conflicting)}


def systemd_main_pid(module, unit):
    systemctl = module.get_bin_path("systemctl", required=True)
    argv = [systemctl, "show", "--property", "MainPID", "--value", unit]
    rc, stdout, stderr = module.run_command(argv, environ_update={"LC_ALL": "C"})
    if rc != 0:
        module.fail_json(msg="could not read MainPID of %s" % unit, rc=rc, stdout=stdout, stderr=stderr)
    try:
        pid = int(stdout.strip() or 0)
    except ValueError:
        module.fail_json(msg="unexpected MainPID of %s: %r" % (unit, stdout), rc=rc, stdout=stdout, stderr=stderr)
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


def main():
    module = AnsibleModule(
        argument_spec=dict(
            paths=dict(type="list", elements="path", default=[]),
            shm_path=dict(type="path", default="/dev/shm"),
            port=dict(type="int"),
            host=dict(type="str", default="127.0.0.1"),
            pid_file=dict(type="path"),
            systemd_unit=dict(type="str"),
        ),
        mutually_exclusive=[["pid_file", "systemd_unit"]],
        supports_check_mode=True,
    )
    p = module.params
    if p["port"] is not None and not 0 < p["port"] < 65536:
        module.fail_json(msg="port must be between 1 and 65535, got %d" % p["port"])
    managed_pid = None
    try:
        if p["pid_file"]:
            managed_pid = read_pid_file(p["pid_file"])
    except (IOError, OSError) as exc:
        module.fail_json(msg="cannot read pid file %s: %s" % (p["pid_file"], exc))
    if p["systemd_unit"]:
        managed_pid = systemd_main_pid(module, p["systemd_unit"])
    try:
        result = dict(changed=False, disk=[disk_free(path) for path in p["paths"]], shm=shm_info(p["shm_path"]),
                      managed_pid=managed_pid, managed_running=pid_running(managed_pid))
    except OSError as exc:
        module.fail_json(msg="cannot measure free space: %s" % exc)
    if p["port"] is not None:
        if not HAS_PSUTIL:
            module.fail_json(msg=missing_required_lib("psutil", reason="to find the process listening on the port"),
                             exception=str(PSUTIL_IMPORT_ERROR))
        try:
            result["port"] = port_info(p["port"], p["host"], managed_pid if result["managed_running"] else None)
        except psutil.AccessDenied as exc:
            module.fail_json(msg="not allowed to list TCP sockets (%s); run with become" % exc)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
