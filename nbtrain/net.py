"""Network helpers for multi-node clusters: interfaces, routes, the controller's address, ports, --hosts.

Runs in the notebook kernel (and is cheap enough for engines): psutil and the standard library only.

In [1]: from nbtrain import net
In [2]: net.parse_hosts("node1:2,node2:2")
Out[2]: [HostSpec(host='node1', engines=2, user=None), HostSpec(host='node2', engines=2, user=None)]
In [3]: net.listen_address(["node1", "node2"])
Out[3]: ListenChoice(address='10.0.0.5', interface='eth0', reason='routes to node1, node2')
"""

from __future__ import annotations

import ipaddress
import logging
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class UnknownHostError(ClusterError):
    """A host name does not resolve on this machine."""

    def __init__(self, message: str, host: str):
        super().__init__(message)
        self.host = host


class UnreachableHostError(ClusterError):
    """This machine has no route to a host."""

    def __init__(self, message: str, host: str):
        super().__init__(message)
        self.host = host


# -- interfaces ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interface:
    """A network interface of this machine and its addresses (IPv4 first)."""

    name: str
    addresses: tuple[str, ...]
    up: bool
    loopback: bool
    speed_mbps: int = 0  # 0 where the kernel does not know (virtual links)
    mtu: int = 0

    @property
    def ipv4(self) -> tuple[str, ...]:
        return tuple(a for a in self.addresses if ":" not in a)


