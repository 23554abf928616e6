"""The side file that tells the Jupyter server what an nbtrain cluster is.

ipyparallel writes its own cluster file; next to it nbtrain writes
``<profile_dir>/security/nbtrain-<cluster_id>.json`` with the rank table, so the Lab sidebar can
show nodes, ranks and GPUs. Written atomically, mode 0600, removed when the cluster stops.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.runs import cluster_side_file, ipp_cluster_file_name

log = logging.getLogger(__name__)


def _side_file(profile_dir: str | Path, cluster_id: str) -> Path:
    return cluster_side_file(profile_dir, cluster_id)


def side_file(ipp_cluster: Any) -> Path | None:
    """The side file (rank table, backend, attached kernel) of an ipyparallel cluster, or None."""
    profile_dir = getattr(ipp_cluster, "profile_dir", None)
    cluster_id = getattr(ipp_cluster, "cluster_id", None)
    if not profile_dir or not cluster_id:
        return None
    return _side_file(profile_dir, cluster_id)


def _notebook() -> str | None:
    # the notebook that started the cluster, where the kernel knows it (Jupyter sets it for kernels)
    return os.environ.get("JPY_SESSION_NAME") or None


def write(cluster: Any, state: str = "running") -> None:
    path = side_file(cluster.ipp_cluster)
    if path is None:
        return
    data = {
        "cluster_id": cluster.cluster_id,
        "profile_dir": str(cluster.ipp_cluster.profile_dir),
        "state": state,
        "backend": cluster.backend,
        "world_size": cluster.world_size,
        "hosts": cluster.hosts,
        "ranks": [asdict(r) for r in cluster.ranks],
        "notebook": _notebook(),
        "client_pid": os.getpid(),
        "started": cluster.started,
        # named sub-groups, so a kernel that attaches later knows them (`cluster.groups`)
        "groups": getattr(cluster, "group_specs", {}),
        "reinits": getattr(cluster, "reinits", 0),
        "updated": time.time(),
    }
    atomic.write_json(path, data, perms=0o600)
    # ipyparallel writes its own cluster file world-readable; it names pids and log paths: keep it private
    ipp_file = path.with_name(ipp_cluster_file_name(cluster.cluster_id))
    try:
        os.chmod(ipp_file, 0o600)
    except OSError:
        pass


def remove_files(profile_dir: str | Path, cluster_id: str) -> None:
    """Remove a stopped cluster's files: nbtrain's side file, and the hub's engine-state file
    (``log/engines<cluster_id>.json``), which ipyparallel writes for a controller restart that nbtrain
    never does and never removes, so one more of them was left in the profile on every start."""
    for p in (
        _side_file(profile_dir, cluster_id),
        Path(profile_dir) / "log" / f"engines{cluster_id}.json",
    ):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def forget(ipp_cluster: Any) -> None:
    if side_file(ipp_cluster) is not None:
        remove_files(ipp_cluster.profile_dir, ipp_cluster.cluster_id)
