"""The idle watchdog: a cluster whose kernel is gone and that runs nothing stops itself.

One small process per local cluster, started with it (its own session, so a dying kernel does not take
it along). Every few seconds it looks at the cluster's side file (``nbtrain-<cluster_id>.json``):

* attached: the kernel named there (``client_pid``) is alive. `%nbtrain attach` rewrites it;
* busy: an engine has a task queued or running (asked from the hub, like ``%nbtrain status``).

After ``idle_timeout`` seconds neither attached nor busy (``NBTRAIN_IDLE_TIMEOUT``, default 1800) it
stops the engines and the controller and removes the side file. When the cluster is stopped normally the
side file goes away and so does the watchdog.

    python -m nbtrain.cluster.faults.watchdog <side-file>
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from nbtrain import procs
from nbtrain.cluster import registry
from nbtrain.cluster.options import idle_timeout
from nbtrain.cluster.session import close_client

log = logging.getLogger(__name__)


def _busy(client: Any) -> bool:
    try:
        status = client.queue_status()
    except Exception:
        return True  # cannot tell: do not stop on a guess
    return any(
        isinstance(v, dict) and (v.get("queue", 0) or v.get("tasks", 0)) for v in status.values()
    )


def _stop(side: dict[str, Any]) -> None:
    pids = [int(r["pid"]) for r in side.get("ranks", [])]
    try:
        import ipyparallel as ipp

        ipc = ipp.Cluster.from_file(profile_dir=side["profile_dir"], cluster_id=side["cluster_id"])
        ipc.stop_cluster_sync()
    except Exception:
        # the processes are killed below whatever ipyparallel managed
        log.debug(
            "stopping cluster %s through ipyparallel failed", side.get("cluster_id"), exc_info=True
        )
    procs.kill_with_children(pids)
    registry.remove_files(side["profile_dir"], side["cluster_id"])  # the side file too


def watch(path: Path, idle: float) -> None:
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
        if procs.alive(side.get("client_pid")):
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
            except Exception:  # the hub is not up (yet, or any more): counted as busy, asked again
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
