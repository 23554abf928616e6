"""`Cluster`, the one public object: a session with everything a notebook does on it, delegated.

Get one from `nbtrain.start()`; `nbtrain.current_cluster()` returns the one the magics use. The
work happens below: the cell runner (`cell`), fault handling (`faults`, `diagnose`), the probe, the
process group (`group`); the launcher that started the engines stops them (`launch`).
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Sequence
from typing import Any

from nbtrain.cluster import group
from nbtrain.cluster.group import define_groups, group_ranks
from nbtrain.cluster.ranks.ranges import parse_ranks
from nbtrain.cluster.session import Session
from nbtrain.errors import ClusterError, ConfigError, NoClusterError

log = logging.getLogger(__name__)

_current: Cluster | None = None


class Cluster(Session):
    """A running set of engines, one per torch rank, joined in one process group.

    Get one from `nbtrain.start()`; `nbtrain.current_cluster()` returns the one the magics use.
    """

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "running"
        return f"<nbtrain.Cluster {state}: {self.world_size} rank(s), backend {self.backend}, hosts {', '.join(self.hosts)}>"

    def execute(
        self,
        code: str,
        ranks: Any = None,
        output: str = "rank0",
        timeout: float | None = None,
        live: bool = True,
        group: str | None = None,
    ) -> list[Any]:
        """Run `code` on every rank (or `ranks`, or named `group`'s) in its persistent namespace,
        like a `%%distributed` cell; `group` in the code is that group's process group (else WORLD).

        Streams the output as it comes (rank 0's, or every rank's with `output="all"`), draws live
        plots from `nbtrain.log`, and raises `DistributedCellError` if any rank fails.
        """
        from nbtrain.cluster.cell import CellRun

        if group is not None and ranks is not None:
            msg = "--ranks and --group cannot be used together: --group runs the cell on its group's ranks."
            raise ConfigError(msg)
        which = (
            group_ranks(self, group) if group is not None else parse_ranks(ranks, self.world_size)
        )
        run = CellRun(self, code, which, output=output, timeout=timeout, live=live, group=group)
        return run.run()

    def groups(self, **named: Any) -> dict[str, list[int]]:
        """Named sub-groups of the process group, e.g. `cluster.groups(actor="0-3", rollout=[4, 5])`.

        Replaces the previous set on every rank (each rank then has `groups[name]`, and
        `%%distributed --group name` cells get `group`); re-created after a restart. With no
        arguments, changes nothing. Returns name -> world ranks. Twin of `%nbtrain groups`.
        """
        if named:
            return define_groups(self, named)
        return {n: list(r) for n, r in self.group_specs.items()}

    def clear_groups(self) -> None:
        """Destroy every named group on every rank (`%nbtrain groups --clear`)."""
        define_groups(self, {})

    def check_group(
        self, ranks: Sequence[int] | None = None, timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Every rank's view of its process group (initialized, collectives so far)."""
        return group.check(self, ranks=ranks, timeout=timeout)

    def reinit_group(self, timeout: float = 60.0) -> None:
        """Re-create the process group on every rank (after an interrupt broke it)."""
        group.reinit(self, timeout=timeout)

    def repair_group(self) -> str:
        """After an interrupt: keep the process group if every rank agrees on it, else re-create it."""
        return group.repair(self)

    def probe(self, **kwargs: Any) -> Any:
        """All-reduce bandwidth and latency across the ranks; see `nbtrain.cluster.probe.probe`."""
        from nbtrain.cluster.probe import probe

        return probe(self, **kwargs)

    def scaling(self, cfg: Any, **kwargs: Any) -> Any:
        """`cfg`'s short fine-tune on the first 1, 2, 4... nodes, a model past them, a verdict; twin of
        %nbtrain scaling (see `nbtrain.cluster.scaling.sweep.scaling`).

        In [1]: report = cluster.scaling(cfg, nodes=[1, 2, 4], steps=30, predict=[8, 16], out="scaling")
        """
        from nbtrain.cluster.scaling.sweep import scaling

        return scaling(self, cfg, **kwargs)

    def check(self, timeout: float = 30.0) -> Any:
        """Every node's host, CPUs, GPUs and versions, the odd ones marked; twin of %nbtrain check.

        In [1]: print(cluster.check())       # one row per host; .odd says what differs where
        """
        from nbtrain.cluster.check import check_cluster

        return check_cluster(self, timeout=timeout)

    def restart(self, all_ranks: bool = False, timeout: float | None = None) -> str:
        """Replace dead or wedged engines, re-create the process group; says what was lost.

        In [1]: print(cluster.restart())     # twin of %nbtrain restart
        nbtrain: replaced rank 1 on node2 (dead: ...) with fresh engines and re-created the process group ...
        """
        from nbtrain.cluster.faults.recovery import restart

        before = self.engine_ids()
        # a restart must not queue behind the Tinker service's verb it is there to end
        with self.client_lock.rescue():
            said = restart(self, all_ranks=all_ranks, timeout=timeout)
        service = self._tinker_service()
        if service is not None and self.engine_ids() != before:
            # the replaced ranks lost the service's models: back from their last saved states
            reloaded = service.reload()
            said += "".join(f"\nnbtrain: Tinker model {line}" for line in reloaded)
        return said

    def serve_tinker(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        root: Any = None,
        session_timeout: float = 600.0,
    ) -> Any:
        """Serve the Tinker protocol on this cluster's ranks; twin of %nbtrain serve tinker.

        In [1]: svc = cluster.serve_tinker()          # svc.url, svc.api_key, svc.status(), svc.stop()
        In [2]: tc = tinker.ServiceClient(base_url=svc.url).create_lora_training_client(
           ...:     base_model="/models/Qwen3-8B", rank=32).result()

        Listens on the loopback unless `host` says otherwise, which needs an `api_key` ("tml-...")
        that every request must then send. Checkpoints go under `root` (default
        $NBTRAIN_HOME/tinker). A session with no heartbeat or request for `session_timeout` s
        (0: never) ends: its models are saved, then unloaded.
        """
        from nbtrain.cluster.faults import recovery
        from nbtrain.tinker.kernel import serve

        def watch() -> str | None:
            # a verb's wait would never end with a dead peer: the service asks this while it waits
            dead = recovery.dead_ranks(self)
            return "; ".join(recovery.describe_death(self, r).describe() for r in dead) or None

        return serve(
            self,
            host=host,
            port=port,
            api_key=api_key,
            root=root,
            watch=watch,
            session_timeout=session_timeout,
        )

    def _tinker_service(self) -> Any:
        serving = sys.modules.get(
            "nbtrain.tinker.kernel.serve"
        )  # never served: nothing to import or stop
        service = serving.current_service() if serving is not None else None
        backend = getattr(service, "backend", None)
        return service if getattr(backend, "session", None) is self else None

    def diagnose(self, ranks: Any = None, timeout: float = 8.0) -> Any:
        """Every rank's Python stacks (all threads) and which ranks wait in a collective; never stops a cell.

        In [1]: cluster.diagnose()           # twin of %nbtrain diagnose; works while a cell runs
        """
        from nbtrain.cluster.faults.diagnose import diagnose

        return diagnose(self, ranks=ranks, timeout=timeout)

    def stop(self) -> None:
        """Stop every engine and the controller; nothing of this cluster keeps running."""
        global _current
        if _current is self:
            _current = None
        service = self._tinker_service()
        if service is not None:
            service.stop()
        super().stop()
        group.remove_store_files(self.cluster_id)


def current_cluster() -> Cluster | None:
    """The cluster `%%distributed` cells run on (the last one started), or None."""
    if _current is not None and _current.stopped:
        return None
    return _current


def require_cluster() -> Cluster:
    """The current cluster; a `NoClusterError` saying how to start one if there is none."""
    cluster = current_cluster()
    if cluster is None:
        msg = "no nbtrain cluster is running. Start one first: %nbtrain start -n 2 (or nbtrain.start(n=2))."
        raise NoClusterError(msg)
    return cluster


def set_current(cluster: Cluster) -> None:
    """Make `cluster` the one the magics use."""
    global _current
    _current = cluster


def replace_current(force: bool, how: str) -> None:
    """Before a new cluster: stop the current one with `force`, else refuse saying `how` to."""
    existing = current_cluster()
    if existing is None:
        return
    if not force:
        msg = (
            f"a cluster is already running ({existing.world_size} rank(s) on {', '.join(existing.hosts)}). "
            f"Stop it with %nbtrain stop, or {how}."
        )
        raise ClusterError(msg)
    existing.stop()


def _stop_at_exit() -> None:
    # a kernel shutdown or restart must not leave engines behind
    cluster = _current
    if cluster is not None and not cluster.stopped:
        try:
            cluster.stop()
        except Exception as e:  # pragma: no cover - best effort at exit
            log.warning("nbtrain: stopping the cluster at exit failed: %s", e, exc_info=True)


atexit.register(_stop_at_exit)
