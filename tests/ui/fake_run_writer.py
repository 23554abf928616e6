"""Stand-in for `finetune`'s writer in the UI tests: a run being written, that honours stop.

It does what `nbtrain.sft` does to a run folder, minus the training: registers the folder in the
runs registry (``nbtrain.runs``), appends one ``metrics.jsonl`` row per step, updates the record's
step / loss / tokens_per_s, and checks the stop flag at each step boundary; asked to stop, it writes
a ``checkpoint-<step>`` marker and ends the run as ``stopped``. Using it keeps the UI tests
independent of torch and of how fast a real model trains on a shared CPU.

    python tests/ui/fake_run_writer.py OUTPUT_DIR --steps 1000 --interval 0.25
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from nbtrain import runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1000, help="total steps to write")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds per step")
    parser.add_argument("--name", default="live-sft", help="run name shown in the sidebar")
    args = parser.parse_args()

    args.output_dir.mkdir(parents=True, exist_ok=True)
    run_id = runs.register_run(args.output_dir, name=args.name, total_steps=args.steps)
    print(run_id, flush=True)  # the test reads the id from the first line
    metrics = args.output_dir / "metrics.jsonl"
    with metrics.open("a") as f:
        for step in range(1, args.steps + 1):
            if runs.stop_requested(run_id):
                (args.output_dir / f"checkpoint-{step - 1}").mkdir(exist_ok=True)
                runs.finish_run(run_id, "stopped")
                return 0
            loss = 0.8 + 2.0 * math.exp(-step / 60) + 0.05 * math.sin(step)
            tps = 3100 + 200 * math.sin(step / 7)
            row = {
                "step": step,
                "loss": round(loss, 4),
                "grad_norm": round(1.0 / math.sqrt(step), 4),
                "learning_rate": 2e-4 * min(1.0, step / 10),
                "tokens_per_s": round(tps, 1),
                "step_time": args.interval,
                "epoch": round(step / args.steps, 4),
            }
            if step % 10 == 0:
                row["eval_loss"] = round(loss + 0.1, 4)
            f.write(json.dumps(row) + "\n")
            f.flush()
            runs.update_run(run_id, step=step, loss=row["loss"], tokens_per_s=row["tokens_per_s"])
            time.sleep(args.interval)
    runs.finish_run(run_id, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
