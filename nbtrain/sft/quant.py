"""QLoRA: the frozen base in 4-bit NF4 (or 8-bit) through bitsandbytes, LoRA on top in bf16/fp32.

The recipe is peft's and transformers': `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)`, then
`prepare_model_for_kbit_training` (norms in fp32, input grads on for checkpointing). The adapter trained
on a 4-bit base is an ordinary LoRA adapter: it loads on the unquantised base. Merging it into 4-bit
weights would round the merged weights to 4 bits, so `merge=True` merges into a full-precision copy of
the base (bf16 on GPUs, fp32 on the CPU) loaded on rank 0's CPU instead
(`nbtrain.sft.checkpoint.export_merged_from_adapter`). With `shard="fsdp"`, each rank quantises the
whole base onto its own device and FSDP2 then keeps 1/N of it (see `bnb_config`'s `sharded`); 8-bit
weights are not sharded.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from nbtrain.errors import ConfigError


def quantized(cfg: Any) -> bool:
    return bool(cfg.load_in_4bit or cfg.load_in_8bit)


def check_quant(cfg: Any, device: Any, rank: int, host: str) -> None:
    """A ConfigError, before any step, where this rank cannot load the base quantised.

    bitsandbytes quantises on CUDA, and its recent releases on the CPU too (0.50.2 is tested here;
    slowly: it is for trying the path, not for training). Whether it can on this rank's device is found
    by quantising a few numbers there.
    """
    if not quantized(cfg):
        return
    what = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit"
    if importlib.util.find_spec("bitsandbytes") is None:
        msg = (
            f"{what}=True needs bitsandbytes, which is not installed on rank {rank} on {host}; "
            "pip install 'nbtrain[qlora]' (bitsandbytes) on every node, or drop "
            f"{what}"
        )
        raise ConfigError(msg)
    why = _cannot_quantize(device, eight_bit=bool(cfg.load_in_8bit))
    if why is not None:
        msg = (
            f"{what}=True: bitsandbytes on rank {rank} on {host} cannot quantise on {device.type} "
            f"({why}); pip install -U bitsandbytes on every node (recent releases have CPU kernels, "
            f"and GPU wheels CUDA ones), or drop {what}"
        )
        raise ConfigError(msg)


def _cannot_quantize(device: Any, eight_bit: bool) -> str | None:
    """None when bitsandbytes quantises a tensor on `device`, else its error in one line."""
    import torch

    try:
        import bitsandbytes.functional as bnbf

        if eight_bit:
            bnbf.int8_vectorwise_quant(torch.ones(2, 64, dtype=torch.float16, device=device))
        else:
            bnbf.quantize_4bit(torch.ones(64, dtype=torch.float32, device=device), quant_type="nf4")
    except Exception as e:  # noqa: BLE001 - any failure means no kernel for this device
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def bnb_config(cfg: Any, compute_dtype: Any, sharded: bool = False) -> Any:
    """peft's QLoRA quantisation settings: NF4, double quantisation, bf16 compute.

    `sharded`: the 4-bit words stored in the compute dtype (`bnb_4bit_quant_storage`: bf16 on a GPU,
    fp32 on the CPU), so that FSDP2 shards and gathers them as it does the model's other weights. The
    gathered words come back as plain tensors; bitsandbytes' Linear4bit reattaches the quant_state it
    keeps on the module itself (`fix_4bit_weight_quant_state_from_module`), which is what makes
    QLoRA under FSDP2 compute the same as under DDP (tests/test_sft_shard.py).
    """
    import torch
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    kwargs: dict[str, Any] = {}
    if sharded:
        kwargs["bnb_4bit_quant_storage"] = compute_dtype or torch.bfloat16
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype or torch.bfloat16,
        **kwargs,
    )


def load_quantized(cfg: Any, device: Any, compute_dtype: Any, sharded: bool = False) -> Any:
    """The base model quantised onto this rank's device, prepared for k-bit training."""
    import torch
    from peft import prepare_model_for_kbit_training

    from nbtrain.sft.model import load_model

    # bf16 compute on a GPU unless the run says otherwise; on the CPU, fp32 as the rest of a CPU run
    dtype = compute_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    base = load_model(
        cfg.model,
        dtype,
        device,
        quantization_config=bnb_config(cfg, dtype, sharded),
        device_map={"": device},
    )
    if device.type == "cpu":
        # on CPUs with AVX512-BF16, Linear4bit repacks its weight into a CPU-only layout in the first
        # no-grad eval forward (an eval step), replacing weight.data, which FSDP2 owns when sharded;
        # keep the one layout that every CPU, and the tests, run
        for module in base.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    return prepare_model_for_kbit_training(
        base,
        use_gradient_checkpointing=cfg.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
