"""When ranks die or hang: notice it fast, say what happened in the notebook, and put the cluster back.

In [1]: cluster.diagnose()        # twin of %nbtrain diagnose: every rank's stacks, who waits in a collective
In [2]: cluster.restart()         # twin of %nbtrain restart: replace dead or wedged engines, new group

How a death is noticed, fastest first:
  * a local engine's process is gone (psutil, checked every 0.1 s while a cell runs), its exit status
    read from the launcher that started it (negative: the signal that killed it);
  * the hub unregisters the engine: its nanny reports the exit at once, or, when the engine and its nanny
    are both gone or the network to the node is cut, the hub's heartbeat (every 0.5 s, 10 misses) does
    within about 5 s.
The last lines of the rank's stderr come from the cell's captured stderr and the engine's own log file
(where `nbtrain.engine.faults` points faulthandler and a copy of stderr).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbtrain import procs
from nbtrain.cluster import group, registry
from nbtrain.cluster.faults.diagnose import classify, in_cell
from nbtrain.cluster.ranks.topology import agree, describe_ranks
from nbtrain.cluster.session import Session
from nbtrain.errors import ClusterError, RankDiedError

log = logging.getLogger(__name__)

# how long ranks that outlived a dead one get to leave their cell after SIGINT before their engines are
# ended: a rank blocked in a gloo/NCCL collective waiting for the dead one never returns by itself
SURVIVOR_GRACE = 1.5
# how long such a rank that answers and is not in a collective (leaving its cell, slowly under load)
# may still take before it is ended too
SURVIVOR_FINISH = 30.0
CHECK_EVERY = 0.1
# a rank that does not answer a control-channel request within this many seconds is wedged
WEDGED_AFTER = 3.0
TAIL_LINES = 12

_SIGNAL_HINTS = {
    "SIGKILL": "kill -9, or the kernel's out-of-memory killer",
    "SIGSEGV": "segmentation fault: a crash in C/C++/CUDA code",
    "SIGABRT": "abort: a failed C++ assertion or an uncaught C++ exception",
    "SIGBUS": "bus error",
    "SIGFPE": "arithmetic error in native code",
    "SIGILL": "illegal instruction",
    "SIGTERM": "terminated",
}
# ipyparallel's own log lines in an engine's output file: infrastructure, not the rank's stderr
_INFRA = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \[(IPEngine|KernelNanny|IPController)")


@dataclass
class RankDeath:
    """One rank that died: where, how, and what it last wrote to stderr."""

    rank: int
    host: str
    pid: int
    how: str  #: "killed by SIGKILL (...)", "exited with code 3", "lost: no heartbeat ..."
    exit_code: int | None = None
    signal: str | None = None
    tail: list[str] = field(default_factory=list)
    log: str | None = None

    def describe(self) -> str:
        lines = [f"rank {self.rank} on {self.host} (pid {self.pid}) {self.how}."]
        if self.tail:
            where = f" ({self.log})" if self.log else ""
            lines.append(f"Last lines of its stderr{where}:")
            lines.extend(f"    {line}" for line in self.tail)
        elif self.log:
            lines.append(f"It wrote nothing to stderr; its log is {self.host}:{self.log}.")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------- detection
def _is_local(cluster: Session, host: str) -> bool:
    return host == socket.gethostname()


def _launcher_for(cluster: Session, pid: int) -> Any:
    ipc = getattr(cluster, "ipp_cluster", None)
    for engine_set in list(getattr(ipc, "engines", {}).values()):
        for launcher in list(getattr(engine_set, "launchers", {}).values()):
            if getattr(launcher, "pid", None) == pid:
                return launcher
    return None


def lost_ranks(cluster: Session) -> set[int]:
    """Ranks nbtrain already knows are gone (died, or ended because they were stuck)."""
    return cluster.lost


def dead_ranks(cluster: Session, which: Sequence[int] | None = None) -> list[int]:
    """Ranks (of `which`, default all) whose engine is gone: process exited, or the hub dropped it."""
    which = range(cluster.world_size) if which is None else which
    ids = set(cluster.client.ids)
    out = []
    for r in which:
        info = cluster.ranks[r]
        if info.engine_id not in ids:
            out.append(r)
        elif _is_local(cluster, info.host) and procs.gone(info.pid):
            out.append(r)
    return out


def silent_ranks(cluster: Session, which: Sequence[int], timeout: float = 2.0) -> list[int]:
    """Ranks of `which` that are dead, or alive to the hub but not answering their control channel."""
    dead = dead_ranks(cluster, which)
    rest = [r for r in which if r not in dead]
    if rest:
        stacks = cluster.stacks(rest, timeout=timeout)
        dead += [r for r in rest if stacks.get(r, {}).get("error")]
    return sorted(dead)


class DeathWatch:
    """Checks for dead ranks at most every `CHECK_EVERY` seconds (cheap enough for every poll)."""

    def __init__(self, cluster: Session, which: Sequence[int]) -> None:
        self.cluster = cluster
        self.which = list(which)
        self._next = 0.0

    def poll(self) -> list[int]:
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + CHECK_EVERY
        try:
            return dead_ranks(self.cluster, self.which)
        except Exception:  # a client shutting down: the cell's own wait reports that
            return []


def check_alive(cluster: Session, which: Sequence[int]) -> None:
    """Before a cell: refuse to run on a cluster with dead ranks, saying what to do."""
    dead = sorted(set(dead_ranks(cluster)) | lost_ranks(cluster))
    if not dead:
        return

    msg = (
        f"{describe_ranks(cluster.ranks, dead)} of this cluster died or {agree(dead, 'was', 'were')} "
        "ended, so the process group "
        "is broken. Run %nbtrain restart (cluster.restart()) to replace them; then re-run your set-up "
        "cells, and continue training with finetune(SFTConfig(..., resume='latest'))."
    )
    raise ClusterError(msg)


# -------------------------------------------------------------------------------------- description
def _exit_code(cluster: Session, pid: int, wait: float = 1.0) -> int | None:
    """The exit status of a local engine the launcher started (psutil caches it once reaped)."""
    launcher = _launcher_for(cluster, pid)
    proc = getattr(launcher, "process", None)
    if proc is None:
        return None
    # ipyparallel's launcher waits on the same process in a thread of its own: whichever reaps it
    # second gets None, and psutil keeps that (CI saw "exit status unknown" for a SIGKILLed rank)
    return procs.exit_code(proc, wait, waiter=getattr(launcher, "_wait_thread", None))


def _how(code: int | None) -> tuple[str, str | None]:
    if code is None:
        return "died (its exit status is unknown)", None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = _SIGNAL_HINTS.get(name)
        return f"was killed by {name}" + (f" ({hint})" if hint else ""), name
    return f"exited with code {code}", None


def _reachable(address: str, port: int = 22, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError as e:
        # refused means the host is up and answered, just not on that port
        return isinstance(e, ConnectionRefusedError)


def _filter_tail(lines: Sequence[str], n: int = TAIL_LINES) -> list[str]:
    useful = [line.rstrip() for line in lines if line.strip() and not _INFRA.match(line)]
    fatal = [i for i, line in enumerate(useful) if line.startswith("Fatal Python error")]
    if not fatal:
        return useful[-n:]
    # a faulthandler dump: the lines before it, its header and the innermost frames of the crashing
    # thread (most recent call first), not the engine's event-loop frames at its bottom
    i = fatal[-1]
    before = useful[max(0, i - 4) : i]
    dump = useful[i:]
    current = [k for k, line in enumerate(dump) if line.startswith("Current thread")]
    if current:
        dump = dump[:1] + dump[current[0] :]
    head: list[str] = []
    frames: list[str] = []
    for line in dump:
        if line.lstrip().startswith("File "):
            if len(frames) < 6:
                frames.append(line)
        elif not frames:
            head.append(line)
        else:
            break
    return before + head + frames


def _log_path(cluster: Session, rank: int) -> str | None:
    info = cluster.ranks[rank]
    path = getattr(info, "log", None)
    launcher = _launcher_for(cluster, info.pid)
    if path is None and launcher is not None:
        path = getattr(launcher, "output_file", None)
    return path or None


def log_offsets(cluster: Session, which: Sequence[int]) -> dict[int, int]:
    """Where each local rank's log ends now, before a cell: a death in it reports only what came after
    (not an earlier cell's stderr, which the log keeps too)."""
    out = {}
    for r in which:
        path = _log_path(cluster, r)
        if path and _is_local(cluster, cluster.ranks[r].host):
            try:
                out[r] = os.path.getsize(path)
            except OSError:
                pass
    return out


def _log_tail(
    cluster: Session, rank: int, survivors: Sequence[int], start: int = 0
) -> tuple[list[str], str | None]:
    from nbtrain.engine.faults import tail_file

    info = cluster.ranks[rank]
    path = _log_path(cluster, rank)
    if not path:
        return [], None
    if _is_local(cluster, info.host):
        return tail_file(path, lines=200, start=start), path
    # another rank on the same host can read the file for us
    for r in survivors:
        other = cluster.ranks[r]
        if other.host == info.host and r not in lost_ranks(cluster):
            try:
                ar = cluster.client[other.engine_id].apply_async(tail_file, path, 200)
                return list(ar.get(timeout=2.0)), path
            except Exception:
                log.debug("rank %d's log could not be read through rank %d", rank, r, exc_info=True)
                break
    return [], path


def describe_death(
    cluster: Session,
    rank: int,
    cell_stderr: str = "",
    survivors: Sequence[int] = (),
    log_start: int = 0,
) -> RankDeath:
    """What is known about how `rank` died, from the launcher, the hub and its log (what it wrote
    there after byte `log_start`: the cell's start)."""
    info = cluster.ranks[rank]
    code = None
    sig = None
    if _is_local(cluster, info.host):
        code = _exit_code(cluster, info.pid)
        if code is None and _launcher_for(cluster, info.pid) is None:
            how = "died (its exit status is unknown: this kernel did not start that engine)"
        else:
            how, sig = _how(code)
    else:
        same_host_alive = [
            r
            for r in survivors
            if cluster.ranks[r].host == info.host
            and cluster.ranks[r].engine_id in cluster.client.ids
        ]
        if same_host_alive:
            how = (
                "died: its nanny reported the engine's exit to the controller (the exit status stays "
                f"on {info.host})"
            )
        elif _reachable(info.address):
            how = (
                f"died with its nanny (no heartbeat), though {info.host} still answers on the network: "
                "killed, e.g. by the out-of-memory killer"
            )
        else:
            how = (
                f"was lost: no heartbeat from {info.host} and it does not answer on the network at "
                f"{info.address} (node down or network cut)"
            )
    log_lines, path = _log_tail(cluster, rank, survivors, log_start)
    # the log holds a copy of the cell's stderr (and crash dumps); the captured stderr is the fallback
    tail = _filter_tail(log_lines) or _filter_tail(cell_stderr.splitlines())
    return RankDeath(
        rank=rank,
        host=info.host,
        pid=info.pid,
        how=how,
        exit_code=code,
        signal=sig,
        tail=tail,
        log=path,
    )


# ------------------------------------------------------------------------------------ the failed cell
def end_engines(cluster: Session, ranks: Sequence[int]) -> None:
    """Kill the engines of `ranks` (they are blocked for good); `restart` brings them back."""
    for r in ranks:
        info = cluster.ranks[r]
        if _is_local(cluster, info.host):
            procs.kill_with_children([info.pid])
        else:
            try:
                # the nanny on that host delivers it
                procs.signal_engine(cluster.client, signal.SIGKILL, info.engine_id)
            except Exception:
                log.debug("SIGKILL to rank %d on %s failed", r, info.host, exc_info=True)
    lost_ranks(cluster).update(ranks)


def fail_cell(run: Any, ar: Any, dead: Sequence[int], started: float) -> None:
    """A rank died while the cell ran: stop the others, then raise `RankDiedError` saying what happened."""

    cluster = run.cluster
    detected = time.monotonic() - started
    lost_ranks(cluster).update(dead)
    survivors = [r for r in run._pending(ar) if r not in dead]
    if survivors:
        try:
            cluster.interrupt(survivors)
        except Exception:
            log.debug("interrupting the survivors %s failed", survivors, exc_info=True)
    deaths = []
    for r in dead:
        fut = ar._children[run.which.index(r)]
        try:
            cell_stderr = fut.output.metadata.get("stderr", "") or ""
        except Exception:  # no output came back from the dead rank: its log file's tail is used
            cell_stderr = ""
        start = getattr(run, "log_offsets", {}).get(r, 0)
        deaths.append(describe_death(cluster, r, cell_stderr, survivors, start))
    deadline = time.monotonic() + SURVIVOR_GRACE
    while time.monotonic() < deadline and any(
        not ar._children[run.which.index(r)].done() for r in survivors
    ):
        run._drain()
        time.sleep(0.05)

    def pending(ranks: Sequence[int]) -> list[int]:
        return [r for r in ranks if not ar._children[run.which.index(r)].done()]

    stuck = pending(survivors)
    where = {}
    if stuck:
        try:
            stacks = cluster.stacks(stuck, timeout=2.0)
        except Exception:
            log.debug("the stacks of ranks %s could not be read", stuck, exc_info=True)
            stacks = {}
        kinds = {r: classify(i) for r, i in stacks.items()}
        # one that answers, is not in a collective and has left the cell's code is on its way out
        # (under load, writing its traceback takes seconds): wait for it rather than end it and lose
        # its variables. One still in the cell's code did not take the SIGINT (a Ray-hosted engine
        # whose peer's node was lost): ended now, so the death is named without that wait
        going = [
            r
            for r in stuck
            if kinds.get(r, ("silent", ""))[0] in ("busy", "idle") and not in_cell(stacks[r])
        ]
        deadline = time.monotonic() + SURVIVOR_FINISH
        while pending(going) and time.monotonic() < deadline:
            run._drain()
            time.sleep(0.05)
        stuck = pending(survivors)
        where = {r: kinds[r][1] for r in stuck if r in kinds}
    if stuck:
        end_engines(cluster, stuck)
    run._drain()
    run._finish_display()
    parts = [
        f"{len(dead)} of {len(run.which)} rank(s) died while the cell ran (noticed after {detected:.1f} s)."
    ]
    parts.extend(d.describe() for d in deaths)
    for i, r in enumerate(run.which):
        fut = ar._children[i]
        if r in dead or r in survivors or not fut.done():
            continue
        err = fut.exception()
        if err is None and isinstance(fut.result(), BaseException):
            err = fut.result()
        if err is not None:
            first = str(getattr(err, "evalue", err)).strip().splitlines()[:1]
            parts.append(
                f"{describe_ranks(cluster.ranks, [r])} failed first: {getattr(err, 'ename', type(err).__name__)}: "
                f"{first[0] if first else ''}"
            )
    stopped = [r for r in survivors if r not in stuck]
    if stopped:
        parts.append(
            f"Interrupted the other ranks ({describe_ranks(cluster.ranks, stopped)}); "
            f"{agree(stopped, 'it keeps its', 'they keep their')} variables."
        )
    if stuck:
        parts.append(
            f"Ended {describe_ranks(cluster.ranks, stuck)}: still blocked {SURVIVOR_GRACE:g} s after an "
            "interrupt (waiting for the dead rank in a collective)."
        )
        parts.extend(f"  rank {r} was in {w}" for r, w in sorted(where.items()))
    parts.append(
        "The process group is broken until the lost ranks are replaced: run %nbtrain restart "
        "(cluster.restart()). Their in-memory state is gone: re-run your set-up cells, and continue "
        "training with finetune(SFTConfig(..., resume='latest'))."
    )
    err = RankDiedError("\n".join(parts), deaths)
    raise err


# ----------------------------------------------------------------------------------------- restart
def _wedged(cluster: Session, alive: Sequence[int]) -> tuple[list[int], list[int]]:
    """(busy ranks that ignore SIGINT, ranks that do not answer the control channel)."""
    if not alive:
        return [], []
    queues = cluster.client.queue_status(targets=cluster.engine_ids(alive))
    busy = [r for r in alive if queues.get(cluster.ranks[r].engine_id, {}).get("queue", 0)]
    if busy:
        cluster.interrupt(busy)
        deadline = time.monotonic() + 4.0
        while busy and time.monotonic() < deadline:
            time.sleep(0.2)
            queues = cluster.client.queue_status(targets=cluster.engine_ids(busy))
            busy = [r for r in busy if queues.get(cluster.ranks[r].engine_id, {}).get("queue", 0)]
    quiet = [r for r in alive if r not in busy]
    stacks = cluster.stacks(quiet, timeout=WEDGED_AFTER) if quiet else {}
    silent = [r for r, s in stacks.items() if s.get("error")]
    return busy, silent


def restart(cluster: Session, all_ranks: bool = False, timeout: float | None = None) -> str:
    """Replace dead or wedged engines with fresh ones and re-create the process group on every rank.

    Returns what was done, for the notebook. Replaced ranks lose their in-memory state.
    """

    cluster.check_usable()
    t0 = time.monotonic()
    world = range(cluster.world_size)
    dead = set(dead_ranks(cluster)) | lost_ranks(cluster)
    busy, silent = ([], []) if all_ranks else _wedged(cluster, [r for r in world if r not in dead])
    replace = sorted(world) if all_ranks else sorted(dead | set(busy) | set(silent))
    if replace:
        cluster.restart_ranks(replace, timeout=timeout)
    else:
        group.reinit(cluster, timeout=timeout or 60.0)
    lost_ranks(cluster).clear()
    try:
        registry.write(cluster)
    except Exception as e:
        log.warning(
            "nbtrain: cluster %s restarted, but its record could not be written (%s: %s); a kernel "
            "that attaches later sees it as before the restart",
            cluster.cluster_id,
            type(e).__name__,
            e,
            exc_info=True,
        )
    took = time.monotonic() - t0
    if not replace:
        return (
            f"nbtrain: every rank was alive; the process group was re-created in {took:.1f} s. Variables "
            "are kept; rebuild objects that hold the old group (e.g. DDP models)."
        )
    reasons = []
    if dead & set(replace):
        reasons.append(f"dead: {describe_ranks(cluster.ranks, sorted(dead))}")
    if busy:
        reasons.append(f"did not stop: {describe_ranks(cluster.ranks, busy)}")
    if silent:
        reasons.append(f"did not answer: {describe_ranks(cluster.ranks, silent)}")
    why = f" ({'; '.join(reasons)})" if reasons else ""
    kept = [r for r in world if r not in replace]
    kept_note = (
        f" {describe_ranks(cluster.ranks, kept)} kept {agree(kept, 'its', 'their')} variables, "
        "but rebuild objects that hold "
        "the old process group (e.g. DDP models)."
        if kept
        else ""
    )
    return (
        f"nbtrain: replaced {describe_ranks(cluster.ranks, replace)}{why} with fresh engines and re-created "
        f"the process group in {took:.1f} s. The in-memory state of the replaced ranks was lost: re-run "
        f"your set-up cells, and continue training with finetune(SFTConfig(..., resume='latest')).{kept_note}"
    )
