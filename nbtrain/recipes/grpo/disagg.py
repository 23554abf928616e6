"""Disaggregated GRPO, the part of `nbtrain.recipes.grpo.recipe.GRPORecipe` only its two rank groups run,
as a component the recipe holds (`recipe.disagg`): the handshake after set-up (both groups' set-up
errors, the actor's plan, its first adapter), a rollout rank's set-up and loop, and the exchange of each
actor step (the completions in, the adapter out: `nbtrain.recipes.grpo.link`).

The rollout group samples and scores step s + 1 with the adapter of step s while the actor group trains
step s, then loads the adapter of step s + 1: a step's completions are one optimizer step old at most.

With `engine="vllm"` the ranks that sample (every rank collocated, the rollout group disaggregated)
start their vLLM engine at the end of set-up (`GRPORecipe.start_engine`); the adapter reaches it from
the rank's own model before each step's sampling (`rollout.generate_part`), which disaggregated is the
adapter the actor broadcast after its step. The actor group starts none.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nbtrain.engine.signals.preempt import Preempted
from nbtrain.errors import ConfigError
from nbtrain.losses import grpo as grpo_loss
from nbtrain.recipes import run_setup
from nbtrain.recipes.grpo import rollout as grpo_rollout
from nbtrain.recipes.grpo.rollout import PromptOrder, RewardFunctionError, Scored
from nbtrain.recipes.saves import TrainResult

log = logging.getLogger(__name__)


class Disaggregated:
    """This rank's side of a disaggregated GRPO run (`role` "actor" or "rollout"), over the recipe `r`
    it belongs to: its model, rows and rollouts are the recipe's."""

    def __init__(self, r: Any, role: str, actor_ranks: list[int], rollout_ranks: list[int]) -> None:
        self.r = r
        self.role = role
        self.actor_ranks, self.rollout_ranks = actor_ranks, rollout_ranks
        self.link: Any = None
        #: the actor's place in the exchange: "await_batch" (the rollout is sampling the next step),
        #: "owe_weights" (it waits for the adapter), "done" (it was told the run is over)
        self.link_state = "await_batch"
        #: the rollout group failed and raised (so it waits for nothing more from the actor)
        self.rollout_failed = False
        #: a rollout rank's data step minus its optimizer step (the actor's span's shift)
        self.shift = 0

    # ---- set-up

    def setup_rollout(self) -> None:
        """A rollout rank's set-up: the checks, the prompt rows and the model with its adapter; no
        optimizer, no output. Then the handshake: the actor's plan, and its adapter."""
        r = self.r
        err: BaseException | None = None
        try:
            from nbtrain.engine.dist import Dist

            d = r.d = Dist(r.group)
            checked = d.agree(r._check)
            r.tokenizer = checked["tokenizer"]
            r.rows = r._rows(checked["source"])
            run_setup.load_model(r, None, [])
            r.trainable = [p for p in r.peft_model.parameters() if p.requires_grad]
            r.start_engine()
        except BaseException as e:  # told to the actor group in the handshake, then raised
            err = e
        self.handshake(err)
        if err is not None:
            raise err

    def handshake(self, err: BaseException | None) -> None:
        """Both groups say whether their set-up worked (all raise if one failed); the actor's plan
        reaches the rollout, then the actor's first adapter."""
        from nbtrain.recipes.grpo import link as grpo_link

        r = self.r
        self.link = grpo_link.Link(self.actor_ranks, self.rollout_ranks)
        mine: dict[str, Any] = {"error": None if err is None else f"{type(err).__name__}: {err}"}
        if err is None and self.role == "actor":
            mine.update(
                start=r.start_step,
                total=r.total_steps,
                shift=r.span.shift,
                per_step=r.order.per_step,
                spe=r.spe,
            )
        import torch.distributed as dist

        reports = self.link.gather((dist.get_rank(), mine))
        failed = [(k, m["error"]) for k, m in reports if m["error"]]
        if failed and err is None:
            if r.runlog is not None:
                r.runlog.finish("failed")
            k, text = failed[0]
            msg = f"rank {k} failed during set-up: {text}"
            raise ConfigError(msg)
        if failed:
            return
        plan = next(m for k, m in reports if k == self.link.actor0)
        if self.role == "rollout":
            r.start_step, r.total_steps = plan["start"], plan["total"]
            r.order = PromptOrder(len(r.rows), plan["per_step"], r.seed)
            self.shift = plan["shift"]
        self.weights(more=True)
        self.link_state = "await_batch"

    # ---- the actor's side of a step

    def receive(self) -> dict[str, Any]:
        """The rollout group's message of the step (its scored completions, its times; the actor waits
        for it); raises the rollout's failure."""
        message = self.link.object(None, src=self.link.rollout0)
        self.link_state = "owe_weights"
        if message["error"]:
            self.rollout_failed = True
            raise RewardFunctionError(message["error"])
        return message

    def send(self, more: bool) -> None:
        """The adapter after the actor's step, and whether another step follows; waits until the
        rollout has sampled the next step's completions."""
        self.weights(more)
        self.link_state = "await_batch" if more else "done"

    def release(self, failure: str | None) -> None:
        """The actor's end of the exchange, however its loop ended: take the completions the rollout
        is sampling, tell it no step follows, then send the history (and the failure, if any)."""
        if self.link_state == "await_batch":
            taken = self.link.object(None, src=self.link.rollout0)
            if taken["error"]:  # the rollout raised after sending it, and waits for nothing more
                return
            self.link_state = "owe_weights"
        if self.link_state == "owe_weights":
            self.weights(False)
            self.link_state = "done"
        self.link.object({"history": self.r.history, "failure": failure}, src=self.link.actor0)

    def weights(self, more: bool) -> bool:
        """The adapter's one broadcast from actor rank 0 (sent, kept, or loaded on a rollout rank) with
        the flag whether another step follows; returns that flag."""
        import torch.distributed as dist

        if self.role == "rollout":
            mode = "load"
        else:
            mode = "send" if dist.get_rank() == self.link.actor0 else "keep"
        return bool(self.link.weights(self.r.trainable, more, mode))

    # ---- the rollout's loop

    def serve(self) -> None:
        """A rollout rank's loop: sample and score step s + 1 while the actor trains step s, send it,
        load the adapter the actor sends after its step; until the actor says it is done."""
        r = self.r
        r.state = "failed"
        step, wait = r.start_step, None
        is_src = r.d.is_zero
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
            later = self._remote(step) if step < r.total_steps else (None, 0.0, None)
            t0 = time.perf_counter()
            more = self.weights(False)
            wait = sent + time.perf_counter() - t0
            if not more:
                break
            scored, gen_s, error = later
        r.step = step
        end = self.link.object(None, src=self.link.actor0)
        r.history = end["history"]
        if end["failure"] and end["failure"].startswith(f"{Preempted.__name__}: "):
            # every rank raises the same Preempted, whichever group got the signal
            r.state = "preempted"
            raise Preempted(end["failure"].split(": ", 1)[1])
        if end["failure"]:
            msg = (
                f"the actor group (rank {self.link.actor0} first) stopped the run: {end['failure']}"
            )
            raise RuntimeError(msg)
        done = bool(r.history) and r.history[-1].get("step") == r.total_steps
        r.state = "done" if done else "stopped"

    def _remote(self, step: int) -> tuple[Scored | None, float, str | None]:
        """The rollout group's completions of `step`, scored, with their log-probabilities under the
        adapter that sampled them; or the first failure's message."""
        r = self.r
        d = r.d
        prompts = r.order.step(step + self.shift)
        n = len(prompts) * r.G
        part, report = None, None
        try:
            part = r._part(prompts, step + self.shift, grpo_rollout.share(n, d.rank, d.world))
            self._old_logps(part)
        except Exception as e:  # sent to the actor, which raises it on every rank (`receive`)
            report = str(e) if isinstance(e, RewardFunctionError) else f"{type(e).__name__}: {e}"
        got = d.gather_objects((part, report))
        failed = [rep for _, rep in got if rep is not None]
        if failed:
            return None, 0.0, failed[0]
        parts = [p for p, _ in got]
        scored = grpo_rollout.finish(parts, r.func_names, r.weights, r.G, r.scale)
        return scored, max(p.seconds for p in parts), None

    def _old_logps(self, part: grpo_rollout.Part) -> None:
        """The sampling adapter's log-probabilities of the part's completions (the ratio's old policy)."""
        import torch

        r = self.r
        t0 = time.perf_counter()
        out: list[list[float]] = []
        size = max(int(r.cfg.per_device_train_batch_size), 1)
        r.peft_model.eval()
        try:
            for b in range(0, len(part.texts), size):
                sl = slice(b, b + size)
                batch = grpo_rollout.collate(
                    part.prompt_ids[sl],
                    part.completion_ids[sl],
                    [0.0] * len(part.texts[sl]),
                    part.truncated[sl],
                    r.tokenizer.pad_token_id,
                    False,
                )
                batch = {k: v.to(r.d.device) for k, v in batch.items()}
                with torch.no_grad():
                    lp = grpo_loss.token_logps(
                        r.peft_model,
                        batch,
                        r.autocast,
                        r.loss_settings.temperature,
                        r.loss_fn is not None,
                    )
                out += [lp[i, : len(c)].tolist() for i, c in enumerate(part.completion_ids[sl])]
        finally:
            r.peft_model.train()
        part.old_logps = out
        part.seconds += time.perf_counter() - t0

    def rollout_result(self) -> TrainResult:
        """A rollout rank's `TrainResult`: the actor's history, no adapter of its own."""
        import pandas as pd

        r = self.r
        return TrainResult(
            history=pd.DataFrame(r.history),
            adapter_dir=None,
            output_dir=str(r.out),
            metrics=dict(r.history[-1]) if r.history else {},
            global_step=r.step,
            state=r.state,
            plan={"role": "rollout"},
        )
