"""One nbtrain arm of bench_data: a 1-step `nbtrain.finetune`, timed from process start to the first step.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 _data_rank.py CONFIG_JSON   # 2 ranks
    python _data_rank.py CONFIG_JSON                                                       # 1 process

The clock is read before any import; the process's start (interpreter start-up included) comes from
/proc/self/stat. The end of the first optimizer step is taken from a global optimizer step post-hook
(`torch.optim.optimizer.register_optimizer_step_post_hook`: it fires inside `finetune`, whatever
optimizer nbtrain builds), so the adapter export after the step is not counted. Each rank prints one
JSON line.
"""

import time

T_SCRIPT = time.time()  # before the imports

import _common  # noqa: E402  (stdlib only: a few ms)

PROC_START = _common.process_start()

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from dataclasses import fields  # noqa: E402

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import nbtrain  # noqa: E402

T_IMPORTED = time.time()
first_step: list[float] = []


def _on_step(optimizer, args, kwargs):  # noqa: ANN001, ARG001
    if not first_step:
        first_step.append(time.time())


register_optimizer_step_post_hook(_on_step)

cfg = json.loads(sys.argv[1])
if "data_cache" in cfg and "data_cache" not in {f.name for f in fields(nbtrain.SFTConfig)}:
    # the field is new: older nbtrain reads the cache folder from the environment only
    cfg.pop("data_cache")
t0 = time.time()
result = nbtrain.finetune(nbtrain.SFTConfig(**cfg))
t_end = time.time()

print(
    json.dumps(
        {
            "rank": int(os.environ.get("RANK", "0")),
            "world": int(os.environ.get("WORLD_SIZE", "1")),
            "threads": torch.get_num_threads(),
            "proc_start": PROC_START,
            "script_start": T_SCRIPT,
            "imported": T_IMPORTED,
            "finetune_start": t0,
            "first_step_end": first_step[0] if first_step else None,
            "finetune_end": t_end,
            "steps": result.global_step,
            # Linux reports kilobytes
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "plan": {
                k: v for k, v in (result.plan or {}).items() if isinstance(v, int | float | str)
            },
        }
    ),
    flush=True,
)
