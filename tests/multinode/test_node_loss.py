"""Node loss on simulated nodes: a cell fails within 15 s naming the lost rank and node, survivors stop.

Two shapes: the engine and its nanny are killed on the node (the node still answers), and the node's
cable is pulled (`testbed.cut`: packets are dropped, no RST; only the hub's heartbeat can tell).
"""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

import nbtrain
from nbtrain.errors import ClusterError, RankDiedError

from .testbed import Testbed

pytestmark = pytest.mark.timeout(300)

LOOP = (
    "import torch, torch.distributed as dist, time\n"
    "t = torch.ones(1)\n"
    "for _ in range(100000):\n"
    "    dist.all_reduce(t); t.fill_(1); time.sleep(0.01)\n"
)


def _start(testbed: Testbed):
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    return nbtrain.start(
        launcher="ssh",
        hosts=f"{n1.name}:1,{n2.name}:1",
        ssh_args=testbed.ssh_args,
        remote_python=testbed.remote_python,
        timeout=90,
        force=True,
    )


def _engine_pids_on(testbed: Testbed, node) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", node.netns], capture_output=True, text=True, check=True
    ).stdout
    return sorted({int(p) for p in out.split()} - {testbed._sshd_pid(node)})


def _fail_after(cluster, fault, after: float = 2.0):
    fired = {}

    def fire():
        fired["t"] = time.monotonic()
        fault()

    threading.Timer(after, fire).start()
    with pytest.raises(RankDiedError) as info:
        cluster.execute(LOOP, live=False)
    return info.value, time.monotonic() - fired["t"]


def test_engine_and_nanny_killed_on_a_node(testbed: Testbed) -> None:
    n2 = testbed.nodes[1]
    cluster = _start(testbed)
    try:

        def kill_node_processes():
            for pid in _engine_pids_on(testbed, n2):
                subprocess.run(["kill", "-9", str(pid)], check=False)

        err, took = _fail_after(cluster, kill_node_processes)
        text = str(err)
        print(f"engine+nanny killed on {n2.name}: cell failed {took:.1f} s later\n{text}")
        assert took < 15.0
        assert f"rank 1 on {n2.name}" in text
        assert "still answers on the network" in text  # sshd on the node is alive
        assert "rank 0 on" in text  # the survivor was stopped, not left in its all_reduce
        with pytest.raises(ClusterError, match="%nbtrain restart"):
            cluster.execute("print(1)", live=False)
    finally:
        cluster.stop()


def test_network_cut_to_a_node(testbed: Testbed) -> None:
    n2 = testbed.nodes[1]
    cluster = _start(testbed)
    try:
        err, took = _fail_after(cluster, lambda: testbed.cut(n2))
        text = str(err)
        print(f"network to {n2.name} cut: cell failed {took:.1f} s later\n{text}")
        assert took < 15.0
        assert f"rank 1 on {n2.name}" in text and "does not answer on the network" in text
        assert "rank 0 on" in text
    finally:
        testbed.restore(n2)
        cluster.stop()
