"""Futures, and the one worker that runs them: each model's requests strictly in `seq_id` order.

The SDK numbers every request of a training model (`seq_id` from 1; a create-via-load is 0) and may
send a split `forward_backward`'s chunks in parallel, so they can arrive out of order. A request is
held until every lower `seq_id` of its model has been queued; the worker then runs queued requests
one at a time, in the order they became ready, because each one is a collective on every rank.

A training verb is a `Step` (its verb and arguments for the ranks, then what the kernel does with the
answer). When the worker takes one and the requests queued right behind it are Steps of the same model
(an SDK loop that submits ahead: the next batch's forward_backward and optim_step), it runs them in one
trip to the ranks (`batch`): each verb as it would run alone, each future answered with its own result
or its own error, in order.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: a finished request's answer: ("json", dict) or ("proto", bytes)
Payload = tuple[str, Any]
#: how the worker turns an exception into (category, message, every pending request fails too)
Classifier = Callable[[BaseException], tuple[str, str, bool]]
#: runs (verb, args) calls in one trip to the ranks: each call's answer, or the exception it raised
Batcher = Callable[[list[tuple[str, tuple[Any, ...]]]], Sequence[Any]]

_KEEP_S = 600.0  # a finished future is kept this long for the client to fetch (and fetch again)
#: the most requests of one model run in one trip (a forward_backward split in chunks, then its step)
MAX_BATCH = 8


@dataclass
class Step:
    """A training verb: `call(verb, *args)` on the ranks, then `finish(answer)` in the kernel (its
    run's tracking, the wire encoding). Run alone it is exactly that; the worker may instead run the
    verbs of several queued Steps of one model in one trip and finish each with its own answer."""

    call: Callable[..., Any]
    verb: str
    args: tuple[Any, ...]
    finish: Callable[[Any], Payload]

    def __call__(self) -> Payload:
        return self.finish(self.call(self.verb, *self.args))


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

    def __init__(
        self,
        classify: Classifier,
        batch: Batcher | None = None,
        name: str = "nbtrain-tinker-worker",
    ):
        self._classify = classify
        #: one trip for a model's queued Steps (None: every request runs alone)
        self.batch = batch
        #: model id -> [trips that ran several requests, requests they ran]
        self.batched: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._futures: dict[str, Future] = {}
        self._models: dict[str, _Model] = {}
        self._queue: deque[tuple[Future, Callable[[], Payload]] | None] = deque()
        self._ready = threading.Condition()
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
            self.batched.pop(model_id, None)

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
                self._put((fut, fn))
                return fut
            model.seen[seq_id] = fut.request_id
            if seq_id < model.next_seq:
                # an id the model already passed and that this server never saw: a client that
                # restarted its numbering. Run it now rather than hold it for ever.
                self._put((fut, fn))
                return fut
            model.held[seq_id] = (fut, fn)
            self._release(model)
            return fut

    def _put(self, item: tuple[Future, Callable[[], Payload]] | None) -> None:
        with self._ready:
            self._queue.append(item)
            self._ready.notify()

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
                self._put(item)
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
    def _take(self) -> list[tuple[Future, Callable[[], Payload]]] | None:
        """The next request, with the Steps of its model queued right behind it where it is a Step
        (and a batch can run); None to stop."""
        with self._ready:
            while not self._queue:
                self._ready.wait()
            first = self._queue.popleft()
            if first is None:
                return None
            items = [first]
            if self.batch is None or not isinstance(first[1], Step):
                return items
            while self._queue and len(items) < MAX_BATCH:
                nxt = self._queue[0]
                if nxt is None or not isinstance(nxt[1], Step):
                    break
                if nxt[0].model_id != first[0].model_id:
                    break
                items.append(nxt)
                self._queue.popleft()
            return items

    def _work(self) -> None:
        while True:
            items = self._take()
            if items is None:
                return
            items = [(fut, fn) for fut, fn in items if not fut.finished()]  # failed while waiting
            if len(items) > 1:
                self._run_batch(items)
            elif items:
                fut, fn = items[0]
                self._answer(fut, fn)

    def _answer(self, fut: Future, fn: Callable[[], Payload]) -> None:
        try:
            payload = fn()
        except BaseException as e:  # noqa: BLE001 - every failure becomes the future's error
            self._fail(fut, e)
            return
        fut.resolve(payload)

    def _fail(self, fut: Future, error: BaseException) -> None:
        category, message, fatal = self._classify(error)
        fut.resolve(("json", {"error": message, "category": category}))
        if fatal:
            self.broken = message
            self.fail_all(message)

    def _run_batch(self, items: list[tuple[Future, Callable[[], Payload]]]) -> None:
        """Steps of one model in one trip; each future then gets what it would have got alone, in
        order (a failed verb fails only its own future)."""
        steps = [fn for _, fn in items if isinstance(fn, Step)]
        assert self.batch is not None and len(steps) == len(items)
        try:
            answers = self.batch([(s.verb, s.args) for s in steps])
        except BaseException as e:  # noqa: BLE001 - the trip failed: every request in it failed
            for fut, _ in items:
                if not fut.finished():
                    self._fail(fut, e)
            return
        counts = self.batched.setdefault(items[0][0].model_id or "", [0, 0])
        counts[0] += 1
        counts[1] += len(items)
        for (fut, _), step, answer in zip(items, steps, answers):
            if fut.finished():
                continue  # a fatal failure before it failed it already
            if isinstance(answer, BaseException):
                self._fail(fut, answer)
            else:
                self._answer(fut, functools.partial(step.finish, answer))

    def stop(self) -> None:
        self._put(None)
        self._thread.join(timeout=5)
