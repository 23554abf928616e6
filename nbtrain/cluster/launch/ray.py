"""Engines as Ray actors in one placement group: for users who already have a Ray cluster.

In [1]: cluster = nbtrain.start(launcher="ray", address="auto", n=8, gpus_per_rank=1,
   ...:                         placement="SPREAD")   # %nbtrain start --launcher ray --address auto ...
nbtrain: Ray cluster at auto: 2 nodes, 16 CPUs, 8 GPUs
nbtrain: placement group nbtrain-1a2b3c4d: 8 bundles of {CPU: 1, GPU: 1}, SPREAD: placed

`--address` is `auto` (the Ray cluster this machine belongs to), `local` (a private one-machine Ray
started here and stopped with the nbtrain cluster) or `ray://head:10001` (a remote head, through
Ray Client). One bundle per rank (`--cpus-per-rank`, `--gpus-per-rank`), placed all or nothing with
`--placement` (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD); with `--nodes N --engines-per-node K`, one
bundle per node holding its K ranks, the N nodes STRICT_SPREAD. While Ray cannot place the group, the
start says what is missing; past `--timeout` it removes the group and says what to change.

Each rank is an `EngineHost` actor (nbtrain.engine.ray_host) running an ordinary ipyparallel engine as
its child, so cells, faults, diagnose, probe and attach work as for every launcher. Ranks are
node-major in the order Ray placed the bundles; a rank given GPUs sees only those (Ray sets
CUDA_VISIBLE_DEVICES per actor) and trains on its cuda:0. The controller runs here, listening on the
address that routes to the Ray nodes, as for SSH.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nbtrain import net
from nbtrain.cluster import procs
from nbtrain.cluster.launch.base import EngineLaunch, start_engines, stop_here
from nbtrain.cluster.launch.ray_engines import RayEngineSet
from nbtrain.cluster.options import PROFILE, LaunchOptions, StartOptions
from nbtrain.cluster.session import Launched, close_client
from nbtrain.engine.setup import PINNED_ENV
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger("nbtrain")

NAMESPACE = "nbtrain"
INSTALL_HINT = 'pip install "ray[default]" (the same Ray version as the cluster\'s)'


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


def _fmt(resources: dict[str, float]) -> str:
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
        why.append(f"no node can hold one bundle {_fmt(one)} (a bundle never spans nodes)")
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


def _pending_fix(strategy: str) -> str:
    looser = " a looser --placement (PACK or SPREAD)," if strategy.startswith("STRICT") else ""
    return (
        f"Ask for fewer ranks (-n) or fewer --gpus-per-rank/--cpus-per-rank,{looser} add nodes to "
        "the Ray cluster (ray start --address HEAD:6379 on them), or give a longer --timeout"
    )


class RayLaunch(EngineLaunch):
    """Engines as actors in a placement group of the Ray cluster at `--address`."""

    what = "as Ray actors"

    def __init__(self, lo: LaunchOptions) -> None:
        super().__init__(lo)
        self.started_ray = False  # this start connected (or started) Ray: it disconnects it
        self.group: Any = None
        self.group_name = f"nbtrain-{uuid.uuid4().hex[:8]}"
        self.bundle_of_task: list[int] = []
        self.nodes: list[RayNode] = []

    # -- connecting -----------------------------------------------------------------------------

    def connect(self) -> Any:
        """Ray, connected to `--address` (already connected: as it is); a clear error if not."""
        try:
            import ray
        except ImportError:
            msg = f"--launcher ray needs the ray package on this machine: {INSTALL_HINT}."
            raise ConfigError(msg) from None
        if ray.is_initialized():
            return ray
        address = str(self.lo.address)
        kwargs: dict[str, Any] = {
            "namespace": NAMESPACE,
            "log_to_driver": False,
            "logging_level": logging.WARNING,
        }
        if address == "local":
            # a private Ray for this machine: enough CPUs for the ranks asked for
            wanted, _, _ = bundles(self.lo)
            cpus = sum(b.get("CPU", 0.0) for b in wanted)
            kwargs["num_cpus"] = max(os.cpu_count() or 1, int(cpus + 0.999))
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as e:
            msg = (
                f"no Ray cluster at --address {address}: {e}. Start one (ray start --head) or use "
                "--address local for a private one on this machine."
            )
            raise ClusterError(msg) from None
        except Exception as e:
            msg = (
                f"connecting to Ray at --address {address} failed: {type(e).__name__}: {e}. Check "
                "that the head runs (ray status on it), that ray:// addresses name its Ray Client "
                "port (10001 by default), and that this machine has the same Ray and Python "
                "versions as the cluster."
            )
            raise ClusterError(msg) from None
        self.started_ray = True
        return ray

    def disconnect(self) -> None:
        """Disconnect from Ray (stopping a `local` one) if this start connected."""
        if self.started_ray:
            import ray

            self.started_ray = False
            try:
                ray.shutdown()
            except Exception as e:
                log.debug("ray.shutdown: %s", e)

    def _alive_nodes(self, ray: Any) -> list[RayNode]:
        out = []
        for n in ray.nodes():
            if n.get("Alive"):
                name = n.get("NodeManagerHostname") or n.get("NodeManagerAddress", "?")
                total = {k: float(v) for k, v in n.get("Resources", {}).items()}
                out.append(RayNode(name, n.get("NodeManagerAddress", name), total))
        return out

    # -- the EngineLaunch contract --------------------------------------------------------------

    def listen(self) -> net.ListenChoice:
        ray = self.connect()
        try:
            self.nodes = self._alive_nodes(ray)
            if self.lo.ip:
                return net.ListenChoice(self.lo.ip, net.interface_of(self.lo.ip), "given with --ip")
            return net.listen_address([n.address for n in self.nodes])
        except BaseException:
            self.disconnect()
            raise

    def prepare(self, options: StartOptions, remaining: Callable[[], float], say: Any) -> int:
        try:
            return self._place(options, remaining, say)
        except BaseException:
            self._remove_group()
            self.disconnect()
            raise

    def _place(self, options: StartOptions, remaining: Callable[[], float], say: Any) -> int:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        cpus = sum(n.total.get("CPU", 0.0) for n in self.nodes)
        gpus = sum(n.total.get("GPU", 0.0) for n in self.nodes)
        say(
            f"Ray cluster at {self.lo.address}: {len(self.nodes)} node(s), {cpus:g} CPUs, "
            f"{gpus:g} GPUs"
        )
        wanted, strategy, per = bundles(self.lo)
        self.group = placement_group(wanted, strategy=strategy, name=self.group_name)
        shape = f"{len(wanted)} bundle(s) of {_fmt(wanted[0])}, {strategy}"
        said_pending = ""
        while not self.group.wait(timeout_seconds=min(1.0, remaining())):
            why = explain_pending(
                wanted, strategy, self._alive_nodes(ray), ray.available_resources()
            )
            if remaining() <= 0.1:
                msg = (
                    f"Ray could not place the placement group within --timeout {options.timeout:g} s "
                    f"({shape}): {why}. {_pending_fix(strategy)}. The group was removed; nothing "
                    "was left running."
                )
                raise ClusterError(msg)
            if why != said_pending:
                say(f"placement group {self.group_name} ({shape}) pending: {why}")
                said_pending = why
        table = placement_group_table(self.group)
        bundle_nodes = {int(i): str(node) for i, node in table["bundles_to_node_id"].items()}
        self.bundle_of_task = rank_order(bundle_nodes, per)
        say(
            f"placement group {self.group_name} ({shape}): placed on {len(set(bundle_nodes.values()))} node(s)"
        )
        self.total = len(self.bundle_of_task)
        return self.total

    def launcher_class(self) -> Any:
        return RayEngineSet

    def configure(self, ipp_cluster: Any, options: StartOptions) -> None:
        cfg = ipp_cluster.config.RayEngineSet
        cfg.placement_group_name = self.group_name
        cfg.namespace = NAMESPACE
        cfg.bundle_of_task = list(self.bundle_of_task)
        cfg.cpus_per_rank = float(self.lo.cpus_per_rank or 0)
        cfg.gpus_per_rank = float(self.lo.gpus_per_rank or 0)
        cfg.start_timeout = float(options.timeout)
        env = {"NBTRAIN_PROFILE_NAME": f"profile_{options.profile or PROFILE}"}
        if self.lo.gpus_per_rank:
            env[PINNED_ENV] = "1"
        cfg.engine_environment = env

    def watch(self, ipp_cluster: Any, say: Any, force: bool = False) -> None:
        es = self._engine_set(ipp_cluster)
        if es is None:
            return
        ended = es.exited()
        if ended:
            task, info, code, tail = ended[0]
            where = info.get("host", "?")
            msg = (
                f"the engine of rank {task} on {where} (a Ray actor) exited with code {code} before "
                f"it registered. Its log ({info.get('log', '?')} on {where}) ends:\n{tail.rstrip()}\n"
                "Check that nbtrain and ipyparallel are installed in the Ray nodes' Python. Nothing "
                "was left running."
            )
            raise ClusterError(msg)

    def teardown(
        self, ipp_cluster: Any, client: Any, engine_pids: dict[str, list[int]], remove_logs: bool
    ) -> None:
        close_client(client)
        es = self._engine_set(ipp_cluster)
        if es is not None:
            es.stop_actors()
        self._remove_group()
        stop_here(ipp_cluster, procs.controller_pids(ipp_cluster))
        self.disconnect()

    def _remove_group(self) -> None:
        if self.group is None:
            return
        from ray.util.placement_group import remove_placement_group

        group, self.group = self.group, None
        try:
            remove_placement_group(group)
        except Exception as e:
            log.debug("removing placement group %s: %s", self.group_name, e)

    def restart_hint(self) -> str:
        return "%nbtrain start --force --launcher ray with the same settings"


def check_nodes(address: str | None = None, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Each alive node's facts (`%nbtrain check --address ...`): one Ray task per node, pinned to
    it, running `nbtrain.engine.facts.node_facts`, before any engine starts."""
    lo = LaunchOptions(launcher="ray", address=address)
    launch = RayLaunch(lo)
    ray = launch.connect()
    try:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from nbtrain.engine.facts import node_facts

        probe = ray.remote(num_cpus=0)(node_facts)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)
            ).remote()
            for n in nodes
        ]
        out: list[dict[str, Any]] = []
        for n, ref in zip(nodes, refs):
            name = n.get("NodeManagerHostname") or n.get("NodeManagerAddress", "?")
            try:
                out.append(dict(ray.get(ref, timeout=timeout)))
            except Exception as e:
                out.append({"hostname": name, "error": f"{type(e).__name__}: {e}"})
        return out
    finally:
        launch.disconnect()


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Start engines as Ray actors (see the module docstring) and form their process group."""
    assert lo is not None
    return start_engines(RayLaunch(lo), options, quiet=quiet)


__all__ = [
    "RayLaunch",
    "RayNode",
    "bundles",
    "check_nodes",
    "explain_pending",
    "rank_order",
    "start",
]
