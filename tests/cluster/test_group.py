"""Named rank groups (`%nbtrain groups`, `cluster.groups`, `%%distributed --group`) on a real
4-rank gloo cluster: collectives inside disjoint and overlapping groups, cells on one group, the
errors, and the groups surviving a re-init and a replaced engine."""

from __future__ import annotations

import threading
import time

import pytest

from nbtrain.errors import ConfigError
from tests.conftest import magic_cluster, quiet, run_cell

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(ip):
    """One 4-rank gloo cluster for the module, started and stopped with the magics."""
    with magic_cluster(ip, 4) as c:
        run_cell(ip, "import torch, torch.distributed as dist")
        yield c


# every rank all-reduces its rank + 1 in each group it belongs to, in the order given
REDUCE = (
    "sums = {}\n"
    "for name in order:\n"
    "    if groups.member(name):\n"
    "        t = torch.tensor([float(rank + 1)])\n"
    "        dist.all_reduce(t, group=groups[name])\n"
    "        sums[name] = t.item()\n"
)


def test_disjoint_groups_reduce_at_the_same_time(ip, cluster):
    out = quiet(ip.run_line_magic, "nbtrain", "groups actor=0-1 rollout=2-3")
    assert "actor" in out and "0-1" in out and "rollout" in out and "2-3" in out
    assert cluster.groups() == {"actor": [0, 1], "rollout": [2, 3]}
    # one cell on every rank: each rank reduces in its own group while the other group does too
    cluster.push({"order": ["actor", "rollout"]})
    run_cell(ip, REDUCE)
    assert cluster.pull("sums") == [
        {"actor": 3.0},
        {"actor": 3.0},
        {"rollout": 7.0},
        {"rollout": 7.0},
    ]
    # non-members hold torch's marker, not a process group
    member = cluster.execute(
        "m = [groups.member('actor'), groups['actor'] is dist.GroupMember.NON_GROUP_MEMBER]",
        output="none",
    )
    assert member and cluster.pull("m") == [
        [True, False],
        [True, False],
        [False, True],
        [False, True],
    ]


def test_overlapping_groups(ip, cluster):
    # collocated: ranks 1 and 2 are in both groups
    assert cluster.groups(a="0-2", b=[1, 2, 3]) == {"a": [0, 1, 2], "b": [1, 2, 3]}
    cluster.push({"order": ["a", "b"]})
    run_cell(ip, REDUCE)
    assert cluster.pull("sums") == [
        {"a": 6.0},
        {"a": 6.0, "b": 9.0},
        {"a": 6.0, "b": 9.0},
        {"b": 9.0},
    ]
    out = quiet(ip.run_line_magic, "nbtrain", "groups")
    assert "a" in out and "0-2" in out and "1-3" in out and "shares ranks with" in out


def test_group_cell_runs_on_its_ranks_with_its_group(ip, cluster):
    cluster.groups(actor="0-1", rollout="2-3")
    out = run_cell(
        ip,
        "t = torch.ones(1); dist.all_reduce(t, group=group)\n"
        "print('on', rank, dist.get_rank(group), dist.get_world_size(group), t.item())",
        "--group rollout --output all",
    )
    # ranks print concurrently: their lines may arrive in either order
    assert sorted(out.splitlines()) == ["[rank 2] on 2 0 2 2.0", "[rank 3] on 3 1 2 2.0"]
    out = run_cell(ip, "print('lead', rank)", "--group rollout")
    assert out.strip() == "lead 2"
    # a cell without --group: `group` is the world group again
    out = run_cell(
        ip,
        "print(group is dist.group.WORLD, dist.get_world_size(group))",
        "--output all",
    )
    assert out.count("True 4") == 4
    # the Python twin
    cluster.execute("who = rank", group="actor", output="none")
    cluster.execute("who = -1", group="rollout", output="none")
    assert cluster.pull("who") == [0, 1, -1, -1]


def test_group_errors(ip, cluster):
    cluster.groups(actor="0-1", rollout="2-3")
    with pytest.raises(ConfigError, match="--ranks and --group cannot be used together"):
        run_cell(ip, "pass", "--ranks 0 --group actor")
    with pytest.raises(ConfigError, match=r"no such group.*actor \(0-1\), rollout \(2-3\)"):
        run_cell(ip, "pass", "--group critic")
    with pytest.raises(ConfigError, match="outside the world of 4"):
        cluster.groups(big="0-7")
    with pytest.raises(ConfigError, match="not NAME=RANKS"):
        ip.run_line_magic("nbtrain", "groups actor")
    # a refused definition leaves the previous groups in place
    assert cluster.groups() == {"actor": [0, 1], "rollout": [2, 3]}
    cluster.clear_groups()
    assert cluster.groups() == {}
    with pytest.raises(ConfigError, match="no groups are defined"):
        cluster.execute("pass", group="actor")


def test_groups_survive_reinit_and_a_replaced_engine(ip, cluster):
    cluster.groups(actor="0-1", rollout="2-3")
    cluster.push({"order": ["actor", "rollout"]})
    # every rank alive: restart only re-creates the process group, then the groups
    assert "re-created" in cluster.restart()
    run_cell(ip, REDUCE)
    assert cluster.pull("sums") == [
        {"actor": 3.0},
        {"actor": 3.0},
        {"rollout": 7.0},
        {"rollout": 7.0},
    ]
    # a fresh engine for rank 3: it gets the groups like the others
    cluster.restart_ranks([3])
    cluster.push({"order": ["actor", "rollout"]}, ranks=3)
    run_cell(ip, "import torch, torch.distributed as dist", "--ranks 3")
    run_cell(ip, REDUCE)
    assert cluster.pull("sums") == [
        {"actor": 3.0},
        {"actor": 3.0},
        {"rollout": 7.0},
        {"rollout": 7.0},
    ]
    out = run_cell(ip, "print(rank, dist.get_world_size(group))", "--group rollout --output all")
    assert "[rank 3] 3 2" in out


