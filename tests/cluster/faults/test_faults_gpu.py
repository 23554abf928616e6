"""GPU faults on a real CUDA device and a real NCCL group: out of memory, and collectives the GPU has
not finished (`nbtrain/engine/oom.py`, `nbtrain/engine/faults.py::collectives`).

One GPU is enough: a 1-rank NCCL group. A collective is kept from completing by a spin kernel queued
before it on the same stream (`torch.cuda._sleep`), which is what a peer that never joins looks like
from this rank's flight recorder.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

import nbtrain
from nbtrain.engine import oom
from nbtrain.errors import CellTimeoutError, DistributedCellError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (CUDA out-of-memory and the NCCL flight recorder)",
    ),
]

GiB = 2**30
# ~10 s of GPU time on an H100 (1.98 GHz); the tests need the collective pending for a second or two
SPIN = 20_000_000_000


@pytest.fixture(scope="module")
def cluster():
    c = nbtrain.start(n=1, backend="nccl", force=True)
    yield c
    c.stop()


FILL = """
import torch
def fill():
    held = []  # only the failed frame holds these, as activations are held in a real OOM
    while True:
        held.append(torch.empty(4 * 2**30, dtype=torch.uint8, device=device))
fill()
"""


def test_cuda_oom_names_sizes_and_fixes_and_gives_the_memory_back(cluster):
    cluster.execute("import torch\nbase = torch.cuda.memory_allocated()\n", live=False)
    with pytest.raises(DistributedCellError) as info:
        cluster.execute(FILL, live=False)
    text = str(info.value)
    host = cluster.ranks[0].host
    assert "OutOfMemoryError" in text and "fill()" in text  # torch's error, the remote traceback
    assert f"nbtrain: rank 0 on {host} (cuda:0, " in text
    # torch prints what was free in MiB below 1 GiB
    m = re.search(r"it tried to allocate 4\.00 GiB with ([\d.]+ \w+) of ([\d.]+ GiB) free", text)
    assert m, text
    assert oom.to_bytes(m[1]) < 4 * GiB < oom.to_bytes(m[2])
    assert "torch.cuda.mem_get_info said" in text
    assert "gradient_checkpointing=True" in text and "per_device_train_batch_size" in text
    # the figure taken while the error is reported: on the H100 (2026-11-23) only 2 of 79 GiB were back
    # at that point, inside IPython's exception handling; what matters is the next cell, below
    assert re.search(r"cached blocks \(([\d.]+ \w+) of ([\d.]+) GiB free while the error", text), (
        text
    )
    # the next cell: allocations are back at the baseline and a large one works
    cluster.execute(
        "after = torch.cuda.memory_allocated() - base\n"
        "x = torch.ones(4 * 2**30, dtype=torch.uint8, device=device)\n"
        "ok = int(x.sum().item()) == 4 * 2**30\n"
        "del x\n",
        live=False,
    )
    assert cluster.pull("after") == [pytest.approx(0, abs=64 * 2**20)]
    assert cluster.pull("ok") == [True]


def _all_reduce_cuda():
    import torch
    import torch.distributed as dist

    t = torch.ones(8, device="cuda")
    dist.all_reduce(t)
    return t.sum().item()


def _fault_env():
    return {
        k: os.environ.get(k)
        for k in (
            "TORCH_FR_BUFFER_SIZE",
            "TORCH_NCCL_DUMP_ON_TIMEOUT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        )
    }


def test_nccl_flight_recorder_is_on_and_read(cluster):
    from nbtrain.engine.faults import NCCL_DEFAULTS, set_env_defaults

    # engines inherit this process's environment: what is set here is the user's and must be kept
    env = dict(os.environ)
    set_env_defaults(env, {})
    assert cluster.run(_fault_env) == [{k: env.get(k) for k in NCCL_DEFAULTS}]
    assert cluster.run(_all_reduce_cuda) == [8.0]
    deadline = time.monotonic() + 10
    while True:
        fr = cluster.stacks()[0]["collectives"]
        last = fr["entries"][-1] if fr.get("entries") else {}
        if last.get("state") == "completed" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert fr["available"] and fr["recorder"] == "nccl" and fr["backend"] == "nccl", fr
    assert (
        last["op"] == "nccl:all_reduce" and last["sizes"] == [[8]] and last["dtypes"] == ["Float"]
    )
    assert last["state"] == "completed" and not last["pending"] and fr["pending"] == []
    diag = cluster.diagnose()
    assert "error" not in diag.stacks[0] and "--- rank 0 on" in diag.text
    assert "flight recorder: every rank's last collective is #" in diag.text
    assert "(nccl:all_reduce)" in diag.text


def test_collective_pending_on_the_gpu_shows_in_diagnose(cluster):
    cluster.execute(
        "import torch, torch.distributed as dist\n"
        f"torch.cuda._sleep({SPIN})\n"
        "work = dist.all_reduce(torch.ones(3, 2, device=device), async_op=True)\n",
        live=False,
    )
    diag = cluster.diagnose()
    assert list(diag.waiting) == [0], diag.text
    what = diag.waiting[0]
    assert (
        "nccl:all_reduce of 3x2 Float in pg 0 (default_pg), scheduled, issued at <cell>:3" in what
    )
    assert what.endswith("not completed; meanwhile idle (no cell running)")
    assert "not completed (flight recorder, nccl):" in diag.text
    cluster.execute("work.wait()\ntorch.cuda.synchronize()\n", live=False)
    deadline = time.monotonic() + 10
    while cluster.diagnose().waiting and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.diagnose().waiting == {}


def test_timeout_while_the_gpu_holds_a_collective(cluster):
    # the rank's Python waits in .item() for a collective stuck behind the spin: --timeout shows both
    code = (
        "import torch, torch.distributed as dist\n"
        f"torch.cuda._sleep({SPIN})\n"
        "t = torch.ones(256, device=device)\n"
        "dist.all_reduce(t)\n"
        "print(t.sum().item())\n"
    )
    with pytest.raises(CellTimeoutError) as info:
        cluster.execute(code, timeout=2, live=False)
    text = str(info.value)
    assert "waiting in a collective: rank 0: #" in text, text
    assert "nccl:all_reduce of 256 Float in pg 0 (default_pg)" in text
    assert "issued at <cell>:4" in text and "print(t.sum().item())" in text
    # the rank is usable again (interrupted, or replaced if still blocked in CUDA)
    assert cluster.run(_all_reduce_cuda) == [8.0]
