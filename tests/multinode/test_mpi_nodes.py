"""`--launcher mpi --hosts` across simulated nodes: one real Open MPI mpiexec starts its daemons on
the nodes over the test bed's SSH, a gloo all_reduce crosses the nodes, and stop leaves nothing on
either node or here. With `--map-by node` MPI numbers round robin; nbtrain's ranks stay node-major."""

from __future__ import annotations

import shutil
import subprocess
import time

import psutil
import pytest

from nbtrain.cluster import facade as core
from nbtrain.cluster.launch import mpi

from .testbed import Testbed

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        shutil.which("mpiexec") is None, reason="no mpiexec (apt install openmpi-bin)"
    ),
]


@pytest.fixture
def openmpi(monkeypatch):
    if mpi.flavour() != "openmpi":
        pytest.skip("the multi-host arguments here are Open MPI's")
    # the test bed logs in as root; Open MPI refuses root unless told, here and on the nodes (-x)
    for name in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        monkeypatch.setenv(name, "1")


def _mpi_args(testbed: Testbed, *extra: str) -> str:
    return (
        f"--mca plm_rsh_args '-F {testbed.ssh_config}' --mca btl self,tcp "
        "-x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM " + " ".join(extra)
    )


def _on_nodes(testbed: Testbed) -> dict[str, set[int]]:
    out = {}
    for node in testbed.nodes:
        text = subprocess.run(
            ["ip", "netns", "pids", node.netns], capture_output=True, text=True, check=True
        ).stdout
        pids = {int(p) for p in text.split()} - {testbed._sshd_pid(node)}
        alive = set()
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
            except psutil.Error:
                pass
        out[node.name] = alive
    return out


def _assert_nothing_left(
    testbed: Testbed, before: set[int], on_nodes: dict[str, set[int]], timeout: float = 15
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = {k: v - on_nodes[k] for k, v in _on_nodes(testbed).items()}
        here = set()
        for pid in {p.pid for p in psutil.Process().children(recursive=True)} - before:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    here.add(pid)
            except psutil.Error:
                pass
        if not any(left.values()) and not here:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left running: nodes {left}, here {here}")
        time.sleep(0.2)


def test_mpi_across_nodes_ranks_node_major_all_reduce_and_stop(
    ip, testbed: Testbed, openmpi, capsys
):
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    # what runs on the nodes besides sshd before the start (a login of the test bed's own, if any)
    on_nodes = _on_nodes(testbed)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    ip.run_line_magic(
        "nbtrain",
        f"start --launcher mpi --hosts {n1.name}:2,{n2.name}:1 --timeout 90 "
        f'--mpi-args "{_mpi_args(testbed, "--map-by node")}"',
    )
    started = time.monotonic() - t0
    out = capsys.readouterr().out
    cluster = core.require_cluster()
    assert f"starting 3 engine(s) with mpiexec (openmpi): 2 on {n1.name}, 1 on {n2.name}" in out
    # the controller listens where the nodes reach it, not on loopback
    assert cluster.listen is not None and not cluster.listen.address.startswith("127.")
    assert [r.host for r in cluster.ranks] == [n1.name, n1.name, n2.name]
    assert [r.local_rank for r in cluster.ranks] == [0, 1, 0]
    assert {r.host: r.address for r in cluster.ranks} == {n1.name: n1.address, n2.name: n2.address}

    def who():
        import os

        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        e = os.environ
        return t.item(), e["RANK"], e["LOCAL_RANK"], e["OMPI_COMM_WORLD_RANK"], e["MASTER_ADDR"]

    results = cluster.run(who)
    assert [r[0] for r in results] == [6.0, 6.0, 6.0]  # 1 + 2 + 3, across the nodes
    # --map-by node: MPI puts ranks 0 and 2 on node 1, 1 on node 2; nbtrain's RANK is node-major
    assert [r[1:4] for r in results] == [("0", "0", "0"), ("1", "1", "2"), ("2", "0", "1")]
    assert {r[4] for r in results} == {n1.address}
    t1 = time.monotonic()
    ip.run_line_magic("nbtrain", "stop")
    print(f"mpi on 2 nodes: start {started:.1f} s, stop {time.monotonic() - t1:.1f} s")
    _assert_nothing_left(testbed, before, on_nodes)
