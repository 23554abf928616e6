"""SFTConfig: typed settings, checked where they enter, with errors that name the problem and the fix."""

from __future__ import annotations

from dataclasses import fields

import pytest

from nbtrain.configs.sft import SFTConfig
from nbtrain.errors import ConfigError

ISSUE_FIELDS = (
    "model data eval_data output_dir max_steps num_train_epochs per_device_train_batch_size "
    "gradient_accumulation_steps learning_rate lr_scheduler_type warmup_steps max_length packing lora_r "
    "lora_alpha lora_dropout target_modules logging_steps eval_steps save_steps resume seed dtype "
    "gradient_checkpointing overwrite"
).split()


@pytest.fixture
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    return {"model": str(model), "data": str(data), "output_dir": str(tmp_path / "out")}


def test_fields_and_help():
    names = [f.name for f in fields(SFTConfig)]
    for name in ISSUE_FIELDS:
        assert name in names
    assert fields(SFTConfig)[names.index("target_modules")].default == "all-linear"
    for f in fields(SFTConfig):
        assert f.metadata["help"].strip(), f.name
    assert len(SFTConfig.help().splitlines()) == len(names)


def test_valid_config_is_normalised(base, tmp_path):
    cfg = SFTConfig(**base, dtype="bf16", target_modules=("q_proj", "v_proj"), max_steps=5)
    assert cfg.dtype == "bfloat16"
    assert cfg.target_modules == ["q_proj", "v_proj"]
    assert not (tmp_path / "out").exists()  # building a config writes nothing
    d = SFTConfig(**{**base, "data": [{"text": "a"}, {"text": "b"}]}).to_dict()
    assert d["data"] == "<list of 2 rows>"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"max_length": 0}, ["max_length=0", ">= 1"]),
        ({"per_device_train_batch_size": 0}, ["per_device_train_batch_size=0"]),
        ({"gradient_accumulation_steps": -2}, ["gradient_accumulation_steps=-2"]),
        ({"max_steps": 0}, ["max_steps=0", "-1"]),
        ({"max_steps": -1, "num_train_epochs": 0}, ["num_train_epochs=0"]),
        ({"learning_rate": 0}, ["learning_rate=0", "> 0"]),
        ({"learning_rate": -1e-4}, ["learning_rate=-0.0001"]),
        ({"lr_scheduler_type": "cosine_annealing"}, ["lr_scheduler_type", "cosine"]),
        ({"dtype": "float16"}, ["float16", "bfloat16"]),
        ({"dtype": "int8"}, ["dtype='int8'"]),
        ({"lora_r": 0}, ["lora_r=0"]),
        ({"lora_dropout": 1.5}, ["lora_dropout"]),
        ({"target_modules": []}, ["target_modules", "all-linear"]),
        ({"save_steps": 0}, ["save_steps=0"]),
        (
            {"data": "/nonexistent/train.jsonl"},
            ["data file", "not found", "/nonexistent/train.jsonl"],
        ),
        ({"data": None}, ["data is required"]),
        ({"model": "./no-such-model"}, ["model folder", "does not exist"]),
        ({"model": ""}, ["model is required"]),
        ({"resume": "/nowhere/checkpoint-3"}, ["resume checkpoint", "not found", "latest"]),
    ],
)
def test_bad_values_raise_config_error(base, tmp_path, change, words):
    with pytest.raises(ConfigError) as e:
        SFTConfig(**{**base, **change})
    for w in words:
        assert w in str(e.value)
    assert not (tmp_path / "out").exists()


def test_data_file_suffix_checked(base, tmp_path):
    bad = tmp_path / "train.txt"
    bad.write_text("x")
    with pytest.raises(ConfigError, match=r"unknown suffix.*\.jsonl"):
        SFTConfig(**{**base, "data": str(bad)})


