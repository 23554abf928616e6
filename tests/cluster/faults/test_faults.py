"""Faults on real engines and a real gloo group: rank death, restart, diagnose, interrupt, killed saves.

Every number a test asserts (detection time, metrics steps, adapter values) is measured, not assumed.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

import nbtrain
from nbtrain.errors import CellTimeoutError, ClusterError, RankDiedError

pytestmark = pytest.mark.timeout(240)

# a loop of all_reduces: the survivors are inside a collective when their peer dies
LOOP = (
    "import torch, torch.distributed as dist, time\n"
    "t = torch.ones(1)\n"
    "for _ in range(100000):\n"
    "    dist.all_reduce(t); t.fill_(1); time.sleep(0.01)\n"
)


@pytest.fixture(scope="module")
def cluster():
    c = nbtrain.start(n=2, force=True)
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def _usable_cluster(request):
    """Each test starts from a working 2-rank group: one that failed midway (and left a rank dead or
    the group broken) gets its ranks replaced here, so its failure does not fail the tests after it."""
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        try:
            c.run(lambda: 1, timeout=15)
            c.execute("import torch.distributed as _d; _d.barrier()", output="none", timeout=15)
        except Exception:
            c.restart(all_ranks=True)
    yield


def _run_and_kill(cluster, code, kill=None, after=1.5):
    """Run `code` as a cell; `kill(cluster)` fires after `after` s. Returns (error, seconds to fail after kill)."""
    fired = {}

    def fire():
        fired["t"] = time.monotonic()
        kill(cluster)

    if kill is not None:
        threading.Timer(after, fire).start()
    t0 = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        cluster.execute(code, live=False)
    end = time.monotonic()
    return info.value, end - fired.get("t", t0)


def _sigkill_rank1(c):
    os.kill(c.ranks[1].pid, signal.SIGKILL)


@pytest.mark.timed
@pytest.mark.parametrize(
    "name, code, kill, how",
    [
        ("sigkill", LOOP, _sigkill_rank1, "killed by SIGKILL"),
        (
            "segfault",
            "import os, signal, sys, time\n"
            "print('about to crash', file=sys.stderr, flush=True)\n"
            "time.sleep(0.5)\n"
            "if rank == 1:\n"
            "    os.kill(os.getpid(), signal.SIGSEGV)\n" + LOOP,
            None,
            "killed by SIGSEGV",
        ),
        (
            "exit3",
            "import os, sys, time\n"
            "print('leaving with 3', file=sys.stderr, flush=True)\n"
            "time.sleep(0.5)\n"
            "if rank == 1:\n"
            "    os._exit(3)\n" + LOOP,
            None,
            "exited with code 3",
        ),
    ],
)
def test_rank_death_fails_cell_fast_and_restart_recovers(cluster, name, code, kill, how, capsys):
    err, took = _run_and_kill(cluster, code, kill)
    text = str(err)
    print(text)
    host = cluster.ranks[1].host
    assert took < 5.0, f"{name}: the cell failed {took:.1f} s after the death"
    assert f"rank 1 on {host}" in text and how in text, text
    assert len(err.deaths) == 1 and err.deaths[0].rank == 1
    if name == "segfault":
        # faulthandler's dump of the crashing rank reached its log, and the client shows it
        assert "Fatal Python error: Segmentation fault" in text, text
        assert "about to crash" in text
    if name == "exit3":
        assert err.deaths[0].exit_code == 3
        assert "leaving with 3" in text  # rank 1's stderr, although only rank 0's output is shown
    # rank 0 was not left blocked in its all_reduce: interrupted or ended by nbtrain, or its gloo
    # call failed on its own when the peer's socket closed (then its error is in the message)
    assert (
        "Interrupted the other ranks (rank 0 on" in text
        or "Ended rank 0 on" in text
        or f"rank 0 on {host} failed first" in text
    ), text
    status = cluster.status()  # does not hang
    assert len(status) == 2
    # a cell on the broken cluster says what to do instead of hanging
    with pytest.raises(ClusterError, match="%nbtrain restart"):
        cluster.execute("print(1)", live=False)
    note = cluster.restart()
    assert "replaced rank" in note and "in-memory state of the replaced ranks was lost" in note
    out = cluster.run(_all_reduce_one)
    assert out == [2.0, 2.0]
    print(f"{name}: failed {took:.2f} s after the death")


def test_rank_death_shows_only_what_the_rank_wrote_in_this_cell(cluster):
    # an earlier cell's stderr (e.g. a Preempted traceback) stays in the engine's log, which the
    # death's report reads: it must not show up as the last words of a rank killed later
    cluster.execute(
        "import sys\nprint('stale line from an earlier cell', file=sys.stderr, flush=True)",
        output="none",
        live=False,
    )
    code = (
        "import sys, time\n"
        "print('fresh line from the fatal cell', file=sys.stderr, flush=True)\n"
        "time.sleep(0.5)\n" + LOOP
    )
    err, _ = _run_and_kill(cluster, code, _sigkill_rank1)
    text = str(err)
    assert "killed by SIGKILL" in text and "fresh line from the fatal cell" in text, text
    assert "stale line from an earlier cell" not in text, text
    cluster.restart()


def _all_reduce_one():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.timed
def test_engine_and_nanny_killed_is_noticed(cluster):
    # the node-loss shape on one machine: engine and its nanny die together, only the heartbeat can tell
    def kill_both(c):
        proc = psutil.Process(c.ranks[1].pid)
        procs = [proc, *proc.children(recursive=True)]
        for p in procs:
            p.kill()

    err, took = _run_and_kill(cluster, LOOP, kill_both)
    assert took < 15.0
    assert "rank 1 on" in str(err)
    cluster.restart()
    assert cluster.run(_all_reduce_one) == [2.0, 2.0]


SKIP = (
    "import torch, torch.distributed as dist, time\n"
    "def step():\n"
    "    t = torch.ones(1)\n"
    "    if rank == 0:\n"
    "        dist.all_reduce(t)\n"
    "    else:\n"
    "        time.sleep(600)  # rank 1 skips the all_reduce\n"
    "step()\n"
)


@pytest.mark.timed
def test_diagnose_while_cell_hangs_names_waiting_rank(cluster, ip):
    result = {}

    def cell():
        try:
            cluster.execute(SKIP, live=False)
        except BaseException as e:  # the interrupt below ends it
            result["error"] = e

    runner = threading.Thread(target=cell)
    runner.start()
    time.sleep(2.0)
    t0 = time.monotonic()
    diag = cluster.diagnose()
    took = time.monotonic() - t0
    assert took < 10.0
    text = str(diag)
    assert set(diag.waiting) == {0} and "all_reduce" in diag.waiting[0]
    assert 1 in diag.other and "sleep" in diag.other[1]
    assert diag.behind == [1]  # the flight recorder: rank 0 entered a collective rank 1 did not
    # its entry for the all_reduce rank 0 waits in: not completed, with sizes, group and call site
    fr0, fr1 = diag.stacks[0]["collectives"], diag.stacks[1]["collectives"]
    assert fr0["available"] and fr0["backend"] == "gloo"
    [entry] = fr0["pending"]
    assert entry["op"] == "gloo:all_reduce" and entry["sizes"] == [[1]]
    assert entry["dtypes"] == ["Float"] and entry["pg"] == "0" and entry["state"] == "scheduled"
    assert entry["site"] == ""  # gloo: its Python stack shows the call (no symbolizing)
    assert fr1["pending"] == []
    assert (
        f"flight recorder, not completed: rank 0: #{entry['seq']} gloo:all_reduce of 1 Float in pg 0 "
        "(default_pg), scheduled; rank 1: none"
    ) in text
    assert "  not completed (flight recorder, generic):" in text
    assert "--- rank 0 on" in text and "--- rank 1 on" in text
    assert "time.sleep(600)" in text
    # the magic twin, from another thread while the cell still runs
    import io
    import sys

    buf = io.StringIO()
    old = sys.stdout
    sys.stdout = buf
    try:
        ip.run_line_magic("nbtrain", "diagnose")
    finally:
        sys.stdout = old
    assert "waiting in a collective: rank 0: all_reduce" in buf.getvalue()
    assert runner.is_alive(), "diagnose must not stop the cell"
    # stop the hung cell as a user would: --timeout equivalent via restart of the stuck ranks
    cluster.interrupt()
    runner.join(30)
    assert not runner.is_alive()
    print(f"diagnose took {took:.2f} s")
    cluster.restart()
    assert cluster.run(_all_reduce_one) == [2.0, 2.0]
    # rank 1 kept its engine and the old group's unfinished entries are not reported in the new one
    after = cluster.stacks()
    assert after[0]["collectives"]["pending"] == [] and after[1]["collectives"]["pending"] == []
    assert [e["op"] for e in after[1]["collectives"]["entries"]] == ["gloo:all_reduce"]


def test_timeout_cell_shows_the_diagnosis(cluster):
    with pytest.raises(CellTimeoutError) as info:
        cluster.execute(SKIP, timeout=2, live=False)
    text = str(info.value)
    assert "waiting in a collective: rank 0: all_reduce" in text
    assert "not in a collective: rank 1" in text
    # rank 0, blocked in the collective rank 1 left, is replaced, said of one rank
    assert "and was replaced: its variables are gone" in text, text
    assert "flight recorder" in text
    assert cluster.run(_all_reduce_one) == [2.0, 2.0]


def test_collective_left_pending_after_the_cell_shows_as_waiting(cluster):
    # what NCCL does to every collective: the call returns, the rank moves on (here its cell ends),
    # and only the flight recorder knows it has not completed. gloo does the same with async_op=True
    cluster.execute(
        "import torch, torch.distributed as dist\n"
        "work = dist.all_reduce(torch.ones(3, 2), async_op=True) if rank == 0 else None\n",
        live=False,
    )
    diag = cluster.diagnose()
    assert set(diag.waiting) == {0} and 1 in diag.other
    assert diag.waiting[0].startswith("#")
    assert (
        "gloo:all_reduce of 3x2 Float in pg 0 (default_pg), scheduled, not completed; meanwhile idle"
        in (diag.waiting[0])
    )
    assert diag.waiting[0].endswith("not completed; meanwhile idle (no cell running)")
    assert "flight recorder, not completed: rank 0: #" in diag.text and "rank 1: none" in diag.text
    # rank 1 joins; the entry completes on rank 0 and is no longer reported
    cluster.execute(
        "if rank == 1:\n    dist.all_reduce(torch.ones(3, 2))\nelse:\n    work.wait()\n", live=False
    )
    after = cluster.diagnose()
    assert after.waiting == {} and "not completed" not in after.text


@pytest.mark.timed
def test_stacks_stay_fast_with_a_full_flight_recorder(cluster):
    # a long run fills the recorder's ring (2000 entries); a stack request must still answer well
    # within the 2 s after which the client calls a rank silent and ends it
    cluster.execute(
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1)\n"
        "for _ in range(2100):\n"
        "    dist.all_reduce(t)\n",
        live=False,
    )
    t0 = time.monotonic()
    stacks = cluster.stacks()
    took = time.monotonic() - t0
    assert [len(stacks[r]["collectives"]["entries"]) for r in (0, 1)] == [8, 8]
    assert took < 1.0, f"stacks took {took:.2f} s"
    print(f"stacks with a full flight recorder: {took:.2f} s")


def test_nccl_env_defaults_keep_the_users_values():
    from nbtrain.engine.faults import NCCL_DEFAULTS, set_env_defaults

    env: dict[str, str] = {}
    ours: dict[str, str] = {}
    assert set_env_defaults(env, ours) == NCCL_DEFAULTS == env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_FR_BUFFER_SIZE"] == "2000"
    # the user's own value, or one under the older name torch also reads, is kept
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    set_env_defaults(env, {})
    assert env == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    # hello set the defaults; start(env=...) then brings the user's old-name value: ours steps back
    env, ours = {}, {}
    set_env_defaults(env, ours)
    env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "0"
    env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"
    set_env_defaults(env, ours)
    assert "TORCH_FR_BUFFER_SIZE" not in env and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert ours == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def _fault_env():
    import os

    return {k: os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")}


def test_engines_have_the_defaults_before_their_group(cluster):
    assert (
        cluster.run(_fault_env)
        == [{"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}] * 2
    )


def test_a_collective_left_on_the_gpu_counts_as_waiting():
    # NCCL enqueues a collective and returns: the rank's Python is elsewhere (here: idle) while the
    # flight recorder still has it scheduled. The entry has the structure torch's dump gives
    from nbtrain.cluster.faults.diagnose import classify
    from nbtrain.engine.faults import summarize_dump

    dump = {
        "entries": [
            {
                "record_id": 7,
                "pg_id": 0,
                "process_group": ("0", "default_pg"),
                "collective_seq_id": 12,
                "p2p_seq_id": 0,
                "op_id": 12,
                "profiling_name": "nccl:all_reduce",
                "time_created_ns": 1,
                "input_sizes": [[4096, 4096]],
                "input_dtypes": ["BFloat16"],
                "output_sizes": [[4096, 4096]],
                "output_dtypes": ["BFloat16"],
                "state": "scheduled",
                "time_discovered_started_ns": None,
                "time_discovered_completed_ns": None,
                "retired": False,
                "timeout_ms": 1800000,
                "is_p2p": False,
                "frames": [
                    {
                        "name": "all_reduce",
                        "filename": "/x/torch/distributed/distributed_c10d.py",
                        "line": 3245,
                    },
                    {"name": "step", "filename": "/tmp/ipykernel_123/456.py", "line": 5},
                ],
            }
        ],
        "pg_status": {"0": {"last_enqueued_collective": 12, "last_completed_collective": 11}},
    }
    fr = summarize_dump(dump)
    info = {"threads": [{"main": True, "user_frames": 0, "stack": ""}], "collectives": fr}
    kind, what = classify(info)
    assert kind == "collective"
    assert what == (
        "#12 nccl:all_reduce of 4096x4096 BFloat16 in pg 0 (default_pg), scheduled, issued at "
        "<cell>:5 in step, not completed; meanwhile idle (no cell running)"
    )
    assert fr["pg_status"] == {
        "0": {"last_enqueued_collective": 12, "last_completed_collective": 11}
    }
    # entries of a group destroyed before the current one was made are not the current group's
    assert summarize_dump(dump, since_ns=2)["pending"] == []
