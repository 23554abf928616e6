"""What one micro-batch needs: its copy to the device, the loss (fused from hidden states, or through the
logits), the batch plan that sizes it, and the eval loss over the eval batches."""

from __future__ import annotations

import logging
import os
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.engine.dist import Dist

log = logging.getLogger(__name__)


def token_loss_sum(model: Any, batch: dict[str, Any], autocast: Any, aux: Any = None) -> Any:
    """Summed cross-entropy over target tokens (labels shifted by one); `aux` as in `loss_sum`."""
    import torch.nn.functional as F

    from nbtrain.losses.sft import model_inputs

    with autocast():
        out = model(**model_inputs(batch), **(aux.kwargs if aux is not None else {}))
    if aux is not None:
        aux.seen(out)
    logits = out.logits
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
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


def loss_impl(
    cfg: SFTConfig, model: Any, device: Any, autocast: Any
) -> tuple[str, Any, str | None]:
    """The loss this run computes: ("liger" | "chunked", fn) from the hidden states, or ("logits",
    None) the plain way; and a note when the config asked for a fused loss that cannot apply."""
    if not cfg.fused_cross_entropy:
        return "logits", None, None
    from nbtrain.losses import sft as loss

    ok, why = loss.fused_loss_supported(model, autocast=autocast)
    if not ok:
        return "logits", None, f"fused_cross_entropy off: {why}"
    name, fn = loss.select_loss_impl(device)
    note = None
    if device.type == "cuda" and name != "liger":
        note = "Liger's fused loss not installed: using nbtrain's chunked one (pip install 'nbtrain[gpu]')"
    return name, fn, note


def loss_sum(net: Any, batch: dict[str, Any], autocast: Any, fn: Any, aux: Any = None) -> Any:
    """Summed cross-entropy over the batch's target tokens, through `net` (the model, or DDP around it).
    `aux` (`nbtrain.losses.router.RouterAux`): also ask an MoE for its router loss, which `aux` keeps."""
    if fn is None:
        return token_loss_sum(net, batch, autocast, aux)
    from nbtrain.losses import sft as loss

    return loss.causal_lm_loss_sum(net, batch, autocast, fn, aux)


def evaluate(
    net: Any, evals: Any, n_eval: int, filler: Any, pad_id: int, d: Dist, loss_sum: Any
) -> float:
    """The eval loss per target token over every rank's eval batches (`evals`), `net` in eval mode
    meanwhile. Each rank runs `n_eval` forwards: under FSDP each one gathers weights on every rank, so
    a rank short of batches runs `filler` (a micro-batch of its own) and counts nothing."""
    import torch

    from nbtrain.data.loader import collate

    net.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(n_eval):
            exs = evals[i] if i < len(evals) else filler
            pad = max(len(e.input_ids) for e in exs)
            loss = loss_sum(net, to_device(collate(exs, pad, pad_id), d.device)).double().item()
            if i < len(evals):
                sums[0] += loss
                sums[1] += sum(e.n_targets for e in exs)
    net.train()
    sums = d.sum_(sums)
    return float(sums[0] / max(sums[1].item(), 1.0))


def plan_batch(cfg: SFTConfig, d: Dist, model: Any, loss_sum: Any, n_rows: int) -> Any:
    """This rank's batch plan: as configured, or measured with probe steps for 'auto'."""
    import torch

    from nbtrain.data.batch import MemoryProbe, auto_plan, fixed_plan

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
        batch = to_device({k: v.cpu() for k, v in batch.items()}, d.device)
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
        shard_size=_shard_size(cfg, d.world, local_world),
    )


def _shard_size(cfg: SFTConfig, world: int, local_world: int) -> int:
    """Over how many ranks the model's weights are split: 1 (ddp), all (fsdp), a node's (hsdp)."""
    return {"ddp": 1, "fsdp": world, "hsdp": min(world, local_world)}.get(cfg.shard, 1)
