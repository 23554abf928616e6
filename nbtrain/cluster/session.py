"""A session: the client, the ranks and their views, and whether it can still be used.

The plain object the workers (the cell runner, fault handling, probe, attach) work on. It knows how
to reach every rank and gather their answers; it does not know how engines were started (a launcher
gave it a `stop` and, where it can, a `replace`) nor how a process group is made (`group`).
`nbtrain.Cluster` is the public facade over it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from nbtrain import procs
from nbtrain.cluster.failures import raise_for_failures
from nbtrain.cluster.options import StartOptions
from nbtrain.cluster.ranks.ranges import parse_ranks
from nbtrain.cluster.ranks.topology import RankInfo, describe_ranks, rank_table
from nbtrain.errors import ClusterError, NoClusterError

if TYPE_CHECKING:
    import ipyparallel as ipp

    from nbtrain.cluster.ranks.plan import DevicePlan

log = logging.getLogger(__name__)

# how a launcher replaces single engines: replace(session, ranks, timeout)
Replace = Callable[["Session", Sequence[int], float], None]
Stop = Callable[["Session"], None]


def close_client(client: Any) -> None:
    """Close an ipyparallel client's sockets at once; a client that is already gone is fine."""
    if client is not None:
        try:
            client.close(linger=0)
        except Exception:  # a client whose sockets are already gone is closed: nothing left to do
            log.debug("closing an ipyparallel client failed", exc_info=True)


