"""module_utils/gpufleet_ports.py: the one port check (which listener keeps a server from binding its address),
used by the launch and start_after (gpufleet_spawn.port_listeners) and the host reads (port_info)."""
import socket

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_host_measure as host_measure
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_ports as ports
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_spawn as spawn

# (address the server will bind, address a listener holds, overlap?)
OVERLAP = [
    # IPv4
    ("127.0.0.1", "127.0.0.1", True),
    ("127.0.0.1", "10.0.0.5", False),
    ("10.0.0.5", "127.0.0.1", False),
    ("0.0.0.0", "10.0.0.5", True),
    ("127.0.0.1", "0.0.0.0", True),
    ("0.0.0.0", "0.0.0.0", True),
    # IPv6 wildcard: dual-stack, a listener's IPV6_V6ONLY unknown counts as covering IPv4 too
    ("::", "127.0.0.1", True),
    ("127.0.0.1", "::", True),
    ("10.0.0.5", "::", True),
    ("0.0.0.0", "::", True),
    ("::", "0.0.0.0", True),
    ("::", "::1", True),
    ("::1", "::", True),
    ("[::]", "10.0.0.5", True),
    ("", "127.0.0.1", True),      # empty host: every interface
    ("", "::1", True),
    # IPv4 wildcard covers no IPv6 address
    ("0.0.0.0", "::1", False),
    ("::1", "0.0.0.0", False),
    ("0.0.0.0", "fd00::5", False),
    # loopbacks of the two families are different addresses
    ("::1", "127.0.0.1", False),
    ("127.0.0.1", "::1", False),
    ("::1", "::1", True),
    ("[::1]", "::1", True),
    ("fd00::5", "FD00:0:0::5", True),
    ("fd00::5", "fd00::6", False),
    # IPv4-mapped IPv6 is its IPv4 address
    ("127.0.0.1", "::ffff:127.0.0.1", True),
    ("::ffff:127.0.0.1", "127.0.0.1", True),
    ("::ffff:10.0.0.5", "0.0.0.0", True),
    ("0.0.0.0", "::ffff:10.0.0.5", True),
    ("::ffff:127.0.0.1", "::1", False),
    ("127.0.0.2", "::ffff:127.0.0.1", False),
    # names: resolved; one that does not resolve meets only the wildcards
    ("localhost", "127.0.0.1", True),
    ("localhost", "10.0.0.5", False),
    ("no-such-host.invalid", "0.0.0.0", True),
    ("no-such-host.invalid", "::", True),
    ("no-such-host.invalid", "127.0.0.1", False),
]


@pytest.mark.parametrize("bind,listen,overlap", OVERLAP)
def test_addresses_overlap_table(bind, listen, overlap):
    assert ports.addresses_overlap(bind, listen) is overlap


def test_both_callers_use_the_one_check():
    assert spawn.addresses_overlap is ports.addresses_overlap
    assert host_measure.addresses_overlap is ports.addresses_overlap
    assert spawn.WILDCARDS is ports.WILDCARDS is host_measure.WILDCARDS


@pytest.mark.parametrize("bind,taken", [("127.0.0.1", True), ("0.0.0.0", True), ("::", True), ("127.0.0.2", False),
                                        ("::1", False)])
def test_launch_and_host_read_agree_on_a_real_listener(bind, taken):
    pytest.importorskip("psutil")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        assert [c.laddr[0] for c in ports.tcp_listeners(port)] == ["127.0.0.1"]
        launch = spawn.port_listeners(port, bind)
        host = host_measure.port_info(port, bind, None)
    finally:
        sock.close()
    assert bool(launch) is taken
    assert host["free"] is (not taken)
    assert [item["address"] for item in host["listeners"]] == ["127.0.0.1"]  # listed, flagged or not
