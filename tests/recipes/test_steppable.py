"""nbtrain.Run (nbtrain/recipes/steppable.py): a run trained a span at a time equals one uninterrupted
finetune, bit for bit on the CPU (SFT, DPO and GRPO in one process; SFT and GRPO on 2 real ranks), with
sampling, another RNG user and a generate between the spans; its record and metrics.jsonl are one
curve; what may change between spans, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import nbtrain
from nbtrain import runs
from nbtrain.data.examples import instructions_path, preferences_path
from nbtrain.errors import ConfigError

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

ROWS = [
    {"prompt": f"What is {a} plus {b}?\nAnswer: ", "answer": str(a + b)}
    for a in range(4)
    for b in range(4)
]


def digits(completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(len(c.replace(" ", "")), 1) for c in completions]


def short(completions, **kw):
    return [-float(len(c)) for c in completions]


def _sft(tiny, out, **kw):
    return nbtrain.SFTConfig(**_sft_kw(tiny, out, **kw))


def _sft_kw(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=instructions_path(),
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        warmup_steps=2,
        logging_steps=2,
        save_steps=None,
        max_length=64,
        # dropout draws from the global RNG: the spans must give it back as one run would have it
        lora_dropout=0.1,
        seed=3,
    )
    return {**base, **kw}


def _dpo(tiny, out):
    return nbtrain.DPOConfig(**_dpo_kw(tiny, out))


def _dpo_kw(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=preferences_path(),
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        logging_steps=1,
        save_steps=None,
        max_length=64,
        lora_dropout=0.1,
        disable_dropout=False,
        seed=3,
    )
    return {**base, **kw}


def _grpo(tiny, out, **kw):
    return nbtrain.GRPOConfig(reward_funcs=digits, **_grpo_kw(tiny, out, **kw))


def _grpo_kw(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=ROWS,
        num_generations=4,
        max_completion_length=4,
        per_device_train_batch_size=8,
        output_dir=str(out),
        max_steps=4,
        learning_rate=2e-2,
        warmup_steps=1,
        logging_steps=1,
        save_steps=None,
        lora_dropout=0.0,
        data_cache="off",
        seed=5,
    )
    return {**base, **kw}


def _adapter(out):
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a_dir, b_dir):
    a, b = _adapter(a_dir), _adapter(b_dir)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _in_between(run):
    """What a notebook does between spans: draws from the global RNG, samples from the model."""
    torch.rand(1000)
    table = run.generate(["Add 12 and 30."], max_new_tokens=4, do_sample=True, seed=1)
    assert len(table) == 1 and table["tokens"][0] >= 1


def test_sft_two_spans_equal_one_run(tiny, tmp_path, monkeypatch):
    ref = nbtrain.finetune(_sft(tiny, tmp_path / "one"))
    out = tmp_path / "two"
    # what the live display is sent (a %%distributed cell's, or a plain kernel's)
    from nbtrain.engine import metrics

    sent = []
    monkeypatch.setattr(metrics, "_publish", sent.append)
    run = nbtrain.Run(_sft(tiny, out, sample_prompts=["Say hi"], sample_steps=2))
    first = run.train(steps=3)
    assert (first.state, first.global_step, first.adapter_dir) == ("paused", 3, None)
    record = runs.get_run(runs.run_id_for(out))
    assert (record["state"], record["paused"], record["step"]) == ("running", True, 3)
    _in_between(run)
    second = run.train(steps=3)
    assert (second.state, second.global_step) == ("done", 6)
    # each span's display: the first ends 'paused'; the second redraws the rows so far and goes on
    said = [(p["kind"], p.get("row", {}).get("step"), p.get("state")) for p in sent]
    said = [x for x in said if x[0] != "samples"]
    assert said == [
        ("begin", None, None),
        ("row", 2, None),
        ("end", None, "paused"),
        ("begin", None, None),
        ("row", 2, None),
        ("row", 4, None),
        ("row", 6, None),
        ("end", None, "done"),
    ]
    assert second.adapter_dir == str(out / "adapter")
    assert_same_adapter(tmp_path / "one", out)
    # one curve: the same rows as the uninterrupted run, in metrics.jsonl and the record
    torch.testing.assert_close(
        torch.tensor(second.history["loss"].to_list()),
        torch.tensor(ref.history["loss"].to_list()),
        rtol=0,
        atol=0,
    )
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]
    record = runs.get_run(runs.run_id_for(out))
    assert (record["state"], record["paused"], record["step"]) == ("done", False, 6)
    # the samples taken while training went on across the spans
    sampled = [json.loads(x)["step"] for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sampled == [0, 2, 4, 6]  # the first before any step
    with pytest.raises(ConfigError, match="trains no more .it reached its last step, 6"):
        run.train(steps=1)
    # the weights stay for a look after the end
    assert len(run.generate("Say hi", max_new_tokens=3)) == 1


def test_dpo_two_spans_equal_one_run(tiny, tmp_path):
    nbtrain.finetune(_dpo(tiny, tmp_path / "one"))
    run = nbtrain.Run(_dpo(tiny, tmp_path / "two"))
    run.train(steps=1)
    _in_between(run)
    assert run.train(steps=3).state == "done"
    assert_same_adapter(tmp_path / "one", tmp_path / "two")


def test_grpo_two_spans_equal_one_run_and_a_new_reward_applies(tiny, tmp_path):
    ref = nbtrain.finetune(_grpo(tiny, tmp_path / "one"))
    run = nbtrain.Run(_grpo(tiny, tmp_path / "two"))
    run.train(steps=2)
    _in_between(run)
    assert run.train(steps=2).state == "done"
    assert_same_adapter(tmp_path / "one", tmp_path / "two")

    # a reward function changed between spans scores the next span's completions
    run = nbtrain.Run(_grpo(tiny, tmp_path / "three"))
    run.train(steps=2)
    run.reward_funcs = [short]
    assert run.reward_funcs == [short]
    done = run.train(steps=2)
    h = done.history
    digits_col, short_col = "rewards/digits/mean", "rewards/short/mean"
    assert digits_col in h.columns and short_col in h.columns
    assert h[short_col].iloc[:2].isna().all() and h[digits_col].iloc[2:].isna().all()
    # the first span is the unchanged run's
    assert h["reward"].iloc[:2].to_list() == ref.history["reward"].iloc[:2].to_list()
    assert (h[short_col].iloc[2:] <= 0).all()
    saved = json.loads((tmp_path / "three" / "sft_config.json").read_text())
    assert saved["reward_funcs"] == ["short"]


def test_an_interrupt_pauses_the_run_whole(tiny, tmp_path):
    """SIGINT during a span is taken at the next step's start: the run pauses there and goes on to
    the uninterrupted run's adapter."""
    import os
    import signal

    nbtrain.finetune(_sft(tiny, tmp_path / "one"))
    hooks = nbtrain.Hooks()
    sent = []

    @hooks.on_step
    def interrupt(recipe, step, **kw):
        if step == 2 and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGINT)

    run = nbtrain.Run(_sft(tiny, tmp_path / "two"), hooks=hooks)
    with pytest.raises(KeyboardInterrupt):
        run.train(steps=5)
    assert (run.state, run.step) == ("paused", 2)
    record = runs.get_run(runs.run_id_for(tmp_path / "two"))
    assert (record["state"], record["paused"]) == ("running", True)
    assert run.train().state == "done"
    assert_same_adapter(tmp_path / "one", tmp_path / "two")


