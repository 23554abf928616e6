"""Futures, and the one worker that runs them: each model's requests strictly in `seq_id` order.

The SDK numbers every request of a training model (`seq_id` from 1; a create-via-load is 0) and may
send a split `forward_backward`'s chunks in parallel, so they can arrive out of order. A request is
held until every lower `seq_id` of its model has been queued; the worker then runs queued requests
one at a time, in the order they became ready, because each one is a collective on every rank.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: a finished request's answer: ("json", dict) or ("proto", bytes)
Payload = tuple[str, Any]
#: how the worker turns an exception into (category, message, every pending request fails too)
Classifier = Callable[[BaseException], tuple[str, str, bool]]

_KEEP_S = 600.0  # a finished future is kept this long for the client to fetch (and fetch again)


@dataclass
class Future:
    """One request's future: `done` resolves to a Payload, or to {"error", "category"}."""

    request_id: str
    model_id: str | None
    what: str
    created: float = field(default_factory=time.time)
    done: cf.Future = field(default_factory=cf.Future)

    def answer(self) -> Payload:
        """The answer the client gets from retrieve_future (only once `done`)."""
        return self.done.result()

    def finished(self) -> bool:
        return self.done.done()

    def resolve(self, payload: Payload) -> None:
        """Answer once; a later answer (the worker finishing a request a dead rank failed) is dropped."""
        try:
            self.done.set_result(payload)
        except cf.InvalidStateError:
            pass


@dataclass
class _Model:
    next_seq: int
    #: requests waiting for a lower seq_id; None for a refused request's seq_id (nothing to run)
    held: dict[int, tuple[Future, Callable[[], Payload]] | None] = field(default_factory=dict)
    #: seq_id -> request_id, so a retried request gets its first future back
    seen: dict[int, str] = field(default_factory=dict)


class Executor:
    """Futures by request id, per-model ordering, and the worker thread that runs them."""

    def __init__(self, classify: Classifier, name: str = "nbtrain-tinker-worker"):
        self._classify = classify
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._futures: dict[str, Future] = {}
        self._models: dict[str, _Model] = {}
        self._queue: queue.Queue[tuple[Future, Callable[[], Payload]] | None] = queue.Queue()
        #: when set, every new request fails at once with this message (a dead rank)
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    # --- submitting -----------------------------------------------------------------------------
    def expect(self, model_id: str, next_seq: int) -> None:
        """Start ordering `model_id`'s requests: the next one it may run is `next_seq`."""
        with self._lock:
            self._models.setdefault(model_id, _Model(next_seq=next_seq))

    def forget(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def submit(
        self,
        what: str,
        fn: Callable[[], Payload],
        model_id: str | None = None,
        seq_id: int | None = None,
    ) -> Future:
        """A future for `fn`, run once every lower `seq_id` of `model_id` was queued."""
        with self._lock:
            model = self._models.get(model_id) if model_id is not None else None
            if model is not None and seq_id is not None and seq_id in model.seen:
                return self._futures[model.seen[seq_id]]
            fut = Future(request_id=f"req-{next(self._ids)}", model_id=model_id, what=what)
            self._futures[fut.request_id] = fut
            self._prune()
            if self.broken is not None:
                fut.resolve(("json", {"error": self.broken, "category": "server"}))
                return fut
            if model is None or seq_id is None:
                self._queue.put((fut, fn))
                return fut
            model.seen[seq_id] = fut.request_id
            if seq_id < model.next_seq:
                # an id the model already passed and that this server never saw: a client that
                # restarted its numbering. Run it now rather than hold it for ever.
                self._queue.put((fut, fn))
                return fut
            model.held[seq_id] = (fut, fn)
            self._release(model)
            return fut

    def skip(self, model_id: Any, seq_id: Any) -> None:
        """A request refused before it was queued (a 400) still used its seq_id: later ones must
        not wait for it."""
        with self._lock:
            model = self._models.get(model_id) if isinstance(model_id, str) else None
            if model is None or not isinstance(seq_id, int) or seq_id < model.next_seq:
                return
            model.held.setdefault(seq_id, None)
            self._release(model)

    def _release(self, model: _Model) -> None:
        while model.next_seq in model.held:
            item = model.held.pop(model.next_seq)
            if item is not None:
                self._queue.put(item)
            model.next_seq += 1

    def get(self, request_id: str) -> Future | None:
        with self._lock:
            return self._futures.get(request_id)

    def pending(self) -> int:
        with self._lock:
            return sum(not f.finished() for f in self._futures.values())

    def _prune(self) -> None:
        now = time.time()
        old = [k for k, f in self._futures.items() if f.finished() and now - f.created > _KEEP_S]
        for k in old:
            del self._futures[k]

    # --- failing --------------------------------------------------------------------------------
    def fail_all(self, message: str) -> int:
        """Fail every request not yet answered (queued, held or running) with `message`."""
        with self._lock:
            n = 0
            for fut in self._futures.values():
                if not fut.finished():
                    fut.resolve(("json", {"error": message, "category": "server"}))
                    n += 1
            for model in self._models.values():
                model.held.clear()
            return n

    # --- the worker -----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn = item
            if fut.finished():
                continue  # failed while it waited (a dead rank)
            try:
                payload = fn()
            except BaseException as e:  # noqa: BLE001 - every failure becomes the future's error
                category, message, fatal = self._classify(e)
                fut.resolve(("json", {"error": message, "category": category}))
                if fatal:
                    self.broken = message
                    self.fail_all(message)
                continue
            fut.resolve(payload)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
