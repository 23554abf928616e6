"""Disaggregated GRPO, the parts of `nbtrain.recipes.grpo.recipe.GRPORecipe` only its two rank groups run:
the handshake after set-up (both groups' set-up errors, the actor's plan, its first adapter), a rollout
rank's set-up and loop, and the adapter sent after each actor step (`nbtrain.recipes.grpo.link`).

The rollout group samples and scores step s + 1 with the adapter of step s while the actor group trains
step s, then loads the adapter of step s + 1: a step's completions are one optimizer step old at most.

With `engine="vllm"` the ranks that sample (every rank collocated, the rollout group disaggregated)
start their vLLM engine at the end of set-up (`rollout.rollout_engine`); the adapter reaches it from
the rank's own model before each step's sampling (`rollout.generate_part`), which disaggregated is the
adapter the actor broadcast after its step. The actor group starts none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nbtrain.engine.signals.preempt import Preempted
from nbtrain.errors import ConfigError
from nbtrain.losses import grpo as grpo_loss
from nbtrain.recipes.grpo import rollout as grpo_rollout
from nbtrain.recipes.grpo.rollout import PromptOrder, PromptRows, RewardFunctionError, Scored
from nbtrain.recipes.sft import SFTRecipe, TrainResult


class Disaggregated(SFTRecipe):
    """The disaggregated placement's methods of `GRPORecipe`, which subclasses this."""

    # set by GRPORecipe
    role: str
    link: Any
    link_state: str
    actor_ranks: list[int]
    rollout_ranks: list[int]
    rows: PromptRows
    order: PromptOrder
    shift: int
    G: int
    func_names: list[str]
    weights: list[float]
    scale: str
    loss_settings: grpo_loss.LossSettings
    _part: Callable[..., grpo_rollout.Part]
    decoding: Any

    def _setup_rollout(self) -> None:
        """A rollout rank's set-up: the checks, the prompt rows and the model with its adapter; no
        optimizer, no output. Then the handshake: the actor's plan, and its adapter."""
        err: BaseException | None = None
        try:
            from nbtrain.engine.dist import Dist

            d = self.d = Dist(self.group)
            checked = d.agree(self._check)
            self.tokenizer = checked["tokenizer"]
            self.rows = self.prepare_rows(checked["source"])
            self._load_model(None, [])
            self.trainable = [p for p in self.peft_model.parameters() if p.requires_grad]
            self._start_engine()
        except BaseException as e:
            err = e
        self._handshake(err)
        if err is not None:
            raise err

    def _check(self) -> dict[str, Any]:
        # GRPORecipe's checks call this, on every rank under d.agree, before any model loads: the
        # ranks that will sample through vLLM check it is installed in versions that work together
        if getattr(self.cfg, "engine", "hf") == "vllm" and self.role != "actor":
            from nbtrain.engine.rank import get_rank
            from nbtrain.generation import engines

            engines.check_vllm(get_rank(), self.d.host)
        checked: dict[str, Any] = super()._check()
        return checked

    def setup(self) -> None:
        # GRPORecipe's set-up of a collocated or actor rank runs this (a rollout rank's runs
        # _setup_rollout instead); collocated, every rank samples, so every rank starts its engine
        super().setup()
        if self.role == "collocated":
            self.d.agree(self._start_engine)

    def _start_engine(self) -> None:
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

    def _handshake(self, err: BaseException | None) -> None:
        """Both groups say whether their set-up worked (all raise if one failed); the actor's plan
        reaches the rollout, then the actor's first adapter."""
        from nbtrain.recipes.grpo import link as grpo_link

        self.link = grpo_link.Link(self.actor_ranks, self.rollout_ranks)
        mine: dict[str, Any] = {"error": None if err is None else f"{type(err).__name__}: {err}"}
        if err is None and self.role == "actor":
            mine.update(
                start=self.start_step,
                total=self.total_steps,
                shift=self.span.shift,
                per_step=self.order.per_step,
                spe=self.spe,
            )
        import torch.distributed as dist

        reports = self.link.gather((dist.get_rank(), mine))
        failed = [(r, m["error"]) for r, m in reports if m["error"]]
        if failed and err is None:
            if self.runlog is not None:
                self.runlog.finish("failed")
            r, text = failed[0]
            msg = f"rank {r} failed during set-up: {text}"
            raise ConfigError(msg)
        if failed:
            return
        plan = next(m for r, m in reports if r == self.link.actor0)
        if self.role == "rollout":
            self.start_step, self.total_steps = plan["start"], plan["total"]
            self.order = PromptOrder(len(self.rows), plan["per_step"], self.seed)
            self.shift = plan["shift"]
        self._weights(more=True)
        #: the actor's place in the exchange: "await_batch" (the rollout is sampling the next step),
        #: "owe_weights" (it waits for the adapter), "done" (it was told the run is over)
        self.link_state = "await_batch"

    def _release(self, failure: str | None) -> None:
        """The actor's end of the exchange, however its loop ended: take the completions the rollout
        is sampling, tell it no step follows, then send the history (and the failure, if any)."""
        if self.link_state == "await_batch":
            taken = self.link.object(None, src=self.link.rollout0)
            if taken["error"]:  # the rollout raised after sending it, and waits for nothing more
                return
            self.link_state = "owe_weights"
        if self.link_state == "owe_weights":
            self._weights(False)
            self.link_state = "done"
        self.link.object({"history": self.history, "failure": failure}, src=self.link.actor0)

    def _weights(self, more: bool) -> bool:
        import torch.distributed as dist

        if self.role == "rollout":
            mode = "load"
        else:
            mode = "send" if dist.get_rank() == self.link.actor0 else "keep"
        return self.link.weights(self.trainable, more, mode)

    # ---- the loop: one step

    def serve(self) -> None:
        """A rollout rank's loop: sample and score step s + 1 while the actor trains step s, send it,
        load the adapter the actor sends after its step; until the actor says it is done."""
        self.state = "failed"
        step, wait = self.start_step, None
        is_src = self.d.is_zero
        scored, gen_s, error = self._remote(step)
        while True:
            # the rollout's wait: in handing over the completions and in taking the adapter (each
            # blocks until the actor takes part), reported with the next step's completions
            message = {"error": error, "scored": scored, "gen_s": gen_s, "rollout_wait_s": wait}
            t0 = time.perf_counter()
            self.link.object(message if is_src else None, src=self.link.rollout0)
            sent = time.perf_counter() - t0
            if error:
                raise RewardFunctionError(error)
            step += 1
            later = self._remote(step) if step < self.total_steps else (None, 0.0, None)
            t0 = time.perf_counter()
            more = self._weights(False)
            wait = sent + time.perf_counter() - t0
            if not more:
                break
            scored, gen_s, error = later
        self.step = step
        end = self.link.object(None, src=self.link.actor0)
        self.history = end["history"]
        if end["failure"] and end["failure"].startswith(f"{Preempted.__name__}: "):
            # every rank raises the same Preempted, whichever group got the signal
            self.state = "preempted"
            raise Preempted(end["failure"].split(": ", 1)[1])
        if end["failure"]:
            msg = (
                f"the actor group (rank {self.link.actor0} first) stopped the run: {end['failure']}"
            )
            raise RuntimeError(msg)
        done = bool(self.history) and self.history[-1].get("step") == self.total_steps
        self.state = "done" if done else "stopped"

    def _remote(self, step: int) -> tuple[Scored | None, float, str | None]:
        """The rollout group's completions of `step`, scored, with their log-probabilities under the
        adapter that sampled them; or the first failure's message."""
        d = self.d
        prompts = self.order.step(step + self.shift)
        n = len(prompts) * self.G
        part, report = None, None
        try:
            part = self._part(prompts, step + self.shift, grpo_rollout.share(n, d.rank, d.world))
            self._old_logps(part)
        except Exception as e:
            report = str(e) if isinstance(e, RewardFunctionError) else f"{type(e).__name__}: {e}"
        got = d.gather_objects((part, report))
        failed = [rep for _, rep in got if rep is not None]
        if failed:
            return None, 0.0, failed[0]
        parts = [p for p, _ in got]
        scored = grpo_rollout.finish(parts, self.func_names, self.weights, self.G, self.scale)
        return scored, max(p.seconds for p in parts), None

    def _old_logps(self, part: grpo_rollout.Part) -> None:
        """The sampling adapter's log-probabilities of the part's completions (the ratio's old policy)."""
        import torch

        t0 = time.perf_counter()
        out: list[list[float]] = []
        size = max(int(self.cfg.per_device_train_batch_size), 1)
        self.peft_model.eval()
        try:
            for b in range(0, len(part.texts), size):
                sl = slice(b, b + size)
                batch = grpo_rollout.collate(
                    part.prompt_ids[sl],
                    part.completion_ids[sl],
                    [0.0] * len(part.texts[sl]),
                    part.truncated[sl],
                    self.tokenizer.pad_token_id,
                    False,
                )
                batch = {k: v.to(self.d.device) for k, v in batch.items()}
                with torch.no_grad():
                    lp = grpo_loss.token_logps(
                        self.peft_model, batch, self.autocast, self.loss_settings.temperature
                    )
                out += [lp[i, : len(c)].tolist() for i, c in enumerate(part.completion_ids[sl])]
        finally:
            self.peft_model.train()
        part.old_logps = out
        part.seconds += time.perf_counter() - t0

    def result(self) -> TrainResult:
        if self.role != "rollout":
            return super().result()
        import pandas as pd

        return TrainResult(
            history=pd.DataFrame(self.history),
            adapter_dir=None,
            output_dir=str(self.out),
            metrics=dict(self.history[-1]) if self.history else {},
            global_step=self.step,
            state=self.state,
            plan={"role": "rollout"},
        )
