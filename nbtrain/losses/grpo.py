"""GRPO's numbers: advantages relative to each prompt's group, per-token log-probabilities, the clipped
policy loss with its aggregation per loss type, and the step's loss metrics, as TRL's GRPOTrainer
computes them (trl/trainer/grpo_trainer.py: `_generate_and_score_completions`, `_compute_loss`).

In [1]: adv, reward = advantages(rewards_per_func, weights, num_generations, "group")
In [2]: logps = token_logps(model, batch, autocast, temperature)        # [rows, completion tokens]
In [3]: loss, sums = policy_loss(logps, None, None, batch, settings, norm)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: the loss metrics of a step, summed over tokens (then divided by the step's tokens), by TRL's names
LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class LossSettings:
    """What the loss reads from GRPOConfig."""

    loss_type: str
    epsilon_low: float
    epsilon_high: float
    beta: float
    max_completion_length: int
    temperature: float
    use_bias_correction_kl: bool = True


def nanstd(x: Any, dim: int | None = None) -> Any:
    """The standard deviation ignoring NaNs, with Bessel's correction (TRL's `nanstd`)."""
    import torch

    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    count = count.to(x.dtype)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan")))
    out = torch.sqrt(var * corr)
    return out if dim is None else out.squeeze(dim)


def advantages(
    rewards_per_func: Any, weights: list[float], group: int, scale: str
) -> tuple[Any, Any]:
    """(advantages [N], rewards [N]) of N = prompts x `group` completions in prompt order, from each
    function's rewards ([N, F], NaN where a function returned None): the weighted sum, minus its group's
    mean, divided by the std (+1e-4) of the group ('group'), of all N ('batch'), or not ('none')."""
    import torch

    w = torch.tensor(weights, dtype=rewards_per_func.dtype)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), rewards


def token_logps(
    model: Any, batch: dict[str, Any], autocast: Any, temperature: float, fused: bool = False
) -> Any:
    """log p(completion token | what comes before) under `model` ([rows, C], fp32), the logits divided
    by `temperature` as TRL does; `batch` holds left-padded prompts and right-padded completions.

    `fused` (a model `nbtrain.losses.sft.fused_loss_supported` passes): from the last hidden states
    and the lm_head a chunk of tokens at a time, so the [rows, C, vocab] logits never exist at once
    (at Qwen3's 151,936 vocab, 8 rows of 256 tokens would be 1.2 GiB of fp32)."""
    import torch

    from nbtrain.losses.sft import chunked_token_logps, last_hidden_states

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    rows, width = batch["completion_ids"].shape
    if fused:
        hidden, head, softcap = last_hidden_states(
            model, {"input_ids": ids, "attention_mask": mask}, autocast
        )
        # position t predicts token t + 1: the states before each completion token
        states = hidden[:, -width - 1 : -1].reshape(-1, hidden.shape[-1])
        with autocast():
            flat = chunked_token_logps(
                states,
                head.weight,
                head.bias,
                batch["completion_ids"].reshape(-1),
                softcap,
                temperature,
            )
        return flat.view(rows, width)
    with autocast():
        # only the logits that predict a completion token (and one more), never the prompt's
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits
    logits = logits[:, :-1].float() / temperature
    return (
        torch.log_softmax(logits, dim=-1).gather(2, batch["completion_ids"].unsqueeze(2)).squeeze(2)
    )


def policy_loss(
    logps: Any,
    old_logps: Any,
    ref_logps: Any,
    batch: dict[str, Any],
    s: LossSettings,
    grad_accum: int,
    step_tokens: float,
    world: int,
) -> tuple[Any, Any]:
    """(this micro-batch's loss, the sums of `LOSS_METRICS` and the token count, fp64 on the CPU).

    The loss is scaled as TRL scales each micro-batch's, so that DDP's average over `world` ranks of
    the gradients summed over `grad_accum` micro-batches is TRL's step: 'dapo' divides by the step's
    completion tokens over every rank (`step_tokens`) per rank; the others by `grad_accum`."""
    import torch

    mask = batch["loss_mask"].to(logps.dtype)
    adv = batch["advantages"].to(logps.dtype).unsqueeze(1)
    # on-policy (collocated) the old policy is this one: the ratio is 1 but carries the gradient
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if s.beta != 0.0:
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        if s.use_bias_correction_kl:
            # TRL's default: the ratio (1 on-policy, but differentiable) makes the KL's gradient the
            # unbiased reverse-KL gradient
            kl = kl * ratio
        per_token = per_token + s.beta * kl
    rows = logps.shape[0]
    if s.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / grad_accum
    elif s.loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0) / grad_accum
    elif s.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (rows * s.max_completion_length) / grad_accum
    elif s.loss_type == "dapo":
        loss = (per_token * mask).sum() / max(step_tokens / world, 1e-12)
    else:
        msg = f"unknown GRPO loss_type {s.loss_type!r}"
        raise ValueError(msg)
    with torch.no_grad():
        low = ((ratio < 1 - s.epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + s.epsilon_high) & (adv > 0)).to(mask.dtype)
        region = torch.clamp(low + high, max=1.0)
        kl_sum = (kl * mask).sum() if kl is not None else mask.new_zeros(())
        sums = torch.stack(
            [kl_sum, (low * mask).sum(), (high * mask).sum(), (region * mask).sum(), mask.sum()]
        )
    return loss, sums.double().cpu()
