"""Test Rays that stop only themselves: each has its own temp dir (and, on this machine, its own
ports), and is stopped by its own processes, the ones whose command line names that dir, never by
`ray stop --force` (which ends every Ray on the machine, a user's own cluster included).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import psutil

from nbtrain import procs

RAY_BIN = str(Path(sys.executable).with_name("ray"))


def ray_bin() -> str:
    return RAY_BIN if Path(RAY_BIN).exists() else shutil.which("ray") or "ray"


def temp_dir(tag: str) -> str:
    """A short, new temp dir for one test Ray (Ray's socket paths must stay under 107 bytes)."""
    return tempfile.mkdtemp(prefix=f"nbt-{tag}-", dir="/tmp")


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on this machine now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def own_processes(temp: str) -> list[psutil.Process]:
    """Every process of the Ray whose temp dir is `temp`, and their children."""
    return [psutil.Process(p) for p in procs.using(temp) if procs.exists(p)]


def stop_own(temp: str, grace: float = 5.0) -> list[int]:
    """SIGTERM the Ray of `temp` (all its processes), SIGKILL what is left after `grace` s (two
    of its agents ignore SIGTERM); the pids still running after that (none, normally)."""
    pids = procs.using(temp)
    procs.terminate(pids + procs.descendants(pids), grace)
    _, alive = psutil.wait_procs([p for p in own_processes(temp)], timeout=5)
    return [p.pid for p in alive if procs.running(p)]


def head_argv(temp: str, ports: dict[str, int], cpus: int, gpus: int) -> list[str]:
    """`ray start --head` with its own temp dir and ports."""
    return [
        ray_bin(),
        "start",
        "--head",
        f"--temp-dir={temp}",
        f"--port={ports['gcs']}",
        f"--dashboard-port={ports['dashboard']}",
        f"--ray-client-server-port={ports['client']}",
        f"--dashboard-agent-listen-port={ports['agent']}",
        f"--num-cpus={cpus}",
        f"--num-gpus={gpus}",
        "--disable-usage-stats",
    ]


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    # declared GPUs are not real: engines must report none, so ranks train on CPU with gloo
    env["NBTRAIN_TEST_GPU_COUNT"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # no token auth: a head would otherwise write ~/.ray/auth_token (the user's) and refuse
    # drivers that loaded another token earlier in the same process
    env["RAY_AUTH_MODE"] = "disabled"
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    return env
