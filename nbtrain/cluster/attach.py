"""Reconnect a new kernel to a cluster that outlived its kernel, and to the job it runs.

In [1]: %load_ext nbtrain
In [2]: %nbtrain attach              # twin of nbtrain.attach(): rank table, then the running job's live plot

Engines and the controller run in their own sessions, so a dying kernel leaves them (and a `finetune`
in progress, which keeps appending to ``output_dir/metrics.jsonl``) running. The cluster's side file
``<profile>/security/nbtrain-<cluster_id>.json`` holds the rank table; ipyparallel's own cluster file
lets the new kernel stop and restart engines as if it had started them. Following the job tails its
metrics.jsonl into the same live display a `%%distributed` cell draws; interrupting the follow only
detaches, the job goes on.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from nbtrain import runs
from nbtrain.cluster import registry
from nbtrain.cluster.faults.recovery import lost_ranks
from nbtrain.cluster.launch import local
from nbtrain.cluster.options import StartOptions
from nbtrain.cluster.ranks.topology import RankInfo
from nbtrain.cluster.session import Launched, Session
from nbtrain.compare.data import json_rows
from nbtrain.errors import ClusterError

log = logging.getLogger(__name__)


@dataclass
class Attached:
    """What `attach` found: the cluster (now current) and the job running on it, if any."""

    cluster: Any
    run: dict[str, Any] | None

    def follow(
        self, timeout: float | None = None, live: bool = True, poll: float = 0.5
    ) -> list[dict[str, Any]]:
        """Tail the running job's metrics.jsonl (into the live display in a notebook) until it ends."""
        if self.run is None:
            return []
        return follow_run(self.run, timeout=timeout, live=live, poll=poll)


def _profile_dir(profile: str) -> Path:
    from IPython.paths import get_ipython_dir

    return Path(get_ipython_dir()) / f"profile_{profile}"


def find_clusters(profile: str = "nbtrain") -> list[dict[str, Any]]:
    """Side files of this profile's clusters whose controller still runs, newest first."""
    import psutil

    out = []
    for path in sorted((_profile_dir(profile) / "security").glob(runs.cluster_file_name("*"))):
        try:
            side = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        ipp_file = path.with_name(runs.ipp_cluster_file_name(str(side.get("cluster_id"))))
        try:
            ctl = json.loads(ipp_file.read_text()).get("controller", {}).get("state", {})
            alive = psutil.pid_exists(int(ctl.get("pid", -1)))
        except (OSError, ValueError, json.JSONDecodeError, AttributeError):
            alive = False
        if alive:
            side["_path"] = str(path)
            out.append(side)
    out.sort(key=lambda s: s.get("started") or 0, reverse=True)
    return out


def running_job(cluster: Any) -> dict[str, Any] | None:
    """The registered run that rank 0 of `cluster` is executing, if any."""
    from nbtrain.runs import list_runs

    pid0 = cluster.ranks[0].pid
    for run in list_runs():
        if run.get("state") == "running" and run.get("pid") == pid0:
            return run
    return None


def find_one(cluster_id: str | None, profile: str, current: Any) -> dict[str, Any] | None:
    """The side file of the cluster to attach to; None when `current` already is that cluster."""
    found = find_clusters(profile)
    if cluster_id is not None:
        found = [s for s in found if s.get("cluster_id") == cluster_id]
    if not found:
        which = f"cluster {cluster_id!r}" if cluster_id else "no running nbtrain cluster"
        msg = (
            f"{which} {'is not running' if cluster_id else 'was found'} in profile {profile!r} "
            f"({_profile_dir(profile)}). Start one with %nbtrain start -n 2."
        )
        raise ClusterError(msg)
    if len(found) > 1 and cluster_id is None:
        ids = ", ".join(s["cluster_id"] for s in found)
        msg = f"{len(found)} clusters are running ({ids}); name one: %nbtrain attach <cluster_id>."
        raise ClusterError(msg)
    side = found[0]
    if current is not None and current.cluster_id == side["cluster_id"]:
        return None
    if current is not None:
        msg = (
            f"this kernel already has a cluster ({current.cluster_id}); stop it with %nbtrain stop "
            "before attaching to another."
        )
        raise ClusterError(msg)
    return side


