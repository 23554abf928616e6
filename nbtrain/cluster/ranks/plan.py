"""One backend and one device per rank for the whole cluster, decided here before any rank initialises.

In [1]: from nbtrain.cluster.ranks.plan import Slot, plan_devices
In [2]: plan_devices([Slot("vm", 0, 1), Slot("vm", 1, 1)])
Out[2]: DevicePlan(backend='gloo', devices=('cpu', 'cpu'), why='2 ranks on vm but 1 GPU: ...')

Every rank must use the same backend, so no rank may choose alone (a rank with a GPU taking NCCL
while its neighbour without one takes gloo hangs the rendezvous). The rules:

* NCCL needs a GPU of its own for every rank: local rank i on a host uses cuda:i, so a host must
  have at least as many GPUs as ranks. A rank whose launcher gave it its own GPU and hid the others
  (`pinned`: Ray sets CUDA_VISIBLE_DEVICES per actor) uses cuda:0.
* `auto`: NCCL on cuda:<local rank> where that holds for every rank; else gloo on CPU for every
  rank, with one line saying why and what to change (unless no rank has a GPU at all: a CPU cluster
  needs no explanation).
* `gloo`: gloo. Ranks still compute on cuda:<local rank> where every rank has a GPU of its own (as
  under torchrun, the backend carries the collectives, the device is the model's); on CPU otherwise.
  To train on CPU on a GPU machine, hide the GPUs: `env={"CUDA_VISIBLE_DEVICES": ""}`.
* `nccl` where a rank lacks a GPU: a `ConfigError` naming the rank, its host and the fix.

Pure: no torch, no engines; the GPU counts come from each engine's `setup.hello()`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    """One rank as the plan sees it, in rank order."""

    host: str
    local_rank: int
    gpus: int  # GPUs this rank's engine sees on its host (hello()'s "gpus")
    pinned: bool = False  # the engine sees only GPUs given to it alone (Ray): it owns cuda:0


@dataclass(frozen=True)
class DevicePlan:
    """The cluster's backend, every rank's device ("cuda:0", "cpu"), and why GPUs go unused, if so."""

    backend: str  # "nccl" or "gloo", the same on every rank
    devices: tuple[str, ...]  # indexed by rank
    why: str | None = None  # one line for the notebook: why not on the GPUs, and what to change


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _hosts(slots: Sequence[Slot]) -> dict[str, tuple[int, int]]:
    """host -> (ranks on it, GPUs it has), hosts in rank order."""
    out: dict[str, tuple[int, int]] = {}
    for s in slots:
        ranks, gpus = out.get(s.host, (0, 0))
        # pinned engines each see only their own GPUs: the host has their sum
        out[s.host] = (ranks + 1, gpus + s.gpus if s.pinned else max(gpus, s.gpus))
    return out


def _fewer(hosts: dict[str, tuple[int, int]], launcher: str) -> str:
    """How to ask for one rank per GPU with this launcher."""
    if launcher == "local":
        return f"-n {max(g for _, g in hosts.values())}"
    if launcher in ("ssh", "mpi"):
        return "--hosts " + ",".join(f"{h}:{min(r, g)}" for h, (r, g) in hosts.items() if g)
    if launcher == "slurm":
        return "--engines-per-node " + str(min(g for _, g in hosts.values()))
    if launcher == "ray":
        return "--gpus-per-rank 1"
    return "one engine per GPU on each host"


def plan_devices(
    slots: Sequence[Slot], backend: str = "auto", launcher: str = "local"
) -> DevicePlan:
    """The backend and every rank's device for `slots` (one per rank, in rank order).

    `backend` is what the user asked for (auto, gloo, nccl); `launcher` (local, ssh, slurm, mpi,
    connect) only words the fix in messages.
    """
    if backend not in ("auto", "gloo", "nccl"):
        msg = f"unknown backend {backend!r}; choose one of auto, gloo, nccl."
        raise ConfigError(msg)
    own_gpu = [s.gpus > 0 if s.pinned else s.local_rank < s.gpus for s in slots]
    cuda = tuple("cuda:0" if s.pinned else f"cuda:{s.local_rank}" for s in slots)
    cpu = ("cpu",) * len(slots)
    hosts = _hosts(slots)
    if all(own_gpu):
        return DevicePlan("gloo" if backend == "gloo" else "nccl", cuda)
    if backend == "nccl":
        rank = own_gpu.index(False)
        s = slots[rank]
        ranks, gpus = hosts[s.host]
        if gpus == 0:
            fix = (
                "Use --backend gloo (or auto)"
                if len(hosts) == 1
                else f"Leave {s.host} out, or use --backend gloo (or auto)"
            )
        else:
            fix = f"Use {_fewer(hosts, launcher)} (one rank per GPU), or --backend gloo (or auto)"
        msg = (
            f"--backend nccl needs CUDA GPUs, one per rank, but rank {rank} on {s.host} (local rank "
            f"{s.local_rank}) has none: {s.host} has {_n(gpus, 'GPU')} for {_n(ranks, 'rank')}. {fix}."
        )
        raise ConfigError(msg)
    if not any(g for _, g in hosts.values()):
        return DevicePlan("gloo", cpu)  # a CPU cluster: nothing to explain
    short = {h: (r, g) for h, (r, g) in hosts.items() if r > g}
    where = "; ".join(f"{_n(r, 'rank')} on {h} but {_n(g, 'GPU')}" for h, (r, g) in short.items())
    if any(g == 0 for _, g in short.values()):
        bare = ", ".join(h for h, (_, g) in short.items() if g == 0)
        fix = f"leave {bare} out (no GPU) and start one rank per GPU elsewhere"
    elif len(hosts) == 1:
        gpus = next(iter(hosts.values()))[1]
        fix = f"use {_fewer(hosts, launcher)} to train on the {'GPU' if gpus == 1 else 'GPUs'}, or one rank per GPU"
    else:
        fix = f"use {_fewer(hosts, launcher)} to train on the GPUs (one rank per GPU)"
    why = f"{where}: using gloo on CPU for every rank; {fix}."
    return DevicePlan("gloo", cpu, why)


__all__ = ["DevicePlan", "Slot", "plan_devices"]
