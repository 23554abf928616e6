"""The SFT recipe: one object per run, with a phase for each job, as torchtune's distributed LoRA recipe.

In [1]: recipe = SFTRecipe(cfg)      # reads cfg, once
In [2]: recipe.setup()               # rows, model, LoRA or QLoRA, sharding, optimizer, schedule, resume
In [3]: recipe.train()               # the loop (step, eval, log), checkpoints, the export; then cleanup()
In [4]: recipe.result()              # the TrainResult `finetune` returns

`nbtrain.finetune(cfg)` is `SFTRecipe(cfg).run()`. The loop follows nanoGPT's train.py: one global batch
per optimizer step, gradients summed across ranks by DDP, the loss normalised by the number of target
tokens in the whole global batch, so N ranks with batch B train exactly like 1 rank with batch N*B.
Features that need the loop add a hook (`nbtrain.recipes.hooks`: on_begin, on_step, on_eval, on_log,
on_save), as the samples taken while training do (`nbtrain.generation.sampling`).

Phases, and what each may touch: `setup` (`nbtrain.recipes.run_setup`, which any training recipe can share)
finds everything that can be wrong on every rank before any write, and only then opens output_dir on
rank 0; `train` runs the steps; `save_checkpoint` and `export` write; `cleanup` puts back what the run
changed (signal handlers, the live display, the run record).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.engine import metrics as live
from nbtrain.engine.signals import interrupts
from nbtrain.engine.signals.preempt import Preempted, Preemption
from nbtrain.engine.signals.preempt import message as preempt_message
from nbtrain.generation.sampling import Sampler
from nbtrain.model import checkpoint as ckpt
from nbtrain.model import shard
from nbtrain.recipes import step as one_step
from nbtrain.recipes.hooks import Hooks
from nbtrain.recipes.run_setup import RunSetup
from nbtrain.recipes.span import drop_taken
from nbtrain.runs import loss_unit, run_id_for
from nbtrain.telemetry.report import Meter, flops_per_token, peak_flops


@dataclass
class TrainResult:
    """What `finetune` returns on every rank."""

    history: Any  #: pandas DataFrame, one row per logged step
    adapter_dir: str | None  #: the exported adapter folder on rank 0; None on other ranks
    output_dir: str
    merged_dir: str | None = None  #: the merged model folder (merge=True, rank 0)
    metrics: dict[str, Any] = field(default_factory=dict)  #: the last logged row
    global_step: int = 0
    #: "done" or "stopped" (a stop request from the runs sidebar); "paused" between `nbtrain.Run` spans
    state: str = "done"
    run_id: str | None = None
    #: how the run was set up: micro-batch, accumulation steps, global batch, loss and kernels used
    plan: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        loss = self.metrics.get("loss")
        loss_s = f", loss={loss:.4f}" if isinstance(loss, float) else ""
        return (
            f"TrainResult(state={self.state!r}, global_step={self.global_step}{loss_s}, "
            f"adapter_dir={self.adapter_dir!r}, rows={len(self.history)})"
        )


class SFTRecipe(RunSetup):
    """One LoRA/QLoRA SFT run on this rank: `setup()` (`RunSetup`), `train()`, `result()` (or `run()`).

    `group` trains on a sub-group of the running process group (its ranks are the run's ranks 0..n-1);
    `hooks` are called at the loop's named places (`nbtrain.recipes.hooks.Hooks`).
    """

    def __init__(
        self, cfg: SFTConfig, merge: bool = False, group: Any = None, hooks: Hooks | None = None
    ) -> None:
        super().__init__(cfg, group)
        self.merge = merge
        # the caller's hooks and the run's own (samples while training) in a copy of its object
        self.hooks = hooks.copy() if hooks is not None else Hooks()
        if cfg.sample_prompts is not None:
            Sampler(cfg).attach(self.hooks)
        # what the loop and the saves fill in
        self.step = 0
        self.state = "failed"
        #: (the rank that got the signal, the signal) once a preemption reached the step's collective
        self.preempted: tuple[int, int] | None = None
        self.adapter_dir: str | None = None
        self.merged_dir: str | None = None
        #: the checkpoint a preemption wrote, to resume from
        self.checkpoint: str | None = None

    def run(self) -> TrainResult:
        """Set up, train, and return the result: what `finetune` does."""
        # an interrupt during set-up (whose ranks meet in collectives too) is held to the first step
        with interrupts.Held():
            self.setup()
            self.train()
        return self.result()

    # ---- train phase: the loop, with its step and eval

    def train(self) -> None:
        """Train from the start (or resumed) step to the span's end, evaluating, logging and saving as
        asked; export the adapter; stop early, with a checkpoint, on a stop request or a preemption."""
        self.hold()
        try:
            self.begin()
            self.finish(stopped=not self.advance(self.total_steps))
        finally:
            self.cleanup()

    # the loop in parts, so that `nbtrain.Run` (`nbtrain.recipes.steppable`) can run it a span at a time

    def begin(self) -> None:
        """Once, before the first step: the live display, the meter, train mode and the on_begin hooks."""
        import torch

        d = self.d
        live.begin(
            total_steps=self.total_steps,
            name=self.name,
            kind=self.kind,
            loss_unit=loss_unit(self.kind),
            run_id=run_id_for(self.out),
        )
        self.state = "failed"
        self.step = self.start_step
        self.last_saved = self.start_step if self.resumed else -1
        if d.device.type == "cuda":
            # the peak of this run's training, not of the set-up's probes or an earlier cell's work
            torch.cuda.reset_peak_memory_stats(d.device)
        # LoRA training FLOPs, a 4-bit base counted at its logical shape, not its packed storage
        token_flops = flops_per_token(self.peft_model)
        peak = peak_flops(d.device) if self.compute_dtype is not None else None
        self.meter = Meter(d, self.spe, token_flops, peak, step_shift=self.span.shift)
        self.model.train()
        self.grad_norm = None
        self.hooks.call("on_begin", self, step=self.step)

    def hold(self) -> None:
        """While steps run: SIGTERM/SIGUSR1 (a preemption) and SIGINT (an interrupt) are only recorded,
        and the step's collective tells every rank, so that no rank leaves a collective its peers are in."""
        self.preemption = Preemption().__enter__()
        self.held = interrupts.Held().__enter__()

    def release(self) -> None:
        """Put back the signal handlers `hold` replaced (twice is harmless)."""
        self.preemption.__exit__()
        self.held.__exit__()

    def advance(self, until: int) -> bool:
        """Optimizer steps up to step `until` (at most the run's last); False where the run stopped
        early instead (a stop request or a preemption: `_stop` wrote the checkpoint, or raised)."""
        self.state = "failed"  # until the span ends well
        while self.step < min(until, self.total_steps):
            if not self.train_step():
                self._stop()
                return False
        return True

    def finish(self, stopped: bool = False) -> None:
        """The run's end: the export, every rank together, and the state it ended in."""
        self.export()
        self.d.barrier()
        self.state = "stopped" if stopped else "done"

    def train_step(self) -> bool:
        """One optimizer step, its eval, log row and checkpoint; False where the run stops before the
        step instead (a stop request, or a preemption: then `preempted` is (rank, signal)).

        The phases a preference recipe shares: `step_stats` (the step's one small collective, with the
        stop and preemption flags), `accumulate` (the micro-batches' forward and backward: what a
        recipe's own step changes), `optimizer_step`, then `after_step` (hooks, eval, log, save)."""
        micro = [self.micro_batch(self.step, a) for a in range(self.plan.grad_accum)]
        stats = self.step_stats(micro)
        if stats is None:
            return False
        self.accumulate(micro, stats)
        lr = self.optimizer_step()
        self.meter.tokens += float(stats[:, 2 * self.plan.grad_accum].sum())
        self.after_step(lr)
        return True

    def micro_stats(self, exs: list[Any]) -> tuple[float, int, int]:
        """(what the loss is normalised by, the longest row, tokens) of one micro-batch on this rank:
        SFT's target tokens."""
        return (
            sum(e.n_targets for e in exs),
            max((len(e.input_ids) for e in exs), default=1),
            sum(len(e.input_ids) for e in exs),
        )

    def step_stats(self, micro: list[list[Any]]) -> Any:
        """Every rank's `micro_stats` and the stop and preemption flags, summed in one collective:
        [world, 2*GA+4] (normaliser per micro-batch, longest row per micro-batch, tokens, stop,
        signal, interrupt); None where the run stops before this step. An interrupt on any rank
        raises KeyboardInterrupt on every rank here, at the same step."""
        import torch

        d, GA = self.d, self.plan.grad_accum
        stats = torch.zeros((d.world, 2 * GA + 4), dtype=torch.float64)
        for a, exs in enumerate(micro):
            norm, longest, n_tokens = self.micro_stats(exs)
            stats[d.rank, a] = norm
            stats[d.rank, GA + a] = longest
            stats[d.rank, 2 * GA] += n_tokens
        if self.runlog is not None:
            stats[0, 2 * GA + 1] = float(self.runlog.stop_requested())
        stats[d.rank, 2 * GA + 2] = float(self.preemption.signum)
        stats[d.rank, 2 * GA + 3] = self.held.flag()
        stats = d.sum_meta(stats)
        if stats[:, 2 * GA + 3].any():
            self.state = "stopped"
            interrupts.stop_if_any(stats[:, 2 * GA + 3], f"step {self.step}/{self.total_steps}")
        signalled = [r for r in range(d.world) if stats[r, 2 * GA + 2] > 0]
        if signalled:
            self.preempted = (signalled[0], int(stats[signalled[0], 2 * GA + 2]))
        if stats[0, 2 * GA + 1] > 0 or self.preempted:
            return None
        return stats

    def synced(self, a: int) -> Any:
        """The context micro-batch `a`'s backward runs in: gradients are all-reduced once per step,
        on the last micro-batch (DDP's no_sync before it; FSDP's own switch)."""
        sync = a == self.plan.grad_accum - 1 or not self.d.active
        if self.sharded:
            shard.set_gradient_sync(self.model, sync)
        return contextlib.nullcontext() if sync or self.sharded else self.model.no_sync()

    def accumulate(self, micro: list[list[Any]], stats: Any) -> None:
        """SFT's forward and backward over the step's micro-batches: the token loss, normalised by the
        target tokens of the whole global batch."""
        d, GA = self.d, self.plan.grad_accum
        n_targets = max(float(stats[:, :GA].sum()), 1.0)
        for a, exs in enumerate(micro):
            # pad to the longest row across ranks: the same shapes as one rank with the whole batch
            batch = self.batches.collate(exs, int(stats[:, GA + a].max()))
            batch = one_step.to_device(batch, d.device)
            with self.synced(a):
                batch_loss = self.loss_sum(self.model, batch)
                # DDP averages gradients over ranks; scaling by world turns that into the global sum
                (batch_loss * (d.world / n_targets)).backward()
            self.meter.loss += batch_loss.detach().double() / n_targets

    def optimizer_step(self) -> float:
        """Clip, step the optimizer and the schedule; returns the learning rate the step used."""
        self.grad_norm = shard.clip_grad_norm(self.trainable, self.clip)
        lr: float = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.meter.steps += 1
        return lr

    def after_step(self, lr: float) -> None:
        """The on_step hooks, then the eval, the log row and the checkpoint the step is due."""
        step, meter = self.step, self.meter
        self.hooks.call("on_step", self, step=step, grad_norm=self.grad_norm, lr=lr)
        evaluated: dict[str, float] = {}
        if self.evals is not None and (
            (self.eval_steps is not None and step % self.eval_steps == 0)
            or step == self.total_steps
        ):
            t0 = time.perf_counter()
            evaluated = self.eval_metrics()
            meter.exclude(time.perf_counter() - t0)
            self.hooks.call("on_eval", self, step=step, eval_loss=evaluated["eval_loss"])
        if step % self.logging_steps == 0 or step == self.total_steps or evaluated:
            row = meter.row(step, self.grad_norm, lr, evaluated.get("eval_loss"))
            self.log({**row, **evaluated})
        # and at the last step, as HF's Trainer does, so resume='latest' always has the run's end
        if self.save_steps is not None and (
            step % self.save_steps == 0 or step == self.total_steps
        ):
            t0 = time.perf_counter()
            self.save_checkpoint(step)
            meter.exclude(time.perf_counter() - t0)

    def eval_metrics(self) -> dict[str, float]:
        """What an evaluation adds to the log row: SFT's `eval_loss`."""
        return {"eval_loss": self.evaluate()}

    def micro_batch(self, step: int, a: int) -> list[Any]:
        """This rank's examples of micro-batch `a` of optimizer step `step`."""
        span, plan, d = self.span, self.plan, self.d
        exs = self.batches.micro_batch(step + span.shift, a)
        if step != self.start_step or not span.skip:
            return exs
        # the first step of a run resumed on another world size or batch, whose checkpoint ended
        # inside this step's global batch: the units before `skip` were trained already
        k = ((step + span.shift) % self.spe) * plan.grad_accum + a
        return drop_taken(exs, d.world * k * plan.micro_batch + d.rank, d.world, span.skip)

    def evaluate(self) -> float:
        """The token-mean loss over every rank's eval batches."""
        return one_step.evaluate(
            self.peft_model,
            self.evals,
            self.n_eval,
            self.micro0,
            self.tokenizer.pad_token_id,
            self.d,
            self.loss_sum,
        )

    def log(self, row: dict[str, Any]) -> None:
        """One row into the history, the live display, rank 0's run record; then the on_log hooks."""
        self.history.append(row)
        live.log(**row)
        if self.runlog is not None:
            self.runlog.row(row)
        self.hooks.call("on_log", self, row=row)

    def _stop(self) -> None:
        """A stop request or a preemption: the row so far, a checkpoint for the step reached; raise
        `Preempted` on every rank for a preemption."""
        d = self.d
        if self.meter.steps:
            self.log(
                self.meter.row(self.step, self.grad_norm, self.scheduler.get_last_lr()[0], None)
            )
        if self.last_saved != self.step:
            self.save_checkpoint(self.step)
        if self.preempted:
            hosts = d.gather_objects(d.host)
            self.state = "preempted"
            r, signum = self.preempted
            where = self.checkpoint = str(self.out / f"checkpoint-{self.step}")
            config = type(self.cfg).__name__
            raise Preempted(
                preempt_message(self.step, self.total_steps, r, hosts[r], signum, where, config)
            )
        if d.is_zero:
            print(
                f"nbtrain: stopped at step {self.step}/{self.total_steps} on request; checkpoint saved"
            )

    # ---- save phase: checkpoints and the adapter export

    def save_checkpoint(self, step: int) -> None:
        """An atomic checkpoint of step `step` in output_dir (rank 0; every rank writes its own shards)."""
        d, out, span, spe, plan = self.d, self.out, self.span, self.spe, self.plan
        rngs = d.gather_objects(ckpt.get_rng_state())
        tmp, adapter = None, None
        if self.sharded:  # every rank writes its shards into rank 0's temporary folder
            final = out / f"checkpoint-{step}"
            tmp = Path(d.broadcast_object(str(ckpt.open_atomic_dir(final)) if d.is_zero else ""))
            shard.save_sharded(tmp / shard.SHARDED_DIR, self.peft_model, self.optimizer, d.group)
            adapter = shard.full_adapter(self.peft_model, d.is_zero)
        if d.is_zero:
            data_step = step + span.shift
            epoch, in_epoch = divmod(data_step, spe)
            state = {
                "global_step": step,
                "total_steps": self.total_steps,
                "epoch": data_step / spe,
                "data_position": {
                    "epoch": epoch,
                    "step_in_epoch": in_epoch,
                    "rows_consumed": self.batches.consumed(data_step),
                },
                "steps_per_epoch": spe,
                "world_size": d.world,
                "per_device_train_batch_size": plan.micro_batch,
                "gradient_accumulation_steps": plan.grad_accum,
                "global_batch_size": plan.global_batch,
                "seed": self.seed,
                "shard": self.shard_kind,
            }
            written = ckpt.save_checkpoint(
                out,
                step,
                model=self.peft_model,
                optimizer=None if self.sharded else self.optimizer,
                scheduler=self.scheduler,
                rng_states=rngs,
                state=state,
                config=self.config_dict,
                adapter_state=adapter,
                tmp=tmp,
            )
            if self.save_total_limit is not None:
                ckpt.prune_checkpoints(out, self.save_total_limit, written)
        if self.sharded:
            d.barrier()
        self.last_saved = step
        self.hooks.call("on_save", self, step=step, checkpoint=str(out / f"checkpoint-{step}"))

    def export(self) -> None:
        """The adapter (and with merge=True the merged model) in output_dir, written by rank 0."""
        adapter = shard.full_adapter(self.peft_model, self.d.is_zero) if self.sharded else None
        if self.d.is_zero:
            # a sharded or 4-bit base cannot take the merge in place: a fresh copy on the CPU does
            fresh = self.model_name if self.sharded or self.quantized else None
            self.adapter_dir, self.merged_dir = ckpt.export_run(
                self.out,
                self.peft_model,
                self.tokenizer,
                adapter,
                self.merge,
                fresh,
                self.compute_dtype,
                self.use_cache,
            )

    def cleanup(self) -> None:
        """Put back the signal handlers, close the live display, and record how the run ended."""
        self.release()
        live.end(self.state)
        if self.runlog is not None:
            # a preempted run's record says where to resume from
            ended = {"step": self.step, "checkpoint": self.checkpoint} if self.checkpoint else {}
            self.runlog.finish(self.state, **ended)

    def result(self) -> TrainResult:
        import pandas as pd

        history = self.history
        return TrainResult(
            history=pd.DataFrame(history),
            adapter_dir=self.adapter_dir,
            output_dir=str(self.out),
            merged_dir=self.merged_dir,
            metrics=dict(history[-1]) if history else {},
            global_step=self.step,
            state=self.state,
            run_id=self.runlog.run_id if self.runlog else None,
            plan={
                "micro_batch": self.plan.micro_batch,
                "gradient_accumulation_steps": self.plan.grad_accum,
                "global_batch": self.plan.global_batch,
                "levers": self.levers,
                "notes": self.notes,
                # (elements this rank holds, elements in all) of the frozen base: 1/N of it under fsdp
                "base_params_held": shard.local_numel(self.peft_model, trainable=False),
            },
        )