def test_repair_re_creates_when_a_named_group_is_out_of_step(ip, cluster):
    cluster.groups(actor="0-1", rollout="2-3")
    assert cluster.repair_group().startswith("The process group is intact")
    # rank 0 starts a collective in `actor` that rank 1 never joins: the world group is in step,
    # the named group is not (what an interrupt inside a group's collective leaves)
    cluster.execute(
        "work = dist.all_reduce(torch.ones(1), group=group, async_op=True) if rank == 0 else None",
        group="actor",
        output="none",
    )
    assert "re-created" in cluster.repair_group()
    cluster.push({"order": ["actor", "rollout"]})
    run_cell(ip, REDUCE)
    assert cluster.pull("sums") == [
        {"actor": 3.0},
        {"actor": 3.0},
        {"rollout": 7.0},
        {"rollout": 7.0},
    ]


def test_a_kernel_that_attaches_knows_the_groups(ip, cluster):
    import json

    from nbtrain.cluster import attach, registry
    from nbtrain.cluster.facade import Cluster
    from nbtrain.cluster.session import close_client

    cluster.groups(actor="0-1", rollout="2-3")
    side = json.loads(registry.side_file(cluster.ipp_cluster).read_text())
    assert side["groups"] == {"actor": [0, 1], "rollout": [2, 3]}
    # what a new kernel's %nbtrain attach builds from the side file (without making it current)
    other = Cluster.from_launched(attach.reconnect(side, 30))
    try:
        assert other.groups() == {"actor": [0, 1], "rollout": [2, 3]}
        other.execute("seen = dist.get_world_size(group)", group="rollout", output="none")
        assert other.pull("seen", ranks="2-3") == [2, 2]
    finally:
        close_client(other.client)


def test_diagnose_after_group_cells_on_an_idle_cluster_reports_no_hang(ip, cluster):
    # the groups count their collectives apart: actor runs 3, rollout 1, the world 1 more. An idle
    # cluster is in step in every group, though rank 0's count (3 in actor) is not rank 2's
    cluster.groups(actor="0-1", rollout="2-3")
    run_cell(ip, "dist.all_reduce(torch.ones(1))")
    run_cell(
        ip, "for _ in range(3):\n    dist.all_reduce(torch.ones(1), group=group)", "--group actor"
    )
    run_cell(ip, "dist.all_reduce(torch.ones(1), group=group)", "--group rollout")
    diag = cluster.diagnose()
    assert diag.behind == [] and diag.waiting == {}, diag.text
    assert "did not" not in diag.text
    groups = [s["collectives"]["groups"] for s in (diag.stacks[0], diag.stacks[2])]
    actor = max((int(pg), g["seq"]) for pg, g in groups[0].items() if g["desc"] == "actor")
    rollout = max((int(pg), g["seq"]) for pg, g in groups[1].items() if g["desc"] == "rollout")
    assert actor[1] - rollout[1] == 2  # the counts differ, and that is no hang
    assert "group actor's ranks all at" in diag.text and "group rollout's ranks all at" in diag.text
    out = quiet(ip.run_line_magic, "nbtrain", "diagnose")
    assert "did not" not in out and "idle (no cell running)" in out


def test_diagnose_names_the_group_of_a_hang_inside_it(ip, cluster):
    cluster.groups(actor="0-1", rollout="2-3")
    run_cell(ip, "dist.all_reduce(torch.ones(1), group=group)", "--group actor")
    result = {}

    def cell():
        try:
            cluster.execute(
                "import time\n"
                "if rank == 0:\n"
                "    dist.all_reduce(torch.ones(1), group=group)\n"
                "else:\n"
                "    time.sleep(600)  # rank 1 skips the group's all_reduce\n",
                group="actor",
                live=False,
            )
        except BaseException as e:  # the interrupt below ends it
            result["error"] = e

    host = cluster.ranks[0].host
    runner = threading.Thread(target=cell)
    runner.start()
    try:
        time.sleep(2.0)
        diag = cluster.diagnose()
        assert set(diag.waiting) == {0} and "all_reduce" in diag.waiting[0]
        assert diag.behind == [1], diag.text
        # the newest group named actor (each `cluster.groups` call made a new one)
        actor = diag.stacks[0]["collectives"]["groups"]
        seq = max((int(pg), g["seq"]) for pg, g in actor.items() if g["desc"] == "actor")[1]
        assert (
            f"flight recorder, group actor (ranks 0-1): rank 0 on {host} entered collective #{seq} "
            f"(gloo:all_reduce); rank 1 on {host} did not (last: rank 1 #{seq - 1})."
        ) in diag.text
        # ranks 2 and 3 are idle and in step: not blamed
        assert diag.text.count("did not") == 1
    finally:
        cluster.interrupt()
        runner.join(30)
    assert not runner.is_alive()
    cluster.restart()
    cluster.execute("import torch, torch.distributed as dist", output="none")
    assert cluster.diagnose().behind == []