class ClientLock:
    """One caller at a time on a session's ipyparallel client, which is not thread-safe: the notebook's
    cells and the Tinker service's worker thread take turns, each for a whole call (submit and wait).

    Re-entrant (a held call may call `Session.run`), and free of cost when nobody else holds it. The
    fault paths (interrupt, stacks, status, diagnose) never take it: they rescue a stuck holder. A
    replace of engines runs under `rescue()`, where this thread does not wait for it either."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        #: what holds it, where the holder says (e.g. "the Tinker service's forward_backward")
        self.holder: str | None = None

    @contextlib.contextmanager
    def held(self, what: str | None = None, say: bool = False) -> Iterator[None]:
        """Hold the client for a call; `what` names the holder to those who wait. With `say`, a wait
        behind a named holder prints one line saying so (a cell behind the service's verb)."""
        if getattr(self._local, "rescue", 0):
            yield
            return
        if not self._lock.acquire(blocking=False):
            holder = self.holder
            if say and holder:
                print(f"nbtrain: waiting for {holder} to finish", file=sys.stderr, flush=True)
            self._lock.acquire()  # a KeyboardInterrupt ends the wait (POSIX lock waits are interruptible)
        outer = self.holder
        if what is not None:
            self.holder = what
        try:
            yield
        finally:
            self.holder = outer
            self._lock.release()

    @contextlib.contextmanager
    def rescue(self) -> Iterator[None]:
        """Calls in this thread do not wait for the lock: a restart must not queue behind the call
        it is there to end."""
        self._local.rescue = getattr(self._local, "rescue", 0) + 1
        try:
            yield
        finally:
            self._local.rescue -= 1


class Session:
    """Engines with ranks: the client, the rank table, views over ranks, gathering results."""

    def __init__(
        self,
        client: ipp.Client,
        ipp_cluster: ipp.Cluster | None,
        ranks: list[RankInfo],
        backend: str,
        options: StartOptions,
        pids: Sequence[int] = (),
        *,
        launcher: str = "local",
        stop: Stop | None = None,
        replace: Replace | None = None,
        restart_hint: str = "",
    ) -> None:
        self.client = client
        self.ipp_cluster = ipp_cluster
        self.ranks = ranks
        self.backend = backend
        self.options = options
        self.started = time.time()
        self.launcher = launcher  # how the engines were started: local, ssh, slurm, mpi, connect
        # the malloc the engines run with ("tcmalloc", "system"); set by local starts, None elsewhere
        self.allocator: str | None = None
        # the backend and devices decided for every rank (nbtrain.cluster.ranks.plan); set by every start
        self.plan: DevicePlan | None = None
        # what a multi-node start found and said (nbtrain.cluster.launch)
        self.notes: list[str] = []
        self.listen: Any = None
        self.preflight: Any = None
        self.preflight_reports: list[dict[str, Any]] | None = None
        self.engine_pids: dict[str, list[int]] = {}  # launch label -> its engines' pids there
        self._pids = list(pids)  # processes of this machine that end with the session
        self._stop = stop
        self._replace = replace
        self.restart_hint = restart_hint
        self._stopped = False
        self._views: dict[tuple[int, ...], Any] = {}
        self.lost: set[int] = set()  # ranks known to be gone (died, or ended because stuck)
        # named sub-groups (name -> world ranks), replayed on every rank after a re-init (`group`)
        self.group_specs: dict[str, list[int]] = {}
        # how many times the process group was re-created: torchrun's TORCHELASTIC_RESTART_COUNT
        self.reinits = 0
        # cells (and run/push/pull) and the Tinker service's worker thread take turns on `client`
        self.client_lock = ClientLock()

    @classmethod
    def from_launched(cls, launched: Launched) -> Any:
        """The session (or facade) over what a launcher started."""
        session = cls(
            launched.client,
            launched.ipp_cluster,
            launched.ranks,
            launched.plan.backend if launched.plan is not None else launched.options.backend,
            launched.options,
            launched.pids,
            launcher=launched.launcher,
            stop=launched.stop,
            replace=launched.replace,
            restart_hint=launched.restart_hint,
        )
        populate(session, launched)
        if launched.on_ready is not None:
            launched.on_ready(session)
        return session

    # --- what it is -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def cluster_id(self) -> str | None:
        return getattr(self.ipp_cluster, "cluster_id", None)

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(r.host for r in self.ranks))

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def pids(self) -> list[int]:
        """Processes on this machine that end with the session (engines, nannies, watchdog)."""
        return self._pids

    def engine_ids(self, ranks: Sequence[int] | None = None) -> list[int]:
        which = range(self.world_size) if ranks is None else ranks
        return [self.ranks[r].engine_id for r in which]

    def table(self) -> str:
        """The rank table: rank, host, local rank, device, address (and interface, multi-node), pid."""
        return rank_table(self.ranks, interfaces=self.launcher != "local")

    def check_usable(self) -> None:
        """Raise `NoClusterError` if the session was stopped."""
        if self._stopped:
            msg = "this cluster was stopped; start a new one with %nbtrain start (or nbtrain.start())."
            raise NoClusterError(msg)

    # --- running code -------------------------------------------------------------------------
    def view(self, ranks: Sequence[int] | None = None) -> ipp.DirectView:
        """An ipyparallel DirectView over `ranks` (all by default), in rank order."""
        self.check_usable()
        targets = tuple(self.engine_ids(ranks))
        # keyed by engine ids, so a restarted rank (new engine) gets a new view
        view = self._views.get(targets)
        if view is None:
            view = self._views[targets] = self.client.direct_view(targets=list(targets))
        return view

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: Any = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; one result per rank, in rank order.

        In [1]: cluster.run(lambda: torch.distributed.get_rank())
        Out[1]: [0, 1]
        """
        which = parse_ranks(ranks, self.world_size)
        with self.client_lock.held(say=True):
            ar = self.view(which).apply_async(fn, *args, **kwargs)
            return self.gather(ar, which, timeout, what=getattr(fn, "__name__", "function"))

    def gather(self, ar: Any, which: list[int], timeout: float | None, what: str) -> list[Any]:
        """Wait for `ar` on ranks `which`; its results in rank order, or one error naming the ranks."""
        try:
            if not ar.wait(timeout):
                msg = f"{what} did not finish on {describe_ranks(self.ranks, which)} within {timeout} s."
                raise ClusterError(msg)
        except KeyboardInterrupt:
            self.interrupt(which)
            raise
        results = ar.get(return_exceptions=True)
        raise_for_failures(self.ranks, which, results)
        return list(results)

    def push(self, namespace: dict[str, Any], ranks: Any = None) -> None:
        """Put the names in `namespace` into every rank's cell namespace."""
        which = parse_ranks(ranks, self.world_size)
        with self.client_lock.held(say=True):
            ar = self.view(which).push(namespace, block=False)
            self.gather(ar, which, None, what="push")

    def pull(self, name: str, ranks: Any = None) -> list[Any]:
        """The value of `name` on every rank (or `ranks`), in rank order."""
        which = parse_ranks(ranks, self.world_size)
        with self.client_lock.held(say=True):
            ar = self.view(which).pull(name, block=False)
            return self.gather(ar, which, None, what=f"pull {name!r}")

    # --- watching and steering ----------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, host, local rank, device, pid, busy/idle and queued cells."""
        self.check_usable()
        # a dead engine is no longer registered: asking the hub about it would raise
        alive = [e for e in self.engine_ids() if e in set(self.client.ids)]
        queues = self.client.queue_status(targets=alive) if alive else {}
        rows = []
        for r in self.ranks:
            q = queues.get(r.engine_id, {}) if isinstance(queues, dict) else {}
            busy = bool(q.get("queue", 0))
            state = "dead" if r.engine_id not in alive else "busy" if busy else "idle"
            rows.append({**asdict(r), "state": state, "queued": q.get("queue", 0)})
        return rows

    def stacks(
        self, ranks: Any = None, timeout: float = 5.0, all_threads: bool = True
    ) -> dict[int, dict[str, Any]]:
        """Every rank's current Python stacks, asked over the control channel (works while busy)."""
        self.check_usable()
        which = parse_ranks(ranks, self.world_size)
        out: dict[int, dict[str, Any]] = {}
        futures = []
        for r in which:
            fut = self.client._send_control_request(
                targets=[self.ranks[r].engine_id],
                msg_type="nbtrain_stack_request",
                content={"all_threads": all_threads},
                block=False,
            )
            futures.append((r, fut))
        deadline = time.monotonic() + timeout
        for r, fut in futures:
            try:
                replies = fut.result(timeout=max(0.01, deadline - time.monotonic()))
                out[r] = replies[0]["content"]
            except Exception as e:  # a dead or wedged engine does not answer
                out[r] = {
                    "host": self.ranks[r].host,
                    "pid": self.ranks[r].pid,
                    "threads": [],
                    "error": f"no answer ({type(e).__name__})",
                }
        return out

    def interrupt(self, ranks: Any = None) -> None:
        """Send SIGINT to every rank (or `ranks`): a KeyboardInterrupt in whatever it runs."""
        import signal

        self.check_usable()
        which = parse_ranks(ranks, self.world_size)
        local = socket.gethostname()
        for r in which:
            info = self.ranks[r]
            if info.host == local and self.ipp_cluster is not None:
                procs.interrupt(info.pid)
                continue
            procs.signal_engine(self.client, signal.SIGINT, info.engine_id)

    def restart_ranks(self, ranks: Sequence[int], timeout: float | None = None) -> None:
        """Replace the engines of `ranks` with fresh ones (the launcher's way), and re-create the group."""
        if self._replace is None:
            hint = self.restart_hint or "%nbtrain start --force with the same settings"
            msg = (
                f"{describe_ranks(self.ranks, list(ranks))} did not stop, and nbtrain cannot replace "
                f"single engines of this cluster. Restart the cluster: {hint}."
            )
            raise ClusterError(msg)
        with self.client_lock.rescue():  # a held call may be what is stuck on these ranks
            self._replace(self, ranks, timeout or self.options.timeout)

    # --- ending -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every engine and the controller the launcher started; nothing of it keeps running."""
        if self._stopped:
            return
        self._stopped = True
        if self._stop is not None:
            self._stop(self)


