"""GRPO with its rollouts sampled through vLLM (issue 37), on a real 2-rank local cluster (gloo, CPU),
in the vLLM environment only (`make venv-vllm`; skipped elsewhere, the reason printed).

One vLLM engine a rank for the whole module: the collocated run starts one beside each rank (70-90 s
each on this machine), and the disaggregated run after it finds rank 1's already there (the same base
and LoRA shape) and samples with it, so the module pays for engine starts once.

- collocated (`engine="vllm"`): both ranks sample their share through their own vLLM, given the
  adapter in memory before each step's sampling; the reward rises. After the last optimizer step a hook
  samples through the same engine with log-probabilities and compares them with the training model's
  on the same tokens (the same adapter): what GRPO's importance ratio relies on.
- disaggregated (`engine="vllm", actor=, rollout=`): rank 1 samples through vLLM with the adapter
  rank 0 broadcast after each step; the reward rises (at learning rate 1e-2: see the test).

- an engine whose process died between runs is started again by the next run;
- `generate(engine="vllm")` after GRPO takes the engine GRPO kept: one vLLM worker process a rank;
- an engine that cannot start (a model vLLM refuses) is an error named on every rank, and the cluster
  stays usable with no vLLM process left (the module's last test).

On the 2-core machine: 4 passed in 45 s at a load of 2-4, the first three 103 s at a load of ~10
(the first run's two engine starts included).

The task is tests/recipes/grpo/test_distributed.py's (the arithmetic prompts, a digits reward, 6 new
tokens, 8 completions per prompt), on the tiny Llama with one attention head of 64 (vLLM's CPU
attention refuses the default's head_dim 16). Simulated nodes (tests/multinode) are not covered here.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

import nbtrain

if importlib.util.find_spec("vllm") is None:
    REASON = (
        "vLLM is not installed in this environment: these tests run in the vLLM venv "
        "(make venv-vllm; .venv-vllm/bin/python -m pytest tests/recipes/grpo/test_grpo_vllm.py)"
    )
    print(f"test_grpo_vllm skipped: {REASON}")
    pytest.skip(REASON, allow_module_level=True)

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]

STEPS = 20

SETUP = """
import nbtrain, torch
torch.set_num_threads(1)

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

# after the last optimizer step: vLLM's log-probabilities of completions it samples with the current
# adapter, against the training model's on the same tokens
COMPARE = """
from nbtrain.recipes.hooks import Hooks

hooks = Hooks()
check = {}

@hooks.on_step
def compare(recipe, step, **kw):
    # on a rank that samples through vLLM (not a disaggregated run's actor)
    if step != last_step or getattr(recipe.decoding, "engine", None) is None:
        return
    from nbtrain.generation import decode
    from nbtrain.losses import grpo as grpo_loss
    from nbtrain.recipes.grpo import rollout as grpo_rollout

    eng = recipe.decoding.engine
    eng.set_adapter(recipe.peft_model)
    prompts = [decode.Prompt(i, None, recipe.rows.ids[i]) for i in range(16)]
    out = eng.generate(prompts, decode.Decoding(max_new_tokens=6, do_sample=True, seed=7),
                       logprobs=True)
    batch = grpo_rollout.collate([p.ids for p in prompts], [c.ids for c in out], [0.0] * 16,
                                 [False] * 16, recipe.tokenizer.pad_token_id, False)
    recipe.peft_model.eval()
    with torch.no_grad():
        lp = grpo_loss.token_logps(recipe.peft_model, batch, recipe.autocast, 1.0)
    recipe.peft_model.train()
    diffs = [abs(a - b) for i, c in enumerate(out)
             for a, b in zip(c.logprobs, lp[i, :len(c.ids)].tolist(), strict=True)]
    # the base alone (no adapter) on the same tokens: the adapter must matter by more than the gap
    with torch.no_grad(), recipe.peft_model.disable_adapter():
        base = grpo_loss.token_logps(recipe.peft_model, batch, recipe.autocast, 1.0)
    moved = [abs(a - b) for i, c in enumerate(out)
             for a, b in zip(c.logprobs, base[i, :len(c.ids)].tolist(), strict=True)]
    check.update(engine=eng.name, tokens=len(diffs), max_diff=max(diffs),
                 mean_diff=sum(diffs) / len(diffs), base_mean_diff=sum(moved) / len(moved))
"""

