"""The set-up phase every recipe shares, as a component the recipe calls: the checks, then the rows,
the model (LoRA or QLoRA, sharded or not), the batch plan, the resume point, output_dir and its
trackers, the optimizer and schedule.

In [1]: run_setup.setup(recipe, check=recipe._check, rows=recipe._rows, batches=recipe._batches)

A recipe's `setup()` calls `setup` with what is its own (its checks, how its rows are read, its batches;
GRPO its compile note), or the phases one by one (a disaggregated GRPO rollout rank: `check`,
`load_model`). Each phase fills in attributes of the recipe (`nbtrain.recipes.base.Recipe` lists them)
from the settings it read from its config.

Everything that can be wrong is found here, on every rank, before any write: only at its end does rank 0
open output_dir.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbtrain.data.batch import BatchPlan, split_global
from nbtrain.engine.dist import Dist
from nbtrain.errors import ConfigError
from nbtrain.losses.router import RouterAux
from nbtrain.losses.router import check as router_check
from nbtrain.model import build as model_build
from nbtrain.model import checkpoint as ckpt
from nbtrain.model import memory, quant, shard, speed
from nbtrain.model.build import build_model
from nbtrain.recipes import step as one_step
from nbtrain.recipes.span import run_span
from nbtrain.telemetry import commtime, tracking
from nbtrain.telemetry.report import RunLog, read_history

log = logging.getLogger(__name__)


def setup(
    r: Any,
    *,
    check: Callable[[], dict[str, Any]],
    rows: Callable[[Any], Any],
    batches: Callable[[Any], None],
    compile_model: Callable[[], None] | None = None,
) -> None:
    """Check the settings and the data, load the rows, the model (LoRA or QLoRA, sharded or not), plan
    the batch, open output_dir and its trackers, and build the optimizer and schedule (or resume them).

    The recipe's own parts: `check()` (its checks on every rank, under `Dist.agree`, returning
    `check`'s dict), `rows(source)` (the training rows as a store), `batches(store)` (sets
    `batches`, `evals` and `spe`), `compile_model()` (default `compile_blocks`)."""
    cfg = r.cfg
    d = r.d = Dist(r.group)
    # refusals first; the mesh's collectives run on every rank alike, outside the set-up's try
    shard_note = d.agree(lambda: shard.check_shard(cfg, d))
    mesh = d.agree(lambda: shard.make_mesh(d, cfg.shard, r.group)) if r.sharded else None
    checked = d.agree(check)
    r.tokenizer = checked["tokenizer"]
    r.eval_rows = checked["eval_rows"]
    # the rows, tokenized once across the ranks (or read from the token cache), before the model
    store = rows(checked["source"])
    load_model(r, mesh, [n for n in (shard_note, checked["fits"]) if n])
    # the base model's own KV-cache setting (training turns it off), for the merged export
    r.use_cache = getattr(checked["base_config"], "use_cache", None)
    plan_batch(r, len(store))
    batches(store)
    if compile_model is None:
        compile_blocks(r)
    else:
        compile_model()
    if d.is_zero:
        for note in r.notes:
            print(f"nbtrain: {note}", flush=True)
    resume_point(r, checked["resume_from"])
    open_output(r)
    build_optimizer(r)
    log.debug("%s run %s set up: steps %d..%d", r.kind, r.name, r.start_step, r.total_steps)


def check(r: Any, read_eval: bool = True) -> dict[str, Any]:
    """The checks every recipe shares (output_dir, the data, the model, quantisation, memory), run on
    every rank under `Dist.agree`: the tokenizer, the data source, the eval rows (where `read_eval`:
    SFT's row formats; DPO reads its pairs itself) and what the rest of the set-up needs."""
    from nbtrain.data.loader import load_rows
    from nbtrain.data.sources import Source
    from nbtrain.model.pretrained import check_causal_lm, load_tokenizer

    d, cfg = r.d, r.cfg
    if not d.is_zero or os.environ.get("NBTRAIN_ENGINE") == "1":
        # N copies of the same "Loading weights" bar would bury rank 0's output in the cell, and on
        # an engine even rank 0's bar is a notebook widget the client cannot draw: the live display
        # already shows progress
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    resume_from = ckpt.check_output_dir(cfg) if d.is_zero else None
    source = Source(r.data, "data")
    read = read_eval and r.eval_data is not None
    eval_rows = load_rows(r.eval_data, "eval_data") if read else None
    base_config = check_causal_lm(r.model_name)
    if getattr(cfg, "packing", False) or getattr(cfg, "padding_free", False):
        from nbtrain.model.report import packing_refusal

        why = packing_refusal(base_config)
        if why:
            what = "packing=True" if getattr(cfg, "packing", False) else "padding_free=True"
            msg = (
                f"{what} would mix the documents of a row for {type(base_config).__name__} "
                f"({r.model_name}): {why}. Set packing=False and padding_free=False "
                "(docs/models.md says which families this holds for)"
            )
            raise ConfigError(msg)
    router_check(base_config, cfg.router_aux_loss_coef, r.kind)
    tokenizer = load_tokenizer(r.model_name)
    quant.check_quant(cfg, d.device, d.rank, d.host)
    if getattr(cfg, "sample_engine", "hf") == "vllm" and getattr(cfg, "sample_prompts", None):
        # samples through vLLM: its versions are checked here, before the model loads
        from nbtrain.generation import engines

        engines.check_vllm(d.rank, d.host, r.model_name, d.device)
    r.quantized = quant.quantized(cfg)
    fits = memory.check_fits(cfg, base_config, d.device, d.world)
    return {
        "resume_from": resume_from,
        "source": source,
        "tokenizer": tokenizer,
        "eval_rows": eval_rows,
        "base_config": base_config,
        "fits": fits,
    }


def load_model(r: Any, mesh: Any, notes: list[str]) -> None:
    """The model on this rank (LoRA on the base: whole, sharded or quantised), its dtypes and loss."""
    import torch

    d, cfg = r.d, r.cfg

    def load() -> tuple[Any, Any, list[str], list[str]]:
        compute_dtype = model_build.compute_dtype(cfg, d.device)
        weights_dtype = (
            compute_dtype if d.device.type == "cuda" and compute_dtype else torch.float32
        )
        t0 = time.perf_counter()
        if d.is_zero:
            print(f"nbtrain: loading {r.model_name} on {d.world} rank(s)", flush=True)
        model, more, levers = build_model(cfg, d, mesh, weights_dtype, compute_dtype)
        if d.is_zero:
            print(f"nbtrain: model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        return model, compute_dtype, notes + more, levers

    r.model, r.compute_dtype, r.notes, r.levers = d.agree(load)
    # the unwrapped peft model (the loop's `model` may be DDP around it)
    r.peft_model = r.model
    loss_name, r.loss_fn, loss_note = one_step.loss_impl(cfg, r.model, d.device, r.autocast)
    if loss_note:
        r.notes.append(loss_note)
    r.levers.append(f"loss {loss_name}")
    r.router_aux, router_note = RouterAux.plan(r.model, cfg.router_aux_loss_coef, r.kind)
    if router_note:
        r.notes.append(router_note)


def plan_batch(r: Any, n_rows: int) -> None:
    """The batch plan: micro-batch and accumulation steps (measured where 'auto')."""
    d = r.d
    plan = d.agree(lambda: one_step.plan_batch(r.cfg, d, r.model, r.loss_sum, n_rows))
    if r.auto_batch:
        agreed = d.min_int(plan.micro_batch)
        if agreed != plan.micro_batch:
            accum = (
                plan.grad_accum
                if r.global_batch_size is None
                else split_global(r.global_batch_size, d.world, agreed)
            )
            plan = BatchPlan(agreed, accum, d.world * agreed * accum, plan.note)
    if plan.note:
        r.notes.append(plan.note)
    r.plan = plan


def compile_blocks(r: Any) -> None:
    """torch_compile=True: compile each block of the base model (a lever, or a note why not)."""
    if r.torch_compile:
        why_not = speed.compile_layers(r.model.get_base_model())
        if why_not is None:
            r.levers.append("torch.compile")
        else:
            r.notes.append(why_not)


def resume_point(r: Any, resume_from: str | None) -> None:
    """Rank 0 reads the checkpoint and hands it to the others (they may not see its disk); every tensor
    in it is on the CPU, so none lands on another rank's GPU. Then the run's span."""
    d, plan = r.d, r.plan
    r.resume_from = d.broadcast_object(resume_from)
    resumed: dict[str, Any] | None = None
    if r.resume_from is not None:
        where = r.resume_from
        resumed = d.agree(lambda: ckpt.load_checkpoint(where) if d.is_zero else None)
        resumed = d.broadcast_object(resumed)
    if resumed:
        shard.check_resume(r.cfg, resumed["state"], r.resume_from)
    r.resumed = resumed
    r.start_step = int(resumed["state"]["global_step"]) if resumed else 0
    # every rank has the same checkpoint and plan, so every rank raises here alike, before any write
    r.span = run_span(
        r.cfg,
        r.spe,
        r.batches.n_units,
        d.world * plan.micro_batch * plan.grad_accum,
        resumed,
        r.resume_from,
    )
    r.total_steps = r.span.total
    if resumed and resumed["state"].get("global_batch_size") != plan.global_batch and d.is_zero:
        print(
            f"nbtrain: resuming with a global batch of {plan.global_batch} rows where the "
            f"checkpoint used {resumed['state'].get('global_batch_size')}; the data goes on from "
            f"the rows the checkpoint had consumed, and the run ends at step {r.total_steps}",
            flush=True,
        )


def open_output(r: Any) -> None:
    """From here on rank 0 writes to output_dir. report_to's TensorBoard and MLflow first: one that
    cannot be opened stops every rank here."""
    d, out, resumed = r.d, r.out, r.resumed

    def open_trackers() -> tracking.Trackers | None:
        if not d.is_zero:
            return None
        at, before = (r.start_step, read_history(out, r.start_step)) if resumed else (None, [])
        return tracking.open_trackers(r.cfg, out, r.name, d.world, at, before)

    trackers = d.agree(open_trackers)
    history: list[dict[str, Any]] = []
    if d.is_zero:
        if r.overwrite:
            ckpt.clear_output_dir(out)
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_run_config(out, r.config_dict)
        history = read_history(out, r.start_step) if resumed else []
        r.runlog = RunLog(out, history, r.name, r.total_steps, d.world, trackers, kind=r.kind)
    r.history = d.broadcast_object(history)


def build_optimizer(r: Any) -> None:
    """DDP around the model (unsharded), AdamW, the schedule; on resume their states and the RNG."""
    import torch
    from peft import set_peft_model_state_dict
    from transformers import get_scheduler

    d, resumed, span = r.d, r.resumed, r.span
    if resumed and not r.sharded:
        set_peft_model_state_dict(r.peft_model, resumed["adapter"])
    r.trainable = [p for p in r.peft_model.parameters() if p.requires_grad]
    if d.active and not r.sharded:
        from torch.nn.parallel import DistributedDataParallel as DDP

        r.model = DDP(
            r.peft_model,
            device_ids=[d.device.index] if d.device.type == "cuda" else None,
            process_group=d.group,
        )
        # a no-op unless a scaling run is timing it
        commtime.attach(r.model, d.group, r.trainable)
    r.optimizer = torch.optim.AdamW(r.trainable, lr=r.learning_rate, weight_decay=0.0)
    r.scheduler = get_scheduler(
        r.lr_scheduler_type,
        r.optimizer,
        num_warmup_steps=r.warmup_steps,
        num_training_steps=span.schedule_length,
    )
    if resumed:
        if r.sharded:  # every rank reads its own shards of the adapter and the optimizer state
            shard.load_sharded(
                Path(str(r.resume_from)) / shard.SHARDED_DIR,
                r.model,
                r.optimizer,
                d.group,
            )
        else:
            r.optimizer.load_state_dict(resumed["optimizer"])
        # the schedule's position is the span's, not the step the checkpoint's schedule was at
        saved_schedule = {**resumed["scheduler"], "last_epoch": span.schedule_start}
        ckpt.restore_schedule(r.scheduler, r.optimizer, saved_schedule)
        rng = resumed["rng"]
        if d.rank < len(rng):
            ckpt.set_rng_state(rng[d.rank])
        else:
            torch.manual_seed(r.seed + 1 + d.rank)
    else:
        # dropout masks differ across ranks, as distinct samples would get
        torch.manual_seed(r.seed + 1 + d.rank)
    r.n_eval = len(r.evals or [])
    if r.sharded and r.evals is not None:
        r.n_eval = -d.min_int(-r.n_eval)
    r.micro0 = r.batches.micro_batch(0, 0)[:1]