@dataclass
class Launched:
    """What every launcher gives back: the engines (client, ipyparallel cluster), their ranks and
    group plan, and how to stop them (and, where it can, replace single ones)."""

    client: Any
    ipp_cluster: Any
    ranks: list[RankInfo]
    plan: DevicePlan | None  # None: not planned here (a cluster re-attached from its side file)
    options: StartOptions
    launcher: str
    stop: Callable[[Session], None]  # ends every engine (or leaves them, for connect)
    replace: Replace | None = None  # replaces single engines; None: the launcher cannot
    restart_hint: str = ""  # how to restart the whole cluster, for messages
    pids: list[int] = field(default_factory=list)  # local processes that end with the cluster
    allocator: str | None = None
    notes: list[str] = field(default_factory=list)
    listen: Any = None
    preflight: Any = None
    preflight_reports: list[dict[str, Any]] | None = None
    engine_pids: dict[str, list[int]] = field(default_factory=dict)
    on_ready: Callable[[Session], None] | None = (
        None  # once the session exists (registry, watchdog)
    )


def populate(session: Session, launched: Launched) -> None:
    """Copy what a launcher found (plan, notes, preflight, ...) onto its new session."""
    session.plan = launched.plan
    session.allocator = launched.allocator
    session.notes = list(launched.notes)
    session.listen = launched.listen
    session.preflight = launched.preflight
    session.preflight_reports = launched.preflight_reports
    session.engine_pids = launched.engine_pids


def new_engines(
    session: Session, before: set[int], count: int, remaining: Callable[[], float]
) -> list[tuple[int, dict[str, Any]]]:
    """A replace's new engines: wait until `count` engines beyond `before` have registered, then say
    hello to them; (engine id, hello) for each, by engine id."""
    from nbtrain.engine import setup

    session.client.wait_for_engines(len(before) + count, timeout=remaining(), interactive=False)
    new_ids = sorted(set(session.client.ids) - before)
    hellos = (
        session.client.direct_view(targets=new_ids)
        .apply_async(setup.hello)
        .get(timeout=remaining())
    )
    return list(zip(new_ids, hellos))


def adopt(info: RankInfo, engine_id: int, hello: dict[str, Any]) -> None:
    """Rank `info` is now the engine `engine_id` that answered `hello`."""
    info.engine_id, info.pid, info.host = engine_id, int(hello["pid"]), hello["host"]
    info.log, info.gpus = hello.get("log"), int(hello.get("gpus", 0))
