"""The GRPO recipe: the shared set-up, loop and saves, with prompt rows, rollouts and GRPO's step.

In [1]: recipe = GRPORecipe(cfg)      # cfg: nbtrain.GRPOConfig, read once
In [2]: recipe.run()                  # set-up, the loop, checkpoints, the export

`nbtrain.finetune(GRPOConfig(...))` is `GRPORecipe(cfg).run()`, on every rank, in one of two placements:

- **collocated** (the default): each step every rank samples its share of the step's completions,
  scores them, the ranks swap the rewards (advantages are relative to each prompt's group, which may
  span ranks), and every rank trains on its share (DDP);
- **disaggregated** (`actor=` and `rollout=` name two rank groups): the rollout group samples and scores
  the completions of step s + 1 while the actor group trains step s on those the rollout sent before,
  so a step's completions come from the adapter one optimizer step old at most (staleness 1). The
  rollout sends each step's completions from its rank 0; actor rank 0 sends the adapter after each
  step (`nbtrain.recipes.grpo.link`). The completions carry the rollout's log-probabilities, the policy
  ratio's denominator, so the clipped loss corrects for the step of lag. This rank's side of it is a
  component the recipe holds, `self.disagg` (`nbtrain.recipes.grpo.disagg.Disaggregated`).

The reference for `beta` > 0 is the same model with its adapter off (peft's `disable_adapter()`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from nbtrain.configs.grpo import GRPOConfig
from nbtrain.engine.rank import get_rank
from nbtrain.engine.signals import interrupts
from nbtrain.errors import ConfigError
from nbtrain.generation import decode
from nbtrain.losses import grpo as grpo_loss
from nbtrain.losses import rewards as grpo_rewards
from nbtrain.recipes import loop, run_setup, saves
from nbtrain.recipes.base import Recipe
from nbtrain.recipes.grpo import rollout as grpo_rollout
from nbtrain.recipes.grpo.disagg import Disaggregated
from nbtrain.recipes.grpo.rollout import PromptOrder, PromptRows, RewardFunctionError, Scored
from nbtrain.recipes.hooks import Hooks
from nbtrain.recipes.saves import TrainResult

log = logging.getLogger(__name__)

#: completions per `generate` call
GENERATE_BATCH = 64


class _PromptBatches:
    """What the set-up and the saves read off a run's batches, for prompt rows: the units are
    completions (a step's are ranks x per-device batch x accumulation steps)."""

    def __init__(self, order: PromptOrder, group: int) -> None:
        self.order, self.group = order, group
        self.steps_per_epoch = order.steps_per_epoch
        self.n_units = order.steps_per_epoch * order.per_step * group

    def consumed(self, data_step: int) -> int:
        return data_step * self.order.per_step * self.group

    def micro_batch(self, step: int, a: int) -> list[Any]:
        return []


class GRPORecipe(Recipe):
    """One LoRA GRPO run on this rank: `setup()`, `train()`, `result()` (or `run()`)."""

    kind = "grpo"

    def __init__(
        self, cfg: GRPOConfig, merge: bool = False, group: Any = None, hooks: Hooks | None = None
    ) -> None:
        if not isinstance(cfg, GRPOConfig):
            msg = f"GRPORecipe needs an nbtrain.GRPOConfig, got {type(cfg).__name__}"
            raise ConfigError(msg)
        self.role = "collocated"
        #: this rank's side of a disaggregated run (None collocated)
        self.disagg: Disaggregated | None = None
        actor: list[int] = []
        rollout: list[int] = []
        if cfg.actor is not None:
            if group is not None:
                msg = "finetune(group=...) and GRPOConfig(actor=..., rollout=...) both pick ranks; give one"
                raise ConfigError(msg)
            import torch.distributed as dist

            from nbtrain.recipes.grpo import link as grpo_link

            actor, rollout, actor_pg, rollout_pg = grpo_link.resolve(cfg.actor, str(cfg.rollout))
            self.role = "actor" if dist.get_rank() in actor else "rollout"
            group = actor_pg if self.role == "actor" else rollout_pg
        super().__init__(cfg, merge=merge, group=group, hooks=hooks)
        if self.role != "collocated":
            self.disagg = Disaggregated(self, self.role, actor, rollout)
        self.funcs = list(cfg.reward_funcs)
        self.func_names = cfg.func_names()
        self.weights = cfg.weights()
        self.G = cfg.num_generations
        self.scale = str(cfg.scale_rewards)
        self.mask_truncated = cfg.mask_truncated_completions
        self.disable_dropout = cfg.disable_dropout
        self.loss_settings = grpo_loss.LossSettings(
            cfg.loss_type,
            float(cfg.epsilon),
            float(cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high),
            float(cfg.beta),
            cfg.max_completion_length,
            float(cfg.temperature),
            cfg.use_bias_correction_kl,
        )
        self.decoding = decode.Decoding(
            max_new_tokens=cfg.max_completion_length,
            do_sample=True,
            temperature=float(cfg.temperature),
            top_p=float(cfg.top_p),
            top_k=cfg.top_k,
            seed=cfg.seed,
            batch_size=GENERATE_BATCH,
        )
        #: the logged row's figures of the steps since the last row
        self._window: list[dict[str, float]] = []
        self._sums: Any = None
        self._halt = False

    # ---- set-up: the shared phases with prompt rows (a rollout rank: `Disaggregated.setup_rollout`)

    def setup(self) -> None:
        """The shared set-up with GRPO's checks, prompt rows and prompt order (collocated: then every
        rank's vLLM engine, where engine='vllm'); an actor rank then tells the rollout group how it
        went (`Disaggregated.handshake`), a rollout rank sets up its own way. Dropout off where asked."""
        import torch

        if self.disagg is not None and self.role == "rollout":
            self.disagg.setup_rollout()
        else:
            err: BaseException | None = None
            try:
                run_setup.setup(
                    self,
                    check=self._check,
                    rows=self._rows,
                    batches=self._batches,
                    compile_model=self._compile,
                )
                # collocated, every rank samples, so every rank starts its engine
                if self.role == "collocated":
                    self.d.agree(self.start_engine)
            except BaseException as e:  # told to the rollout group below, then raised
                err = e
            if self.disagg is not None:
                self.disagg.handshake(err)
            if err is not None:
                raise err
        if self.disable_dropout:
            for m in self.peft_model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        self._sums = torch.zeros(len(grpo_loss.LOSS_METRICS) + 1, dtype=torch.float64)

    def _check(self) -> dict[str, Any]:
        # a step's completions are known from the settings: refused before the model loads
        cfg = self.cfg
        micro, accum = int(cfg.per_device_train_batch_size), cfg.gradient_accumulation_steps
        ranks = self.d.world if self.disagg is None else len(self.disagg.actor_ranks)
        completions = ranks * micro * accum
        if completions % self.G:
            who = "rank(s)" if self.role == "collocated" else "actor rank(s)"
            fits = self.G // math.gcd(self.G, ranks * accum)
            msg = (
                f"a step's completions, {ranks} {who} x per_device_train_batch_size={micro} x "
                f"gradient_accumulation_steps={accum} = {completions}, must be a multiple of "
                f"num_generations={self.G}: make per_device_train_batch_size a multiple of {fits}, "
                "or lower num_generations"
            )
            raise ConfigError(msg)
        if getattr(cfg, "engine", "hf") == "vllm" and self.role != "actor":
            # the ranks that will sample through vLLM check it is installed in versions that work
            # together, before any model loads
            from nbtrain.generation import engines

            engines.check_vllm(get_rank(), self.d.host, self.model_name, self.d.device)
        return run_setup.check(self)

    def _rows(self, source: Any) -> Any:
        def read() -> PromptRows:
            rows = PromptRows.read(source, self.tokenizer, self.template_kwargs)
            # the columns the reward functions name, before the model loads
            grpo_rewards.check(self.funcs, self.func_names, rows.columns)
            return rows

        return self.d.agree(read)

    def _batches(self, store: Any) -> None:
        d, plan = self.d, self.plan
        completions = d.world * plan.micro_batch * plan.grad_accum
        self.rows: PromptRows = store
        if self.disagg is not None and self.role == "actor":
            self.notes.append(
                f"disaggregated GRPO: actor ranks {self.disagg.actor_ranks} train while rollout ranks "
                f"{self.disagg.rollout_ranks} sample; each step trains on completions sampled with the adapter "
                "of the step before it at most (staleness 1), their log-probabilities the ratio's old policy"
            )
        self.order = PromptOrder(len(store), completions // self.G, self.seed)
        self.batches = _PromptBatches(self.order, self.G)
        self.evals = None
        self.spe = self.batches.steps_per_epoch

    def _compile(self) -> None:
        # GRPO samples with the same model it trains: its blocks are left uncompiled, and said so
        if self.torch_compile:
            self.notes.append(
                "torch_compile off: GRPO samples with the model it trains, and compiled blocks would "
                "be compiled again for every length a completion reaches"
            )

    def start_engine(self) -> None:
        """With engine='vllm', this rank's vLLM engine (kept from an earlier run where it fits), carried
        by the decoding every step's sampling reads."""
        if getattr(self.cfg, "engine", "hf") != "vllm":
            return
        from dataclasses import asdict

        d = self.d
        t0 = time.perf_counter()
        engine = grpo_rollout.rollout_engine(
            self.model_name, self.tokenizer, self.peft_model, d, self.compute_dtype
        )
        self.decoding = grpo_rollout.RolloutDecoding(**asdict(self.decoding), engine=engine)
        if d.is_zero:
            print(
                f"nbtrain: vLLM rollout engine ready in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )

    # ---- train: the shared loop over GRPO's step (a rollout rank: `Disaggregated.serve`)

    def train(self) -> None:
        """The shared loop (`nbtrain.recipes.loop.train`) over `train_step`; a rollout rank serves
        the actor group instead, and an actor rank ends the exchange however its loop ended."""
        if self.disagg is None:
            loop.train(self, self.train_step)
            return
        if self.role == "rollout":
            self.disagg.serve()
            return
        failure: str | None = None
        try:
            loop.train(self, self.train_step)
        except BaseException as e:
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            # the rollout ranks return with the run's history, or raise with the actor's failure
            # (unless they failed first, and raised)
            if not self.disagg.rollout_failed:
                self.disagg.release(failure)

    def train_step(self) -> bool:
        """One GRPO step: the completions (sampled here, or received from the rollout group), the
        loss over this rank's share, the optimizer step, the log row and checkpoint; False where the
        run stops before the step (a stop request, or a preemption)."""
        if self._halt or (self.disagg is None and self._stop_now()):
            return False
        t0 = time.perf_counter()
        figures: dict[str, float] = {}
        if self.disagg is None:
            scored = self.rollout(self.step + self.span.shift)
            figures["gen_s"] = max(p.seconds for p in scored.parts)
        else:
            message = self.disagg.receive()
            figures["actor_wait_s"] = time.perf_counter() - t0
            scored = message["scored"]
            figures["gen_s"] = message["gen_s"]
            if message.get("rollout_wait_s") is not None:
                figures["rollout_wait_s"] = message["rollout_wait_s"]
        t1 = time.perf_counter()
        tokens = self.learn(scored)
        lr = loop.optimizer_step(self)
        figures["train_s"] = time.perf_counter() - t1
        if self.disagg is not None:
            # the stop check for the next step, then the adapter (and whether to go on) to the rollout
            self._halt = self._stop_now()
            more = self.step < self.total_steps and not self._halt
            t2 = time.perf_counter()
            # waits until the rollout has sampled the next step's completions
            self.disagg.send(more)
            figures["actor_wait_s"] += time.perf_counter() - t2
        self._window.append({**scored.metrics, **figures})
        self.meter.tokens += tokens
        loop.after_step(self, lr)
        return True

    def _stop_now(self) -> bool:
        """The step's small collective: a stop request (rank 0) or a preemption (any rank)."""
        import torch

        d = self.d
        # [stop request, each rank's preemption signal, interrupts]
        flags = torch.zeros(d.world + 2, dtype=torch.float64)
        if self.runlog is not None:
            flags[0] = float(self.runlog.stop_requested())
        flags[1 + d.rank] = float(self.preemption.signum)
        flags[-1] = self.held.flag()
        flags = d.sum_meta(flags)
        if flags[-1] > 0:  # an interrupt on any rank: every rank stops here, at the same step
            self.state = "stopped"
            interrupts.stop_if_any(flags[-1:], f"step {self.step}/{self.total_steps}")
        signalled = [r for r in range(d.world) if flags[1 + r] > 0]
        if signalled:
            self.preempted = (signalled[0], int(flags[1 + signalled[0]]))
        return bool(flags[0] > 0) or bool(self.preempted)

    def rollout(self, data_step: int) -> Scored:
        """Collocated: this rank samples and scores its share of the step's completions; the ranks
        swap them (every rank raises if a reward function failed on one)."""
        d = self.d
        prompts = self.order.step(data_step)
        n = len(prompts) * self.G
        part, report, reward = None, None, False
        try:
            part = self._part(prompts, data_step, grpo_rollout.share(n, d.rank, d.world))
        except Exception as e:  # told to the other ranks in the gather below, then raised
            reward = isinstance(e, RewardFunctionError)
            report = str(e) if reward else f"{type(e).__name__}: {e}"
            err = e
        got = d.gather_objects((part, report, reward))
        if report is not None:
            raise err
        failed = [(r, rep, rew) for r, (_, rep, rew) in enumerate(got) if rep is not None]
        if failed:
            # a reward function's failure is the user's; another (an engine that died) is not
            rank, said, was_reward = failed[0]
            if was_reward:
                raise RewardFunctionError(said)
            msg = f"rank {rank} failed while sampling its rollouts: {said}"
            raise RuntimeError(msg)
        return grpo_rollout.finish(
            [p for p, _, _ in got], self.func_names, self.weights, self.G, self.scale
        )

    def _part(self, prompts: list[int], data_step: int, span: tuple[int, int]) -> grpo_rollout.Part:
        from dataclasses import replace

        # the step's draws: its own seed, whatever rank draws a completion
        decoding = replace(self.decoding, seed=hash((self.seed, data_step)) % (2**31))
        part = grpo_rollout.generate_part(
            self.peft_model,
            self.tokenizer,
            self.rows,
            prompts,
            self.G,
            span,
            decoding,
            self.d.device,
            self.autocast,
        )
        # the rank as the cluster numbers it (a rollout rank's rank in its group is not)
        rank = get_rank()
        grpo_rollout.score_part(self.funcs, self.func_names, self.rows, part, rank, self.d.host)
        return part

    def learn(self, scored: Scored) -> float:
        """Forward and backward over this rank's share of the step's completions, in micro-batches;
        returns the step's tokens (prompt and completion, every rank's)."""
        import torch

        d, plan = self.d, self.plan
        flat = [
            (pi, ci, tr, old)
            for p in scored.parts
            for pi, ci, tr, old in zip(
                p.prompt_ids,
                p.completion_ids,
                p.truncated,
                p.old_logps or [[]] * len(p.texts),
                strict=True,
            )
        ]
        adv = scored.advantages
        start, end = grpo_rollout.share(len(flat), d.rank, d.world)
        step_tokens = float(sum(len(c) for _, c, t, _ in flat if not (self.mask_truncated and t)))
        B, GA = plan.micro_batch, plan.grad_accum
        pad = self.tokenizer.pad_token_id
        model = self.model
        # from the hidden states a chunk at a time where the model allows (never [rows, C, vocab])
        fused = self.loss_fn is not None
        for a in range(GA):
            lo, hi = start + a * B, min(start + (a + 1) * B, end)
            rows = flat[lo:hi]
            batch = grpo_rollout.collate(
                [r[0] for r in rows],
                [r[1] for r in rows],
                adv[lo:hi],
                [r[2] for r in rows],
                pad,
                self.mask_truncated,
            )
            old = None
            if rows and rows[0][3]:
                width = batch["completion_ids"].shape[1]
                old = torch.tensor([list(r[3]) + [0.0] * (width - len(r[3])) for r in rows])
            batch = {k: v.to(d.device) for k, v in batch.items()}
            ref = None
            if self.loss_settings.beta != 0.0:
                with torch.no_grad(), self.peft_model.disable_adapter():
                    ref = grpo_loss.token_logps(
                        self.peft_model, batch, self.autocast, self.loss_settings.temperature, fused
                    )
            with loop.synced(self, a):
                logps = grpo_loss.token_logps(
                    model, batch, self.autocast, self.loss_settings.temperature, fused
                )
                loss, sums = grpo_loss.policy_loss(
                    logps,
                    None if old is None else old.to(d.device),
                    ref,
                    batch,
                    self.loss_settings,
                    GA,
                    step_tokens,
                    d.world,
                )
                loss.backward()
            self.meter.loss += loss.detach().double() / d.world
            self._sums += sums
        return float(sum(len(p) + len(c) for p, c, _, _ in flat))

    def log(self, row: dict[str, Any]) -> None:
        """The row with the rollout's metrics (the mean over the steps since the last row) and the
        loss metrics (over every rank's tokens), then into the history and the record."""
        sums = self.d.sum_meta(self._sums.clone())
        tokens = float(sums[len(grpo_loss.LOSS_METRICS)])
        extra: dict[str, float] = {}
        if self._window:
            for key in self._window[-1]:
                values = [w[key] for w in self._window if key in w]
                extra[key] = sum(values) / len(values)
        if tokens > 0:
            for i, key in enumerate(grpo_loss.LOSS_METRICS):
                if key == "kl" and self.loss_settings.beta == 0.0:
                    continue
                extra[key] = float(sums[i]) / tokens
        self._sums.zero_()
        self._window = []
        loop.record(self, {**row, **extra})

    def eval_metrics(self) -> dict[str, float]:
        # GRPO has no eval rows (its `evals` is None), so the loop never evaluates it
        return {}

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
        if self.disagg is not None and self.role == "rollout":
            return self.disagg.rollout_result()
        return saves.result(self)
