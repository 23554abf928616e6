"""torchrun baseline of bench_finetune: the same `nbtrain.finetune` LoRA run, launched by torchrun.

Run as `OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 _torchrun_finetune.py CONFIG_JSON`.
`finetune` sees torchrun's environment and makes the gloo process group itself; rank 0 writes
`output_dir/metrics.jsonl`, which the benchmark reads. Each rank prints one JSON line.
"""

import json
import os
import sys
import time

import torch

import nbtrain

cfg = nbtrain.SFTConfig(**json.loads(sys.argv[1]))
t0 = time.perf_counter()
result = nbtrain.finetune(cfg)
print(
    json.dumps(
        {
            "rank": int(os.environ["RANK"]),
            "threads": torch.get_num_threads(),
            "finetune_s": time.perf_counter() - t0,
            "steps": result.global_step,
        }
    ),
    flush=True,
)
