"""The training loop every recipe shares, around the step the recipe passes in: the signals held while
steps run, the live display and meter, the stop and preemption at a step's boundary, and after each
step the hooks, the eval, the log row and the checkpoint it is due.

In [1]: loop.train(recipe, recipe.train_step)    # what a recipe's `train()` is

The step is the recipe's own (`SFTRecipe.train_step`, `DPORecipe.train_step`, `GRPORecipe.train_step`):
it returns False where the run stops before it (a stop request or a preemption), and calls the shared
parts it needs: `step_stats` (the step's one small collective with the stop and preemption flags, for
recipes whose step is micro-batches of rows), `synced`, `optimizer_step`, then `after_step`.

`nbtrain.Run` (`nbtrain.recipes.steppable`) runs the same loop a span at a time: `hold`, `begin` once,
`advance(until)` per span, `finish`, `release`. The loop calls the recipe's `log(row)`,
`eval_metrics()` and `save_checkpoint(step)` (the contract of `nbtrain.recipes.base.Recipe`), and every
hook gets the recipe (`nbtrain.recipes.hooks`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from nbtrain.engine import metrics as live
from nbtrain.engine.signals import interrupts
from nbtrain.engine.signals.preempt import Preempted, Preemption
from nbtrain.engine.signals.preempt import message as preempt_message
from nbtrain.model import shard, targets
from nbtrain.recipes.span import drop_taken
from nbtrain.runs import loss_unit, run_id_for
from nbtrain.telemetry.report import Meter, flops_per_token, peak_flops

log = logging.getLogger(__name__)

#: a recipe's step: one optimizer step with its log row and checkpoint; False where the run stops first
Step = Callable[[], bool]


def train(r: Any, step: Step) -> None:
    """Train from the start (or resumed) step to the span's end with `step`, evaluating, logging and
    saving as asked; export the adapter; stop early, with a checkpoint, on a stop request or a
    preemption. `r.cleanup()` however it ends."""
    hold(r)
    try:
        begin(r)
        finish(r, stopped=not advance(r, r.total_steps, step))
    finally:
        r.cleanup()


def begin(r: Any) -> None:
    """Once, before the first step: the live display, the meter, train mode and the on_begin hooks."""
    import torch

    d = r.d
    live.begin(
        total_steps=r.total_steps,
        name=r.name,
        kind=r.kind,
        loss_unit=loss_unit(r.kind),
        run_id=run_id_for(r.out),
    )
    r.state = "failed"
    r.step = r.start_step
    r.last_saved = r.start_step if r.resumed else -1
    if d.device.type == "cuda":
        # the peak of this run's training, not of the set-up's probes or an earlier cell's work
        torch.cuda.reset_peak_memory_stats(d.device)
    # LoRA training FLOPs, a 4-bit base counted at its logical shape, not its packed storage
    # and on an MoE only the experts a token is routed to
    routed, share = targets.routed_experts(r.peft_model)
    token_flops = flops_per_token(r.peft_model, unrouted=routed - round(routed * share))
    peak = peak_flops(d.device) if r.compute_dtype is not None else None
    r.meter = Meter(
        d, r.spe, token_flops, peak, step_shift=r.span.shift, aux=r.router_aux is not None
    )
    r.model.train()
    r.grad_norm = None
    log.debug("%s run %s begins at step %d of %d", r.kind, r.name, r.step, r.total_steps)
    r.hooks.call("on_begin", r, step=r.step)


def hold(r: Any) -> None:
    """While steps run: SIGTERM/SIGUSR1 (a preemption) and SIGINT (an interrupt) are only recorded,
    and the step's collective tells every rank, so that no rank leaves a collective its peers are in."""
    r.preemption = Preemption().__enter__()
    r.held = interrupts.Held().__enter__()


def release(r: Any) -> None:
    """Put back the signal handlers `hold` replaced (twice is harmless)."""
    r.preemption.__exit__()
    r.held.__exit__()


def advance(r: Any, until: int, step: Step) -> bool:
    """Optimizer steps of `step` up to step `until` (at most the run's last); False where the run
    stopped early instead (a stop request or a preemption: `stop` wrote the checkpoint, or raised)."""
    r.state = "failed"  # until the span ends well
    while r.step < min(until, r.total_steps):
        if not step():
            stop(r)
            return False
    return True


def finish(r: Any, stopped: bool = False) -> None:
    """The run's end: the export, every rank together, and the state it ended in."""
    r.export()
    r.d.barrier()
    r.state = "stopped" if stopped else "done"


def cleanup(r: Any) -> None:
    """Put back the signal handlers, close the live display, and record how the run ended."""
    release(r)
    live.end(r.state)
    if r.runlog is not None:
        # a preempted run's record says where to resume from
        ended = {"step": r.step, "checkpoint": r.checkpoint} if r.checkpoint else {}
        r.runlog.finish(r.state, **ended)


# ---- the parts a step calls


def micro_batch(r: Any, step: int, a: int) -> list[Any]:
    """This rank's examples of micro-batch `a` of optimizer step `step`."""
    span, plan, d = r.span, r.plan, r.d
    exs = r.batches.micro_batch(step + span.shift, a)
    if step != r.start_step or not span.skip:
        return exs
    # the first step of a run resumed on another world size or batch, whose checkpoint ended
    # inside this step's global batch: the units before `skip` were trained already
    k = ((step + span.shift) % r.spe) * plan.grad_accum + a
    return drop_taken(exs, d.world * k * plan.micro_batch + d.rank, d.world, span.skip)


