"""`finetune`: LoRA supervised fine-tuning that runs on every rank, in a plain process or on a cluster.

In [1]: %%distributed
   ...: cfg = nbtrain.SFTConfig(model="tiny-llama", data="train.jsonl", output_dir="runs/first",
   ...:                         max_steps=200, per_device_train_batch_size=4)
   ...: result = nbtrain.finetune(cfg)
In [2]: result.history.plot(x="step", y="loss")

The loop follows nanoGPT's train.py and torchtune's distributed LoRA recipe: one global batch per
optimizer step, gradients summed across ranks by DDP, the loss normalised by the number of target tokens
in the whole global batch, so N ranks with batch B train exactly like 1 rank with batch N*B.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbtrain.engine import metrics as live
from nbtrain.engine.rank import get_local_rank, get_rank, get_world_size
from nbtrain.errors import ConfigError
from nbtrain.sft import checkpoint as ckpt
from nbtrain.sft import speed
from nbtrain.sft.batch import BatchPlan, split_global
from nbtrain.sft.config import SFTConfig

# Dense bf16 peak FLOP/s per GPU (no sparsity), for MFU. A name is matched on whole words, so an L40 is
# not an L4 and an H100 PCIe or NVL is not an SXM; a GPU not listed reports no MFU rather than a wrong one.
_PEAK_BF16: tuple[tuple[set[str], set[str], float], ...] = (
    # (words that must all be in the name, words that must not, FLOP/s)
    ({"h100", "nvl"}, set(), 835e12),
    ({"h100", "pcie"}, set(), 756e12),
    ({"h100"}, set(), 989e12),  # SXM (the name says "80GB HBM3")
    ({"h200", "nvl"}, set(), 835e12),
    ({"h200"}, set(), 989e12),
    ({"gh200"}, set(), 989e12),
    ({"b200"}, set(), 2250e12),
    ({"a100"}, set(), 312e12),
    ({"l40s"}, set(), 362e12),
    ({"l40"}, set(), 181e12),
    ({"l4"}, set(), 121e12),
    ({"a10"}, set(), 125e12),
    ({"rtx", "4090"}, set(), 165e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU from its name as torch reports it, or None when not known.

    In [1]: peak_bf16_flops("NVIDIA H100 80GB HBM3")
    Out[1]: 989000000000000.0
    """
    import re

    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for need, never, flops in _PEAK_BF16:
        if need <= words and not (never & words):
            return flops
    return None


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


