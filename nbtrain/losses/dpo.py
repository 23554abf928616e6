"""DPO's numbers for one micro-batch: sequence log-probabilities, the losses, and the reward metrics.

In [1]: logps = sequence_logps(model, batch, autocast, fused=True)     # [2B]: chosen rows, then rejected
In [2]: per_pair = pair_losses(logps, ref_logps, batch, beta, "sigmoid")
In [3]: sums = metric_sums(logps, ref_logps, batch, beta)              # summed over ranks and steps, then / pairs

As TRL's DPOTrainer computes them: a sequence's log-probability is the sum over its completion tokens
of log p(token | what comes before); with r = logp(policy) - logp(reference), the sigmoid loss is
-log sigmoid(beta (r_chosen - r_rejected)), IPO's (r_chosen / n_chosen - r_rejected / n_rejected -
1 / (2 beta))^2 with n a completion's token count; the rewards are beta r.

The log-probabilities come from the last hidden states and the lm_head weight, a chunk of tokens at a
time with each chunk's logits recomputed in backward (`torch.utils.checkpoint`), so only one chunk's
logits exist at once: the trick of `nbtrain.losses.sft`, here per token instead of summed.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: the metrics TRL's DPOTrainer logs, by its names, in the order `metric_sums` returns their sums
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def sequence_logps(model: Any, batch: dict[str, Any], autocast: Any, fused: bool) -> Any:
    """Each row's summed log-probability of its completion tokens (fp32, [rows]).

    `model` is called through its own forward (DDP included, so gradients sync). `fused`: from the
    last hidden states (a model `nbtrain.losses.sft.fused_loss_supported` passes), else from the logits.
    """
    import torch

    from nbtrain.losses.sft import chunked_token_logps, last_hidden_states, model_inputs

    ids, completion = batch["input_ids"], batch["completion_mask"]
    rows, width = ids.shape
    # position t predicts token t + 1; a completion token at position 0 has nothing before it
    labels = torch.where(completion[:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    labels = torch.nn.functional.pad(labels, (0, 1), value=-100).reshape(-1)
    where = (labels != -100).nonzero().squeeze(1)
    if fused:
        hidden, head, softcap = last_hidden_states(model, batch, autocast)
        flat = hidden.reshape(-1, hidden.shape[-1])
        with autocast():
            per_token = chunked_token_logps(
                flat.index_select(0, where),
                head.weight,
                head.bias,
                labels.index_select(0, where),
                softcap,
            )
    else:
        with autocast():
            logits = model(**model_inputs(batch)).logits
        flat = logits.reshape(-1, logits.shape[-1]).float()
        per_token = (
            torch.log_softmax(flat.index_select(0, where), dim=-1)
            .gather(1, labels.index_select(0, where).unsqueeze(1))
            .squeeze(1)
        )
    out = torch.zeros(rows, dtype=torch.float32, device=ids.device)
    out = out.index_add(0, where // width, per_token)
    if where.numel() == 0:
        # a stand-in batch with no completion tokens: a zero that still reaches every LoRA weight, so
        # that DDP's backward (and FSDP's) completes on this rank as on the others
        out = out + 0.0 * flat.float().sum()
    return out


def pair_losses(
    logps: Any, ref_logps: Any, batch: dict[str, Any], beta: float, loss_type: str
) -> Any:
    """The loss of each pair ([B]), zero for a stand-in pair: TRL's "sigmoid" or "ipo"."""
    import torch.nn.functional as F

    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_r, rejected_r = chosen - ref_chosen, rejected - ref_rejected
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_r - rejected_r))
    elif loss_type == "ipo":
        # per token, as TRL (and the IPO authors' results) normalise the sequence-level log-ratios
        n_chosen, n_rejected = batch["completion_mask"].sum(dim=1).clamp(min=1).chunk(2)
        losses = (chosen_r / n_chosen - rejected_r / n_rejected - 1 / (2 * beta)) ** 2
    else:
        msg = f"unknown DPO loss_type {loss_type!r}"
        raise ValueError(msg)
    return losses * batch["real"].to(losses.dtype)


def metric_sums(logps: Any, ref_logps: Any, batch: dict[str, Any], beta: float) -> Any:
    """The sums over this micro-batch's real pairs of each of `METRICS`, then the pair count (fp64 [7]
    on the CPU): summed over ranks and steps, then divided by the pairs, they are TRL's means."""
    import torch

    real = batch["real"].to(torch.float64)
    chosen, rejected = logps.detach().double().chunk(2)
    ref_chosen, ref_rejected = ref_logps.detach().double().chunk(2)
    chosen_rw, rejected_rw = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    per_pair = torch.stack(
        [
            chosen_rw,
            rejected_rw,
            (chosen_rw > rejected_rw).double(),
            chosen_rw - rejected_rw,
            chosen,
            rejected,
        ]
    )
    sums = (per_pair * real.to(per_pair.device)).sum(dim=1).cpu()
    return torch.cat([sums, real.sum().reshape(1).cpu()])
