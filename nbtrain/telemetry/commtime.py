"""Time spent waiting in the gradient all-reduce, measured inside DDP; and one size of a scaling run.

`%nbtrain scaling` runs the same short `finetune` on the ranks of the first k nodes. To split each
step into compute and all-reduce, a DDP communication hook (the default all-reduce, unchanged) notes
when each gradient bucket is handed to the all-reduce and when that all-reduce completes. DDP hands a
bucket over as soon as its gradients are computed, and the step cannot go on until every bucket's
all-reduce is done, so

    waiting in the all-reduce = (last completion) - (hand-over of the last bucket)

is the time the step spends after the backward pass's compute, waiting for communication: the part
of the all-reduce that did not overlap with compute. (LoRA's gradients usually fit one bucket, and
then it is the whole all-reduce.) On the CPU the times are the host clock at hand-over and in the
completion callback (gloo completes the future when the work is done); on a GPU they are CUDA events
on the streams, read at the end of the run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

_ACTIVE: list[CommTimer] = []


class CommTimer:
    """Records each gradient bucket's all-reduce: hand-over and completion, grouped by step."""

    def __init__(self) -> None:
        self.events: list[list[Any]] = []  # [handed over, completed, is the step's last bucket]
        self.grad_bytes = 0
        self.cuda = False

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def on_bucket(self, state: Any, bucket: Any) -> Any:
        """The default all-reduce of one bucket, its hand-over and completion noted."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        rec = [self._now(), None, bucket.is_last()]
        self.events.append(rec)
        fut = default_hooks.allreduce_hook(state, bucket)

        def done(f: Any) -> Any:
            rec[1] = self._now()
            return f.value()

        return fut.then(done)

    def steps(self) -> list[dict[str, float]]:
        """Per step: seconds waiting after the last hand-over, and from first hand-over to last completion."""
        out: list[dict[str, float]] = []
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        cur: list[list[Any]] = []
        for rec in self.events:
            cur.append(rec)
            if not rec[2]:
                continue
            if all(r[1] is not None for r in cur):
                out.append(
                    {
                        "wait_s": max(self._gap(rec[0], r[1]) for r in cur),
                        "span_s": max(self._gap(cur[0][0], r[1]) for r in cur),
                        "buckets": float(len(cur)),
                    }
                )
            cur = []
        return out

    def _gap(self, a: Any, b: Any) -> float:
        if self.cuda:
            return float(a.elapsed_time(b)) / 1e3
        return max(float(b - a), 0.0)


def attach(model: Any, group: Any, trainable: Sequence[Any]) -> None:
    """Time `model`'s (a DDP module's) gradient all-reduces, when a scaling run asked for it; else nothing."""
    if not _ACTIVE:
        return
    timer = _ACTIVE[-1]
    timer.grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    timer.cuda = next(iter(trainable)).device.type == "cuda" if trainable else False

    # DDP checks a hook's annotations against its own types: this one has none
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        return timer.on_bucket(state, bucket)

    model.register_comm_hook(state=group, hook=hook)


@contextlib.contextmanager
def timing() -> Iterator[CommTimer]:
    """Time the gradient all-reduces of the `finetune` run inside the block (on this rank)."""
    timer = CommTimer()
    _ACTIVE.append(timer)
    try:
        yield timer
    finally:
        _ACTIVE.remove(timer)
