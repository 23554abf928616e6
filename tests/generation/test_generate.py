"""nbtrain.generate: greedy output equals transformers' own `generate` token for token, in one process and
on a 2-rank cluster (one cluster for the module), for the base, an adapter, a merged model, FSDP and 4 bits.

The model is a tiny Llama with untied, widely spread random weights: its greedy output depends on the
whole prompt, so a wrong pad side or wrong positions change it (`test_the_test_model_sees_padding`); the
shipped tiny model's random weights mostly repeat the last token, which would hide those bugs.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import nbtrain
from nbtrain.errors import ConfigError
from nbtrain.generation.utf8 import decode_completion
from tests.conftest import magic_cluster

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

NEW = 10
# very different lengths (the left-padding trap), a chat prompt, and 7 of them: not divisible by 2 ranks
PROMPTS = [
    "Hi",
    "Add 12 and 30, then tell me a long story about a fox and a crow in a wood. " * 5,
    [{"role": "user", "content": "Say hi"}],
    "What is the capital",
    "x",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    "One two three four five six",
]


def _reference_ids(tok, prompt):
    if isinstance(prompt, str):
        return tok(prompt, return_tensors="pt")["input_ids"]
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def reference(model, tok, prompts, new=NEW):
    """transformers' generate, one prompt at a time (no padding at all): (texts, token counts)."""
    texts, counts = [], []
    for p in prompts:
        ids = _reference_ids(tok, p)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
        )
        gen = out[0, ids.shape[1] :].tolist()
        eos = tok.eos_token_id
        n = gen.index(eos) + 1 if eos in gen else len(gen)
        # the text of these ids as every writer of a completion decodes it: less the half character a
        # length cut leaves (tests/generation/test_utf8.py checks that rule on its own)
        texts.append(decode_completion(tok, gen[:n]))
        counts.append(n)
    return texts, counts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A varied tiny base, a LoRA adapter on it with nonzero B, and the adapter merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nbtrain.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("gen")
    tiny = make_tiny_model(root / "tiny")
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for p in base.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.3)
    base.generation_config.pad_token_id = cfg.pad_token_id
    base.generation_config.eos_token_id = cfg.eos_token_id
    tok = AutoTokenizer.from_pretrained(tiny)
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base"), lora)
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
    peft.save_pretrained(root / "run" / "adapter")
    peft.merge_and_unload().save_pretrained(root / "run" / "merged")
    tok.save_pretrained(root / "run" / "merged")
    return {
        "base": str(root / "base"),
        "adapter": str(root / "run" / "adapter"),
        "merged": str(root / "run" / "merged"),
        "root": root,
    }


@pytest.fixture(scope="module")
def refs(models):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["base"])
    base = AutoModelForCausalLM.from_pretrained(models["base"]).eval()
    out = {"base": reference(base, tok, PROMPTS)}
    merged = AutoModelForCausalLM.from_pretrained(models["merged"]).eval()
    out["merged"] = reference(merged, tok, PROMPTS)
    tuned = PeftModel.from_pretrained(base, models["adapter"]).eval()
    out["adapter"] = reference(tuned, tok, PROMPTS)
    return out


@pytest.fixture(scope="module")
def two(ip):
    """One 2-rank gloo cluster for the module."""
    with magic_cluster(ip, 2) as c:
        c.execute("import torch; torch.set_num_threads(1); import nbtrain", output="none")
        yield c


def _check(df, ref, column="completion", tokens="tokens"):
    texts, counts = ref
    assert list(df[column]) == texts
    assert list(df[tokens]) == counts


