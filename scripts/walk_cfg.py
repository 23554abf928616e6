"""Walk `finetune`'s cfg: which files read an attribute of the SFTConfig, in order, and how often each
file is entered (a run of reads from one file counts once; coming back after another file is a re-entry).

    PYTHONPATH=. python scripts/walk_cfg.py [--eval] [--json out.json]

Runs one tiny finetune (a tiny Llama built from a config, 4 steps, an eval, a checkpoint) in this process.
Reads made by SFTConfig's own methods (config.py) are counted for their caller's file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def walk() -> list[tuple[str, str]]:
    import torch

    from nbtrain.configs import sft as config_mod
    from nbtrain.configs.sft import SFTConfig
    from nbtrain.model.tiny import make_tiny_model
    from nbtrain.recipes.train import finetune

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="walk-cfg-"))
    model = make_tiny_model(tmp / "model")
    data = str(ROOT / "nbtrain" / "data" / "examples" / "instructions.jsonl")
    cfg = SFTConfig(
        model=model,
        data=data,
        eval_data=data,
        output_dir=str(tmp / "run"),
        max_steps=4,
        per_device_train_batch_size=4,
        max_length=48,
        logging_steps=1,
        save_steps=2,
        eval_steps=2,
        lora_r=8,
        data_cache="off",
    )
    reads: list[tuple[str, str]] = []
    skip = {config_mod.__file__, __file__, "<string>"}
    real = SFTConfig.__getattribute__
    tracing = [False]

    def traced(self, name):  # type: ignore[no-untyped-def]
        if tracing[0] and self is cfg and not name.startswith("__"):
            f = sys._getframe(1)
            while f is not None and (
                f.f_code.co_filename in skip or "dataclasses" in f.f_code.co_filename
            ):
                f = f.f_back
            if f is not None:
                reads.append((f.f_code.co_filename, name))
        return real(self, name)

    SFTConfig.__getattribute__ = traced  # type: ignore[method-assign]
    try:
        tracing[0] = True
        finetune(cfg)
    finally:
        tracing[0] = False
        SFTConfig.__getattribute__ = real  # type: ignore[method-assign]
    return reads


def visits(reads: list[tuple[str, str]]) -> tuple[list[str], Counter[str]]:
    order: list[str] = []
    for f, _ in reads:
        if not order or order[-1] != f:
            order.append(f)
    return order, Counter(order)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    reads = walk()
    order, entered = visits(reads)
    rel = {
        f: str(Path(f).resolve().relative_to(ROOT)) if str(f).startswith(str(ROOT)) else f
        for f in entered
    }
    print(f"{len(reads)} attribute reads of cfg, {len(entered)} files, {len(order)} entries")
    for f, n in entered.most_common():
        names = sorted({a for g, a in reads if g == f})
        print(f"  {n:3d}x {rel[f]}: {', '.join(names)}")
    print("order:", " > ".join(Path(f).name for f in order))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "reads": len(reads),
                    "entered": {rel[f]: n for f, n in entered.items()},
                    "order": [rel[f] for f in order],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
