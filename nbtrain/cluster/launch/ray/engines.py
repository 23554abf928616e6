"""ipyparallel's engine set, as Ray actors: one `EngineHost` actor per rank in a placement group.

Its own module so the class can be imported by name: ipyparallel records it in the cluster file.
The Ray launcher (`launch/ray.py`) has already connected to Ray and placed the group; this class
only creates the actors in their bundles, starts an engine in each, and stops them.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from ipyparallel.cluster.launcher import EngineLauncher
from traitlets import Dict, Float, Int, List, Unicode

from nbtrain.engine.boot import EXIT_WITH_PARENT_ENV
from nbtrain.engine.network import TASK_ENV

log = logging.getLogger(__name__)


class RayEngineSet(EngineLauncher):
    """One actor per rank, each in its bundle of the placement group, each running one engine."""

    # how ipyparallel names the class in the cluster file: a dotted path it can import back
    entrypoint_name = "nbtrain.cluster.launch.ray.engines.RayEngineSet"

    placement_group_name = Unicode("", config=True).tag(to_dict=True)
    namespace = Unicode("nbtrain", config=True).tag(to_dict=True)
    # rank order: the bundle index of each task (several tasks share a bundle with --nodes)
    bundle_of_task = List(Int(), config=True).tag(to_dict=True)
    cpus_per_rank = Float(1.0, config=True).tag(to_dict=True)
    gpus_per_rank = Float(0.0, config=True).tag(to_dict=True)
    engine_environment = Dict(config=True)
    start_timeout = Float(120.0, config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.actors: list[Any] = []
        self.infos: list[dict[str, Any]] = []

    def find_args(self) -> list[str]:
        return ["ray engine set"]

    def actor_name(self, task: int) -> str:
        return f"{self.placement_group_name}-rank{task}"

    def start(self, n: int) -> list[dict[str, Any]]:
        import ray

        refs = [self._start_actor(task) for task in range(len(self.bundle_of_task))]
        self.n = len(refs)
        self.infos = list(ray.get(refs, timeout=self.start_timeout))
        log.info("ray: %d engine(s) started: %s", len(self.infos), self.infos)
        self.notify_start(self.infos)
        return self.infos

    def _start_actor(self, task: int) -> Any:
        """Create task `task`'s actor in its bundle (the name carries the task) and start its
        engine; the start's object ref (where it runs)."""
        import ray
        from ray.util import get_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from nbtrain.engine.ray_host import EngineHost

        pg = get_placement_group(self.placement_group_name)
        actor: Any = (
            ray.remote(EngineHost)
            .options(  # type: ignore[attr-defined]
                name=self.actor_name(task),
                namespace=self.namespace,
                num_cpus=self.cpus_per_rank,
                num_gpus=self.gpus_per_rank,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=self.bundle_of_task[task]
                ),
            )
            .remote()
        )
        if task < len(self.actors):
            self.actors[task] = actor
        else:
            self.actors.append(actor)
        env = {
            **self.get_env(),
            **self.engine_environment,
            TASK_ENV: str(task),
            EXIT_WITH_PARENT_ENV: "1",
        }
        log_name = f"ipengine-{self.cluster_id}-{task}.log"
        log.debug(
            "ray: task %d's engine in bundle %d: %s",
            task,
            self.bundle_of_task[task],
            self.engine_args,
        )
        return actor.start.remote(list(self.engine_args), env, log_name)

    def task_of(self, engine_pid: int) -> int | None:
        """The task whose actor started the engine with pid `engine_pid`."""
        for task, info in enumerate(self.infos):
            if int(info.get("pid", -1)) == engine_pid:
                return task
        return None

    def replace(self, tasks: list[int], timeout: float) -> list[dict[str, Any]]:
        """New actors (and engines) for `tasks`, in their bundles; the old actors killed first,
        so their bundles are free. Where each new engine runs."""
        import ray

        for task in tasks:
            try:
                ray.kill(self.actors[task], no_restart=True)
            except Exception as e:
                log.debug("ray.kill of task %s: %s", task, e)
        # a new actor takes the old one's name, which Ray frees once the old one is dead
        deadline = time.monotonic() + min(timeout, 30.0)
        for task in tasks:
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(self.actor_name(task), namespace=self.namespace)
                except ValueError:
                    break
                time.sleep(0.1)
        refs = [self._start_actor(task) for task in tasks]
        infos = list(ray.get(refs, timeout=timeout))
        for task, info in zip(tasks, infos):
            self.infos[task] = info
        return infos

    def exited(self) -> list[tuple[int, dict[str, Any], int, str]]:
        """Engines that have already ended: (task, where it ran, exit code, its log's last lines)."""
        import ray

        if not self.actors:
            return []
        codes = ray.get([a.poll.remote() for a in self.actors], timeout=30)
        out = []
        for task, code in enumerate(codes):
            if code is not None:
                tail = ray.get(self.actors[task].tail.remote(), timeout=30)
                out.append((task, self.infos[task] if task < len(self.infos) else {}, code, tail))
        return out

    def signal(self, sig: int) -> None:
        for actor in self.actors:
            try:
                actor.signal.remote(int(sig))
            except Exception as e:
                log.debug("signal to a Ray engine failed: %s", e)

    def stop_actors(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL), then kill its actor; idempotent."""
        import ray

        actors, self.actors = self.actors, []
        if not actors:
            return
        log.info("ray: stopping %d engine(s) and their actors", len(actors))
        try:
            ray.get([a.stop.remote() for a in actors], timeout=15)
        except Exception as e:
            log.debug("stopping Ray engines: %s", e)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                log.debug("ray.kill: %s", e)

    async def stop(self) -> None:
        try:
            self.stop_actors()
        finally:
            self.notify_stop({"exit_code": None, "signal": int(signal.SIGTERM)})

    def get_output(self, remove: bool = False) -> str:
        # each engine's log stays on its node (the actor's `log`), where messages point
        return ""


__all__ = ["RayEngineSet"]
