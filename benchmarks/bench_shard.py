"""Peak GPU memory and tokens/s of LoRA on one GPU: nbtrain's shard="ddp", shard="fsdp" (1 GPU: the
sharded code path, no saving), QLoRA (load_in_4bit) alone and with shard="fsdp", against HF Trainer +
peft in bf16 and in 4 bits.

    python benchmarks/bench_shard.py [--shape llama-3.1-8b] [--seq 2048] [--global-batch 4] [--steps 16]
                                     [--warmup 4] [--arms nbtrain-ddp,nbtrain-fsdp,nbtrain-qlora,
                                                           nbtrain-qlora-fsdp,hf,hf-qlora]
                                     [--json benchmarks/results/shard.json]

Needs a CUDA GPU (and bitsandbytes for the QLoRA arms); `--shape tiny` runs the arms but hf-qlora on the
CPU in a minute (bitsandbytes' CPU kernels for nbtrain's QLoRA), to check the script itself (no
meaningful numbers). Every arm runs in its own process
on the same model (random weights in a real architecture's shape, built and saved once, see
bench_gpu.py), the same rows of exactly `--seq` tokens, LoRA r16 on all linear layers, micro-batch 1 with
gradient checkpointing, so the peak is the model's and the optimizer's, not the batch's. tokens/s counts
the steps after `--warmup`. The memory the formula predicts (nbtrain.model.memory.rank_memory) is printed
beside each measured peak.

Not run on the machine this was written on (it has no GPU): no results are recorded yet.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import bench_gpu as G  # noqa: E402

ARMS = ("nbtrain-ddp", "nbtrain-fsdp", "nbtrain-qlora", "nbtrain-qlora-fsdp", "hf", "hf-qlora")


def arm_nbtrain(
    args: argparse.Namespace, model_dir: Path, data: Path, work: Path
) -> dict[str, Any]:
    import torch

    import nbtrain

    kind = args.arm.split("-", 1)[1]
    cfg = nbtrain.SFTConfig(
        model=str(model_dir),
        data=str(data),
        output_dir=str(work / args.arm),
        overwrite=True,
        max_steps=args.steps,
        per_device_train_batch_size=1,
        global_batch_size=args.global_batch,
        max_length=args.seq,
        learning_rate=G.LR,
        logging_steps=1,
        save_steps=None,
        gradient_checkpointing=True,
        lora_dropout=0.0,
        shard="fsdp" if kind.endswith("fsdp") else "ddp",
        load_in_4bit=kind.startswith("qlora"),
    )
    result = nbtrain.finetune(cfg)
    rates = result.history["tokens_per_s"].to_numpy()[args.warmup :]
    out: dict[str, Any] = {"tok_s": float(rates.mean()) if len(rates) else None}
    if torch.cuda.is_available():
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def arm_hf(args: argparse.Namespace, model_dir: Path, data: Path, work: Path) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16 if on_gpu else torch.float32}
    if args.arm == "hf-qlora":  # peft's QLoRA recipe
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.config.use_cache = False
    if args.arm == "hf-qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    elif on_gpu:
        model = model.to("cuda")
    # the LoRA settings of the nbtrain arms (SFTConfig's defaults, as bench_gpu's)
    lora = LoraConfig(
        r=G.LORA["lora_r"],
        lora_alpha=G.LORA["lora_alpha"],
        lora_dropout=G.LORA["lora_dropout"],
        target_modules=G.LORA["target_modules"],
    )
    model = get_peft_model(model, lora)
    ids = G.tokenized([json.loads(x) for x in data.read_text().splitlines()], model_dir)
    clock = C.StepClock()
    targs = TrainingArguments(
        output_dir=str(work / args.arm),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.global_batch,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        max_steps=args.steps,
        learning_rate=G.LR,
        bf16=on_gpu,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        use_cpu=not on_gpu,
    )
    train = [{"input_ids": x, "labels": x} for x in ids]
    Trainer(model=model, args=targs, train_dataset=train, callbacks=[clock.callback()]).train()
    steps, seconds = clock.window(args.warmup)
    out: dict[str, Any] = {"tok_s": steps * args.global_batch * args.seq / seconds}
    if on_gpu:
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def predicted_gb(shape: str, arm: str, seq: int) -> float | None:
    from transformers import AutoConfig

    from nbtrain.model.memory import Shape, rank_memory

    s = Shape.from_config(AutoConfig.for_model(**G.SHAPES[shape]))
    if s is None:
        return None
    quant = "nf4" if "qlora" in arm else None
    shard = "fsdp" if arm.endswith("fsdp") else "ddp"
    return rank_memory(s, shard=shard, world=1, quant=quant, seq_len=seq)["total"] / 2**30


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(G.SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "shard.json"))
    p.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in the child process
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    work = Path(__file__).resolve().parent / "_work"
    model_dir = work / args.shape
    data = work / f"rows-{args.shape}-{args.seq}.jsonl"
    if args.arm:
        run = arm_nbtrain if args.arm.startswith("nbtrain") else arm_hf
        Path(args.out).write_text(json.dumps(run(args, model_dir, data, work)))
        return

    import torch

    if not torch.cuda.is_available() and args.shape != "tiny":
        sys.exit(
            "bench_shard.py measures GPU memory: run it on a CUDA GPU (or --shape tiny on the CPU)"
        )
    arms = [a for a in args.arms.split(",") if a]
    if not torch.cuda.is_available():
        # hf-qlora's recipe places the model on GPU 0
        arms = [a for a in arms if a != "hf-qlora"]
    work.mkdir(exist_ok=True)
    G.build_model(args.shape, work)
    n = args.global_batch * (args.steps + 1)
    data.write_text(
        "\n".join(
            json.dumps(r) for r in G.make_rows(G.SHAPES[args.shape]["vocab_size"], args.seq, n)
        )
    )
    record: dict[str, Any] = {
        "shape": args.shape,
        "seq": args.seq,
        "device": G.device_name(),
        "arms": {},
    }
    for arm in arms:
        out = work / f"{arm}.json"
        cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--arm", arm, "--out", str(out)]
        done = subprocess.run(cmd, check=False)
        result = json.loads(out.read_text()) if done.returncode == 0 else {"error": done.returncode}
        result["predicted_gb"] = predicted_gb(args.shape, arm, args.seq)
        record["arms"][arm] = result
        print(f"{arm:14s} {result}", flush=True)
    path = Path(args.json)
    history = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    history["runs"].append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history, indent=2))


if __name__ == "__main__":
    main()
