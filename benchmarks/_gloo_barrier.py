"""torchrun baseline of bench_startup: init a gloo process group, barrier, report when ready, exit.

Run as `torchrun --standalone --nproc_per_node=2 _gloo_barrier.py`; rank 0 prints one JSON line.
"""

import json
import time

t_script = time.time()  # the worker's interpreter is up (torchrun already imported torch itself)

import torch.distributed as dist  # noqa: E402

t_imported = time.time()
dist.init_process_group("gloo")
t_group = time.time()
dist.barrier()
t_ready = time.time()
if dist.get_rank() == 0:
    print(
        json.dumps(
            {
                "t_script": t_script,
                "t_imported": t_imported,
                "t_group": t_group,
                "t_ready": t_ready,
                "world_size": dist.get_world_size(),
            }
        ),
        flush=True,
    )
dist.destroy_process_group()
