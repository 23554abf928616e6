"""The ipyparallel clusters this server can see, enriched with nbtrain's side files.

ipyparallel records every cluster in ``<profile_dir>/security/cluster-<id>.json``; nbtrain adds
``nbtrain-<id>.json`` beside it with the ranks, hosts and devices, and the notebook that started it.
A cluster without a side file (started by hand with ``ipcluster``) is still listed, with what
ipyparallel knows.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from nbtrain import runs

log = logging.getLogger(__name__)

# what ipyparallel's cluster ids look like (a time stamp and a random part); anything else is not
# looked up on disk
_CLUSTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def _side_file(profile_dir: str, cluster_id: str) -> dict[str, Any] | None:
    path = runs.cluster_side_file(profile_dir, cluster_id)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _engine_count(cluster: Any) -> int:
    total = 0
    for engine_set in (cluster.engines or {}).values():
        total += int(getattr(engine_set, "n", 0) or 0)
    return total


def cluster_model(key: str, cluster: Any) -> dict[str, Any]:
    """One cluster as the sidebar shows it: id, state, engines, nodes, ranks, GPUs, notebook."""
    from ipyparallel.util import abbreviate_profile_dir

    running = cluster.controller is not None
    engines = _engine_count(cluster)
    side = _side_file(cluster.profile_dir, cluster.cluster_id) or {}
    ranks = side.get("ranks") or []
    hosts = side.get("hosts") or sorted({r.get("host") for r in ranks if r.get("host")})
    gpus = sorted(
        {
            (r.get("host"), r.get("device"))
            for r in ranks
            if str(r.get("device", "")).startswith("cuda")
        }
    )
    state = "running" if running else "stopped"
    if running and side.get("state") and side["state"] != "stopped":
        # the side file knows finer states (starting, ready, failed) while the controller is up
        state = side["state"]
    return {
        "id": key,
        "cluster_id": cluster.cluster_id,
        "profile": abbreviate_profile_dir(cluster.profile_dir),
        "profile_dir": cluster.profile_dir,
        "state": state,
        "engines": engines,
        "backend": side.get("backend"),
        "world_size": side.get("world_size", engines),
        "hosts": hosts,
        "nodes": len(hosts),
        "gpus": len(gpus),
        "ranks": ranks,
        "notebook": side.get("notebook"),
        "started": side.get("started"),
        "nbtrain": bool(side),
    }


def list_clusters(profile_dirs: list[str] | None = None) -> list[dict[str, Any]]:
    """Every cluster with a cluster file, running ones first, newest first.

    Without `profile_dirs`, every IPython profile under ``$IPYTHONDIR`` is searched, as
    ``ipcluster list`` does.
    """
    from ipyparallel import ClusterManager

    manager = ClusterManager()
    clusters = manager.load_clusters(profile_dirs=profile_dirs, init_default_clusters=False)
    models = [cluster_model(key, cluster) for key, cluster in clusters.items()]
    models.sort(key=lambda m: (m["state"] == "stopped", -(m["started"] or 0), m["id"]))
    return models


def _ipython_dir() -> Path:
    from IPython.paths import get_ipython_dir

    return Path(os.environ.get("IPYTHONDIR") or get_ipython_dir())


def find_side_file(cluster_id: str | None) -> dict[str, Any] | None:
    """The side file of cluster `cluster_id` in any IPython profile, while it exists (it is removed
    when the cluster stops); None otherwise."""
    if not cluster_id or not _CLUSTER_ID.fullmatch(cluster_id):
        return None
    for path in sorted(
        _ipython_dir().glob(f"profile_*/security/{runs.cluster_file_name(cluster_id)}")
    ):
        data = _side_file(str(path.parent.parent), cluster_id)
        if data is not None:
            return data
    return None


def run_cluster(record: dict[str, Any]) -> dict[str, Any]:
    """Where a run ran, for its run panel: the record's cluster id, world size and host, and the
    cluster's hosts, backend and notebook while its side file is still there (None otherwise)."""
    side = find_side_file(record.get("cluster_id")) or {}
    host = record.get("host")
    return {
        "cluster_id": record.get("cluster_id"),
        "world_size": record.get("world_size"),
        "host": host,
        "hosts": side.get("hosts") or ([host] if host else []),
        "backend": side.get("backend"),
        "notebook": side.get("notebook"),
    }
