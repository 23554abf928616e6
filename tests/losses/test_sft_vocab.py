"""The SFT step's loss at a real vocabulary (Qwen3's 151,936) on the CPU never makes the [tokens, vocab] logits.

A tiny-hidden Qwen3 (hidden 64, 1 layer) built from its config, LoRA on it, and a batch of 1,799 target
tokens: the full fp32 logits would be 1.02 GiB. A TorchDispatchMode records the biggest tensor any op
makes; through `step.loss_sum` with the impl `select_loss_impl` picks on the CPU it stays within one
chunk's logits (`default_chunk_size`), forward and backward, while the plain logits path
(`fused_cross_entropy=False`, `fn=None`) makes the whole thing, so the test can fail.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nbtrain.losses.sft import default_chunk_size, fused_loss_supported, select_loss_impl
from nbtrain.recipes import step

log = logging.getLogger(__name__)

VOCAB, HIDDEN, ROWS, LENGTH = 151936, 64, 2, 901  # 1,799 target tokens: 1.02 GiB of fp32 logits


class Biggest(TorchDispatchMode):
    """The largest tensor (bytes) any op returns while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.nbytes:
                self.nbytes = t.numel() * t.element_size()
                self.shape = tuple(t.shape)
        return out


@pytest.fixture(scope="module")
def qwen3_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    base = Qwen3ForCausalLM(cfg).eval()
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
    )
    return get_peft_model(base, lora)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    labels = ids.clone()
    labels[0, :1] = -100  # a prompt token: not a target
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_the_cpu_step_loss_never_holds_the_whole_batch_logits(qwen3_lora):
    model, batch = qwen3_lora, _batch()
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    full = tokens * VOCAB * 4
    assert full > 2**30  # the premise: the plain path's fp32 logits are over 1 GiB
    ok, why = fused_loss_supported(model)
    assert ok, why
    name, fn = select_loss_impl(torch.device("cpu"))
    assert name == "chunked"
    chunk = default_chunk_size(VOCAB)
    autocast = torch.autocast("cpu", enabled=False)

    with Biggest() as fused:
        got = step.loss_sum(model, step.to_device(batch, torch.device("cpu")), lambda: autocast, fn)
        got.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)
    log.info("fused path: biggest tensor %s, %d bytes", fused.shape, fused.nbytes)
    # one chunk's fp32 logits (the tied embedding, vocab x 64, is smaller)
    assert fused.nbytes <= chunk * VOCAB * 4, fused.shape

    # the plain path (fused_cross_entropy=False) makes the whole batch's logits: the measurement sees it
    with torch.no_grad(), Biggest() as plain:
        want_plain = step.loss_sum(model, batch, lambda: autocast, None)
    assert plain.nbytes >= full, plain.shape

    # the reference: F.cross_entropy over the full logits, computed here
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        want = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, VOCAB),
            batch["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
    del logits
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(want_plain, want, rtol=1e-5, atol=0.0)
