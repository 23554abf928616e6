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
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from nbtrain import net, procs
from nbtrain.cluster.group import reinit
from nbtrain.cluster.launch import LaunchOptions
from nbtrain.cluster.launch.base import EngineLaunch, start_engines, stop_here
from nbtrain.cluster.launch.ray.address import output_to, resolve, unreachable
from nbtrain.cluster.launch.ray.engines import RayEngineSet
from nbtrain.cluster.launch.ray.local import StartFailure, diagnose, logs_folder

# the launcher's options and their checks (declared with the placement they decide)
from nbtrain.cluster.launch.ray.placement import (  # noqa: F401
    HINT,
    OPTIONS,
    PLACEMENTS,
    SUMMARY,
    RayNode,
    bundles,
    explain_pending,
    pending_fix,
    rank_order,
    resources_text,
    validate,
)
from nbtrain.cluster.options import PROFILE, StartOptions
from nbtrain.cluster.ranks.topology import describe_ranks
from nbtrain.cluster.session import Launched, Session, adopt, close_client, new_engines
from nbtrain.engine.setup import PINNED_ENV
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

NAMESPACE = "nbtrain"
INSTALL_HINT = 'pip install "ray[default]" (the same Ray version as the cluster\'s)'


def _client_server_hiccup(address: str, e: BaseException) -> bool:
    """Ray Client's head could not start this connection's own server: a failure of that one start,
    which the next connection may not have. Ray says "Starting Ray client server failed" when the
    server's process has exited; when it exits just as the head looks at it, the head's own
    `start_specific_server` fails instead (psutil's ZombieProcess, seen on the simulated nodes)."""
    said = str(e)
    return address.startswith("ray://") and (
        "Starting Ray client server failed" in said
        or ("Initialization failure from server" in said and "start_specific_server" in said)
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
        self.timeout = 120.0  # seconds to connect (the start's --timeout)
        self.private = False  # `local`: a Ray of our own, under temp_dir, that we stop
        self.temp_dir = ""
        self.log_path = ""

    # -- connecting -----------------------------------------------------------------------------

    def connect(self) -> Any:
        """Ray, connected to `--address` (already connected: as it is) within `self.timeout`
        seconds; else one ClusterError fitting the address form, with nothing of ours left."""
        try:
            import ray
        except ImportError:
            msg = f"--launcher ray needs the ray package on this machine: {INSTALL_HINT}."
            raise ConfigError(msg) from None
        if ray.is_initialized():
            return ray
        address = str(self.lo.address)
        timeout = float(self.timeout)
        deadline = time.monotonic() + timeout
        kwargs: dict[str, Any] = {
            "namespace": NAMESPACE,
            "log_to_driver": False,
            "logging_level": logging.WARNING,
        }
        if address == "local":
            # a private Ray for this machine: enough CPUs for the ranks asked for; its own temp
            # dir, which every one of its processes names, so a failed start can find them all
            wanted, _, _ = bundles(self.lo)
            cpus = sum(b.get("CPU", 0.0) for b in wanted)
            kwargs["num_cpus"] = max(os.cpu_count() or 1, int(cpus + 0.999))
            kwargs["include_dashboard"] = False
            self.private = True
        else:
            target = resolve(address)
            if target is None:
                raise self._connect_failed(address, timeout, "no running Ray cluster was found")
            why = unreachable(target, max(0.5, min(10.0, deadline - time.monotonic())))
            if why:
                raise self._connect_failed(address, timeout, why, target)
        # Ray's own retry lines and warnings go here, not to the notebook; a failure names it
        self.temp_dir = tempfile.mkdtemp(prefix=f"nbtrain-ray-{os.getpid()}-")
        self.log_path = os.path.join(self.temp_dir, "connect.log")
        if self.private:
            kwargs["_temp_dir"] = self.temp_dir
        tries = 0
        while True:
            # set before ray.init: a failure inside it (a SystemExit included) must still be undone
            self.started_ray = True
            tries += 1
            began = time.monotonic()
            try:
                with output_to(self.log_path):
                    ray.init(address=address, **kwargs)
                break
            except BaseException as e:
                failure = diagnose(self.temp_dir) if self.private else None
                self._abandon()
                cause = f"{type(e).__name__}: {e}".strip().rstrip(":")
                if isinstance(e, KeyboardInterrupt):
                    raise
                if (
                    failure is not None
                    and failure.slow_agent
                    and deadline - time.monotonic() > time.monotonic() - began
                ):
                    # a raylet that gave up on a slow agent (a fixed 15 s in Ray): start the
                    # private Ray again while --timeout leaves the time another try took
                    log.info("the private Ray did not start (%s); starting it again", failure.cause)
                    self.private = True
                    continue
                if address == "local":
                    raise self._private_failed(timeout, cause, failure, tries) from None
                if _client_server_hiccup(address, e) and deadline - time.monotonic() > 5:
                    # Ray Client starts one server per connection; on a busy head that start can
                    # fail once and work the next time: try again while --timeout lasts
                    log.info("Ray Client's server did not start (%s); connecting again", e)
                    time.sleep(2)
                    continue
                raise self._connect_failed(address, timeout, cause) from None
        if time.monotonic() > deadline + 1.0:
            self._abandon()
            raise self._connect_failed(address, timeout, "Ray took longer than --timeout")
        return ray

    def _connect_failed(
        self, address: str, timeout: float, cause: str, target: str | None = None
    ) -> ClusterError:
        """The one message for a connect that failed, worded for the address form."""
        where = f" Ray's output: {self.log_path}." if os.path.exists(self.log_path) else ""
        cause = cause.rstrip(".")
        if address == "local":
            return self._private_failed(timeout, cause, None, 1)
        if address == "auto":
            found = f" (found at {target})" if target else ""
            msg = (
                f"no Ray cluster answers for --address auto{found} within --timeout {timeout:g} s: "
                f"{cause}. Start one on this machine (ray start --head), set RAY_ADDRESS to the "
                f"head's host:port, or use --address local for a private one.{where}"
            )
        elif address.startswith("ray://"):
            port = address.rsplit(":", 1)[-1]
            msg = (
                f"no Ray Client server answers at --address {address} within --timeout "
                f"{timeout:g} s: {cause}. Check that the head runs (ray status on it), that {port} "
                "is its Ray Client port (10001 unless ray start --head was given "
                "--ray-client-server-port), that this machine can reach it, and that Ray and "
                f"Python here are the versions the cluster runs.{where}"
            )
        else:
            port = address.rsplit(":", 1)[-1]
            msg = (
                f"no Ray head (GCS) answers at --address {address} within --timeout {timeout:g} "
                f"s: {cause}. Check that the head runs (ray status on it), that {port} is its GCS "
                "port (6379 unless ray start --head was given --port), and that this machine can "
                f"reach it; from outside the cluster use ray://HEAD:10001 instead.{where}"
            )
        return ClusterError(msg)

    def _private_failed(
        self, timeout: float, cause: str, failure: StartFailure | None, tries: int
    ) -> ClusterError:
        """The message for a private Ray (`--address local`) that did not start: the cause its
        raylet's log names, that log, and Ray's own words."""
        where = f" Ray's output: {self.log_path}." if os.path.exists(self.log_path) else ""
        cause = cause.rstrip(".")
        logs = logs_folder(self.temp_dir) if self.temp_dir else "?"
        tried = f", {tries} tries" if tries > 1 else ""
        head = f"the private Ray of --address local did not start (--timeout {timeout:g} s{tried})"
        if failure is None:
            return ClusterError(
                f"{head}: {cause}. Its logs: {logs}.{where} Nothing of it was left running. "
                "Start again with a longer --timeout (this machine may be busy or short of "
                "memory), or use --launcher local, which needs no Ray."
            )
        fix = (
            "Start again when this machine is less busy, or with a longer --timeout (nbtrain "
            "starts the private Ray again while --timeout lasts)"
            if failure.slow_agent
            else "Start again, with a longer --timeout if this machine is busy or short of memory"
        )
        return ClusterError(
            f"{head}: {failure.cause}. The raylet's log says so: {failure.log} (Ray said: "
            f"{cause}). Its logs: {logs}.{where} Nothing of it was left running. {fix}, or use "
            "--launcher local, which needs no Ray."
        )

    def _abandon(self) -> None:
        """After a failed start: disconnect, and end every process of a private Ray (SIGTERM,
        then SIGKILL: two of its agents ignore SIGTERM), orphaned ones included."""
        import ray

        self.started_ray = False
        try:
            with output_to(self.log_path):
                ray.shutdown()
        except BaseException as e:
            log.debug("ray.shutdown after a failed start: %s", e)
        self._end_private()

    def _end_private(self) -> None:
        if not (self.private and self.temp_dir):
            return
        self.private = False
        pids = procs.using(self.temp_dir)
        if pids:
            procs.terminate(pids + procs.descendants(pids), grace=2.0)
        left = procs.using(self.temp_dir)
        if left:
            procs.terminate(left, grace=0.0)

    def disconnect(self) -> None:
        """Disconnect from Ray (stopping a `local` one, all its processes) if this start connected."""
        if self.started_ray:
            import ray

            self.started_ray = False
            try:
                ray.shutdown()
            except Exception as e:
                log.debug("ray.shutdown: %s", e)
        self._end_private()

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
        shape = f"{len(wanted)} bundle(s) of {resources_text(wanted[0])}, {strategy}"
        said_pending = ""
        while not self.group.wait(timeout_seconds=min(1.0, remaining())):
            why = explain_pending(
                wanted, strategy, self._alive_nodes(ray), ray.available_resources()
            )
            if remaining() <= 0.1:
                msg = (
                    f"Ray could not place the placement group within --timeout {options.timeout:g} s "
                    f"({shape}): {why}. {pending_fix(strategy)}. The group was removed; nothing "
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
        if remove_logs and self.temp_dir:
            # a clean stop: the private Ray's logs go with it (a failed start keeps them)
            shutil.rmtree(self.temp_dir, ignore_errors=True)

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

    def replace(self, session: Session, ranks: Sequence[int], timeout: float) -> None:
        """`%nbtrain restart`: new actors (and engines) for `ranks` in their bundles, then the
        process group re-created on every rank."""
        deadline = time.monotonic() + timeout

        def remaining() -> float:
            return max(0.1, deadline - time.monotonic())

        es = self._engine_set(session.ipp_cluster)
        tasks = [es.task_of(session.ranks[r].pid) if es is not None else None for r in ranks]
        if es is None or any(t is None for t in tasks):
            msg = (
                f"{describe_ranks(session.ranks, list(ranks))} cannot be replaced: nbtrain no "
                f"longer knows their Ray actors. Restart the cluster: {self.restart_hint()}."
            )
            raise ClusterError(msg)
        dead_ids = {session.ranks[r].engine_id for r in ranks}
        # a wedged rank's engine ends with its old actor (it exits with its parent)
        before = set(session.client.ids) - dead_ids
        infos = es.replace([int(t) for t in tasks if t is not None], remaining())
        while dead_ids & set(session.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        # each new actor's engine is found by its pid: actors may register in any order
        by_pid = {
            int(h["pid"]): (eid, h)
            for eid, h in new_engines(session, before, len(ranks), remaining)
        }
        for r, info in zip(ranks, infos):
            adopt(session.ranks[r], *by_pid[int(info["pid"])])
        reinit(session, timeout=remaining())


def check_nodes(address: str | None = None, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Each alive node's facts (`%nbtrain check --address ...`): one Ray task per node, pinned to
    it, running `nbtrain.engine.facts.node_facts`, before any engine starts."""
    lo = LaunchOptions(launcher="ray", address=address)
    launch = RayLaunch(lo)
    launch.timeout = timeout
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
            except Exception as e:  # that node's row says its error; the other nodes' are kept
                out.append({"hostname": name, "error": f"{type(e).__name__}: {e}"})
        return out
    finally:
        launch.disconnect()


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Start engines as Ray actors (see the module docstring) and form their process group."""
    assert lo is not None
    launch = RayLaunch(lo)
    launch.timeout = float(options.timeout)
    launched = start_engines(launch, options, quiet=quiet)
    launched.replace = launch.replace
    return launched


__all__ = [
    "RayLaunch",
    "RayNode",
    "bundles",
    "check_nodes",
    "explain_pending",
    "rank_order",
    "start",
]
