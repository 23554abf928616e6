"""Where the verbs run: on every rank of a cluster (`ClusterBackend`), or in this kernel
(`InProcessBackend`). Both call the rank-side functions of `nbtrain.tinker.ranks` with plain
data (dicts, lists, numpy arrays) and return rank 0's answer."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nbtrain.errors import ConfigError, DistributedCellError, RankDiedError

if TYPE_CHECKING:
    from nbtrain.cluster.session import Session

log = logging.getLogger(__name__)

#: the rank-side verbs a backend passes on (nbtrain/tinker/ranks/, the contract of issue 36)
VERBS = (
    "create_model",
    "forward_backward",
    "optim_step",
    "save_state",
    "load_state",
    "snapshot",
    "save_sampler",
    "sample",
    "unload",
    "status",
    "checkpoint_all",
)


def _service() -> Any:
    from nbtrain.tinker import ranks as service

    return service


class Backend:
    """The rank-side service's verbs, each a method of the same name and arguments."""

    where = "here"
    #: the kernel draws each model's live loss plot (False where the verbs' own `nbtrain.log` rows
    #: already draw it: in this kernel, through the live display's local sink)
    draws = True

    def call(self, verb: str, *args: Any) -> Any:
        raise NotImplementedError

    def batch(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Training verbs ((verb, args) each) run one after the other, each as it would run alone:
        one answer per call, or the exception it would have raised. Here one call each; the
        backends below make one trip (the rank side's `batch`)."""
        out: list[Any] = []
        for verb, args in calls:
            try:
                out.append(self.call(verb, *args))
            except Exception as e:  # noqa: BLE001 - that call's own error, the next ones still run
                out.append(e)
        return out

    def __getattr__(self, verb: str) -> Any:
        if verb not in VERBS:
            raise AttributeError(verb)
        return lambda *args: self.call(verb, *args)

    def classify(self, error: BaseException) -> tuple[str, str, bool]:
        """(category, message, fatal): "user" for a refused setting, else "server"; `fatal` when
        the service cannot go on (a dead rank) and every pending request must fail."""
        if isinstance(error, ConfigError):
            return "user", str(error), False
        return (
            "server",
            f"{type(error).__name__}: {error} (in the kernel on {socket.gethostname()})",
            False,
        )

    def dead(self) -> str | None:
        """A message naming dead ranks, or None when every rank is alive."""
        return None

    #: `arm` works from any thread of this kernel (the ranks' main threads take the signals)
    arms_anywhere = False

    def arm(self, folder: str) -> bool:
        """Checkpoint every live model under `folder` on a preemption notice (SIGTERM, or Slurm's
        SIGUSR1); False where signals cannot be caught (not the main thread)."""
        return False

    def disarm(self) -> None:
        """Put back the signal handlers `arm` replaced (where that is possible from here)."""


class InProcessBackend(Backend):
    """The verbs in this process (world size 1, no process group): a laptop, or a test."""

    where = "in this kernel"
    draws = False

    def call(self, verb: str, *args: Any) -> Any:
        return getattr(_service(), verb)(*args)

    def batch(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        # in this process the verbs' own exceptions come back, as each would raise alone
        return [o.get("exception", o.get("value")) for o in self.call("batch", calls, True)]

    def arm(self, folder: str) -> bool:
        # signal handlers belong to the main thread: serve() called there arms, a thread does not
        return bool(_service().arm_preemption(folder))

    def disarm(self) -> None:
        import threading

        if threading.current_thread() is threading.main_thread():
            _service().disarm_preemption()


def _failure(verb: str, failed: list[dict[str, Any]], world: int) -> DistributedCellError:
    """One verb of a batch that failed on some ranks, as a cell failing there says it: identical
    failures once, with their ranks and hosts."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for o in failed:
        e = o["error"]
        g = groups.setdefault((e["ename"], e["evalue"]), {**e, "ranks": [], "where": []})
        g["ranks"].append(o["rank"])
        g["where"].append(f"rank {o['rank']} on {o['host']}")
    parts = [f"{verb} failed on {len(failed)} of {world} rank(s)"]
    for g in groups.values():
        first, *rest = f"{g['ename']}: {g['evalue']}".split("\n")
        parts.append("\n".join([f"\n{first}  [{'; '.join(g.pop('where'))}]", *rest]))
        parts.append(g["traceback"].rstrip())
    return DistributedCellError("\n".join(parts), list(groups.values()))


class ClusterBackend(Backend):
    """The verbs on every rank of `session` (a `Cluster`); rank 0's answer.

    `watch()` says which ranks died and how (None while all live): a verb whose peer died would
    wait for it for ever, so the wait looks every `WATCH_S` and gives up with that message."""

    WATCH_S = 0.5

    def __init__(
        self,
        session: Session,
        timeout: float | None = None,
        watch: Callable[[], str | None] | None = None,
    ):
        self.session = session
        self.timeout = timeout
        self.watch = watch

    arms_anywhere = True

    @property
    def where(self) -> str:  # type: ignore[override]
        return f"on {self.session.world_size} rank(s) of cluster {self.session.cluster_id}"

    def arm(self, folder: str) -> bool:
        # an apply runs in the engine's main thread, where signal handlers can be set: every rank
        # answers True (rank 0 writes the checkpoints, the others record the notice)
        armed = self.session.run(_service().arm_preemption, folder, timeout=self.timeout or 60.0)
        return all(armed)

    def call(self, verb: str, *args: Any) -> Any:
        return self._every(verb, verb, *args)[0]

    def batch(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """One trip to every rank; a call that failed on some rank is a `DistributedCellError`
        naming those ranks and hosts, as that verb alone would have raised."""
        every = self._every("batch", " + ".join(verb for verb, _ in calls), calls)
        out: list[Any] = []
        for i, (verb, _) in enumerate(calls):
            outcomes = [rank_out[i] for rank_out in every]
            failed = [o for o in outcomes if "error" in o]
            out.append(_failure(verb, failed, len(outcomes)) if failed else outcomes[0]["value"])
        return out

    def _every(self, verb: str, what: str, *args: Any) -> list[Any]:
        # the client is shared with the notebook's cells (not thread-safe): hold it for the whole verb;
        # a cell that comes meanwhile says it waits for this verb, and runs after it
        lock = getattr(self.session, "client_lock", None)
        if lock is None:
            return self._call(verb, what, *args)
        with lock.held(f"the Tinker service's {what}"):
            return self._call(verb, what, *args)

    def _call(self, verb: str, what: str, *args: Any) -> list[Any]:
        """Every rank's answer to the rank-side `verb` (`what` it does, for messages), in rank order."""
        fn = getattr(_service(), verb)
        if self.watch is None:
            return self.session.run(fn, *args, timeout=self.timeout)
        which = list(range(self.session.world_size))
        ar = self.session.view(which).apply_async(fn, *args)
        while not ar.wait(self.WATCH_S):
            said = self.watch()
            if said:
                try:
                    self.session.interrupt()  # the survivors may sit in a collective with the dead
                except Exception:  # noqa: BLE001 - best effort; the restart replaces what is stuck
                    pass
                msg = (
                    f"{what} failed: {said}\nEvery pending request failed. %nbtrain restart "
                    "(Cluster.restart()) replaces the rank and reloads the service's models from "
                    "their last saved state."
                )
                raise RankDiedError(msg)
        return self.session.gather(ar, which, self.timeout, what=what)

    def classify(self, error: BaseException) -> tuple[str, str, bool]:
        if isinstance(error, RankDiedError):
            return "server", str(error), True
        if isinstance(error, DistributedCellError):
            names = {f.get("ename") for f in error.failures}
            if names == {"ConfigError"}:
                # the engine refused a setting on every rank alike: the user's to fix
                return "user", error.failures[0].get("evalue") or str(error), False
            dead = self.dead()
            if dead:
                return "server", f"{error}\n{dead}", True
            return "server", str(error), False
        dead = self.dead()
        return (
            "server",
            f"{type(error).__name__}: {error}" + (f"\n{dead}" if dead else ""),
            bool(dead),
        )

    def dead(self) -> str | None:
        if self.watch is not None:
            try:
                said = self.watch()
            except Exception as e:  # noqa: BLE001 - a cluster we cannot even ask is as good as dead
                said = f"the cluster cannot be reached ({type(e).__name__}: {e})"
            return f"{said}; %nbtrain restart brings it back." if said else None
        try:
            rows = self.session.status()
        except Exception as e:  # noqa: BLE001 - a cluster we cannot even ask is as good as dead
            return f"the cluster cannot be reached ({type(e).__name__}: {e}); %nbtrain restart brings it back."
        gone = [r for r in rows if r.get("state") == "dead"]
        if not gone:
            return None
        where = ", ".join(f"rank {r['rank']} on {r['host']}" for r in gone)
        return (
            f"{where} died; every pending request failed. %nbtrain restart (Cluster.restart()) "
            "replaces the rank and reloads the service's models from their last saved state."
        )
