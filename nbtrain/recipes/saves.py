"""What a recipe writes and returns, shared by every recipe: the atomic checkpoint of a step, the
adapter (and merged model) export, and the `TrainResult` `finetune` returns.

Each function takes the recipe that was set up (`nbtrain.recipes.run_setup`) and trained
(`nbtrain.recipes.loop`): a recipe's `save_checkpoint`, `export` and `result` call them, in its own file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain.model import checkpoint as ckpt
from nbtrain.model import shard

log = logging.getLogger(__name__)


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


def save_checkpoint(r: Any, step: int) -> None:
    """An atomic checkpoint of step `step` in output_dir (rank 0; every rank writes its own shards),
    then the on_save hooks."""
    d, out, span, spe, plan = r.d, r.out, r.span, r.spe, r.plan
    rngs = d.gather_objects(ckpt.get_rng_state())
    tmp, adapter = None, None
    if r.sharded:  # every rank writes its shards into rank 0's temporary folder
        final = out / f"checkpoint-{step}"
        tmp = Path(d.broadcast_object(str(ckpt.open_atomic_dir(final)) if d.is_zero else ""))
        shard.save_sharded(tmp / shard.SHARDED_DIR, r.peft_model, r.optimizer, d.group)
        adapter = shard.full_adapter(r.peft_model, d.is_zero)
    if d.is_zero:
        data_step = step + span.shift
        epoch, in_epoch = divmod(data_step, spe)
        state = {
            "global_step": step,
            "total_steps": r.total_steps,
            "epoch": data_step / spe,
            "data_position": {
                "epoch": epoch,
                "step_in_epoch": in_epoch,
                "rows_consumed": r.batches.consumed(data_step),
            },
            "steps_per_epoch": spe,
            "world_size": d.world,
            "per_device_train_batch_size": plan.micro_batch,
            "gradient_accumulation_steps": plan.grad_accum,
            "global_batch_size": plan.global_batch,
            "seed": r.seed,
            "shard": r.shard_kind,
        }
        written = ckpt.save_checkpoint(
            out,
            step,
            model=r.peft_model,
            optimizer=None if r.sharded else r.optimizer,
            scheduler=r.scheduler,
            rng_states=rngs,
            state=state,
            config=r.config_dict,
            adapter_state=adapter,
            tmp=tmp,
        )
        log.debug("checkpoint of step %d written: %s", step, written)
        if r.save_total_limit is not None:
            ckpt.prune_checkpoints(out, r.save_total_limit, written)
    if r.sharded:
        d.barrier()
    r.last_saved = step
    r.hooks.call("on_save", r, step=step, checkpoint=str(out / f"checkpoint-{step}"))


def export(r: Any) -> None:
    """The adapter (and with merge=True the merged model) in output_dir, written by rank 0."""
    adapter = shard.full_adapter(r.peft_model, r.d.is_zero) if r.sharded else None
    if r.d.is_zero:
        # a sharded or 4-bit base cannot take the merge in place: a fresh copy on the CPU does
        fresh = r.model_name if r.sharded or r.quantized else None
        r.adapter_dir, r.merged_dir = ckpt.export_run(
            r.out,
            r.peft_model,
            r.tokenizer,
            adapter,
            r.merge,
            fresh,
            r.compute_dtype,
            r.use_cache,
        )


def result(r: Any) -> TrainResult:
    """The run's `TrainResult` on this rank: its history, exports, state and plan."""
    import pandas as pd

    history = r.history
    return TrainResult(
        history=pd.DataFrame(history),
        adapter_dir=r.adapter_dir,
        output_dir=str(r.out),
        merged_dir=r.merged_dir,
        metrics=dict(history[-1]) if history else {},
        global_step=r.step,
        state=r.state,
        run_id=r.runlog.run_id if r.runlog else None,
        plan={
            "micro_batch": r.plan.micro_batch,
            "gradient_accumulation_steps": r.plan.grad_accum,
            "global_batch": r.plan.global_batch,
            "levers": r.levers,
            "notes": r.notes,
            # (elements this rank holds, elements in all) of the frozen base: 1/N of it under fsdp
            "base_params_held": shard.local_numel(r.peft_model, trainable=False),
            "params": params(r.peft_model),
        },
    )


def params(model: Any) -> dict[str, int]:
    """The model's parameters in all ("total"), those one token computes with ("active": on an MoE,
    without the experts it is not routed to) and those trained ("trainable", the LoRA)."""
    from nbtrain.model import targets

    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "active": targets.active_numel(model, total), "trainable": trainable}
