"""FSDP2 (shard="fsdp") against DDP on 2 real ranks for the MoE and hybrid families: the same losses,
gradient norms and adapter (experts included). One process pair per run, as tests/model/test_shard.py
does for Llama; the families' tiny models are built once per module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.test_distributed import _kw, _losses, run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the hybrids (linear attention, Mamba), MoE families whose checkpoints hold the experts fused
#: (GPT-OSS with sinks, Llama 4 with a shared expert), and one whose checkpoint holds one entry per
#: expert (Qwen3-MoE, fused on load as transformers does), with the default LoRA: on the fused
#: experts too (peft's parameter LoRA, lora.ParamWrapper)
FAMILIES = ["qwen3_5", "granite4", "gpt_oss", "llama4", "qwen3_moe"]
MOE = ("gpt_oss", "llama4", "qwen3_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_equals_ddp(family, tmp_path):
    from nbtrain.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch=family)
    if family == "qwen3_moe":  # the checkpoint really stores each expert apart
        assert any(".experts.0.gate_proj." in k for k in _checkpoint_keys(model))
    runs = {
        shard: run_ranks(tmp_path, 2, **_kw(model, tmp_path / shard, shard=shard, max_steps=3))
        for shard in ("ddp", "fsdp")
    }
    hd, hf = runs["ddp"][0]["history"], runs["fsdp"][0]["history"]
    torch.testing.assert_close(_losses(hf), _losses(hd))
    torch.testing.assert_close(
        torch.tensor([x["grad_norm"] for x in hf]), torch.tensor([x["grad_norm"] for x in hd])
    )
    a_f = load_file(str(Path(runs["fsdp"][0]["adapter_dir"]) / "adapter_model.safetensors"))
    a_d = load_file(str(Path(runs["ddp"][0]["adapter_dir"]) / "adapter_model.safetensors"))
    assert a_f.keys() == a_d.keys()
    torch.testing.assert_close(a_f, a_d, atol=1e-4, rtol=1e-3)
    if family in MOE:
        # the fused experts' own LoRA (both of peft's nested ParamWrappers, A and B) trained, and equal
        experts = [k for k in a_f if ".experts." in k]
        assert len(experts) >= 4 and len(experts) % 4 == 0
        assert all(a_f[k].abs().sum() > 0 for k in experts)
    if family == "llama4":
        assert any(".shared_expert." in k for k in a_f)


def _checkpoint_keys(model_dir):
    from safetensors import safe_open

    keys = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys += list(f.keys())
    return keys


def _build_sharded(model_dir, out):
    from nbtrain.configs.sft import SFTConfig
    from nbtrain.engine.dist import Dist
    from nbtrain.model import shard

    cfg = SFTConfig(**_kw(model_dir, out, shard="fsdp"))
    d = Dist()
    mesh = shard.make_mesh(d, "fsdp", None)
    return shard.build_sharded(cfg, d, mesh, torch.float32, None, lambda base: None)


@pytest.mark.parametrize("family", MOE)
def test_fsdp_wraps_each_decoder_layer_whole_experts_inside(family, tmp_path):
    """One fully_shard unit per decoder layer (attention, router, experts and their LoRA together)
    and one for the root: no expert block is a unit of its own, so a layer's experts are gathered in
    one all-gather and their LoRA gradients reduce-scattered with the layer's."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from nbtrain.model.tiny import make_tiny_model

    model = _build_sharded(make_tiny_model(tmp_path / "model", arch=family), tmp_path / "out")
    inner = model.get_base_model()
    units = {n for n, m in inner.named_modules() if isinstance(m, FSDPModule)}
    assert units == {"", *(f"model.layers.{i}" for i in range(inner.config.num_hidden_layers))}
    trained = [n for n, p in inner.named_parameters() if ".experts." in n and p.requires_grad]
    # the experts' LoRA is there, and each piece of it is sharded in its layer's unit
    assert trained
    for name, param in inner.named_parameters():
        if ".experts." in name:
            assert isinstance(param, DTensor), name
            assert name.startswith("model.layers.")


def test_fsdp_on_a_checkpoint_missing_an_expert_is_refused_naming_ddp(tmp_path):
    """A per-expert checkpoint that lacks one expert's entry cannot be fused: refused before any step,
    naming the weights and shard='ddp' (which reports what transformers makes of it)."""
    from safetensors.torch import save_file

    from nbtrain.errors import ConfigError
    from nbtrain.model.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", arch="qwen3_moe")
    (path,) = sorted(Path(model_dir).glob("*.safetensors"))
    weights = load_file(str(path))
    (gone,) = [k for k in weights if k.endswith("layers.0.mlp.experts.1.up_proj.weight")]
    del weights[gone]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"experts\.gate_up_proj.*shard='ddp'"):
        _build_sharded(model_dir, tmp_path / "out")
