"""`--launcher ray` on a real Ray cluster over the simulated nodes: `ray start --head` inside node 1,
`ray start --address` inside node 2 (each with 2 CPUs and 2 declared GPUs), the notebook here
connecting through Ray Client (`ray://node1:10001`). One Ray cluster for the module.

Placement: SPREAD puts ranks on different hosts, STRICT_PACK and PACK on one; `--nodes 2
--engines-per-node 1` gives one rank per node; a 2-node finetune gives the same adapter as local
engines; every stop leaves no actor, no placement group and no engine process.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import nbtrain
from nbtrain.errors import ClusterError, RankDiedError
from tests import ray_testing as rt

from .testbed import Testbed

pytest.importorskip("ray", reason='no ray here (pip install "ray[default]")')

RAY = rt.ray_bin()
REPO = Path(__file__).resolve().parents[2]


def _env() -> list[str]:
    # the declared GPUs are not real: engines report none and train on CPU with gloo
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # token auth off on every node: a private test network (the head enables it by default)
    return [
        "env",
        "NBTRAIN_TEST_GPU_COUNT=0",
        "RAY_USAGE_STATS_ENABLED=0",
        "RAY_AUTH_MODE=disabled",
        f"PYTHONPATH={pythonpath}",
    ]


@pytest.fixture(scope="module")
def ray_cluster(testbed: Testbed):
    n1, n2 = testbed.nodes[0], testbed.nodes[1]
    common = ["--num-cpus=2", "--num-gpus=2", "--disable-usage-stats"]
    # each node's Ray has a temp dir of its own, and is stopped by its own processes (those that
    # name it or hold a file in it): never `ray stop --force`, which ends every Ray on the machine
    temps = {n1.name: rt.temp_dir("n1"), n2.name: rt.temp_dir("n2")}
    try:
        testbed.exec(
            n1,
            [
                *_env(),
                RAY,
                "start",
                "--head",
                f"--temp-dir={temps[n1.name]}",
                f"--node-ip-address={n1.address}",
                "--port=6379",
                "--ray-client-server-port=10001",
                "--dashboard-host=0.0.0.0",
                *common,
            ],
            timeout=240,
        )
        testbed.exec(
            n2,
            [
                *_env(),
                RAY,
                "start",
                f"--address={n1.address}:6379",
                f"--temp-dir={temps[n2.name]}",
                f"--node-ip-address={n2.address}",
                *common,
            ],
            timeout=240,
        )
        dashboard = f"http://{n1.address}:8265"
        _wait_nodes(dashboard, 2)
        _wait_client(f"ray://{n1.address}:10001")
        yield {
            "address": f"ray://{n1.address}:10001",
            "dashboard": dashboard,
            "hosts": [n1.name, n2.name],
            "temps": temps,
        }
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        left = {name: rt.stop_own(temp) for name, temp in temps.items()}
        for temp in temps.values():
            shutil.rmtree(temp, ignore_errors=True)
        assert not any(left.values()), f"the test Rays left processes: {left}"


def _wait_nodes(dashboard: str, count: int, timeout: float = 120) -> None:
    from ray.util.state import list_nodes

    deadline = time.monotonic() + timeout
    while True:
        try:
            alive = [n for n in list_nodes(address=dashboard) if n.state == "ALIVE"]
            if len(alive) >= count:
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the Ray cluster did not reach {count} nodes in {timeout:g} s")
        time.sleep(1)


def _wait_client(address: str, timeout: float = 120) -> None:
    """Until the head's Ray Client server takes a connection (its first start can fail under load)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.init(address=address, logging_level="ERROR")
            ray.shutdown()
            return
        except Exception:
            if ray.is_initialized():
                ray.shutdown()
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def _ours(dashboard: str) -> tuple[list, list]:
    from ray.util.state import list_actors, list_placement_groups

    alive = list_actors(
        address=dashboard, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
    )
    groups = list_placement_groups(address=dashboard, raise_on_missing_output=False)
    return (
        [a.name for a in alive if (a.name or "").startswith("nbtrain-")],
        [g.name for g in groups if (g.name or "").startswith("nbtrain-") and g.state != "REMOVED"],
    )


def _stop_and_check(cluster, dashboard: str) -> None:
    engines = [r.pid for r in cluster.ranks]
    cluster.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _ours(dashboard) == ([], []) and not [p for p in engines if psutil.pid_exists(p)]:
            return
        time.sleep(0.5)
    left = [p for p in engines if psutil.pid_exists(p)]
    raise AssertionError(f"stop left in Ray {_ours(dashboard)} and engines {left}")


def _start(ray_cluster, **kw):
    return nbtrain.start(
        launcher="ray", address=ray_cluster["address"], force=True, timeout=180, **kw
    )