def test_the_test_model_sees_padding(models, refs):
    """The check below can fail: right padding (the trap) changes this model's greedy output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["base"])
    tok.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(models["base"]).eval()
    texts = [p for p in PROMPTS if isinstance(p, str)]
    enc = tok(texts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    wrong = [decode_completion(tok, o[enc.input_ids.shape[1] :].tolist()) for o in out]
    right = [t for p, t in zip(PROMPTS, refs["base"][0], strict=True) if isinstance(p, str)]
    assert wrong != right
    assert len(set(refs["base"][0])) == len(PROMPTS)  # varied output, not one repeated token


def test_greedy_equals_transformers_in_one_process(models, refs):
    df = nbtrain.generate(PROMPTS, model=models["base"], max_new_tokens=NEW, batch_size=4)
    assert list(df.columns) == ["prompt", "completion", "tokens", "seconds"]
    assert list(df.prompt) == PROMPTS
    _check(df, refs["base"])
    # the adapter unmerged, the base named by the adapter itself
    df = nbtrain.generate(PROMPTS, adapter=models["adapter"], max_new_tokens=NEW, batch_size=3)
    _check(df, refs["adapter"])
    assert refs["adapter"][0] != refs["base"][0]


def test_side_by_side_in_one_process(models, refs):
    df = nbtrain.generate(
        PROMPTS,
        model=models["base"],
        adapter=["base", models["adapter"], models["merged"]],
        max_new_tokens=NEW,
        batch_size=8,
    )
    # one run's adapter and merged model: the columns say which is which
    assert list(df.columns)[:4] == ["prompt", "base", "run/adapter", "run/merged"]
    _check(df, refs["base"], "base", "tokens_base")
    _check(df, refs["adapter"], "run/adapter", "tokens_run/adapter")
    _check(df, refs["merged"], "run/merged", "tokens_run/merged")


def test_a_run_folder_is_its_adapter(models, refs):
    run = str(models["root"] / "run")
    df = nbtrain.generate(
        PROMPTS, adapter=["base", run, run + "/merged"], max_new_tokens=NEW, batch_size=8
    )
    assert list(df.columns)[:4] == ["prompt", "base", "run/adapter", "run/merged"]
    _check(df, refs["adapter"], "run/adapter", "tokens_run/adapter")
    # alone, the run folder gives the adapter's completions, the base named by the adapter
    _check(nbtrain.generate(PROMPTS, adapter=run, max_new_tokens=NEW), refs["adapter"])


def test_column_labels_tell_models_apart():
    from nbtrain.generation.generate import _models, _name_columns

    def labels(adapter):
        models = _models(adapter)
        _name_columns(models)
        return [m.label for m in models]

    assert labels(["base", "runs/a/adapter", "runs/b"]) == ["base", "a", "b"]
    assert labels(["x/sft/adapter", "y/sft/adapter"]) == ["x/sft/adapter", "y/sft/adapter"]
    assert labels(["base", "runs/base/adapter"]) == ["base", "base/adapter"]
    assert labels(["runs/a/adapter", "runs/a/adapter"]) == ["a", "a-2"]
    assert labels({"mine": "runs/a/adapter", "a": "base"}) == ["mine", "a"]
    assert labels("runs/a/adapter") == ["completion"]


def test_a_run_folder_without_its_adapter_names_the_way_out(models, tmp_path):
    import shutil

    run = tmp_path / "stopped"
    (run / "checkpoint-5").mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(models["root"] / "run" / "adapter" / f, run / "checkpoint-5" / f)
    (run / "checkpoint-5" / "trainer_state.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="run folder without an adapter/") as e:
        nbtrain.generate(["hi"], model=models["base"], adapter=str(run))
    assert "resume='latest'" in str(e.value)
    assert f"adapter={str(run / 'checkpoint-5')!r}" in str(e.value)


def test_an_adapter_prints_no_deprecation_notice_nor_loading_bar(models, capfd):
    import warnings

    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh kernel
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            nbtrain.generate(["hi"], adapter=models["adapter"], max_new_tokens=2)
        assert hf_logging.is_progress_bar_enabled()  # the user's setting is left as it was
    finally:
        if not was:
            hf_logging.disable_progress_bar()
    assert [str(w.message) for w in seen if issubclass(w.category, FutureWarning)] == []
    out = capfd.readouterr()
    assert "Loading weights" not in out.out + out.err


def test_two_ranks_equal_transformers_in_prompt_order(two, models, refs):
    two.push({"P": PROMPTS, "M": models, "N": NEW})
    two.execute(
        "df = nbtrain.generate(P, model=M['base'], max_new_tokens=N, batch_size=2)\n"
        "side = nbtrain.generate(P, adapter={'base': 'base', 'tuned': M['adapter'], "
        "'merged': M['merged']}, max_new_tokens=N, batch_size=2)"
    )
    df, none = two.pull("df")
    assert none is None  # rank 1 gets nothing
    assert list(df.prompt) == PROMPTS
    _check(df, refs["base"])
    side = two.pull("side", ranks=0)[0]
    _check(side, refs["base"], "base", "tokens_base")
    _check(side, refs["adapter"], "tuned", "tokens_tuned")
    _check(side, refs["merged"], "merged", "tokens_merged")


def test_fewer_prompts_than_ranks_and_fsdp(two, models, refs):
    two.push({"P": PROMPTS, "M": models, "N": NEW})
    two.execute(
        "one = nbtrain.generate(P[:1], model=M['base'], max_new_tokens=N)\n"
        "fs = nbtrain.generate(P, model=M['base'], adapter=['base', M['adapter']], shard='fsdp', "
        "max_new_tokens=N, batch_size=3)"
    )
    one = two.pull("one", ranks=0)[0]
    assert list(one.completion) == refs["base"][0][:1]
    # FSDP2: every rank runs the same forward passes (a short rank repeats a batch); fp32 on the CPU
    # gives the same tokens as the whole model
    fs = two.pull("fs", ranks=0)[0]
    _check(fs, refs["base"], "base", "tokens_base")
    _check(fs, refs["adapter"], "run", "tokens_run")


def test_the_model_a_finetune_in_the_same_cell_trained(two, models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbtrain.data.examples import instructions_path

    cfg = dict(
        model=models["base"],
        data=instructions_path(),
        output_dir=str(tmp_path / "ft"),
        max_steps=2,
        per_device_train_batch_size=2,
        max_length=48,
        save_steps=None,
        learning_rate=1e-2,
        lora_r=4,
    )
    two.push({"cfg": cfg, "P": PROMPTS, "N": NEW})
    two.execute(
        "result = nbtrain.finetune(nbtrain.SFTConfig(**cfg))\n"
        "tuned = nbtrain.generate(P, adapter=result, max_new_tokens=N, batch_size=4)"
    )
    tuned = two.pull("tuned", ranks=0)[0]
    tok = AutoTokenizer.from_pretrained(models["base"])
    base = AutoModelForCausalLM.from_pretrained(models["base"])
    ref = PeftModel.from_pretrained(base, str(tmp_path / "ft" / "adapter")).eval()
    _check(tuned, reference(ref, tok, PROMPTS))


def test_a_data_file_gives_references(models, tmp_path):
    rows = [
        {"prompt": "Add 2 and 2.", "completion": " 4"},
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ]
        },
        {
            "prompt": [{"role": "user", "content": "Bye"}],
            "completion": [{"role": "assistant", "content": "Ciao"}],
        },
        {"text": "Once upon"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = nbtrain.generate(str(path), model=models["base"], max_new_tokens=3)
    assert list(df.reference) == [" 4", "Hello", "Ciao", None]
    assert df.prompt[1] == [{"role": "user", "content": "Hi"}]
    # a prompt that ends like a file name is still a prompt
    one = nbtrain.generate("Summarise notes.csv", model=models["base"], max_new_tokens=2)
    assert list(one.prompt) == ["Summarise notes.csv"]
    # the same through a DataFrame
    df2 = nbtrain.generate(pd.DataFrame(rows[:1]), model=models["base"], max_new_tokens=3)
    assert df2.completion[0] == df.completion[0]


def test_sampling_takes_a_seed_and_leaves_the_global_rng(models):
    kw = dict(model=models["base"], max_new_tokens=8, do_sample=True, temperature=1.5)
    state = torch.get_rng_state()
    a = nbtrain.generate(PROMPTS, seed=1, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    b = nbtrain.generate(PROMPTS, seed=1, **kw)
    c = nbtrain.generate(PROMPTS, seed=2, **kw)
    assert list(a.completion) == list(b.completion)
    assert list(a.completion) != list(c.completion)


@pytest.fixture(scope="module")
def four_bit_ref(models):
    """transformers' own 4-bit load of the base (NF4 as nbtrain's QLoRA), one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbtrain.model import quant

    cfg = type("C", (), {"load_in_8bit": False})()
    q = AutoModelForCausalLM.from_pretrained(
        models["base"],
        quantization_config=quant.bnb_config(cfg, torch.float32),
        dtype=torch.float32,
        device_map={"": "cpu"},
    ).eval()
    for module in q.modules():  # the one CPU weight layout nbtrain keeps (nbtrain.model.quant)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return reference(q, AutoTokenizer.from_pretrained(models["base"]), PROMPTS)


