"""engine="vllm" on a CPU refuses, before any model loads, the families vLLM's CPU build was found not to
run (`families.VLLM_CPU_FAMILIES`; with a LoRA, `VLLM_CPU_LORA_REFUSED`), naming the family, the
reason and engine="hf". Needs no vLLM: the family is checked before vLLM's installation, so in the main
venv the refusal, not the install hint, is what a refused family gets. The families it takes are run
through vLLM in tests/generation/test_vllm_families.py (the vLLM venv).
"""

from __future__ import annotations

import types

import pytest
import torch

import nbtrain
from nbtrain.generation import engines
from nbtrain.model.families import FAMILIES, VLLM_CPU_FAMILIES, VLLM_CPU_LORA_REFUSED

pytestmark = pytest.mark.timeout(300)

CPU = torch.device("cpu")
REFUSED = sorted(name for name, why in VLLM_CPU_FAMILIES.items() if why is not None)
TAKEN = sorted(name for name, why in VLLM_CPU_FAMILIES.items() if why is None)


def _tiny(tmp_path, arch: str) -> str:
    from nbtrain.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path / arch, arch=arch)


def _adapter(base: str, out) -> str:
    from transformers import AutoModelForCausalLM

    from nbtrain.model.pretrained import apply_lora

    cfg = types.SimpleNamespace(
        lora_r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"
    )
    apply_lora(AutoModelForCausalLM.from_pretrained(base), cfg).save_pretrained(out)
    return str(out)


def test_the_table_names_every_family_of_the_matrix():
    assert set(VLLM_CPU_FAMILIES) == set(FAMILIES)
    assert set(VLLM_CPU_LORA_REFUSED) <= set(TAKEN)  # a LoRA is refused only where the base runs
    assert REFUSED and TAKEN


@pytest.mark.parametrize("arch", REFUSED)
def test_generate_refuses_the_family_before_the_model_loads(arch, tmp_path):
    path = _tiny(tmp_path, arch)
    with pytest.raises(engines.EngineError) as e:
        nbtrain.generate(["Hi"], model=path, max_new_tokens=2, engine="vllm")
    msg = str(e.value)
    assert 'engine="vllm" on rank 0' in msg
    assert f"vLLM's CPU build (vllm-cpu 0.32.0) cannot run {arch} models" in msg
    assert VLLM_CPU_FAMILIES[arch] in msg and 'Use engine="hf"' in msg
    # before vLLM's own check: the install hint (main venv) is not what it says
    assert "not installed" not in msg
    # engine="hf" runs it
    assert len(nbtrain.generate(["Hi"], model=path, max_new_tokens=2)) == 1


@pytest.mark.parametrize("arch", sorted(VLLM_CPU_LORA_REFUSED))
def test_a_lora_on_the_family_is_refused_the_base_is_not(arch, tmp_path):
    path = _tiny(tmp_path, arch)
    adapter = _adapter(path, tmp_path / "adapter")
    with pytest.raises(engines.EngineError) as e:
        nbtrain.generate(["Hi"], model=path, adapter=adapter, max_new_tokens=2, engine="vllm")
    msg = str(e.value)
    assert f"runs {arch} models" in msg and "without a LoRA, not with one" in msg
    assert VLLM_CPU_LORA_REFUSED[arch] in msg and 'Use engine="hf"' in msg
    # GRPO's and the samples' check (always with a LoRA) says the same
    with pytest.raises(engines.EngineError, match="without a LoRA, not with one"):
        engines.check_vllm(0, "h1", path, CPU)
    _not_refused(path, CPU, lora=False)


@pytest.mark.parametrize("arch", [*REFUSED[:1], *TAKEN[:1]])
def test_on_a_gpu_and_for_a_taken_family_only_vllms_own_checks_remain(arch, tmp_path):
    path = _tiny(tmp_path, arch)
    _not_refused(path, torch.device("cuda", 0), lora=True)
    if arch in TAKEN:
        _not_refused(path, CPU, lora=True)


def _not_refused(path: str, device, lora: bool) -> None:
    """check_vllm passes, or (no vLLM here) says only what vLLM's installation says."""
    try:
        engines.check_vllm(0, "h1", path, device, lora)
    except engines.EngineError as e:
        assert "vLLM's CPU build" not in str(e) and "not installed" in str(e)


def test_check_model_says_taken_or_refused(tmp_path):
    line = nbtrain.check_model(_tiny(tmp_path, REFUSED[0])).paths["vLLM"]
    assert line.startswith("refused on a CPU before the model loads") and REFUSED[0] in line
    assert "engine='hf'" in line
    taken = next(a for a in TAKEN if a not in VLLM_CPU_LORA_REFUSED)
    line = nbtrain.check_model(_tiny(tmp_path, taken)).paths["vLLM"]
    assert f"on a CPU takes {taken}, base and LoRA" in line
    if VLLM_CPU_LORA_REFUSED:
        moe = sorted(VLLM_CPU_LORA_REFUSED)[0]
        line = nbtrain.check_model(_tiny(tmp_path, moe)).paths["vLLM"]
        assert "takes the base; with a LoRA" in line and VLLM_CPU_LORA_REFUSED[moe] in line