def test_check_lists_every_ray_node(ray_cluster) -> None:
    result = nbtrain.check(address=ray_cluster["address"], timeout=120)
    hosts = sorted(str(n.get("hostname")) for n in result.nodes)
    assert hosts == sorted(ray_cluster["hosts"]), str(result)


def test_spread_puts_ranks_on_different_hosts_pack_on_one(ray_cluster) -> None:
    spread = _start(ray_cluster, n=2, gpus_per_rank=1, placement="SPREAD")
    try:
        assert sorted(r.host for r in spread.ranks) == sorted(ray_cluster["hosts"])
        assert [r.local_rank for r in spread.ranks] == [0, 0]
        assert spread.run(lambda: __import__("torch").distributed.get_world_size()) == [2, 2]
    finally:
        _stop_and_check(spread, ray_cluster["dashboard"])
    for placement in ("STRICT_PACK", "PACK"):
        packed = _start(ray_cluster, n=2, gpus_per_rank=1, placement=placement)
        try:
            assert len({r.host for r in packed.ranks}) == 1, placement
            assert [r.local_rank for r in packed.ranks] == [0, 1]
            seen = packed.run(lambda: __import__("os").environ.get("CUDA_VISIBLE_DEVICES"))
            assert len(set(seen)) == 2, f"{placement}: two ranks share a GPU: {seen}"
        finally:
            _stop_and_check(packed, ray_cluster["dashboard"])


def _finetune(kw):
    from nbtrain.configs.sft import SFTConfig
    from nbtrain.recipes.train import finetune

    result = finetune(SFTConfig(**kw))
    return {"adapter_dir": result.adapter_dir, "losses": list(result.history["loss"])}


def test_two_node_finetune_equals_local_engines(ray_cluster, tiny, tmp_path) -> None:
    from safetensors.torch import load_file

    from nbtrain.data.examples import instructions_path

    def kw(out):
        return dict(
            model=str(tiny),
            data=instructions_path(),
            output_dir=str(out),
            max_steps=6,
            per_device_train_batch_size=2,
            learning_rate=5e-3,
            max_length=48,
            logging_steps=1,
            save_steps=None,
            lora_r=8,
        )

    nodes = _start(ray_cluster, nodes=2, engines_per_node=1, placement="STRICT_PACK")
    try:
        assert sorted(r.host for r in nodes.ranks) == sorted(ray_cluster["hosts"])
        remote = nodes.run(_finetune, kw(tmp_path / "ray"), timeout=300)
    finally:
        _stop_and_check(nodes, ray_cluster["dashboard"])
    local_cluster = nbtrain.start(n=2, timeout=120, force=True)
    try:
        local = local_cluster.run(_finetune, kw(tmp_path / "local"), timeout=300)
    finally:
        local_cluster.stop()
    torch.testing.assert_close(torch.tensor(remote[0]["losses"]), torch.tensor(local[0]["losses"]))
    a_ray = load_file(str(Path(remote[0]["adapter_dir"]) / "adapter_model.safetensors"))
    a_local = load_file(str(Path(local[0]["adapter_dir"]) / "adapter_model.safetensors"))
    assert a_ray.keys() == a_local.keys()
    torch.testing.assert_close(a_ray, a_local)
    # the adapter moved (lora_B starts at zero), so equality means something
    assert max(v.abs().max().item() for k, v in a_ray.items() if "lora_B" in k) > 1e-3


def test_a_lost_worker_node_is_named_within_15_s(ray_cluster) -> None:
    """Node 2's raylet killed while a cell runs: the rank there is named dead, with its host."""
    n2 = ray_cluster["hosts"][1]
    spread = _start(ray_cluster, n=2, gpus_per_rank=1, placement="SPREAD")
    try:
        lost = next(r for r in spread.ranks if r.host == n2)
        raylets = [
            p
            for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] == "raylet"
            and ray_cluster["temps"][n2] in " ".join(p.info["cmdline"] or [])
        ]
        assert len(raylets) == 1, raylets
        killed: list[float] = []

        def kill_later() -> None:
            time.sleep(3)
            raylets[0].kill()
            killed.append(time.monotonic())

        threading.Thread(target=kill_later, daemon=True).start()
        with pytest.raises((RankDiedError, ClusterError)) as info:
            spread.execute(
                "import time\nfor _ in range(900): time.sleep(0.1)", live=False, timeout=120
            )
        assert killed, "the cell ended before the raylet was killed"
        took = time.monotonic() - killed[0]
        text = str(info.value)
        print(f"\n[lost node] named after {took:.1f} s: {text}")
        assert f"rank {lost.rank} on {n2}" in text, text
        assert took < 15, f"the lost node was named after {took:.1f} s"
    finally:
        spread.stop()
