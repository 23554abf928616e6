"""GRPO end to end on a real 2-rank local cluster (gloo, CPU): the tiny model learns a verifiable task,
collocated (both ranks sample, then train) and disaggregated (`%nbtrain groups actor=0 rollout=1`:
rank 1 samples step s + 1 while rank 0 trains step s); a reward function that raises is named with its
row and rank, and the run stops on every rank with nothing half-written.

The task: the shipped arithmetic prompts ("What is 3 plus 4?\\nAnswer: "), 6 new tokens sampled per
completion, 8 per prompt, rewarded by the share of digits in the completion (a format reward; the
sum's correctness is a second function, weight 0.5, which a model of this size does not learn in the
budget). The untrained model writes digits in about 2% of its characters.

Measured on this machine (2 shared cores, the test prints the whole curve): collocated, the reward at
step 1 was 0.03 and the mean of steps 18-20 0.79; disaggregated 0.00 and 0.72 (it learns a little
slower: each step trains on completions sampled with the adapter one step older). The module takes
about 30 s.
"""

from __future__ import annotations

import pytest

import nbtrain

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("one_torch_thread")]

STEPS = 20

SETUP = """
import nbtrain, torch
torch.set_num_threads(1)
from nbtrain.model.tiny import make_tiny_model

def digits(completions, **kw):
    out = []
    for c in completions:
        s = c.replace(" ", "")
        out.append(sum(ch.isdigit() for ch in s) / max(len(s), 1))
    return out

def correct(completions, answer, **kw):
    return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

rows = [{"prompt": f"What is {a} plus {b}?\\nAnswer: ", "answer": str(a + b)}
        for a in range(10) for b in range(10)]
"""


@pytest.fixture(scope="module")
def cluster(tiny):
    c = nbtrain.start(n=2, force=True)
    try:
        c.execute(SETUP, output="none")
        yield c
    finally:
        c.stop()


def _kw(tiny, out, **kw):
    return {
        "model": tiny,
        "data": None,  # the cell's rows
        "reward_funcs": None,
        "reward_weights": [1.0, 0.5],
        "num_generations": 8,
        "max_completion_length": 6,
        "per_device_train_batch_size": 16,
        "output_dir": str(out),
        "max_steps": STEPS,
        "learning_rate": 2e-2,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_steps": None,
        "lora_dropout": 0.0,
        "data_cache": "off",
        "seed": 3,
        **kw,
    }


RUN = """
kw = dict(grpo_kw, data=rows, reward_funcs=[digits, correct])
r = nbtrain.finetune(nbtrain.GRPOConfig(**kw))
res = {"history": r.history.to_dict(orient="records"), "adapter": r.adapter_dir, "state": r.state,
       "notes": r.plan.get("notes", [])}
"""


def _run(cluster, kw):
    cluster.push({"grpo_kw": kw, "res": None})
    cluster.execute(RUN, output="none")
    return cluster.pull("res")


def _learned(history, label):
    """Step 1's reward (the untrained model's completions) against the mean of the last 3 steps."""
    start = history[0]["reward"]
    last = sum(r["reward"] for r in history[-3:]) / 3
    curve = " ".join(f"{r['reward']:.2f}" for r in history)
    print(
        f"{label}: reward at step 1 {start:.2f}, mean of steps {STEPS - 2}-{STEPS} {last:.2f} ({curve})"
    )
    assert start < 0.1
    assert last > start + 0.4, (start, last)


def test_collocated_learns(cluster, tiny, tmp_path):
    got = _run(cluster, _kw(tiny, tmp_path / "col"))
    h0, h1 = got[0]["history"], got[1]["history"]
    assert [r["step"] for r in h0] == list(range(1, STEPS + 1))
    # both ranks log the same rows (the rewards are swapped, the loss metrics summed)
    assert [r["reward"] for r in h0] == [r["reward"] for r in h1]
    assert all(r["gen_s"] > 0 and r["train_s"] > 0 for r in h0)
    assert {
        "rewards/digits/mean",
        "rewards/correct/std",
        "completions/mean_length",
        "clip_ratio/region_mean",
    } <= set(h0[0])
    assert got[0]["adapter"] == str(tmp_path / "col" / "adapter") and got[1]["adapter"] is None
    _learned(h0, "collocated")


