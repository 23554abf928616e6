"""One `%%distributed` cell: send it to the ranks, stream their output, draw live metrics, gather errors."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

from nbtrain.cluster import group
from nbtrain.cluster.failures import raise_for_failures
from nbtrain.cluster.ranks.topology import agree, describe_ranks
from nbtrain.engine import groups as engine_groups
from nbtrain.engine.metrics import KEY_PREFIX
from nbtrain.errors import CellTimeoutError

if TYPE_CHECKING:
    from nbtrain.cluster.session import Session

log = logging.getLogger(__name__)

OUTPUT_MODES = ("rank0", "all", "none")
# how long ranks get to honour an interrupt before those still busy are asked where they are.
# Measured on 2 cores at load 6-17 (two busy processes beside other tests): ranks in finetune's loop
# got SIGINT within 0.06 s and raised within 0.1 s of it, all at the same step; their cells ended
# 0.4-10.9 s after the interrupt (an engine writes the traceback, slowly under load; the old fixed
# 4 s replaced ranks doing only that).
# A rank in a collective its peer left never ends, so the first look comes early, and a rank that
# answers and is on its way is waited for (HELD_GRACE) rather than replaced
INTERRUPT_GRACE = 4.0
# how long a rank must answer that stack request in (the control channel, answered on its own thread)
STACK_ANSWER = 5.0
# the most a rank that answers and is on its way (holding the interrupt to its step's end, writing
# its traceback) is waited for, counted from the interrupt
HELD_GRACE = 120.0
# once one rank has failed, how long the others may go on before we assume they wait for it
FAIL_GRACE = 3.0
# --output all holds what the ranks print for up to this long, to print it in rank order
ALL_HOLD = 1.0
# the cell loop wakes when a rank sends something (output, metrics) or finishes, and at least this
# often to check for dead ranks, the timeout and failures: a 20 Hz loop cost ~1% of a core while
# training, taken from the ranks on a machine whose cores they all use
POLL = 0.25


def in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def _publish(data: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
    if in_kernel():
        from IPython.display import publish_display_data

        publish_display_data(data=data, metadata=metadata or {})
    elif "text/plain" in data:
        print(data["text/plain"])


class CellRun:
    """Runs one cell on `which` ranks and waits for it like a local cell would."""

    def __init__(
        self,
        cluster: Session,
        code: str,
        which: list[int],
        output: str = "rank0",
        timeout: float | None = None,
        live: bool = True,
        group: str | None = None,
    ) -> None:
        if output not in OUTPUT_MODES:
            from nbtrain.errors import ConfigError

            msg = f"--output {output!r}: choose one of {', '.join(OUTPUT_MODES)}."
            raise ConfigError(msg)
        if timeout is not None and timeout <= 0:
            from nbtrain.errors import ConfigError

            msg = f"--timeout {timeout} must be a positive number of seconds."
            raise ConfigError(msg)
        self.cluster = cluster
        self.code = code
        self.which = which
        self.output = output
        self.timeout = timeout
        self.live = live
        self.group = group  # the named group the cell runs on (`group` in the cell), or None: WORLD
        # rank whose output is shown in rank0 mode: rank 0, or the lowest rank the cell runs on
        self.lead = which[0]
        self._queue: deque[tuple[Any, ...]] = deque()
        self._partial: dict[tuple[int, str], str] = {}
        self._display: Any = None
        self._seen_keys = 0
        self._queued_since: float | None = (
            None  # --output all: when the oldest unprinted output came
        )
        # set by the IO thread when a rank sends a message or the cell finishes: wakes the loop
        self._wake = threading.Event()

    # --- output ---------------------------------------------------------------------------------
    def _shows(self, rank: int) -> bool:
        if self.output == "all":
            return True
        if self.output == "none":
            return False
        return rank == self.lead

    def _on_iopub(self, rank: int, msg: dict[str, Any]) -> None:
        # runs on the client's IO thread: only queue, the main thread prints
        msg_type = msg["header"]["msg_type"]
        if msg_type in ("stream", "display_data", "execute_result") and self._shows(rank):
            self._queue.append((rank, msg_type, msg["content"]))
            self._wake.set()
        elif msg_type == "data_message" and self.live:
            self._wake.set()  # metrics from rank 0 (datapub)

    def _hook(self, ar: Any) -> None:
        """Attach output callbacks on the IO thread, so no message slips between snapshot and hook.

        Not waited for here (that hop costs ~1 ms, far more at the tail): `_hooked` is waited on before
        the final drain, when the hook has long run.
        """
        installed = self._hooked = threading.Event()

        def install() -> None:
            try:
                for rank, fut in zip(self.which, ar._children):
                    md = fut.output.metadata
                    if self._shows(rank):
                        for name in ("stdout", "stderr"):
                            if md[name]:
                                self._queue.append(
                                    (rank, "stream", {"name": name, "text": md[name]})
                                )
                        for out in md["outputs"]:
                            self._queue.append((rank, "display_data", out))
                        if md["execute_result"]:
                            self._queue.append((rank, "execute_result", md["execute_result"]))
                    fut.iopub_callbacks.append(partial(self._on_iopub, rank))
            finally:
                installed.set()

        self.cluster.client._io_loop.add_callback(install)

    def _write(self, rank: int, name: str, text: str) -> None:
        stream = sys.stderr if name == "stderr" else sys.stdout
        if self.output != "all":
            stream.write(text)
            return
        key = (rank, name)
        buf = self._partial.get(key, "") + text
        *lines, rest = buf.split("\n")
        self._partial[key] = rest
        if lines:
            stream.write("".join(f"[rank {rank}] {line}\n" for line in lines))

    def _drain(self, final: bool = True) -> None:
        """Print what the ranks sent. With --output all, what arrived within `ALL_HOLD` s of each
        other comes out in rank order (each rank's own output in its order), as a short cell's
        lines do: the ranks' messages reach the client in any order."""
        items = []
        if self.output == "all" and self._queue:
            now = time.monotonic()
            if self._queued_since is None:
                self._queued_since = now
            if not final and now - self._queued_since < ALL_HOLD:
                return
        self._queued_since = None
        while self._queue:
            items.append(self._queue.popleft())
        if self.output == "all":
            items.sort(key=lambda item: item[0])
        wrote = False
        for rank, msg_type, content in items:
            if msg_type == "stream":
                self._write(rank, content["name"], content["text"])
                wrote = True
            else:
                if self.output == "all":
                    sys.stdout.write(f"[rank {rank}] output:\n")
                sys.stdout.flush()
                _publish(content.get("data", {}), content.get("metadata"))
        if wrote:
            sys.stdout.flush()
            sys.stderr.flush()

    def _flush_partial(self) -> None:
        for (rank, name), rest in sorted(self._partial.items()):
            if rest:
                stream = sys.stderr if name == "stderr" else sys.stdout
                stream.write(f"[rank {rank}] {rest}\n")
        self._partial.clear()

    def _feed_metrics(self, ar: Any) -> None:
        # live plots need a notebook to draw in; elsewhere rank 0's log lines tell the story
        if not self.live or 0 not in self.which or not in_kernel():
            return
        fut = ar._children[self.which.index(0)]
        data = fut.output.metadata["data"]
        if len(data) <= self._seen_keys:
            return
        keys = [k for k in list(data)[self._seen_keys :]]
        self._seen_keys += len(keys)
        for key in keys:
            if not key.startswith(KEY_PREFIX):
                continue
            payload = data[key]
            kind = payload.get("kind")
            if (
                self._display is not None
                and kind != "end"
                and (self._display.closed or (kind == "begin" and self._display.rows))
            ):
                # a second run in the same cell (two finetune calls): the first keeps its final
                # image where it was, and the second gets a display of its own below it
                self._display.close()
                self._display = None
            if self._display is None:
                from nbtrain.live import LiveDisplay

                self._display = LiveDisplay()
            self._display.feed(payload)

    # --- the run --------------------------------------------------------------------------------
    def run(self) -> list[Any]:
        # the client is the cluster's, shared with the Tinker service's worker thread: one at a time
        lock = getattr(self.cluster, "client_lock", None)
        if lock is None:
            return self._run()
        with lock.held(say=True):
            return self._run()

    def _run(self) -> list[Any]:
        from nbtrain.cluster.faults import recovery as faults

        faults.check_alive(self.cluster, self.which)
        if self.cluster.group_specs:
            # `group` in the cell: this cell's group, or the world group for a cell without one
            self.cluster.run(engine_groups.enter, self.group, ranks=self.which, timeout=30)
        # a rank that dies in this cell is described by what it wrote in this cell only
        self.log_offsets = faults.log_offsets(self.cluster, self.which)
        view = self.cluster.view(self.which)
        ar = view.execute(self.code, silent=False, block=False)
        self._hook(ar)
        for fut in [*ar._children, ar]:  # a rank that finishes or fails wakes the loop at once
            fut.add_done_callback(lambda _: self._wake.set())
        start = time.monotonic()
        self._stopped_note = ""
        first_failure: float | None = None
        watch = faults.DeathWatch(self.cluster, self.which)
        try:
            while not ar.ready():
                self._wake.wait(POLL)
                self._wake.clear()
                dead = watch.poll()
                if dead:
                    faults.fail_cell(self, ar, dead, start)
                self._drain(final=False)
                self._feed_metrics(ar)
                if self._display is not None:
                    self._display.maybe_render()
                if self.timeout is not None and time.monotonic() - start > self.timeout:
                    self._on_timeout(ar)
                if first_failure is None and self._any_failed(ar):
                    first_failure = time.monotonic()
                if first_failure is not None and time.monotonic() - first_failure > FAIL_GRACE:
                    # like torchrun: a failed rank takes the others down rather than leaving them
                    # blocked for ever in a collective that waits for it
                    waiting = self._pending(ar)
                    # a rank's failure can be the echo of a peer that died where we cannot see it
                    # (another host, before the heartbeat says so): ranks that do not answer are dead
                    silent = faults.silent_ranks(self.cluster, waiting, timeout=STACK_ANSWER)
                    if silent:
                        faults.fail_cell(self, ar, silent, start)
                    self._stopped_note = self._stop_ranks(ar)
                    self._stopped_note = (
                        f"\n\n{describe_ranks(self.cluster.ranks, waiting)} kept running after the failure "
                        f"(likely waiting for the failed rank in a collective) and {agree(waiting, 'was', 'were')} stopped. {self._stopped_note}"
                    )
                    break
        except KeyboardInterrupt:
            self._drain()
            note = self._stop_ranks(ar)
            self._finish_display()
            print(f"\nnbtrain: interrupted on {len(self.which)} rank(s). {note}", file=sys.stderr)
            raise
        if self._any_failed(ar):
            # the cell ended because a rank died (its peers' collectives then fail too): say so
            dead = faults.dead_ranks(self.cluster, self.which)
            if dead:
                faults.fail_cell(self, ar, dead, start)
        ar.wait_for_output(2.0)
        self._hooked.wait(5)
        self._drain()
        self._feed_metrics(ar)
        self._flush_partial()
        self._finish_display()
        results = ar.get(return_exceptions=True)
        raise_for_failures(self.cluster.ranks, self.which, results, note=self._stopped_note)
        return list(results)

    def _any_failed(self, ar: Any) -> bool:
        # a finished child holds an ExecuteReply, or the RemoteError itself (not raised)
        for fut in ar._children:
            if fut.done() and (
                fut.exception() is not None or isinstance(fut.result(), BaseException)
            ):
                return True
        return False

    def _finish_display(self) -> None:
        if self._display is not None:
            self._display.close()

    def _on_timeout(self, ar: Any) -> None:
        from nbtrain.cluster.faults.diagnose import diagnose

        pending = self._pending(ar)
        # the same report as %nbtrain diagnose: stacks, and who waits in a collective
        text = diagnose(self.cluster, self.which, pending=pending).text
        self._drain()
        note = self._stop_ranks(ar)
        self._finish_display()
        msg = (
            f"the cell ran past --timeout {self.timeout:g} s and was stopped. {note}\n"
            f"Where each rank was:\n{text}"
        )
        raise CellTimeoutError(msg)

    def _pending(self, ar: Any) -> list[int]:
        return [r for r, fut in zip(self.which, ar._children) if not fut.done()]

    def _stop_ranks(self, ar: Any) -> str:
        """Interrupt the cell on every rank; replace ranks that do not stop; make the group usable.

        Ranks still busy after `INTERRUPT_GRACE` are asked where they are: one that does not answer,
        or waits in a collective its peers have left, is replaced; one that answers and is on its way
        (it holds the interrupt to its step's end, or runs Python such as its traceback) is waited for,
        up to `HELD_GRACE`. A second interrupt stops the waiting."""
        from nbtrain.cluster.faults.diagnose import classify

        cluster = self.cluster
        cluster.interrupt(self.which)
        t0 = time.monotonic()
        told = False
        try:
            self._wait(ar, t0 + INTERRUPT_GRACE)
            while self._pending(ar) and time.monotonic() < t0 + HELD_GRACE:
                stuck = self._pending(ar)
                stacks = cluster.stacks(stuck, timeout=STACK_ANSWER)
                going = [
                    r
                    for r in stuck
                    if stacks.get(r, {}).get("interrupt_held_s") is not None
                    or classify(stacks.get(r, {"error": "no answer"}))[0] in ("busy", "idle")
                ]
                if not going:
                    break  # replace now: the silent and the blocked never finish by themselves
                if not told:
                    told = True
                    print(
                        f"nbtrain: {describe_ranks(cluster.ranks, going)} {agree(going, 'is', 'are')} still finishing "
                        f"(up to {HELD_GRACE:g} s after the interrupt); interrupt again to replace "
                        f"{agree(going, 'it', 'them')} now.",
                        file=sys.stderr,
                    )
                self._wait(ar, min(time.monotonic() + 2.0, t0 + HELD_GRACE))
        except KeyboardInterrupt:
            pass  # a second interrupt: stop waiting, replace whoever is still busy
        stuck = self._pending(ar)
        if stuck:
            waited = time.monotonic() - t0
            cluster.restart_ranks(stuck)
            return (
                f"{describe_ranks(cluster.ranks, stuck)} did not stop within {waited:.0f} s of the "
                f"interrupt (blocked in a collective or in C code) and {agree(stuck, 'was', 'were')} replaced: "
                f"{agree(stuck, 'its', 'their')} variables are gone. The process group was re-created on every rank; "
                "rebuild objects that hold it (e.g. DDP models)."
            )
        return group.repair(cluster)

    def _wait(self, ar: Any, deadline: float) -> None:
        while not ar.wait(0.1) and time.monotonic() < deadline:
            self._drain()
