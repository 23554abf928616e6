"""shard="hsdp" across two simulated nodes of two ranks each: a (2, 2) mesh, replicated across the
nodes and sharded inside each, on SSH engines and gloo over the nodes' own addresses. The run equals
the same run under DDP, each rank holds half of the base, and QLoRA (bitsandbytes' CPU kernels)
shards the same way and equals QLoRA under DDP."""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.test_distributed import DATA

from .testbed import Testbed, ssh_cluster

pytestmark = pytest.mark.timeout(600)

SETUPS = {
    "ddp": {"shard": "ddp"},
    "hsdp": {"shard": "hsdp"},
    "qlora-ddp": {"shard": "ddp", "load_in_4bit": True},
    "qlora-hsdp": {"shard": "hsdp", "load_in_4bit": True},
}

RUN = """
import os, socket
import torch
import nbtrain

torch.set_num_threads(1)
results = {}
for name, setup in SETUPS.items():
    res = nbtrain.finetune(nbtrain.SFTConfig(
        model=MODEL, data=DATA, output_dir=os.path.join(OUT, name), max_steps=3,
        per_device_train_batch_size=2, learning_rate=1e-2, max_length=48, logging_steps=1,
        save_steps=None, lora_r=8, lora_dropout=0.0, overwrite=True, **setup,
    ))
    results[name] = {
        "losses": [float(x) for x in res.history["loss"]],
        "held": res.plan["base_params_held"],
        "adapter": res.adapter_dir,
        "host": socket.gethostname(),
    }
"""


@pytest.fixture(scope="module")
def results(testbed: Testbed, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("shard-nodes")
    with ssh_cluster(testbed, per_node=2) as cluster:
        cluster.push({"MODEL": tiny, "DATA": DATA, "OUT": str(out), "SETUPS": SETUPS})
        cluster.execute(RUN, live=False)
        yield cluster.pull("results")


def test_ranks_are_two_nodes_of_two(testbed: Testbed, results) -> None:
    n1, n2 = testbed.nodes[0].name, testbed.nodes[1].name
    assert [r["hsdp"]["host"] for r in results] == [n1, n1, n2, n2]
    assert n1 != socket.gethostname()


@pytest.mark.parametrize(("sharded", "whole"), [("hsdp", "ddp"), ("qlora-hsdp", "qlora-ddp")])
def test_hsdp_across_nodes_equals_ddp(results, sharded, whole) -> None:
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r[sharded]["losses"]), torch.tensor(r[whole]["losses"])
        )
        # sharded over the 2 ranks of a node, replicated across the nodes
        held, total = r[sharded]["held"]
        assert abs(held - total / 2) <= 0.01 * total
        assert r[whole]["held"][0] == r[whole]["held"][1]
    a = load_file(f"{results[0][sharded]['adapter']}/adapter_model.safetensors")
    b = load_file(f"{results[0][whole]['adapter']}/adapter_model.safetensors")
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    assert all(r[sharded]["adapter"] is None for r in results[1:])
