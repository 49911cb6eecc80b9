"""Thin ctypes wrappers for the Linux calls the lab needs and Python 3.11 lacks (mount, umount, setns, unshare).

Each raises OSError with errno and the arguments on failure. Flags from <linux/sched.h> and <sys/mount.h>.
"""
import ctypes
import ctypes.util
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _b(s):
    return None if s is None else os.fsencode(s)


def mount(source, target, fstype, flags=0, data=None):
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
           "mount(%r, %r, %r, %#x, %r)" % (source, target, fstype, flags, data))


def umount(target, flags=0):
    _check(_libc.umount2(_b(target), flags), "umount2(%r)" % (target,))


def unshare(flags):
    _check(_libc.unshare(flags), "unshare(%#x)" % flags)


def setns(fd, nstype):
    _check(_libc.setns(fd, nstype), "setns(%d, %#x)" % (fd, nstype))


def set_pdeathsig(sig):
    """Ask the kernel to send ``sig`` to this process when its parent thread dies (prctl)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def set_comm(name):
    """Set /proc/self/comm (15 bytes max, what ps -o comm and psutil name() show) with prctl(PR_SET_NAME).

    setproctitle sets comm to the start of the title; real programs keep their executable's name."""
    _check(_libc.prctl(PR_SET_NAME, ctypes.c_char_p(os.fsencode(name)[:15]), 0, 0, 0), "prctl(PR_SET_NAME)")


def mounts_under(path):
    """Mount points at or below ``path`` in this mount namespace, deepest first (from mountinfo)."""
    path = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == path or mp.startswith(path.rstrip("/") + "/"):
                found.append(mp)
    return sorted(set(found), key=lambda p: -p.count("/"))
