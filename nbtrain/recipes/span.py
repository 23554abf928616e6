"""Where a run starts and ends: its length in optimizer steps, where in its data it starts, and its
learning-rate schedule, for a new run and for one resumed on any world size or batch.

A run asked for N epochs ends after N epochs of its data, whatever the world size it resumes on: the
checkpoint records the units (rows, or max_length blocks with packing) consumed, and the resumed run
goes on from there at its own steps per epoch (HF's Trainer would go on from the step number instead,
and so train another world size's part of an epoch again, or skip it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Span:
    """A run's steps, in optimizer steps and in the data.

    A data step is the step index `ShardedBatches.micro_batch` takes: data step = optimizer step +
    `shift`. A run resumed on another world size or batch continues from the units its checkpoint had
    consumed, not from its step number, so its data steps are not its optimizer steps.
    """

    total: int  #: the optimizer step the run ends at
    shift: int = 0  #: data step minus optimizer step
    #: units of the first resumed step's epoch that the checkpoint's run had already taken, where they
    #: end inside that step's global batch (the batches of two world sizes need not line up); else 0
    skip: int = 0
    schedule_length: int = 0  #: the learning-rate schedule's length, in its own steps
    schedule_start: int = 0  #: where the schedule is at the run's first step


def run_span(
    cfg: Any,
    spe: int,
    n_units: int,
    step_units: int,
    resumed: dict[str, Any] | None,
    resume_from: str | None,
) -> Span:
    """The run's span: `spe`, `n_units` and `step_units` are this run's steps per epoch, units per
    epoch and units per global step; `resumed` the checkpoint (None for a new run).

    A max_steps run ends at max_steps, resumed or not. A num_train_epochs run ends when it has gone
    num_train_epochs times through its data: a resumed one is recomputed from the data position its
    checkpoint recorded (rows_consumed), so on another world size or batch, where an epoch is another
    number of steps, it still ends at the epochs asked for. A ConfigError when the checkpoint is
    already at or past the run's end: such a run would report done without training.
    """
    epochs_total = max(1, math.ceil(cfg.num_train_epochs * spe))
    new_total = cfg.max_steps if cfg.max_steps > 0 else epochs_total
    if resumed is None:
        return Span(new_total, schedule_length=new_total)
    state = resumed["state"]
    step = int(state["global_step"])
    consumed = (state.get("data_position") or {}).get("rows_consumed")
    if consumed is None:
        data_start, skip = step, 0  # a checkpoint without a data position goes on by step
    else:
        epoch, in_epoch = divmod(int(consumed), n_units)
        data_start = epoch * spe + in_epoch // step_units
        skip = in_epoch if in_epoch % step_units else 0
    shift = data_start - step
    if cfg.max_steps > 0:
        span = Span(cfg.max_steps, shift, skip, cfg.max_steps, step)
        why = f"max_steps={cfg.max_steps}"
    else:
        # the schedule runs on data steps, to the end of the last epoch: its length and position are
        # this run's (epochs_total, data_start), so the rate goes on from the fraction of the data
        # already trained and reaches the schedule's end at the run's last step, whatever the world
        # size before (rounded down to this run's step, where the checkpoint ended inside one). On
        # the same world size and batch the data steps are the optimizer steps, and a resumed run is
        # the uninterrupted one.
        span = Span(step + epochs_total - data_start, shift, skip, epochs_total, data_start)
        why = (
            f"num_train_epochs={cfg.num_train_epochs}, {data_start / spe:g} of them done, at {spe} "
            "steps per epoch"
        )
    if step >= span.total:
        more = (
            f"pass max_steps larger than {step}"
            if cfg.max_steps > 0
            else "raise num_train_epochs (or pass max_steps)"
        )
        msg = (
            f"nothing to train: checkpoint {resume_from} is at step {step} and the run is "
            f"{span.total} steps long ({why}); {more} to train further, or drop resume to start a "
            "new run"
        )
        raise ConfigError(msg)
    return span


def drop_taken(examples: list[Any], first: int, stride: int, skip: int) -> list[Any]:
    """The examples of a micro-batch whose units are at or past `skip` in their epoch, the i-th being
    unit `first + stride * i` (rank r's micro-batch k of N ranks with batch B: first = N*k*B + r,
    stride = N, ShardedBatches' layout)."""
    return [e for i, e in enumerate(examples) if first + stride * i >= skip]
