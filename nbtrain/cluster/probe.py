"""`%nbtrain probe`: all-reduce bus bandwidth and latency across the ranks, node-to-node latency.

In [1]: result = cluster.probe()
In [2]: print(result)          # one row per size; warnings when the network is not what it should be

Bus bandwidth is computed as nccl-tests does for all_reduce: algbw = bytes / time and
busbw = algbw * 2 (n - 1) / n, which makes it comparable with the link's speed for any n.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from nbtrain.cluster.ranks.topology import format_table
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 2**20
# a link delivering less than this share of its nominal speed is worth a warning
FAR_BELOW = 0.2


def parse_size(text: str) -> int:
    """'64M' -> 67108864; K, M, G are powers of 1024; a plain number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        msg = f"--max-size {text!r} is not a size; write e.g. 64M, 512K or 1G."
        raise ConfigError(msg)
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def sizes_up_to(max_bytes: int, min_bytes: int = 4) -> list[int]:
    """4 B, then every power of 4 from 4 KiB up to `max_bytes` (and `max_bytes` itself)."""
    if max_bytes < min_bytes:
        msg = f"the largest size ({max_bytes} B) is below the smallest ({min_bytes} B)."
        raise ConfigError(msg)
    sizes = [min_bytes]
    s = 4096
    while s < max_bytes:
        if s > min_bytes:
            sizes.append(s)
        s *= 4
    if max_bytes > sizes[-1]:
        sizes.append(max_bytes)
    return sizes


