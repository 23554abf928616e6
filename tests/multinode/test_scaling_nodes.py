"""`nbtrain.scaling` on 4 simulated nodes (the `testbed4` fixture grows the test bed), one engine each, over SSH and a
real gloo group: a row per size of nodes, then the bridge shaped with tbf (netem is not in this
kernel) to check the model's all-reduce time against the measured one and the verdict.

The numbers come from a small shared CPU machine, not GPUs; the report names the machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import nbtrain
from nbtrain.configs.sft import SFTConfig

from .testbed import Testbed

REPO = Path(__file__).resolve().parents[2]
DATA = str(REPO / "nbtrain" / "data" / "examples" / "instructions.jsonl")

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster4(testbed4: Testbed):
    testbed = testbed4
    if len(testbed.nodes) < 4:
        pytest.skip(
            f"needs 4 simulated nodes, the test bed has {len(testbed.nodes)}: run with NBTRAIN_TESTBED_NODES=4"
        )
    hosts = ",".join(f"{n.name}:1" for n in testbed.nodes[:4])
    cluster = nbtrain.start(
        hosts=hosts,
        force=True,
        launcher="ssh",
        ssh_args=testbed.ssh_args,
        remote_python=testbed.remote_python,
        timeout=120,
    )
    cluster.run(lambda: __import__("torch").set_num_threads(1))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A small model whose LoRA gradients (r=64 on every linear layer: about 2.2 MB) take a while
    on a shaped link but little time on an open one."""
    from nbtrain.model.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("scaling") / "model", hidden_size=256, intermediate_size=512
    )


def _cfg(model, out):
    return SFTConfig(
        model=model,
        data=DATA,
        output_dir=str(out),
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_length=48,
        lora_r=64,
        lora_alpha=64,
        lora_dropout=0.0,
        seed=3,
    )


def _shape(testbed: Testbed, rate: str | None) -> None:
    """Limit every node's bridge port (both directions of traffic into the node) to `rate`; None clears."""
    for n in testbed.nodes:
        if rate is None:
            subprocess.run(
                ["tc", "qdisc", "del", "dev", n.veth, "root"], capture_output=True, check=False
            )
        else:
            subprocess.run(
                [
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    n.veth,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "200ms",
                ],
                check=True,
            )


def test_report_on_1_2_4_nodes(cluster4, testbed4: Testbed, model, tmp_path) -> None:
    testbed = testbed4
    report = cluster4.scaling(
        _cfg(model, tmp_path / "user"),
        nodes=[1, 2, 4],
        steps=6,
        predict=[8, 16],
        out=tmp_path / "rep",
    )
    rows = report.measured
    assert [(r["nodes"], r["ranks"]) for r in rows] == [(1, 1), (2, 2), (4, 4)]
    for r in rows:
        assert r["efficiency"] == pytest.approx(
            r["tokens_per_s"] / (rows[0]["tokens_per_s"] * r["nodes"])
        )
    assert [r["predicted"] for r in report.rows] == [False, False, False, True, True]
    assert all(
        r["assumptions"].startswith("predicted: as measured at 4 nodes:") for r in report.predicted
    )
    assert report.machine.startswith("4 node(s) (" + ", ".join(n.name for n in testbed.nodes[:4]))
    assert "CPU" in report.machine
    assert not (tmp_path / "user").exists()
    print(report.markdown())


@pytest.mark.timed  # speeds compared, unshaped against shaped: a busy machine blurs them
def test_shaped_bridge_is_bandwidth_bound_and_the_model_agrees(
    cluster4, testbed4: Testbed, model, tmp_path
) -> None:
    _shape(testbed4, "200mbit")
    try:
        slow = cluster4.scaling(_cfg(model, tmp_path / "user"), nodes=[1, 2], steps=6)
    finally:
        _shape(testbed4, None)
    two = slow.measured[1]
    print(slow.markdown())
    # the gradients cross a 200 Mbit/s (25 MB/s) link: about 2.2 MB take ~90 ms
    assert two["busbw"] < 30e6
    # the all-reduces' own time in training agrees with the ring model over the probed busbw
    assert two["allreduce_s"] == pytest.approx(two["model_comm_s"], rel=0.25)
    assert 0 < two["comm_s"] <= two["allreduce_s"]
    assert slow.verdict.limit == "bandwidth-bound"
    assert any("interconnect" in a for a in slow.verdict.advice)

    fast = cluster4.scaling(_cfg(model, tmp_path / "user"), nodes=[1, 2], steps=6)
    print(fast.markdown())
    assert fast.measured[1]["busbw"] > 4 * two["busbw"]
    assert fast.verdict.limit != "bandwidth-bound"