# ------------------------------------------------------------------------------------ process group
class _Dist:
    """The process group as this run sees it; every method also works alone (world size 1)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.dist = dist
        world = get_world_size()
        # on an nbtrain engine the client planned the device for every rank (NBTRAIN_DEVICE); else
        # (torchrun) a GPU only where every rank on this host gets its own, never two on one GPU
        planned = os.environ.get("NBTRAIN_DEVICE")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        own_gpu = torch.cuda.is_available() and local_world <= torch.cuda.device_count()
        if world > 1 and not dist.is_initialized():
            # launched by torchrun or by hand: nbtrain's cluster would have set the group up already
            backend = "nccl" if own_gpu else "gloo"
            dist.init_process_group(backend=backend, init_method="env://")
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.active else get_rank()
        self.world = dist.get_world_size() if self.active else 1
        if self.world == 1:
            self.rank = 0
        self.local_rank = get_local_rank()
        if planned:
            self.device = torch.device(planned)
        elif own_gpu:
            self.device = torch.device("cuda", self.local_rank)
        else:
            if torch.cuda.is_available():
                import sys

                print(
                    f"nbtrain: {local_world} ranks on {socket.gethostname()} but "
                    f"{torch.cuda.device_count()} GPU(s): training on CPU; start one rank per GPU.",
                    file=sys.stderr,
                )
            self.device = torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = dist.get_backend() if self.active else "gloo"
        self.comm_device = self.device if backend == "nccl" else torch.device("cpu")
        # the step's small bookkeeping (token counts, stop flag, logged figures) goes over gloo on the
        # CPU: over NCCL it would have to wait for the GPU, a host synchronisation in every step
        self.meta_group = _cpu_group(dist) if self.active and backend == "nccl" else None
        self.host = socket.gethostname()

    @property
    def is_zero(self) -> bool:
        # the one rank-0 flag (nbtrain.is_rank_zero reads the env; the group is the truth here)
        return self.rank == 0

    def sum_(self, t: Any) -> Any:
        """All-reduce (sum) a tensor in place; returns it on the compute device's side of comms."""
        if self.active:
            moved = t.to(self.comm_device)
            self.dist.all_reduce(moved)
            return moved.to(t.device)
        return t

    def sum_meta(self, t: Any) -> Any:
        """All-reduce (sum) a small CPU tensor in place without waiting for the GPU."""
        if self.active:
            self.dist.all_reduce(t, group=self.meta_group)
        return t

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.active:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def min_int(self, value: int) -> int:
        import torch

        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.comm_device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        if self.active:
            self.dist.barrier()

    def agree(self, fn: Any) -> Any:
        """Run a set-up phase on every rank; if it fails on any rank, raise on all of them, not hang."""
        err: BaseException | None = None
        value = None
        try:
            value = fn()
        except Exception as e:
            err = e
        report = (
            None if err is None else (type(err).__name__, str(err), isinstance(err, ConfigError))
        )
        reports = self.gather_objects((report, self.host))
        if err is not None:
            raise err
        failed = [(r, rep, host) for r, (rep, host) in enumerate(reports) if rep is not None]
        if failed:
            r, (kind, text, is_config), host = failed[0]
            msg = f"rank {r} on {host} failed during set-up: {text}"
            raise ConfigError(msg) if is_config else RuntimeError(f"{kind}: {msg}")
        return value


_CPU_GROUP: list[Any] = []  # [the default group it was made for, the gloo group]


def _cpu_group(dist: Any) -> Any:
    """A gloo group over every rank of the default group, made once per default group (the default
    group is held here, so a re-created one is never mistaken for it)."""
    default = dist.distributed_c10d._get_default_group()
    if not _CPU_GROUP or _CPU_GROUP[0] is not default:
        _CPU_GROUP[:] = [default, dist.new_group(backend="gloo")]
    return _CPU_GROUP[1]


# ------------------------------------------------------------------------------------------- helpers
class _RunLog:
    """Rank 0's record of a run: the log line, metrics.jsonl and the runs registry, row by row."""

    def __init__(self, out: Path, history: list[dict[str, Any]], name: str, total: int, world: int):
        from nbtrain.runs import register_run

        self.total = total
        # a resumed run drops the rows logged after its checkpoint, which it is about to redo
        tmp = out / ".metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in history))
        os.replace(tmp, out / "metrics.jsonl")
        self.file = (out / "metrics.jsonl").open("a")
        self.run_id = register_run(
            out,
            name=name,
            total_steps=total,
            world_size=world,
            cluster_id=os.environ.get("NBTRAIN_CLUSTER_ID"),
        )

    def stop_requested(self) -> bool:
        from nbtrain.runs import stop_requested

        return stop_requested(self.run_id)

    def row(self, row: dict[str, Any]) -> None:
        from nbtrain.runs import update_run

        print(_fmt_line(row, self.total), flush=True)
        # one line per row, flushed, so a crashed run keeps its history
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        update_run(
            self.run_id, step=row["step"], loss=row["loss"], tokens_per_s=row["tokens_per_s"]
        )

    def finish(self, state: str) -> None:
        from nbtrain.runs import finish_run

        self.file.close()
        finish_run(self.run_id, state)


def _compute_dtype(cfg: SFTConfig, device: Any) -> Any:
    import torch

    if cfg.dtype == "float32":
        return None
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return None  # fp32 on CPU


