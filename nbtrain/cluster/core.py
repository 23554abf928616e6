"""The notebook side of a cluster: start engines, give each a torch rank, run code on every rank.

In [1]: import nbtrain
In [2]: cluster = nbtrain.start(n=2)          # twin of %nbtrain start -n 2
In [3]: cluster.run(lambda: __import__("os").environ["RANK"])
Out[3]: ['0', '1']
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from nbtrain.cluster.ranges import parse_ranks
from nbtrain.errors import ClusterError, ConfigError, DistributedCellError, NoClusterError

if TYPE_CHECKING:
    import ipyparallel as ipp

    from nbtrain.cluster.plan import DevicePlan

log = logging.getLogger("nbtrain")

BACKENDS = ("auto", "gloo", "nccl")
PROFILE = "nbtrain"
# The hub only admits a new engine after a heartbeat round; ipyparallel's 3 s default makes a cold
# start wait ~5 s for nothing. 500 ms also lets the hub notice a dead engine within ~5 s.
HEARTBEAT_MS = 500
# how long the other ranks get to finish joining the group once one rank failed to (they are
# usually blocked in the rendezvous, waiting for it)
FAILED_GRACE_S = 2.0

_current: Cluster | None = None


@dataclass
class RankInfo:
    """Where one rank lives."""

    rank: int
    engine_id: int
    host: str
    local_rank: int
    local_world_size: int
    pid: int
    device: str = "cpu"
    address: str = "127.0.0.1"
    interface: str | None = None
    log: str | None = None  # the engine's log file on its host (its stderr and crash dumps)
    gpus: int = 0  # GPUs the engine sees on its host (setup.hello); the device plan's input


@dataclass
class StartOptions:
    """Settings of `nbtrain.start` / `%nbtrain start`, validated before anything starts."""

    n: int = 1  # how many engines (ranks) to start on this machine
    backend: str = "auto"  # auto (NCCL where every rank has its own GPU, else gloo), gloo or nccl
    timeout: float = 120.0  # seconds to get every engine and the process group, else fail
    pg_timeout: float = 1800.0  # seconds a collective may wait before torch gives up
    force: bool = False  # stop a running cluster first instead of refusing
    profile: str = PROFILE  # IPython profile holding the cluster's connection files
    extra_env: dict[str, str] = field(default_factory=dict)  # more environment for every rank
    allocator: str | None = None  # local engines' malloc: auto, tcmalloc or system (allocator.py)

    def __post_init__(self) -> None:
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                as_float = float(n)
            except (TypeError, ValueError):
                as_float = float("nan")
            if as_float != as_float or as_float != int(as_float):
                msg = f"-n {n!r} is not a whole number of engines; use e.g. -n 2."
                raise ConfigError(msg)
            n = int(as_float)
        if n < 1:
            msg = f"-n {n} asks for no engines; start at least one, e.g. -n 2."
            raise ConfigError(msg)
        self.n = n
        if self.backend not in BACKENDS:
            msg = f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}."
            raise ConfigError(msg)
        if self.timeout <= 0:
            msg = f"--timeout {self.timeout} must be a positive number of seconds."
            raise ConfigError(msg)
        from nbtrain.cluster.allocator import resolve

        self.allocator = resolve(self.allocator)


def local_gpu_count() -> int:
    """GPUs this machine exposes, without importing torch or creating a CUDA context."""
    from nbtrain.engine.setup import _cuda_count

    return _cuda_count()


def default_engine_count(n: int | None = None) -> int:
    """`n`, or one engine per GPU of this machine (at least one), as torchrun's --nproc-per-node gpu.

    The one default of `nbtrain.start()` and `%nbtrain start`.
    """
    return max(1, local_gpu_count()) if n is None else n


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assign_ranks(
    hellos: dict[int, dict[str, Any]],
    host_order: Sequence[str] = (),
    engine_order: Mapping[int, Any] | None = None,
) -> list[RankInfo]:
    """Node-major ranks, contiguous per host: hosts in `host_order` (then first seen), engines on a
    host by `engine_order[engine_id]` (the launcher's task id), else by engine id."""
    by_host: dict[str, list[int]] = {}
    key = engine_order.__getitem__ if engine_order is not None else None
    for eid in sorted(hellos, key=key):
        by_host.setdefault(hellos[eid]["host"], []).append(eid)
    order = [h for h in host_order if h in by_host] + [h for h in by_host if h not in host_order]
    ranks: list[RankInfo] = []
    for host in order:
        eids = by_host[host]
        for local_rank, eid in enumerate(eids):
            ranks.append(
                RankInfo(
                    rank=len(ranks),
                    engine_id=eid,
                    host=host,
                    local_rank=local_rank,
                    local_world_size=len(eids),
                    pid=int(hellos[eid]["pid"]),
                    log=hellos[eid].get("log"),
                    gpus=int(hellos[eid].get("gpus", 0)),
                )
            )
    return ranks


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Plain-text columns, the first row a header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _describe_ranks(ranks: Sequence[RankInfo], which: Sequence[int]) -> str:
    hosts: dict[str, list[int]] = {}
    for r in which:
        hosts.setdefault(ranks[r].host, []).append(r)
    parts = []
    for host, rs in hosts.items():
        label = "rank" if len(rs) == 1 else "ranks"
        parts.append(f"{label} {_compact(rs)} on {host}")
    return "; ".join(parts)


def _compact(nums: Sequence[int]) -> str:
    """0,1,2,5 -> '0-2,5'."""
    nums = sorted(nums)
    out: list[str] = []
    start = prev = nums[0]
    for n in nums[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(out)


def _kill_tree(pids: Sequence[int], grace: float = 3.0) -> None:
    """Wait for processes (and their children) to exit, then kill what is left."""
    import psutil

    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs.append(p)
            procs.extend(p.children(recursive=True))
        except psutil.Error:
            continue
    if not procs:
        return
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2.0)


class Cluster:
    """A running set of engines, one per torch rank, joined in one process group.

    Get one from `nbtrain.start()`; `nbtrain.current_cluster()` returns the one the magics use.
    """

    def __init__(
        self,
        client: ipp.Client,
        ipp_cluster: ipp.Cluster | None,
        ranks: list[RankInfo],
        backend: str,
        options: StartOptions,
        pids: Sequence[int] = (),
    ) -> None:
        self.client = client
        self.ipp_cluster = ipp_cluster
        self.ranks = ranks
        self.backend = backend
        self.options = options
        self.started = time.time()
        # the malloc the engines run with ("tcmalloc", "system"); set by local starts, None elsewhere
        self.allocator: str | None = None
        # the backend and devices decided for every rank (nbtrain.cluster.plan); set by every start
        self.plan: DevicePlan | None = None
        self._pids = list(pids)
        self._stopped = False
        self._views: dict[tuple[int, ...], Any] = {}
        self._rank_of_engine = {r.engine_id: r.rank for r in ranks}

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

    def engine_ids(self, ranks: Sequence[int] | None = None) -> list[int]:
        which = range(self.world_size) if ranks is None else ranks
        return [self.ranks[r].engine_id for r in which]

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"<nbtrain.Cluster {state}: {self.world_size} rank(s), backend {self.backend}, hosts {', '.join(self.hosts)}>"

    def table(self) -> str:
        """The rank table: rank, host, local rank, device, pid."""
        rows = [("rank", "host", "local", "device", "address", "pid")]
        for r in self.ranks:
            rows.append((str(r.rank), r.host, str(r.local_rank), r.device, r.address, str(r.pid)))
        return format_table(rows)

    def _check_usable(self) -> None:
        if self._stopped:
            msg = "this cluster was stopped; start a new one with %nbtrain start (or nbtrain.start())."
            raise NoClusterError(msg)

    # --- running code -------------------------------------------------------------------------
    def view(self, ranks: Sequence[int] | None = None) -> ipp.DirectView:
        """An ipyparallel DirectView over `ranks` (all by default), in rank order."""
        self._check_usable()
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
        ar = self.view(which).apply_async(fn, *args, **kwargs)
        return self._gather(ar, which, timeout, what=getattr(fn, "__name__", "function"))

    def _gather(self, ar: Any, which: list[int], timeout: float | None, what: str) -> list[Any]:
        try:
            if not ar.wait(timeout):
                msg = f"{what} did not finish on {_describe_ranks(self.ranks, which)} within {timeout} s."
                raise ClusterError(msg)
        except KeyboardInterrupt:
            self.interrupt(which)
            raise
        results = ar.get(return_exceptions=True)
        raise_for_failures(self, which, results)
        return list(results)

    def execute(
        self,
        code: str,
        ranks: Any = None,
        output: str = "rank0",
        timeout: float | None = None,
        live: bool = True,
    ) -> list[Any]:
        """Run `code` on every rank (or `ranks`) in its persistent namespace, like a `%%distributed` cell.

        Streams the output as it comes (rank 0's, or every rank's with `output="all"`), draws live
        plots from `nbtrain.log`, and raises `DistributedCellError` if any rank fails.
        """
        from nbtrain.cluster.cell import CellRun

        which = parse_ranks(ranks, self.world_size)
        return CellRun(self, code, which, output=output, timeout=timeout, live=live).run()

    def push(self, namespace: dict[str, Any], ranks: Any = None) -> None:
        """Put the names in `namespace` into every rank's cell namespace."""
        which = parse_ranks(ranks, self.world_size)
        ar = self.view(which).push(namespace, block=False)
        self._gather(ar, which, None, what="push")

    def pull(self, name: str, ranks: Any = None) -> list[Any]:
        """The value of `name` on every rank (or `ranks`), in rank order."""
        which = parse_ranks(ranks, self.world_size)
        ar = self.view(which).pull(name, block=False)
        return self._gather(ar, which, None, what=f"pull {name!r}")

    # --- watching and steering ----------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, host, local rank, device, pid, busy/idle and queued cells."""
        self._check_usable()
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
        self._check_usable()
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
        self._check_usable()
        which = parse_ranks(ranks, self.world_size)
        local = socket.gethostname()
        for r in which:
            info = self.ranks[r]
            if info.host == local and self.ipp_cluster is not None:
                try:
                    os.kill(info.pid, signal.SIGINT)
                    continue
                except ProcessLookupError:
                    continue
            self.client.send_signal(signal.SIGINT, targets=[info.engine_id], block=False)

    def check_group(
        self, ranks: Sequence[int] | None = None, timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        from nbtrain.engine import setup

        return self.run(setup.check_group, ranks=ranks, timeout=timeout)

    def reinit_group(self, timeout: float = 60.0) -> None:
        """Re-create the process group on every rank (after an interrupt broke it)."""
        deadline = time.monotonic() + timeout
        master_addr = self.ranks[0].address
        # planned again from the ranks' GPU counts: the same decision unless replaced engines differ
        self.plan = _init_group(
            self.client,
            self.ranks,
            self.options,
            lambda: max(0.1, deadline - time.monotonic()),
            master_addr=master_addr,
            port=self._rendezvous_port(),
            launcher=self._launcher_name(),
            announce=False,
        )
        self.backend = self.plan.backend

    def repair_group(self) -> str:
        """After an interrupt: keep the process group if every rank agrees on it, else re-create it."""
        try:
            info = self.check_group(timeout=10)
        except Exception:
            info = []
        seqs = [i.get("seq") for i in info]
        intact = (
            bool(info)
            and all(i.get("initialized") for i in info)
            and None not in seqs
            and len(set(seqs)) == 1
        )
        if intact:
            return "The process group is intact and every rank kept its variables."
        self.reinit_group()
        return (
            "The ranks stopped at different points of their collectives, so the process group was "
            "re-created; variables are kept, but rebuild objects that hold the old group (e.g. DDP models)."
        )

    def restart_ranks(self, ranks: Sequence[int], timeout: float | None = None) -> None:
        """Replace the engines of `ranks` with fresh ones and re-create the process group everywhere."""
        if self.ipp_cluster is None:
            msg = (
                f"rank(s) {_compact(list(ranks))} are stuck, and this cluster was connected, not started, by "
                "nbtrain, so it cannot replace their engines. Restart the cluster where it was started."
            )
            raise ClusterError(msg)
        import psutil

        from nbtrain.engine import setup

        timeout = timeout or self.options.timeout
        deadline = time.monotonic() + timeout

        def remaining() -> float:
            return max(0.1, deadline - time.monotonic())

        dead_ids = {self.ranks[r].engine_id for r in ranks}
        orphans: list[psutil.Process] = []
        for r in ranks:
            try:
                proc = psutil.Process(self.ranks[r].pid)
                orphans.extend(proc.children(recursive=True))
                proc.kill()
            except psutil.Error:
                pass
        # the nanny tells the hub at once; wait until the client no longer lists the old engines
        while dead_ids & set(self.client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill_tree([p.pid for p in orphans], grace=1.0)
        before = set(self.client.ids)
        self.ipp_cluster.start_engines_sync(len(ranks))
        self.client.wait_for_engines(
            len(before) + len(ranks), timeout=remaining(), interactive=False
        )
        new_ids = sorted(set(self.client.ids) - before)
        hellos = (
            self.client.direct_view(targets=new_ids)
            .apply_async(setup.hello)
            .get(timeout=remaining())
        )
        for r, eid, h in zip(sorted(ranks), new_ids, hellos):
            info = self.ranks[r]
            info.engine_id, info.pid, info.host = eid, int(h["pid"]), h["host"]
            info.log, info.gpus = h.get("log"), int(h.get("gpus", 0))
            self._pids.extend([info.pid, *h.get("children", [])])
        self._rank_of_engine = {r.engine_id: r.rank for r in self.ranks}
        self.reinit_group(timeout=remaining())

    def probe(self, **kwargs: Any) -> Any:
        """All-reduce bandwidth and latency across the ranks; see `nbtrain.cluster.probe.probe`."""
        from nbtrain.cluster.probe import probe

        return probe(self, **kwargs)

    def restart(self, all_ranks: bool = False, timeout: float | None = None) -> str:
        """Replace dead or wedged engines, re-create the process group; says what was lost.

        In [1]: print(cluster.restart())     # twin of %nbtrain restart
        nbtrain: replaced rank 1 on node2 (dead: ...) with fresh engines and re-created the process group ...
        """
        from nbtrain.cluster.faults import restart

        return restart(self, all_ranks=all_ranks, timeout=timeout)

    def diagnose(self, ranks: Any = None, timeout: float = 8.0) -> Any:
        """Every rank's Python stacks (all threads) and which ranks wait in a collective; never stops a cell.

        In [1]: cluster.diagnose()           # twin of %nbtrain diagnose; works while a cell runs
        """
        from nbtrain.cluster.faults import diagnose

        return diagnose(self, ranks=ranks, timeout=timeout)

    def _launcher_name(self) -> str:
        """How this cluster's engines were started ("local", "ssh", ...): words fixes in messages."""
        return "local"

    def _rendezvous_port(self) -> int:
        from nbtrain.engine import setup

        if self.ranks[0].host == socket.gethostname():
            return _free_local_port()
        return int(self.run(setup.free_port, ranks=[0], timeout=30)[0])

    # --- ending -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every engine and the controller; nothing of this cluster keeps running."""
        global _current
        if self._stopped:
            return
        self._stopped = True
        if _current is self:
            _current = None
        _teardown(self.ipp_cluster, self.client, self._pids)


def _teardown(ipp_cluster: Any, client: Any, pids: Sequence[int]) -> None:
    """Stop a local cluster: every engine, nanny, the controller and the watchdog, all at once.

    ipyparallel's own stop signals the processes one after another and waits several seconds, but a
    kernel restart gives us about 2.5 s before it is killed itself: so terminate everything we know of
    together, kill what is left after a short grace, and only then let ipyparallel tidy its files.
    """
    from nbtrain.cluster import registry

    close_client(client)
    local: list[int] = list(pids)
    if ipp_cluster is not None:
        local.extend(_launcher_pids(ipp_cluster))
    local.extend(_descendants(local))
    groups = _session_groups(local)
    # engines (IPython kernels) sit on SIGTERM for seconds; their state is being discarded anyway
    _terminate(local, grace=0.5)
    if ipp_cluster is not None:
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception as e:
            log.debug("ipyparallel stop_cluster failed: %s", e)
        registry.forget(ipp_cluster)
    _kill_groups(groups)


def close_client(client: Any) -> None:
    """Close an ipyparallel client's sockets at once; a client that is already gone is fine."""
    if client is not None:
        try:
            client.close(linger=0)
        except Exception:
            pass


def _session_groups(pids: Sequence[int]) -> list[int]:
    """The process groups `pids` lead: ipyparallel starts the controller (and each local engine) in a
    session of its own, so its group also holds what it spawns, even once orphaned."""
    mine = os.getpgid(0)
    groups = []
    for pid in dict.fromkeys(pids):
        try:
            if os.getpgid(pid) == pid != mine:
                groups.append(pid)
        except OSError:
            continue
    return groups


def _kill_groups(groups: Sequence[int]) -> None:
    """SIGKILL whatever is left in `groups`: a controller stopped while it was still starting has
    spawned its schedulers after anyone could list its children, and they outlive it."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            continue  # the group is empty: everything in it has exited


def _running(proc: Any) -> bool:
    import psutil

    try:
        # our own children linger as zombies until ipyparallel's waiter threads reap them: they are gone
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _terminate(pids: Sequence[int], grace: float) -> None:
    """SIGTERM every process, SIGKILL those still running after `grace` seconds."""
    import psutil

    procs = []
    for pid in dict.fromkeys(pids):
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.Error:
            continue
    deadline = time.monotonic() + grace
    while procs and time.monotonic() < deadline:
        time.sleep(0.05)
        procs = [p for p in procs if _running(p)]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _descendants(pids: Sequence[int]) -> list[int]:
    import psutil

    out: list[int] = []
    for pid in pids:
        try:
            out.extend(p.pid for p in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return out


def _launcher_pids(ipp_cluster: Any) -> list[int]:
    pids = []
    ctl = getattr(ipp_cluster, "controller", None)
    if ctl is not None and getattr(ctl, "pid", None):
        pids.append(int(ctl.pid))
    for engine_set in getattr(ipp_cluster, "engines", {}).values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            if getattr(launcher, "pid", None):
                pids.append(int(launcher.pid))
    return pids


def current_cluster() -> Cluster | None:
    """The cluster `%%distributed` cells run on (the last one started), or None."""
    if _current is not None and _current.stopped:
        return None
    return _current


def require_cluster() -> Cluster:
    cluster = current_cluster()
    if cluster is None:
        msg = "no nbtrain cluster is running. Start one first: %nbtrain start -n 2 (or nbtrain.start(n=2))."
        raise NoClusterError(msg)
    return cluster


def start(
    n: int | None = None,
    backend: str = "auto",
    timeout: float = 120.0,
    force: bool = False,
    pg_timeout: float = 1800.0,
    env: dict[str, str] | None = None,
    quiet: bool = True,
    launcher: str = "local",
    allocator: str | None = None,
    **launch: Any,
) -> Cluster:
    """Start `n` engines on this machine and a process group across them; return the `Cluster`.

    In [1]: cluster = nbtrain.start(n=2)
    In [2]: cluster.run(lambda: __import__("os").environ["WORLD_SIZE"])
    Out[2]: ['2', '2']

    `n` defaults to one engine per GPU of this machine (1 without GPUs), as `%nbtrain start` does.
    The backend and every rank's device are decided here, once, before any rank initialises
    (`nbtrain.cluster.plan`): `"auto"` is NCCL on cuda:<local rank> when every rank gets a GPU of
    its own, else gloo on CPU for every rank, with one printed line saying why; `"nccl"` where a
    rank would lack a GPU is a `ConfigError`; `"gloo"` keeps the GPUs only where every rank has its
    own. With `launcher="ssh"`, `"slurm"` or `"mpi"`, engines start elsewhere instead (settings in
    `nbtrain.cluster.launchers.LaunchOptions`: hosts, nodes, gpus_per_node, partition, account,
    time, ip, iface, port, allow_version_mismatch, ...):

    In [3]: nbtrain.start(launcher="ssh", hosts="node1:2,node2:2", force=True)
    In [4]: nbtrain.start(launcher="slurm", nodes=2, gpus_per_node=4, partition="gpu", time="02:00:00")
    In [5]: nbtrain.start(launcher="mpi", n=8)

    Local CPU engines run with tcmalloc where the machine has it (`allocator="auto"`, or
    $NBTRAIN_ALLOCATOR): 3-10% more tokens/s on CPU here. `"system"` keeps glibc's malloc;
    `"tcmalloc"` fails if it is missing. `cluster.allocator` says what the engines got.

    Either every engine and the process group are ready within `timeout` seconds, or this raises
    and leaves no process behind.
    """
    global _current
    remote = launcher != "local" or bool(launch)
    options = StartOptions(
        n=1 if remote and n is None else default_engine_count(n),
        backend=backend,
        timeout=timeout,
        force=force,
        pg_timeout=pg_timeout,
        extra_env=dict(env or {}),
        allocator=allocator,
    )
    launch_options = None
    if allocator is not None and (launcher != "local" or launch):
        msg = (
            f"--allocator applies to engines started on this machine, not with --launcher {launcher}. "
            "Drop it, or set LD_PRELOAD for the remote engines in their environment yourself."
        )
        raise ConfigError(msg)
    if remote:
        from nbtrain.cluster.launchers import parse_launch

        if n is not None:
            launch["n"] = options.n  # mpi's rank count; an error for the other launchers
        launch_options = parse_launch(launcher, launch)
    elif options.backend == "nccl":
        # refused before anything starts; the plan on the engines' own GPU counts decides again
        from nbtrain.cluster.plan import Slot, plan_devices

        host, gpus = socket.gethostname(), local_gpu_count()
        plan_devices([Slot(host, i, gpus) for i in range(options.n)], "nccl")
    existing = current_cluster()
    if existing is not None:
        if not options.force:
            msg = (
                f"a cluster is already running ({existing.world_size} rank(s) on {', '.join(existing.hosts)}). "
                "Stop it with %nbtrain stop, or replace it with %nbtrain start --force."
            )
            raise ClusterError(msg)
        existing.stop()
    if launch_options is not None:
        from nbtrain.cluster.launchers import start_remote

        cluster: Cluster = start_remote(options, launch_options, quiet=quiet)
    else:
        cluster = _start_local(options, quiet=quiet)
    _current = cluster
    return cluster


async def start_async(**kwargs: Any) -> Cluster:
    """The awaitable twin of `start` (runs it in a worker thread)."""
    return await asyncio.to_thread(start, **kwargs)


def engine_environment(options: StartOptions) -> dict[str, str]:
    """What every local engine gets in its environment at launch, before anything imports torch.

    The user's `env` first; then, as torchrun does, one share of the cores per rank
    (OMP_NUM_THREADS), since several ranks that each use every core thrash the CPU; and on a machine
    without GPUs, tcmalloc preloaded where installed (`nbtrain.cluster.allocator`).
    """
    from nbtrain.cluster import allocator

    env = dict(options.extra_env)
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in os.environ and options.n > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // options.n))
    env.update(allocator.engine_env(options.allocator or "auto", env, local_gpu_count()))
    return env


def _start_local(options: StartOptions, quiet: bool = True) -> Cluster:
    import ipyparallel as ipp

    from nbtrain.cluster import registry
    from nbtrain.engine import setup

    deadline = time.monotonic() + options.timeout

    def remaining() -> float:
        return max(0.1, deadline - time.monotonic())

    cluster_id = f"nbtrain-{uuid.uuid4().hex[:8]}"
    ipp_cluster = ipp.Cluster(
        n=options.n,
        engine_launcher_class="local",
        profile=options.profile,
        cluster_id=cluster_id,
        controller_ip="127.0.0.1",
        controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"],
        # engines wait for the connection file themselves, so they start while the controller does
        send_engines_connection_env=False,
        log_level=logging.ERROR,
        # nbtrain stops its clusters at exit itself, all processes at once; ipyparallel's own atexit
        # stop is serial and slow enough that a restarting kernel gets killed halfway through it
        shutdown_atexit=False,
    )
    # engines import torch while they wait for the controller (nbtrain.engine.boot), so the thread
    # settings torch reads at import must be in their environment from the start
    ipp_cluster.config.LocalEngineSetLauncher.engine_cmd = [
        sys.executable,
        "-m",
        "nbtrain.engine.boot",
    ]
    ipp_cluster.config.LocalEngineSetLauncher.environment = engine_environment(options)
    client = None
    pids: list[int] = []
    step = "starting the controller"
    try:
        ipp_cluster.start_controller_sync()
        step = f"starting {options.n} engine(s)"
        ipp_cluster.start_engines_sync(options.n)
        step = "connecting to the controller"
        client = ipp_cluster.connect_client_sync()
        step = f"waiting for {options.n} engine(s) to register"
        try:
            client.wait_for_engines(options.n, timeout=remaining(), interactive=False)
        except TimeoutError:
            got = len(client.ids)
            msg = (
                f"only {got} of {options.n} engine(s) started within --timeout {options.timeout:g} s on "
                f"{socket.gethostname()}. Nothing was left running. Try a longer --timeout, fewer engines, "
                f"or look at the engine logs in {ipp_cluster.profile_dir}/log."
            )
            raise ClusterError(msg) from None
        step = "saying hello to the engines"
        dv = client[:]
        hellos_list = dv.apply_async(setup.hello).get(timeout=remaining())
        hellos = {eid: h for eid, h in zip(dv.targets, hellos_list)}
        pids = [p for h in hellos.values() for p in [h["pid"], *h.get("children", [])]]
        ranks = assign_ranks(hellos)
        step = "joining the process group"
        plan = _init_group(
            client, ranks, options, remaining, master_addr="127.0.0.1", port=_free_local_port()
        )
    except BaseException as e:
        _teardown(ipp_cluster, client, pids)
        if isinstance(e, (ClusterError, ConfigError, DistributedCellError)):
            raise
        if isinstance(e, KeyboardInterrupt):
            raise
        msg = f"starting the cluster failed while {step}: {type(e).__name__}: {e}. Nothing was left running."
        raise ClusterError(msg) from e
    cluster = Cluster(client, ipp_cluster, ranks, plan.backend, options, pids=pids)
    cluster.plan = plan
    cluster.allocator = ",".join(sorted({h.get("allocator", "system") for h in hellos.values()}))
    registry.write(cluster)
    from nbtrain.cluster.watchdog import spawn

    # stops the cluster if its kernel dies and nothing runs on it for NBTRAIN_IDLE_TIMEOUT seconds
    watchdog = spawn(cluster)
    if watchdog is not None:
        cluster._pids.append(watchdog)
    return cluster


def _loopback_env(
    ranks: Sequence[RankInfo], master_addr: str, port: int, options: StartOptions
) -> dict[str, str]:
    """A cluster on this machine alone keeps its process group off the network.

    torch's TCPStore listens on every interface, so local ranks meet through a FileStore in the profile's
    security folder (0700) instead, and gloo's pairs use the loopback interface.
    """
    if master_addr != "127.0.0.1" or any(r.host != socket.gethostname() for r in ranks):
        return {}
    from IPython.paths import get_ipython_dir

    folder = os.path.join(get_ipython_dir(), f"profile_{options.profile}", "security")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    store = os.path.join(folder, f".nbtrain-store-{os.getpid()}-{port}")
    return {"NBTRAIN_STORE_FILE": store, "GLOO_SOCKET_IFNAME": "lo"}


def _init_group(
    client: Any,
    ranks: list[RankInfo],
    options: StartOptions,
    remaining: Callable[[], float],
    master_addr: str,
    port: int,
    launcher: str = "local",
    announce: bool = True,
) -> DevicePlan:
    """Plan the backend and every rank's device here, then have every rank join the group with them.

    The one place a process group is made (local, remote and connected starts, re-init after an
    interrupt or a restart). Prints the plan's why-line when `announce`.
    """
    from nbtrain.cluster.plan import Slot, plan_devices
    from nbtrain.engine import setup

    plan = plan_devices(
        [Slot(r.host, r.local_rank, r.gpus) for r in ranks], options.backend, launcher=launcher
    )
    if plan.why and announce:
        log.info("nbtrain: %s", plan.why)
        print(f"nbtrain: {plan.why}", flush=True)
    world = len(ranks)
    pending = []
    for r in ranks:
        env = {
            "RANK": str(r.rank),
            "LOCAL_RANK": str(r.local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(r.local_world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(port),
            **_loopback_env(ranks, master_addr, port, options),
            **options.extra_env,
        }
        r.address = master_addr if r.rank == 0 else r.address
        ar = client[r.engine_id].apply_async(
            setup.init_rank, env, plan.backend, plan.devices[r.rank], options.pg_timeout
        )
        pending.append((r, ar))
    failures: list[tuple[RankInfo, BaseException]] = []
    late: list[RankInfo] = []
    # a rank that failed leaves the others waiting in the rendezvous for it: report the failure
    # after a short grace instead of sitting out --timeout and blaming the network
    failed_at: float | None = None
    todo = list(pending)
    while todo:
        now = time.monotonic()
        if remaining() <= 0.1 or (failed_at is not None and now - failed_at > FAILED_GRACE_S):
            late = [r for r, _ in todo]
            break
        r, ar = todo[0]
        if not ar.wait(min(0.1, remaining())):
            todo.append(todo.pop(0))
            continue
        todo.pop(0)
        try:
            info = ar.get()
        except Exception as err:
            failures.append((r, err))
            failed_at = failed_at or time.monotonic()
            continue
        r.device = info["device"]
    if failures:
        lines = []
        for r, e in sorted(failures, key=lambda f: f[0].rank):
            ename = getattr(e, "ename", type(e).__name__)
            evalue = getattr(e, "evalue", str(e))
            lines.append(f"  rank {r.rank} on {r.host}: {ename}: {evalue}")
        if late:
            who = _describe_ranks(ranks, [r.rank for r in late])
            lines.append(f"  {who}: still waiting for the failed rank(s) in the rendezvous")
        msg = "the process group could not be created; nothing was left running.\n" + "\n".join(
            lines
        )
        raise ClusterError(msg)
    if late:
        who = _describe_ranks(ranks, [r.rank for r in late])
        msg = (
            f"the process group was not ready within --timeout {options.timeout:g} s: {who} did not join "
            f"the rendezvous at {master_addr}:{port} (backend {plan.backend}). Nothing was left "
            "running. A firewall or a wrong network interface between the nodes is the usual cause."
        )
        raise ClusterError(msg)
    return plan


def raise_for_failures(
    cluster: Cluster, which: Sequence[int], results: Sequence[Any], note: str = ""
) -> None:
    """Raise one `DistributedCellError` grouping identical remote failures, if any rank failed."""
    from nbtrain.cluster.cell import group_failures

    failures = []
    for r, res in zip(which, results):
        if isinstance(res, BaseException):
            failures.append((r, res))
    if failures:
        message, groups = group_failures(cluster, failures, total=len(which))
        raise DistributedCellError(message + note, groups)


@atexit.register
def _stop_at_exit() -> None:
    # a kernel shutdown or restart must not leave engines behind
    cluster = _current
    if cluster is not None and not cluster.stopped:
        try:
            cluster.stop()
        except Exception as e:  # pragma: no cover - best effort at exit
            print(f"nbtrain: stopping the cluster at exit failed: {e}", file=sys.stderr)
