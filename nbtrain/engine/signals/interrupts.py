"""Interrupts every rank honours at the same point: a loop's ranks stop together, none left in a collective.

Interrupting the kernel sends SIGINT to every rank, but not at the same instant: under load one rank
can raise KeyboardInterrupt in its own code while its peer already waits for it in an all-reduce, which
a gloo or NCCL collective never gives up, so that peer had to be replaced and lost its variables.
While a loop that meets in collectives runs (`finetune`'s steps, DPO's, GRPO's, `generate`'s batches),
`Held` only records the SIGINT; the loop adds `flag()` to the small collective it makes anyway, and
every rank sees the same sum and raises `KeyboardInterrupt` at the same step (`stop_if_any`).

A second SIGINT while the first is held raises at once: the way out of a loop that never reaches its
check. The client's stack request reads `held_for()`, so it waits for such a rank, which answers,
instead of replacing it.

In [1]: with Held() as held:
   ...:     for step in range(n):
   ...:         flags = sum_across_ranks(held.flag())   # the step's own collective
   ...:         stop_if_any(flags, f"step {step}")
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# the Held blocks entered on this engine's main thread, innermost last
_ACTIVE: list[Held] = []


class Held:
    """Record SIGINT for the length of a `with` block (main thread only; elsewhere a no-op)."""

    def __init__(self) -> None:
        self.since: float | None = None  #: time.monotonic() of the held SIGINT, None before one
        self._old: Any = None
        self._installed = False

    @property
    def pending(self) -> bool:
        return self.since is not None

    def flag(self) -> float:
        """1.0 once a SIGINT is held, else 0.0: this rank's share of the step's collective."""
        return 1.0 if self.pending else 0.0

    def _handler(self, signum: int, frame: Any) -> None:
        if self.pending:
            # a second interrupt: the loop did not reach its check in time; leave now
            raise KeyboardInterrupt
        self.since = time.monotonic()

    def __enter__(self) -> Held:
        if threading.current_thread() is threading.main_thread():
            # nested in another (finetune's set-up, then its loop; samples inside a step): one
            # interrupt, whichever block holds it when it comes
            if _ACTIVE and _ACTIVE[-1].pending:
                self.since = _ACTIVE[-1].since
            self._old = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._installed:
            return
        self._installed = False
        signal.signal(
            signal.SIGINT, self._old if self._old is not None else signal.default_int_handler
        )
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if _ACTIVE and self.pending and not _ACTIVE[-1].pending:
            _ACTIVE[-1].since = self.since


def held(fn: F) -> F:
    """`fn` runs in a `Held` block: an interrupt while it sets up (loads a model, meets its peers)
    waits for the loop inside it to check."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with Held():
            return fn(*args, **kwargs)

    return cast(F, wrapper)


def stop_if_any(flags: Iterable[float], where: str) -> None:
    """Raise KeyboardInterrupt where any rank's flag in the summed `flags` is set (the same on every rank)."""
    if any(float(f) > 0 for f in flags):
        msg = f"interrupted: every rank stopped together at {where}"
        raise KeyboardInterrupt(msg)


def held_for() -> float | None:
    """How long this engine has held a SIGINT (its loop has not reached its check yet); None: none held.

    Read by the control channel's stack request, on its own thread."""
    for held in list(_ACTIVE):
        if held.since is not None:
            return time.monotonic() - held.since
    return None
