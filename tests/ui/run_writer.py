"""A real `finetune` run for the UI tests: a tiny model trains until the browser's Stop ends it.

Builds a tiny causal LM from a config (nothing is downloaded), then runs `nbtrain.finetune` in a plain
process with one logged row per step, so the run folder, the runs registry and the stop flag are
exactly what a notebook run produces. Prints the run id on its first line once the run is registered
and has logged its first step; exits 0 when the run ends (stopped from the UI, or after `--steps`).

    python tests/ui/run_writer.py OUTPUT_DIR --steps 1000
    python tests/ui/run_writer.py runs/lr-1e-2 --steps 20 --lr 1e-2 --eval-steps 5 --name lr-1e-2
    python tests/ui/run_writer.py runs/s --steps 12 --sample-steps 4   # completions every 4 steps

With ``--sample-steps`` the run samples `SAMPLE_PROMPTS` while it trains (``SFTConfig(sample_prompts=...,
sample_steps=...)``), into ``output_dir/samples.jsonl``. Where this checkout's finetune cannot sample
yet (no ``nbtrain.generation.sampling``), the writer writes that file itself once the run ends: a row per
prompt at step 0, every N steps and the last, in the same layout, completions made up from the prompt
(a stand-in, said so in each completion), so the Lab's Samples section is tested against the file a
run writes until finetune writes it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import nbtrain
from nbtrain import runs
from nbtrain.data.examples import instructions_path
from nbtrain.model.tiny import make_tiny_model

#: prompts of very different lengths, one with a reference (the data file's completion) and one long
#: enough that its text has to wrap
SAMPLE_PROMPTS = [
    {"prompt": "What is the opposite of left?\nAnswer: ", "completion": "right"},
    {"prompt": "Say hi"},
    {
        "prompt": "Write a short story about a lighthouse keeper who counts the ships that pass "
        "each night, and what she finds one morning on the rocks below the light. "
        "Keep it under a hundred words, and end it with a question."
    },
]


def sampling_in_finetune() -> bool:
    """Whether this checkout's finetune samples while it trains (SFTConfig.sample_prompts)."""
    return importlib.util.find_spec("nbtrain.generation.sampling") is not None


def write_stand_in_samples(out: Path, steps: int, every: int) -> None:
    """samples.jsonl as finetune writes it, for a finetune that cannot sample yet (see the module doc)."""
    at = sorted({0, *range(every, steps, every), steps})
    lines = []
    for step in at:
        for index, row in enumerate(SAMPLE_PROMPTS):
            words = row["prompt"].split()
            completion = (
                f"[stand-in at step {step}] "
                + " ".join(words[: 2 + step % 7])
                + ("\nsecond line of the answer" if index == 2 else "")
                + (" and a long tail" * (8 if index == 2 else 0))
            )
            lines.append(
                json.dumps(
                    {
                        "step": step,
                        "index": index,
                        "prompt": row["prompt"],
                        "completion": completion,
                        "reference": row.get("completion"),
                        "tokens": len(completion.split()),
                        "seconds": 0.01,
                    }
                )
            )
    (out / runs.SAMPLES_FILE).write_text("".join(line + "\n" for line in lines))


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
    parser.add_argument(
        "--sample-steps", type=int, default=None, help="sample SAMPLE_PROMPTS every N steps"
    )
    args = parser.parse_args()
    real_sampling = args.sample_steps is not None and sampling_in_finetune()
    sampling = {}
    if real_sampling:
        # as a data file (a row's completion stands as the reference), one beside the run folders,
        # so that runs compared side by side do not differ in their sample_prompts setting
        prompts = args.output_dir.parent / "sample-prompts.jsonl"
        prompts.parent.mkdir(parents=True, exist_ok=True)
        tmp = prompts.with_name(f".{prompts.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in SAMPLE_PROMPTS))
        os.replace(tmp, prompts)
        sampling = {
            "sample_prompts": str(prompts),
            "sample_steps": args.sample_steps,
            # few tokens: each sampled step generates for every prompt, on a loaded CI machine
            "sample_max_new_tokens": 8,
        }
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
        **sampling,
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
    if args.sample_steps is not None and not real_sampling and "r" in result:
        write_stand_in_samples(args.output_dir, args.steps, args.sample_steps)
    return 0 if "r" in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
