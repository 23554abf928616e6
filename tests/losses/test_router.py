"""An MoE's router load-balancing loss in SFT (nbtrain.losses.router): on where the model's config asks
for it, its gradient the one of transformers' own `loss` for `labels` (cross-entropy plus
router_aux_loss_coef x aux_loss), logged as aux_loss; off where the config does not ask, and refused
where the model has no router loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")

COEF = 0.5  # large, so that a router loss left out (or weighted wrongly) moves the gradients a lot


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny Qwen3-MoE and GPT-OSS whose configs ask for the router loss, and a dense Llama."""
    from nbtrain.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("router")
    out = {}
    for family in ("qwen3_moe", "gpt_oss", "llama", "llama4"):
        path = Path(make_tiny_model(root / family, arch=family))
        if family != "llama":
            config = json.loads((path / "config.json").read_text())
            text = config.get("text_config", config)
            text.update(output_router_logits=True, router_aux_loss_coef=COEF)
            (path / "config.json").write_text(json.dumps(config))
        out[family] = str(path)
    return out


def _cfg(model: str, tmp_path: Path, **kw):
    import nbtrain
    from nbtrain.data.examples import instructions_path

    base = dict(
        model=model,
        data=instructions_path(),
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_length=64,
        logging_steps=1,
        save_steps=None,
        lora_dropout=0.0,
        seed=0,
    )
    return nbtrain.SFTConfig(**{**base, **kw})


def _one_step_grads(cfg):
    """The LoRA gradients of nbtrain's first step, and the recipe (its model and first batch)."""
    from nbtrain.recipes import loop
    from nbtrain.recipes import step as one_step
    from nbtrain.recipes.sft import SFTRecipe

    r = SFTRecipe(cfg)
    r.setup()
    loop.hold(r)  # the stop and preemption flags the step reads; cleanup() puts them back
    loop.begin(r)
    micro = [loop.micro_batch(r, r.step, a) for a in range(r.plan.grad_accum)]
    assert len(micro) == 1
    stats = loop.step_stats(r, micro, r.micro_stats)
    r.accumulate(micro, stats)
    grads = {n: p.grad.clone() for n, p in r.peft_model.named_parameters() if p.requires_grad}
    batch = one_step.to_device(r.batches.collate(micro[0], int(stats[:, 1].max())), r.d.device)
    r.peft_model.zero_grad(set_to_none=True)
    return r, batch, grads


def _reference_grads(model, batch, output_router_logits: bool):
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        output_router_logits=output_router_logits,
        use_cache=False,
    )
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads, out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_router_loss_is_in_the_gradient_as_transformers_adds_it(models, family, tmp_path):
    r, batch, ours = _one_step_grads(_cfg(models[family], tmp_path))
    try:
        assert r.router_aux is not None and r.router_aux.coef == COEF
        with_aux, out = _reference_grads(r.peft_model, batch, True)
        without, _ = _reference_grads(r.peft_model, batch, False)
        assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
        assert ours.keys() == with_aux.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], with_aux[name], atol=1e-6, rtol=1e-4)
        # the router loss does move them: the same check against the cross-entropy alone fails
        assert any((ours[n] - without[n]).abs().max() > 1e-4 for n in ours)
        # the meter's share is the unweighted router loss, as logged
        torch.testing.assert_close(
            float(r.meter.aux), float(out.aux_loss.detach()), rtol=1e-5, atol=1e-7
        )
    finally:
        r.cleanup()


def test_aux_loss_is_logged_and_off_means_off(models, tmp_path):
    import nbtrain

    on = nbtrain.finetune(_cfg(models["qwen3_moe"], tmp_path / "on"))
    off = nbtrain.finetune(_cfg(models["qwen3_moe"], tmp_path / "off", router_aux_loss_coef=0))
    assert (on.history["aux_loss"] > 0).all(), on.history
    assert "aux_loss" not in off.history
    # the cross-entropy of the first step is the same batch on the same base: equal; the second
    # step follows a different update
    assert on.history["loss"].iloc[0] == pytest.approx(off.history["loss"].iloc[0], rel=1e-6)
    assert on.history["loss"].iloc[1] != pytest.approx(off.history["loss"].iloc[1], rel=1e-6)


def test_a_dense_model_refuses_a_router_loss_naming_the_fix(models, tmp_path):
    import nbtrain
    from nbtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="is not an MoE with a router.*router_aux_loss_coef=None"):
        nbtrain.finetune(_cfg(models["llama"], tmp_path, router_aux_loss_coef=0.01))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_dpo_refuses_a_router_loss_it_does_not_add(models, tmp_path):
    import nbtrain
    from nbtrain.data.examples import preferences_path
    from nbtrain.errors import ConfigError

    cfg = nbtrain.DPOConfig(
        model=models["qwen3_moe"],
        data=preferences_path(),
        output_dir=str(tmp_path / "dpo"),
        max_steps=1,
        router_aux_loss_coef=0.01,
    )
    with pytest.raises(ConfigError, match="DPO does not add the router loss yet"):
        nbtrain.finetune(cfg)


def test_a_family_whose_model_returns_no_router_loss_says_so(models, tmp_path, capsys):
    """Llama 4's config has output_router_logits, but transformers' Llama4ForCausalLM returns no
    router loss: the run trains without it and says so."""
    import nbtrain

    result = nbtrain.finetune(_cfg(models["llama4"], tmp_path, max_steps=1))
    assert "aux_loss" not in result.history
    assert "returns none: trained without it" in capsys.readouterr().out
