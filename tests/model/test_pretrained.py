"""nbtrain.model.pretrained: a model name that cannot come from anywhere fails at once, not after the Hub
client's retries (about 28 s here with no network)."""

from __future__ import annotations

import time

import pytest

from nbtrain.errors import ConfigError
from nbtrain.model import pretrained as model


@pytest.fixture(autouse=True)
def _fresh_probe(monkeypatch):
    # imported before the clock starts: transformers' first import alone takes seconds
    import transformers.models.auto.modeling_auto  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    monkeypatch.setattr(model, "_REACHABLE", {})


@pytest.mark.parametrize("load", [model.check_causal_lm, model.load_tokenizer])
def test_offline_fails_at_once(monkeypatch, load):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(
        ConfigError,
        match="not a local folder and not in the Hugging Face cache.*HF_HUB_OFFLINE is set",
    ):
        load("someorg/no-such-model")
    assert time.monotonic() - t0 < 2.0


def test_an_unreachable_hub_fails_after_one_short_probe(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(model, "_offline", lambda: False)
    # nothing listens on port 9 here: refused at once, as a machine without a route fails its probe
    monkeypatch.setattr(model, "_hub_endpoint", lambda: "http://127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"127.0.0.1:9 cannot be reached from .*save_pretrained"):
        model.check_causal_lm("someorg/no-such-model")
    assert time.monotonic() - t0 < model.PROBE_TIMEOUT_S + 1
    assert model._REACHABLE  # asked once per process, then remembered


def test_a_folder_is_never_probed(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="has no config.json"):
        model.check_causal_lm(str(tmp_path))
    model.require_hub(str(tmp_path))  # a folder: nothing to ask the Hub


def test_bitsandbytes_kernels_note_is_not_shown():
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed: nothing prints the note")

    def stderr(code: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        ).stderr

    if "gemm_4bit_forward" not in stderr("import peft"):
        pytest.skip("bitsandbytes prints no kernels note on this CPU (it needs AVX512-BF16)")
    assert "gemm_4bit_forward" not in stderr("import nbtrain.model.pretrained, peft")


def test_loading_and_lora_print_no_bar_nor_deprecation_notice(tmp_path, capfd):
    # finetune and generate load through these two: in a fresh kernel (bars on) rank 0 printed a
    # "Loading weights" bar, and peft's wrapping transformers' FutureWarning, on every call
    import warnings
    from types import SimpleNamespace

    import torch
    from transformers.utils import logging as hf_logging

    from nbtrain.model.tiny import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny")
    lora = SimpleNamespace(lora_r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear")
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            base = model.load_model(tiny, torch.float32, torch.device("cpu"))
            model.apply_lora(base, lora)
        out = capfd.readouterr()
        assert hf_logging.is_progress_bar_enabled()  # the user's own setting is left as it was
    finally:
        if not was:
            hf_logging.disable_progress_bar()
    assert "Loading weights" not in out.out + out.err
    assert [str(w.message) for w in seen if issubclass(w.category, FutureWarning)] == []


def test_finetune_with_merge_prints_no_bar_nor_deprecation_notice(tiny, tmp_path, capfd):
    # in one process (a docs page, a notebook without a cluster) rank 0 printed a "Writing model
    # shards" bar for merge=True, and a merge into a fresh base (4-bit, sharded runs) two more bars
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    import nbtrain
    from nbtrain.data.examples import instructions_path
    from nbtrain.model.checkpoint import export_merged_from_adapter
    from nbtrain.model.pretrained import load_tokenizer

    cfg = nbtrain.SFTConfig(
        model=tiny,
        data=instructions_path(),
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=2,
        max_length=48,
        save_steps=None,
    )
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = nbtrain.finetune(cfg, merge=True)
            export_merged_from_adapter(
                tmp_path / "again",
                tiny,
                result.adapter_dir,
                load_tokenizer(tiny),
                torch.float32,
                True,
            )
        out = capfd.readouterr()
    finally:
        if not was:
            hf_logging.disable_progress_bar()
    assert (tmp_path / "again" / "merged" / "config.json").is_file()
    for bar in ("Loading weights", "Writing model shards"):
        assert bar not in out.out + out.err
    assert [str(w.message) for w in seen if issubclass(w.category, FutureWarning)] == []