def test_4_bit_equals_transformers_4_bit(models, four_bit_ref):
    """bitsandbytes' CPU kernels: the same greedy tokens as transformers' own 4-bit load. Against the
    fp32 model the 4-bit rounding changes this random model's tokens, so that is not compared."""
    df = nbtrain.generate(PROMPTS, model=models["base"], load_in_4bit=True, max_new_tokens=NEW)
    _check(df, four_bit_ref)


def test_4_bit_under_fsdp_on_two_ranks(two, models, four_bit_ref):
    """QLoRA's sharded base (each rank its rows of the 4-bit words): the same tokens again."""
    two.push({"P": PROMPTS, "M": models, "N": NEW})
    two.execute(
        "q = nbtrain.generate(P, model=M['base'], shard='fsdp', load_in_4bit=True, "
        "max_new_tokens=N, batch_size=4)"
    )
    _check(two.pull("q", ranks=0)[0], four_bit_ref)


@pytest.mark.parametrize(
    ("prompts", "kw", "match"),
    [
        (42, {}, "int is not supported"),
        ("missing.jsonl", {}, "prompts file 'missing.jsonl' not found"),
        ([{"question": "?"}], {}, r"prompts\[0\] is not a prompt: keys found 'question'"),
        (["hi"], {"max_new_tokens": 0}, "max_new_tokens=0 must be an integer >= 1"),
        (["hi"], {"shard": "zero3"}, "shard='zero3' is not supported"),
        (["hi"], {"adapter": "/nonexistent/adapter"}, "not found on rank 0"),
        ([], {}, "holds no prompts"),
    ],
)
def test_bad_input_is_refused_naming_the_fix(models, prompts, kw, match):
    kw = {"model": models["base"], **kw}
    with pytest.raises(ConfigError, match=match):
        nbtrain.generate(prompts, **kw)


def test_a_folder_that_is_neither_adapter_nor_model(models, tmp_path):
    with pytest.raises(ConfigError, match="neither adapter_config.json"):
        nbtrain.generate(["hi"], model=models["base"], adapter=str(tmp_path))