def _check_output_dir(cfg: SFTConfig) -> str | None:
    """Rank 0: the checkpoint to resume from, or a ConfigError when the folder holds another run."""
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        msg = f"output_dir {cfg.output_dir!r} is a file; pass a folder path"
        raise ConfigError(msg)
    if cfg.resume == "latest":
        found = ckpt.list_checkpoints(out)
        if not found:
            msg = (
                f"resume='latest' but output_dir {cfg.output_dir!r} holds no complete checkpoint; "
                "drop resume to start a new run, or point output_dir at the run to continue"
            )
            raise ConfigError(msg)
        return str(found[-1])
    if cfg.resume is not None:
        path = Path(cfg.resume).expanduser()
        if not (path / ckpt.STATE_FILE).is_file():
            msg = (
                f"resume={cfg.resume!r} is not a complete checkpoint (no {ckpt.STATE_FILE}); pass a "
                "checkpoint-<step> folder written by finetune, or resume='latest'"
            )
            raise ConfigError(msg)
        return str(path)
    existing = ckpt.any_checkpoint_dirs(out)
    if existing and not cfg.overwrite:
        shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
        msg = (
            f"output_dir {cfg.output_dir!r} holds another run's checkpoints ({shown}); pass "
            "resume='latest' to continue that run, overwrite=True to start over, or a new output_dir"
        )
        raise ConfigError(msg)
    return None


def _clear_output_dir(out: Path) -> None:
    """overwrite=True: remove what an earlier run wrote (only nbtrain's own files)."""
    for p in out.iterdir() if out.is_dir() else []:
        if (
            ckpt.CHECKPOINT_RE.match(p.name)
            or p.name in ("adapter", "merged")
            or p.name.startswith(".tmp-")
        ):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name == "metrics.jsonl":
            p.unlink()


def _total_steps(
    cfg: SFTConfig, spe: int, resumed: dict[str, Any] | None, resume_from: str | None
) -> int:
    """The run's length in optimizer steps, which also shapes the learning-rate schedule.

    A resumed run keeps the length its checkpoint recorded, so the schedule goes on where it was even
    when another world size or batch gives another number of steps per epoch; only a length the user
    changed (max_steps, or num_train_epochs while max_steps is -1) is recomputed. A ConfigError when
    the checkpoint is already at or past that length: such a run would report done without training.
    """
    new_total = (
        cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.num_train_epochs * spe))
    )
    if resumed is None:
        return new_total
    state, saved = resumed["state"], resumed.get("config") or {}
    step = int(state["global_step"])

    def length(max_steps: Any, epochs: Any) -> tuple[Any, Any]:
        return (max_steps, epochs if max_steps == -1 else None)

    changed = length(cfg.max_steps, cfg.num_train_epochs) != length(
        saved.get("max_steps"), saved.get("num_train_epochs")
    )
    total = new_total if changed or "total_steps" not in state else int(state["total_steps"])
    if step >= total:
        if changed and cfg.max_steps > 0:
            why = f"max_steps={cfg.max_steps}"
        elif changed:
            why = f"num_train_epochs={cfg.num_train_epochs} at {spe} steps per epoch"
        else:
            why = "the length the checkpoint recorded"
        msg = (
            f"nothing to train: checkpoint {resume_from} is at step {step} and the run is {total} "
            f"steps long ({why}); pass max_steps larger than {step} to train further, or drop "
            "resume to start a new run"
        )
        raise ConfigError(msg)
    return total


def _read_history(out: Path, upto_step: int) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if row.get("step", 0) <= upto_step:
                rows.append(row)
    return rows


def _peak_flops(device: Any) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


def _fmt_line(row: dict[str, Any], total: int) -> str:
    parts = [f"step {row['step']}/{total}", f"loss {row['loss']:.4f}"]
    if row.get("grad_norm") is not None:
        parts.append(f"grad_norm {row['grad_norm']:.2f}")
    parts += [
        f"lr {row['learning_rate']:.2e}",
        f"{row['step_time']:.2f} s",
        f"{row['tokens_per_s']:,.0f} tok/s",
    ]
    if row.get("eval_loss") is not None:
        parts.append(f"eval_loss {row['eval_loss']:.4f}")
    return " | ".join(parts)