def step_stats(
    r: Any, micro: list[list[Any]], micro_stats: Callable[[list[Any]], tuple[float, int, int]]
) -> Any:
    """Every rank's `micro_stats` of each micro-batch (what the loss is normalised by, the longest
    row, tokens) and the stop and preemption flags, summed in one collective: [world, 2*GA+4]
    (normaliser per micro-batch, longest row per micro-batch, tokens, stop, signal, interrupt); None
    where the run stops before this step. An interrupt on any rank raises KeyboardInterrupt on every
    rank here, at the same step."""
    import torch

    d, GA = r.d, r.plan.grad_accum
    stats = torch.zeros((d.world, 2 * GA + 4), dtype=torch.float64)
    for a, exs in enumerate(micro):
        norm, longest, n_tokens = micro_stats(exs)
        stats[d.rank, a] = norm
        stats[d.rank, GA + a] = longest
        stats[d.rank, 2 * GA] += n_tokens
    if r.runlog is not None:
        stats[0, 2 * GA + 1] = float(r.runlog.stop_requested())
    stats[d.rank, 2 * GA + 2] = float(r.preemption.signum)
    stats[d.rank, 2 * GA + 3] = r.held.flag()
    stats = d.sum_meta(stats)
    if stats[:, 2 * GA + 3].any():
        r.state = "stopped"
        interrupts.stop_if_any(stats[:, 2 * GA + 3], f"step {r.step}/{r.total_steps}")
    signalled = [k for k in range(d.world) if stats[k, 2 * GA + 2] > 0]
    if signalled:
        r.preempted = (signalled[0], int(stats[signalled[0], 2 * GA + 2]))
    if stats[0, 2 * GA + 1] > 0 or r.preempted:
        return None
    return stats


def synced(r: Any, a: int) -> Any:
    """The context micro-batch `a`'s backward runs in: gradients are all-reduced once per step,
    on the last micro-batch (DDP's no_sync before it; FSDP's own switch)."""
    sync = a == r.plan.grad_accum - 1 or not r.d.active
    if r.sharded:
        shard.set_gradient_sync(r.model, sync)
    return contextlib.nullcontext() if sync or r.sharded else r.model.no_sync()


def optimizer_step(r: Any) -> float:
    """Clip, step the optimizer and the schedule; returns the learning rate the step used."""
    r.grad_norm = shard.clip_grad_norm(r.trainable, r.clip)
    lr: float = r.scheduler.get_last_lr()[0]
    r.optimizer.step()
    r.scheduler.step()
    r.optimizer.zero_grad(set_to_none=True)
    r.step += 1
    r.meter.steps += 1
    return lr


def after_step(r: Any, lr: float) -> None:
    """The on_step hooks, then the eval (`r.eval_metrics()`), the log row (`r.log`) and the
    checkpoint (`r.save_checkpoint`) the step is due."""
    step, meter = r.step, r.meter
    r.hooks.call("on_step", r, step=step, grad_norm=r.grad_norm, lr=lr)
    evaluated: dict[str, float] = {}
    if r.evals is not None and (
        (r.eval_steps is not None and step % r.eval_steps == 0) or step == r.total_steps
    ):
        t0 = time.perf_counter()
        evaluated = r.eval_metrics()
        meter.exclude(time.perf_counter() - t0)
        r.hooks.call("on_eval", r, step=step, eval_loss=evaluated["eval_loss"])
    if step % r.logging_steps == 0 or step == r.total_steps or evaluated:
        row = meter.row(step, r.grad_norm, lr, evaluated.get("eval_loss"))
        r.log({**row, **evaluated})
    # and at the last step, as HF's Trainer does, so resume='latest' always has the run's end
    if r.save_steps is not None and (step % r.save_steps == 0 or step == r.total_steps):
        t0 = time.perf_counter()
        r.save_checkpoint(step)
        meter.exclude(time.perf_counter() - t0)


def record(r: Any, row: dict[str, Any]) -> None:
    """One row into the history, the live display, rank 0's run record; then the on_log hooks: the
    end of every recipe's `log`."""
    r.history.append(row)
    live.log(**row)
    if r.runlog is not None:
        r.runlog.row(row)
    r.hooks.call("on_log", r, row=row)


def stop(r: Any) -> None:
    """A stop request or a preemption: the row so far, a checkpoint for the step reached; raise
    `Preempted` on every rank for a preemption."""
    d = r.d
    if r.meter.steps:
        r.log(r.meter.row(r.step, r.grad_norm, r.scheduler.get_last_lr()[0], None))
    if r.last_saved != r.step:
        r.save_checkpoint(r.step)
    if r.preempted:
        hosts = d.gather_objects(d.host)
        r.state = "preempted"
        k, signum = r.preempted
        where = r.checkpoint = str(r.out / f"checkpoint-{r.step}")
        config = type(r.cfg).__name__
        raise Preempted(preempt_message(r.step, r.total_steps, k, hosts[k], signum, where, config))
    if d.is_zero:
        print(f"nbtrain: stopped at step {r.step}/{r.total_steps} on request; checkpoint saved")
