"""GRPO's per-token log-probabilities from the hidden states, a chunk at a time (`token_logps(fused=True)`).

On a tiny-hidden Qwen3 at its real 151,936 vocab with LoRA, 2 rows of 900 completion tokens (the full
fp32 logits would be 1.02 GiB): the fused path gives the same log-probabilities and the same LoRA
gradients as the logits path at temperature 0.7, and the biggest tensor it makes is one chunk's
logits, while the logits path makes them all (so the test can fail).
"""

from __future__ import annotations

import torch

from nbtrain.losses.grpo import token_logps
from nbtrain.losses.sft import default_chunk_size, fused_loss_supported
from tests.losses.test_sft_vocab import VOCAB, Biggest, qwen3_lora  # noqa: F401 (fixture)

PROMPT, COMPLETION = 12, 900


def _batch():
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (2, PROMPT), generator=g)
    completion = torch.randint(0, VOCAB, (2, COMPLETION), generator=g)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :3] = 0  # left padding
    completion_mask = torch.ones_like(completion)
    completion_mask[1, -40:] = 0  # right padding
    return {
        "prompt_ids": prompt,
        "prompt_mask": prompt_mask,
        "completion_ids": completion,
        "completion_mask": completion_mask,
    }


def _grads(model):
    out = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return out


def test_fused_token_logps_equal_the_logits_path_within_one_chunk(qwen3_lora):  # noqa: F811
    model, batch = qwen3_lora, _batch()
    ok, why = fused_loss_supported(model)
    assert ok, why
    autocast = torch.autocast("cpu", enabled=False)
    weights = batch["completion_mask"].float()

    with Biggest() as fused:
        got = token_logps(model, batch, lambda: autocast, 0.7, fused=True)
        (got * weights).sum().backward()
    got_grads = _grads(model)
    assert fused.nbytes <= default_chunk_size(VOCAB) * VOCAB * 4, fused.shape

    with Biggest() as plain:
        want = token_logps(model, batch, lambda: autocast, 0.7, fused=False)
        (want * weights).sum().backward()
    want_grads = _grads(model)
    assert plain.nbytes >= 2 * COMPLETION * VOCAB * 4, plain.shape

    assert got.shape == (2, COMPLETION) and got.dtype == torch.float32
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
    assert any(g.abs().sum() > 0 for g in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        # summed over 1,800 tokens in another order: fp32 noise, relative to the gradient's scale
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))