def test_set_learning_rate_and_refusals(tiny, tmp_path, capsys):
    out = tmp_path / "lr"
    run = nbtrain.Run(_sft(tiny, out, lr_scheduler_type="linear", max_steps=8, logging_steps=1))
    with pytest.raises(ConfigError, match="has not trained yet"):
        run.save()
    run.train(steps=4)
    # linear decay after 2 warmup steps: step 5's factor is (8 - 4) / (8 - 2)
    run.learning_rate = 1e-3
    assert "from step 4: learning_rate=0.001" in capsys.readouterr().out
    h = run.train(steps=1).history
    assert h["learning_rate"].iloc[-1] == pytest.approx(1e-3 * 4 / 6)
    assert json.loads((out / "sft_config.json").read_text())["learning_rate"] == 1e-3
    with pytest.raises(ConfigError, match="cannot change model, per_device_train_batch_size"):
        run.set(model="other", per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match="learning_rate"):
        run.set(learning_rate=-1.0)  # the config's own check
    with pytest.raises(ConfigError, match="steps must be an integer >= 1"):
        run.train(steps=0)
    # the adapter of the weights as they are, and a checkpoint to resume from
    assert run.export() == str(out / "adapter")
    assert run.save() == str(out / "checkpoint-5")
    run.close()
    record = runs.get_run(runs.run_id_for(out))
    assert (record["state"], record["step"]) == ("stopped", 5)
    assert record["checkpoint"] == str(out / "checkpoint-5")
    with pytest.raises(ConfigError, match="make a new nbtrain.Run"):
        run.train(steps=1)
    # it resumes where close() left it, to the end
    resumed = nbtrain.finetune(
        _sft(tiny, out, lr_scheduler_type="linear", max_steps=8, logging_steps=1, resume="latest")
    )
    assert resumed.global_step == 8


