"""The sharded QLoRA load (shard="fsdp" with load_in_4bit) against from_pretrained's quantised load, on
the CPU (bitsandbytes' CPU kernels, fp32) and, where there is one, on a GPU (bf16: the weights are read
in bf16 before they are quantised, and the 4-bit words are stored in bf16 for FSDP2).

One rank keeps every row of every shard, so what it holds is compared whole, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from nbtrain.configs.sft import SFTConfig
from tests.recipes.test_distributed import _kw

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here"),
        ],
    ),
]


def _local(t):
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_qlora_quantises_weight_by_weight_as_from_pretrained_does(
    tiny, monkeypatch, device
):
    """No whole base on the rank: from_pretrained is not called and each weight is quantised alone;
    the 4-bit words, their scales and every other frozen weight come out bit for bit those of
    from_pretrained's quantised load (then peft's k-bit preparation)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    from nbtrain.engine.dist import Dist
    from nbtrain.model import quant
    from nbtrain.model.build import build_model
    from nbtrain.model.shard import make_mesh

    cfg = SFTConfig(**_kw(tiny, "unused", shard="fsdp", load_in_4bit=True))
    d = Dist()
    assert d.device.type == device
    compute = torch.bfloat16 if device == "cuda" else None
    weights = compute or torch.float32
    reference = quant.load_quantized(cfg, d.device, compute)
    expected = {n: m for n, m in reference.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    frozen = {n: p for n, p in reference.named_parameters() if not n.endswith("proj.weight")}

    whole_loads, sizes = [], []
    quantize_like = quant.quantize_like

    def one_at_a_time(recipe, weight):
        sizes.append(weight.numel())
        return quantize_like(recipe, weight)

    def from_pretrained(*a, **k):
        whole_loads.append(a)
        raise AssertionError("the sharded QLoRA load called from_pretrained")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(quant, "quantize_like", one_at_a_time)
    model, _, levers = build_model(cfg, d, make_mesh(d, "fsdp", None), weights, compute)
    assert not whole_loads and "4-bit NF4 base" in levers

    def base_name(n):
        return n.removeprefix("base_model.model.").replace(".base_layer", "")

    got = {base_name(n): m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert sorted(got) == sorted(expected) and len(sizes) == len(expected)
    assert max(sizes) == max(m.in_features * m.out_features for m in expected.values())
    for name, ref in expected.items():
        words = _local(got[name].weight)
        assert words.dtype == (torch.bfloat16 if device == "cuda" else torch.float32)
        assert torch.equal(
            words.view(torch.uint8).flatten(), ref.weight.detach().view(torch.uint8).flatten()
        ), name
        mine, theirs = got[name].quant_state, ref.weight.quant_state
        assert torch.equal(mine.absmax, theirs.absmax) and mine.shape == theirs.shape
        assert torch.equal(mine.state2.absmax, theirs.state2.absmax)
        assert mine.offset == theirs.offset and mine.dtype == theirs.dtype
    # embeddings, norms, lm_head: read through the load dtype, then in fp32 as peft's preparation leaves them
    held = {base_name(n): _local(p) for n, p in model.named_parameters() if not p.requires_grad}
    for name, ref in frozen.items():
        assert held[name].dtype == ref.dtype == torch.float32, name
        assert torch.equal(held[name], ref.detach()), name
