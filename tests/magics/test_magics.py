"""%nbtrain and %%distributed, driven the way a user drives them, on real engines and a real gloo group."""

from __future__ import annotations

import _thread
import io
import sys
import threading
import time

import pytest

from nbtrain.errors import (
    CellTimeoutError,
    ClusterError,
    ConfigError,
    DistributedCellError,
)
from tests.conftest import cluster_processes, wait_gone

pytestmark = pytest.mark.timeout(180)


class TimedStream(io.StringIO):
    """stdout replacement that remembers when each piece of text arrived."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[float, str]] = []

    def write(self, s):
        self.events.append((time.monotonic(), s))
        return super().write(s)


def run_cell(ip, code, line=""):
    out = TimedStream()
    old = sys.stdout
    sys.stdout = out
    try:
        ip.run_cell_magic("distributed", line, code)
    finally:
        sys.stdout = old
    return out.getvalue()


@pytest.fixture(scope="module")
def started(ip):
    """A 2-rank gloo cluster started with %nbtrain start, stopped with %nbtrain stop at the end.

    gloo is asked for: these tests mean gloo whatever GPUs the machine has (auto would be NCCL on a
    machine with a GPU per rank).
    """
    import nbtrain

    ip.run_line_magic("nbtrain", "stop")
    out = TimedStream()
    old = sys.stdout
    sys.stdout = out
    try:
        ip.run_line_magic("nbtrain", "start -n 2 --backend gloo")
    finally:
        sys.stdout = old
    cluster = nbtrain.current_cluster()
    assert cluster is not None
    yield cluster, out.getvalue()
    pids = list(cluster._pids)
    ip.run_line_magic("nbtrain", "stop")
    assert wait_gone(pids) == []


def test_start_prints_rank_table(started):
    cluster, printed = started
    assert "process group ready: 2 rank(s), backend gloo" in printed
    assert "rank  host" in printed
    assert cluster.world_size == 2
    assert [r.rank for r in cluster.ranks] == [0, 1]
    assert [r.local_rank for r in cluster.ranks] == [0, 1]


def test_all_reduce_and_state_persists(ip, started):
    out = run_cell(
        ip,
        "import torch, torch.distributed as dist\n"
        "t = torch.tensor([float(rank)]); dist.all_reduce(t)\n"
        "kept = rank * 10\n"
        "print('sum', t.item())",
    )
    assert out.strip() == "sum 1.0"  # rank 0 only, 0 + 1
    out = run_cell(ip, "print('kept', kept, rank)", "--output all")
    assert "[rank 0] kept 0 0" in out
    assert "[rank 1] kept 10 1" in out


def test_torchrun_environment_and_names(ip, started):
    cluster, _ = started
    envs = cluster.run(
        lambda: {
            k: __import__("os").environ[k]
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            )
        }
    )
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert envs[0]["MASTER_PORT"] != "29500" or True  # a free port, whatever it is
    # one share of the cores per rank, and torch's pool agrees although engines import torch early
    threads = cluster.run(
        lambda: (__import__("torch").get_num_threads(), __import__("os").environ["OMP_NUM_THREADS"])
    )
    share = max(1, (__import__("os").cpu_count() or 1) // 2)
    assert threads == [(share, str(share))] * 2
    out = run_cell(ip, "print(rank, local_rank, world_size, str(device))", "--output all")
    # the device the client planned (cpu here; cuda:<local rank> where every rank has its own GPU)
    devices = [r.device for r in cluster.ranks]
    assert set(devices) in ({"cpu"}, {"cuda:0", "cuda:1"})
    assert f"[rank 0] 0 0 2 {devices[0]}" in out
    assert f"[rank 1] 1 1 2 {devices[1]}" in out
    # code written for torchrun, unchanged: it inits the group itself and destroys it at the end
    script = (
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\n"
        "model = DDP(torch.nn.Linear(2, 1))\n"
        "model(torch.ones(1, 2) * (dist.get_rank() + 1)).sum().backward()\n"
        "print('grad', model.module.weight.grad.tolist(), dist.get_rank(), dist.get_world_size())\n"
        "dist.destroy_process_group()\n"
    )
    out = run_cell(ip, script)
    assert "grad [[1.5, 1.5]] 0 2" in out  # DDP averaged rank 0's 1 and rank 1's 2
    out = run_cell(ip, script)  # and again: the group is still there for the next cell
    assert "grad [[1.5, 1.5]] 0 2" in out


def test_output_streams_while_running(ip, started):
    out = TimedStream()
    old = sys.stdout
    sys.stdout = out
    try:
        t0 = time.monotonic()
        ip.run_cell_magic(
            "distributed",
            "",
            "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')",
        )
        t_end = time.monotonic()
    finally:
        sys.stdout = old
    first = [t for t, s in out.events if "first" in s]
    assert first, out.getvalue()
    assert first[0] - t0 < (t_end - t0) - 1.0, "the first line arrived only when the cell ended"
    assert "second" in out.getvalue()


def test_failure_names_ranks_and_groups_identical(ip, started):
    with pytest.raises(DistributedCellError) as info:
        run_cell(ip, "1/0")
    text = str(info.value)
    assert "failed on 2 of 2 rank(s)" in text
    assert "ranks 0-1 on" in text
    assert text.count("ZeroDivisionError: division by zero  [") == 1  # shown once, not per rank
    assert len(info.value.failures) == 1

    with pytest.raises(DistributedCellError) as info:
        run_cell(ip, "if rank == 1:\n    raise ValueError(f'bad rank {rank}')")
    text = str(info.value)
    assert "failed on 1 of 2 rank(s)" in text
    assert "ValueError: bad rank 1  [rank 1 on" in text


def test_failure_stops_a_notebook_cell(ip, started):
    # the magic raises (so nbclient stops there); IPython shows the message, not nbtrain internals
    result = ip.run_cell("%%distributed\nraise KeyError('missing')")
    assert isinstance(result.error_in_exec, DistributedCellError)
    lines = result.error_in_exec._render_traceback_()
    assert lines[0].startswith("DistributedCellError: the cell failed on 2 of 2 rank(s)")


def test_a_failure_is_told_once_not_again_as_the_tracebacks_last_line(ip, started):
    import re
    import socket

    with pytest.raises(DistributedCellError) as info:
        run_cell(ip, "1/0")
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(info.value))
    assert text.count("division by zero") == 1, text
    assert "Traceback" in text and "----> 1 1/0" in text  # the traceback itself stays
    # nbtrain's own errors: their traceback is their message, so only the message is left, with
    # the ranks on its first line
    code = "from nbtrain.errors import ConfigError\nraise ConfigError('bad rows:\\nline 2: x')"
    with pytest.raises(DistributedCellError) as info:
        run_cell(ip, code)
    assert str(info.value) == (
        "the cell failed on 2 of 2 rank(s)\n\n"
        f"ConfigError: bad rows:  [ranks 0-1 on {socket.gethostname()}]\nline 2: x"
    )


def test_ranks_subset(ip, started):
    out = run_cell(ip, "print('on', rank)", "--ranks 1 --output all")
    assert out.strip() == "[rank 1] on 1"
    out = run_cell(ip, "print('on', rank)", "--ranks 0-1 --output all")
    assert "[rank 0] on 0" in out and "[rank 1] on 1" in out
    out = run_cell(ip, "print('lead', rank)", "--ranks 1")
    assert out.strip() == "lead 1"  # rank0 mode shows the lowest selected rank
    with pytest.raises(ConfigError, match="outside the world of 2"):
        run_cell(ip, "pass", "--ranks 0,5")


def test_timeout_shows_stacks_and_cluster_survives(ip, started):
    code = (
        "import torch, torch.distributed as dist, time\n"
        "def skipper():\n"
        "    t = torch.ones(1)\n"
        "    if rank == 0:\n"
        "        dist.all_reduce(t)\n"
        "    else:\n"
        "        time.sleep(300)\n"
        "skipper()\n"
    )
    t0 = time.monotonic()
    with pytest.raises(CellTimeoutError) as info:
        run_cell(ip, code, "--timeout 2")
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "ran past --timeout 2 s" in text
    assert "--- rank 0 on" in text and "--- rank 1 on" in text
    rank0 = text.split("--- rank 0 on")[1].split("--- rank 1 on")[0]
    rank1 = text.split("--- rank 1 on")[1]
    assert "all_reduce" in rank0
    assert "time.sleep(300)" in rank1
    assert elapsed < 30
    assert "did not stop" in text and "was replaced" in text  # rank 0 was stuck in C code
    out = run_cell(
        ip,
        "import torch, torch.distributed as dist\nt = torch.ones(1); dist.all_reduce(t); print('after', t.item())",
    )
    assert "after 2.0" in out


def test_failed_rank_does_not_leave_others_blocked(ip, started):
    code = (
        "import torch, torch.distributed as dist\n"
        "if rank == 1:\n"
        "    raise RuntimeError('rank 1 gave up')\n"
        "t = torch.ones(1); dist.all_reduce(t)\n"
    )
    t0 = time.monotonic()
    with pytest.raises(DistributedCellError) as info:
        run_cell(ip, code)
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert "RuntimeError: rank 1 gave up  [rank 1 on" in text
    assert "kept running after the failure" in text
    out = run_cell(
        ip,
        "import torch, torch.distributed as dist\nt = torch.ones(1); dist.all_reduce(t); print('ok', t.item())",
    )
    assert "ok 2.0" in out


def test_interrupt_reaches_every_rank_and_keeps_state(ip, started):
    run_cell(ip, "kept2 = rank + 100")
    threading.Timer(1.0, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_cell(ip, "import time\ntime.sleep(120)")
    assert time.monotonic() - t0 < 11
    out = run_cell(
        ip,
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1); dist.all_reduce(t); print(kept2, t.item())",
        "--output all",
    )
    assert "[rank 0] 100 2.0" in out
    assert "[rank 1] 101 2.0" in out


def test_status_lists_ranks(ip, started, capsys):
    ip.run_line_magic("nbtrain", "status")
    out = capsys.readouterr().out
    assert "rank  host" in out and "idle" in out
    cluster, _ = started
    rows = cluster.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert {r["state"] for r in rows} == {"idle"}


def test_push_pull(started):
    cluster, _ = started
    cluster.push({"pushed": 7})
    assert cluster.pull("pushed") == [7, 7]
    assert cluster.run(lambda a, b=0: a + b, 1, b=2) == [3, 3]


def test_two_runs_in_one_cell_each_get_their_own_live_display(ip, started, monkeypatch):
    # two finetune calls in one cell publish begin, rows, end twice: notebooks/06 does this
    from nbtrain import live
    from nbtrain.cluster import cell

    drawn = []

    def render(self, final=False):
        drawn.append((id(self), self.name, final, [r["step"] for r in self.rows]))
        self._handle = object()

    monkeypatch.setattr(cell, "in_kernel", lambda: True)  # live plots only draw in a kernel
    monkeypatch.setattr(live.LiveDisplay, "render", render)
    displays = []
    monkeypatch.setattr(live.LiveDisplay, "__init__", _recording_init(displays))
    run_cell(
        ip,
        "from nbtrain.engine import metrics\n"
        "for name in ('first', 'second'):\n"
        "    metrics.begin(total_steps=2, name=name)\n"
        "    for step in (1, 2):\n"
        "        metrics.log(step=step, loss=1.0 / step)\n"
        "    metrics.end()\n",
    )
    assert [d.name for d in displays] == ["first", "second"]
    for d in displays:
        assert d.closed and [r["step"] for r in d.rows] == [1, 2]
        finals = [x for x in drawn if x[0] == id(d) and x[2]]
        assert len(finals) == 1 and finals[0][3] == [1, 2], drawn


def _recording_init(displays):
    from nbtrain import live

    init = live.LiveDisplay.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        displays.append(self)

    return recording


def test_second_start_refused_without_force(ip, started, capsys):
    with pytest.raises(ClusterError, match="already running.*--force"):
        ip.run_line_magic("nbtrain", "start -n 2")
    # refused before anything is said to start
    assert "starting" not in capsys.readouterr().out


def test_output_all_prints_in_rank_order(ip, started):
    # rank 1 prints first; the lines still come out as rank 0's, then rank 1's (docs/groups.md)
    out = run_cell(
        ip,
        "import time\ntime.sleep(0.3 if rank == 0 else 0)\nprint('hello from', rank)",
        "--output all",
    )
    assert out.index("[rank 0] hello from 0") < out.index("[rank 1] hello from 1"), out


def test_help_is_real(ip):
    from nbtrain.magics import NbtrainMagics

    doc = NbtrainMagics.nbtrain.__doc__
    assert "%nbtrain start" in doc and "--backend" in doc and "--timeout" in doc
    ddoc = NbtrainMagics.distributed.__doc__
    assert "--ranks" in ddoc and "--output" in ddoc and "--timeout" in ddoc


@pytest.mark.parametrize(
    "line, message",
    [
        ("start -n 0", "start at least one engine"),
        ("start -n -1", "start at least one engine"),
        ("start -n 1.5", "not a whole number"),
        ("start -n two", "not a whole number"),
        ("start --backend mpi", "invalid choice: 'mpi'"),
        ("start --backend nccl -n 99", "needs CUDA GPUs, one per rank"),  # more than any host has
        ("frobnicate", "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_start_input_starts_nothing(ip, line, message):
    before = {p.pid for p in cluster_processes()}
    with pytest.raises(ConfigError, match=message):
        ip.run_line_magic("nbtrain", line)
    assert {p.pid for p in cluster_processes()} - before == set()


def _subcommands():
    from nbtrain.magics.cluster import parser

    return sorted(next(a for a in parser()._actions if a.dest == "command").choices)


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_magic_and_subcommand_answers_help(ip, capsys, flag):
    ip.run_line_magic("load_ext", "nbtrain")
    names = _subcommands()
    assert {"start", "stop", "status", "diagnose", "groups", "scaling", "restart"} <= set(names)
    for line in ["", *names]:
        capsys.readouterr()
        assert ip.run_line_magic("nbtrain", f"{line} {flag}".strip()) is None
        out = capsys.readouterr().out
        assert out.startswith(f"usage: %nbtrain {line}".rstrip()), (line, out[:200])
    # the cell magic prints its help and runs nothing, with or without a cluster
    capsys.readouterr()
    assert ip.run_cell_magic("distributed", flag, "raise SystemExit('ran')") is None
    out = capsys.readouterr().out
    assert out.startswith("usage: %%distributed [--ranks RANKS]")
    assert "--group NAME" in out and "--output" in out


@pytest.mark.parametrize(
    "line, usage, hint",
    [
        ("start --backnd gloo", "usage: %nbtrain start [-h]", "did you mean --backend?"),
        ("diagnose --timout 3", "usage: %nbtrain diagnose [-h]", "did you mean --timeout?"),
        ("start --launcher rya", "usage: %nbtrain start [-h]", "did you mean ray?"),
        ("strat -n 2", "usage: %nbtrain [-h] COMMAND", "did you mean start?"),
    ],
)
def test_an_unknown_option_names_the_nearest_and_its_subcommands_usage(ip, line, usage, hint):
    ip.run_line_magic("load_ext", "nbtrain")
    with pytest.raises(ConfigError) as info:
        ip.run_line_magic("nbtrain", line)
    text = str(info.value)
    assert hint in text and usage in text, text
    if usage != "usage: %nbtrain [-h] COMMAND":
        assert "usage: %nbtrain [-h] COMMAND" not in text


def test_distributed_unknown_option_names_the_nearest(ip):
    ip.run_line_magic("load_ext", "nbtrain")
    with pytest.raises(ConfigError) as info:
        ip.run_cell_magic("distributed", "--rnaks 0", "pass")
    text = str(info.value)
    assert "unrecognized arguments: --rnaks 0; did you mean --ranks?" in text
    assert "usage: %%distributed [--ranks RANKS]" in text
    with pytest.raises(ConfigError, match="invalid choice: 'everyone'"):
        ip.run_cell_magic("distributed", "--output everyone", "pass")


def test_help_lists_the_ray_launcher():
    import nbtrain
    from nbtrain.magics.cluster import parser

    start = parser()._subcommand("start").format_help()
    assert "multi-node (--launcher ssh, slurm, mpi or ray)" in start
    assert 'launcher="ray"' in nbtrain.start.__doc__ and '"ray"' in nbtrain.start.__doc__