def test_disaggregated_learns(cluster, tiny, tmp_path):
    cluster.groups(actor="0", rollout="1")
    try:
        got = _run(cluster, _kw(tiny, tmp_path / "dis", actor="actor", rollout="rollout"))
    finally:
        cluster.clear_groups()
    h0, h1 = got[0]["history"], got[1]["history"]
    assert [r["step"] for r in h0] == list(range(1, STEPS + 1))
    # the rollout rank returns the run's history too
    assert [(r["step"], r["loss"], r["reward"]) for r in h1] == [
        (r["step"], r["loss"], r["reward"]) for r in h0
    ]
    assert got[0]["state"] == got[1]["state"] == "done"
    assert any("staleness 1" in n for n in got[0]["notes"])  # stated in the run's notes
    assert got[0]["adapter"] == str(tmp_path / "dis" / "adapter") and got[1]["adapter"] is None
    # each group's wait is measured (the rollout's from step 2: it reports the previous wait)
    assert all(r["actor_wait_s"] >= 0 for r in h0)
    assert all(r["rollout_wait_s"] >= 0 for r in h0[1:])
    # off-policy by one step: the ratio is not 1, so some tokens are clipped at some step
    assert any(r["clip_ratio/region_mean"] > 0 for r in h0)
    _learned(h0, "disaggregated")


FAULTY = """
def picky(completions, answer, **kw):
    if "13" in answer:
        raise ValueError("no thirteens")
    return [0.0] * len(completions)
kw = dict(grpo_kw, data=rows, reward_funcs=[digits, picky])
r = nbtrain.finetune(nbtrain.GRPOConfig(**kw))
"""


@pytest.mark.parametrize("placement", ["collocated", "disaggregated"])
def test_a_raising_reward_function_is_named_and_stops_the_run(cluster, tiny, tmp_path, placement):
    extra = {"actor": "actor", "rollout": "rollout"} if placement == "disaggregated" else {}
    out = tmp_path / placement
    cluster.push({"grpo_kw": _kw(tiny, out, save_steps=1, **extra)})
    if extra:
        cluster.groups(actor="0", rollout="1")
    try:
        with pytest.raises(nbtrain.DistributedCellError) as err:
            cluster.execute(FAULTY, output="none")
    finally:
        if extra:
            cluster.clear_groups()
    text = str(err.value)
    print(text[:600])
    assert "RewardFunctionError" in text
    assert "reward function 'picky' raised ValueError: no thirteens on rank" in text
    if extra:  # named by its rank in the cluster: the rollout group's rank 0 is rank 1
        assert "no thirteens on rank 1 (" in text
    assert "RewardFunctionError: RewardFunctionError" not in text
    assert "for data row " in text  # the row: its index in the data
    # every rank raised (none is left waiting), and nothing is half-written: no adapter, no temp
    # folders, only whole checkpoints of the steps done
    assert {r for f in err.value.failures for r in f["ranks"]} == {0, 1}
    assert not (out / "adapter").exists()
    assert not list(out.glob(".tmp-*"))
    for ck in out.glob("checkpoint-*"):
        assert (ck / "trainer_state.json").is_file()


NEEDS_SOLUTION = """
def needs_solution(completions, solution, **kw):
    return [float(c.strip() == s) for c, s in zip(completions, solution)]

kw = dict(grpo_kw, data=rows, reward_funcs=[digits, needs_solution])
r = nbtrain.finetune(nbtrain.GRPOConfig(**kw))
"""


