"""The nodes' network interfaces for the picker's Interface dropdown: asked of the SSH hosts
(Check hosts, `check_node_interfaces`) or taken from a started cluster's preflight reports."""

from __future__ import annotations

import html
import logging
from typing import Any

from nbtrain.display.picker.results import error_text
from nbtrain.display.picker.settings import AUTO, PickerSettings

log = logging.getLogger(__name__)


def interface_choices() -> list[str]:
    """'auto' and this machine's interfaces that are up (loopback last)."""
    from nbtrain import net

    return [AUTO, *(i.name for i in net.interfaces())]


# -- the nodes' interfaces -------------------------------------------------------------------------

# host (as in --hosts) -> interface name -> its addresses (IPv4 first), as the hosts report them
NodeInterfaces = dict[str, dict[str, list[str]]]


def check_node_interfaces(
    s: PickerSettings, timeout: float = 30.0
) -> tuple[NodeInterfaces, dict[str, str]]:
    """Log in to every SSH host (in parallel) and ask for its interfaces; nothing is started.

    Returns (host -> interfaces, host -> error message). Each host is asked on its own, so one host
    that cannot be reached does not hide the interfaces of the others, and every failing host is
    named. The login and the question are `nbtrain.cluster.launch.ssh.check_hosts`, the check `nbtrain.start` makes.
    """
    from concurrent.futures import ThreadPoolExecutor

    from nbtrain import net
    from nbtrain.cluster.launch import LaunchOptions, ssh

    specs = net.parse_hosts(s.hosts)
    extra: dict[str, Any] = {}
    if s.python:
        extra["remote_python"] = s.python
    if s.ssh_args:
        extra["ssh_args"] = s.ssh_args

    def one(spec: net.HostSpec) -> dict[str, list[str]]:
        # one host per LaunchOptions: an unknown host name fails here, naming that host only
        lo = LaunchOptions(launcher="ssh", hosts=[spec], **extra)
        return ssh.check_hosts(lo, timeout)[spec.host].interfaces

    found: NodeInterfaces = {}
    errors: dict[str, str] = {}
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {spec.host: pool.submit(one, spec) for spec in specs}
        for host, fut in futures.items():
            try:
                found[host] = {n: list(a) for n, a in fut.result().items()}
            except Exception as e:  # returned: the form shows each host's error beside it
                errors[host] = error_text(e)
    return found, errors


def interfaces_from_reports(ranks: Any, reports: Any) -> NodeInterfaces:
    """Host -> interfaces from the preflight reports of a started cluster (one report per rank)."""
    found: NodeInterfaces = {}
    for r, report in zip(ranks, reports or ()):
        if r.host in found or not isinstance(report, dict):
            continue
        nics = report.get("interfaces") or {}
        found[r.host] = {n: list(v.get("addresses", [])) for n, v in nics.items()}
    return found


def _ipv4(addresses: list[str]) -> list[str]:
    return [a for a in addresses if ":" not in a]


def _is_loopback(name: str, addresses: list[str]) -> bool:
    import ipaddress

    if name == "lo":
        return True
    try:
        return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
    except ValueError:
        return False


def _missing_text(name: str, nodes: NodeInterfaces) -> str:
    """'' when every node has `name` with an IPv4 address, else which node lacks what."""
    absent = [h for h, nics in nodes.items() if name not in nics]
    no_v4 = [h for h, nics in nodes.items() if name in nics and not _ipv4(nics[name])]
    parts = []
    if absent:
        parts.append("not on " + ", ".join(absent))
    if no_v4:
        parts.append("no IPv4 address on " + ", ".join(no_v4))
    return "; ".join(parts)


def node_interface_options(
    nodes: NodeInterfaces, current: str = AUTO, n_hosts: int | None = None
) -> list[tuple[str, str]]:
    """The Interface dropdown's (label, value) pairs for the nodes' interfaces.

    'auto' first, then the interfaces every node has (with an IPv4 address: the process group
    needs one), then those some node lacks, labelled with the node. Loopback is left out when there
    is more than one node (`n_hosts`: the hosts of the cluster, default those in `nodes`; it does
    not connect them), and so are interfaces with no IPv4 address on any node. A `current` choice
    that is not among them stays, labelled as such.
    """
    several = (len(nodes) if n_hosts is None else n_hosts) > 1
    names: list[str] = []
    for nics in nodes.values():
        for name, addresses in nics.items():
            if name in names or not _ipv4(addresses):
                continue
            if several and _is_loopback(name, addresses):
                continue
            names.append(name)
    common = [n for n in names if not _missing_text(n, nodes)]
    partial = [n for n in names if n not in common]
    options = [(AUTO, AUTO)]
    options += [(n, n) for n in common]
    options += [(f"{n} ({_missing_text(n, nodes)})", n) for n in partial]
    if current not in (AUTO, *names):
        why = _missing_text(current, nodes) if nodes else ""
        options.append((f"{current} ({why or 'not found on the nodes'})", current))
    return options


def node_interfaces_html(nodes: NodeInterfaces, source: str, n_hosts: int | None = None) -> str:
    """Each node's interfaces and addresses, and which interface some node lacks, as HTML."""
    if not nodes:
        return ""
    out = [f'<div class="nbtrain-node-ifaces"><small>interfaces of the nodes ({source}):</small>']
    out.append("<table><thead><tr><th>node</th><th>interfaces</th></tr></thead><tbody>")
    for host, nics in nodes.items():
        listed = ", ".join(f"{n} ({', '.join(_ipv4(a))})" for n, a in nics.items() if _ipv4(a))
        out.append(
            f"<tr><td>{html.escape(host)}</td><td>{html.escape(listed or 'none with IPv4')}</td></tr>"
        )
    out.append("</tbody></table>")
    lacking = [
        (n, _missing_text(n, nodes))
        for _, n in node_interface_options(nodes, n_hosts=n_hosts)
        if n != AUTO and _missing_text(n, nodes)
    ]
    for name, why in lacking:
        out.append(f"<div><small>{html.escape(name)}: {html.escape(why)}</small></div>")
    out.append("</div>")
    return "".join(out)
