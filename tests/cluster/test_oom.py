"""Out of memory on a rank (`nbtrain/engine/oom.py`): the message, the grouping, the memory given back.

On CPU the engines raise torch's real `OutOfMemoryError` class with the text torch's CUDA allocator
writes, from inside a function that holds a large tensor, so the hook, the client's grouping and the
release of the failed frames all run for real; `tests/cluster/faults/test_faults_gpu.py` runs a real CUDA OOM.
"""

from __future__ import annotations

import socket

import pytest

import nbtrain
from nbtrain.engine import oom
from nbtrain.errors import DistributedCellError

pytestmark = pytest.mark.timeout(240)

# what c10/cuda/CUDACachingAllocator.cpp writes (torch 2.x), sizes as its format_size prints them
TORCH_TEXT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "1.50 GiB is free. Including non-PyTorch memory, this process has 77.68 GiB memory in use. Of the "
    "allocated memory 76.20 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def test_parse_reads_the_sizes_from_torch_text():
    sizes = oom.parse(TORCH_TEXT)
    assert sizes == {
        "alloc": "2.00 GiB",
        "gpu": "0",
        "total": "79.19 GiB",
        "free": "1.50 GiB",
        "in_use": "77.68 GiB",
        "by_torch": "76.20 GiB",
        "reserved_free": "512.00 MiB",
    }
    assert oom.to_bytes("512.00 MiB") == 512 * 2**20
    assert oom.to_bytes("1023 bytes") == 1023
    assert oom.summary(TORCH_TEXT) == "tried to allocate 2.00 GiB; 1.50 GiB of 79.19 GiB free"
    assert oom.is_oom("OutOfMemoryError", "")
    assert oom.is_oom("RuntimeError", "CUDA error: out of memory\nCUDA kernel errors ...")
    assert not oom.is_oom("RuntimeError", "DefaultCPUAllocator: not enough memory")


def test_explain_without_cuda_names_rank_host_sizes_and_fixes(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    note = oom.explain(TORCH_TEXT, now={})
    assert note.startswith(f"nbtrain: rank 3 on {socket.gethostname()} ran out of GPU memory")
    assert "tried to allocate 2.00 GiB with 1.50 GiB of 79.19 GiB free" in note
    assert "per_device_train_batch_size" in note and "max_length" in note
    assert "gradient_checkpointing=True" in note and '"auto"' in note
    assert "mem_get_info" not in note  # no CUDA: nothing measured, nothing claimed
    now = {
        "device": "cuda:0",
        "name": "NVIDIA H100",
        "free": 1.5 * 2**30,
        "total": 79.19 * 2**30,
        "allocated": 76.2 * 2**30,
        "reserved": 76.7 * 2**30,
    }
    note = oom.explain(TORCH_TEXT, now=now)
    assert "(cuda:0, NVIDIA H100)" in note
    assert "torch.cuda.mem_get_info said 1.50 GiB of 79.19 GiB free" in note


@pytest.fixture(scope="module")
def cluster():
    c = nbtrain.start(n=2, force=True)
    yield c
    c.stop()


# rank 1 (or `ranks`) runs out of "GPU memory" inside a function that holds a 64 MiB tensor: only the
# traceback's frames keep it alive, as activations are kept in a real OOM
CELL = """
import sys, weakref, torch
TEXT = {text!r}
def forward():
    activations = torch.ones(16 * 2**20)
    global probe
    probe = weakref.ref(activations)
    raise torch.OutOfMemoryError(TEXT.replace("1.50 GiB is free", f"{{1.5 + rank}}0 GiB is free"))
probe = None
if rank in {ranks}:
    forward()
"""


def test_oom_in_a_cell_names_rank_sizes_fixes_and_releases(cluster):
    with pytest.raises(DistributedCellError) as info:
        cluster.execute(CELL.format(text=TORCH_TEXT, ranks=[1]), live=False)
    text = str(info.value)
    host = cluster.ranks[1].host
    assert "the cell failed on 1 of 2 rank(s)" in text
    assert f"nbtrain: rank 1 on {host} ran out of GPU memory" in text
    assert "tried to allocate 2.00 GiB with 2.50 GiB of 79.19 GiB free" in text
    assert "gradient_checkpointing=True" in text and "per_device_train_batch_size" in text
    assert "nbtrain released the failed code's tensors" in text
    # the remote traceback is kept: the frame that ran out
    assert "forward()" in text and "OutOfMemoryError" in text
    [group] = info.value.failures
    assert group["ranks"] == [1] and group["ename"] == "OutOfMemoryError"
    # the next cell runs, and the tensor the failed frame held is gone
    released = cluster.run(_released)
    assert released == [{"freed": True, "last_traceback": None}] * 2


def _released():
    import sys

    from IPython import get_ipython

    ns = get_ipython().user_ns
    probe = ns.get("probe")
    return {
        "freed": probe is None or probe() is None,
        "last_traceback": getattr(sys, "last_traceback", None),
    }


def test_oom_on_every_rank_is_one_group_with_each_ranks_sizes(cluster):
    with pytest.raises(DistributedCellError) as info:
        cluster.execute(CELL.format(text=TORCH_TEXT, ranks=[0, 1]), live=False)
    text = str(info.value)
    assert len(info.value.failures) == 1
    assert info.value.failures[0]["ranks"] == [0, 1]
    assert "Out of GPU memory on each rank:" in text
    for r, free in ((0, "1.50"), (1, "2.50")):
        line = f"rank {r} on {cluster.ranks[r].host}: tried to allocate 2.00 GiB; {free} GiB of 79.19 GiB free"
        assert line in text
    assert cluster.run(_released) == [{"freed": True, "last_traceback": None}] * 2


def _oom_in_apply(text):
    import torch

    held = torch.ones(2**20)  # noqa: F841 (held by the frame, as activations would be)
    raise torch.OutOfMemoryError(text)


def test_oom_in_cluster_run_is_annotated_too(cluster):
    with pytest.raises(DistributedCellError) as info:
        cluster.run(_oom_in_apply, TORCH_TEXT, ranks=[0])
    text = str(info.value)
    assert f"nbtrain: rank 0 on {cluster.ranks[0].host} ran out of GPU memory" in text
    assert "gradient_checkpointing=True" in text
    # the cluster and its process group are fine afterwards
    assert cluster.run(_all_reduce_one) == [2.0, 2.0]


def _all_reduce_one():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_client_adds_the_fixes_when_the_engine_did_not(cluster):
    # an engine without the hook (nbtrain's hook on, but a plain RuntimeError text from cudaMalloc)
    from nbtrain.cluster.failures import group_failures

    class Remote(Exception):
        ename = "RuntimeError"
        evalue = "CUDA error: out of memory"
        traceback = ["RuntimeError: CUDA error: out of memory"]

    message, groups = group_failures(cluster.ranks, [(0, Remote()), (1, Remote())], total=2)
    assert len(groups) == 1 and groups[0]["ranks"] == [0, 1]
    assert oom.FIXES in message
