"""Collective timings that run on every rank, for `%nbtrain probe` (nbtrain.cluster.probe)."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


def _device(group: Any = None) -> Any:
    import torch
    import torch.distributed as dist

    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def allreduce_times(
    sizes: list[int], iters: int, warmup: int = 1, group: Any = None
) -> list[dict[str, float]]:
    """Seconds per all_reduce (sum, float32) of each size in bytes, averaged over `iters`.

    Every rank (of `group`, the world by default) must call this with the same arguments.
    """
    import torch
    import torch.distributed as dist

    device = _device(group)
    out = []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        t = torch.ones(numel, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(t, group=group)
        _sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, group=group)
        _sync(device)
        out.append({"bytes": float(numel * 4), "seconds": (time.perf_counter() - t0) / iters})
    return out


def pingpong(pairs: list[tuple[int, int]], iters: int) -> dict[str, float]:
    """One-way latency (half the round trip of a 4-byte send/recv) between each pair of ranks.

    Every rank calls this; ranks outside a pair wait at the barrier after it. The first rank of a
    pair reports it.
    """
    import torch
    import torch.distributed as dist

    device = _device()
    me = dist.get_rank()
    t = torch.zeros(1, dtype=torch.float32, device=device)
    out: dict[str, float] = {}
    for a, b in pairs:
        if me in (a, b):
            peer = b if me == a else a
            for i in range(iters + 1):
                if i == 1:
                    t0 = time.perf_counter()  # the first round trip sets up the connection
                if me == a:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)
            _sync(device)
            if me == a:
                out[f"{a}-{b}"] = (time.perf_counter() - t0) / iters / 2
        dist.barrier()
    return out