def test_generate_engine_hf_is_the_default_and_nbtrain_generate_s(tiny, tmp_path):
    """Run.generate(engine="hf") is the default's table, and the one nbtrain.generate makes from the
    adapter the run exports at that step (one generation path); the run's train mode comes back."""
    from pandas.testing import assert_frame_equal

    out = tmp_path / "gen"
    prompts = ["Add 12 and 30.", [{"role": "user", "content": "Say hi"}], "Name a colour."]
    run = nbtrain.Run(_sft(tiny, out, max_steps=4))
    run.train(steps=2)
    kw = dict(max_new_tokens=6, do_sample=True, seed=4, batch_size=2)
    default = run.generate(prompts, **kw)
    hf = run.generate(prompts, engine="hf", **kw)
    assert run.model.training and len(default) == 3 and default["tokens"].min() >= 1
    # seconds are each call's own
    assert_frame_equal(default.drop(columns="seconds"), hf.drop(columns="seconds"))
    run.export()
    exported = nbtrain.generate(prompts, model=tiny, adapter=str(out / "adapter"), **kw)
    assert_frame_equal(default.drop(columns="seconds"), exported.drop(columns="seconds"))
    with pytest.raises(ConfigError, match="engine='tgi' is not an engine"):
        run.generate(prompts, engine="tgi")
    run.close()


def test_disaggregated_grpo_is_refused(tiny, tmp_path):
    with pytest.raises(ConfigError, match="collocated only"):
        nbtrain.Run(_grpo(tiny, tmp_path / "d", actor="actor", rollout="rollout"))


# ---- on 2 real ranks: one cluster for the module's tests

ENGINE_CODE = """
import json, torch
from safetensors.torch import load_file
import nbtrain
torch.set_num_threads(1)

def digits(completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(len(c.replace(" ", "")), 1) for c in completions]

def make(kind, kw):
    if kind == "grpo":
        return nbtrain.GRPOConfig(reward_funcs=digits, **kw)
    if kind == "dpo":
        return nbtrain.DPOConfig(**kw)
    return nbtrain.SFTConfig(**kw)
"""


@pytest.fixture(scope="module")
def two_ranks():
    cluster = nbtrain.start(n=2, force=True)
    try:
        cluster.execute(ENGINE_CODE, output="none")
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("kind", ["sft", "fsdp", "dpo", "grpo"])
def test_two_ranks_two_spans_equal_one_run(two_ranks, tiny, tmp_path, kind):
    make = {"sft": _sft_kw, "fsdp": _sft_kw, "dpo": _dpo_kw, "grpo": _grpo_kw}[kind]
    kw = {
        "sft": {"per_device_train_batch_size": 2},
        # sharded: generate runs synced on both ranks, the export gathers the adapter
        "fsdp": {"per_device_train_batch_size": 2, "shard": "fsdp", "max_steps": 4},
        "dpo": {"per_device_train_batch_size": 1},
        "grpo": {},
    }[kind]
    one = make(str(tiny), tmp_path / "one", **kw)
    two = make(str(tiny), tmp_path / "two", **kw)
    two_ranks.push({"one": one, "two": two, "kind": "sft" if kind == "fsdp" else kind})
    two_ranks.execute(
        "ref = nbtrain.finetune(make(kind, one))\n"
        "run = nbtrain.Run(make(kind, two))\n"
        "first = run.train(steps=2)\n"
        "torch.rand(100)\n"
        "table = run.generate(['Add 1 and 2.'], max_new_tokens=3)\n"
        "second = run.train()\n",
        output="none",
    )
    first, second, tables = (two_ranks.pull(k) for k in ("first", "second", "table"))
    assert [f.state for f in first] == ["paused", "paused"]
    assert [s.state for s in second] == ["done", "done"]
    assert (
        second[0].adapter_dir == str(tmp_path / "two" / "adapter") and second[1].adapter_dir is None
    )
    assert len(tables[0]) == 1 and tables[1] is None
    assert_same_adapter(tmp_path / "one", tmp_path / "two")
