"""nbtrain/generation/decode.py's shared pieces: `generation_mode` (eval with the KV cache on inside,
train mode and use_cache as they were after, an exception included) and `generate_kwargs`."""

from __future__ import annotations

import pytest

from nbtrain.generation import decode


@pytest.fixture(scope="module")
def model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny)


@pytest.mark.parametrize(("training", "use_cache"), [(True, False), (False, True), (True, True)])
def test_generation_mode_restores_both_after_an_exception(model, training, use_cache):
    model.train(training)
    model.config.use_cache = use_cache
    with pytest.raises(RuntimeError, match="inside"), decode.generation_mode(model) as m:
        assert m is model
        assert not model.training and model.config.use_cache is True
        # every submodule is in eval (dropout draws nothing), not only the top one
        assert not any(x.training for x in model.modules())
        raise RuntimeError("inside")
    assert model.training is training and model.config.use_cache is use_cache
    assert all(x.training is training for x in model.modules())


def test_generation_mode_restores_after_an_interrupt_and_leaves_a_config_without_use_cache(model):
    model.train(True)
    model.config.use_cache = False
    with pytest.raises(KeyboardInterrupt), decode.generation_mode(model):
        raise KeyboardInterrupt
    assert model.training and model.config.use_cache is False

    import torch

    plain = torch.nn.Linear(2, 2)
    plain.config = type("Config", (), {})()  # a config without use_cache stays without it
    with decode.generation_mode(plain):
        assert not plain.training and not hasattr(plain.config, "use_cache")
    assert plain.training and not hasattr(plain.config, "use_cache")


def test_generate_kwargs_greedy_sampled_and_full_length(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    greedy = decode.generate_kwargs(decode.Decoding(max_new_tokens=5, stop=("\n",)), 0, [2], tok)
    assert greedy == {
        "max_new_tokens": 5,
        "do_sample": False,
        "num_beams": 1,
        "pad_token_id": 0,
        "use_cache": True,
        "eos_token_id": [2],
        "stop_strings": ["\n"],
        "tokenizer": tok,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    sampled = decode.generate_kwargs(
        decode.Decoding(do_sample=True, temperature=0.7, top_p=0.9, top_k=5), 0, [], tok,
        synced=True, logprobs=True,
    )  # fmt: skip
    assert "eos_token_id" not in sampled  # none given: the model's generation_config decides
    assert (
        sampled["synced_gpus"] and sampled["output_logits"] and sampled["return_dict_in_generate"]
    )
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 5)
    full = decode.generate_kwargs(decode.Decoding(stop=("x",)), 0, [2], tok, full_length=True)
    assert full["eos_token_id"] is None and full["synced_gpus"] is False
    assert "stop_strings" not in full