def interfaces(*, include_down: bool = False) -> list[Interface]:
    """This machine's interfaces with their IP addresses, loopback last."""
    stats = psutil.net_if_stats()
    found = []
    for name, addrs in psutil.net_if_addrs().items():
        st = stats.get(name)
        up = bool(st and st.isup)
        if not up and not include_down:
            continue
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        # drop the %scope suffix psutil keeps on link-local IPv6 addresses
        v6 = [a.address.split("%")[0] for a in addrs if a.family == socket.AF_INET6]
        ips = tuple(v4 + v6)
        loopback = name == "lo" or any(ipaddress.ip_address(a).is_loopback for a in ips)
        speed = st.speed if st else 0
        found.append(Interface(name, ips, up, loopback, speed, st.mtu if st else 0))
    return sorted(found, key=lambda i: (i.loopback, i.name))


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds `address`, or None."""
    want = ipaddress.ip_address(address)
    for iface in interfaces(include_down=True):
        if any(ipaddress.ip_address(a) == want for a in iface.addresses):
            return iface.name
    return None


def local_addresses() -> set[str]:
    """Every IP address of this machine, loopback included."""
    return {a for i in interfaces(include_down=True) for a in i.addresses}


def require_interface(name: str, host: str, available: Mapping[str, Sequence[str]]) -> None:
    """Raise a clear error when `host` lacks interface `name` (for `--iface`).

    `available` maps the host's interface names to their addresses, as preflight reports them.
    """
    if name in available:
        return
    listed = ", ".join(
        f"{n} ({', '.join(a) if a else 'no address'})" for n, a in sorted(available.items())
    )
    msg = (
        f"host {host} has no network interface {name!r}; its interfaces: {listed or 'none'}. "
        "Pass --iface with one of these, or leave --iface out to use the interface that routes "
        "to the other nodes."
    )
    raise ConfigError(msg)


# -- resolution and routes -------------------------------------------------------------------------


def resolve(host: str) -> str:
    """The IP address `host` resolves to on this machine (IPv4 preferred)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        msg = (
            f"cannot resolve host {host!r} ({e.strerror}). Check the spelling, add the host to DNS "
            "or /etc/hosts on this machine, or give its IP address instead."
        )
        raise UnknownHostError(msg, host) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def is_local(host: str) -> bool:
    """True when `host` is this machine: a loopback address, one of its addresses, or its name."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    address = resolve(host)
    return ipaddress.ip_address(address).is_loopback or address in local_addresses()


@dataclass(frozen=True)
class Route:
    """How this machine reaches `host`: through `interface`, from `source`."""

    host: str
    address: str  # what `host` resolved to
    source: str  # this machine's address on that route
    interface: str | None  # None where the source address maps to no interface (rare)
    local: bool  # `host` is this machine


def _ip_route_get(address: str) -> tuple[str | None, str | None]:
    """(dev, src) from `ip route get`, or (None, None) where `ip` is missing or says nothing."""
    if shutil.which("ip") is None:
        return None, None
    try:
        out = subprocess.run(
            ["ip", "route", "get", address], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    dev = re.search(r"\bdev (\S+)", out)
    src = re.search(r"\bsrc (\S+)", out)
    return (dev.group(1) if dev else None), (src.group(1) if src else None)


def route_to(host: str) -> Route:
    """The interface and source address this machine uses to reach `host`.

    Asks the kernel by connecting a UDP socket (no packet is sent), then names the interface from
    `ip route get` where available, else by finding which interface holds the source address.
    """
    address = resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError as e:
            msg = (
                f"no route from this machine to host {host} ({address}): {e.strerror}. Check that "
                "the host is on a network this machine is connected to, or pass --ip with this "
                "machine's address on that network."
            )
            raise UnreachableHostError(msg, host) from None
        source = str(s.getsockname()[0])
    dev, _ = _ip_route_get(address)
    local = ipaddress.ip_address(address).is_loopback or address in local_addresses()
    # for a local address the kernel routes through lo; the source address names the interface
    interface = dev if dev and not local else interface_of(source) or dev
    return Route(host, address, source, interface, local)


@dataclass(frozen=True)
class ListenChoice:
    """The address the controller listens on, and why."""

    address: str
    interface: str | None
    reason: str
    routes: tuple[Route, ...] = field(default=(), repr=False)


def listen_address(hosts: Iterable[str]) -> ListenChoice:
    """The controller's listen address for engines on `hosts`: reachable by every one of them.

    127.0.0.1 only when every host is this machine; otherwise this machine's address on the
    interface that routes to the remote hosts.
    """
    hosts = list(dict.fromkeys(hosts))
    if not hosts:
        msg = "no hosts given: pass at least one host, e.g. --hosts node1:2,node2:2"
        raise ConfigError(msg)
    routes = tuple(route_to(h) for h in hosts)
    remote = [r for r in routes if not r.local]
    if not remote:
        return ListenChoice(LOOPBACK, interface_of(LOOPBACK), "every host is this machine", routes)
    by_source: dict[str, list[Route]] = {}
    for r in remote:
        by_source.setdefault(r.source, []).append(r)
    if len(by_source) > 1:
        groups = "; ".join(
            f"{', '.join(r.host for r in rs)} via {rs[0].interface} ({src})"
            for src, rs in by_source.items()
        )
        msg = (
            f"the hosts are reached through different interfaces of this machine: {groups}. "
            "Pass --ip with an address of this machine that every host can reach."
        )
        raise ClusterError(msg)
    source, rs = next(iter(by_source.items()))
    return ListenChoice(
        source, rs[0].interface, f"routes to {', '.join(r.host for r in rs)}", routes
    )


# -- ports -----------------------------------------------------------------------------------------


def free_port(address: str = "") -> int:
    """A TCP port that is free on `address` now (all addresses by default).

    Another process can take it before it is used; bind soon after.
    """
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, address: str = "") -> bool:
    """True when a TCP listener could not bind `port` on `address` (it is taken)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        try:
            s.bind((address, port))
        except OSError:
            return True
    return False


def require_free_port(port: int, address: str = "", host: str | None = None) -> None:
    """Raise a clear error when the rendezvous `port` is taken on `host`."""
    if not 0 < port < 65536:
        msg = f"port {port} is not a TCP port; give one from 1 to 65535, or leave it out"
        raise ConfigError(msg)
    if port_in_use(port, address):
        where = host or socket.gethostname()
        msg = (
            f"port {port} is already in use on {where}; pass a free port with --port, or leave it "
            "out to pick a free one"
        )
        raise ConfigError(msg)


