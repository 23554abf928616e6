"""GRPO with vLLM rollouts (issue 37) across two simulated nodes, one rank each (SSH engines, gloo over
the nodes' own addresses), in the vLLM venv only (skipped elsewhere, the reason printed): collocated
(a vLLM engine beside each node's rank) and disaggregated (the actor on node 1, the rollout and its
engine on node 2; the adapter crosses between the nodes after each step). Both learn the task of
tests/recipes/grpo/test_grpo_vllm.py, with its settings; each node's engine is a process on that node,
started once for the module."""

from __future__ import annotations

import importlib.util

import pytest

from .testbed import Testbed, ssh_cluster

if importlib.util.find_spec("vllm") is None:
    REASON = "vLLM is not installed in this environment: run in the vLLM venv (make venv-vllm)"
    print(f"test_grpo_vllm_nodes skipped: {REASON}")
    pytest.skip(REASON, allow_module_level=True)

pytestmark = pytest.mark.timeout(900)

RUN = """
import os, socket
import torch
import nbtrain
from nbtrain.generation import vllm_engine

torch.set_num_threads(1)

def digits(completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(len(c.replace(" ", "")), 1) for c in completions]

rows = [{"prompt": f"What is {a} plus {b}?\\nAnswer: ", "answer": str(a + b)}
        for a in range(10) for b in range(10)]
results = {}
for name, extra in PLACEMENTS.items():
    r = nbtrain.finetune(nbtrain.GRPOConfig(
        model=MODEL, data=rows, reward_funcs=[digits], num_generations=8, max_completion_length=6,
        per_device_train_batch_size=16, output_dir=os.path.join(OUT, name), max_steps=20,
        lr_scheduler_type="constant", logging_steps=1, save_steps=None, lora_dropout=0.0,
        data_cache="off", overwrite=True, seed=3, engine="vllm", **extra,
    ))
    eng = vllm_engine.current()
    results[name] = {
        "rewards": [float(x) for x in r.history["reward"]],
        "state": r.state,
        "host": socket.gethostname(),
        "engine_pid": getattr(eng, "pid", None),
    }
"""

PLACEMENTS = {
    "collocated": {"learning_rate": 2e-2},
    "disaggregated": {"actor": "actor", "rollout": "rollout", "learning_rate": 1e-2},
}


@pytest.fixture(scope="module")
def results(testbed: Testbed, tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny64") / "model", num_heads=1)
    out = tmp_path_factory.mktemp("grpo-vllm-nodes")
    with ssh_cluster(testbed, per_node=1) as cluster:
        cluster.groups(actor="0", rollout="1")
        cluster.push({"MODEL": model, "OUT": str(out), "PLACEMENTS": PLACEMENTS})
        cluster.execute(RUN, live=False)
        yield cluster.pull("results")


def test_grpo_with_vllm_learns_across_two_nodes(testbed: Testbed, results) -> None:
    n1, n2 = testbed.nodes[0].name, testbed.nodes[1].name
    assert [r["collocated"]["host"] for r in results] == [n1, n2]
    for name in PLACEMENTS:
        a, b = results[0][name], results[1][name]
        assert a["state"] == b["state"] == "done", name
        assert a["rewards"] == b["rewards"], name
        start, last = a["rewards"][0], sum(a["rewards"][-3:]) / 3
        print(f"{name} on 2 nodes, vLLM: reward {start:.2f} at step 1 -> {last:.2f} (steps 18-20)")
        assert start < 0.1 and last > start + 0.4, (name, a["rewards"])
    # each node's rank sampled through its own engine (node 2's kept for the disaggregated run)
    assert results[0]["collocated"]["engine_pid"] and results[1]["collocated"]["engine_pid"]
    assert results[1]["disaggregated"]["engine_pid"] == results[1]["collocated"]["engine_pid"]
