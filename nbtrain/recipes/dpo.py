"""The DPO recipe: the shared set-up, loop and saves, with DPO's pairs, reference and its own step.

In [1]: recipe = DPORecipe(cfg)      # cfg: nbtrain.DPOConfig, read once
In [2]: recipe.setup()               # pairs, model + LoRA, batch plan, resume; reference log-probs if precomputed
In [3]: recipe.train()               # the loop, checkpoints, the export
In [4]: recipe.result()

`nbtrain.finetune(DPOConfig(...))` is `DPORecipe(cfg).run()`. It inherits from no other recipe: its
set-up calls `nbtrain.recipes.run_setup` with its own checks, pairs and batches, its `train` the shared
loop (`nbtrain.recipes.loop`) over its `train_step`, its saves `nbtrain.recipes.saves`.

The reference model is the same model with its LoRA adapter off (peft's `disable_adapter()`), so there
is no second copy: each step runs the pairs once without the adapter (no gradients), once with it, or
reads the reference log-probabilities computed once at set-up (`precompute_ref_log_probs=True`).

A step's global batch is the pairs of every rank's micro-batches; the loss is their mean, so N ranks of
B pairs train exactly as one rank of N*B (gradients summed by DDP, scaled by world / pairs). The reward
metrics are summed over ranks and the steps since the last logged row, then divided by the pairs: the
row holds TRL's means, under TRL's names (`dpo_loss.METRICS`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nbtrain.configs.dpo import DPOConfig
from nbtrain.data import prefs, tokens
from nbtrain.errors import ConfigError
from nbtrain.losses import dpo as dpo_loss
from nbtrain.recipes import loop, run_setup, saves
from nbtrain.recipes.base import Recipe
from nbtrain.recipes.hooks import Hooks
from nbtrain.recipes.saves import TrainResult

log = logging.getLogger(__name__)


class DPORecipe(Recipe):
    """One LoRA DPO run on this rank: `setup()`, `train()`, `result()` (or `run()`)."""

    kind = "dpo"

    def __init__(
        self, cfg: DPOConfig, merge: bool = False, group: Any = None, hooks: Hooks | None = None
    ) -> None:
        if not isinstance(cfg, DPOConfig):
            msg = f"DPORecipe needs an nbtrain.DPOConfig, got {type(cfg).__name__}"
            raise ConfigError(msg)
        super().__init__(cfg, merge=merge, group=group, hooks=hooks)
        self.beta = float(cfg.beta)
        self.loss_type = cfg.loss_type
        self.precompute = cfg.precompute_ref_log_probs
        self.disable_dropout = cfg.disable_dropout
        self.cut = prefs.Cut(
            cfg.max_length, cfg.truncation_side, cfg.max_prompt_length, cfg.max_completion_length
        )
        #: per data row: the reference log-probs of (chosen, rejected), where precomputed
        self.ref_table: Any = None
        self._sums: Any = None

    # ---- set-up: pairs instead of rows, dropout off, the reference log-probs once if asked

    def setup(self) -> None:
        """The shared set-up with DPO's checks, pairs and batches; then dropout off (where asked), and
        the reference log-probs of every pair once (precompute_ref_log_probs=True)."""
        import torch

        run_setup.setup(self, check=self._check, rows=self._rows, batches=self._batches)
        self.fused = self.loss_fn is not None
        if self.disable_dropout:
            # TRL's disable_dropout: the policy and the reference are the same network but for LoRA
            for m in self.peft_model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        self._sums = torch.zeros(len(dpo_loss.METRICS) + 1, dtype=torch.float64)
        if self.precompute:
            t0 = time.perf_counter()
            self.ref_table = self.d.agree(self._precompute)
            if self.d.is_zero:
                print(
                    f"nbtrain: reference log-probs of {len(self.batches.kept):,} pairs computed in "
                    f"{time.perf_counter() - t0:.1f} s",
                    flush=True,
                )

    def _rows(self, source: Any) -> Any:
        """The training pairs as a token store, tokenized with the pair encoder."""
        return tokens.prepare(
            source, self.tokenizer, self.d, self.data_cache, self.template_kwargs, encoder=prefs
        )

    def _check(self) -> dict[str, Any]:
        # the shared checks without eval_data, which SFT's row formats would refuse: its pairs are
        # read here
        checked = run_setup.check(self, read_eval=False)
        if self.eval_data is not None:
            pairs = prefs.load_pairs(
                self.eval_data, "eval_data", checked["tokenizer"], self.template_kwargs
            )
            checked["eval_rows"] = [p for p in pairs if self.cut.keeps(p)]
            if not checked["eval_rows"]:
                msg = (
                    f"every eval_data pair has a prompt of max_length={self.max_length} tokens "
                    "or more, and nothing would be evaluated; raise max_length"
                )
                raise ConfigError(msg)
        return checked

    def _batches(self, store: Any) -> None:
        """This rank's batches of pairs, and its eval pairs in micro-batches."""
        d, plan = self.d, self.plan

        def make() -> Any:
            return prefs.PrefBatches(
                store,
                self.tokenizer,
                self.cut,
                batch_size=plan.micro_batch,
                grad_accum=plan.grad_accum,
                seed=self.seed,
                rank=d.rank,
                world_size=d.world,
            )

        self.batches = d.agree(make)
        self.evals = None
        if self.eval_rows is not None:  # pairs r, r+N, ... of eval_data, in micro-batches
            mine = self.eval_rows[d.rank :: d.world]
            size = plan.micro_batch
            self.evals = [mine[k : k + size] for k in range(0, len(mine), size)]
        self.spe = self.batches.steps_per_epoch

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        dev = self.d.device
        if dev.type != "cuda":
            return batch
        return {k: v.pin_memory().to(dev, non_blocking=True) for k, v in batch.items()}

    def reference_logps(self, batch: dict[str, Any]) -> Any:
        """[2B] log-probs of the batch's sequences under the base model (the adapter off, no grad)."""
        import torch

        with torch.no_grad(), self.peft_model.disable_adapter():
            # the unwrapped model: nothing here needs DDP's gradient sync
            return dpo_loss.sequence_logps(self.peft_model, batch, self.autocast, self.fused)

    def _precompute(self) -> Any:
        """Every kept pair's reference log-probs: rank r takes pairs r, r+N, ... in micro-batches, and
        the ranks swap what they found; every rank runs as many forwards (FSDP gathers in each)."""
        import numpy as np

        d, b = self.d, self.batches
        mine = b.kept[d.rank :: d.world]
        size = self.plan.micro_batch
        n_batches = -(-len(b.kept[:: d.world]) // size)
        found: list[tuple[int, float, float]] = []
        for k in range(n_batches):
            pairs = [b.example(i) for i in mine[k * size : (k + 1) * size]]
            pad = max((b.length(p) for p in pairs), default=1)
            batch = self._to_device(b.collate(pairs, pad))
            chosen, rejected = self.reference_logps(batch).double().cpu().chunk(2)
            found += [
                (p.index, float(c), float(r))
                for p, c, r in zip(pairs, chosen.tolist(), rejected.tolist(), strict=False)
            ]
        table = np.full((len(b.store), 2), np.nan, dtype=np.float64)
        for part in d.gather_objects(found):
            for i, c, r in part:
                table[i] = (c, r)
        return table

    # ---- train: the shared loop over DPO's step

    def train(self) -> None:
        """The shared loop (`nbtrain.recipes.loop.train`) over DPO's `train_step`."""
        loop.train(self, self.train_step)

    def train_step(self) -> bool:
        """One DPO step: the step's one small collective (`loop.step_stats`, the pairs and the stop and
        preemption flags), `accumulate` over the micro-batches of pairs, the optimizer step, then the
        hooks, eval, log row and checkpoint; False where the run stops before the step."""
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
        """(pairs, the longest sequence, tokens) of one micro-batch of pairs on this rank: the loss
        is the mean over every rank's pairs."""
        b = self.batches
        return (
            len(exs),
            max((b.length(p) for p in exs), default=1),
            sum(len(ids) for p in exs for ids, _ in self.cut.seqs(p)),
        )

    def accumulate(self, micro: list[list[Any]], stats: Any) -> None:
        """DPO's forward and backward over the step's micro-batches of pairs: the policy's log-probs
        against the reference's, the loss the mean over the global batch's pairs."""
        d, GA = self.d, self.plan.grad_accum
        n_pairs = max(float(stats[:, :GA].sum()), 1.0)
        for a, pairs in enumerate(micro):
            # pad to the longest sequence across ranks: the shapes one rank with the whole batch has
            batch = self._to_device(self.batches.collate(pairs, int(stats[:, GA + a].max())))
            ref = self._reference(batch)
            with loop.synced(self, a):
                logps = dpo_loss.sequence_logps(self.model, batch, self.autocast, self.fused)
                losses = dpo_loss.pair_losses(logps, ref, batch, self.beta, self.loss_type)
                batch_loss = losses.sum()
                # DDP averages gradients over ranks; scaling by world makes it the mean over all pairs
                (batch_loss * (d.world / n_pairs)).backward()
            self.meter.loss += batch_loss.detach().double() / n_pairs
            self._sums += dpo_loss.metric_sums(logps, ref, batch, self.beta)

    def eval_metrics(self) -> dict[str, float]:
        """eval_loss and TRL's eval reward metrics, for the log row."""
        return self.evaluate_pairs()

    def _reference(self, batch: dict[str, Any]) -> Any:
        """The batch's reference log-probs: looked up where precomputed, else a forward without LoRA."""
        import torch

        if self.ref_table is None:
            return self.reference_logps(batch)
        idx = batch["index"].cpu().numpy()
        real = idx >= 0
        table = self.ref_table
        chosen = [table[i, 0] if ok else 0.0 for i, ok in zip(idx, real, strict=True)]
        rejected = [table[i, 1] if ok else 0.0 for i, ok in zip(idx, real, strict=True)]
        return torch.tensor(
            chosen + rejected, dtype=torch.float32, device=batch["input_ids"].device
        )

    def log(self, row: dict[str, Any]) -> None:
        """The row with the reward metrics of the steps since the last row, summed over every rank
        (a collective: every rank logs the same rows), then into the history and the record."""
        sums = self.d.sum_meta(self._sums.clone())
        pairs = float(sums[-1])
        if pairs > 0:
            row = {**row, **{k: float(sums[i]) / pairs for i, k in enumerate(dpo_loss.METRICS)}}
        self._sums.zero_()
        loop.record(self, row)

    def evaluate(self) -> float:
        """The eval loss: the mean DPO loss over every rank's eval_data pairs."""
        return self.evaluate_pairs()["eval_loss"]

    def evaluate_pairs(self) -> dict[str, float]:
        """eval_loss and TRL's reward metrics (`eval_rewards/chosen`, ...) over every rank's eval pairs,
        the model in eval mode meanwhile. Each rank runs `n_eval` forwards: under FSDP each gathers
        weights on every rank, so a rank short of batches runs a stand-in pair that counts nothing."""
        import torch

        net, b = self.peft_model, self.batches
        totals = torch.zeros(len(dpo_loss.METRICS) + 2, dtype=torch.float64)
        net.eval()
        try:
            with torch.no_grad():
                for i in range(self.n_eval):
                    pairs = self.evals[i] if self.evals and i < len(self.evals) else []
                    pad = max((b.length(p) for p in pairs), default=1)
                    batch = self._to_device(b.collate(pairs, pad))
                    ref = self.reference_logps(batch)
                    logps = dpo_loss.sequence_logps(net, batch, self.autocast, self.fused)
                    losses = dpo_loss.pair_losses(logps, ref, batch, self.beta, self.loss_type)
                    totals[0] += losses.sum().double().cpu()
                    totals[1:] += dpo_loss.metric_sums(logps, ref, batch, self.beta)
        finally:
            net.train()
        totals = self.d.sum_meta(totals)
        pairs = max(float(totals[-1]), 1.0)
        out = {"eval_loss": float(totals[0]) / pairs}
        out.update(
            {f"eval_{k}": float(totals[1 + i]) / pairs for i, k in enumerate(dpo_loss.METRICS)}
        )
        return out

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
