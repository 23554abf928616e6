"""A real `finetune` run for the UI tests: a tiny model trains until the browser's Stop ends it.

Builds a tiny causal LM from a config (nothing is downloaded), then runs `nbtrain.finetune` in a plain
process with one logged row per step, so the run folder, the runs registry and the stop flag are
exactly what a notebook run produces. Prints the run id on its first line once the run is registered
and has logged its first step; exits 0 when the run ends (stopped from the UI, or after `--steps`).

    python tests/ui/run_writer.py OUTPUT_DIR --steps 1000
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()

    model = make_tiny_model(args.output_dir.parent / "tiny-model", hidden_size=128, num_layers=4)
    cfg = nbtrain.SFTConfig(
        model=model,
        data=instructions_path(),
        output_dir=str(args.output_dir),
        run_name=args.name,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        logging_steps=1,
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
