"""The Ray actor behind one rank: it holds the rank's bundle (CPUs, GPUs) and runs its engine.

The Ray launcher (`nbtrain.cluster.launch.ray`) creates one `EngineHost` actor per rank inside the
cluster's placement group, then asks it to start `python -m nbtrain.engine.boot` (an ordinary
ipyparallel engine) as its child. The engine inherits the actor's environment, so it sees the GPUs
Ray gave this actor (CUDA_VISIBLE_DEVICES as Ray sets it) and nothing else; it exits when the actor
goes (NBTRAIN_EXIT_WITH_PARENT), so a dead actor is a dead rank, reported as any dead engine is.

Runs on the Ray nodes: imports neither ray nor the kernel side at module level.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from typing import Any

from nbtrain import procs

log = logging.getLogger(__name__)


class EngineHost:
    """One rank's actor: start its engine, say where it runs, stop it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = ""

    def start(self, engine_args: list[str], env: dict[str, str], log_name: str) -> dict[str, Any]:
        """Start the engine with `env` over this actor's environment; where it runs, and its pid."""
        import ray

        full = dict(os.environ)
        full.update(env)
        # the profile folder on this node (the kernel's path may not exist here)
        profile = os.path.expanduser(
            os.path.join("~", ".ipython", env.get("NBTRAIN_PROFILE_NAME", "profile_nbtrain"))
        )
        for sub in ("security", "log", "pid", "startup"):
            os.makedirs(os.path.join(profile, sub), exist_ok=True)
        full["IPP_PROFILE_DIR"] = profile
        self.log_path = os.path.join(profile, "log", log_name)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nbtrain.engine.boot", *engine_args],
                env=full,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=os.path.expanduser("~"),
            )
        context = ray.get_runtime_context()
        return {
            "host": socket.gethostname(),
            "pid": self.proc.pid,
            "actor_pid": os.getpid(),
            "node_id": context.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "log": self.log_path,
        }

    def poll(self) -> int | None:
        """The engine's exit code, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            procs.signal_process(self.proc, sig)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the engine, SIGKILL it after `grace` seconds; its exit code."""
        if self.proc is None:
            return None
        return procs.stop(self.proc, grace=grace, kill_wait=5)

    def tail(self, lines: int = 20) -> str:
        """The end of the engine's log (for a start that failed)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


__all__ = ["EngineHost"]
