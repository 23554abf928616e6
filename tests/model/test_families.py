"""The model matrix: a tiny model of each family (nbtrain.model.families, built from the family's own
transformers config class and saved with save_pretrained) through LoRA's plan, SFT, export and
generation. One module-scoped folder of models; each family's runs are in-process (world size 1).

What 'all-linear' must mean is checked against the model's own modules: every linear layer but the
output head and the router gets LoRA, and every MoE's experts do, as parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nbtrain.model.families import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")

MOE = [n for n, f in FAMILIES.items() if f.kind == "moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {name: make_tiny_model(root / name, arch=name) for name in FAMILIES}


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _cfg(**kw):
    from types import SimpleNamespace

    base = dict(lora_r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear")
    base["lora_moe"] = ["experts", "shared_experts"]
    return SimpleNamespace(**{**base, **kw})


def _adapted(peft_model) -> set[str]:
    """Full names (without peft's prefix) of what holds a LoRA: linear modules, or the module whose
    parameter peft wraps (nested ParamWrappers under one experts module count once)."""
    out = set()
    for name, _ in peft_model.named_parameters():
        if ".lora_A." in name:
            holder = name.split(".lora_A.")[0].removeprefix("base_model.model.")
            while holder.endswith(".base_layer"):
                holder = holder.removesuffix(".base_layer")
            out.add(holder)
    return out


def _routers(model) -> set[str]:
    routers = set()
    for name, module in model.named_modules():
        kids = dict(module.named_children())
        if "experts" in kids:
            routers |= {
                f"{name}.{k}" for k in kids if k in ("gate", "router", "shared_expert_gate")
            }
    return routers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_linear_adapts_every_linear_layer_and_the_experts_not_the_router(models, family):
    from nbtrain.model.pretrained import apply_lora
    from nbtrain.model.targets import plan

    model = _load(models[family])
    head = model.get_output_embeddings()
    routers = _routers(model)
    linear = {
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and not any(n == r for r in routers)
    }
    experts = {n for n, m in model.named_modules() if n.endswith(".experts")}
    t = plan(model)
    assert t.moe == (FAMILIES[family].kind == "moe")
    wrapped = _adapted(apply_lora(model, _cfg()))  # the default dropout, as a user runs it
    assert linear <= wrapped, f"linear layers without LoRA: {sorted(linear - wrapped)[:5]}"
    assert experts <= wrapped, f"experts without LoRA: {sorted(experts - wrapped)}"
    assert not (routers & wrapped), f"LoRA on the router: {sorted(routers & wrapped)}"
    assert not any(n.endswith("lm_head") for n in wrapped)
    if family in MOE:
        assert experts, "an MoE family with no experts module"
        assert t.left_out.get("router"), "the router was not seen"


@pytest.mark.parametrize("family", MOE)
def test_lora_moe_chooses_experts_shared_experts_and_router(models, family):
    from nbtrain.model.pretrained import apply_lora

    model = _load(models[family])
    routers = _routers(model)
    shared = {
        n
        for n, _ in model.named_modules()
        if n.split(".")[-1] in ("shared_expert", "shared_experts")
    }
    experts = {n for n, _ in model.named_modules() if n.endswith(".experts")}
    with_router = _adapted(apply_lora(_load(models[family]), _cfg(lora_moe=["experts", "router"])))
    assert routers <= with_router and experts <= with_router
    assert not any(w.startswith(tuple(s + "." for s in shared)) for w in with_router)
    attention_only = _adapted(apply_lora(_load(models[family]), _cfg(lora_moe=[])))
    assert not (attention_only & (experts | routers))
    assert not any(w.startswith(tuple(s + "." for s in shared)) for w in attention_only)
    assert any("attn" in w or "attention" in w for w in attention_only)


def test_a_failed_wrap_names_the_models_own_modules(models):
    from nbtrain.errors import ConfigError
    from nbtrain.model.pretrained import apply_lora

    model = _load(models["qwen3_moe"])
    # a target peft cannot wrap: the norm (not a layer type LoRA supports)
    with pytest.raises(ConfigError) as e:
        apply_lora(model, _cfg(target_modules=["q_norm"]))
    text = str(e.value)
    assert "q_proj" in text and "gate_up_proj" in text
    assert "base_layer" not in text and "default" not in text


def test_a_bad_lora_moe_is_refused_before_anything_loads():
    import nbtrain
    from nbtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="lora_moe=.*experts, shared_experts, router"):
        nbtrain.SFTConfig(model="x", data=[{"prompt": "a", "completion": "b"}], lora_moe=["expert"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_trains_and_its_adapter_loads_in_plain_peft_and_merges_equal(models, family, tmp_path):
    """SFT on the shipped instructions: the loss falls; the exported adapter, loaded with plain peft
    onto the base, gives the logits of the merged export; and it is not the base."""
    from peft import PeftModel

    import nbtrain
    from nbtrain.data.examples import instructions_path

    cfg = nbtrain.SFTConfig(
        model=models[family],
        data=instructions_path(),
        output_dir=str(tmp_path / "run"),
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=2e-2,
        max_length=64,
        logging_steps=1,
        save_steps=None,
        seed=0,
    )
    result = nbtrain.finetune(cfg, merge=True)
    losses = list(result.history["loss"].dropna())
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    adapter_cfg = json.loads((Path(result.adapter_dir) / "adapter_config.json").read_text())
    if family in MOE:
        assert any("experts" in p for p in adapter_cfg["target_parameters"]), adapter_cfg
        assert adapter_cfg["lora_dropout"] == 0  # what a plain peft load of parameter LoRA needs
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23, 61, 7, 11]])
    base = _load(models[family]).eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, result.adapter_dir).eval()(input_ids=ids).logits
        merged = _load(result.merged_dir).eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, atol=2e-5, rtol=1e-4)
    assert (adapted - plain).abs().max() > 1e-3, "the adapter changed nothing"


# different lengths in one batch (the left-padding trap), and a chat prompt
PROMPTS = [
    "Hi",
    "Add 12 and 30, then tell me a story about a fox. " * 3,
    [{"role": "user", "content": "Say hi"}],
]


def _greedy(model, tok, prompt, new: int) -> list[int]:
    """transformers' generate on one prompt alone (no padding): the generated ids, through eos."""
    if isinstance(prompt, str):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    else:
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
    )
    gen = out[0, ids.shape[1] :].tolist()
    return gen[: gen.index(tok.eos_token_id) + 1] if tok.eos_token_id in gen else gen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_equals_transformers(models, family):
    """nbtrain.generate, batched and left-padded, gives what transformers gives each prompt alone,
    through the family's own cache (sliding windows, linear-attention and Mamba states)."""
    from transformers import AutoTokenizer

    import nbtrain
    from nbtrain.generation.utf8 import decode_completion

    new = 8
    tok = AutoTokenizer.from_pretrained(models[family])
    model = _load(models[family]).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    want = [_greedy(model, tok, p, new) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(PROMPTS)  # varied: a padding mistake would show
    df = nbtrain.generate(PROMPTS, model=models[family], max_new_tokens=new, batch_size=3)
    assert list(df.completion) == [decode_completion(tok, ids) for ids in want]
    assert list(df.tokens) == [len(ids) for ids in want]


ATTENTION = ("self_attn", "linear_attn", "mamba")  # a decoder layer's mixer, by its own name
MLP = ("mlp", "feed_forward", "shared_mlp")


@pytest.mark.parametrize("flags", ["attn", "mlp", "unembed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tinker_train_flags_choose_attention_mlp_or_head(models, family, flags):
    """create_lora_training_client(train_attn=, train_mlp=, train_unembed=), one at a time: the LoRA
    a plain peft model builds from by_role sits under each layer's mixer only, its MLP only (the
    experts of an MoE, never the router), or on the output head only."""
    from peft import LoraConfig, get_peft_model

    from nbtrain.model.targets import by_role

    model = _load(models[family])
    routers = _routers(model)
    t = by_role(model, flags == "attn", flags == "mlp", flags == "unembed")
    cfg = LoraConfig(r=2, target_modules=t.modules, target_parameters=t.parameters or None)
    adapted = _adapted(get_peft_model(model, cfg))
    layer_parts = {n.split(".layers.0.")[1].split(".")[0] for n in adapted if ".layers.0." in n}
    owners = {n for n, _ in model.named_modules() if n.endswith("layers.0")}
    children = {c for o in owners for c, _ in model.get_submodule(o).named_children()}
    if flags == "unembed":
        assert adapted == {"lm_head"}, adapted
        return
    assert "lm_head" not in adapted
    assert not any(n.endswith(tuple(routers)) for n in adapted if routers)
    wanted = set(ATTENTION if flags == "attn" else MLP) & children
    assert wanted and wanted <= layer_parts, (layer_parts, children)
    other = set(MLP if flags == "attn" else ATTENTION)
    assert not (layer_parts & other), layer_parts
    if flags == "mlp" and family in MOE:
        assert any(n.endswith(".experts") for n in adapted), adapted


def _datum(n: int, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    toks = rng.integers(5, 400, n + 1)
    w = (rng.random(n) > 0.3).astype(np.float32)
    return {
        "tokens": toks[:-1].tolist(),
        "loss_fn_inputs": {"target_tokens": toks[1:].astype(np.int64), "weights": w},
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tinker_cross_entropy_is_the_weighted_logprob_sum_and_samples(models, family):
    """The Tinker service's rank side, in one process: after a step (so both LoRA factors are
    non-zero), forward_backward('cross_entropy') is -sum(logprob * weight) of a plain peft model with
    the same weights; MoE experts are trained (train_mlp), the router is not; sampling runs."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from nbtrain.model.targets import by_role
    from nbtrain.tinker import ranks as service

    mid = f"tinker-{family}"
    service.create_model(mid, models[family], {"rank": 4, "seed": 1})
    try:
        datums = [_datum(7, 0), _datum(5, 1)]
        service.forward_backward(mid, datums, "cross_entropy", None, False)
        service.optim_step(mid, {"learning_rate": 1e-2})
        out = service.forward_backward(mid, datums, "cross_entropy", None, True)
        weights = service.weights(mid)
        if family in MOE:
            assert any(".experts." in k for k in weights), sorted(weights)[:8]
        routers = _routers(_load(models[family]))
        assert not any(k.split(".lora_")[0].endswith(tuple(routers)) for k in weights)
        t = by_role(_load(models[family]), True, True, True)
        cfg = LoraConfig(
            r=4, lora_alpha=32, target_modules=t.modules, target_parameters=t.parameters or None
        )
        ref = get_peft_model(_load(models[family]), cfg)
        set_peft_model_state_dict(ref, {k: torch.tensor(v) for k, v in weights.items()})
        ref.eval()
        want = 0.0
        with torch.no_grad():
            for d, got in zip(datums, out["outputs"], strict=True):
                logits = ref(input_ids=torch.tensor([d["tokens"]])).logits[0].float()
                t_ids = torch.as_tensor(d["loss_fn_inputs"]["target_tokens"])
                lp = torch.log_softmax(logits, -1).gather(-1, t_ids[:, None]).squeeze(-1)
                torch.testing.assert_close(
                    torch.as_tensor(got["logprobs"]), lp, atol=1e-5, rtol=1e-4
                )
                want -= float((lp * torch.as_tensor(d["loss_fn_inputs"]["weights"])).sum())
        assert out["metrics"]["loss:sum"] == pytest.approx(want, rel=1e-5)
        sampled = service.sample(
            {"model_id": mid}, datums[0]["tokens"], 2, {"max_tokens": 4, "seed": 0}
        )
        assert [len(s["tokens"]) for s in sampled["sequences"]] == [4, 4]
    finally:
        service.unload(mid)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_dpo_and_a_grpo_run(models, family, tmp_path):
    """Two DPO steps on the shipped preference pairs and two GRPO steps with a reward function, on
    the defaults (lora_dropout 0.05): each logs finite losses and exports an adapter."""
    import math

    import nbtrain
    from nbtrain.data.examples import preferences_path

    common = dict(model=models[family], logging_steps=1, save_steps=None, data_cache="off", seed=0)
    dpo = nbtrain.finetune(
        nbtrain.DPOConfig(
            data=preferences_path(),
            output_dir=str(tmp_path / "dpo"),
            max_steps=2,
            per_device_train_batch_size=2,
            learning_rate=5e-3,
            max_length=48,
            **common,
        )
    )
    assert len(dpo.history) == 2 and all(math.isfinite(x) for x in dpo.history["loss"])
    rows = [{"prompt": f"What is {a} plus {b}?\nAnswer: "} for a in range(3) for b in range(3)]
    grpo = nbtrain.finetune(
        nbtrain.GRPOConfig(
            data=rows,
            reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
            num_generations=2,
            max_completion_length=4,
            per_device_train_batch_size=4,
            output_dir=str(tmp_path / "grpo"),
            max_steps=2,
            learning_rate=1e-2,
            **common,
        )
    )
    assert len(grpo.history) == 2 and all(math.isfinite(x) for x in grpo.history["loss"])
    assert Path(dpo.adapter_dir, "adapter_model.safetensors").is_file()
    assert Path(grpo.adapter_dir, "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_run_in_two_spans_equals_one_run(models, family, tmp_path):
    """nbtrain.Run: 2 + 2 steps give the uninterrupted run's losses and adapter, bit for bit (dropout on,
    so the spans must hand the RNG on too)."""
    from safetensors.torch import load_file

    import nbtrain
    from nbtrain.data.examples import instructions_path

    def cfg(out):
        return nbtrain.SFTConfig(
            model=models[family],
            data=instructions_path(),
            output_dir=str(out),
            max_steps=4,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_steps=None,
            max_length=48,
            lora_dropout=0.1,
            data_cache="off",
            seed=3,
        )

    one = nbtrain.finetune(cfg(tmp_path / "one"))
    run = nbtrain.Run(cfg(tmp_path / "two"))
    assert run.train(steps=2).state == "paused"
    two = run.train(steps=2)
    assert two.state == "done"
    assert list(two.history["loss"]) == list(one.history["loss"])
    a = load_file(Path(one.adapter_dir) / "adapter_model.safetensors")
    b = load_file(Path(two.adapter_dir) / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_row_keeps_its_documents_apart(models, family):
    """What nbtrain's packed layout feeds the model (no attention mask, position_ids restarting at 0
    for each document): document B's logits in the row [A, B] equal B's alone, on every family whose
    layers take the boundary. On a hybrid one the recurrent layers carry A's state into B, and
    GPT-OSS's mask ignores position_ids: nbtrain refuses to pack those (nbtrain.model.report.packing_refusal)."""
    from nbtrain.model.report import packing_refusal

    model = _load(models[family]).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(5, 400, (1, 11), generator=g), torch.randint(5, 400, (1, 9), generator=g)
    row = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(11), torch.arange(9)])[None]
    with torch.no_grad():
        packed = model(input_ids=row, position_ids=pos, use_cache=False).logits[0, 11:]
        alone = model(input_ids=b, position_ids=torch.arange(9)[None], use_cache=False).logits[0]
    apart = torch.allclose(packed, alone, atol=1e-5, rtol=1e-4)
    if packing_refusal(model.config):
        assert not apart, "the documents no longer mix: packing could be allowed for this family"
    else:
        assert apart, f"packed differs from alone by {(packed - alone).abs().max():.2e}"


def test_each_column_of_the_docs_table_is_a_test_here_on_every_family():
    """docs/models.md says "tested" for a column only where the test it names is in this module and
    runs on every family of FAMILIES: a test renamed, removed or narrowed fails here."""
    import sys

    from nbtrain.model.matrix import TESTED

    module = sys.modules[__name__]
    for column, name in TESTED.items():
        fn = getattr(module, name, None)
        assert fn is not None, f"{column!r}: no test {name} in {__name__}"
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        assert any(m.args[0] == "family" and list(m.args[1]) == list(FAMILIES) for m in marks), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qlora_trains_on_a_4_bit_base(models, family, tmp_path):
    """load_in_4bit: bitsandbytes' NF4 base (its CPU kernels) under the LoRA, three finite steps; on
    an MoE the fused experts stay unquantised (bitsandbytes takes nn.Linear) and still get LoRA."""
    import importlib.util
    import math

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    import nbtrain
    from nbtrain.data.examples import instructions_path

    result = nbtrain.finetune(
        nbtrain.SFTConfig(
            model=models[family],
            data=instructions_path(),
            output_dir=str(tmp_path / "q"),
            max_steps=3,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            max_length=48,
            logging_steps=1,
            save_steps=None,
            load_in_4bit=True,
            data_cache="off",
        )
    )
    assert "4-bit NF4 base" in result.plan["levers"]
    assert len(result.history) == 3 and all(math.isfinite(x) for x in result.history["loss"])
    if family in MOE:
        cfg = json.loads((Path(result.adapter_dir) / "adapter_config.json").read_text())
        assert any("experts" in p for p in cfg["target_parameters"])


@pytest.mark.parametrize("family", ["qwen3_5", "granite4", "qwen3_next", "gpt_oss"])
@pytest.mark.parametrize("setting", ["packing", "padding_free"])
def test_packing_is_refused_where_documents_would_mix(models, family, setting, tmp_path):
    """finetune refuses packing and padding_free on the families whose packed rows mix documents
    (the test above shows they do), before the model loads and writing nothing."""
    import nbtrain
    from nbtrain.data.examples import instructions_path
    from nbtrain.errors import ConfigError

    out = tmp_path / "run"
    cfg = nbtrain.SFTConfig(
        model=models[family],
        data=instructions_path(),
        output_dir=str(out),
        max_steps=1,
        max_length=48,
        save_steps=None,
        data_cache="off",
        **{setting: True},
    )
    with pytest.raises(
        ConfigError, match=rf"{setting}=True would mix the documents.*packing=False"
    ):
        nbtrain.finetune(cfg)
    assert not out.exists() or not any(out.iterdir())