def bus_bandwidth(nbytes: float, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s for an all_reduce of `nbytes` that took `seconds` on `world` ranks."""
    algbw = nbytes / seconds if seconds > 0 else 0.0
    return algbw, algbw * 2 * (world - 1) / world if world > 1 else algbw


@dataclass
class ProbeResult:
    """Timings of one probe: rows per size, node-to-node latency and warnings."""

    world_size: int
    backend: str
    rows: list[dict[str, float]]  # bytes, seconds, algbw, busbw (bytes/s)
    node_latency: dict[str, float] = field(default_factory=dict)  # "hostA -> hostB" -> seconds
    nominal_bytes_per_s: float | None = None  # the slowest rank interface's nominal speed
    warnings: list[str] = field(default_factory=list)

    @property
    def latency_s(self) -> float:
        """Time of the smallest all_reduce: the latency across all ranks."""
        return self.rows[0]["seconds"]

    @property
    def peak_busbw(self) -> float:
        return max(r["busbw"] for r in self.rows)

    def __str__(self) -> str:
        rows = [("size", "time", "algbw GB/s", "busbw GB/s")]
        for r in self.rows:
            rows.append(
                (
                    _human(r["bytes"]),
                    f"{r['seconds'] * 1e6:.0f} us",
                    f"{r['algbw'] / 1e9:.3f}",
                    f"{r['busbw'] / 1e9:.3f}",
                )
            )
        lines = [
            f"all_reduce across {self.world_size} rank(s), backend {self.backend}: latency "
            f"{self.latency_s * 1e6:.0f} us, peak bus bandwidth {self.peak_busbw / 1e9:.3f} GB/s"
            + (
                f" (link nominal {self.nominal_bytes_per_s / 1e9:.2f} GB/s)"
                if self.nominal_bytes_per_s
                else ""
            ),
            format_table(rows),
        ]
        if self.node_latency:
            lines.append("node-to-node latency (one way):")
            lines += [f"  {k}: {v * 1e6:.0f} us" for k, v in self.node_latency.items()]
        lines += [f"Warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _ib_rate_gbit(port: dict[str, Any]) -> float | None:
    m = re.match(r"\s*([\d.]+)\s*Gb", str(port.get("rate") or ""))
    return float(m.group(1)) if m else None


def network_warnings(
    reports: list[dict[str, Any]],
    interfaces: list[str | None],
    hosts: list[str],
    backend: str,
    peak_busbw: float,
) -> tuple[list[str], float | None]:
    """Warnings about the network from the ranks' preflight reports; and the nominal link speed."""
    warnings: list[str] = []
    multi_node = len(set(hosts)) > 1
    speeds = []
    seen: set[str] = set()
    for report, nic, host in zip(reports, interfaces, hosts):
        if host in seen:
            continue
        seen.add(host)
        if nic:
            mbps = (report.get("interfaces", {}).get(nic) or {}).get("speed_mbps") or 0
            if mbps > 0:
                speeds.append(mbps * 1e6 / 8)
        active = [
            (d["device"], p)
            for d in report.get("infiniband") or []
            for p in d.get("ports", [])
            if "ACTIVE" in str(p.get("state", ""))
        ]
        if not active or not multi_node:
            continue
        names = ", ".join(sorted({dev for dev, _ in active}))
        env = report.get("env", {})
        if backend != "nccl":
            warnings.append(
                f"{host} has InfiniBand/RoCE ({names}), but the {backend} backend runs over TCP "
                "sockets; NCCL (on GPUs) would use it."
            )
        elif env.get("NCCL_IB_DISABLE") == "1" or env.get("NCCL_NET", "").lower() == "socket":
            warnings.append(
                f"{host} has InfiniBand/RoCE ({names}), but NCCL is told to use sockets "
                f"(NCCL_IB_DISABLE={env.get('NCCL_IB_DISABLE')}, NCCL_NET={env.get('NCCL_NET')}); "
                "unset them to use it."
            )
        else:
            rates = [r for _, p in active if (r := _ib_rate_gbit(p))]
            if rates and peak_busbw < FAR_BELOW * min(rates) * 1e9 / 8:
                warnings.append(
                    f"bus bandwidth {peak_busbw / 1e9:.2f} GB/s is far below {host}'s "
                    f"InfiniBand/RoCE rate ({min(rates):g} Gb/s on {names}): NCCL probably fell back "
                    "to TCP sockets. Run with NCCL_DEBUG=INFO and look for NET/Socket instead of "
                    "NET/IB; check that the NCCL build has IB support and NCCL_IB_HCA."
                )
    nominal = min(speeds) if speeds and multi_node else None
    if nominal and peak_busbw < FAR_BELOW * nominal:
        warnings.append(
            f"bus bandwidth {peak_busbw / 1e9:.3f} GB/s is far below the link's nominal "
            f"{nominal / 1e9:.2f} GB/s ({FAR_BELOW:.0%} or less): a slow or shared link, a wrong "
            "interface (--iface), or too small messages (try a larger --max-size)."
        )
    return warnings, nominal


def probe(
    cluster: Any,
    max_bytes: int = DEFAULT_MAX_BYTES,
    iters: int = 5,
    latency_iters: int = 20,
    timeout: float = 300.0,
) -> ProbeResult:
    """All-reduce bandwidth over sizes from 4 B to `max_bytes`, latency, node-to-node latency.

    In [1]: print(cluster.probe(max_bytes=16 * 2**20))
    """
    from nbtrain.engine import preflight as engine_preflight
    from nbtrain.engine import probe as engine_probe

    if iters < 1:
        msg = f"iters={iters}: time at least one all_reduce per size."
        raise ConfigError(msg)
    sizes = sizes_up_to(max_bytes)
    world = cluster.world_size
    per_rank = cluster.run(engine_probe.allreduce_times, sizes, iters, timeout=timeout)
    rows = []
    for i in range(len(sizes)):
        # the slowest rank's time is the collective's time
        seconds = max(r[i]["seconds"] for r in per_rank)
        algbw, busbw = bus_bandwidth(per_rank[0][i]["bytes"], seconds, world)
        rows.append(
            {"bytes": per_rank[0][i]["bytes"], "seconds": seconds, "algbw": algbw, "busbw": busbw}
        )
    # one rank per node, each pair once
    leaders: dict[str, int] = {}
    for r in cluster.ranks:
        leaders.setdefault(r.host, r.rank)
    lead = list(leaders.values())
    pairs = [(a, b) for i, a in enumerate(lead) for b in lead[i + 1 :]]
    node_latency: dict[str, float] = {}
    if pairs:
        got = cluster.run(engine_probe.pingpong, pairs, latency_iters, timeout=timeout)
        for d in got:
            for key, seconds in d.items():
                a, b = (int(x) for x in key.split("-"))
                node_latency[f"{cluster.ranks[a].host} -> {cluster.ranks[b].host}"] = seconds
    preflight = getattr(cluster, "preflight_reports", None)
    reports = preflight or cluster.run(engine_preflight.collect, timeout=timeout)
    result = ProbeResult(world, cluster.backend, rows, node_latency)
    result.warnings, result.nominal_bytes_per_s = network_warnings(
        reports,
        [r.interface for r in cluster.ranks],
        [r.host for r in cluster.ranks],
        cluster.backend,
        result.peak_busbw,
    )
    return result
