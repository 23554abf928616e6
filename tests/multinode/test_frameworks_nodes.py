"""Lightning's `Trainer(strategy="ddp", num_nodes=2)` on two simulated nodes (one SSH engine each),
run unchanged as torchrun would run it: each node's engine has torchrun's environment (GROUP_RANK =
its node), the ranks end with the weights a one-process replay gives, and nbtrain's group works after."""

from __future__ import annotations

import time

import pytest

from tests.test_frameworks import LIGHTNING_FIT, check_trained_together

from .testbed import Testbed, ssh_cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster11(testbed: Testbed):
    with ssh_cluster(testbed, per_node=1, timeout=90) as cluster:
        yield cluster


def _env():
    import os
    import socket

    keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE")
    keys += ("ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR")
    return {"host": socket.gethostname(), **{k: os.environ.get(k) for k in keys}}


def test_each_node_is_a_torchrun_group(testbed: Testbed, cluster11) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    got = cluster11.run(_env)
    assert [g["host"] for g in got] == [n1.name, n2.name]
    assert [(g["RANK"], g["LOCAL_RANK"], g["GROUP_RANK"]) for g in got] == [
        ("0", "0", "0"),
        ("1", "0", "1"),
    ]
    assert {(g["GROUP_WORLD_SIZE"], g["LOCAL_WORLD_SIZE"]) for g in got} == {("2", "1")}
    assert {g["TORCHELASTIC_RUN_ID"] for g in got} == {cluster11.cluster_id}
    assert {g["MASTER_ADDR"] for g in got} == {n1.address}
    # a re-created group counts as torchrun's restart, on every node, and keeps the node ranks
    count = int(got[0]["TORCHELASTIC_RESTART_COUNT"])
    cluster11.reinit_group()
    again = cluster11.run(_env)
    assert [g["GROUP_RANK"] for g in again] == ["0", "1"]
    assert {g["TORCHELASTIC_RESTART_COUNT"] for g in again} == {str(count + 1)}


def test_lightning_ddp_across_two_nodes(cluster11) -> None:
    cluster11.execute("import torch, torch.distributed as dist\ntorch.set_num_threads(1)")
    cluster11.push({"DEVICES": 1, "NODES": 2})
    t0 = time.monotonic()
    cluster11.execute(LIGHTNING_FIT, live=False)
    print(f"Lightning fit on 2 nodes: {time.monotonic() - t0:.1f} s")
    info = cluster11.pull("fit_info")
    assert [(i["world"], i["rank"], i["node"]) for i in info] == [(2, 0, 0), (2, 1, 1)]
    assert {i["env"] for i in info} == {"TorchElasticEnvironment"}
    assert all(i["group"] for i in info)  # nbtrain's group, not a new one
    check_trained_together(cluster11)

    def reduce():
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    assert cluster11.run(reduce) == [3.0, 3.0]
