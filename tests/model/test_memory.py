"""The memory estimate, MFU's FLOPs and the run's plan on MoE models count the experts: every expert
for the weights, the routed top-k for what a token computes (nbtrain.model.memory, targets)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")

MOE = ["qwen3_moe", "gpt_oss", "deepseek_v3", "llama4", "qwen3_next"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("memory")
    return {f: make_tiny_model(root / f, arch=f) for f in [*MOE, "llama"]}


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _experts_by_hand(model):
    """(expert parameters, experts per block, top-k), read off the model's own MoE blocks."""
    numel, n_experts = 0, 0
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            numel += sum(p.numel() for p in module.parameters())
            fused = [p for p in module.parameters() if p.ndim == 3]
            n_experts = fused[0].shape[0]
    text = model.config.get_text_config()
    return numel, n_experts, text.num_experts_per_tok


@pytest.mark.parametrize("family", MOE)
def test_active_parameters_leave_out_the_experts_a_token_is_not_routed_to(models, family):
    from nbtrain.model.targets import active_numel, routed_experts

    model = _load(models[family])
    total = sum(p.numel() for p in model.parameters())
    numel, n_experts, k = _experts_by_hand(model)
    assert numel > 0 and n_experts > k
    assert active_numel(model) == total - numel + round(numel * k / n_experts)
    assert routed_experts(model) == (numel, k / n_experts)


def test_a_dense_model_is_all_active(models):
    from nbtrain.model.targets import active_numel

    model = _load(models["llama"])
    assert active_numel(model) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", MOE)
def test_the_memory_shape_of_an_moe_counts_every_expert(models, family):
    from transformers import AutoConfig

    from nbtrain.model.memory import Shape, lora_params
    from nbtrain.model.report import check_model

    config = AutoConfig.from_pretrained(models[family])
    shape = Shape.for_config(config)
    total = sum(p.numel() for p in _load(models[family]).parameters())
    assert abs(shape.params - total) < shape.layers  # the blocks' average, rounded down
    # the dense formula (one MLP a block) would count fewer
    assert Shape.from_config(config.get_text_config()).block_params < shape.block_params
    # LoRA counted as check_model counts it (which tests/model/test_report.py checks against peft)
    assert lora_params(shape, 4) == check_model(models[family], lora_r=4).lora_params


def test_qwen3_30b_a3b_counts_as_published():
    """Qwen3-30B-A3B's config (its config.json's numbers): 30.5B parameters, 3.3B activated, as its
    model card says; built on the meta device."""
    from transformers import Qwen3MoeConfig

    from nbtrain.model.memory import Shape, rank_memory

    config = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
    )
    shape = Shape.for_config(config)
    assert shape.params / 1e9 == pytest.approx(30.5, abs=0.1)
    assert Shape.from_config(config).params < 0.2 * shape.params  # one dense MLP a block
    # a token goes through 8 experts of 768: the activations' MLP width, plus the router's share
    assert 8 * 768 <= shape.active_intermediate < 8 * 768 * 1.05
    m = rank_memory(shape, world=1)
    assert m["weights"] / 2**30 == pytest.approx(30.5e9 * 2 / 2**30, rel=0.01)  # bf16


def test_the_run_plan_says_total_active_and_trained(models, tmp_path):
    import nbtrain
    from nbtrain.data.examples import instructions_path
    from nbtrain.model.targets import active_numel

    cfg = nbtrain.SFTConfig(
        model=models["qwen3_moe"],
        data=instructions_path(),
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        max_length=32,
        save_steps=None,
    )
    params = nbtrain.finetune(cfg).plan["params"]
    base = _load(models["qwen3_moe"])
    assert params["total"] - params["trainable"] == sum(p.numel() for p in base.parameters())
    assert params["active"] < params["total"]
    assert params["total"] - params["active"] == sum(p.numel() for p in base.parameters()) - (
        active_numel(base)
    )


def test_mfu_flops_count_active_parameters(models):
    """loop.begin's FLOPs per token: 4 x the active parameters (the LoRA's among them) and 2 x the
    trained ones, on a peft model of GPT-OSS with its experts adapted."""
    from types import SimpleNamespace

    from nbtrain.model.pretrained import apply_lora
    from nbtrain.model.targets import routed_experts
    from nbtrain.telemetry.report import flops_per_token

    model = apply_lora(
        _load(models["gpt_oss"]),
        SimpleNamespace(
            lora_r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules="all-linear",
            lora_moe=["experts"],
        ),
    )
    routed, share = routed_experts(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters()) - trained
    active = base - routed + round(routed * share)
    # the LoRA weights compute in the forward too (4 each), and have weight gradients (2 each)
    assert flops_per_token(model, routed - round(routed * share)) == 4 * (active + trained) + (
        2 * trained
    )
    assert routed > 0 and share < 1
