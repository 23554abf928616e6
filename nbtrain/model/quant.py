"""QLoRA: the frozen base in 4-bit NF4 (or 8-bit) through bitsandbytes, LoRA on top in bf16/fp32.

The recipe is peft's and transformers': `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)`, then
`prepare_model_for_kbit_training` (norms in fp32, input grads on for checkpointing). The adapter trained
on a 4-bit base is an ordinary LoRA adapter: it loads on the unquantised base. Merging it into 4-bit
weights would round the merged weights to 4 bits, so `merge=True` merges into a full-precision copy of
the base (bf16 on GPUs, fp32 on the CPU) loaded on rank 0's CPU instead
(`nbtrain.model.checkpoint.export_merged_from_adapter`). With `shard="fsdp"`, no rank holds the whole
base, even in 4 bits: the model is built on the meta device with bitsandbytes' layers where
from_pretrained would put them (`skeleton`), sharded, and then each weight is read and quantised one at a
time, every rank keeping only its own rows of the 4-bit words (`quantize_like`, in `nbtrain.model.shard`);
8-bit weights are not sharded.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


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
    QLoRA under FSDP2 compute the same as under DDP (tests/model/test_shard.py).
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


def load_dtype(compute_dtype: Any, device: Any) -> Any:
    """The dtype the base is read in before quantising: bf16 compute on a GPU unless the run says
    otherwise; on the CPU, fp32 as the rest of a CPU run."""
    import torch

    return compute_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def load_quantized(cfg: Any, device: Any, compute_dtype: Any) -> Any:
    """The base model quantised onto this rank's device, prepared for k-bit training."""
    from nbtrain.model.pretrained import load_model

    dtype = load_dtype(compute_dtype, device)
    base = load_model(
        cfg.model,
        dtype,
        device,
        quantization_config=bnb_config(cfg, dtype),
        device_map={"": device},
    )
    return prepare_for_training(base, cfg, device)


def skeleton(base: Any, cfg: Any, device: Any, dtype: Any) -> dict[str, Any]:
    """Turn `base`, a model on the meta device, into what from_pretrained with `bnb_config(sharded=True)`
    makes, still on meta: transformers' own quantizer swaps in bitsandbytes' Linear4bit where it would
    (lm_head and tied weights stay as they are), and each 4-bit weight takes the shape and dtype its
    packed words will have, which FSDP2 then shards. Returns {weight name: its meta Params4bit}, the
    recipe `quantize_like` follows for that weight."""
    import bitsandbytes as bnb
    import torch
    from transformers.quantizers import AutoHfQuantizer

    hfq = AutoHfQuantizer.from_config(bnb_config(cfg, dtype, sharded=True))
    hfq.preprocess_model(base, device_map={"": device})
    recipes = {}
    for name, module in base.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        w: Any = module.weight  # a Params4bit: its recipe rides on it
        meta = torch.empty(w.shape, dtype=dtype, device="meta")
        words, _ = torch.ops.bitsandbytes.quantize_4bit.default(
            meta, w.blocksize, w.quant_type, w.quant_storage
        )
        module.weight = bnb.nn.Params4bit(
            words,
            requires_grad=False,
            blocksize=w.blocksize,
            compress_statistics=w.compress_statistics,
            quant_type=w.quant_type,
            quant_storage=w.quant_storage,
            module=module,
            bnb_quantized=True,
        )
        recipes[f"{name}.weight"] = module.weight
    hfq.postprocess_model(base)
    base.hf_quantizer = hfq
    return recipes


def quantize_like(recipe: Any, weight: Any) -> Any:
    """`weight` (one whole full-precision weight, on the rank's device) quantised as `recipe` (a meta
    Params4bit from `skeleton`) says, as from_pretrained would; its quant_state goes onto the recipe's
    module, where bitsandbytes finds it again under FSDP2. Returns the packed 4-bit words."""
    import bitsandbytes.functional as bnbf

    words, state = bnbf.quantize_4bit(
        weight.contiguous(),
        blocksize=recipe.blocksize,
        compress_statistics=recipe.compress_statistics,
        quant_type=recipe.quant_type,
        quant_storage=recipe.quant_storage,
    )
    recipe.module.quant_state = state
    return words


def prepare_for_training(base: Any, cfg: Any, device: Any) -> Any:
    """peft's k-bit preparation (frozen, non-4-bit weights in fp32, checkpointing), on a loaded base or
    on a meta skeleton alike."""
    from peft import prepare_model_for_kbit_training

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
