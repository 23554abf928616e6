"""Sharding and QLoRA on a CUDA GPU, in bf16: what the CPU tests (tests/model/test_shard.py, fp32 on gloo)
cannot reach. bf16 FSDP2 with fp32 LoRA masters, bitsandbytes' CUDA kernels, QLoRA's bf16 word storage
under FSDP2, Liger's kernels under FSDP2, and the memory check against the card.

One GPU: each run is one rank in a fresh process (the torchrun environment, as the CPU tests run two),
so `shard="fsdp"` runs its sharded code path over a mesh of one. Skipped, saying so, where torch sees no
CUDA GPU (CI); `bash scripts/gpu-check.sh tests` runs them on a GPU machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nbtrain.configs.sft import SFTConfig
from nbtrain.errors import ConfigError
from tests.recipes.test_distributed import DATA, _adapter, _kw, _losses, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here"),
]

EVAL_ROWS = [json.loads(x) for x in Path(DATA).read_text().splitlines()[:16]]
GPU = dict(
    max_steps=6,
    lr_scheduler_type="constant",
    learning_rate=1e-3,
    eval_data=EVAL_ROWS,
    eval_steps=3,
    dtype="bfloat16",
)
SETUPS = {
    "ddp": {},
    "fsdp": {"shard": "fsdp"},
    "fsdp-no-liger": {"shard": "fsdp", "use_liger_kernel": False},
    "qlora": {"load_in_4bit": True},
    "qlora-fsdp": {"load_in_4bit": True, "shard": "fsdp"},
}
BF16 = dict(rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def gpu_runs(tiny, tmp_path_factory):
    """Each set-up, one rank on the GPU, merge=True."""
    tmp = tmp_path_factory.mktemp("gpu-shard")
    return {
        name: run_ranks(tmp, 1, **_kw(tiny, tmp / name, merge=True, **GPU, **kw))[0]
        for name, kw in SETUPS.items()
    }


def test_fsdp_on_one_gpu_trains_as_ddp_in_bf16(gpu_runs):
    ddp, fsdp = gpu_runs["ddp"], gpu_runs["fsdp"]
    assert "fsdp over 1 rank(s)" in fsdp["plan"]["levers"]
    torch.testing.assert_close(_losses(fsdp["history"]), _losses(ddp["history"]), **BF16)
    held, total = fsdp["plan"]["base_params_held"]
    assert held == total  # one rank holds every shard
    # LoRA masters stay fp32 under bf16 mixed precision, as under DDP
    assert {t.dtype for t in _adapter(fsdp["adapter_dir"]).values()} == {torch.float32}
    assert all(row["peak_memory_gb"] > 0 for row in fsdp["history"])


def test_liger_under_fsdp_keeps_the_loss(gpu_runs):
    from nbtrain.model.speed import liger_available

    if not liger_available():
        pytest.skip("liger-kernel is not installed (pip install 'nbtrain[gpu]')")
    on, off = gpu_runs["fsdp"], gpu_runs["fsdp-no-liger"]
    assert "liger" in on["plan"]["levers"] and "liger" not in off["plan"]["levers"]
    torch.testing.assert_close(_losses(on["history"]), _losses(off["history"]), **BF16)


def test_qlora_on_the_gpu_trains_and_its_adapter_loads_on_the_plain_base(gpu_runs, tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    q = gpu_runs["qlora"]
    assert "4-bit NF4 base" in q["plan"]["levers"]
    assert all(math.isfinite(row["loss"]) for row in q["history"])
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, q["adapter_dir"])
    out = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()
    # merged into a bf16 copy of the base, never into the 4-bit words
    merged = load_file(str(Path(q["merged_dir"]) / "model.safetensors"))
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}


def test_qlora_under_fsdp_on_the_gpu_equals_qlora_under_ddp(gpu_runs):
    ddp, fsdp = gpu_runs["qlora"], gpu_runs["qlora-fsdp"]
    assert "4-bit NF4 base" in fsdp["plan"]["levers"]
    torch.testing.assert_close(_losses(fsdp["history"]), _losses(ddp["history"]), **BF16)
    ev = [
        (a["eval_loss"], b["eval_loss"])
        for a, b in zip(fsdp["history"], ddp["history"], strict=True)
        if a["step"] % 3 == 0
    ]
    assert len(ev) == 2
    torch.testing.assert_close(torch.tensor(ev)[:, 0], torch.tensor(ev)[:, 1], **BF16)
    torch.testing.assert_close(_adapter(fsdp["adapter_dir"]), _adapter(ddp["adapter_dir"]), **BF16)


def test_memory_check_refuses_70b_on_one_gpu_before_loading(tiny):
    from transformers import LlamaConfig

    from nbtrain.model.memory import check_fits

    llama70 = LlamaConfig(
        num_hidden_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    cfg = SFTConfig(**_kw(tiny, "unused"))
    with pytest.raises(ConfigError, match=r"needs about \d+\.\d GiB per rank .* use shard='fsdp'"):
        check_fits(cfg, llama70, torch.device("cuda", 0), world=1)
    note = check_fits(cfg, LlamaConfig(), torch.device("cuda", 0), world=1)  # Llama-2 7B's shape
    assert note is not None and note.startswith("memory per rank by formula")
