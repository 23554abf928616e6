"""A real `finetune` run for the UI tests: a tiny model trains until the browser's Stop ends it.

Builds a tiny causal LM from a config (nothing is downloaded), then runs `nbtrain.finetune` in a plain
process with one logged row per step, so the run folder, the runs registry and the stop flag are
exactly what a notebook run produces. Prints the run id on its first line once the run is registered
and has logged its first step; exits 0 when the run ends (stopped from the UI, or after `--steps`).

    python tests/ui/run_writer.py OUTPUT_DIR --steps 1000
    python tests/ui/run_writer.py runs/lr-1e-2 --steps 20 --lr 1e-2 --eval-steps 5 --name lr-1e-2
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import nbtrain
from nbtrain import runs
from nbtrain.data import instructions_path
from nbtrain.sft.tiny import make_tiny_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1000, help="max_steps of the run")
    parser.add_argument("--name", default="live-sft", help="run name shown in the sidebar")
    parser.add_argument(
        "--model",
        default=None,
        help="a tiny model folder another writer built (default: build one)",
    )
    parser.add_argument("--lr", type=float, default=5e-3, help="learning_rate of the run")
    parser.add_argument(
        "--eval-steps", type=int, default=None, help="evaluate on 8 rows every N steps"
    )
    args = parser.parse_args()

    eval_rows = [json.loads(x) for x in Path(instructions_path()).read_text().splitlines()[:8]]
    model = args.model or make_tiny_model(
        args.output_dir.parent / "tiny-model", hidden_size=128, num_layers=4
    )
    cfg = nbtrain.SFTConfig(
        model=model,
        data=instructions_path(),
        output_dir=str(args.output_dir),
        run_name=args.name,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=args.lr,
        logging_steps=1,
        eval_data=eval_rows if args.eval_steps else None,
        eval_steps=args.eval_steps,
        save_steps=10_000,
        max_length=128,
        overwrite=True,
    )
    run_id = runs.run_id_for(args.output_dir)
    # stdout carries the run id alone; finetune's log lines go to stderr
    out, sys.stdout = sys.stdout, sys.stderr
    result: dict[str, object] = {}
    trainer = threading.Thread(target=lambda: result.update(r=nbtrain.finetune(cfg)))
    trainer.start()
    while trainer.is_alive():
        record = runs.get_run(run_id)
        if record and record.get("state") == "running" and (record.get("step") or 0) > 0:
            break
        time.sleep(0.1)
    print(run_id, file=out, flush=True)  # the test reads the id from the first line
    trainer.join()
    return 0 if "r" in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
