"""Ranks and where they live: `RankInfo`, node-major rank assignment, and the tables that show them.

A primitive: plain data, no ipyparallel client. Everything that numbers ranks or names them in a
message (`describe_ranks(ranks, [0, 1])` -> "ranks 0-1 on node1") comes from here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class RankInfo:
    """Where one rank lives."""

    rank: int
    engine_id: int
    host: str
    local_rank: int
    local_world_size: int
    pid: int
    device: str = "cpu"
    address: str = "127.0.0.1"
    interface: str | None = None
    log: str | None = None  # the engine's log file on its host (its stderr and crash dumps)
    gpus: int = 0  # GPUs the engine sees on its host (setup.hello); the device plan's input
    pinned: bool = False  # the launcher gave this engine its own GPU(s) only (Ray): it uses cuda:0


def assign_ranks(
    hellos: dict[int, dict[str, Any]],
    host_order: Sequence[str] = (),
    engine_order: Mapping[int, Any] | None = None,
) -> list[RankInfo]:
    """Node-major ranks, contiguous per host: hosts in `host_order` (then first seen), engines on a
    host by `engine_order[engine_id]` (the launcher's task id), else by engine id."""
    by_host: dict[str, list[int]] = {}
    key = engine_order.__getitem__ if engine_order is not None else None
    for eid in sorted(hellos, key=key):
        by_host.setdefault(hellos[eid]["host"], []).append(eid)
    order = [h for h in host_order if h in by_host] + [h for h in by_host if h not in host_order]
    ranks: list[RankInfo] = []
    for host in order:
        eids = by_host[host]
        for local_rank, eid in enumerate(eids):
            ranks.append(
                RankInfo(
                    rank=len(ranks),
                    engine_id=eid,
                    host=host,
                    local_rank=local_rank,
                    local_world_size=len(eids),
                    pid=int(hellos[eid]["pid"]),
                    log=hellos[eid].get("log"),
                    gpus=int(hellos[eid].get("gpus", 0)),
                    pinned=bool(hellos[eid].get("pinned", False)),
                )
            )
    return ranks


# torchrun's fixed values: one role, named as torchrun names it; nbtrain never restarts ranks on its own
# (a re-init is the user's or a fault's), so no restarts are budgeted; and no agent store, as there is
# no elastic agent (the group is already made, through nbtrain's own store)
TORCHRUN_FIXED = {
    "ROLE_NAME": "default",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "False",
}


def torchrun_env(
    ranks: Sequence[RankInfo],
    r: RankInfo,
    master_addr: str,
    port: int,
    run_id: str,
    restart_count: int = 0,
) -> dict[str, str]:
    """The environment torchrun (torch 2.13's local elastic agent) gives worker `r`, for this rank table.

    Nodes are hosts in rank order (ranks are node-major), so GROUP_RANK is the node's index and
    GROUP_WORLD_SIZE the number of nodes; the run id is the cluster's and the restart count is how
    many times its process group was re-created.
    """
    hosts = list(dict.fromkeys(x.host for x in ranks))
    world = str(len(ranks))
    return {
        "RANK": str(r.rank),
        "LOCAL_RANK": str(r.local_rank),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": str(r.local_world_size),
        "GROUP_RANK": str(hosts.index(r.host)),
        "GROUP_WORLD_SIZE": str(len(hosts)),
        "ROLE_RANK": str(r.rank),
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        **TORCHRUN_FIXED,
    }


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Plain-text columns, the first row a header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def rank_table(ranks: Sequence[RankInfo], interfaces: bool = False) -> str:
    """The rank table: rank, host, local rank, device, address (, interface), pid."""
    head = ["rank", "host", "local", "device", "address"] + (["interface"] if interfaces else [])
    rows = [(*head, "pid")]
    for r in ranks:
        nic = [r.interface or "-"] if interfaces else []
        rows.append((str(r.rank), r.host, str(r.local_rank), r.device, r.address, *nic, str(r.pid)))
    return format_table(rows)


def agree(which: Sequence[int], one: str, many: str) -> str:
    """The word that agrees with `which` after describe_ranks: agree(dead, "was", "were")."""
    return one if len(which) == 1 else many


def describe_ranks(ranks: Sequence[RankInfo], which: Sequence[int]) -> str:
    """`which` for a message, grouped by host: "ranks 0-2 on node1; rank 3 on node2"."""
    hosts: dict[str, list[int]] = {}
    for r in which:
        hosts.setdefault(ranks[r].host, []).append(r)
    parts = []
    for host, rs in hosts.items():
        label = "rank" if len(rs) == 1 else "ranks"
        parts.append(f"{label} {compact(rs)} on {host}")
    return "; ".join(parts)


def compact(nums: Sequence[int]) -> str:
    """0,1,2,5 -> '0-2,5'."""
    nums = sorted(nums)
    out: list[str] = []
    start = prev = nums[0]
    for n in nums[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(out)
