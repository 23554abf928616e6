"""nbtrain.net on this machine's real interfaces (routing across nodes: tests/multinode)."""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import subprocess

import psutil
import pytest

from nbtrain import net
from nbtrain.errors import ClusterError, ConfigError


def _ip_addr() -> dict[str, set[str]]:
    """Interface -> IPv4 addresses as iproute2 reports them: a second source to check psutil's."""
    out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, check=True)
    return {
        link["ifname"]: {a["local"] for a in link.get("addr_info", []) if a["family"] == "inet"}
        for link in json.loads(out.stdout)
        if "UP" in link.get("flags", [])
    }


def _lan() -> tuple[net.Interface, ipaddress.IPv4Interface]:
    """A non-loopback interface with an IPv4 address and its subnet, or skip."""
    for iface in net.interfaces():
        if iface.loopback:
            continue
        for a in psutil.net_if_addrs()[iface.name]:
            if a.family == socket.AF_INET and a.netmask:
                return iface, ipaddress.IPv4Interface(f"{a.address}/{a.netmask}")
    pytest.skip("this machine has no non-loopback interface with an IPv4 address")


def _peer_in(subnet: ipaddress.IPv4Interface) -> str:
    """Another address in the interface's subnet: on-link, reached through that interface."""
    mine = subnet.ip
    for host in subnet.network.hosts():
        if host != mine and str(host) not in net.local_addresses():
            return str(host)
    pytest.skip(f"subnet {subnet.network} has no address besides this machine's")


# -- interfaces ------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's `ip` to cross-check")
def test_interfaces_match_iproute2() -> None:
    ours = {i.name: set(i.ipv4) for i in net.interfaces()}
    theirs = _ip_addr()
    # `ip` reports UP admin state, psutil the operational one; compare those both call up
    for name in ours.keys() & theirs.keys():
        assert ours[name] == theirs[name], name
    assert "127.0.0.1" in ours[net.interface_of("127.0.0.1") or ""]


def test_loopback_is_listed_last_and_marked() -> None:
    found = net.interfaces()
    lo = [i for i in found if "127.0.0.1" in i.addresses]
    assert len(lo) == 1 and lo[0].loopback and lo[0].up
    assert found[-1].loopback
    assert all(":" not in a for a in lo[0].ipv4)


def test_interface_of_maps_every_address_back_to_its_interface() -> None:
    for iface in net.interfaces():
        for address in iface.addresses:
            assert net.interface_of(address) == iface.name
    assert net.interface_of("203.0.113.254") is None  # TEST-NET-3, never configured here


def test_require_interface_names_host_and_lists_its_interfaces() -> None:
    available = {i.name: list(i.ipv4) for i in net.interfaces()}
    lo = net.interface_of("127.0.0.1")
    assert lo is not None
    net.require_interface(lo, "node7", available)
    with pytest.raises(ConfigError) as e:
        net.require_interface("ib9", "node7", available)
    msg = str(e.value)
    assert "node7" in msg and "'ib9'" in msg and "--iface" in msg
    for name, addrs in available.items():
        assert name in msg
        for a in addrs:
            assert a in msg


# -- routes ----------------------------------------------------------------------------------------


def test_route_to_loopback_and_own_name_is_local() -> None:
    for host in ("127.0.0.1", "localhost"):
        r = net.route_to(host)
        assert r.local
        assert r.source == "127.0.0.1"
        assert r.interface == net.interface_of("127.0.0.1")
    assert net.is_local(socket.gethostname())


def test_route_to_own_lan_address_is_local_on_that_interface() -> None:
    iface, subnet = _lan()
    r = net.route_to(str(subnet.ip))
    assert r.local
    assert r.interface == iface.name
    assert net.is_local(str(subnet.ip))


def test_route_to_a_peer_on_the_lan_uses_that_interface() -> None:
    iface, subnet = _lan()
    peer = _peer_in(subnet)
    r = net.route_to(peer)
    assert (r.address, r.source, r.interface, r.local) == (peer, str(subnet.ip), iface.name, False)
    assert not net.is_local(peer)


def test_listen_address_is_loopback_only_when_every_host_is_local() -> None:
    choice = net.listen_address(["localhost", socket.gethostname(), "127.0.0.1"])
    assert choice.address == "127.0.0.1"
    iface, subnet = _lan()
    peer = _peer_in(subnet)
    for hosts in ([peer], ["localhost", peer]):
        choice = net.listen_address(hosts)
        assert choice.address == str(subnet.ip) != "127.0.0.1"
        assert choice.interface == iface.name
        assert peer in choice.reason