RUN = """
kw = dict(grpo_kw, data=rows, reward_funcs=[digits, correct])
_t0 = time.perf_counter()
r = nbtrain.finetune(nbtrain.GRPOConfig(**kw), hooks=hooks)
res = {"history": r.history.to_dict(orient="records"), "state": r.state,
       "seconds": time.perf_counter() - _t0, "check": dict(check)}
"""


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """The default tiny Llama (hidden 64) with one head of 64, which vLLM's CPU attention takes (it
    refuses the default's 16). Wider models (hidden 128, 2 heads) learned this task unreliably with
    either engine: collocated hf rose to 0.42 and fell back, disaggregated stayed under 0.15."""
    from nbtrain.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny64") / "model", num_heads=1)


@pytest.fixture(scope="module")
def cluster():
    c = nbtrain.start(n=2, force=True)
    try:
        c.execute(SETUP + "\nimport time\n" + COMPARE, output="none")
        yield c
    finally:
        c.stop()


def _kw(model, out, **kw):
    return {
        "model": model,
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
        "engine": "vllm",
        **kw,
    }


def _run(cluster, kw):
    cluster.push({"grpo_kw": kw, "res": None, "last_step": STEPS, "check": {}})
    cluster.execute("check.clear()\n" + RUN, output="none")
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


def _engine_pids(cluster):
    """Each rank's kept vLLM engine's process id (None where it has none), and whether it is alive."""
    code = (
        "import psutil\nfrom nbtrain.generation import vllm_engine as _ve\n"
        "_pid = getattr(_ve.current(), 'pid', None)\n"
        "_eng = (_pid, _pid is not None and psutil.pid_exists(_pid))"
    )
    cluster.execute(code, output="none")
    return cluster.pull("_eng")


def test_collocated_with_vllm_learns_and_its_logprobs_match_training(cluster, tiny64, tmp_path):
    t0 = time.perf_counter()
    got = _run(cluster, _kw(tiny64, tmp_path / "col"))
    print(f"collocated run with two vLLM engine starts: {time.perf_counter() - t0:.0f} s")
    h0, h1 = got[0]["history"], got[1]["history"]
    assert got[0]["state"] == "done"
    assert [r["step"] for r in h0] == list(range(1, STEPS + 1))
    assert [r["reward"] for r in h0] == [r["reward"] for r in h1]
    assert all(r["gen_s"] > 0 for r in h0)
    # every rank sampled through its own vLLM, a process of its own
    pids = _engine_pids(cluster)
    assert all(alive for _, alive in pids) and pids[0][0] != pids[1][0], pids
    for rank in (0, 1):
        c = got[rank]["check"]
        print(
            f"rank {rank}: after {STEPS} steps, vLLM vs training log-probabilities over {c['tokens']} "
            f"tokens: max |diff| {c['max_diff']:.2e}, mean {c['mean_diff']:.2e}; vLLM vs the base "
            f"alone: mean {c['base_mean_diff']:.2e}"
        )
        assert c["engine"] == "vllm" and c["tokens"] > 0
        # fp32 on both sides, different kernels: equal within 1e-3 per token; the adapter moved the
        # log-probabilities far more than that, so vLLM samples with the trained adapter, not the base
        assert c["max_diff"] < 1e-3, c
        assert c["base_mean_diff"] > 50 * c["mean_diff"], c
    _learned(h0, "collocated, vLLM")


def test_disaggregated_with_vllm_learns(cluster, tiny64, tmp_path):
    before = _engine_pids(cluster)
    cluster.groups(actor="0", rollout="1")
    try:
        t0 = time.perf_counter()
        # learning rate 1e-2, not 2e-2: at 2e-2 (seed 3) this run rose to 0.59 at step 9 and fell
        # back to 0.04 with a quarter to a half of the tokens clipped (the step of lag at a large
        # step size), while vLLM's samples matched the rollout model's log-probabilities within
        # 3e-6 at every step (checked by hand): the dynamics, not the engine
        kw = _kw(tiny64, tmp_path / "dis", actor="actor", rollout="rollout", learning_rate=1e-2)
        got = _run(cluster, kw)
        took = time.perf_counter() - t0
    finally:
        cluster.clear_groups()
    print(f"disaggregated run, rank 1's vLLM kept from the collocated run: {took:.0f} s")
    h0, h1 = got[0]["history"], got[1]["history"]
    assert got[0]["state"] == got[1]["state"] == "done"
    assert [r["step"] for r in h0] == list(range(1, STEPS + 1))
    assert [(r["step"], r["reward"]) for r in h1] == [(r["step"], r["reward"]) for r in h0]
    # the rollout rank's engine is the one the collocated run started, not a second start
    assert before[1][1] and _engine_pids(cluster)[1] == before[1]
    _learned(h0, "disaggregated, vLLM")


