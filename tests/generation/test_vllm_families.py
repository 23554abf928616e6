"""engine="vllm" on the families of the model matrix that vLLM's CPU build takes
(`families.VLLM_CPU_FAMILIES`): each family's tiny model, saved by `make_tiny_model`, loads in vLLM
and its greedy tokens equal transformers' `generate`, for the base and, where vLLM serves a LoRA on the
family, with a LoRA on every linear layer (the adapter GRPO trains, `apply_lora`) sent in memory.

One vLLM engine start per family (a start is ~35 s on the loaded 2-core test machine), so the default
run takes one family per distinct vLLM model class (`REPRESENTATIVES`, ~4 minutes);
NBTRAIN_VLLM_ALL_FAMILIES=1 runs every family the table says vLLM takes. Runs in the vLLM venv only
(make test-vllm); elsewhere it skips, saying why. The families it refuses are tested in the main venv
(tests/generation/test_vllm_refusal.py).
"""

from __future__ import annotations

import os
import time
import types

import pytest
import torch

from nbtrain.model.families import VLLM_CPU_FAMILIES, VLLM_CPU_LORA_REFUSED
from nbtrain.model.matrix import VLLM_TESTED
from tests.generation.vllm_fixtures import HAVE_VLLM, SKIP_REASON, say_skip

say_skip()
pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON),
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("one_torch_thread"),
]

CPU = torch.device("cpu")
TEXTS = ["Hi", "Add 12 and 30, then tell me a story about a fox", "What is the capital", "x"]
#: one family per distinct vLLM model class among those it takes (docs/models.md's vLLM column names it)
REPRESENTATIVES = VLLM_TESTED
TAKEN = [name for name, why in VLLM_CPU_FAMILIES.items() if why is None]
FAMILIES = (
    TAKEN
    if os.environ.get("NBTRAIN_VLLM_ALL_FAMILIES") == "1"
    else [f for f in REPRESENTATIVES if f in TAKEN]
)


def _tiny(root, arch: str) -> str:
    """The family's tiny model with head_dim 64 (the CPU attention refuses make_tiny_model's 16) and
    its weights spread out (~N(0, 0.3); Gemma's 0.02, as it scales its embeddings by sqrt(hidden)), so
    greedy output depends on the prompt and the adapter (measured: 23-47 distinct tokens, not 3)."""
    from transformers import AutoModelForCausalLM

    from nbtrain.model.tiny import make_tiny_model

    path = make_tiny_model(root / arch, arch=arch, hidden_size=64, num_heads=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.02 if arch.startswith("gemma") else 0.3)
    model.save_pretrained(path)
    return path


def _lora(path: str) -> object:
    """The peft model GRPO would train on `path` (LoRA r=8 on every linear layer), B nonzero."""
    from transformers import AutoModelForCausalLM

    from nbtrain.model.pretrained import apply_lora

    cfg = types.SimpleNamespace(
        lora_r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        peft = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), cfg)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
    return peft.eval()


@pytest.mark.parametrize("arch", FAMILIES)
def test_vllm_greedy_equals_transformers_on_the_family(arch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbtrain.generation import decode, engines

    path = _tiny(tmp_path, arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [decode.Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(TEXTS)]
    dec = decode.Decoding(max_new_tokens=16)

    def hf(m):
        return engines.make("hf", model=m, tokenizer=tok, device=CPU).generate(prompts, dec)

    want = hf(model)
    # the model's greedy output is not one repeated token, so equal output means something
    assert len({t for c in want for t in c.ids}) > 8
    serves_lora = arch not in VLLM_CPU_LORA_REFUSED
    t0 = time.perf_counter()
    eng = engines.make(
        "vllm", model_path=path, tokenizer=tok, device=CPU, rank=0, host="h",
        lora=engines.LoraSpec(r=8) if serves_lora else None,
    )  # fmt: skip
    print(f"\n{arch}: vLLM engine started in {time.perf_counter() - t0:.1f} s")
    try:
        got = eng.generate(prompts, dec)
        assert [c.ids for c in got] == [c.ids for c in want]
        if serves_lora:
            peft = _lora(path)
            want_lora = hf(peft)
            assert [c.ids for c in want_lora] != [c.ids for c in want]  # the adapter counts
            eng.set_adapter(peft)  # in memory, as GRPO sends it after each step
            got = eng.generate(prompts, dec)
            assert [c.ids for c in got] == [c.ids for c in want_lora]
    finally:
        eng.close()