def _token_loss_sum(model: Any, batch: dict[str, Any], autocast: Any) -> Any:
    """Summed cross-entropy over target tokens (labels shifted by one)."""
    import torch.nn.functional as F

    from nbtrain.sft.loss import model_inputs

    with autocast():
        logits = model(**model_inputs(batch)).logits
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def _to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """A collated batch on `device`, with the flat indices of its target tokens (found here on the CPU,
    so the loss need not ask the GPU for them); on a GPU through pinned memory, so the copy does not
    wait for the work queued before it."""
    import torch

    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    batch = {**batch, "target_rows": (shifted.reshape(-1) != -100).nonzero().squeeze(1)}
    if device.type != "cuda":
        return batch
    return {
        k: v if v is None else v.pin_memory().to(device, non_blocking=True)
        for k, v in batch.items()
    }


def _loss_impl(
    cfg: SFTConfig, model: Any, device: Any, autocast: Any
) -> tuple[str, Any, str | None]:
    """The loss this run computes: ("liger" | "chunked", fn) from the hidden states, or ("logits",
    None) the plain way; and a note when the config asked for a fused loss that cannot apply."""
    if not cfg.fused_cross_entropy:
        return "logits", None, None
    from nbtrain.sft import loss

    ok, why = loss.fused_loss_supported(model, autocast=autocast)
    if not ok:
        return "logits", None, f"fused_cross_entropy off: {why}"
    name, fn = loss.select_loss_impl(device)
    note = None
    if device.type == "cuda" and name != "liger":
        note = "Liger's fused loss not installed: using nbtrain's chunked one (pip install 'nbtrain[gpu]')"
    return name, fn, note


def _loss_sum(net: Any, batch: dict[str, Any], autocast: Any, fn: Any) -> Any:
    """Summed cross-entropy over the batch's target tokens, through `net` (the model, or DDP around it)."""
    if fn is None:
        return _token_loss_sum(net, batch, autocast)
    from nbtrain.sft import loss

    return loss.causal_lm_loss_sum(net, batch, autocast, fn)


