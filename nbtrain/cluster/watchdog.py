"""The idle watchdog: a cluster whose kernel is gone and that runs nothing stops itself.

One small process per local cluster, started with it (its own session, so a dying kernel does not take
it along). Every few seconds it looks at the cluster's side file (``nbtrain-<cluster_id>.json``):

* attached: the kernel named there (``client_pid``) is alive. `%nbtrain attach` rewrites it;
* busy: an engine has a task queued or running (asked from the hub, like ``%nbtrain status``).

After ``idle_timeout`` seconds neither attached nor busy (``NBTRAIN_IDLE_TIMEOUT``, default 1800) it
stops the engines and the controller and removes the side file. When the cluster is stopped normally the
side file goes away and so does the watchdog.

    python -m nbtrain.cluster.watchdog <side-file>
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_IDLE = 1800.0
ENV = "NBTRAIN_IDLE_TIMEOUT"


def idle_timeout() -> float:
    """Seconds a cluster with no kernel and no job may idle: $NBTRAIN_IDLE_TIMEOUT, default 30 min."""
    raw = os.environ.get(ENV)
    if not raw:
        return DEFAULT_IDLE
    try:
        value = float(raw)
    except ValueError:
        from nbtrain.errors import ConfigError

        msg = f"{ENV}={raw!r} is not a number of seconds; e.g. {ENV}=1800 (30 min)."
        raise ConfigError(msg) from None
    return value if value > 0 else DEFAULT_IDLE


def spawn(cluster: Any) -> int | None:
    """Start the watchdog of a local cluster; returns its pid (stopping the cluster kills it too)."""
    from nbtrain.cluster import registry

    path = registry._path(cluster.ipp_cluster)
    if path is None:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbtrain.cluster.watchdog", str(path), str(idle_timeout())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return proc.pid


def _alive(pid: Any) -> bool:
    import psutil

    try:
        return psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return False


def _busy(client: Any) -> bool:
    try:
        status = client.queue_status()
    except Exception:
        return True  # cannot tell: do not stop on a guess
    return any(
        isinstance(v, dict) and (v.get("queue", 0) or v.get("tasks", 0)) for v in status.values()
    )


def _stop(side: dict[str, Any]) -> None:
    import psutil

    pids = []
    for r in side.get("ranks", []):
        pids.append(int(r["pid"]))
    try:
        import ipyparallel as ipp

        ipc = ipp.Cluster.from_file(profile_dir=side["profile_dir"], cluster_id=side["cluster_id"])
        ipc.stop_cluster_sync()
    except Exception:
        pass
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    from nbtrain.cluster import registry

    registry.remove_files(side["profile_dir"], side["cluster_id"])  # the side file too


def watch(path: Path, idle: float) -> None:
    from nbtrain.cluster.core import close_client

    every = max(0.5, min(15.0, idle / 4))
    # The hub is asked only while no kernel is attached: an ipyparallel Client subscribes to every
    # engine's output, so one held here for the whole session would take CPU from the ranks on each
    # message they send (and importing ipyparallel alone costs a quarter of a CPU second)
    client = None
    last_active = time.monotonic()
    while True:
        time.sleep(every)
        try:
            side = json.loads(path.read_text())
        except FileNotFoundError:
            close_client(client)
            return  # stopped normally
        except (OSError, json.JSONDecodeError):
            continue  # being rewritten
        if _alive(side.get("client_pid")):
            close_client(client)  # a kernel attached again
            client = None
            last_active = time.monotonic()
            continue
        if client is None:
            try:
                import ipyparallel as ipp

                client = ipp.Client(
                    profile_dir=side["profile_dir"], cluster_id=side["cluster_id"], timeout=10
                )
            except Exception:
                client = None
        if client is None or _busy(client):
            last_active = time.monotonic()
            continue
        if time.monotonic() - last_active >= idle:
            close_client(client)
            _stop(side)
            return


if __name__ == "__main__":
    watch(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else idle_timeout())
