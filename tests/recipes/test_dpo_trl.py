"""nbtrain's DPO computes what TRL's DPOTrainer computes: the same tokens, then the same losses and reward
metrics, step by step, for the sigmoid and IPO losses.

The same tiny model (built from a config and written with save_pretrained), the same rows, the same LoRA
(nbtrain's initial adapter is loaded into TRL's model before training), AdamW, the linear schedule,
clipping at 1.0, fp32 on the CPU, dropout off on both sides (TRL's disable_dropout, nbtrain's).

How both sides see the same batches in the same order: nbtrain shuffles its rows once per epoch
(`epoch_order(seed)`); the test reads that order off the recipe (`batches.order(0)`), hands TRL the rows
in exactly that order, and makes TRL's Trainer read them sequentially (`train_sampling_strategy=
"sequential"`). With one rank, 2 pairs per step (1 x 2 accumulation steps in one case) and 24 rows,
both take rows 0-1, 2-3, ... of that order; the test checks that TRL's processed data set has the same
rows as nbtrain's pairs, token for token.

TRL's per-step numbers are taken as its `compute_loss` returns them (the loss unrounded, and the
metrics it appends for the step), nbtrain's from its history with logging_steps=1.
"""

from __future__ import annotations

import copy

import pytest

from nbtrain.losses.dpo import METRICS

pytest.importorskip("trl")

STEPS = 10
LR = 5e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("dpo-tiny") / "model")


def _standard_rows(n: int = 24) -> list[dict]:
    from nbtrain.data.examples.make_preferences import make_pairs

    rows = [r for r in make_pairs() if isinstance(r.get("prompt"), str)][:n]
    # a few longer completions, so that max_length cuts some sequences (TRL's keep_start)
    for k in range(0, n, 5):
        rows[k] = {**rows[k], "chosen": rows[k]["chosen"] + " and then some more words to cut"}
    return rows


def _conversational_rows(n: int) -> list[dict]:
    from nbtrain.data.examples.make_preferences import make_pairs

    return [r for r in make_pairs() if isinstance(r.get("prompt"), list)][:n]


def _implicit(rows: list[dict]) -> list[dict]:
    """The same pairs with the prompt folded into both completions."""
    return [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows
    ]