def _plan_batch(cfg: SFTConfig, d: _Dist, model: Any, loss_sum: Any, n_rows: int) -> Any:
    """This rank's batch plan: as configured, or measured with probe steps for 'auto'."""
    import torch

    from nbtrain.sft.batch import MemoryProbe, auto_plan, fixed_plan

    if cfg.per_device_train_batch_size != "auto":
        return fixed_plan(
            int(cfg.per_device_train_batch_size),
            cfg.gradient_accumulation_steps,
            cfg.global_batch_size,
            d.world,
        )
    vocab = model.get_input_embeddings().num_embeddings

    def step(rows: int) -> None:
        # the worst case a micro-batch can be: every row max_length tokens, every token a target
        ids = torch.randint(0, vocab, (rows, cfg.max_length))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        batch = _to_device({k: v.cpu() for k, v in batch.items()}, d.device)
        try:
            loss_sum(model, batch).backward()
        finally:
            model.zero_grad(set_to_none=True)

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    probe = MemoryProbe(step, d.device, local_world=local_world)
    return auto_plan(
        probe,
        world=d.world,
        rows_per_rank=max(1, n_rows // d.world),
        grad_accum=cfg.gradient_accumulation_steps,
        global_batch=cfg.global_batch_size,
    )


# ------------------------------------------------------------------------------------------ finetune
def finetune(cfg: SFTConfig, merge: bool = False) -> TrainResult:
    """Fine-tune `cfg.model` with LoRA on `cfg.data`, on every rank; export the adapter on rank 0.

    In [1]: result = nbtrain.finetune(nbtrain.SFTConfig(model="tiny", data="train.jsonl", max_steps=50))
    In [2]: result.history.tail()

    Bad settings or data raise `ConfigError` on every rank before any step, and nothing is written to
    `output_dir`. `merge=True` also writes the merged model to `output_dir/merged`.
    """
    if not isinstance(cfg, SFTConfig):
        msg = f"finetune needs an nbtrain.SFTConfig, got {type(cfg).__name__}; build one with nbtrain.SFTConfig(...)"
        raise ConfigError(msg)
    import torch

    from nbtrain.sft.data import ShardedBatches, eval_batches, load_rows
    from nbtrain.sft.model import apply_lora, check_causal_lm, load_model, load_tokenizer

    d = _Dist()
    out = Path(cfg.output_dir).expanduser()

    # ---- set-up phase: everything that can be wrong is found here, on every rank, before any write
    def setup() -> dict[str, Any]:
        if not d.is_zero or os.environ.get("NBTRAIN_ENGINE") == "1":
            # N copies of the same "Loading weights" bar would bury rank 0's output in the cell, and on
            # an engine even rank 0's bar is a notebook widget the client cannot draw: the live display
            # already shows progress
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        resume_from = _check_output_dir(cfg) if d.is_zero else None
        rows = load_rows(cfg.data, "data")
        eval_rows = load_rows(cfg.eval_data, "eval_data") if cfg.eval_data is not None else None
        base_config = check_causal_lm(cfg.model)
        tokenizer = load_tokenizer(cfg.model)
        compute_dtype = _compute_dtype(cfg, d.device)
        weights_dtype = (
            compute_dtype if d.device.type == "cuda" and compute_dtype else torch.float32
        )
        base = load_model(cfg.model, weights_dtype, d.device, cfg.gradient_checkpointing)
        notes: list[str] = []
        levers: list[str] = []
        if d.device.type == "cuda" and cfg.use_liger_kernel and not cfg.torch_compile:
            why_not = speed.apply_liger(base)
            if why_not is None:
                levers.append("liger")
            elif cfg.use_liger_kernel is True:
                raise ConfigError(f"use_liger_kernel=True, but {why_not.split(': ', 1)[1]}")
            else:
                notes.append(why_not)
        # same LoRA init on every rank and world size
        torch.manual_seed(cfg.seed)
        model = apply_lora(base, cfg)
        if compute_dtype is not None and speed.skip_lora_input_cast(model):
            levers.append("bf16 lora inputs")
        return {
            "resume_from": resume_from,
            "tokenizer": tokenizer,
            "model": model,
            "rows": rows,
            "eval_rows": eval_rows,
            "compute_dtype": compute_dtype,
            "notes": notes,
            "levers": levers,
            # the base model's own KV-cache setting (training turns it off), for the merged export
            "use_cache": getattr(base_config, "use_cache", None),
        }

    s = d.agree(setup)
    model, tokenizer = s["model"], s["tokenizer"]
    compute_dtype = s["compute_dtype"]
    levers: list[str] = s["levers"]

    def autocast() -> Any:
        if compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=d.device.type, dtype=compute_dtype)

    loss_name, loss_fn, loss_note = _loss_impl(cfg, model, d.device, autocast)
    notes: list[str] = s["notes"] + ([loss_note] if loss_note else [])
    levers.append(f"loss {loss_name}")

    def loss_sum(net: Any, batch: dict[str, Any]) -> Any:
        return _loss_sum(net, batch, autocast, loss_fn)

    # ---- the batch plan: micro-batch and accumulation steps (measured where 'auto')
    plan = d.agree(lambda: _plan_batch(cfg, d, model, loss_sum, len(s["rows"])))
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
            s["rows"],
            tokenizer,
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
            )
        return batches, evals

    batches, evals = d.agree(make_batches)
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
    start_step = int(resumed["state"]["global_step"]) if resumed else 0
    # every rank has the same checkpoint and plan, so every rank raises here alike, before any write
    total_steps = _total_steps(cfg, spe, resumed, resume_from)
    global_batch = plan.global_batch
    if resumed and resumed["state"].get("global_batch_size") != global_batch and d.is_zero:
        print(
            f"nbtrain: resuming with a global batch of {global_batch} rows where the checkpoint used "
            f"{resumed['state'].get('global_batch_size')}; the data order continues by step, not by "
            f"row, and the learning-rate schedule runs to step {total_steps}",
            flush=True,
        )

    # ---- from here on rank 0 writes to output_dir
    history: list[dict[str, Any]] = []
    runlog: _RunLog | None = None
    name = cfg.run_name or out.name
    if d.is_zero:
        if cfg.overwrite:
            _clear_output_dir(out)
        out.mkdir(parents=True, exist_ok=True)
        history = _read_history(out, start_step) if resumed else []
        runlog = _RunLog(out, history, name, total_steps, d.world)
    history = d.broadcast_object(history)

    # ---- model, optimizer, schedule
    from peft import set_peft_model_state_dict
    from transformers import get_scheduler

    if resumed:
        set_peft_model_state_dict(model, resumed["adapter"])
    peft_model = model
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    if d.active:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(peft_model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=0.0)
    scheduler = get_scheduler(
        cfg.lr_scheduler_type,
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=total_steps,
    )
    if resumed:
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        # the loaded rate is the one the checkpoint's schedule gave the next step; a run made longer
        # (max_steps) has another schedule from here, so the next step takes that one's rate. Every
        # scheduler transformers' get_scheduler builds is a LambdaLR: rate = base rate x factor(step)
        rates = [
            base * factor(scheduler.last_epoch)
            for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = rates
        rng = resumed["rng"]
        if d.rank < len(rng):
            ckpt.set_rng_state(rng[d.rank])
        else:
            torch.manual_seed(cfg.seed + 1 + d.rank)
    else:
        # dropout masks differ across ranks, as distinct samples would get
        torch.manual_seed(cfg.seed + 1 + d.rank)

    n_params = sum(p.numel() for p in peft_model.parameters())
    # LoRA training FLOPs: forward 2N, backward 2N for activations; frozen weights need no weight grads
    flops_per_token = 4 * n_params + 2 * sum(p.numel() for p in trainable)
    peak_flops = _peak_flops(d.device) if compute_dtype is not None else None
    GA = plan.grad_accum

    def evaluate() -> float:
        peft_model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        from nbtrain.sft.data import collate

        with torch.no_grad():
            for exs in evals or []:
                pad = max(len(e.input_ids) for e in exs)
                b = _to_device(collate(exs, pad, tokenizer.pad_token_id), d.device)
                sums[0] += loss_sum(peft_model, b).double().item()
                sums[1] += sum(e.n_targets for e in exs)
        peft_model.train()
        sums = d.sum_(sums)
        return float(sums[0] / max(sums[1].item(), 1.0))

    def save(step: int) -> None:
        rngs = d.gather_objects(ckpt.get_rng_state())
        if d.is_zero:
            epoch, in_epoch = divmod(step, spe)
            state = {
                "global_step": step,
                "total_steps": total_steps,
                "epoch": step / spe,
                "data_position": {
                    "epoch": epoch,
                    "step_in_epoch": in_epoch,
                    "rows_consumed": step * global_batch,
                },
                "steps_per_epoch": spe,
                "world_size": d.world,
                "per_device_train_batch_size": plan.micro_batch,
                "gradient_accumulation_steps": GA,
                "global_batch_size": global_batch,
                "seed": cfg.seed,
            }
            written = ckpt.save_checkpoint(
                out,
                step,
                model=peft_model,
                optimizer=optimizer,
                scheduler=scheduler,
                rng_states=rngs,
                state=state,
                config=cfg.to_dict(),
            )
            if cfg.save_total_limit is not None:
                ckpt.prune_checkpoints(out, cfg.save_total_limit, written)

    live.begin(total_steps=total_steps, name=name)
    final_state = "failed"
    step = start_step
    last_saved = start_step if resumed else -1
    if d.device.type == "cuda":
        # the peak of this run's training, not of the set-up's probes or an earlier cell's work
        torch.cuda.reset_peak_memory_stats(d.device)
    meter = _Meter(d, spe, flops_per_token, peak_flops)
    clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")

    def log(row: dict[str, Any]) -> None:
        history.append(row)
        live.log(**row)
        if runlog is not None:
            runlog.row(row)

    try:
        model.train()
        grad_norm = None
        stopped = False
        while step < total_steps:
            # one small collective per step: target tokens and lengths per micro-batch, and the stop flag
            micro = [batches.micro_batch(step, a) for a in range(GA)]
            stats = torch.zeros((d.world, 2 * GA + 2), dtype=torch.float64)
            for a, exs in enumerate(micro):
                stats[d.rank, a] = sum(e.n_targets for e in exs)
                stats[d.rank, GA + a] = max((len(e.input_ids) for e in exs), default=1)
            stats[d.rank, 2 * GA] = sum(len(e.input_ids) for exs in micro for e in exs)
            if runlog is not None:
                stats[0, 2 * GA + 1] = float(runlog.stop_requested())
            stats = d.sum_meta(stats)
            if stats[0, 2 * GA + 1] > 0:
                stopped = True
                break
            n_targets = max(float(stats[:, :GA].sum()), 1.0)
            for a, exs in enumerate(micro):
                # pad to the longest row across ranks: the same shapes as one rank with the whole batch
                batch = batches.collate(exs, int(stats[:, GA + a].max()))
                batch = _to_device(batch, d.device)
                # gradients are all-reduced once per step, on the last micro-batch
                sync = a == GA - 1 or not d.active
                with contextlib.nullcontext() if sync else model.no_sync():
                    batch_loss = loss_sum(model, batch)
                    # DDP averages gradients over ranks; scaling by world turns that into the global sum
                    (batch_loss * (d.world / n_targets)).backward()
                meter.loss += batch_loss.detach().double() / n_targets
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
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
                eval_loss = evaluate()
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
            if d.is_zero:
                print(f"nbtrain: stopped at step {step}/{total_steps} on request; checkpoint saved")

        adapter_dir = merged_dir = None
        if d.is_zero:
            adapter_dir = str(ckpt.export_adapter(out, peft_model, tokenizer))
            if merge:
                merged_dir = str(
                    ckpt.export_merged(out, peft_model, tokenizer, use_cache=s["use_cache"])
                )
        d.barrier()
        final_state = "stopped" if stopped else "done"
    finally:
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
        },
    )


