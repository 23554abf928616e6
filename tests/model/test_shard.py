"""shard="fsdp"/"hsdp" (FSDP2) against shard="ddp" on real processes and a real gloo group, the sharded
checkpoints' resume, the refusals of what does not compose, and QLoRA (bitsandbytes' CPU kernels, so
the 4-bit path runs here as it does on a GPU, slowly), alone and sharded.

Each 2-rank run is a pair of Python processes with the torchrun environment, launched by
tests/recipes/test_distributed.py's run_ranks; the runs are made once per module and shared by the tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nbtrain.configs.sft import SFTConfig
from nbtrain.errors import ConfigError
from nbtrain.recipes.train import finetune
from tests.recipes.test_distributed import DATA, REPO, _kw, _losses, run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVAL_ROWS = [json.loads(x) for x in Path(DATA).read_text().splitlines()[:21]]  # odd: uneven shards
COMMON = dict(max_steps=4, save_steps=2, lora_dropout=0.1, eval_data=EVAL_ROWS, eval_steps=2)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """The same 2-rank run as shard='ddp' and as shard='fsdp' (merge=True for both)."""
    tmp = tmp_path_factory.mktemp("shard")
    out = {}
    for shard in ("ddp", "fsdp"):
        out[shard] = run_ranks(tmp, 2, **_kw(tiny, tmp / shard, shard=shard, merge=True, **COMMON))
    return tmp, out


def _untimed(h):
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time")} for r in h]


def test_fsdp_equals_ddp(runs):
    tmp, r = runs
    hd, hf = r["ddp"][0]["history"], r["fsdp"][0]["history"]
    assert [x["step"] for x in hf] == [1, 2, 3, 4]
    assert _untimed(r["fsdp"][1]["history"]) == _untimed(hf)
    torch.testing.assert_close(_losses(hf), _losses(hd))
    torch.testing.assert_close(
        torch.tensor([x["grad_norm"] for x in hf]), torch.tensor([x["grad_norm"] for x in hd])
    )
    # evaluation over uneven shards (21 rows on 2 ranks): the rank with fewer batches runs a spare
    # forward to keep FSDP's gathers in step, and counts nothing from it
    ev = [
        (a["eval_loss"], b["eval_loss"])
        for a, b in zip(hf, hd, strict=True)
        if a["step"] % 2 == 0  # eval_steps=2; the other rows hold NaN
    ]
    assert len(ev) == 2 and all(a == pytest.approx(b, rel=1e-5) for a, b in ev)

    a_f, a_d = _adapter(r["fsdp"][0]["adapter_dir"]), _adapter(r["ddp"][0]["adapter_dir"])
    assert a_f.keys() == a_d.keys()
    torch.testing.assert_close(a_f, a_d, atol=1e-4, rtol=1e-3)
    assert max(v.abs().max().item() for k, v in a_f.items() if "lora_B" in k) > 1e-3
    assert r["fsdp"][1]["adapter_dir"] is None
    # the merged model (into a fresh copy of the base on rank 0's CPU) equals DDP's in-place merge
    m_f = load_file(str(Path(r["fsdp"][0]["merged_dir"]) / "model.safetensors"))
    m_d = load_file(str(Path(r["ddp"][0]["merged_dir"]) / "model.safetensors"))
    torch.testing.assert_close(m_f, m_d, atol=1e-4, rtol=1e-3)


def _adapter(path):
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def test_each_rank_holds_half_of_the_base(runs):
    _, r = runs
    (held0, total), (held1, total1) = (r["fsdp"][k]["plan"]["base_params_held"] for k in (0, 1))
    assert total == total1 and held0 + held1 == total
    # dim-0 chunks: a rank holds half of each weight, rounded up for odd first dimensions
    assert abs(held0 - total / 2) <= 0.01 * total and abs(held1 - total / 2) <= 0.01 * total
    ddp_held, ddp_total = r["ddp"][0]["plan"]["base_params_held"]
    assert ddp_held == ddp_total == total


def test_fsdp_adapter_loads_with_peft_on_the_base(runs, tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, r = runs
    adapter_dir = r["fsdp"][0]["adapter_dir"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), adapter_dir)
    want = _adapter(adapter_dir)
    got = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    torch.testing.assert_close(got, want)


def test_fsdp_checkpoint_resumes_to_the_same_run(runs, tiny):
    tmp, r = runs
    full = tmp / "fsdp"
    ck = full / "checkpoint-2"
    names = {p.name for p in (ck / "sharded").iterdir()}
    assert ".metadata" in names and len([n for n in names if n.endswith(".distcp")]) == 2
    assert not (ck / "optimizer.pt").exists() and (ck / "adapter_model.safetensors").is_file()
    assert not list(full.glob(".tmp-*"))

    crashed = tmp / "fsdp-crashed"
    crashed.mkdir()
    shutil.copytree(ck, crashed / "checkpoint-2")
    lines = (full / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    resumed = run_ranks(tmp, 2, **_kw(tiny, crashed, shard="fsdp", resume="latest", **COMMON))
    h = resumed[0]["history"]
    assert [x["step"] for x in h] == [1, 2, 3, 4]
    torch.testing.assert_close(_losses(h), _losses(r["fsdp"][0]["history"]))
    torch.testing.assert_close(
        _adapter(resumed[0]["adapter_dir"]), _adapter(r["fsdp"][0]["adapter_dir"])
    )


def test_resume_across_shard_kinds_is_refused(runs, tiny, tmp_path):
    tmp, _ = runs
    ck = tmp / "fsdp" / "checkpoint-2"
    with pytest.raises(ConfigError, match="written with shard='fsdp'.*resume with shard='fsdp'"):
        finetune(SFTConfig(**_kw(tiny, tmp_path / "x", shard="ddp", resume=str(ck), **COMMON)))


def test_hsdp_replicates_across_nodes_with_gradient_checkpointing(tiny, tmp_path, runs):
    # two "nodes" of one rank each: a (2, 1) mesh, so every weight is replicated and gradients are
    # all-reduced across the nodes, which must train exactly as DDP; recomputing each block in
    # backward (dropout masks replayed) changes nothing either
    _, r = runs
    kw = _kw(tiny, tmp_path / "h", shard="hsdp", gradient_checkpointing=True, **COMMON)
    h = run_ranks(tmp_path, 2, local_world=1, **kw)
    torch.testing.assert_close(_losses(h[0]["history"]), _losses(r["ddp"][0]["history"]))
    held, total = h[0]["plan"]["base_params_held"]
    assert held == total  # a node of one rank shards nothing


def test_fsdp_on_one_rank_runs_and_says_it_saves_nothing(tiny, tmp_path):
    res = finetune(SFTConfig(**_kw(tiny, tmp_path / "one", shard="fsdp", max_steps=2)))
    assert res.state == "done" and len(res.history) == 2
    assert any("on 1 rank: nothing to shard" in n for n in res.plan["notes"])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"shard": "zero3"}, "shard='zero3' is not known; use one of ddp, fsdp, hsdp"),
        (
            {"load_in_4bit": True, "load_in_8bit": True},
            "load_in_4bit and load_in_8bit are both True",
        ),
    ],
)
def test_config_refusals(tiny, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        SFTConfig(**_kw(tiny, tmp_path, **kw))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"shard": "fsdp", "torch_compile": True}, "set torch_compile=False"),
        (
            {"shard": "fsdp", "load_in_8bit": True},
            "use load_in_4bit=True.*or load_in_8bit with shard='ddp'",
        ),
    ],
)
def test_setup_refusals_before_any_step(tiny, tmp_path, kw, match):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        finetune(SFTConfig(**_kw(tiny, out, **kw)))
    assert not out.exists()


def test_qlora_without_bitsandbytes_is_refused_naming_the_package(tiny, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a),
    )
    out = tmp_path / "out"
    with pytest.raises(
        ConfigError,
        match=r"needs bitsandbytes, which is not installed on rank 0 on .*nbtrain\[qlora\]",
    ):
        finetune(SFTConfig(**_kw(tiny, out, load_in_4bit=True)))
    assert not out.exists()


# ------------------------------------------------------------------------------------- QLoRA
def _linear_weight(state, layer="model.layers.0.self_attn.q_proj.weight"):
    return next(v for k, v in state.items() if k.endswith(layer))


def test_qlora_trains_and_merges_into_a_full_precision_copy(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    res = finetune(
        SFTConfig(**_kw(tiny, tmp_path / "q", load_in_4bit=True, max_steps=4)), merge=True
    )
    assert "4-bit NF4 base" in res.plan["levers"]
    assert res.history["loss"].iloc[-1] < res.history["loss"].iloc[0]
    # the adapter is an ordinary LoRA adapter: it loads on the unquantised base
    base = AutoModelForCausalLM.from_pretrained(tiny)
    model = PeftModel.from_pretrained(base, res.adapter_dir)
    got = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    torch.testing.assert_close(got, _adapter(res.adapter_dir))
    # merged into a fresh fp32 copy (the CPU run's dtype), not into 4-bit weights: merged - base is
    # exactly the LoRA update, which rounding to NF4 would have destroyed
    merged = load_file(str(Path(res.merged_dir) / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in merged.values())
    orig = load_file(str(Path(tiny) / "model.safetensors"))
    lora = _adapter(res.adapter_dir)
    a = _linear_weight(lora, "layers.0.self_attn.q_proj.lora_A.weight")
    b = _linear_weight(lora, "layers.0.self_attn.q_proj.lora_B.weight")
    scale = res_scale(res.adapter_dir)
    delta = _linear_weight(merged) - _linear_weight(orig)
    torch.testing.assert_close(delta, scale * b @ a, atol=1e-6, rtol=1e-4)
    assert delta.abs().max() > 1e-4


def res_scale(adapter_dir):
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return cfg["lora_alpha"] / cfg["r"]


def test_qlora_in_8_bits_trains(tiny, tmp_path):
    res = finetune(SFTConfig(**_kw(tiny, tmp_path / "q8", load_in_8bit=True, max_steps=3)))
    assert "8-bit base" in res.plan["levers"] and res.state == "done"
    assert all(torch.isfinite(torch.tensor(res.history["loss"].tolist())))


@pytest.fixture(scope="module")
def qruns(tiny, tmp_path_factory):
    """The same 2-rank QLoRA run as shard='ddp' and as shard='fsdp'."""
    tmp = tmp_path_factory.mktemp("qshard")
    out = {}
    for shard in ("ddp", "fsdp"):
        kw = _kw(tiny, tmp / shard, shard=shard, load_in_4bit=True, merge=True, **COMMON)
        out[shard] = run_ranks(tmp, 2, **kw)
    return tmp, out


def test_qlora_under_fsdp_equals_qlora_under_ddp(qruns):
    _, r = qruns
    hd, hf = r["ddp"][0]["history"], r["fsdp"][0]["history"]
    assert "4-bit NF4 base" in r["fsdp"][0]["plan"]["levers"]
    torch.testing.assert_close(_losses(hf), _losses(hd))
    ev = [
        (a["eval_loss"], b["eval_loss"]) for a, b in zip(hf, hd, strict=True) if a["step"] % 2 == 0
    ]
    assert all(a == pytest.approx(b, rel=1e-5) for a, b in ev)
    torch.testing.assert_close(
        _adapter(r["fsdp"][0]["adapter_dir"]),
        _adapter(r["ddp"][0]["adapter_dir"]),
        atol=1e-4,
        rtol=1e-3,
    )
    m_f = load_file(str(Path(r["fsdp"][0]["merged_dir"]) / "model.safetensors"))
    m_d = load_file(str(Path(r["ddp"][0]["merged_dir"]) / "model.safetensors"))
    torch.testing.assert_close(m_f, m_d, atol=1e-4, rtol=1e-3)
    # each rank holds half of the 4-bit words (and of the fp32 embeddings and norms)
    (held0, total), (held1, _) = (r["fsdp"][k]["plan"]["base_params_held"] for k in (0, 1))
    assert held0 + held1 == total and abs(held0 - total / 2) <= 0.01 * total


def test_qlora_under_fsdp_resumes_to_the_same_run(qruns, tiny):
    tmp, r = qruns
    crashed = tmp / "fsdp-crashed"
    crashed.mkdir()
    shutil.copytree(tmp / "fsdp" / "checkpoint-2", crashed / "checkpoint-2")
    lines = (tmp / "fsdp" / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    kw = _kw(tiny, crashed, shard="fsdp", load_in_4bit=True, resume="latest", **COMMON)
    h = run_ranks(tmp, 2, **kw)[0]
    assert [x["step"] for x in h["history"]] == [1, 2, 3, 4]
    torch.testing.assert_close(_losses(h["history"]), _losses(r["fsdp"][0]["history"]))
    torch.testing.assert_close(_adapter(h["adapter_dir"]), _adapter(r["fsdp"][0]["adapter_dir"]))


# ------------------------------------------------------------------------------------- the formula
def test_memory_formula_counts_the_models_real_weights(tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from nbtrain.model.memory import LLAMA3_8B, LLAMA3_70B, Shape, lora_params, rank_memory

    # Meta's published parameter counts of Llama-3 8B and 70B
    assert LLAMA3_8B.params == 8_030_261_248
    assert LLAMA3_70B.params == 70_553_706_496
    # and a real model, counted: its weights, and the LoRA weights peft adds with all-linear
    shape = Shape.from_config(AutoConfig.from_pretrained(tiny))
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert shape.params == sum(p.numel() for p in model.parameters())
    lora = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    assert lora_params(shape, 8) == sum(p.numel() for p in lora.parameters() if p.requires_grad)

    ddp = rank_memory(LLAMA3_70B, shard="ddp")
    fsdp = rank_memory(LLAMA3_70B, shard="fsdp", world=8)
    hsdp = rank_memory(LLAMA3_70B, shard="hsdp", world=16, ranks_per_node=8)
    for part in ("weights", "lora", "grads", "optimizer"):
        assert fsdp[part] == pytest.approx(ddp[part] / 8) and hsdp[part] == fsdp[part]
    assert ddp["weights"] == 2 * LLAMA3_70B.params and ddp["gathered"] == 0
    assert fsdp["total"] == pytest.approx(sum(v for k, v in fsdp.items() if k != "total"))
    nf4 = rank_memory(LLAMA3_70B, quant="nf4")
    assert 0.29 < nf4["weights"] / ddp["weights"] < 0.32  # ~4 bits, embeddings and lm_head in fp32


def test_memory_formula_counts_a_real_4_bit_model(tmp_path):
    # a model big enough for the per-value cost to dominate bitsandbytes' fixed per-layer tables,
    # quantised as a QLoRA run does, and every byte of its weights and quantisation state counted
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nbtrain.model.memory import Shape, weight_bytes
    from nbtrain.model.quant import bnb_config

    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    cfg = SFTConfig(model=str(tmp_path / "m"), data=DATA, load_in_4bit=True)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", quantization_config=bnb_config(cfg, torch.float32), device_map={"": "cpu"}
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    seen, used = set(), 0
    tensors = list(model.parameters())
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            tensors += [
                t for t in (qs.absmax, qs.code, getattr(qs, "offset", None)) if t is not None
            ]
            if qs.state2 is not None:
                tensors += [qs.state2.absmax, qs.state2.code]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            used += t.numel() * t.element_size()
    assert weight_bytes(Shape.from_config(config), "nf4") == pytest.approx(used, rel=0.03)


def test_docs_memory_table_is_current():
    from nbtrain.model import memory

    page = REPO / "docs" / "fine-tuning.md"
    text = page.read_text(encoding="utf-8")
    assert text == memory.render(text), "regenerate it: python -m nbtrain.model.memory"
