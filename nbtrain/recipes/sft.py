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

Phases, and what each may touch: `setup` (over `nbtrain.recipes.run_setup`, the phases every recipe
shares, with SFT's rows and batches) finds everything that can be wrong on every rank before any write,
and only then opens output_dir on rank 0; `train` runs the shared loop (`nbtrain.recipes.loop`) over
`train_step`, SFT's step; `save_checkpoint` and `export` write (`nbtrain.recipes.saves`); `cleanup`
puts back what the run changed (signal handlers, the live display, the run record).
"""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.data import tokens
from nbtrain.recipes import loop, run_setup, saves
from nbtrain.recipes import step as one_step
from nbtrain.recipes.base import Recipe
from nbtrain.recipes.saves import TrainResult

__all__ = ["SFTRecipe", "TrainResult"]

log = logging.getLogger(__name__)


class SFTRecipe(Recipe):
    """One LoRA/QLoRA SFT run on this rank: `setup()`, `train()`, `result()` (or `run()`).

    `group` trains on a sub-group of the running process group (its ranks are the run's ranks 0..n-1);
    `hooks` are called at the loop's named places (`nbtrain.recipes.hooks.Hooks`).
    """

    kind = "sft"

    # ---- set-up: the shared phases, with SFT's tokenized rows and their batches

    def setup(self) -> None:
        """Check the settings and the data, load the rows, the model (LoRA or QLoRA, sharded or not),
        plan the batch, open output_dir and its trackers, and build the optimizer and schedule (or
        resume them)."""
        run_setup.setup(
            self, check=lambda: run_setup.check(self), rows=self._rows, batches=self._batches
        )

    def _rows(self, source: Any) -> Any:
        """The training rows as a token store, tokenized once across the ranks (or read from the
        token cache)."""
        return tokens.prepare(source, self.tokenizer, self.d, self.data_cache, self.template_kwargs)

    def _batches(self, store: Any) -> None:
        """This rank's training batches and eval batches; eval rows cut at max_length are counted."""
        from nbtrain.data.loader import ShardedBatches, eval_batches

        d, plan = self.d, self.plan
        eval_cut: list[int] = []

        def make() -> tuple[Any, Any]:
            batches = ShardedBatches(
                None,
                self.tokenizer,
                store=store,
                max_length=self.max_length,
                batch_size=plan.micro_batch,
                grad_accum=plan.grad_accum,
                seed=self.seed,
                rank=d.rank,
                world_size=d.world,
                packing=self.packing,
                padding_free=self.padding_free,
                attn_implementation=getattr(self.model.config, "_attn_implementation", None),
                truncation_side=self.truncation_side,
            )
            evals = None
            if self.eval_rows is not None:
                evals = eval_batches(
                    self.eval_rows,
                    self.tokenizer,
                    max_length=self.max_length,
                    batch_size=plan.micro_batch,
                    rank=d.rank,
                    world_size=d.world,
                    truncation_side=self.truncation_side,
                    truncated=eval_cut,
                    template_kwargs=self.template_kwargs,
                )
            return batches, evals

        self.batches, self.evals = d.agree(make)
        if self.evals is not None:
            n_cut = sum(d.gather_objects(len(eval_cut)))
            if n_cut and d.is_zero:
                self.notes.append(
                    f"{n_cut} of {len(self.eval_rows)} eval_data rows are longer than "
                    f"max_length={self.max_length} tokens and are cut at the "
                    f"{self.truncation_side}; the eval loss covers only what is left (raise "
                    "max_length to keep them whole)"
                )
        self.spe = self.batches.steps_per_epoch

    # ---- train: the shared loop over SFT's step

    def train(self) -> None:
        """Train from the start (or resumed) step to the span's end, evaluating, logging and saving as
        asked; export the adapter; stop early, with a checkpoint, on a stop request or a preemption."""
        loop.train(self, self.train_step)

    def train_step(self) -> bool:
        """One optimizer step, its eval, log row and checkpoint; False where the run stops before the
        step instead (a stop request, or a preemption: then `preempted` is (rank, signal)).

        `loop.step_stats` (the step's one small collective, with the stop and preemption flags),
        `accumulate` (the micro-batches' forward and backward), `loop.optimizer_step`, then
        `loop.after_step` (hooks, eval, log, save)."""
        micro = [loop.micro_batch(self, self.step, a) for a in range(self.plan.grad_accum)]
        stats = loop.step_stats(self, micro, self.micro_stats)
        if stats is None:
            return False
        self.accumulate(micro, stats)
        lr = loop.optimizer_step(self)
        self.meter.tokens += float(stats[:, 2 * self.plan.grad_accum].sum())
        loop.after_step(self, lr)
        return True

    def micro_stats(self, exs: list[Any]) -> tuple[float, int, int]:
        """(what the loss is normalised by, the longest row, tokens) of one micro-batch on this rank:
        SFT's target tokens."""
        return (
            sum(e.n_targets for e in exs),
            max((len(e.input_ids) for e in exs), default=1),
            sum(len(e.input_ids) for e in exs),
        )

    def accumulate(self, micro: list[list[Any]], stats: Any) -> None:
        """SFT's forward and backward over the step's micro-batches: the token loss, normalised by the
        target tokens of the whole global batch; on an MoE that asks for it, plus the router loss's
        mean over micro-batches and ranks times its coefficient (`nbtrain.losses.router`)."""
        d, GA = self.d, self.plan.grad_accum
        n_targets = max(float(stats[:, :GA].sum()), 1.0)
        aux = self.router_aux
        for a, exs in enumerate(micro):
            # pad to the longest row across ranks: the same shapes as one rank with the whole batch
            batch = self.batches.collate(exs, int(stats[:, GA + a].max()))
            batch = one_step.to_device(batch, d.device)
            with loop.synced(self, a):
                batch_loss = self.loss_sum(self.model, batch, aux)
                # DDP averages gradients over ranks; scaling by world turns that into the global sum
                objective = batch_loss * (d.world / n_targets)
                if aux is not None:
                    router = aux.pop()
                    objective = objective + router * (aux.coef / GA)
                    self.meter.aux += router.detach().double() / (GA * d.world)
                objective.backward()
            self.meter.loss += batch_loss.detach().double() / n_targets

    def eval_metrics(self) -> dict[str, float]:
        """What an evaluation adds to the log row: SFT's `eval_loss`."""
        return {"eval_loss": self.evaluate()}

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
        loop.record(self, row)

    # ---- save, cleanup, result: the shared ones

    def save_checkpoint(self, step: int) -> None:
        """An atomic checkpoint of step `step` in output_dir (rank 0; every rank writes its own shards)."""
        saves.save_checkpoint(self, step)

    def export(self) -> None:
        """The adapter (and with merge=True the merged model) in output_dir, written by rank 0."""
        saves.export(self)

    def cleanup(self) -> None:
        """Put back the signal handlers, close the live display, and record how the run ended."""
        loop.cleanup(self)

    def result(self) -> TrainResult:
        return saves.result(self)
