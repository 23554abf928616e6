"""`%nbtrain connect`: ranks and a process group over an ipyparallel cluster nbtrain did not start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import nbtrain
from nbtrain.cluster import facade as core
from nbtrain.cluster.api import connect
from nbtrain.cluster.launch.ssh import ssh_engine_set_class
from nbtrain.errors import ClusterError

from .testbed import Testbed


def test_connect_to_a_cluster_started_with_ipyparallel(
    ip, testbed: Testbed, tmp_path: Path
) -> None:
    import ipyparallel as ipp

    a, b = testbed.nodes[0], testbed.nodes[1]
    # started as a user would with ipyparallel alone (nbtrain's parallel SSH engine set only to keep
    # the test short; the stock "ssh" launcher behaves the same, one engine at a time)
    cluster = ipp.Cluster(
        engine_launcher_class=ssh_engine_set_class(),
        controller_ip=testbed.head_address,
        profile_dir=str(tmp_path / "profile"),
        log_level=40,
    )
    launcher = cluster.config.SSHEngineSetLauncher
    launcher.engines = {a.name: 1, b.name: 1}
    launcher.ssh_args = testbed.ssh_args
    launcher.scp_args = testbed.ssh_args
    launcher.remote_python = testbed.remote_python
    cluster.start_cluster_sync(n=2)
    try:
        with pytest.raises(ClusterError, match="nbtrain-no-such-profile"):
            connect("nope", profile="nbtrain-no-such-profile")
        ip.run_line_magic("nbtrain", f"connect --file {cluster.cluster_file} --force")
        nb = core.require_cluster()
        assert sorted(r.host for r in nb.ranks) == [a.name, b.name]
        assert {r.address for r in nb.ranks} == {a.address, b.address}

        def reduce():
            import torch
            import torch.distributed as dist

            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return t.item(), socket.gethostname()

        assert [v for v, _ in nb.run(reduce)] == [3.0, 3.0]
        ip.run_line_magic("nbtrain", "stop")
        # nbtrain leaves engines it did not start running, without a process group
        rc = cluster.connect_client_sync()
        rc.wait_for_engines(2, timeout=10)
        assert rc[:].apply_sync(lambda: __import__("torch").distributed.is_initialized()) == [
            False,
            False,
        ]
        rc.close()
    finally:
        cluster.stop_cluster_sync()
    assert nbtrain.current_cluster() is None
