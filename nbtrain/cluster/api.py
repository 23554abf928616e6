"""The public entry points: start a cluster, connect to one, attach to one that outlived its kernel.

In [1]: import nbtrain
In [2]: cluster = nbtrain.start(n=2)          # twin of %nbtrain start -n 2
In [3]: cluster.run(lambda: __import__("os").environ["RANK"])
Out[3]: ['0', '1']

Each checks its settings, stops (or refuses to replace) the current cluster, has a launcher start the
engines (`nbtrain.cluster.launch`), and wraps what comes back in the `Cluster` facade.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from nbtrain.cluster import attach as attaching
from nbtrain.cluster import launch as launchers
from nbtrain.cluster.facade import Cluster, current_cluster, replace_current, set_current
from nbtrain.cluster.launch import connect as connecting
from nbtrain.cluster.launch import parse_launch
from nbtrain.cluster.options import StartOptions, default_engine_count, local_gpu_count
from nbtrain.cluster.ranks.plan import Slot, plan_devices
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


def start(
    n: int | None = None,
    backend: str = "auto",
    timeout: float = 120.0,
    force: bool = False,
    pg_timeout: float = 1800.0,
    env: dict[str, str] | None = None,
    quiet: bool = True,
    launcher: str = "local",
    allocator: str | None = None,
    announce: Callable[[int], None] | None = None,
    **launch: Any,
) -> Cluster:
    """Start `n` engines on this machine and a process group across them; return the `Cluster`.

    In [1]: cluster = nbtrain.start(n=2)
    In [2]: cluster.run(lambda: __import__("os").environ["WORLD_SIZE"])
    Out[2]: ['2', '2']

    `n` defaults to one engine per GPU of this machine (1 without GPUs), as `%nbtrain start` does.
    The backend and every rank's device are decided here, once, before any rank initialises
    (`nbtrain.cluster.ranks.plan`): `"auto"` is NCCL on cuda:<local rank> when every rank gets a GPU of
    its own, else gloo on CPU for every rank, with one printed line saying why; `"nccl"` where a
    rank would lack a GPU is a `ConfigError`; `"gloo"` keeps the GPUs only where every rank has its
    own. With `launcher="ssh"`, `"slurm"`, `"mpi"` or `"ray"`, engines start elsewhere instead
    (settings declared by each launcher, `nbtrain.cluster.launch.LaunchOptions`: hosts, nodes, gpus_per_node, partition,
    account, time, ip, iface, port, address, placement, gpus_per_rank, cpus_per_rank,
    allow_version_mismatch, ...):

    In [3]: nbtrain.start(launcher="ssh", hosts="node1:2,node2:2", force=True)
    In [4]: nbtrain.start(launcher="slurm", nodes=2, gpus_per_node=4, partition="gpu", time="02:00:00")
    In [5]: nbtrain.start(launcher="mpi", n=8)
    In [6]: nbtrain.start(launcher="ray", address="auto", n=8, gpus_per_rank=1, placement="SPREAD")

    Local CPU engines run with tcmalloc where the machine has it (`allocator="auto"`, or
    $NBTRAIN_ALLOCATOR): 3-10% more tokens/s on CPU here. `"system"` keeps glibc's malloc;
    `"tcmalloc"` fails if it is missing. `cluster.allocator` says what the engines got.

    Either every engine and the process group are ready within `timeout` seconds, or this raises
    and leaves no process behind.
    """
    remote = launcher != "local" or bool(launch)
    options = StartOptions(
        n=1 if remote and n is None else default_engine_count(n),
        backend=backend,
        timeout=timeout,
        force=force,
        pg_timeout=pg_timeout,
        extra_env=dict(env or {}),
        allocator=allocator,
    )
    launch_options = None
    if allocator is not None and (launcher != "local" or launch):
        msg = (
            f"--allocator applies to engines started on this machine, not with --launcher {launcher}. "
            "Drop it, or set LD_PRELOAD for the remote engines in their environment yourself."
        )
        raise ConfigError(msg)
    if remote:
        if n is not None:
            launch["n"] = options.n  # mpi's rank count; an error for the other launchers
        launch_options = parse_launch(launcher, launch)
    elif options.backend == "nccl":
        # refused before anything starts; the plan on the engines' own GPU counts decides again
        host, gpus = socket.gethostname(), local_gpu_count()
        plan_devices([Slot(host, i, gpus) for i in range(options.n)], "nccl")
    replace_current(options.force, "replace it with %nbtrain start --force")
    if announce is not None:  # the start goes ahead: the magic's "starting N engine(s)..." line
        announce(options.n)
    cluster: Cluster = Cluster.from_launched(launchers.start(options, launch_options, quiet=quiet))
    set_current(cluster)
    return cluster


async def start_async(**kwargs: Any) -> Cluster:
    """The awaitable twin of `start` (runs it in a worker thread)."""
    return await asyncio.to_thread(start, **kwargs)


def connect(
    cluster_id: str | None = None,
    *,
    profile: str | None = None,
    file: str | None = None,
    iface: str | None = None,
    port: int | None = None,
    backend: str = "auto",
    timeout: float = 120.0,
    allow_version_mismatch: bool = False,
    force: bool = False,
    quiet: bool = True,
) -> Cluster:
    """Attach to an ipyparallel cluster started any way; give its engines ranks and a process group.

    In [1]: cluster = nbtrain.connect(profile="mpi")      # twin of %nbtrain connect --profile mpi

    Stopping the returned cluster leaves its engines running (whoever started them stops them).
    """
    options = StartOptions(backend=backend, timeout=timeout, force=force)  # before anything stops
    replace_current(force, "pass --force")
    launched = connecting.connect(
        cluster_id,
        options,
        profile=profile,
        file=file,
        iface=iface,
        port=port,
        allow_version_mismatch=allow_version_mismatch,
        quiet=quiet,
    )
    cluster: Cluster = Cluster.from_launched(launched)
    set_current(cluster)
    return cluster


def attach(
    cluster_id: str | None = None,
    profile: str = "nbtrain",
    live: bool = True,
    follow: bool = True,
    timeout: float = 30.0,
) -> attaching.Attached:
    """Make a running cluster this kernel's current cluster again; follow its running job.

    In [1]: a = nbtrain.attach()     # %nbtrain attach
    """
    current = current_cluster()
    side = attaching.find_one(cluster_id, profile, current)
    if side is None:  # the current cluster is the one asked for
        assert current is not None
        return attaching.Attached(current, attaching.running_job(current))
    cluster: Cluster = Cluster.from_launched(attaching.reconnect(side, timeout))
    set_current(cluster)
    return attaching.show(cluster, live=live, follow=follow)


def scaling(cfg: Any, **kwargs: Any) -> Any:
    """The running cluster's scaling report for `cfg`; twin of %nbtrain scaling.

    In [1]: report = nbtrain.scaling(cfg, nodes=[1, 2, 4], steps=30, predict=[8, 16])
    In [2]: report.table
    """
    from nbtrain.cluster.facade import require_cluster

    return require_cluster().scaling(cfg, **kwargs)