# -- --hosts ---------------------------------------------------------------------------------------

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class HostSpec:
    """One host of `--hosts` and how many engines to start there (None: decide from its GPUs)."""

    host: str
    engines: int | None = None
    user: str | None = None

    @property
    def location(self) -> str:
        """`user@host` (or `host`) as ssh and ipyparallel's SSH launcher take it."""
        return f"{self.user}@{self.host}" if self.user else self.host


def valid_host_name(host: str) -> bool:
    """True for a syntactically valid host name (RFC 1123) or IP address."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    if not host or len(host.rstrip(".")) > 253:
        return False
    labels = host.rstrip(".").split(".")
    # an all-numeric last label would be a mistyped IPv4 address ("10.0.0.300")
    return all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def _parse_entry(entry: str, spec: str) -> HostSpec:
    user = None
    rest = entry
    if "@" in rest:
        user, rest = rest.split("@", 1)
        if not _USER.fullmatch(user):
            msg = f"--hosts {spec!r}: {entry!r} has an invalid user name {user!r}"
            raise ConfigError(msg)
    count: str | None = None
    if rest.startswith("["):  # [IPv6]:count
        end = rest.find("]")
        if end < 0:
            msg = f"--hosts {spec!r}: {entry!r} opens '[' without ']'; write [ADDRESS]:COUNT"
            raise ConfigError(msg)
        host, tail = rest[1:end], rest[end + 1 :]
        if tail:
            if not tail.startswith(":"):
                msg = f"--hosts {spec!r}: unexpected {tail!r} after ']' in {entry!r}"
                raise ConfigError(msg)
            count = tail[1:]
    elif rest.count(":") > 1:
        msg = (
            f"--hosts {spec!r}: {entry!r} has more than one ':'; write HOST:COUNT "
            "(an IPv6 address goes in brackets: [fe80::1]:2)"
        )
        raise ConfigError(msg)
    elif ":" in rest:
        host, count = rest.split(":")
    else:
        host = rest
    if not valid_host_name(host):
        msg = (
            f"--hosts {spec!r}: {host!r} is not a valid host name or IP address (letters, digits "
            "and '-' in dot-separated parts, e.g. node1 or gpu-2.cluster.local)"
        )
        raise ConfigError(msg)
    engines = None
    if count is not None:
        if not re.fullmatch(r"[0-9]+", count) or int(count) < 1:
            msg = (
                f"--hosts {spec!r}: the engine count for {host} must be a positive integer, not "
                f"{count!r}; write {host}:2, or {host} alone for one engine per GPU"
            )
            raise ConfigError(msg)
        engines = int(count)
    return HostSpec(host, engines, user)


def parse_hosts(spec: str) -> list[HostSpec]:
    """Parse `--hosts` ("node1:2,node2:2", "node1,node2", "user@node1:4") in the order given."""
    if not spec or not spec.strip():
        msg = "--hosts is empty; give HOST[:ENGINES] entries separated by commas, e.g. node1:2,node2:2"
        raise ConfigError(msg)
    out: list[HostSpec] = []
    seen: dict[str, int] = {}
    for pos, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        if not entry:
            msg = (
                f"--hosts {spec!r}: entry {pos} is empty (two commas in a row, or a trailing comma)"
            )
            raise ConfigError(msg)
        if any(c.isspace() for c in entry):
            msg = f"--hosts {spec!r}: {entry!r} contains a space; separate hosts with commas"
            raise ConfigError(msg)
        hs = _parse_entry(entry, spec)
        key = hs.host.lower()
        if key in seen:
            msg = (
                f"--hosts {spec!r}: host {hs.host} is listed twice (entries {seen[key]} and {pos}); "
                f"list it once with its total engine count, e.g. {hs.host}:4"
            )
            raise ConfigError(msg)
        seen[key] = pos
        out.append(hs)
    return out
