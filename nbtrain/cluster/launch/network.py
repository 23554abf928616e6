"""The network of a multi-node group: each node's interface toward rank 0, MASTER_ADDR, the port.

Asked of the engines themselves (`nbtrain.engine.network`), after preflight and before the group
forms; shared by every multi-node launcher and by `connect`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from nbtrain import net
from nbtrain.cluster.ranks.topology import RankInfo
from nbtrain.engine import network, setup
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)


def plan_network(
    client: Any,
    ranks: list[RankInfo],
    reports: Sequence[dict[str, Any]],
    iface: str | None,
    listen: net.ListenChoice,
    remaining: Callable[[], float],
) -> str:
    """Fill every rank's address and interface, set NCCL/GLOO_SOCKET_IFNAME; return MASTER_ADDR."""
    leaders: dict[str, RankInfo] = {}
    for r in ranks:
        leaders.setdefault(r.host, r)
    hosts = list(leaders)
    plan: dict[str, tuple[str, str]] = {}  # host -> (address, interface)

    def ask(host: str, fn: Any, *args: Any) -> Any:
        return client[leaders[host].engine_id].apply_async(fn, *args)

    if iface:
        for host in hosts:
            nics = reports[leaders[host].rank].get("interfaces", {})
            available = {n: v.get("addresses", []) for n, v in nics.items()}
            net.require_interface(iface, host, available)
            v4 = [a for a in available[iface] if ":" not in a]
            if not v4:
                msg = (
                    f"interface {iface} on host {host} has no IPv4 address; pass --iface with an "
                    "interface that has one, or leave --iface out."
                )
                raise ConfigError(msg)
            plan[host] = (v4[0], iface)
    else:
        # every node's address toward the controller, then rank 0's toward another node, then every
        # other node's toward rank 0: the interfaces the process group's traffic will use
        toward_ctl = {h: ask(h, network.route, listen.address) for h in hosts}
        first = {h: ar.get(timeout=remaining()) for h, ar in toward_ctl.items()}
        h0 = hosts[0]
        if len(hosts) == 1:
            plan[h0] = (first[h0]["address"], first[h0]["interface"])
        else:
            r0 = ask(h0, network.route, first[hosts[1]]["address"]).get(timeout=remaining())
            plan[h0] = (r0["address"], r0["interface"])
            others = {h: ask(h, network.route, plan[h0][0]) for h in hosts[1:]}
            for h, ar in others.items():
                r = ar.get(timeout=remaining())
                plan[h] = (r["address"], r["interface"])
        for h, (address, nic) in plan.items():
            if nic in (None, "lo") and len(hosts) > 1:
                msg = (
                    f"host {h} would reach rank 0 through {nic or 'no interface'} ({address}); "
                    "the nodes need a network between them. Pass --iface with the interface "
                    "that connects them."
                )
                raise ClusterError(msg)
    pending = []
    for r in ranks:
        address, nic = plan[r.host]
        r.address, r.interface = address, nic
        env = {"NCCL_SOCKET_IFNAME": nic, "GLOO_SOCKET_IFNAME": nic}
        pending.append(client[r.engine_id].apply_async(network.set_env, env))
    for ar in pending:
        ar.get(timeout=remaining())
    return plan[hosts[0]][0]


def rendezvous_port(
    client: Any, ranks: Sequence[RankInfo], port: int | None, remaining: Callable[[], float]
) -> int:
    rank0 = client[ranks[0].engine_id]
    if port is None:
        return int(rank0.apply_async(setup.free_port).get(timeout=remaining()))
    if rank0.apply_async(network.port_in_use, int(port)).get(timeout=remaining()):
        msg = (
            f"port {port} is already in use on {ranks[0].host} (rank 0's host, where the rendezvous "
            "listens); pass a free port with --port, or leave --port out to pick a free one. "
            "Nothing was left running."
        )
        raise ConfigError(msg)
    return int(port)
