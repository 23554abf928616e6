"""The SFT recipe (nbtrain/recipes/sft.py, run_setup.py, hooks.py): its phases called one by one train as
`finetune` does, and the loop's hooks are called at their places with the loop's own values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nbtrain.errors import ConfigError
from nbtrain.recipes.hooks import Hooks
from nbtrain.recipes.sft import SFTRecipe
from nbtrain.recipes.train import finetune
from tests.recipes.test_train import make_cfg

DATA = str(
    Path(__file__).resolve().parents[2] / "nbtrain" / "data" / "examples" / "instructions.jsonl"
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(tiny, out, **kw):
    # test_sft_train's tiny run, four steps long
    return make_cfg(tiny, out, **{"max_steps": 4, **kw})


def test_hooks_see_every_step_eval_row_and_checkpoint(tiny, tmp_path):
    calls: dict[str, list] = {"on_step": [], "on_eval": [], "on_log": [], "on_save": []}
    hooks = Hooks()
    recipes = set()

    @hooks.on_step
    def step(recipe, step, grad_norm, lr):
        recipes.add(id(recipe))
        calls["on_step"].append((step, float(grad_norm), lr, recipe.step))

    @hooks.on_eval
    def evaluated(recipe, step, eval_loss):
        calls["on_eval"].append((step, eval_loss))

    @hooks.on_log
    def logged(recipe, row):
        # the row is already in the history and in metrics.jsonl when the hook sees it
        lines = (Path(recipe.out) / "metrics.jsonl").read_text().splitlines()
        calls["on_log"].append((dict(row), recipe.history[-1] is row, json.loads(lines[-1])))

    @hooks.on_save
    def saved(recipe, step, checkpoint):
        calls["on_save"].append(
            (step, checkpoint, (Path(checkpoint) / "trainer_state.json").is_file())
        )

    cfg = _cfg(tiny, tmp_path / "run", logging_steps=2, eval_data=DATA, eval_steps=2, save_steps=2)
    result = finetune(cfg, hooks=hooks)

    assert len(recipes) == 1
    assert [c[0] for c in calls["on_step"]] == [1, 2, 3, 4]
    assert all(s == at for s, _, _, at in calls["on_step"])
    history = result.history.to_dict("records")
    # on_log gets each logged row, the same rows the result's history holds
    assert [row for row, _, _ in calls["on_log"]] == history
    assert all(is_last for _, is_last, _ in calls["on_log"])
    assert [row["step"] for row, _, _ in calls["on_log"]] == [2, 4]
    assert [written["step"] for _, _, written in calls["on_log"]] == [2, 4]
    # the learning rate a step used is the one its logged row reports
    lrs = {s: lr for s, _, lr, _ in calls["on_step"]}
    for row in history:
        assert lrs[row["step"]] == pytest.approx(row["learning_rate"])
    assert [s for s, _ in calls["on_eval"]] == [2, 4]
    for (_, loss), row in zip(calls["on_eval"], history, strict=True):
        assert loss == pytest.approx(row["eval_loss"])
    assert calls["on_save"] == [
        (2, str(tmp_path / "run" / "checkpoint-2"), True),
        (4, str(tmp_path / "run" / "checkpoint-4"), True),
    ]


def test_the_phases_one_by_one_train_as_finetune_does(tiny, tmp_path):
    whole = finetune(_cfg(tiny, tmp_path / "whole"))
    recipe = SFTRecipe(_cfg(tiny, tmp_path / "phases"))
    recipe.setup()
    # the set-up wrote only the run's settings: no step, no checkpoint, no adapter yet
    assert recipe.step == 0 and recipe.total_steps == 4
    assert not (tmp_path / "phases" / "adapter").exists()
    recipe.train()
    result = recipe.result()
    assert result.state == "done" and result.global_step == 4
    torch.testing.assert_close(
        torch.tensor(result.history["loss"].tolist()), torch.tensor(whole.history["loss"].tolist())
    )
    assert result.plan == whole.plan


def test_a_failing_hook_fails_the_run_and_puts_everything_back(tiny, tmp_path):
    import signal

    from nbtrain import runs

    before = signal.getsignal(signal.SIGTERM)
    hooks = Hooks()

    @hooks.on_step
    def boom(recipe, step, grad_norm, lr):
        if step == 2:
            raise RuntimeError("hook failed at step 2")

    recipe = SFTRecipe(_cfg(tiny, tmp_path / "run"), hooks=hooks)
    with pytest.raises(RuntimeError, match="step 2"):
        recipe.run()
    assert recipe.state == "failed"
    assert runs.get_run(recipe.runlog.run_id)["state"] == "failed"
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_unknown_hook_is_refused_naming_the_hooks():
    with pytest.raises(ConfigError, match="on_step, on_eval, on_log, on_save"):
        Hooks().add("on_batch", print)
    with pytest.raises(ConfigError, match="needs a function"):
        Hooks().add("on_log", 3)
