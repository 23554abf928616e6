"""Worker of bench_rank_cpu: a warm-up fine-tune, then the measured one, in the same process.

`CONFIG_JSON cold` skips the warm-up: the measured fine-tune is the process's first (as in
bench_finetune's torchrun variant).

Runs under torchrun, or as a `%%distributed` cell (sys.argv set by the cell). Prints one line per rank:
`RANK_CPU {"rank": r, "cpu_s": ..., "wall_s": ...}`: the main thread's CPU time (time.thread_time) and
the wall time of the measured fine-tune.
"""

import json
import os
import sys
import time

import nbtrain

cfg = json.loads(sys.argv[1])
if sys.argv[2:] != ["cold"]:
    # imports, allocator and caches warm in both launchers alike: only then is per-step work comparable
    warm = dict(cfg, max_steps=20, output_dir=cfg["output_dir"] + "-warm")
    nbtrain.finetune(nbtrain.SFTConfig(**warm))
cpu0, wall0 = time.thread_time(), time.perf_counter()
nbtrain.finetune(nbtrain.SFTConfig(**cfg))
report = {
    "rank": int(os.environ["RANK"]),
    "cpu_s": time.thread_time() - cpu0,
    "wall_s": time.perf_counter() - wall0,
}
print("RANK_CPU " + json.dumps(report), flush=True)
