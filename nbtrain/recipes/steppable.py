"""`nbtrain.Run`: a run of nbtrain's own recipes (SFT, DPO, GRPO) that trains a span at a time.

In [1]: run = nbtrain.Run(cfg)                 # loads once: rows, model, LoRA, optimizer, schedule
In [2]: run.train(steps=50)                    # 50 optimizer steps; the run pauses
In [3]: run.generate(["Add 12 and 30."])       # from the weights as they are now, nothing reloaded
In [4]: run.learning_rate = 1e-4               # or run.set(reward_funcs=[...]) for GRPO
In [5]: run.train(steps=50)                    # goes on from step 50: one curve, one record
In [6]: run.export(); run.close()

The run is the recipe `finetune` runs (`nbtrain.recipes.train.recipe_for`), set up once and kept: the
shared loop (`nbtrain.recipes.loop`: `begin`, `advance` over the recipe's `train_step`, `finish`) runs
a span per `train` call. The schedule (warmup, decay)
is the config's, over max_steps or its epochs, and every step's data, dropout and sampling draws are
the step's own, so for an unchanged config two `train(steps=50)` give the adapter one 100-step
`finetune` gives, bit for bit on the CPU. Between calls the run's random state is kept aside and put
back, the signal handlers are the notebook's own, and its record stays "running" with `paused: true`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.engine import metrics as live
from nbtrain.engine.signals import interrupts
from nbtrain.errors import ConfigError
from nbtrain.model import checkpoint as ckpt
from nbtrain.recipes import loop
from nbtrain.recipes.base import Recipe
from nbtrain.recipes.hooks import Hooks
from nbtrain.recipes.saves import TrainResult
from nbtrain.runs import loss_unit, run_id_for

__all__ = ["CHANGEABLE", "Run"]

log = logging.getLogger(__name__)

#: the settings `Run.set` may change between spans, per recipe kind; everything else needs a new Run
CHANGEABLE: dict[str, tuple[str, ...]] = {
    "sft": ("learning_rate", "max_grad_norm", "logging_steps", "eval_steps", "save_steps"),
    "dpo": ("learning_rate", "max_grad_norm", "logging_steps", "eval_steps", "save_steps"),
    "grpo": (
        "learning_rate",
        "max_grad_norm",
        "logging_steps",
        "save_steps",
        "reward_funcs",
        "reward_weights",
    ),
}


class Run:
    """A fine-tuning run kept on this rank between cells: `train(steps)`, `generate`, `set`, `save`,
    `export`, `close`.

    `cfg` is an `nbtrain.SFTConfig`, `DPOConfig` or `GRPOConfig` (collocated); `merge`, `group` and
    `hooks` are `finetune`'s. Make it on every rank of the run, as `finetune` (a `%%distributed` cell, or
    a plain kernel), and call each method on every rank alike.
    """

    def __init__(
        self, cfg: SFTConfig, merge: bool = False, group: Any = None, hooks: Hooks | None = None
    ) -> None:
        from nbtrain.recipes.train import recipe_for

        if getattr(cfg, "actor", None) is not None:
            msg = (
                "nbtrain.Run trains GRPO collocated only: a disaggregated GRPOConfig (actor=, rollout=) "
                "keeps its rollout ranks in a loop of their own; drop actor= and rollout=, or use "
                "nbtrain.finetune(cfg)"
            )
            raise ConfigError(msg)
        recipe = recipe_for(cfg, merge=merge, group=group, hooks=hooks)
        self.recipe: Recipe = recipe
        # an interrupt during set-up (whose ranks meet in collectives) waits for its end, as finetune's
        with interrupts.Held():
            recipe.setup()
        recipe.step = recipe.start_step
        recipe.state = "paused"
        self._begun = False
        #: why the run trains no more (it ended, failed or was closed); None while it can
        self._ended: str | None = None
        self._closed = False
        #: the training's random state while the run is paused, and when it paused
        self._rng: dict[str, Any] | None = None
        self._paused_at = 0.0
        self._mark(paused=True)

    # ---- what a notebook reads

    @property
    def step(self) -> int:
        """The optimizer steps taken (counting a resumed run's earlier ones)."""
        return self.recipe.step

    @property
    def total_steps(self) -> int:
        """The run's last step: max_steps, or its epochs' steps."""
        return self.recipe.total_steps

    @property
    def state(self) -> str:
        """'paused' between spans; then 'done', 'stopped', 'preempted' or 'failed'."""
        return self.recipe.state

    @property
    def history(self) -> Any:
        """The logged rows so far (a pandas DataFrame), every span's."""
        import pandas as pd

        return pd.DataFrame(self.recipe.history)

    @property
    def model(self) -> Any:
        """The peft model being trained (this rank's shard of it under fsdp)."""
        return self.recipe.peft_model

    @property
    def tokenizer(self) -> Any:
        return self.recipe.tokenizer

    @property
    def learning_rate(self) -> float:
        """The peak learning rate of the schedule; assigning it is `set(learning_rate=...)`."""
        return float(self.recipe.learning_rate)

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.set(learning_rate=value)

    @property
    def reward_funcs(self) -> list[Any]:
        """GRPO's reward functions; assigning them is `set(reward_funcs=...)`."""
        return list(getattr(self.recipe, "funcs", []))

    @reward_funcs.setter
    def reward_funcs(self, value: Any) -> None:
        self.set(reward_funcs=value)

    def __repr__(self) -> str:
        r = self.recipe
        return f"Run({r.kind}, {r.name!r}, step {r.step}/{r.total_steps}, {r.state})"

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- training a span

    def train(self, steps: int | None = None) -> TrainResult:
        """Take `steps` more optimizer steps (None: to the run's end) and return the result so far.

        The run pauses after them (state 'paused', nothing exported); at its last step it exports
        the adapter and ends ('done'), as `finetune` does. A stop request from the runs sidebar or a
        preemption ends it with a checkpoint. An interrupt pauses it at a step's start, on every rank.
        """
        r = self.recipe
        self._refuse_if_ended("train")
        if steps is not None and (
            not isinstance(steps, int) or isinstance(steps, bool) or steps < 1
        ):
            msg = f"Run.train(steps={steps!r}): steps must be an integer >= 1, or None for the rest of the run"
            raise ConfigError(msg)
        loop.hold(r)
        try:
            if self._begun:
                self._resume()
            else:
                loop.begin(r)
                self._begun = True
            self._mark(paused=False)
            until = r.total_steps if steps is None else r.step + steps
            if not loop.advance(r, until, r.train_step):
                loop.finish(r, stopped=True)
                self._end(f"it was stopped at step {r.step} on request")
            elif r.step >= r.total_steps:
                loop.finish(r)
                self._end(f"it reached its last step, {r.total_steps}")
            else:
                self._pause()
        except KeyboardInterrupt:
            # `loop.step_stats` (or GRPO's `_stop_now`) raises it on every rank at a step's start, with
            # the state 'stopped' and nothing of the step done: the run can go on from there
            if r.state == "stopped":
                self._pause()
            else:
                self._end(f"it was interrupted inside step {r.step + 1}", failed=True)
            raise
        except BaseException as e:
            self._end(f"it failed at step {r.step}: {type(e).__name__}: {e}", failed=True)
            raise
        return r.result()

    def _pause(self) -> None:
        r = self.recipe
        loop.release(r)
        self._rng = ckpt.get_rng_state()
        self._paused_at = time.perf_counter()
        r.state = "paused"
        live.end("paused")
        self._mark(paused=True)

    def _resume(self) -> None:
        """A later span: the training's random state back, train mode, the pause left out of the
        throughput, and the live display (in this cell) redrawn with the rows so far."""
        r = self.recipe
        if self._rng is not None:
            ckpt.set_rng_state(self._rng)
        r.model.train()
        r.meter.exclude(time.perf_counter() - self._paused_at)
        live.begin(
            total_steps=r.total_steps,
            name=r.name,
            kind=r.kind,
            loss_unit=loss_unit(r.kind),
            run_id=run_id_for(r.out),
        )
        for row in r.history:
            live.log(**row)

    def _end(self, why: str, failed: bool = False) -> None:
        r = self.recipe
        if failed and r.state == "paused":
            r.state = "failed"
        self._ended = why
        self._closed = True
        r.cleanup()

    def _mark(self, paused: bool) -> None:
        """The run's record says whether it waits for the next `train` call (rank 0)."""
        runlog = self.recipe.runlog
        if runlog is not None:
            from nbtrain.runs import update_run

            update_run(runlog.run_id, paused=paused, step=self.recipe.step)

    def _refuse_if_ended(self, what: str) -> None:
        if self._ended is not None or self._closed:
            why = self._ended or "it was closed"
            d = self.recipe.d
            msg = (
                f"Run.{what}: run {self.recipe.name!r} trains no more ({why}; rank {d.rank} on "
                f"{d.host}); make a new nbtrain.Run(cfg) (resume='latest' goes on from its last "
                "checkpoint)"
            )
            raise ConfigError(msg)

    # ---- between spans

    def set(self, **changes: Any) -> None:
        """Change settings between spans, on every rank alike: `learning_rate` (the schedule's peak: the
        next step's rate is the new peak times the schedule's factor at that step), `max_grad_norm`,
        `logging_steps`, `eval_steps`, `save_steps`; GRPO's `reward_funcs` and `reward_weights`.

        The model, the data, the batch, the schedule's kind and length, and the seed cannot change in a
        run: that is a new `nbtrain.Run`. A value is checked as the config checks it.
        """
        r = self.recipe
        self._refuse_if_ended("set")
        allowed = CHANGEABLE[r.kind]
        refused = sorted(k for k in changes if k not in allowed)
        if refused:
            msg = (
                f"Run.set cannot change {', '.join(refused)} of a {r.kind.upper()} run (rank "
                f"{r.d.rank} on {r.d.host}): the model, the data, the batch and the schedule's length "
                f"are set up once; it may change {', '.join(allowed)}. For another setting make a new "
                "nbtrain.Run(cfg)"
            )
            raise ConfigError(msg)
        if "reward_funcs" in changes and "reward_weights" not in changes:
            # weights given for the old functions would not fit the new ones
            changes["reward_weights"] = None
        # the config's own checks, on the config the run goes on with
        cfg = dataclasses.replace(r.cfg, **changes)
        if "reward_funcs" in changes or "reward_weights" in changes:
            from nbtrain.losses import rewards as grpo_rewards

            funcs, names = list(cfg.reward_funcs), cfg.func_names()  # type: ignore[attr-defined]
            r.d.agree(lambda: grpo_rewards.check(funcs, names, r.rows.columns))  # type: ignore[attr-defined]
            r.funcs, r.func_names = funcs, names  # type: ignore[attr-defined]
            r.weights = cfg.weights()  # type: ignore[attr-defined]
        if "learning_rate" in changes:
            self._set_peak(float(cfg.learning_rate))
        if "max_grad_norm" in changes:
            r.clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        for key in ("logging_steps", "eval_steps", "save_steps"):
            if key in changes:
                setattr(r, key, getattr(cfg, key))
        r.cfg = cfg
        r.config_dict = cfg.to_dict()
        if r.d.is_zero:
            shown = ", ".join(f"{k}={v!r}" for k, v in r.config_dict.items() if k in changes)
            print(f"nbtrain: from step {r.step}: {shown}", flush=True)
            ckpt.write_run_config(r.out, r.config_dict)

    def _set_peak(self, lr: float) -> None:
        """A new peak for the schedule: every scheduler transformers builds is a LambdaLR (rate = peak x
        factor(step)), so the next step's rate is `lr` x the factor the schedule has reached."""
        r = self.recipe
        r.learning_rate = lr
        sched, opt = r.scheduler, r.optimizer
        sched.base_lrs = [lr for _ in sched.base_lrs]
        rates = [lr * factor(sched.last_epoch) for factor in sched.lr_lambdas]
        for group, rate in zip(opt.param_groups, rates, strict=True):
            group["initial_lr"] = lr
            group["lr"] = rate
        sched._last_lr = rates

    def generate(
        self,
        prompts: Any,
        *,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        batch_size: int = 8,
        chat_template_kwargs: dict | None = None,
        engine: str = "hf",
    ) -> Any:
        """Completions of `prompts` from the weights as they are now (nothing reloaded), across the
        run's ranks: on rank 0 a DataFrame (prompt, completion, reference where known, tokens, seconds),
        None elsewhere. The arguments are `nbtrain.generate`'s; its draws leave the run's RNG alone.

        `engine="vllm"`: the rank's kept vLLM engine (the one the run's samples or rollouts use, or
        `nbtrain.generate(engine="vllm")` left) on the run's base, given the adapter's current weights
        in memory; for a run with shard="ddp" and no load_in_4bit.
        """
        from nbtrain.data.prompts import read_prompts
        from nbtrain.generation import decode, engines
        from nbtrain.generation.generate import frame

        r = self.recipe
        decoding = decode.Decoding(
            max_new_tokens, do_sample, temperature, top_p, top_k, seed, batch_size
        )
        problems = engines.call_problems(decoding, engine, chat_template_kwargs)
        if engine == "vllm" and (r.cfg.shard != "ddp" or r.cfg.load_in_4bit):
            problems.append(
                'engine="vllm" loads the base in full precision, whole, beside each rank: use it in '
                'a run with shard="ddp" and no load_in_4bit, or generate with engine="hf"'
            )
        if problems:
            lines = "\n".join(f"  - {p}" for p in problems)
            msg = f"invalid Run.generate arguments:\n{lines}"
            raise ConfigError(msg)
        entries = read_prompts(prompts)
        kwargs = chat_template_kwargs if chat_template_kwargs is not None else r.template_kwargs
        d = r.d
        tokenized = d.agree(lambda: decode.encode(entries, r.tokenizer, kwargs))
        rows = engines.from_model(
            r.peft_model,
            r.tokenizer,
            tokenized,
            d,
            decoding,
            engine=engine,
            synced=r.sharded and d.world > 1,
            autocast=r.autocast,
            model_path=r.cfg.model,
            lora=engines.LoraSpec(r=r.cfg.lora_r, alpha=r.cfg.lora_alpha),
        )
        return None if rows is None else frame([("completion", rows)])

    # ---- writing

    def save(self) -> str:
        """A checkpoint of the step reached, in output_dir (atomic; `resume='latest'` goes on from it);
        returns its folder on every rank."""
        r = self.recipe
        if not self._begun:
            msg = f"Run.save: run {r.name!r} has not trained yet; call run.train(steps=...) first"
            raise ConfigError(msg)
        self._with_training_rng(lambda: r.save_checkpoint(r.step))
        return str(r.out / f"checkpoint-{r.step}")

    def export(self) -> str | None:
        """The adapter of the weights as they are now in output_dir/adapter (and with merge=True the
        merged model), written by rank 0 atomically; returns its folder on rank 0, None elsewhere."""
        r = self.recipe
        r.export()
        r.d.barrier()
        return r.adapter_dir if r.d.is_zero else None

    def close(self) -> None:
        """End a run that has not reached its last step: a checkpoint of the step reached (to resume
        from), its record 'stopped' at that step. A run that ended already is left as it is."""
        if self._closed:
            return
        r = self.recipe
        self._closed = True
        self._ended = "it was closed"
        loop.release(r)
        fields: dict[str, Any] = {}
        if self._begun and r.last_saved != r.step:
            self._with_training_rng(lambda: r.save_checkpoint(r.step))
        if self._begun:
            r.checkpoint = str(r.out / f"checkpoint-{r.step}")
            fields = {"step": r.step, "checkpoint": r.checkpoint}
        r.state = "stopped"
        if r.runlog is not None:
            r.runlog.finish("stopped", paused=False, **fields)

    def _with_training_rng(self, fn: Any) -> None:
        """`fn` with the training's random state in place (a checkpoint stores it), the caller's after."""
        if self._rng is None:
            fn()
            return
        current = ckpt.get_rng_state()
        ckpt.set_rng_state(self._rng)
        try:
            fn()
        finally:
            ckpt.set_rng_state(current)
