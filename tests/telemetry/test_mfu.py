"""MFU's FLOPs per token count a QLoRA base at its logical size, not its packed 4-bit storage.

A real tiny model quantised to NF4 by bitsandbytes' CPU kernels, as a QLoRA run loads it
(tests/model/test_shard.py does the same), against the same model unquantised.
"""

from __future__ import annotations

import pytest
import torch

from nbtrain.configs.sft import SFTConfig
from nbtrain.model.quant import bnb_config
from nbtrain.telemetry.report import flops_per_token, logical_numel
from tests.recipes.test_distributed import DATA

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the tiny model in fp32, the same model loaded in 4 bits), each with the same LoRA adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("mfu") / "m"
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    cfg = SFTConfig(model=str(path), data=DATA, load_in_4bit=True)
    lora = dict(r=8, lora_alpha=16, target_modules="all-linear")
    full = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**lora))
    q = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb_config(cfg, torch.float32), device_map={"": "cpu"}
    )
    q = get_peft_model(q, LoraConfig(**lora))
    return full, q


def test_4_bit_model_counts_its_logical_parameters(models):
    full, q = models
    n = sum(p.numel() for p in full.parameters())
    assert any(hasattr(p, "quant_state") for p in q.parameters())  # it really is 4-bit
    # numel() of the packed words is short of the model: the count MFU used to divide by
    assert sum(p.numel() for p in q.parameters()) < 0.8 * n
    assert logical_numel(q) == n
    assert logical_numel(full) == n

    trainable = sum(p.numel() for p in full.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in q.parameters() if p.requires_grad) > 0
    assert flops_per_token(q) == flops_per_token(full) == 4 * n + 2 * trainable


def test_packed_words_without_their_quant_state_count_from_the_module(models):
    # under FSDP2 a 4-bit weight is a plain tensor of its words, its quant_state on the Linear4bit
    import bitsandbytes as bnb

    full, q = models
    n = sum(p.numel() for p in full.parameters())
    saved = {}
    try:
        for module in q.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                saved[module] = module.weight
                module.weight = torch.nn.Parameter(module.weight.data, requires_grad=False)
        assert saved and not any(hasattr(p, "quant_state") for p in q.parameters())
        assert logical_numel(q) == n
    finally:
        for module, weight in saved.items():
            module.weight = weight
