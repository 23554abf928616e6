"""`finetune`: LoRA supervised fine-tuning that runs on every rank, in a plain process or on a cluster.

In [1]: %%distributed
   ...: cfg = nbtrain.SFTConfig(model="tiny-llama", data="train.jsonl", output_dir="runs/first",
   ...:                         max_steps=200, per_device_train_batch_size=4)
   ...: result = nbtrain.finetune(cfg)
In [2]: result.history.plot(x="step", y="loss")

The loop follows nanoGPT's train.py and torchtune's distributed LoRA recipe: one global batch per
optimizer step, gradients summed across ranks by DDP, the loss normalised by the number of target tokens
in the whole global batch, so N ranks with batch B train exactly like 1 rank with batch N*B.

This module is longer than ~500 lines while `finetune` is one function: issue 27 makes it a recipe
(set-up, train, save), each phase in a module of its own.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain.engine import metrics as live
from nbtrain.errors import ConfigError
from nbtrain.sft import checkpoint as ckpt
from nbtrain.sft import commtime, memory, quant, shard, speed, tokens, tracking
from nbtrain.sft import step as one_step
from nbtrain.sft.batch import BatchPlan, split_global
from nbtrain.sft.build import build_model
from nbtrain.sft.config import SFTConfig
from nbtrain.sft.dist import Dist
from nbtrain.sft.preempt import Preempted, Preemption
from nbtrain.sft.preempt import message as preempt_message
from nbtrain.sft.report import Meter, RunLog, flops_per_token, peak_flops, read_history
from nbtrain.sft.span import drop_taken, run_span


@dataclass
class TrainResult:
    """What `finetune` returns on every rank."""

    history: Any  #: pandas DataFrame, one row per logged step
    adapter_dir: str | None  #: the exported adapter folder on rank 0; None on other ranks
    output_dir: str
    merged_dir: str | None = None  #: the merged model folder (merge=True, rank 0)
    metrics: dict[str, Any] = field(default_factory=dict)  #: the last logged row
    global_step: int = 0
    state: str = "done"  #: "done" or "stopped" (a stop request from the runs sidebar)
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


def finetune(cfg: SFTConfig, merge: bool = False, group: Any = None) -> TrainResult:
    """Fine-tune `cfg.model` with LoRA on `cfg.data`, on every rank; export the adapter on rank 0.

    In [1]: result = nbtrain.finetune(nbtrain.SFTConfig(model="tiny", data="train.jsonl", max_steps=50))
    In [2]: result.history.tail()

    Bad settings or data raise `ConfigError` on every rank before any step, and nothing is written to
    `output_dir`. `merge=True` also writes the merged model to `output_dir/merged`.

    `group` trains on a sub-group of the running process group instead of the whole world (e.g.
    `groups["actor"]` in a `%%distributed --group actor` cell): its ranks are the run's ranks 0..n-1,
    and it trains exactly as a cluster of that many ranks would. Call it on the group's ranks only.
    """
    if not isinstance(cfg, SFTConfig):
        msg = f"finetune needs an nbtrain.SFTConfig, got {type(cfg).__name__}; build one with nbtrain.SFTConfig(...)"
        raise ConfigError(msg)
    import torch

    from nbtrain.sft.data import ShardedBatches, eval_batches, load_rows
    from nbtrain.sft.model import check_causal_lm, load_tokenizer
    from nbtrain.sft.sources import Source

    d = Dist(group)
    out = Path(cfg.output_dir).expanduser()
    sharded = cfg.shard != "ddp"
    # refusals first; the mesh's collectives run on every rank alike, outside the set-up's try
    shard_note = d.agree(lambda: shard.check_shard(cfg, d))
    mesh = d.agree(lambda: shard.make_mesh(d, cfg.shard, group)) if sharded else None

    # ---- set-up phase: everything that can be wrong is found here, on every rank, before any write
    def check() -> dict[str, Any]:
        if not d.is_zero or os.environ.get("NBTRAIN_ENGINE") == "1":
            # N copies of the same "Loading weights" bar would bury rank 0's output in the cell, and on
            # an engine even rank 0's bar is a notebook widget the client cannot draw: the live display
            # already shows progress
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        resume_from = ckpt.check_output_dir(cfg) if d.is_zero else None
        source = Source(cfg.data, "data")
        eval_rows = load_rows(cfg.eval_data, "eval_data") if cfg.eval_data is not None else None
        base_config = check_causal_lm(cfg.model)
        tokenizer = load_tokenizer(cfg.model)
        quant.check_quant(cfg, d.device, d.rank, d.host)
        fits = memory.check_fits(cfg, base_config, d.device, d.world)
        return {
            "resume_from": resume_from,
            "source": source,
            "tokenizer": tokenizer,
            "eval_rows": eval_rows,
            "base_config": base_config,
            "fits": fits,
        }

    s = d.agree(check)
    tokenizer = s["tokenizer"]
    # the rows, tokenized once across the ranks (or read from the token cache), before the model
    store = tokens.prepare(s["source"], tokenizer, d, cfg.data_cache, cfg.chat_template_kwargs)

    def setup() -> dict[str, Any]:
        compute_dtype = one_step.compute_dtype(cfg, d.device)
        weights_dtype = (
            compute_dtype if d.device.type == "cuda" and compute_dtype else torch.float32
        )
        t0 = time.perf_counter()
        if d.is_zero:
            print(f"nbtrain: loading {cfg.model} on {d.world} rank(s)", flush=True)
        model, notes, levers = build_model(cfg, d, mesh, weights_dtype, compute_dtype)
        if d.is_zero:
            print(f"nbtrain: model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        notes = [n for n in (shard_note, s["fits"]) if n] + notes
        return {
            "model": model,
            "compute_dtype": compute_dtype,
            "notes": notes,
            "levers": levers,
            # the base model's own KV-cache setting (training turns it off), for the merged export
            "use_cache": getattr(s["base_config"], "use_cache", None),
        }

    s.update(d.agree(setup))
    model = s["model"]
    compute_dtype = s["compute_dtype"]
    levers: list[str] = s["levers"]

    def autocast() -> Any:
        if compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=d.device.type, dtype=compute_dtype)

    loss_name, loss_fn, loss_note = one_step.loss_impl(cfg, model, d.device, autocast)
    notes: list[str] = s["notes"] + ([loss_note] if loss_note else [])
    levers.append(f"loss {loss_name}")

    def loss_sum(net: Any, batch: dict[str, Any]) -> Any:
        # through the module, so a test can wrap nbtrain.sft.step.loss_sum to slow or kill a rank mid-step
        return one_step.loss_sum(net, batch, autocast, loss_fn)

    # ---- the batch plan: micro-batch and accumulation steps (measured where 'auto')
    plan = d.agree(lambda: one_step.plan_batch(cfg, d, model, loss_sum, len(store)))
    if cfg.per_device_train_batch_size == "auto":
        agreed = d.min_int(plan.micro_batch)
        if agreed != plan.micro_batch:
            accum = (
                plan.grad_accum
                if cfg.global_batch_size is None
                else split_global(cfg.global_batch_size, d.world, agreed)
            )
            plan = BatchPlan(agreed, accum, d.world * agreed * accum, plan.note)
    if plan.note:
        notes.append(plan.note)

    def make_batches() -> tuple[Any, Any]:
        batches = ShardedBatches(
            None,
            tokenizer,
            store=store,
            max_length=cfg.max_length,
            batch_size=plan.micro_batch,
            grad_accum=plan.grad_accum,
            seed=cfg.seed,
            rank=d.rank,
            world_size=d.world,
            packing=cfg.packing,
            padding_free=cfg.padding_free,
            attn_implementation=getattr(model.config, "_attn_implementation", None),
            truncation_side=cfg.truncation_side,
        )
        evals = None
        if s["eval_rows"] is not None:
            evals = eval_batches(
                s["eval_rows"],
                tokenizer,
                max_length=cfg.max_length,
                batch_size=plan.micro_batch,
                rank=d.rank,
                world_size=d.world,
                truncation_side=cfg.truncation_side,
                truncated=eval_cut,
                template_kwargs=cfg.chat_template_kwargs,
            )
        return batches, evals

    eval_cut: list[int] = []
    batches, evals = d.agree(make_batches)
    if evals is not None:
        n_cut = sum(d.gather_objects(len(eval_cut)))
        if n_cut and d.is_zero:
            notes.append(
                f"{n_cut} of {len(s['eval_rows'])} eval_data rows are longer than "
                f"max_length={cfg.max_length} tokens and are cut at the {cfg.truncation_side}; "
                "the eval loss covers only what is left (raise max_length to keep them whole)"
            )
    if cfg.torch_compile:
        why_not = speed.compile_layers(model.get_base_model())
        if why_not is None:
            levers.append("torch.compile")
        else:
            notes.append(why_not)
    if d.is_zero:
        for note in notes:
            print(f"nbtrain: {note}", flush=True)
    spe = batches.steps_per_epoch

    # ---- resume: rank 0 reads the checkpoint and hands it to the others (they may not see its disk);
    # every tensor in it is on the CPU, so none lands on another rank's GPU
    resume_from = d.broadcast_object(s["resume_from"])
    resumed: dict[str, Any] | None = None
    if resume_from is not None:
        resumed = d.agree(lambda: ckpt.load_checkpoint(resume_from) if d.is_zero else None)
        resumed = d.broadcast_object(resumed)
    if resumed:
        shard.check_resume(cfg, resumed["state"], resume_from)
    start_step = int(resumed["state"]["global_step"]) if resumed else 0
    # every rank has the same checkpoint and plan, so every rank raises here alike, before any write
    global_batch = plan.global_batch
    GA = plan.grad_accum
    span = run_span(
        cfg, spe, batches.n_units, d.world * plan.micro_batch * GA, resumed, resume_from
    )
    total_steps = span.total
    if resumed and resumed["state"].get("global_batch_size") != global_batch and d.is_zero:
        print(
            f"nbtrain: resuming with a global batch of {global_batch} rows where the checkpoint used "
            f"{resumed['state'].get('global_batch_size')}; the data goes on from the rows the "
            f"checkpoint had consumed, and the run ends at step {total_steps}",
            flush=True,
        )

    # ---- from here on rank 0 writes to output_dir
    history: list[dict[str, Any]] = []
    runlog: RunLog | None = None
    name = cfg.run_name or out.name

    # report_to's TensorBoard and MLflow first: one that cannot be opened stops every rank here
    def open_trackers() -> tracking.Trackers | None:
        if not d.is_zero:
            return None
        at, before = (start_step, read_history(out, start_step)) if resumed else (None, [])
        return tracking.open_trackers(cfg, out, name, d.world, at, before)

    trackers = d.agree(open_trackers)
    if d.is_zero:
        if cfg.overwrite:
            ckpt.clear_output_dir(out)
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_run_config(out, cfg.to_dict())
        history = read_history(out, start_step) if resumed else []
        runlog = RunLog(out, history, name, total_steps, d.world, trackers)
    history = d.broadcast_object(history)

    # ---- model, optimizer, schedule
    from peft import set_peft_model_state_dict
    from transformers import get_scheduler

    if resumed and not sharded:
        set_peft_model_state_dict(model, resumed["adapter"])
    peft_model = model
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    if d.active and not sharded:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(
            peft_model,
            device_ids=[d.device.index] if d.device.type == "cuda" else None,
            process_group=d.group,
        )
        commtime.attach(model, d.group, trainable)  # a no-op unless a scaling run is timing it
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=0.0)
    scheduler = get_scheduler(
        cfg.lr_scheduler_type,
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=span.schedule_length,
    )
    if resumed:
        if sharded:  # every rank reads its own shards of the adapter and the optimizer state
            shard.load_sharded(Path(resume_from) / shard.SHARDED_DIR, model, optimizer, d.group)
        else:
            optimizer.load_state_dict(resumed["optimizer"])
        # the schedule's position is the span's, not the step the checkpoint's schedule was at
        saved_schedule = {**resumed["scheduler"], "last_epoch": span.schedule_start}
        ckpt.restore_schedule(scheduler, optimizer, saved_schedule)
        rng = resumed["rng"]
        if d.rank < len(rng):
            ckpt.set_rng_state(rng[d.rank])
        else:
            torch.manual_seed(cfg.seed + 1 + d.rank)
    else:
        # dropout masks differ across ranks, as distinct samples would get
        torch.manual_seed(cfg.seed + 1 + d.rank)

    # LoRA training FLOPs, a 4-bit base counted at its logical shape, not its packed storage
    token_flops = flops_per_token(peft_model)
    peak = peak_flops(d.device) if compute_dtype is not None else None

    n_eval = len(evals or [])
    if sharded and evals is not None:
        n_eval = -d.min_int(-n_eval)
    micro0 = batches.micro_batch(0, 0)[:1]

    def save(step: int) -> None:
        rngs = d.gather_objects(ckpt.get_rng_state())
        tmp, adapter = None, None
        if sharded:  # every rank writes its shards into rank 0's temporary folder
            final = out / f"checkpoint-{step}"
            tmp = Path(d.broadcast_object(str(ckpt.open_atomic_dir(final)) if d.is_zero else ""))
            shard.save_sharded(tmp / shard.SHARDED_DIR, peft_model, optimizer, d.group)
            adapter = shard.full_adapter(peft_model, d.is_zero)
        if d.is_zero:
            data_step = step + span.shift
            epoch, in_epoch = divmod(data_step, spe)
            state = {
                "global_step": step,
                "total_steps": total_steps,
                "epoch": data_step / spe,
                "data_position": {
                    "epoch": epoch,
                    "step_in_epoch": in_epoch,
                    "rows_consumed": batches.consumed(data_step),
                },
                "steps_per_epoch": spe,
                "world_size": d.world,
                "per_device_train_batch_size": plan.micro_batch,
                "gradient_accumulation_steps": GA,
                "global_batch_size": global_batch,
                "seed": cfg.seed,
                "shard": cfg.shard,
            }
            written = ckpt.save_checkpoint(
                out,
                step,
                model=peft_model,
                optimizer=None if sharded else optimizer,
                scheduler=scheduler,
                rng_states=rngs,
                state=state,
                config=cfg.to_dict(),
                adapter_state=adapter,
                tmp=tmp,
            )
            if cfg.save_total_limit is not None:
                ckpt.prune_checkpoints(out, cfg.save_total_limit, written)
        if sharded:
            d.barrier()

    live.begin(total_steps=total_steps, name=name)
    final_state = "failed"
    step = start_step
    last_saved = start_step if resumed else -1
    if d.device.type == "cuda":
        # the peak of this run's training, not of the set-up's probes or an earlier cell's work
        torch.cuda.reset_peak_memory_stats(d.device)
    meter = Meter(d, spe, token_flops, peak, step_shift=span.shift)
    clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")

    def micro_batch(step: int, a: int) -> list[Any]:
        exs = batches.micro_batch(step + span.shift, a)
        if step != start_step or not span.skip:
            return exs
        # the first step of a run resumed on another world size or batch, whose checkpoint ended
        # inside this step's global batch: the units before `skip` were trained already
        k = ((step + span.shift) % spe) * GA + a
        return drop_taken(exs, d.world * k * plan.micro_batch + d.rank, d.world, span.skip)

    def log(row: dict[str, Any]) -> None:
        history.append(row)
        live.log(**row)
        if runlog is not None:
            runlog.row(row)

    # SIGTERM/SIGUSR1 (a preemption) is only recorded: the step's collective below tells every rank
    preemption = Preemption().__enter__()
    preempted: tuple[int, int] | None = None  # (the rank that got the signal, the signal)
    try:
        model.train()
        grad_norm = None
        stopped = False
        while step < total_steps:
            # one small collective per step: target tokens and lengths per micro-batch, and the stop flag
            micro = [micro_batch(step, a) for a in range(GA)]
            stats = torch.zeros((d.world, 2 * GA + 3), dtype=torch.float64)
            for a, exs in enumerate(micro):
                stats[d.rank, a] = sum(e.n_targets for e in exs)
                stats[d.rank, GA + a] = max((len(e.input_ids) for e in exs), default=1)
            stats[d.rank, 2 * GA] = sum(len(e.input_ids) for exs in micro for e in exs)
            if runlog is not None:
                stats[0, 2 * GA + 1] = float(runlog.stop_requested())
            stats[d.rank, 2 * GA + 2] = float(preemption.signum)
            stats = d.sum_meta(stats)
            signalled = [r for r in range(d.world) if stats[r, 2 * GA + 2] > 0]
            if signalled:
                preempted = (signalled[0], int(stats[signalled[0], 2 * GA + 2]))
            if stats[0, 2 * GA + 1] > 0 or preempted:
                stopped = True
                break
            n_targets = max(float(stats[:, :GA].sum()), 1.0)
            for a, exs in enumerate(micro):
                # pad to the longest row across ranks: the same shapes as one rank with the whole batch
                batch = batches.collate(exs, int(stats[:, GA + a].max()))
                batch = one_step.to_device(batch, d.device)
                # gradients are all-reduced once per step, on the last micro-batch
                sync = a == GA - 1 or not d.active
                if sharded:
                    shard.set_gradient_sync(model, sync)
                with contextlib.nullcontext() if sync or sharded else model.no_sync():
                    batch_loss = loss_sum(model, batch)
                    # DDP averages gradients over ranks; scaling by world turns that into the global sum
                    (batch_loss * (d.world / n_targets)).backward()
                meter.loss += batch_loss.detach().double() / n_targets
            grad_norm = shard.clip_grad_norm(trainable, clip)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            meter.steps += 1
            meter.tokens += float(stats[:, 2 * GA].sum())

            eval_loss = None
            if evals is not None and (
                (cfg.eval_steps is not None and step % cfg.eval_steps == 0) or step == total_steps
            ):
                t0 = time.perf_counter()
                eval_loss = one_step.evaluate(
                    peft_model, evals, n_eval, micro0, tokenizer.pad_token_id, d, loss_sum
                )
                meter.exclude(time.perf_counter() - t0)
            if step % cfg.logging_steps == 0 or step == total_steps or eval_loss is not None:
                log(meter.row(step, grad_norm, lr, eval_loss))
            # and at the last step, as HF's Trainer does, so resume='latest' always has the run's end
            if cfg.save_steps is not None and (step % cfg.save_steps == 0 or step == total_steps):
                t0 = time.perf_counter()
                save(step)
                meter.exclude(time.perf_counter() - t0)
                last_saved = step
        if stopped:
            if meter.steps:
                log(meter.row(step, grad_norm, scheduler.get_last_lr()[0], None))
            if last_saved != step:
                save(step)
            if preempted:
                hosts = d.gather_objects(d.host)
                final_state = "preempted"
                r, signum = preempted
                where = str(out / f"checkpoint-{step}")
                raise Preempted(preempt_message(step, total_steps, r, hosts[r], signum, where))
            if d.is_zero:
                print(f"nbtrain: stopped at step {step}/{total_steps} on request; checkpoint saved")

        adapter_dir = merged_dir = None
        adapter = shard.full_adapter(peft_model, d.is_zero) if sharded else None
        if d.is_zero:
            # a sharded or 4-bit base cannot take the merge in place: a fresh copy on the CPU does
            fresh = cfg.model if sharded or quant.quantized(cfg) else None
            adapter_dir, merged_dir = ckpt.export_run(
                out, peft_model, tokenizer, adapter, merge, fresh, compute_dtype, s["use_cache"]
            )
        d.barrier()
        final_state = "stopped" if stopped else "done"
    finally:
        preemption.__exit__()
        live.end()
        if runlog is not None:
            runlog.finish(final_state)

    import pandas as pd

    return TrainResult(
        history=pd.DataFrame(history),
        adapter_dir=adapter_dir,
        output_dir=str(out),
        merged_dir=merged_dir,
        metrics=dict(history[-1]) if history else {},
        global_step=step,
        state=final_state,
        run_id=runlog.run_id if runlog else None,
        plan={
            "micro_batch": plan.micro_batch,
            "gradient_accumulation_steps": plan.grad_accum,
            "global_batch": plan.global_batch,
            "levers": levers,
            "notes": notes,
            # (elements this rank holds, elements in all) of the frozen base: 1/N of it under fsdp
            "base_params_held": shard.local_numel(peft_model, trainable=False),
        },
    )