def test_bad_rewards_and_batches_are_refused_on_every_rank_before_the_model_loads(
    cluster, tiny, tmp_path, capsys
):
    """issue 34, 4 and 5: a reward function naming a column the data lacks, and (disaggregated, the
    defaults' batch) a step's completions that are not whole groups, are refused on every rank, by
    the settings and the data alone: no model loads, no step is sampled, nothing is written."""
    cluster.push({"grpo_kw": _kw(tiny, tmp_path / "columns")})
    with pytest.raises(nbtrain.DistributedCellError) as err:
        cluster.execute(NEEDS_SOLUTION, output="all", live=False)
    text = str(err.value)
    assert {r for f in err.value.failures for r in f["ranks"]} == {0, 1}
    assert (
        "reward function 'needs_solution(completions, solution, **kw)': it needs 'solution', a column the data does not have"
        in text
    )
    assert "the data's columns are 'prompt', 'answer'" in text
    assert "RewardFunctionError" not in text and "data row" not in text
    kw = _kw(tiny, tmp_path / "split", actor="actor", rollout="rollout")
    del kw["per_device_train_batch_size"]  # the default, 4
    cluster.push({"grpo_kw": kw})
    cluster.groups(actor="0", rollout="1")
    try:
        with pytest.raises(nbtrain.DistributedCellError) as err:
            cluster.execute(RUN, output="all", live=False)
    finally:
        cluster.clear_groups()
    text = str(err.value)
    assert {r for f in err.value.failures for r in f["ranks"]} == {0, 1}
    assert (
        "1 actor rank(s) x per_device_train_batch_size=4 x gradient_accumulation_steps=1 = 4, must "
        "be a multiple of num_generations=8: make per_device_train_batch_size a multiple of 8"
    ) in text
    out = capsys.readouterr()
    assert "nbtrain: loading" not in out.out + out.err
    assert not (tmp_path / "columns").exists() and not (tmp_path / "split").exists()


ACTOR_FAILS = """
from nbtrain.recipes.hooks import Hooks

hooks = Hooks()

@hooks.on_step
def boom(recipe, step, **kw):
    if step == 2:
        raise RuntimeError("the actor's own failure")

kw = dict(grpo_kw, data=rows, reward_funcs=[digits, correct])
r = nbtrain.finetune(nbtrain.GRPOConfig(**kw), hooks=hooks)
"""


def test_an_actor_failure_stops_the_rollout_too(cluster, tiny, tmp_path):
    """An error on the actor's side mid-run (a hook raising after step 2): the actor takes the
    completions the rollout was sampling, tells it no step follows, and the rollout raises too."""
    cluster.push({"grpo_kw": _kw(tiny, tmp_path / "actor", actor="actor", rollout="rollout")})
    cluster.groups(actor="0", rollout="1")
    try:
        with pytest.raises(nbtrain.DistributedCellError) as err:
            cluster.execute(ACTOR_FAILS, output="none", live=False)
    finally:
        cluster.clear_groups()
    text = str(err.value)
    assert {r for f in err.value.failures for r in f["ranks"]} == {0, 1}
    assert "the actor's own failure" in text
    assert "the actor group (rank 0 first) stopped the run" in text


DIES = """
import os
calls = {"n": 0}

def dying(completions, **kw):
    calls["n"] += 1
    if calls["n"] == 3 and rank == 1:  # the rollout rank, while the actor waits for step 3
        os._exit(3)
    return [0.0] * len(completions)
kw = dict(grpo_kw, data=rows, reward_funcs=[digits, dying])
r = nbtrain.finetune(nbtrain.GRPOConfig(**kw))
"""


def test_a_dead_rollout_rank_is_a_dead_rank(cluster, tiny, tmp_path):
    """A rollout rank that dies mid-run is named as dead; the module's cluster is then restarted
    (the dead rank replaced, the module's names set again) for the tests after this one."""
    cluster.push({"grpo_kw": _kw(tiny, tmp_path / "dead", actor="actor", rollout="rollout")})
    cluster.groups(actor="0", rollout="1")
    try:
        with pytest.raises(nbtrain.DistributedCellError) as err:
            cluster.execute(DIES, output="none", live=False)
    finally:
        cluster.restart()
        cluster.execute(SETUP, output="none")
    text = str(err.value)
    print(text[:400])
    # what the cluster says of any rank that dies in a cell: which one, how, and the actor not left
    # blocked in its collective
    assert type(err.value).__name__ == "RankDiedError"
    assert "rank 1 on" in text and "exited with code 3" in text
    assert [d.rank for d in err.value.deaths] == [1]
