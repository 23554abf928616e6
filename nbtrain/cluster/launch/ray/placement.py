"""The Ray launcher's options (`OPTIONS`: the address, the ranks and their bundles, the placement)
and how a start places its ranks: the bundles of the placement group, the rank order Ray's placement
gives, and, while Ray cannot place the group, what is missing and what to change.

Plain declarations and functions over `LaunchOptions` and Ray's node table; nothing here talks to Ray.
`ray.py` (the launcher the registry names) takes its options from here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from nbtrain.cluster.launch import LaunchOptions
from nbtrain.cluster.launch.base import NETWORK
from nbtrain.cluster.options import Option, positive
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

#: what --launcher ray does, in --launcher's help
SUMMARY = "as actors in one Ray placement group"
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _address(value: str) -> str:
    address = value or "auto"
    if address not in ("auto", "local") and not re.fullmatch(
        r"(ray://)?[\w.\-\[\]:]+:\d+", address
    ):
        msg = (
            f"--address {value!r} is not a Ray address. Give auto (the Ray cluster this "
            "machine belongs to), local (a private one-machine Ray cluster, stopped with nbtrain's) "
            "or ray://HEAD:10001 (a remote head's Ray Client port)."
        )
        raise ConfigError(msg)
    return address


def _gpus(value: float) -> float:
    if value > 1 and value != int(value):
        msg = f"--gpus-per-rank {value:g}: above 1, give a whole number of GPUs."
        raise ConfigError(msg)
    return value


# the ranks (-n, --nodes, --engines-per-node) are the picker page's own fields: no label here
OPTIONS = (
    Option(
        "address",
        "auto: the Ray cluster this machine is in (default); local: a private one here; "
        "ray://HEAD:10001: a remote head",
        default="auto",
        metavar="A",
        doc="`auto`: the Ray cluster this machine is in; `local`: a private one-machine Ray, "
        "stopped with the cluster; `ray://HEAD:10001`: a remote head (Ray Client)",
        label="Ray address",
        placeholder="auto",
        check=_address,
    ),
    Option(
        "n",
        "ranks (default 1; or --nodes and --engines-per-node)",
        kind="count",
        flag="-n",
        example="4",
        metavar="N",
        default_doc="1",
    ),
    Option(
        "nodes",
        "nodes to spread the ranks over, one bundle each (with --engines-per-node)",
        kind="count",
        example="2",
        metavar="N",
        default_doc="1, with --engines-per-node",
    ),
    Option(
        "engines_per_node",
        "ranks (Ray actors) per node, with --nodes (default 1)",
        kind="count",
        example="4",
        metavar="E",
        default_doc="1",
    ),
    Option(
        "placement",
        "PACK (default), SPREAD, STRICT_PACK or STRICT_SPREAD: how Ray places the ranks",
        kind="choice",
        choices=PLACEMENTS,
        default="PACK",
        metavar="P",
        doc="Ray's strategy for the ranks' bundles. With `--nodes`: `PACK`/`STRICT_PACK` only (a "
        "node's ranks share one bundle; nodes are STRICT_SPREAD)",
        label="Placement",
    ),
    Option(
        "gpus_per_rank",
        "GPUs for each rank (default 0)",
        kind="amount",
        default=0.0,
        example="1",
        metavar="G",
        default_doc="0 (CPU ranks)",
        doc="GPUs in each rank's bundle; the rank sees only those (`CUDA_VISIBLE_DEVICES` as Ray "
        "sets it) and uses `cuda:0`",
        label="GPUs per rank",
        placeholder="0 (CPU ranks)",
        check=_gpus,
    ),
    Option(
        "cpus_per_rank",
        "CPUs for each rank (default 1)",
        kind="amount",
        default=1.0,
        example="2",
        metavar="C",
        default_doc="1",
        doc="CPUs in each rank's bundle",
        label="CPUs per rank",
        placeholder="1",
    ),
    *NETWORK,
)
HINT = "give -n (or --nodes and --engines-per-node), --gpus-per-rank and --placement"


def validate(lo: LaunchOptions) -> None:
    """Settle the ranks: -n, or --nodes x --engines-per-node (one bundle per node holding that
    node's ranks, the nodes STRICT_SPREAD; --placement then says how a node's ranks sit: PACK or
    STRICT_PACK, the only ways a node's ranks can share one bundle)."""
    if lo.nodes is not None or lo.engines_per_node is not None:
        lo.nodes = 1 if lo.nodes is None else lo.nodes
        lo.engines_per_node = 1 if lo.engines_per_node is None else lo.engines_per_node
        total = lo.nodes * lo.engines_per_node
        if lo.n is not None and int(lo.n) != total:
            msg = (
                f"-n {lo.n} does not match --nodes {lo.nodes} x --engines-per-node "
                f"{lo.engines_per_node} ({total} ranks); give one or the other."
            )
            raise ConfigError(msg)
        if lo.placement not in ("PACK", "STRICT_PACK"):
            msg = (
                f"--placement {lo.placement} with --nodes: each node's ranks share one bundle on one "
                "node, and the nodes are always STRICT_SPREAD. Use --placement STRICT_PACK (or "
                f"leave it out), or give -n {total} without --nodes to {lo.placement} single ranks."
            )
            raise ConfigError(msg)
        lo.n = total
    lo.n = positive(1 if lo.n is None else lo.n, "-n", "4")


@dataclass(frozen=True)
class RayNode:
    """One alive Ray node as the placement explanation sees it."""

    name: str  # its host name (or address)
    address: str
    total: dict[str, float]  # its CPU and GPU (and other) resources


def bundles(lo: LaunchOptions) -> tuple[list[dict[str, float]], str, int]:
    """The placement group's bundles, its strategy, and the ranks per bundle."""
    per = int(lo.engines_per_node) if lo.nodes is not None and lo.engines_per_node else 1
    count = int(lo.n or 1) // per
    cpus, gpus = float(lo.cpus_per_rank or 0), float(lo.gpus_per_rank or 0)
    bundle = {k: v * per for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    strategy = "STRICT_SPREAD" if per > 1 or lo.nodes is not None else str(lo.placement)
    if lo.nodes is not None and lo.nodes == 1:
        strategy = "PACK"  # one node: nothing to spread
    return [dict(bundle) for _ in range(count)], strategy, per


def rank_order(bundle_nodes: dict[int, str], per_bundle: int = 1) -> list[int]:
    """The bundle of each rank, node-major: nodes in the order of their first bundle, a node's
    bundles in index order, `per_bundle` consecutive ranks per bundle."""
    first: dict[str, int] = {}
    for index in sorted(bundle_nodes):
        first.setdefault(bundle_nodes[index], index)
    ordered = sorted(bundle_nodes, key=lambda i: (first[bundle_nodes[i]], i))
    return [i for i in ordered for _ in range(per_bundle)]


def resources_text(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def explain_pending(
    wanted: Sequence[dict[str, float]],
    strategy: str,
    nodes: Sequence[RayNode],
    available: dict[str, float],
) -> str:
    """Why Ray has not placed the group: the resources missing, given the strategy; one line."""
    need: dict[str, float] = {}
    for b in wanted:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    why: list[str] = []
    for k, amount in need.items():
        total = sum(n.total.get(k, 0.0) for n in nodes)
        free = available.get(k, 0.0)
        if total < amount:
            why.append(f"{amount:g} {k} wanted, the Ray cluster has {total:g} in all")
        elif free < amount:
            why.append(f"{amount:g} {k} wanted, {free:g} free now (the rest in use by other work)")
    one = wanted[0] if wanted else {}
    fits = [n for n in nodes if all(n.total.get(k, 0.0) >= v for k, v in one.items())]
    if not fits:
        why.append(
            f"no node can hold one bundle {resources_text(one)} (a bundle never spans nodes)"
        )
    elif strategy == "STRICT_PACK":
        for k, amount in need.items():
            largest = max(n.total.get(k, 0.0) for n in nodes)
            if largest < amount:
                why.append(
                    f"STRICT_PACK puts every bundle on one node, and the largest has {largest:g} {k} "
                    f"of the {amount:g} wanted"
                )
    elif strategy == "STRICT_SPREAD" and len(fits) < len(wanted):
        why.append(
            f"STRICT_SPREAD puts each of the {len(wanted)} bundles on its own node, and "
            f"{len(fits)} node(s) can hold one"
        )
    if not why:
        why.append("the resources exist but are taken or still being freed")
    return "; ".join(why)


def pending_fix(strategy: str) -> str:
    looser = " a looser --placement (PACK or SPREAD)," if strategy.startswith("STRICT") else ""
    return (
        f"Ask for fewer ranks (-n) or fewer --gpus-per-rank/--cpus-per-rank,{looser} add nodes to "
        "the Ray cluster (ray start --address HEAD:6379 on them), or give a longer --timeout"
    )
