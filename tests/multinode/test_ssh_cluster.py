"""`%nbtrain start --launcher ssh` on simulated nodes: real engines over real SSH, a real gloo group.

One 1+2 cluster (nbt-node1: 1 engine, nbt-node2: 2) serves the tests that need a running cluster;
the bad-input tests each start (and must fully stop) their own. The last test compares a 2-node
finetune with the same run on local engines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import nbtrain
from nbtrain.cluster import facade as core
from nbtrain.cluster.launch.preflight import VersionMismatchError
from nbtrain.errors import ClusterError, ConfigError
from tests.conftest import cluster_processes

from .testbed import Testbed

LOCAL_IPP = "ipyparallel"


def _ssh_kw(testbed: Testbed, **kw):
    return dict(
        launcher="ssh",
        ssh_args=testbed.ssh_args,
        remote_python=testbed.remote_python,
        timeout=90,
        **kw,
    )


def _local_ipp_pids() -> set[int]:
    """ipyparallel processes running here, orphans included (a controller's schedulers outlive it
    when it is killed: they are no longer this session's children, so scan every process)."""
    return {p.pid for p in cluster_processes() if LOCAL_IPP in " ".join(p.cmdline())}


def _node_pids(testbed: Testbed, node) -> set[int]:
    """Processes inside a node other than its sshd daemon."""
    out = subprocess.run(
        ["ip", "netns", "pids", node.netns], capture_output=True, text=True, check=True
    ).stdout
    return {int(p) for p in out.split()} - {testbed._sshd_pid(node)}


def _assert_nothing_left(testbed: Testbed, local_before: set[int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = {n.name: _node_pids(testbed, n) for n in testbed.nodes}
        local = _local_ipp_pids() - local_before
        if not any(left.values()) and not local:
            return
        if time.monotonic() > deadline:
            cmds = {}
            for pids in left.values():
                for pid in pids:
                    try:
                        cmds[pid] = " ".join(psutil.Process(pid).cmdline())[:120]
                    except psutil.Error:
                        pass
            raise AssertionError(f"left running: nodes {left}, local {local}, {cmds}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster12(testbed: Testbed):
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    t0 = time.monotonic()
    cluster = nbtrain.start(hosts=f"{n1.name}:1,{n2.name}:2", force=True, **_ssh_kw(testbed))
    cluster.start_seconds = time.monotonic() - t0
    yield cluster
    cluster.stop()
    _assert_nothing_left(testbed, before)


def test_ranks_are_node_major_with_their_own_hosts_addresses_and_interface(
    testbed: Testbed, cluster12
) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    assert [r.host for r in cluster12.ranks] == [n1.name, n2.name, n2.name]
    assert [r.local_rank for r in cluster12.ranks] == [0, 0, 1]
    assert [r.local_world_size for r in cluster12.ranks] == [1, 2, 2]
    assert [r.address for r in cluster12.ranks] == [n1.address, n2.address, n2.address]
    assert [r.interface for r in cluster12.ranks] == [n1.iface, n2.iface, n2.iface]
    # the controller listens on the bridge address the nodes reach, never loopback
    assert cluster12.listen.address == testbed.head_address
    assert any(testbed.head_address in note for note in cluster12.notes)

    def env():
        import os
        import socket

        keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR")
        keys += ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        with open("/proc/self/cmdline") as f:
            argv = f.read().split("\0")
        return {
            "host": socket.gethostname(),
            "entry": argv[argv.index("-m") + 1] if "-m" in argv else argv,
            **{k: os.environ[k] for k in keys},
        }

    got = cluster12.run(env)
    # the SSH engines run nbtrain's entry point, not ipyparallel's bare engine
    assert {g["entry"] for g in got} == {"nbtrain.engine.boot"}
    assert [g["host"] for g in got] == [n1.name, n2.name, n2.name]
    assert [g["RANK"] for g in got] == ["0", "1", "2"]
    assert [g["LOCAL_RANK"] for g in got] == ["0", "0", "1"]
    assert {g["WORLD_SIZE"] for g in got} == {"3"}
    assert {g["MASTER_ADDR"] for g in got} == {n1.address}
    assert {g["GLOO_SOCKET_IFNAME"] for g in got} == {"eth0"}
    assert {g["NCCL_SOCKET_IFNAME"] for g in got} == {"eth0"}
    table = cluster12.table()
    assert "interface" in table.splitlines()[0]
    assert n2.address in table


def test_all_reduce_gives_the_sum_over_nodes(cluster12) -> None:
    def reduce():
        import torch
        import torch.distributed as dist

        t = torch.arange(1000, dtype=torch.float64) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t

    for t in cluster12.run(reduce):
        torch.testing.assert_close(t, torch.arange(1000, dtype=torch.float64) * 6)


def _veth_bytes(veth: str) -> tuple[int, int]:
    stats = Path(f"/sys/class/net/{veth}/statistics")
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


CONNECTIONS = """
import json, sys, psutil
def ip(a):
    # the rendezvous store listens dual-stack: IPv4 peers show as ::ffff:a.b.c.d
    return a.ip.removeprefix("::ffff:")
owner = {(ip(c.laddr), c.laddr.port): c.pid for c in psutil.net_connections(kind="tcp") if c.pid}
out = []
for pid in json.loads(sys.argv[1]):
    family = {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED:
            peer = owner.get((ip(c.raddr), c.raddr.port))
            out.append([pid, ip(c.laddr), ip(c.raddr), peer in family])
print(json.dumps(out))
"""


def test_gloo_traffic_uses_the_node_interface_not_lo(testbed: Testbed, cluster12) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    nbytes = 8 * 2**20

    def big():
        import torch
        import torch.distributed as dist

        t = torch.ones(8 * 2**20 // 4)
        dist.all_reduce(t)
        return float(t[0])

    rx0, tx0 = _veth_bytes(n1.veth)
    assert cluster12.run(big) == [3.0, 3.0, 3.0]
    rx1, tx1 = _veth_bytes(n1.veth)
    # rank 0 (alone on node 1) sent and received its share through its cable: eth0 <-> bridge
    assert rx1 - rx0 >= nbytes // 2 and tx1 - tx0 >= nbytes // 2

    # the engines' established TCP connections, seen inside each node: none over loopback, and
    # rank 0 talks to node 2's address directly (gloo pairs), not only to the controller
    for node in (n1, n2):
        pids = [r.pid for r in cluster12.ranks if r.host == node.name]
        out = testbed.exec(
            node, [testbed.remote_python, "-c", CONNECTIONS, json.dumps(pids)]
        ).stdout
        conns = json.loads(out)
        assert conns, f"no TCP connections of engines on {node.name}"
        # ipyparallel's engine talks to its own nanny over loopback; everything else (the
        # controller, the rendezvous store, gloo's pairs) leaves from the node's eth0 address
        between_ranks = [c for c in conns if not c[3]]
        for _, local, remote, _ in between_ranks:
            assert not local.startswith("127.") and not remote.startswith("127."), conns
            assert local == node.address, conns
        peers = {remote for _, _, remote, _ in between_ranks}
        other = n2 if node is n1 else n1
        assert other.address in peers and testbed.head_address in peers


def test_probe_reports_bus_bandwidth_and_node_latency(testbed: Testbed, cluster12) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    result = cluster12.probe(max_bytes=2**20, iters=2, latency_iters=5)
    assert [r["bytes"] for r in result.rows] == [4, 4096, 16384, 65536, 262144, 1048576]
    for r in result.rows:
        assert r["seconds"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * 2 / 3)
    assert list(result.node_latency) == [f"{n1.name} -> {n2.name}"]
    assert 0 < result.node_latency[f"{n1.name} -> {n2.name}"] < 0.5
    # veth reports 10 Gb/s: the nominal speed is known
    assert result.nominal_bytes_per_s == pytest.approx(10_000 * 1e6 / 8)
    text = str(result)
    assert "busbw GB/s" in text and f"{n1.name} -> {n2.name}" in text


# --- stops the shared cluster; the bad-input tests below start their own ------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _finetune(kw):
    from nbtrain.configs.sft import SFTConfig
    from nbtrain.recipes.train import finetune

    result = finetune(SFTConfig(**kw))
    return {"adapter_dir": result.adapter_dir, "losses": list(result.history["loss"])}


def test_two_node_finetune_equals_local_engines(
    testbed: Testbed, cluster12, tiny, tmp_path
) -> None:
    from safetensors.torch import load_file

    from nbtrain.data.examples import instructions_path

    def kw(out):
        return dict(
            model=tiny,
            data=instructions_path(),
            output_dir=str(out),
            max_steps=10,
            per_device_train_batch_size=2,
            learning_rate=5e-3,
            max_length=48,
            logging_steps=1,
            save_steps=None,
            lora_r=8,
        )

    remote = cluster12.run(_finetune, kw(tmp_path / "nodes"), timeout=240)
    before = _local_ipp_pids()
    cluster12.stop()
    _assert_nothing_left(testbed, before)
    local_cluster = nbtrain.start(n=3, timeout=120)
    try:
        local = local_cluster.run(_finetune, kw(tmp_path / "local"), timeout=240)
    finally:
        local_cluster.stop()

    assert remote[0]["adapter_dir"] and local[0]["adapter_dir"]
    torch.testing.assert_close(torch.tensor(remote[0]["losses"]), torch.tensor(local[0]["losses"]))
    a_nodes = load_file(str(Path(remote[0]["adapter_dir"]) / "adapter_model.safetensors"))
    a_local = load_file(str(Path(local[0]["adapter_dir"]) / "adapter_model.safetensors"))
    assert a_nodes.keys() == a_local.keys()
    # the losses agree to float32 rounding (the engines' BLAS threads and summation order differ by
    # host), but Adam divides each update by sqrt(v): a near-zero gradient component can move by a
    # sizeable fraction of lr, hence the atol (as in test_sft_distributed)
    torch.testing.assert_close(a_nodes, a_local, atol=1e-4, rtol=1e-3)
    # the adapter moved (lora_B starts at zero), so equality means something
    assert max(v.abs().max().item() for k, v in a_nodes.items() if "lora_B" in k) > 1e-3


def test_magic_start_with_bad_hosts_starts_nothing(ip, testbed: Testbed) -> None:
    before = _local_ipp_pids()
    ssh = f"--ssh-args='-F {testbed.ssh_config}' --python {testbed.remote_python}"
    cases = [
        ("nbt-node1:0", "engine count for nbt-node1 must be a positive integer"),
        ("nbt-node1,,nbt-node2", "entry 2 is empty"),
        ("nbt-node1:2,nbt-node1:1", "listed twice"),
        ("nbt_node1:1", "not a valid host name"),
        ("nbt-node9:1", "cannot resolve host 'nbt-node9'"),
    ]
    for hosts, message in cases:
        with pytest.raises((ConfigError, ClusterError), match=message):
            ip.run_line_magic("nbtrain", f"start --launcher ssh --hosts {hosts} {ssh}")
    with pytest.raises(
        ConfigError, match="--hosts is a setting of --launcher ssh or --launcher mpi"
    ):
        ip.run_line_magic("nbtrain", "start --launcher slurm --hosts nbt-node1")
    assert _local_ipp_pids() - before == set()


def test_interface_a_node_lacks_names_the_node_and_its_interfaces(testbed: Testbed) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    with pytest.raises(ConfigError) as e:
        nbtrain.start(hosts=f"{n1.name}:1,{n2.name}:1", iface="ib0", **_ssh_kw(testbed))
    msg = str(e.value)
    assert f"host {n1.name} has no network interface 'ib0'" in msg
    assert f"eth0 ({n1.address}" in msg and "lo (127.0.0.1" in msg and "--iface" in msg
    assert core.current_cluster() is None
    _assert_nothing_left(testbed, before)


def test_rendezvous_port_in_use_on_rank0_host_is_refused(testbed: Testbed) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    code = (
        "import socket, sys, time; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen(
        [*testbed.nsenter_argv(n1), sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        with pytest.raises(ConfigError) as e:
            nbtrain.start(hosts=f"{n1.name}:1,{n2.name}:1", port=port, **_ssh_kw(testbed))
    finally:
        holder.kill()
        holder.wait()
    msg = str(e.value)
    assert f"port {port} is already in use on {n1.name}" in msg and "--port" in msg
    _assert_nothing_left(testbed, before)


def test_version_mismatch_is_refused_with_the_table(testbed: Testbed) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    odd = {"NBTRAIN_PREFLIGHT_OVERRIDE": json.dumps({"nbtrain": "0.0.1"})}
    with pytest.raises(VersionMismatchError) as e:
        nbtrain.start(hosts=f"{n1.name}:1,{n2.name}:1", host_env={n2.name: odd}, **_ssh_kw(testbed))
    msg = str(e.value)
    assert "refusing to start" in msg
    assert f"nbtrain: 0.0.1 on {n2.name}; {nbtrain.__version__} on {n1.name}" in msg
    assert "--allow-version-mismatch" in msg
    # the table marks the odd node's row and value
    row = next(line for line in msg.splitlines() if line.startswith(f"! {n2.name}"))
    assert "*0.0.1" in row
    assert core.current_cluster() is None
    _assert_nothing_left(testbed, before)


def test_unreachable_host_fails_within_the_timeout(testbed: Testbed) -> None:
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    before = _local_ipp_pids()
    testbed.cut(n2)
    try:
        t0 = time.monotonic()
        kw = _ssh_kw(testbed)
        kw["timeout"] = 4
        with pytest.raises(ClusterError) as e:
            nbtrain.start(hosts=f"{n1.name}:1,{n2.name}:1", **kw)
        elapsed = time.monotonic() - t0
    finally:
        testbed.restore(n2)
    msg = str(e.value)
    assert n2.name in msg and ("timed out" in msg.lower() or "did not answer" in msg)
    assert "--timeout" in msg and "Nothing was started" in msg
    assert elapsed < 4 + 5
    _assert_nothing_left(testbed, before)
