"""The set-up phase every training recipe shares: the settings read once, then the rows, the model (LoRA
or QLoRA, sharded or not), the batch plan, output_dir and its trackers, the optimizer and schedule, and
resuming. `nbtrain.recipes.sft.SFTRecipe` adds the loop and the saves on top.

Everything that can be wrong is found here, on every rank, before any write: only at its end does rank 0
open output_dir. SFT, DPO and GRPO would share this and differ in their step.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.data import tokens
from nbtrain.data.batch import BatchPlan, split_global
from nbtrain.engine.dist import Dist
from nbtrain.errors import ConfigError
from nbtrain.model import build as model_build
from nbtrain.model import checkpoint as ckpt
from nbtrain.model import memory, quant, shard, speed
from nbtrain.model.build import build_model
from nbtrain.recipes import step as one_step
from nbtrain.recipes.span import Span, run_span
from nbtrain.telemetry import commtime, tracking
from nbtrain.telemetry.report import RunLog, read_history


class RunSetup:
    """A run's settings (read from `cfg` once, here) and its set-up phase, `setup()`, on this rank.

    `group` trains on a sub-group of the running process group (its ranks are the run's ranks 0..n-1).
    """

    #: what the run trains, in its record (`nbtrain.runs.RUN_KINDS`): a recipe sets its own
    kind = "sft"

    def __init__(self, cfg: SFTConfig, group: Any = None) -> None:
        if not isinstance(cfg, SFTConfig):
            msg = f"finetune needs an nbtrain.SFTConfig, got {type(cfg).__name__}; build one with nbtrain.SFTConfig(...)"
            raise ConfigError(msg)
        self.cfg = cfg
        self.group = group
        # the settings the recipe itself uses, read here once; the modules it calls read their own
        self.out = Path(cfg.output_dir).expanduser()
        self.shard_kind = cfg.shard
        self.sharded = cfg.shard != "ddp"
        self.name = cfg.run_name or self.out.name
        self.config_dict = cfg.to_dict()
        self.model_name = cfg.model
        self.eval_data = cfg.eval_data
        self.data = cfg.data
        self.data_cache = cfg.data_cache
        self.template_kwargs = cfg.chat_template_kwargs
        self.auto_batch = cfg.per_device_train_batch_size == "auto"
        self.global_batch_size = cfg.global_batch_size
        self.max_length = cfg.max_length
        self.truncation_side = cfg.truncation_side
        self.packing = cfg.packing
        self.padding_free = cfg.padding_free
        self.seed = cfg.seed
        self.torch_compile = cfg.torch_compile
        self.overwrite = cfg.overwrite
        self.learning_rate = cfg.learning_rate
        self.lr_scheduler_type = cfg.lr_scheduler_type
        self.warmup_steps = cfg.warmup_steps
        self.clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        self.logging_steps = cfg.logging_steps
        self.eval_steps = cfg.eval_steps
        self.save_steps = cfg.save_steps
        self.save_total_limit = cfg.save_total_limit
        # what the set-up fills in
        self.runlog: RunLog | None = None
        self.history: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.levers: list[str] = []

    def setup(self) -> None:
        """Check the settings and the data, load the rows, the model (LoRA or QLoRA, sharded or not), plan
        the batch, open output_dir and its trackers, and build the optimizer and schedule (or resume them)."""
        cfg = self.cfg
        d = self.d = Dist(self.group)
        # refusals first; the mesh's collectives run on every rank alike, outside the set-up's try
        shard_note = d.agree(lambda: shard.check_shard(cfg, d))
        mesh = d.agree(lambda: shard.make_mesh(d, cfg.shard, self.group)) if self.sharded else None
        checked = d.agree(self._check)
        self.tokenizer = checked["tokenizer"]
        self.eval_rows = checked["eval_rows"]
        # the rows, tokenized once across the ranks (or read from the token cache), before the model
        store = self.prepare_rows(checked["source"])
        self._load_model(mesh, [n for n in (shard_note, checked["fits"]) if n])
        # the base model's own KV-cache setting (training turns it off), for the merged export
        self.use_cache = getattr(checked["base_config"], "use_cache", None)
        self._plan(len(store))
        self._batches(store)
        self._compile()
        if d.is_zero:
            for note in self.notes:
                print(f"nbtrain: {note}", flush=True)
        self._resume_point(checked["resume_from"])
        self._open_output()
        self._optimizer()

    def prepare_rows(self, source: Any) -> Any:
        """The training rows as a token store, tokenized once across the ranks (or read from the token
        cache); a recipe with other rows (DPO's pairs) tokenizes them its own way here."""
        return tokens.prepare(source, self.tokenizer, self.d, self.data_cache, self.template_kwargs)

    def _check(self) -> dict[str, Any]:
        from nbtrain.data.loader import load_rows
        from nbtrain.data.sources import Source
        from nbtrain.model.pretrained import check_causal_lm, load_tokenizer

        d, cfg = self.d, self.cfg
        if not d.is_zero or os.environ.get("NBTRAIN_ENGINE") == "1":
            # N copies of the same "Loading weights" bar would bury rank 0's output in the cell, and on
            # an engine even rank 0's bar is a notebook widget the client cannot draw: the live display
            # already shows progress
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        resume_from = ckpt.check_output_dir(cfg) if d.is_zero else None
        source = Source(self.data, "data")
        eval_rows = load_rows(self.eval_data, "eval_data") if self.eval_data is not None else None
        base_config = check_causal_lm(self.model_name)
        tokenizer = load_tokenizer(self.model_name)
        quant.check_quant(cfg, d.device, d.rank, d.host)
        if getattr(cfg, "sample_engine", "hf") == "vllm" and getattr(cfg, "sample_prompts", None):
            # samples through vLLM: its versions are checked here, before the model loads
            from nbtrain.generation import engines

            engines.check_vllm(d.rank, d.host)
        self.quantized = quant.quantized(cfg)
        fits = memory.check_fits(cfg, base_config, d.device, d.world)
        return {
            "resume_from": resume_from,
            "source": source,
            "tokenizer": tokenizer,
            "eval_rows": eval_rows,
            "base_config": base_config,
            "fits": fits,
        }

    def _load_model(self, mesh: Any, notes: list[str]) -> None:
        """The model on this rank (LoRA on the base: whole, sharded or quantised), its dtypes and loss."""
        import torch

        d, cfg = self.d, self.cfg

        def load() -> tuple[Any, Any, list[str], list[str]]:
            compute_dtype = model_build.compute_dtype(cfg, d.device)
            weights_dtype = (
                compute_dtype if d.device.type == "cuda" and compute_dtype else torch.float32
            )
            t0 = time.perf_counter()
            if d.is_zero:
                print(f"nbtrain: loading {self.model_name} on {d.world} rank(s)", flush=True)
            model, more, levers = build_model(cfg, d, mesh, weights_dtype, compute_dtype)
            if d.is_zero:
                print(f"nbtrain: model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            return model, compute_dtype, notes + more, levers

        self.model, self.compute_dtype, self.notes, self.levers = d.agree(load)
        # the unwrapped peft model (the loop's `model` may be DDP around it)
        self.peft_model = self.model
        loss_name, self.loss_fn, loss_note = one_step.loss_impl(
            cfg, self.model, d.device, self.autocast
        )
        if loss_note:
            self.notes.append(loss_note)
        self.levers.append(f"loss {loss_name}")

    def autocast(self) -> Any:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.d.device.type, dtype=self.compute_dtype)

    def loss_sum(self, net: Any, batch: dict[str, Any]) -> Any:
        # through the module, so a test can wrap nbtrain.recipes.step.loss_sum to slow or kill a rank mid-step
        return one_step.loss_sum(net, batch, self.autocast, self.loss_fn)

    def _plan(self, n_rows: int) -> None:
        """The batch plan: micro-batch and accumulation steps (measured where 'auto')."""
        d = self.d
        plan = d.agree(lambda: one_step.plan_batch(self.cfg, d, self.model, self.loss_sum, n_rows))
        if self.auto_batch:
            agreed = d.min_int(plan.micro_batch)
            if agreed != plan.micro_batch:
                accum = (
                    plan.grad_accum
                    if self.global_batch_size is None
                    else split_global(self.global_batch_size, d.world, agreed)
                )
                plan = BatchPlan(agreed, accum, d.world * agreed * accum, plan.note)
        if plan.note:
            self.notes.append(plan.note)
        self.plan = plan

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

    def _compile(self) -> None:
        """torch_compile=True: compile each block of the base model (a lever, or a note why not)."""
        if self.torch_compile:
            why_not = speed.compile_layers(self.model.get_base_model())
            if why_not is None:
                self.levers.append("torch.compile")
            else:
                self.notes.append(why_not)

    def _resume_point(self, resume_from: str | None) -> None:
        """Rank 0 reads the checkpoint and hands it to the others (they may not see its disk); every tensor
        in it is on the CPU, so none lands on another rank's GPU. Then the run's span."""
        d, plan = self.d, self.plan
        self.resume_from = d.broadcast_object(resume_from)
        resumed: dict[str, Any] | None = None
        if self.resume_from is not None:
            where = self.resume_from
            resumed = d.agree(lambda: ckpt.load_checkpoint(where) if d.is_zero else None)
            resumed = d.broadcast_object(resumed)
        if resumed:
            shard.check_resume(self.cfg, resumed["state"], self.resume_from)
        self.resumed = resumed
        self.start_step = int(resumed["state"]["global_step"]) if resumed else 0
        # every rank has the same checkpoint and plan, so every rank raises here alike, before any write
        self.span: Span = run_span(
            self.cfg,
            self.spe,
            self.batches.n_units,
            d.world * plan.micro_batch * plan.grad_accum,
            resumed,
            self.resume_from,
        )
        self.total_steps = self.span.total
        if resumed and resumed["state"].get("global_batch_size") != plan.global_batch and d.is_zero:
            print(
                f"nbtrain: resuming with a global batch of {plan.global_batch} rows where the "
                f"checkpoint used {resumed['state'].get('global_batch_size')}; the data goes on from "
                f"the rows the checkpoint had consumed, and the run ends at step {self.total_steps}",
                flush=True,
            )

    def _open_output(self) -> None:
        """From here on rank 0 writes to output_dir. report_to's TensorBoard and MLflow first: one that
        cannot be opened stops every rank here."""
        d, out, resumed = self.d, self.out, self.resumed

        def open_trackers() -> tracking.Trackers | None:
            if not d.is_zero:
                return None
            at, before = (
                (self.start_step, read_history(out, self.start_step)) if resumed else (None, [])
            )
            return tracking.open_trackers(self.cfg, out, self.name, d.world, at, before)

        trackers = d.agree(open_trackers)
        history: list[dict[str, Any]] = []
        if d.is_zero:
            if self.overwrite:
                ckpt.clear_output_dir(out)
            out.mkdir(parents=True, exist_ok=True)
            ckpt.write_run_config(out, self.config_dict)
            history = read_history(out, self.start_step) if resumed else []
            self.runlog = RunLog(
                out, history, self.name, self.total_steps, d.world, trackers, kind=self.kind
            )
        self.history = d.broadcast_object(history)

    def _optimizer(self) -> None:
        """DDP around the model (unsharded), AdamW, the schedule; on resume their states and the RNG."""
        import torch
        from peft import set_peft_model_state_dict
        from transformers import get_scheduler

        d, resumed, span = self.d, self.resumed, self.span
        if resumed and not self.sharded:
            set_peft_model_state_dict(self.peft_model, resumed["adapter"])
        self.trainable = [p for p in self.peft_model.parameters() if p.requires_grad]
        if d.active and not self.sharded:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(
                self.peft_model,
                device_ids=[d.device.index] if d.device.type == "cuda" else None,
                process_group=d.group,
            )
            # a no-op unless a scaling run is timing it
            commtime.attach(self.model, d.group, self.trainable)
        self.optimizer = torch.optim.AdamW(self.trainable, lr=self.learning_rate, weight_decay=0.0)
        self.scheduler = get_scheduler(
            self.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=self.warmup_steps,
            num_training_steps=span.schedule_length,
        )
        if resumed:
            if (
                self.sharded
            ):  # every rank reads its own shards of the adapter and the optimizer state
                shard.load_sharded(
                    Path(str(self.resume_from)) / shard.SHARDED_DIR,
                    self.model,
                    self.optimizer,
                    d.group,
                )
            else:
                self.optimizer.load_state_dict(resumed["optimizer"])
            # the schedule's position is the span's, not the step the checkpoint's schedule was at
            saved_schedule = {**resumed["scheduler"], "last_epoch": span.schedule_start}
            ckpt.restore_schedule(self.scheduler, self.optimizer, saved_schedule)
            rng = resumed["rng"]
            if d.rank < len(rng):
                ckpt.set_rng_state(rng[d.rank])
            else:
                torch.manual_seed(self.seed + 1 + d.rank)
        else:
            # dropout masks differ across ranks, as distinct samples would get
            torch.manual_seed(self.seed + 1 + d.rank)
        self.n_eval = len(self.evals or [])
        if self.sharded and self.evals is not None:
            self.n_eval = -d.min_int(-self.n_eval)
        self.micro0 = self.batches.micro_batch(0, 0)[:1]
