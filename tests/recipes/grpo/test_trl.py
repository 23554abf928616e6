"""nbtrain's GRPO computes what TRL's GRPOTrainer computes: with the completions fixed, one step's
rewards, advantages, loss and LoRA gradients equal TRL's within fp32 tolerance, for TRL's default loss
('dapo') and the other loss types nbtrain has, with and without the KL to the reference.

How both sides get the same inputs:
- the same tiny model (built from a config, written with save_pretrained), the same LoRA settings, and
  the same adapter: nbtrain's, its B matrices made nonzero (else the policy is the reference and the
  KL term is zero), loaded into TRL's model (dropout 0 on both);
- the same prompts in the same order: nbtrain's first step takes prompts `recipe.order.step(0)`; TRL is
  handed exactly those rows, each repeated num_generations times, as its RepeatSampler would;
- the same completion token ids: on nbtrain's side only the sampling itself is replaced
  (`decode.generate_batch`, called by nbtrain's `grpo_rollout.generate_part`, returns the fixed ids);
  on TRL's side its `_generate` (tokenize the prompts, sample, decode) returns TRL's own prompt ids
  (checked equal to nbtrain's) with the same fixed completion ids and their decoded text. Everything
  after sampling is each side's own code: the reward functions' calls, the advantages, the
  reference's log-probabilities, the loss and its backward.

nbtrain's side is one real `train_step` (its gradients caught in an optimizer pre-hook, before the
step; max_grad_norm=0, no clipping); TRL's is `_generate_and_score_completions` then `compute_loss`
and `backward`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

G = 4  # completions per prompt
B = 8  # completions per step: 2 prompts
MAX_NEW = 6


def length(completions, **kw):
    return [len(c) / 10 for c in completions]


def mentions(completions, answer, **kw):
    return [float(any(ch in c for ch in a)) for c, a in zip(completions, answer, strict=True)]


def _rows():
    return [
        {"prompt": f"What is {a} plus {b}?\nAnswer: ", "answer": str(a + b)}
        for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (0, 6)]
    ]


def _fixed_completions(tokenizer):
    """B completions of 2-6 tokens: some end with eos, some are cut at MAX_NEW (no eos)."""
    import torch

    g = torch.Generator().manual_seed(0)
    eos = tokenizer.eos_token_id
    specials = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in specials]
    out = []
    for k in range(B):
        n = [2, 3, 4, 5, MAX_NEW, MAX_NEW, 3, MAX_NEW][k]
        ids = [vocab[int(i)] for i in torch.randint(0, len(vocab), (n,), generator=g)]
        if k not in (4, 5, 7):  # the others end with eos; 4, 5 and 7 are cut at MAX_NEW
            ids[-1] = eos
        out.append(ids)
    return out


CASES = {
    "dapo (TRL's default)": {},
    "grpo, beta=0.04": {"loss_type": "grpo", "beta": 0.04},
    "bnpo, scale_rewards='batch', masked truncations": {
        "loss_type": "bnpo",
        "scale_rewards": "batch",
        "mask_truncated_completions": True,
    },
    "dr_grpo, beta=0.1, scale_rewards='none'": {
        "loss_type": "dr_grpo",
        "beta": 0.1,
        "scale_rewards": "none",
    },
}


def _nbtrain_step(tiny, tmp_path, monkeypatch, fixed, settings):
    import torch
    from peft import get_peft_model_state_dict

    import nbtrain
    from nbtrain.generation import decode
    from nbtrain.recipes.grpo.recipe import GRPORecipe

    def fixed_batch(model, tokenizer, batch, decoding, device, synced=False, autocast=None):
        return [{"index": p.index, "ids": list(fixed[p.index])} for p in batch]

    monkeypatch.setattr(decode, "generate_batch", fixed_batch)
    cfg = nbtrain.GRPOConfig(
        model=tiny,
        data=_rows(),
        reward_funcs=[length, mentions],
        reward_weights=[1.0, 0.5],
        num_generations=G,
        max_completion_length=MAX_NEW,
        per_device_train_batch_size=B,
        output_dir=str(tmp_path / "nb"),
        max_steps=1,
        logging_steps=1,
        save_steps=None,
        learning_rate=1e-2,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        max_grad_norm=0.0,
        data_cache="off",
        **settings,
    )
    recipe = GRPORecipe(cfg)
    recipe.setup()
    # a trained-looking adapter (LoRA's B starts at zero, where the policy is the reference and the
    # KL and its gradient are zero): both sides start from these weights
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in recipe.peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    init = {k: v.detach().clone() for k, v in get_peft_model_state_dict(recipe.peft_model).items()}
    prompts = recipe.order.step(0)
    names = {id(p): n for n, p in recipe.peft_model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def catch(opt, args, kwargs):
        for p in recipe.trainable:
            grads[names[id(p)]] = p.grad.detach().clone()

    recipe.optimizer.register_step_pre_hook(catch)
    recipe.train()
    row = recipe.result().history.iloc[0]
    return recipe, init, prompts, grads, row


def _trl_step(tiny, tmp_path, rows, fixed, init, settings):
    import datasets
    from peft import LoraConfig, set_peft_model_state_dict
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=MAX_NEW,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        max_steps=1,
        reward_weights=[1.0, 0.5],
        **settings,
    )
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    trainer = GRPOTrainer(
        model=tiny,
        reward_funcs=[length, mentions],
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(tiny),
        peft_config=lora,
    )
    set_peft_model_state_dict(trainer.model, init)
    seen = {}

    def fixed_generate(prompts):
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        seen["prompt_ids"] = [list(p) for p in prompt_ids]
        texts = trainer.processing_class.batch_decode(fixed, skip_special_tokens=True)
        return prompt_ids, [list(c) for c in fixed], None, texts, None, {}, None, []

    trainer._generate = fixed_generate
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = [r for r in rows for _ in range(G)]  # each prompt num_generations times, in order
    batch = trainer._generate_and_score_completions(inputs)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {
        n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad
    }
    assert grads and all(g is not None for g in grads.values())
    return seen, batch, float(loss.detach()), grads, trainer._metrics["train"]


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_equals_trl(tiny, tmp_path, monkeypatch, case):
    import torch
    from transformers import AutoTokenizer

    settings = CASES[case]
    tok = AutoTokenizer.from_pretrained(tiny)
    fixed = _fixed_completions(tok)
    recipe, init, prompts, ours, row = _nbtrain_step(tiny, tmp_path, monkeypatch, fixed, settings)
    rows = [_rows()[i] for i in prompts]
    seen, batch, trl_loss, theirs, metrics = _trl_step(tiny, tmp_path, rows, fixed, init, settings)

    # the same prompt tokens on both sides
    assert seen["prompt_ids"] == [recipe.rows.ids[i] for i in prompts for _ in range(G)]
    # the same rewards and advantages
    assert row["rewards/length/mean"] == pytest.approx(metrics["rewards/length/mean"][-1], abs=1e-6)
    assert row["rewards/mentions/mean"] == pytest.approx(
        metrics["rewards/mentions/mean"][-1], abs=1e-6
    )
    assert row["reward"] == pytest.approx(metrics["reward"][-1], abs=1e-6)
    # the loss and every LoRA gradient
    assert row["loss"] == pytest.approx(trl_loss, rel=1e-4, abs=1e-6)
    assert set(ours) == set(theirs)
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    scale = max(float(theirs[k].abs().max()) for k in theirs)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-6)
    if "beta" in settings:
        assert row["kl"] > 1e-4  # the adapter moved the policy off the reference
        assert row["kl"] == pytest.approx(metrics["kl"][-1], rel=1e-4, abs=1e-7)
    print(
        f"{case}: loss {row['loss']:.6g} vs TRL {trl_loss:.6g}; largest gradient difference "
        f"{worst:.2e} (largest gradient {scale:.2e})"
    )
    assert scale > 0  # a test whose gradients were all zero could not fail