def reconnect(side: dict[str, Any], timeout: float = 30.0) -> Launched:
    """A new client to the cluster of side file `side`, with its rank table, as a launch would give."""
    import ipyparallel as ipp

    try:
        # quiet as the cluster this kernel starts: no "Stopping engine(s): ..." on %nbtrain stop
        ipc = ipp.Cluster.from_file(
            profile_dir=side["profile_dir"], cluster_id=side["cluster_id"], log_level=logging.ERROR
        )
        client = ipc.connect_client_sync()
        client.wait_for_engines(side["world_size"], timeout=timeout, interactive=False)
    except Exception as e:
        msg = (
            f"could not reconnect to cluster {side['cluster_id']}: {type(e).__name__}: {e}. Its idle "
            "watchdog stops it once nothing runs on it; or start a new one with %nbtrain start --force."
        )
        raise ClusterError(msg) from None
    names = {f.name for f in fields(RankInfo)}
    ranks = [RankInfo(**{k: v for k, v in r.items() if k in names}) for r in side["ranks"]]
    missing = [r.rank for r in ranks if r.engine_id not in client.ids]
    # a re-init after a restart plans again with the backend the cluster was started with, so it
    # keeps that backend and those devices (the side file records every rank's GPU count)
    backend = side.get("backend", "gloo")

    def ready(session: Session) -> None:
        session.started = side.get("started") or session.started
        lost_ranks(session).update(missing)
        # the engines still hold the named groups the last kernel made: know them here too
        session.group_specs = {n: list(r) for n, r in (side.get("groups") or {}).items()}
        session.reinits = int(side.get("reinits") or 0)  # a later re-init counts on from there
        registry.write(session)  # this kernel is now the one attached (client_pid)

    return Launched(
        client,
        ipc,
        ranks,
        None,
        StartOptions(n=len(ranks), backend=backend),
        launcher="local",
        stop=local.stop,
        replace=local.replace,
        pids=[r.pid for r in ranks],
        on_ready=ready,
    )


def show(cluster: Any, live: bool = True, follow: bool = True) -> Attached:
    """Print what was attached (rank table, the running job) and follow the job if asked."""
    missing = sorted(lost_ranks(cluster))
    run = running_job(cluster)
    print(
        f"nbtrain: attached to cluster {cluster.cluster_id}: {cluster.world_size} rank(s), backend "
        f"{cluster.backend}"
        + (f"; rank(s) {missing} are gone: run %nbtrain restart" if missing else "")
    )
    print(cluster.table())
    result = Attached(cluster, run)
    if run is None:
        print("nbtrain: no job is running on it.")
    else:
        print(
            f"nbtrain: job {run['name']!r} is running (step {run.get('step')}/{run.get('total_steps')}), output in {run['output_dir']}"
        )
        if follow and live:
            try:
                result.follow(live=True)
            except KeyboardInterrupt:
                print("nbtrain: stopped following; the job goes on.")
    return result


class _Tail:
    """The complete JSON lines a growing file gained since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0
        self.buf = ""

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """(new rows, whether the file grew at all)."""
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            chunk = ""
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        return list(json_rows(lines)), bool(chunk)


def follow_run(
    run: dict[str, Any], timeout: float | None = None, live: bool = True, poll: float = 0.5
) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl as they come, until the run is no longer running (or `timeout`).
    Its samples (samples.jsonl, where the run samples while training) are shown beside them, those
    taken before the attach included."""
    from nbtrain.runs import METRICS_FILE, SAMPLES_FILE, get_run, loss_unit

    folder = Path(run["output_dir"])
    metrics, samples = _Tail(folder / METRICS_FILE), _Tail(folder / SAMPLES_FILE)
    display = None
    if live:
        from nbtrain.cluster.cell import in_kernel

        if in_kernel():
            from nbtrain.live import LiveDisplay

            display = LiveDisplay()
            display.feed(
                {
                    "kind": "begin",
                    "total_steps": run.get("total_steps"),
                    "name": run.get("name"),
                    "loss_unit": loss_unit(run.get("kind")),
                    "run_id": run.get("id"),
                }
            )
    rows: list[dict[str, Any]] = []
    state = run.get("state")
    by_step: dict[int, list[dict[str, Any]]] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            state = (get_run(run["id"]) or {}).get("state")
            new, grew = metrics.read()
            for row in new:
                rows.append(row)
                if display is not None:
                    display.feed({"kind": "row", "row": row})
                else:
                    print(
                        f"step {row.get('step')}/{run.get('total_steps')} | loss {row.get('loss', float('nan')):.4f}",
                        flush=True,
                    )
            new_samples, _ = samples.read()
            for step in _add_samples(by_step, new_samples):
                if display is not None:
                    shown = [{k: v for k, v in r.items() if k != "step"} for r in by_step[step]]
                    display.feed({"kind": "samples", "step": step, "rows": shown})
            if display is None:
                for r in new_samples:
                    print(
                        f"sample at step {r.get('step')} [{r.get('index')}]: {r.get('prompt')!r} -> "
                        f"{r.get('completion')!r}",
                        flush=True,
                    )
            if display is not None:
                display.maybe_render()
            if state != "running" and not grew:
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll)
    finally:
        if display is not None:
            # how the run ended, or "running" where the follow timed out before it did
            display.feed({"kind": "end", "state": state})
            display.close()
    return rows


def _add_samples(by_step: dict[int, list[dict[str, Any]]], rows: list[dict[str, Any]]) -> list[int]:
    """File sample rows under their step; the steps that gained rows, in order."""
    steps = []
    for r in rows:
        step = int(r.get("step", 0))
        by_step.setdefault(step, []).append(r)
        if step not in steps:
            steps.append(step)
    return steps


__all__ = [
    "Attached",
    "find_clusters",
    "find_one",
    "follow_run",
    "reconnect",
    "running_job",
    "show",
]
