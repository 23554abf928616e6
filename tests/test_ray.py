"""`%nbtrain start --launcher ray`: settings and placement logic (always), and real engines as actors
of a real Ray (the `ray` package; these skip, saying so, where it is not installed).

One Ray head per module (`ray start --head` with 4 CPUs and 4 declared GPUs, so `--address auto`
joins it), shared by the tests; `--address local` starts and stops its own. Ray's processes share
this machine's two cores: the module starts Ray twice in all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import nbtrain
from nbtrain.cluster.launch.ray import RayNode, bundles, explain_pending, rank_order
from nbtrain.cluster.options import LaunchOptions
from nbtrain.cluster.plan import Slot, plan_devices
from nbtrain.errors import ClusterError, ConfigError, RankDiedError

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason='no ray here (pip install "ray[default]")')
RAY_BIN = Path(sys.executable).with_name("ray")


# -- settings and placement logic (no Ray needed) ---------------------------------------------


def test_settings_are_checked_before_anything_starts():
    lo = LaunchOptions(launcher="ray", n=4)
    assert (lo.address, lo.placement, lo.gpus_per_rank, lo.cpus_per_rank) == ("auto", "PACK", 0, 1)
    assert LaunchOptions(launcher="ray", placement="strict-spread").placement == "STRICT_SPREAD"
    both = LaunchOptions(launcher="ray", nodes=2, engines_per_node=4, placement="STRICT_PACK")
    assert both.n == 8
    with pytest.raises(ConfigError, match="choose one of PACK, SPREAD"):
        LaunchOptions(launcher="ray", placement="TIGHT")
    with pytest.raises(ConfigError, match="not a Ray address"):
        LaunchOptions(launcher="ray", address="head")
    with pytest.raises(ConfigError, match="does not match --nodes 2"):
        LaunchOptions(launcher="ray", n=3, nodes=2, engines_per_node=2)
    with pytest.raises(ConfigError, match="nodes are always STRICT_SPREAD"):
        LaunchOptions(launcher="ray", nodes=2, placement="SPREAD")
    with pytest.raises(ConfigError, match="is a setting of --launcher ray"):
        LaunchOptions(launcher="ssh", hosts="localhost", placement="SPREAD")
    with pytest.raises(ConfigError, match="--gpus-per-rank"):
        LaunchOptions(launcher="ray", gpus_per_rank=-1)


def test_bundles_per_rank_or_per_node():
    wanted, strategy, per = bundles(
        LaunchOptions(launcher="ray", n=3, gpus_per_rank=1, placement="SPREAD")
    )
    assert (wanted, strategy, per) == ([{"CPU": 1.0, "GPU": 1.0}] * 3, "SPREAD", 1)
    lo = LaunchOptions(launcher="ray", nodes=2, engines_per_node=4, gpus_per_rank=1)
    assert bundles(lo) == ([{"CPU": 4.0, "GPU": 4.0}] * 2, "STRICT_SPREAD", 4)


def test_ranks_are_node_major_in_placement_order():
    # bundles 0 and 2 on node b (placed first), 1 and 3 on node a
    assert rank_order({0: "b", 1: "a", 2: "b", 3: "a"}) == [0, 2, 1, 3]
    assert rank_order({0: "x", 1: "y"}, per_bundle=2) == [0, 0, 1, 1]


def test_pending_group_names_what_is_missing():
    nodes = [
        RayNode("n1", "10.0.0.1", {"CPU": 4, "GPU": 2}),
        RayNode("n2", "10.0.0.2", {"CPU": 4, "GPU": 2}),
    ]
    gpu = {"CPU": 1.0, "GPU": 1.0}
    free = {"CPU": 8.0, "GPU": 4.0}
    assert "5 GPU wanted, the Ray cluster has 4 in all" in explain_pending(
        [gpu] * 5, "PACK", nodes, free
    )
    why = explain_pending([gpu] * 3, "STRICT_PACK", nodes, free)
    assert "STRICT_PACK puts every bundle on one node, and the largest has 2 GPU" in why
    why = explain_pending([gpu] * 3, "STRICT_SPREAD", nodes, free)
    assert "3 bundles on its own node, and 2 node(s) can hold one" in why
    assert "no node can hold one bundle {CPU: 8" in explain_pending(
        [{"CPU": 8.0}], "PACK", nodes, free
    )
    assert "1 free now" in explain_pending([gpu] * 2, "PACK", nodes, {"CPU": 8.0, "GPU": 1.0})


def test_a_rank_pinned_to_its_gpu_uses_cuda0():
    # Ray gives each actor its own GPU and hides the others: both ranks see 1 GPU, each its own
    plan = plan_devices([Slot("h", 0, 1, pinned=True), Slot("h", 1, 1, pinned=True)])
    assert (plan.backend, plan.devices) == ("nccl", ("cuda:0", "cuda:0"))
    # not pinned, two ranks on one visible GPU: CPU for both, as before
    assert plan_devices([Slot("h", 0, 1), Slot("h", 1, 1)]).backend == "gloo"


# -- a real Ray ---------------------------------------------------------------------------------


def _ray_env() -> dict[str, str]:
    env = dict(os.environ)
    # the declared GPUs are not real: engines must report none, so ranks train on CPU with gloo
    env["NBTRAIN_TEST_GPU_COUNT"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
    return env


def _ray_procs() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "gcs_server" in cmd or "raylet" in (p.info["name"] or ""):
            out.append(p)
    return out


@pytest.fixture(scope="module")
def head():
    """A Ray head on this machine (`--address auto` joins it): 4 CPUs and 4 declared GPUs."""
    if not HAVE_RAY:
        pytest.skip('no ray here (pip install "ray[default]")')
    before = {p.pid for p in _ray_procs()}
    ray_bin = str(RAY_BIN) if RAY_BIN.exists() else shutil.which("ray") or "ray"
    cmd = [
        ray_bin,
        "start",
        "--head",
        "--num-cpus",
        "4",
        "--num-gpus",
        "4",
        "--disable-usage-stats",
    ]
    subprocess.run(cmd, env=_ray_env(), check=True, capture_output=True, timeout=120)
    try:
        yield {p.pid for p in _ray_procs()} - before
    finally:
        import ray as ray_mod

        if ray_mod.is_initialized():
            ray_mod.shutdown()
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120, check=False)


def _state(address: str = "http://127.0.0.1:8265") -> tuple[list, list]:
    """Our actors still alive and our placement groups not removed, as Ray's state API shows."""
    from ray.util.state import list_actors, list_placement_groups

    alive = list_actors(
        address=address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
    )
    actors = [a for a in alive if (a.name or "").startswith("nbtrain-")]
    groups = [
        g
        for g in list_placement_groups(address=address, raise_on_missing_output=False)
        if (g.name or "").startswith("nbtrain-") and g.state != "REMOVED"
    ]
    return actors, groups


