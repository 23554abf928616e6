"""`batch`: several training verbs of the Tinker service in one call on every rank (one trip from the
kernel), each run as it would run alone, each with its own answer or its own error.

In [1]: service.batch([("forward_backward", ("m1", datums, "cross_entropy", None, False)),
   ...:                ("optim_step", ("m1", {"learning_rate": 1e-4}))])
Out[1]: [{"value": {"outputs": [...], "metrics": {...}}}, {"value": {"grad_norm:mean": ...}}]

A verb that fails leaves the next ones to run as they would have after it (a failed forward_backward
adds no gradient; the optim_step behind it steps on what there is). Every rank runs the same calls in
the same order, so the verbs' collectives still meet.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from nbtrain.errors import ConfigError, NbtrainError

log = logging.getLogger(__name__)

#: the verbs a batch may hold: the training verbs, which an SDK loop queues back to back
BATCHABLE = ("forward_backward", "optim_step")


def batch(calls: list[tuple[str, tuple[Any, ...]]], raw: bool = False) -> list[dict[str, Any]]:
    """Run `calls` ((verb, args) each) in order; one outcome per call: {"value": its answer}, or
    {"error": {"ename", "evalue", "traceback"}, "rank", "host"} (with "exception", the exception
    itself, where `raw`: a caller in this process)."""
    from nbtrain.tinker.ranks import registry, train

    verbs: dict[str, Callable[..., Any]] = {
        "forward_backward": train.forward_backward,
        "optim_step": train.optim_step,
    }
    unknown = [verb for verb, _ in calls if verb not in verbs]
    if unknown:
        msg = f"batch runs only {', '.join(BATCHABLE)}, not {', '.join(unknown)}"
        raise ConfigError(msg)
    d = registry.dist()
    out: list[dict[str, Any]] = []
    for verb, args in calls:
        try:
            out.append({"value": verbs[verb](*args)})
        except Exception as e:  # noqa: BLE001 - that verb's own error; the next ones still run
            # nbtrain's own errors say all in their message; others keep where they came from
            tb = (
                "" if isinstance(e, NbtrainError) else "".join(traceback.format_tb(e.__traceback__))
            )
            error = {"ename": type(e).__name__, "evalue": str(e), "traceback": tb}
            outcome: dict[str, Any] = {"error": error, "rank": d.rank, "host": d.host}
            if raw:
                outcome["exception"] = e
            out.append(outcome)
    return out
