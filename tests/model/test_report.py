"""nbtrain.check_model / %nbtrain check --model: what each path does with a model, from its config on
the meta device. Its counts are checked against the real thing: peft's trainable parameters after
nbtrain's LoRA, and the experts a token uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")

FAMILIES = [
    "llama",
    "phi3",
    "gemma4",
    "qwen3_5",
    "granite4",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "llama4",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("report")
    return {f: make_tiny_model(root / f, arch=f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("r", [4, 16])
def test_lora_parameter_count_is_what_peft_trains(models, family, r):
    from transformers import AutoModelForCausalLM

    import nbtrain
    from nbtrain.model.pretrained import apply_lora

    report = nbtrain.check_model(models[family], lora_r=r)
    cfg = SimpleNamespace(lora_r=r, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(models[family]), cfg)
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert report.lora_params == trained
    assert report.family == family
    real = AutoModelForCausalLM.from_pretrained(models[family])
    assert report.params == sum(p.numel() for p in real.parameters())


def test_an_moe_counts_the_experts_a_token_uses(models):
    import nbtrain

    report = nbtrain.check_model(models["qwen3_moe"])
    assert report.kind == "moe"
    # 4 experts, 2 per token: half of the expert weights are active
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained(models["qwen3_moe"])
    experts = sum(p.numel() for n, p in real.named_parameters() if ".experts." in n)
    assert report.active_params == report.params - experts // 2
    assert "router" in report.left_out and "lora_moe" in str(report)
    # what tests/model/test_shard_families.py shows FSDP2 does on it
    assert "LoRA on the experts included" in report.paths["FSDP2"]


def test_hybrid_models_are_named_and_their_packing_refused(models):
    import nbtrain

    # transformers 5 names Granite 4's Mamba layers linear_attention in layer_types, too
    for family, layer in (("qwen3_5", "linear_attention"), ("granite4", "linear_attention")):
        report = nbtrain.check_model(models[family])
        assert report.kind == "hybrid"
        assert report.paths["packing"].startswith("refused") and layer in report.paths["packing"]
    assert nbtrain.check_model(models["llama"]).paths["packing"].startswith("exact")


def test_the_magic_prints_the_report_without_a_cluster(ip, models, capsys):
    ip.run_line_magic("nbtrain", f"check --model {models['gpt_oss']} --lora-r 8")
    out = capsys.readouterr().out
    assert "GptOssForCausalLM, moe" in out
    assert "LoRA r=8" in out and "gate_up_proj, down_proj" in out
    assert "active per token" in out


def test_a_folder_that_is_not_a_model_is_a_clear_error(tmp_path):
    import nbtrain
    from nbtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="config.json"):
        nbtrain.check_model(str(tmp_path))


def test_nothing_is_loaded(models, monkeypatch):
    """Built on the meta device: no weight file is read."""
    import safetensors.torch

    import nbtrain

    def refuse(*a, **k):
        raise AssertionError("a weight file was read")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    report = nbtrain.check_model(models["llama"])
    assert report.params > 0
    assert torch.get_default_device().type == "cpu"
