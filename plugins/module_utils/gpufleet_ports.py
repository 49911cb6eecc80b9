# -*- coding: utf-8 -*-
# gpufleet: who listens on a TCP port, and whether that listener keeps a server from binding its address; the one
# port check of sglang_process (the launch), sglang_stop (start_after) and the host reads (sglang_host_info,
# preflight, the fleet check).
"""TCP listeners on a port (psutil) and whether one overlaps the address a server will bind.

:func:`addresses_overlap` follows what Linux does on ``bind()`` without SO_REUSEPORT:

- ``::`` (and the empty host, "all interfaces") is taken as dual-stack: the kernel's default
  (``net.ipv6.bindv6only=0``) and what uvicorn/SGLang get for ``--host ::``. A listener's IPV6_V6ONLY cannot be read
  from /proc/net/tcp6, so a listener on ``::`` is taken as covering IPv4 as well: it overlaps every address. That may
  call a port taken that a V6ONLY listener would have left free; the opposite mistake starts a server that dies
  on EADDRINUSE, which costs more.
- ``0.0.0.0`` covers every IPv4 address (and IPv4-mapped ones), no IPv6 address: a server on ``::1`` binds beside
  a listener on ``0.0.0.0``.
- IPv4-mapped IPv6 (``::ffff:a.b.c.d``) is its IPv4 address; ``::1`` and ``127.0.0.1`` are different addresses.
- Otherwise two addresses overlap when they are equal. A host name is resolved (getaddrinfo) and overlaps when any
  of its addresses does; a name that does not resolve overlaps only the wildcards.
"""
from __future__ import absolute_import, division, print_function

import functools
import ipaddress
import socket

try:
    import psutil
except ImportError:  # reported by the calling module with missing_required_lib("psutil")
    psutil = None

__metaclass__ = type

WILDCARDS = ("0.0.0.0", "::", "")
_ANY4 = ipaddress.ip_address("0.0.0.0")
_ANY6 = ipaddress.ip_address("::")


def _ip(text):
    """The ipaddress of ``text`` (brackets and a %scope dropped, IPv4-mapped IPv6 as IPv4), None for a name."""
    text = (text or "").strip().strip("[]").split("%", 1)[0]
    if text == "":
        return _ANY6  # every interface, both families
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


@functools.lru_cache(maxsize=16)
def _host_ips(host):
    """The addresses ``host`` stands for: its own when it is an address, else what it resolves to (maybe none);
    resolved once per name and module run (a port has a few listeners, each compared with it)."""
    ip = _ip(host)
    if ip is not None:
        return (ip,)
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    except (socket.error, UnicodeError):
        return ()
    return tuple(ip for ip in (_ip(info[4][0]) for info in infos) if ip is not None)


def _overlap(a, b):
    if a == _ANY6 or b == _ANY6:
        return True
    if a == _ANY4:
        return b.version == 4
    if b == _ANY4:
        return a.version == 4
    return a == b


def addresses_overlap(bind_host, listen_ip):
    """True when a socket listening on ``listen_ip`` keeps a server from binding ``bind_host`` on the same port
    (the rules are in this module's docstring)."""
    listen = _ip(listen_ip)
    if listen is None:  # not an address (psutil gives addresses): only a name can match it
        return (listen_ip or "") == (bind_host or "")
    binds = _host_ips(bind_host)
    if not binds:  # a name that does not resolve: the wildcards are the listeners sure to be in its way
        return listen in (_ANY4, _ANY6)
    return any(_overlap(bind, listen) for bind in binds)


def tcp_listeners(port):
    """The listening TCP sockets on ``port``: psutil.net_connections("tcp") (/proc/net/tcp{,6} mapped to pids
    through /proc/*/fd; ``pid`` None for another user's socket without root), as psutil's sconn tuples."""
    return [conn for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr[1] == port]