def test_listen_address_needs_hosts() -> None:
    with pytest.raises(ConfigError, match="no hosts"):
        net.listen_address([])


def test_unknown_host_names_the_host_and_the_fix() -> None:
    host = "nbt-no-such-host.invalid"  # .invalid never resolves (RFC 2606)
    with pytest.raises(net.UnknownHostError) as e:
        net.route_to(host)
    assert e.value.host == host
    assert host in str(e.value) and "/etc/hosts" in str(e.value)
    assert isinstance(e.value, ClusterError)


# -- ports -----------------------------------------------------------------------------------------


def test_free_port_can_be_bound_and_a_bound_port_is_in_use() -> None:
    port = net.free_port("127.0.0.1")
    assert 0 < port < 65536
    assert not net.port_in_use(port, "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert net.port_in_use(port, "127.0.0.1")
        with pytest.raises(ConfigError) as e:
            net.require_free_port(port, "127.0.0.1", host="node3")
        assert f"port {port}" in str(e.value) and "node3" in str(e.value)
        assert "--port" in str(e.value)
    net.require_free_port(port, "127.0.0.1")


@pytest.mark.parametrize("port", [0, -1, 70000])
def test_require_free_port_rejects_non_ports(port: int) -> None:
    with pytest.raises(ConfigError, match="not a TCP port"):
        net.require_free_port(port)


# -- --hosts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("node1:2,node2:2", [("node1", 2, None), ("node2", 2, None)]),
        ("node1,node2", [("node1", None, None), ("node2", None, None)]),
        (" node1:1 , node2:3 ", [("node1", 1, None), ("node2", 3, None)]),
        ("alice@gpu-1.cluster.local:8", [("gpu-1.cluster.local", 8, "alice")]),
        (
            "10.0.0.7:2,[fe80::1]:4,[::1]",
            [("10.0.0.7", 2, None), ("fe80::1", 4, None), ("::1", None, None)],
        ),
        ("node1:1,node2:2", [("node1", 1, None), ("node2", 2, None)]),  # uneven layouts
    ],
)
def test_parse_hosts(spec: str, expected: list[tuple[str, int | None, str | None]]) -> None:
    got = net.parse_hosts(spec)
    assert [(h.host, h.engines, h.user) for h in got] == expected


def test_host_spec_location_is_what_ssh_takes() -> None:
    a, b = net.parse_hosts("root@node1:2,node2")
    assert (a.location, b.location) == ("root@node1", "node2")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("", ["empty"]),
        ("node1,,node2", ["entry 2 is empty"]),
        ("node1,", ["entry 2 is empty"]),
        ("node1:0", ["node1", "positive integer", "'0'"]),
        ("node1:-2", ["node1", "positive integer"]),
        ("node1:two", ["node1", "positive integer", "'two'"]),
        ("node1:", ["node1", "positive integer"]),
        ("node1:1.5", ["positive integer"]),
        ("node1:2:3", ["more than one ':'"]),
        ("node_1:2", ["'node_1'", "not a valid host name"]),
        ("-node:2", ["not a valid host name"]),
        ("node1 node2", ["contains a space", "commas"]),
        ("node1,NODE1:2", ["listed twice", "entries 1 and 2"]),
        ("10.0.0.300", ["not a valid host name"]),
        ("[fe80::1:2", ["without ']'"]),
        ("bad user@node1", ["contains a space"]),
        ("b!d@node1", ["invalid user name"]),
        ("a" * 64 + ":1", ["not a valid host name"]),
    ],
)
def test_parse_hosts_rejects_malformed_input_clearly(spec: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        net.parse_hosts(spec)
    for word in words:
        assert word in str(e.value)
    assert "--hosts" in str(e.value)


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("node1", True),
        ("gpu-2.cluster.local", True),
        ("gpu-2.cluster.local.", True),
        ("192.168.213.11", True),
        ("fd00::2", True),
        ("node_1", False),
        ("node-", False),
        ("", False),
        ("a..b", False),
        ("1.2.3.4.5", False),
        ("x" * 63, True),
        ("x" * 64, False),
    ],
)
def test_valid_host_name(host: str, ok: bool) -> None:
    assert net.valid_host_name(host) is ok
