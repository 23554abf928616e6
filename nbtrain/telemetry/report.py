"""What a run reports: MFU's GPU peaks, the per-step meter, and rank 0's log line, metrics.jsonl and
runs-registry record."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbtrain import atomic
from nbtrain.engine.dist import Dist
from nbtrain.runs import METRICS_FILE

if TYPE_CHECKING:
    from nbtrain.telemetry.tracking import Trackers

log = logging.getLogger(__name__)

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


def flops_per_token(model: Any, unrouted: int = 0) -> float:
    """Training FLOPs per token of a LoRA model, for MFU: 4N for the forward (2N) and the backward's
    activation gradients (2N), and 2 per trainable parameter for its weight gradients; frozen weights
    need none. N counts a 4-bit base's logical weights, not its packed storage (`logical_numel`), less
    `unrouted`: an MoE's expert parameters a token is not routed to (`nbtrain.model.targets
    .routed_experts`), so N is the active parameters. LoRA on the experts is counted whole.
    """

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return float(4 * (logical_numel(model) - unrouted) + 2 * trainable)


def peak_flops(device: Any) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


class RunLog:
    """Rank 0's record of a run: the log line, metrics.jsonl and the runs registry, row by row."""

    def __init__(
        self,
        out: Path,
        history: list[dict[str, Any]],
        name: str,
        total: int,
        world: int,
        trackers: Trackers | None = None,
        kind: str = "sft",
    ):
        from nbtrain.runs import register_run

        self.total = total
        self.trackers = trackers  # report_to's TensorBoard and MLflow writers
        # a resumed run drops the rows logged after its checkpoint, which it is about to redo
        atomic.write_text(out / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in history))
        self.file = (out / METRICS_FILE).open("a")
        self.run_id = register_run(
            out,
            name=name,
            total_steps=total,
            world_size=world,
            # set on every engine by the cluster that started it (`cluster.group.init_group`)
            cluster_id=os.environ.get("NBTRAIN_CLUSTER_ID"),
            kind=kind,
        )

    def stop_requested(self) -> bool:
        from nbtrain.runs import stop_requested

        return stop_requested(self.run_id)

    def row(self, row: dict[str, Any]) -> None:
        from nbtrain.runs import update_run

        print(fmt_line(row, self.total), flush=True)
        # one line per row, flushed, so a crashed run keeps its history
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.trackers is not None:
            self.trackers.row(row)
        update_run(
            self.run_id, step=row["step"], loss=row["loss"], tokens_per_s=row["tokens_per_s"]
        )

    def finish(self, state: str, **fields: Any) -> None:
        """Close the files and mark the record `state`, with `fields` (a preemption's step and
        checkpoint)."""
        from nbtrain.runs import finish_run

        self.file.close()
        if self.trackers is not None:
            self.trackers.finish(state)
        finish_run(self.run_id, state, **fields)


def read_history(out: Path, upto_step: int) -> list[dict[str, Any]]:
    path = out / METRICS_FILE
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


def fmt_line(row: dict[str, Any], total: int) -> str:
    parts = [f"step {row['step']}/{total}", f"loss {row['loss']:.4f}"]
    if row.get("aux_loss") is not None:  # an MoE's router loss, where the run adds it
        parts.append(f"aux_loss {row['aux_loss']:.4f}")
    if row.get("reward") is not None:  # GRPO: the mean reward is what a run is watched by
        parts.append(f"reward {row['reward']:.3f}")
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


class Meter:
    """Accumulates the steps between two logged rows and turns them into one row, the same on every rank.

    `step_shift`: the data step minus the optimizer step, nonzero in a run resumed on another world
    size or batch, so that `epoch` says how far through its data the run is.
    """

    def __init__(
        self,
        d: Dist,
        spe: int,
        flops_per_token: float,
        peak_flops: float | None,
        step_shift: int = 0,
        aux: bool = False,
    ):
        import torch

        self.d, self.spe, self.step_shift = d, spe, step_shift
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.on_gpu = d.device.type == "cuda"
        self.loss = torch.zeros(
            (), dtype=torch.float64, device=d.device
        )  # sum of this rank's loss shares
        #: an MoE's router loss, this rank's shares of its mean (logged as aux_loss where `aux`)
        self.has_aux = aux
        self.aux = torch.zeros((), dtype=torch.float64, device=d.device)
        self.reset()

    def reset(self) -> None:
        #: figures a hook adds to the next row (`note`), e.g. the seconds spent sampling
        self.extra: dict[str, float] = {}
        self.loss.zero_()
        self.aux.zero_()
        self.steps = 0
        self.tokens = 0.0
        self.start = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training (evaluation) out of tokens/s and step time."""
        self.start += seconds

    def note(self, key: str, value: float) -> None:
        """Add `value` to column `key` of the next row (summed until that row is made)."""
        self.extra[key] = self.extra.get(key, 0.0) + value

    def row(self, step: int, grad_norm: Any, lr: float, eval_loss: float | None) -> dict[str, Any]:
        import torch

        d = self.d
        if self.on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.start
        # ranks' loss shares add up to the global mean; rank 0's wall clock (so every rank's row has
        # the same time) and each rank's peak memory ride along
        vec = torch.zeros(3 + d.world, dtype=torch.float64)
        vec[0] = self.loss.item()
        if d.is_zero:
            vec[1] = time.time()
        vec[2] = self.aux.item()
        if self.on_gpu:
            vec[3 + d.rank] = torch.cuda.max_memory_allocated() / 2**30
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
            "epoch": (step + self.step_shift) / self.spe,
            # wall-clock time of the row, so runs can be compared against time as well as step
            "time": float(vec[1]),
        }
        if self.has_aux:
            row["aux_loss"] = float(vec[2]) / steps
        if eval_loss is not None:
            row["eval_loss"] = eval_loss
        row.update(self.extra)
        if self.on_gpu:
            if self.peak_flops:
                row["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * d.world)
            row["peak_memory_gb"] = float(vec[3:].max())
            for r in range(d.world):
                row[f"peak_memory_gb_rank{r}"] = float(vec[3 + r])
        self.reset()
        return row


def logical_numel(model: Any) -> int:
    """The parameters of `model` as it computes with them, a 4-bit weight counted at its logical shape.

    bitsandbytes stores a 4-bit weight as packed words (two values a byte, or more per element in a
    wider `bnb_4bit_quant_storage`), so its `numel()` is a fraction of the weight's; the logical shape
    is the quant_state's. Under FSDP2 the weight is a plain (sharded) tensor of those words and the
    quant_state stays on the Linear4bit module (`fix_4bit_weight_quant_state_from_module`), where it is
    read instead. A weight shared by two modules is counted once.
    """
    import math

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            qs = getattr(p, "quant_state", None)
            if qs is None and name == "weight":
                qs = getattr(module, "quant_state", None)
            shape = getattr(qs, "shape", None)
            total += math.prod(shape) if shape is not None else p.numel()
    return total