def test_all_problems_reported_at_once(base):
    with pytest.raises(ConfigError) as e:
        SFTConfig(**base, max_length=0, learning_rate=0)
    assert "max_length" in str(e.value) and "learning_rate" in str(e.value)


def test_hub_id_is_not_checked_locally(base):
    # a Hub id cannot be checked without the network; finetune reports it when loading
    cfg = SFTConfig(**{**base, "model": "Qwen/Qwen2.5-0.5B"})
    assert cfg.model == "Qwen/Qwen2.5-0.5B"


def test_an_unknown_keyword_names_the_nearest_setting(base):
    with pytest.raises(ConfigError) as info:
        SFTConfig(**base, learning_rte=1e-3, max_stpes=3, frobnicate=1)
    text = str(info.value)
    assert "unknown setting learning_rte (did you mean learning_rate?)" in text
    assert "unknown setting max_stpes (did you mean max_steps?)" in text
    assert "unknown setting frobnicate." in text and "SFTConfig.help()" in text
    # the known keywords still reach the dataclass, and its checks
    assert SFTConfig(**base, learning_rate=1e-3).learning_rate == 1e-3
    with pytest.raises(ConfigError, match="invalid SFTConfig"):
        SFTConfig(**base, learning_rate=-1.0)


def test_eval_steps_without_eval_data_is_refused(base, tmp_path):
    # it would be ignored silently: nothing to evaluate on
    with pytest.raises(ConfigError) as e:
        SFTConfig(**base, eval_steps=10)
    for words in ("eval_steps=10", "eval_data", "None", "pass eval_data", "drop eval_steps"):
        assert words in str(e.value)
    assert not (tmp_path / "out").exists()
    # with eval_data it is a setting, and eval_data alone evaluates at the end
    assert SFTConfig(**base, eval_steps=10, eval_data=[{"text": "a"}]).eval_steps == 10
    assert SFTConfig(**base, eval_data=[{"text": "a"}]).eval_steps is None


def _reward(completions, **kw):
    return [0.0 for _ in completions]


@pytest.mark.parametrize("kind", ["SFTConfig", "DPOConfig", "GRPOConfig"])
def test_every_numeric_setting_given_as_text_is_refused_as_text(base, kind):
    """learning_rate="2e-4" (from a YAML file or argv) is a string to fix, not a value out of range:
    said once per field, with the number to write, for every int or float field of every config."""
    import nbtrain

    cls = getattr(nbtrain, kind)
    extra = {"reward_funcs": _reward} if kind == "GRPOConfig" else {}
    numeric = [
        f for f in fields(cls) if {k.strip() for k in str(f.type).split("|")} & {"int", "float"}
    ]
    assert {"learning_rate", "max_steps", "lora_alpha", "save_steps"} <= {f.name for f in numeric}
    for f in numeric:
        text = "0.5" if "float" in str(f.type) else "3"
        with pytest.raises(ConfigError) as e:
            cls(**base, **extra, **{f.name: text})
        lines = [x for x in str(e.value).splitlines() if f"{f.name}=" in x]
        want = "a number" if "float" in str(f.type) else "an integer"
        assert lines == [
            f"  - {f.name}={text!r} must be {want}, not a string; pass {f.name}={text} (no quotes)"
        ], (kind, f.name, str(e.value))
    with pytest.raises(ConfigError) as e:
        cls(**base, **extra, learning_rate="2e-4", lora_r=True, max_grad_norm=[1.0])
    assert str(e.value).splitlines()[1:] == [
        "  - learning_rate='2e-4' must be a number, not a string; pass learning_rate=2e-4 (no quotes)",
        "  - lora_r=True must be an integer, not a bool",
        "  - max_grad_norm=[1.0] must be a number, not a list",
    ]
    # words that are no number are refused as text too, and 'auto' stays a value of its own
    with pytest.raises(ConfigError, match=r"max_steps='lots' must be an integer, not a string$"):
        cls(**base, **extra, max_steps="lots")
