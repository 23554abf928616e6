"""What the vLLM tests share: the reason they skip, and the tiny model vLLM's CPU build takes.

vLLM's CPU attention refuses head_dim 24 (the shipped tiny model's); head_dim 64 works, so the model
here is a Qwen2 with hidden size 128 and 2 heads. Its weights are untied and widely spread (as in
test_generate.py), so greedy output depends on the whole prompt rather than repeating the last token.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = (
    "vLLM is not installed in this environment: the vLLM tests run in their own venv "
    "(make venv-vllm; make test-vllm)"
)


def say_skip() -> None:
    """Print the reason as well: a skipped module's reason is easy to miss in -q output."""
    if not HAVE_VLLM:
        print(f"\n{__name__}: {SKIP_REASON}")


def tiny_head64(root: Path, std: float = 0.3, seed: int = 0) -> str:
    """A tiny Qwen2 (head_dim 64, untied, weights ~ N(0, std)) and its tokenizer, saved in `root`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nbtrain.model.tiny import make_tiny_model

    tiny = make_tiny_model(
        root / "tiny", arch="qwen2", hidden_size=128, num_heads=2, intermediate_size=256
    )
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, std)
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.generation_config.eos_token_id = cfg.eos_token_id
    out = root / "base"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return str(out)


def lora_adapter(base: str, out: Path, r: int = 8, seed: int = 1) -> str:
    """A LoRA adapter on `base` with nonzero B (so it changes the output), saved in `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
    peft.save_pretrained(out)
    return str(out)