def _trl_trainer(model_dir, rows, tmp_path, cfg, recorded=None, eval_rows=None):
    """TRL's DPOTrainer with `cfg`'s settings; `recorded` gets each compute_loss call's loss and metrics."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class Recorded(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if recorded is not None and self.model.training:
                rec = {k: self._metrics["train"][k][-1] for k in METRICS}
                recorded.append({"loss": float(loss.detach()), **rec})
            return loss

    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        seed=cfg.seed,
        beta=cfg.beta,
        loss_type=[cfg.loss_type],
        precompute_ref_log_probs=cfg.precompute_ref_log_probs,
        max_length=cfg.max_length,
        truncation_mode={"right": "keep_start", "left": "keep_end"}[cfg.truncation_side],
        disable_dropout=True,
    )
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    return Recorded(
        model=model_dir,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=lora,
    )


def _nb_cfg(model_dir, rows, tmp_path, **kw):
    import nbtrain

    settings = {
        "model": model_dir,
        "data": rows,
        "output_dir": str(tmp_path / "nb"),
        "max_steps": STEPS,
        "per_device_train_batch_size": 2,
        "learning_rate": LR,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "logging_steps": 1,
        "save_steps": None,
        "data_cache": "off",
        "max_length": 24,
        **kw,
    }
    return nbtrain.DPOConfig(**settings)


def _pairs_of(recipe, order):
    return [(p.prompt, p.chosen, p.rejected) for p in (recipe.batches.example(i) for i in order)]


def _trl_pairs(trainer):
    ds = trainer.train_dataset
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in ds]


# the first two also evaluate on 6 other pairs at the end, against TRL's trainer.evaluate()
EVAL = ("sigmoid", "ipo")
CASES = {
    "sigmoid": {},
    "ipo": {"loss_type": "ipo", "beta": 0.5},
    "sigmoid, precomputed reference": {"precompute_ref_log_probs": True},
    # 1 pair x 2 accumulation steps: TRL divides each micro-batch's mean by 2, nbtrain by the step's pairs
    "sigmoid, accumulation": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2},
    "sigmoid, conversational": {"max_length": 64},
    # cut keeping each sequence's end: TRL's truncation_mode="keep_end" (deprecated there, still there)
    "sigmoid, keep_end": {"truncation_side": "left", "max_length": 16},
}


@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_trl(tiny, tmp_path, case):
    """10 steps: per-step loss and every reward metric equal TRL's within fp32 tolerance."""
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from nbtrain.recipes.dpo import DPORecipe

    rows = _conversational_rows(24) if "conversational" in case else _standard_rows()
    eval_rows = _standard_rows(30)[24:] if case in EVAL else None
    cfg = _nb_cfg(tiny, rows, tmp_path, eval_data=eval_rows, **CASES[case])
    precompute = cfg.precompute_ref_log_probs
    recipe = DPORecipe(cfg)
    recipe.setup()
    init = {k: v.detach().clone() for k, v in get_peft_model_state_dict(recipe.peft_model).items()}
    order = recipe.batches.order(0)
    assert len(order) == len(rows)  # no pair dropped: both train on the same rows
    assert (recipe.ref_table is not None) == precompute
    recipe.train()
    ours = recipe.result().history

    recorded: list[dict] = []
    trainer = _trl_trainer(tiny, [rows[i] for i in order], tmp_path, cfg, recorded, eval_rows)
    assert _trl_pairs(trainer) == _pairs_of(recipe, order)  # the same tokens, in the same order
    assert ("ref_chosen_logps" in trainer.train_dataset.column_names) == precompute
    if cfg.max_length <= 24:  # the standard rows' cases also check how both cut long sequences
        longest = max(len(p) + max(len(c), len(r)) for p, c, r in _pairs_of(recipe, order[:20]))
        assert longest > cfg.max_length
    set_peft_model_state_dict(trainer.model, init)
    now = get_peft_model_state_dict(trainer.model)
    assert all(torch.equal(now[k], v) for k, v in init.items())
    trainer.train()

    # one record per micro-batch: a step's numbers are the mean of its micro-batches' (equal sizes)
    ga = cfg.gradient_accumulation_steps
    assert len(recorded) == STEPS * ga and len(ours) == STEPS
    theirs = {
        k: torch.tensor([r[k] for r in recorded], dtype=torch.float64).reshape(STEPS, ga).mean(1)
        for k in recorded[0]
    }
    mine = {k: torch.tensor(ours[k].tolist(), dtype=torch.float64) for k in theirs}
    worst = {k: float((mine[k] - theirs[k]).abs().max()) for k in theirs}
    print(f"\n{case}: max |nbtrain - TRL| over {STEPS} steps: {worst}")
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-5, msg=k)
    # the run moved: a test of ten identical zeros would prove nothing
    assert float(mine["rewards/margins"].abs().max()) > 1e-3
    assert float((mine["loss"] - mine["loss"][0]).abs().max()) > 1e-4
    if eval_rows:
        # the eval at the end: TRL's evaluate() after training, nbtrain's last row
        evaluated = trainer.evaluate()
        keys = ["eval_loss", *(f"eval_{k}" for k in METRICS)]
        last = ours.iloc[-1]
        worst = {k: abs(float(last[k]) - float(evaluated[k])) for k in keys}
        print(f"{case}: eval, max |nbtrain - TRL|: {worst}")
        for k in keys:
            assert float(last[k]) == pytest.approx(float(evaluated[k]), rel=1e-4, abs=1e-5), k
        assert abs(float(last["eval_rewards/margins"])) > 1e-3


@pytest.mark.parametrize(
    "layout", ["conversational", "implicit standard", "implicit conversational"]
)
def test_tokens_match_trl(tiny, tmp_path, layout):
    """Prompt, chosen and rejected tokens equal those of TRL's processed data set, for the layouts the
    training comparison does not use (conversations; the prompt implicit in chosen/rejected)."""
    from transformers import AutoTokenizer

    from nbtrain.data.prefs import encode_pairs
    from nbtrain.model.tiny import make_tiny_tokenizer

    rows = _standard_rows(9) if layout == "implicit standard" else _conversational_rows(8)
    if layout.startswith("implicit"):
        rows = _implicit(rows)
    tok = AutoTokenizer.from_pretrained(tiny)
    assert type(tok) is type(make_tiny_tokenizer())
    store = encode_pairs(rows, tok)
    import numpy as np

    ours = []
    for i in range(len(rows)):
        ids, which = (np.asarray(a) for a in store.arrays(i))
        ours.append(tuple(ids[which == k].tolist() for k in (0, 1, 2)))
    cfg = _nb_cfg(tiny, rows, tmp_path, max_length=1024)
    trainer = _trl_trainer(tiny, copy.deepcopy(rows), tmp_path, cfg)
    assert _trl_pairs(trainer) == ours
    assert all(p and c and r for p, c, r in ours)
