"""GRPOConfig's checks, and a GRPO run in one process: resumed from its step-2 checkpoint, it ends as the
uninterrupted run does (the same rewards at steps 3-4 and the same adapter: each step's sampling is
seeded by the run's seed and the step, not by the RNG the checkpoint restores)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import nbtrain
from nbtrain.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = [
    {"prompt": f"What is {a} plus {b}?\nAnswer: ", "answer": str(a + b)}
    for a in range(5)
    for b in range(5)
]


def digits(completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(len(c.replace(" ", "")), 1) for c in completions]


def _cfg(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=ROWS,
        reward_funcs=digits,
        num_generations=4,
        max_completion_length=5,
        per_device_train_batch_size=8,
        output_dir=str(out),
        max_steps=4,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_steps=2,
        lora_dropout=0.0,
        data_cache="off",
        seed=5,
    )
    base.update(kw)
    return nbtrain.GRPOConfig(**base)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"reward_funcs": None}, "reward_funcs=None must be a function"),
        ({"num_generations": 1}, "num_generations=1 must be an integer >= 2"),
        ({"loss_type": "cispo"}, "loss_type='cispo' is not supported"),
        ({"shard": "fsdp"}, "shard='fsdp' is not supported for GRPO"),
        ({"actor": "actor"}, "give both group names"),
        ({"reward_weights": [1.0, 2.0]}, "must be a list of 1 numbers"),
        ({"scale_rewards": "sometimes"}, "scale_rewards='sometimes' must be one of"),
    ],
)
def test_bad_settings_are_refused(tiny, tmp_path, kw, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace("[", r"\[")):
        _cfg(tiny, tmp_path, **kw)


def test_a_step_must_hold_whole_groups(tiny, tmp_path, capsys):
    # issue 34, 5: refused from the settings, before the model loads, with what to change
    with pytest.raises(
        ConfigError,
        match="= 6, must be a multiple of num_generations=4: make per_device_train_batch_size a "
        "multiple of 4, or lower num_generations",
    ):
        nbtrain.finetune(_cfg(tiny, tmp_path, per_device_train_batch_size=6))
    assert "nbtrain: loading" not in capsys.readouterr().out
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_rows_without_a_prompt_are_refused_together_before_the_model_loads(tiny, tmp_path, capsys):
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]
    with pytest.raises(
        ConfigError,
        match="all 25 rows of data have keys 'question', 'answer', and a GRPO row needs a 'prompt'",
    ):
        nbtrain.finetune(_cfg(tiny, tmp_path, data=rows))
    mixed = [*ROWS[:20], *rows[20:]]
    with pytest.raises(
        ConfigError,
        match=r"5 of 25 data rows are not GRPO prompt rows: data row 20 has keys 'question', 'answer'; data row 21",
    ):
        nbtrain.finetune(_cfg(tiny, tmp_path, data=mixed))
    assert "nbtrain: loading" not in capsys.readouterr().out


def samples_only(samples):
    return [0.0] * len(samples)


def needs_solution(completions, solution, **kw):
    return [float(c == s) for c, s in zip(completions, solution)]


def no_kwargs(prompts, completions, completion_ids):
    return [0.0] * len(completions)


def test_reward_functions_are_checked_against_trls_call_before_the_model_loads(
    tiny, tmp_path, capsys
):
    # issue 34, 4: a signature TRL's call cannot fit is refused where the config is made ...
    with pytest.raises(
        ConfigError,
        match=r"reward function 'samples_only\(samples\)': it takes no argument named 'prompts', "
        r"'completions', 'completion_ids', which the calls pass; add \*\*kwargs",
    ):
        _cfg(tiny, tmp_path, reward_funcs=[digits, samples_only])
    # ... and a column the data lacks when the data is read: both before any model load, not blamed on
    # a data row after a step was sampled
    with pytest.raises(ConfigError) as info:
        nbtrain.finetune(_cfg(tiny, tmp_path, reward_funcs=[digits, needs_solution, no_kwargs]))
    msg = str(info.value)
    assert (
        "reward function 'needs_solution(completions, solution, **kw)': it needs 'solution', a column the data does not have"
        in msg
    )
    assert (
        "'no_kwargs(prompts, completions, completion_ids)': it takes no argument named 'answer'"
        in msg
    )
    assert "digits" not in msg.split("TRL calls")[0]
    assert "the data's columns are 'prompt', 'answer'" in msg
    assert "nbtrain: loading" not in capsys.readouterr().out
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_the_step_line_shows_the_mean_reward(tiny, tmp_path, capsys):
    # issue 34, 13: the printed step line is not only a loss near 0
    result = nbtrain.finetune(_cfg(tiny, tmp_path, max_steps=1, save_steps=None))
    reward = float(result.history["reward"][0])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 1/1 |"))
    assert f"| reward {reward:.3f} |" in line, line


def test_a_finished_run_is_not_overwritten(tiny, tmp_path):
    out = tmp_path / "done"
    nbtrain.finetune(_cfg(tiny, out, max_steps=1, save_steps=None))
    before = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(
        ConfigError, match=r"holds another run \(adapter, metrics.jsonl, .*overwrite=True"
    ):
        nbtrain.finetune(_cfg(tiny, out, max_steps=2, save_steps=None))
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_resumed_run_ends_as_the_uninterrupted_one(tiny, tmp_path):
    whole = nbtrain.finetune(_cfg(tiny, tmp_path / "whole"))
    resumed = nbtrain.finetune(
        _cfg(tiny, tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    )
    assert list(resumed.history["step"]) == [3, 4]
    assert list(resumed.history["reward"]) == list(whole.history["reward"][2:])
    a = load_file(str(tmp_path / "whole" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    # and the run trained: the adapter moved from its start
    assert any(float(whole.history["grad_norm"][i]) > 0 for i in range(4))


def test_torch_compile_is_off_and_said_so(tiny, tmp_path, capsys):
    result = nbtrain.finetune(
        _cfg(tiny, tmp_path, torch_compile=True, max_steps=1, save_steps=None)
    )
    notes = result.plan["notes"]
    assert any(
        n.startswith("torch_compile off: GRPO samples with the model it trains") for n in notes
    )
    assert "torch.compile" not in result.plan["levers"]
    assert "nbtrain: torch_compile off: GRPO" in capsys.readouterr().out


def test_preemption_records_the_run_and_names_grpoconfig(tiny, tmp_path):
    """SIGUSR1 during a GRPO run: Preempted naming GRPOConfig; the record says preempted, at which
    step, with the checkpoint it wrote, and that the run is a GRPO run."""
    import os
    import signal

    from nbtrain import runs
    from nbtrain.recipes.hooks import Hooks

    hooks = Hooks()

    @hooks.on_step
    def signal_at_step_1(recipe, step, **kw):
        if step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)

    out = tmp_path / "grpo"
    with pytest.raises(nbtrain.Preempted) as info:
        nbtrain.finetune(_cfg(tiny, out, save_steps=None), hooks=hooks)
    msg = str(info.value)
    assert "preempted at step 1/4 on rank 0" in msg
    assert "this run's GRPOConfig (or the same GRPOConfig(...) with resume='latest')" in msg
    record = runs.get_run(runs.run_id_for(out))
    assert record["state"] == "preempted" and record["ended"] is not None
    assert (record["step"], record["checkpoint"]) == (1, str(out / "checkpoint-1"))
    assert record["kind"] == "grpo"
    assert (out / "checkpoint-1").is_dir()