@needs_ray
def test_local_starts_a_private_ray_and_stops_it():
    before = {p.pid for p in _ray_procs()}
    c = nbtrain.start(launcher="ray", address="local", n=2, force=True, timeout=120)
    try:
        assert c.world_size == 2
        assert [r.local_rank for r in c.ranks] == [0, 1]
        assert c.run(lambda: __import__("torch").distributed.get_world_size()) == [2, 2]
        engines = [r.pid for r in c.ranks]
        started = {p.pid for p in _ray_procs()} - before
        assert started, "address=local started no Ray of its own"
    finally:
        c.stop()
    gone, alive = psutil.wait_procs(
        [psutil.Process(p) for p in started if psutil.pid_exists(p)], timeout=20
    )
    assert not alive, f"Ray processes left by --address local: {[p.pid for p in alive]}"
    assert not any(psutil.pid_exists(p) for p in engines)


@needs_ray
def test_auto_joins_the_running_cluster_with_4_ranks(head):
    c = nbtrain.start(launcher="ray", address="auto", n=4, force=True, timeout=120)
    engines = [r.pid for r in c.ranks]
    try:
        assert [r.rank for r in c.ranks] == [0, 1, 2, 3]
        assert [r.local_rank for r in c.ranks] == [0, 1, 2, 3]  # one node
        tasks = c.run(lambda: __import__("os").environ["NBTRAIN_LAUNCH_TASK"])
        assert tasks == ["0", "1", "2", "3"]

        def total() -> float:
            import torch
            import torch.distributed as dist

            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return float(t.item())

        assert c.run(total) == [10.0] * 4
        actors, groups = _state()
        assert len(actors) == 4 and len(groups) == 1
    finally:
        c.stop()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        any(_state()) or any(psutil.pid_exists(p) for p in engines)
    ):
        time.sleep(0.5)
    assert _state() == ([], []), "stop left actors or a placement group in Ray"
    assert not [p for p in engines if psutil.pid_exists(p)], "stop left engine processes"


@needs_ray
def test_each_rank_sees_the_gpu_ray_gave_it_and_a_dead_actor_is_a_dead_rank(head):
    import ray as ray_mod

    c = nbtrain.start(launcher="ray", address="auto", n=2, gpus_per_rank=1, force=True, timeout=120)
    try:
        seen = c.run(lambda: __import__("os").environ.get("CUDA_VISIBLE_DEVICES"))
        assert all(s is not None and len(s.split(",")) == 1 for s in seen), seen
        assert len(set(seen)) == 2, f"two ranks share a GPU: {seen}"
        # the declared GPUs are fake (engines report none): gloo on CPU
        assert c.backend == "gloo"
        # kill rank 1's actor: its engine goes with it, and the next cell says which rank died
        actor = ray_mod.get_actor(f"{_group_name()}-rank1", namespace="nbtrain")
        ray_mod.kill(actor)
        # (during the cell, or before it once the controller has noticed: the dead-engine messages)
        with pytest.raises((RankDiedError, ClusterError), match="rank 1"):
            c.execute("import time\nfor _ in range(200): time.sleep(0.1)", live=False, timeout=60)
    finally:
        c.stop()


def _group_name() -> str:
    _, groups = _state()
    names = [g.name for g in groups]
    assert len(names) == 1, names
    return names[0]


@needs_ray
def test_an_unsatisfiable_group_fails_within_timeout_naming_what_is_missing(head):
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as info:
        nbtrain.start(launcher="ray", address="auto", n=5, gpus_per_rank=1, force=True, timeout=8)
    took = time.monotonic() - t0
    text = str(info.value)
    assert "5 GPU wanted, the Ray cluster has 4 in all" in text
    assert "--gpus-per-rank" in text and "was removed" in text
    assert took < 8 + 20, f"took {took:.0f} s for --timeout 8"
    assert _state() == ([], [])
