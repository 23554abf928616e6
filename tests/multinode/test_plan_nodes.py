"""The backend and device plan across simulated nodes: one decision for every rank, made on the client.

A 1+2 layout (nbt-node1: 1 engine, nbt-node2: 2) where every node reports 1 GPU (injected per node
with NBTRAIN_TEST_GPU_COUNT in `host_env`): node 2 is short of a GPU, so every rank, node 1's too,
runs gloo on CPU and the start says why; asking for NCCL is refused before any engine starts.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

import nbtrain
from nbtrain.errors import ConfigError
from tests.conftest import cluster_processes

from .testbed import Testbed

pytestmark = pytest.mark.timeout(240)


def _kw(testbed: Testbed, gpus: dict[str, int]) -> dict:
    env: dict[str, dict[str, str]] = {}
    for host, count in gpus.items():
        env[host] = {"NBTRAIN_TEST_GPU_COUNT": str(count)}
        if os.environ.get("PYTHONPATH"):
            # a checkout run without installing it (a worktree): its nbtrain on the nodes too
            env[host]["PYTHONPATH"] = os.environ["PYTHONPATH"]
    python = testbed.remote_python if Path(testbed.remote_python).exists() else sys.executable
    return dict(
        launcher="ssh",
        ssh_args=testbed.ssh_args,
        remote_python=python,
        timeout=90,
        host_env=env,
    )


def _view():
    import os

    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return (
        str(dist.get_backend()),
        str(get_ipython().user_ns["device"]),
        os.environ["NBTRAIN_DEVICE"],
        t.item(),
    )


def test_a_short_node_puts_every_rank_on_gloo_cpu_and_says_why(testbed: Testbed, capsys) -> None:
    n1, n2 = testbed.nodes[0].name, testbed.nodes[1].name
    t0 = time.monotonic()
    cluster = nbtrain.start(
        hosts=f"{n1}:1,{n2}:2", force=True, quiet=False, **_kw(testbed, {n1: 1, n2: 1})
    )
    took = time.monotonic() - t0
    try:
        out = capsys.readouterr().out
        assert [(r.host, r.local_rank, r.gpus) for r in cluster.ranks] == [
            (n1, 0, 1),
            (n2, 0, 1),
            (n2, 1, 1),
        ]
        assert (
            f"nbtrain: 2 ranks on {n2} but 1 GPU: using gloo on CPU for every rank; use --hosts "
            f"{n1}:1,{n2}:1 to train on the GPUs (one rank per GPU)." in out
        )
        assert out.count("using gloo on CPU") == 1
        assert cluster.backend == "gloo"
        assert [r.device for r in cluster.ranks] == ["cpu"] * 3
        assert cluster.run(_view, timeout=60) == [("gloo", "cpu", "cpu", 3.0)] * 3
        assert took < 60, f"start took {took:.1f} s"
    finally:
        cluster.stop()


def test_nccl_with_a_short_node_is_refused_before_engines_start(testbed: Testbed) -> None:
    n1, n2 = testbed.nodes[0].name, testbed.nodes[1].name
    before = {p.pid for p in cluster_processes()}
    with pytest.raises(ConfigError) as e:
        nbtrain.start(
            hosts=f"{n1}:1,{n2}:2", backend="nccl", force=True, **_kw(testbed, {n1: 1, n2: 1})
        )
    msg = str(e.value)
    assert f"rank 2 on {n2} (local rank 1) has none: {n2} has 1 GPU for 2 ranks" in msg
    assert f"Use --hosts {n1}:1,{n2}:1 (one rank per GPU), or --backend gloo (or auto)." in msg
    assert {p.pid for p in cluster_processes()} - before == set()