def test_an_engine_that_died_between_runs_is_started_again(cluster, tiny64, tmp_path):
    """Rank 1's kept engine killed after the runs above: the next run starts a new one there (rank 0
    keeps its own) and finishes."""
    import os
    import signal

    before = _engine_pids(cluster)
    assert all(alive for _, alive in before), before
    os.kill(before[1][0], signal.SIGKILL)
    # gone, not still tearing down (a run started at once can find it half dead: then the run fails
    # with the engine's EngineError, 'died during lora', naming rank 1)
    cluster.execute("_ve.current().proc.wait(30)", ranks=[1], output="none")
    got = _run(cluster, _kw(tiny64, tmp_path / "again", max_steps=3))
    after = _engine_pids(cluster)
    assert got[0]["state"] == "done" and len(got[0]["history"]) == 3
    assert after[0] == before[0]
    assert after[1][1] and after[1][0] != before[1][0], (before, after)


def _vllm_workers(cluster):
    """Each rank's vLLM worker processes, counted among the rank's child processes."""
    code = (
        "import psutil\n"
        "def _workers():\n"
        "    out = []\n"
        "    for p in psutil.Process().children(recursive=True):\n"
        "        try:\n"
        "            if 'nbtrain.generation.vllm_worker' in ' '.join(p.cmdline()):\n"
        "                out.append(p.pid)\n"
        "        except psutil.Error:\n"
        "            pass\n"
        "    return sorted(out)\n"
        "_w = _workers()"
    )
    cluster.execute(code, output="none")
    return cluster.pull("_w")


def test_generate_after_grpo_takes_the_ranks_one_vllm_engine(cluster, tiny64):
    """After the GRPO runs above, `generate(engine="vllm")` on the same base reuses each rank's kept
    engine (`vllm_engine.kept`, which GRPO's rollouts also use): one vLLM worker process a rank, not a
    rollout engine and a second one for generate (twice the memory on a GPU), and no engine start."""
    before = _engine_pids(cluster)
    assert all(alive for _, alive in before), before
    cluster.push({"M": str(tiny64)})
    t0 = time.perf_counter()
    cluster.execute(
        "g = nbtrain.generate(['What is 2 plus 3?\\nAnswer: '], model=M, max_new_tokens=4, "
        "engine='vllm')",
        output="none",
    )
    took = time.perf_counter() - t0
    print(f"generate through the engines GRPO kept: {took:.1f} s")
    assert len(cluster.pull("g", ranks=0)[0]) == 1
    assert _engine_pids(cluster) == before
    assert _vllm_workers(cluster) == [[before[0][0]], [before[1][0]]]


def test_an_engine_that_cannot_start_is_named_on_every_rank_and_the_cluster_stays(
    cluster, tiny, tmp_path
):
    """The last test of the module (it ends the engines the others kept): the default tiny model, whose
    head_dim 16 vLLM's CPU attention refuses, fails the engine's start on both ranks at the end of
    set-up; every rank raises the engine's error with its rank, host and log, none hangs, no step is
    sampled, and the cluster runs the next cell with no vLLM process left."""
    cluster.push({"grpo_kw": _kw(tiny, tmp_path / "bad"), "last_step": STEPS, "check": {}})
    with pytest.raises(nbtrain.DistributedCellError) as err:
        cluster.execute(RUN, output="none", live=False)
    text = str(err.value)
    print(text[:800])
    assert {r for f in err.value.failures for r in f["ranks"]} == {0, 1}
    assert "vLLM engine on rank" in text and "failed to start" in text
    assert "head_dim" in text  # the cause, from the engine's log
    assert not (tmp_path / "bad" / "adapter").exists()
    assert [pid for pid, _ in _engine_pids(cluster)] == [None, None]