class _Meter:
    """Accumulates the steps between two logged rows and turns them into one row, the same on every rank."""

    def __init__(self, d: _Dist, spe: int, flops_per_token: float, peak_flops: float | None):
        import torch

        self.d, self.spe = d, spe
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.on_gpu = d.device.type == "cuda"
        self.loss = torch.zeros(
            (), dtype=torch.float64, device=d.device
        )  # sum of this rank's loss shares
        self.reset()

    def reset(self) -> None:
        self.loss.zero_()
        self.steps = 0
        self.tokens = 0.0
        self.start = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training (evaluation) out of tokens/s and step time."""
        self.start += seconds

    def row(self, step: int, grad_norm: Any, lr: float, eval_loss: float | None) -> dict[str, Any]:
        import torch

        d = self.d
        if self.on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.start
        # ranks' loss shares add up to the global mean; each rank's peak memory rides along
        vec = torch.zeros(1 + d.world, dtype=torch.float64)
        vec[0] = self.loss.item()
        if self.on_gpu:
            vec[1 + d.rank] = torch.cuda.max_memory_allocated() / 2**30
        vec = d.sum_meta(vec)
        steps = max(self.steps, 1)
        tokens_per_s = self.tokens / elapsed if elapsed > 0 else 0.0
        row: dict[str, Any] = {
            "step": step,
            "loss": float(vec[0]) / steps,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "learning_rate": float(lr),
            "tokens_per_s": tokens_per_s,
            "step_time": elapsed / steps,
            "epoch": step / self.spe,
        }
        if eval_loss is not None:
            row["eval_loss"] = eval_loss
        if self.on_gpu:
            if self.peak_flops:
                row["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * d.world)
            row["peak_memory_gb"] = float(vec[1:].max())
            for r in range(d.world):
                row[f"peak_memory_gb_rank{r}"] = float(vec[1 + r])
        self.reset()
        return row
