"""GRPO across two simulated nodes, one rank each (SSH engines, gloo over the nodes' own addresses):
collocated, and disaggregated with the actor on one node and the rollout on the other (the completions
and the adapter cross between the nodes). A few steps of the tiny model: the runs finish on both nodes
with the same history, and the adapter is exported by rank 0."""

from __future__ import annotations

import pytest

from .testbed import Testbed, ssh_cluster

pytestmark = pytest.mark.timeout(600)

RUN = """
import os, socket
import torch
import nbtrain

torch.set_num_threads(1)

def digits(completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(len(c.replace(" ", "")), 1) for c in completions]

rows = [{"prompt": f"What is {a} plus {b}?\\nAnswer: ", "answer": str(a + b)}
        for a in range(10) for b in range(10)]
results = {}
for name, extra in PLACEMENTS.items():
    r = nbtrain.finetune(nbtrain.GRPOConfig(
        model=MODEL, data=rows, reward_funcs=[digits], num_generations=4, max_completion_length=6,
        per_device_train_batch_size=8 if extra else 4, output_dir=os.path.join(OUT, name),
        max_steps=4, learning_rate=2e-2, logging_steps=1, save_steps=None, lora_dropout=0.0,
        data_cache="off", overwrite=True, **extra,
    ))
    results[name] = {
        "steps": [int(s) for s in r.history["step"]],
        "rewards": [float(x) for x in r.history["reward"]],
        "adapter": r.adapter_dir,
        "state": r.state,
        "host": socket.gethostname(),
    }
"""

PLACEMENTS = {"collocated": {}, "disaggregated": {"actor": "actor", "rollout": "rollout"}}


@pytest.fixture(scope="module")
def results(testbed: Testbed, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-nodes")
    with ssh_cluster(testbed, per_node=1) as cluster:
        cluster.groups(actor="0", rollout="1")
        cluster.push({"MODEL": tiny, "OUT": str(out), "PLACEMENTS": PLACEMENTS})
        cluster.execute(RUN, live=False)
        yield cluster.pull("results")


def test_grpo_runs_across_two_nodes(testbed: Testbed, results) -> None:
    n1, n2 = testbed.nodes[0].name, testbed.nodes[1].name
    assert [r["collocated"]["host"] for r in results] == [n1, n2]
    for name in PLACEMENTS:
        a, b = results[0][name], results[1][name]
        assert a["steps"] == b["steps"] == [1, 2, 3, 4], name
        assert a["rewards"] == b["rewards"], name
        assert a["state"] == b["state"] == "done", name
        assert a["adapter"] is not None and a["adapter"].endswith(f"{name}/adapter")
        assert b["adapter"] is None
