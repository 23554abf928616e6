"""The throughput levers of finetune: MFU's GPU table, the batch plan ('auto' and global_batch_size), and
on a GPU, that each lever (fused loss, Liger, torch.compile, bf16 LoRA inputs) keeps the loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nbtrain.configs.sft import SFTConfig
from nbtrain.data.batch import BatchPlan, MemoryProbe, auto_plan, fixed_plan, split_global
from nbtrain.errors import ConfigError
from nbtrain.recipes.train import finetune
from nbtrain.telemetry.report import peak_bf16_flops
from tests.recipes.test_train import make_cfg

DATA = str(
    Path(__file__).resolve().parents[2] / "nbtrain" / "data" / "examples" / "instructions.jsonl"
)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here")


def cfg(tiny, out, **kw):
    return make_cfg(tiny, out, **{"max_steps": 3, **kw})


# ------------------------------------------------------------------------------------------ MFU
@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA A10G", None),  # not an A10: its peak differs, so no MFU rather than a wrong one
        ("Tesla T4", None),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_peak_flops_matches_whole_names(name, flops):
    assert peak_bf16_flops(name) == flops


# ------------------------------------------------------------------------------------ batch plan
def test_fixed_plan_and_global_batch():
    assert fixed_plan(4, 2, None, 3) == BatchPlan(4, 2, 24)
    assert fixed_plan(2, 1, 16, 2) == BatchPlan(2, 4, 16)
    with pytest.raises(ConfigError, match="multiple of 6"):
        split_global(16, 2, 3)
    with pytest.raises(ConfigError, match="disagree"):
        fixed_plan(2, 3, 16, 2)


def test_auto_plan_measures_real_memory_on_cpu():
    """Each row of the probe step really takes 64 MiB; with a 1 GiB budget about 14 rows fit (the
    process's own memory is the fixed part), and a global batch of 24 over 2 ranks makes it a divisor of 12."""
    row = 64 * 2**20
    kept = []

    def step(rows: int) -> None:
        t = torch.ones(rows * row // 4, dtype=torch.float32)  # touched, so resident
        kept.append(float(t[-1]))
        del t

    probe = MemoryProbe(step, torch.device("cpu"))
    base = probe.peak(1) - row
    probe.budget = base + 2**30
    plan = auto_plan(probe, world=2, rows_per_rank=100, grad_accum=1, global_batch=24)
    assert plan.micro_batch in (12, 6), plan
    assert plan.micro_batch * plan.grad_accum * 2 == 24
    free = auto_plan(probe, world=1, rows_per_rank=100, grad_accum=3, global_batch=None)
    assert 12 <= free.micro_batch <= 16 and free.grad_accum == 3, free
    assert "auto batch" in free.note


def test_auto_batch_finetune_on_cpu(tiny, tmp_path):
    result = finetune(
        cfg(tiny, tmp_path / "auto", per_device_train_batch_size="auto", global_batch_size=8)
    )
    plan = result.plan
    assert plan["global_batch"] == 8
    assert plan["micro_batch"] * plan["gradient_accumulation_steps"] == 8
    assert result.history["loss"].notna().all()


def test_global_batch_by_accumulation_trains_like_one_big_batch(tiny, tmp_path):
    """8 rows as 4 micro-batches of 2 and as one of 8: the loss is normalised by the step's target
    tokens, so both runs are the same training."""
    common = dict(global_batch_size=8, lr_scheduler_type="constant", dtype="float32")
    small = finetune(cfg(tiny, tmp_path / "a", per_device_train_batch_size=2, **common))
    big = finetune(cfg(tiny, tmp_path / "b", per_device_train_batch_size=8, **common))
    assert (
        small.plan["gradient_accumulation_steps"] == 4
        and big.plan["gradient_accumulation_steps"] == 1
    )
    torch.testing.assert_close(
        torch.tensor(small.history["loss"].to_list()),
        torch.tensor(big.history["loss"].to_list()),
        rtol=1e-4,
        atol=1e-5,
    )


def test_fused_loss_matches_the_logits_path(tiny, tmp_path):
    common = dict(dtype="float32", lr_scheduler_type="constant")
    fused = finetune(cfg(tiny, tmp_path / "f", fused_cross_entropy=True, **common))
    plain = finetune(cfg(tiny, tmp_path / "p", fused_cross_entropy=False, **common))
    assert "loss chunked" in fused.plan["levers"] and "loss logits" in plain.plan["levers"]
    torch.testing.assert_close(
        torch.tensor(fused.history["loss"].to_list()),
        torch.tensor(plain.history["loss"].to_list()),
        rtol=1e-5,
        atol=1e-6,
    )


def test_lever_settings_are_checked():
    with pytest.raises(ConfigError, match="use_liger_kernel"):
        SFTConfig(model="x/y", data=DATA, use_liger_kernel="yes")
    with pytest.raises(ConfigError, match="per_device_train_batch_size"):
        SFTConfig(model="x/y", data=DATA, per_device_train_batch_size="big")
    with pytest.raises(ConfigError, match="global_batch_size"):
        SFTConfig(model="x/y", data=DATA, global_batch_size=0)


def test_liger_on_cpu_is_a_config_error_only_when_forced(tiny, tmp_path):
    # on the CPU Liger never applies: 'auto' is quietly off, and the run trains
    result = finetune(cfg(tiny, tmp_path / "l", use_liger_kernel="auto"))
    assert "liger" not in result.plan["levers"]


# -------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "lever",
    [
        {"fused_cross_entropy": True},
        {"torch_compile": True},
        {"use_liger_kernel": "auto"},
        {"per_device_train_batch_size": "auto", "global_batch_size": 4},
    ],
    ids=["fused", "compile", "liger", "auto-batch"],
)
def test_gpu_levers_keep_the_loss(tiny, tmp_path, lever):
    """bf16 on the GPU: each lever against all of them off, within bf16 tolerance."""
    off = dict(
        fused_cross_entropy=False,
        torch_compile=False,
        use_liger_kernel=False,
        lr_scheduler_type="constant",
        learning_rate=1e-3,
    )
    base = finetune(cfg(tiny, tmp_path / "off", **off))
    on = finetune(cfg(tiny, tmp_path / "on", **{**off, **lever}))
    if "use_liger_kernel" in lever:
        from nbtrain.model.speed import liger_available

        if not liger_available():
            pytest.skip("liger-kernel is not installed")
        assert "liger" in on.plan["levers"]
    torch.testing.assert_close(
        torch.tensor(on.history["loss"].to_list()),
        torch.tensor(base.history["loss"].to_list()),
        rtol=2e-2,
        atol=2e-2,
    )
    assert (on.history["peak_memory_gb"] > 0).all()
