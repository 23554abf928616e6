"""LoRA fine-tuning throughput on one GPU: nbtrain against HF Trainer + peft and a bare torch loop.

    python benchmarks/bench_gpu.py [--shape llama-3.1-8b] [--seq 2048] [--global-batch 4] [--steps 24]
                                   [--warmup 8] [--nbtrain-micro auto] [--baseline-micro 1]
                                   [--compile/--no-compile] [--arms nbtrain,hf,bare] [--json benchmarks/results/gpu.json]

One run, the same model, data and training settings in three arms:
  nbtrain  `nbtrain.finetune(SFTConfig(...))` in a `%%distributed` cell (`Cluster.execute`, the call the
           magic makes) on a 1-engine cluster started by `nbtrain.start()`
  hf       transformers' Trainer with a peft LoRA model, bf16, fused AdamW, as its users run it
  bare     a hand-written loop: peft model, bf16 autocast, `model(input_ids, labels=...)`, AdamW
The model has a real architecture's shape with random weights, built from its config on the GPU and
saved with `save_pretrained` (nothing is downloaded); every arm loads it with `from_pretrained`. The data
is rows of exactly `--seq` tokens of random words, so every arm trains on full rows with no padding,
as packed text gives. LoRA r16, alpha 32, dropout 0, on all linear layers; lr 2e-4; the same global batch
(`--global-batch` rows per optimizer step) in every arm; each arm may split it into micro-batches
(nbtrain: `--nbtrain-micro`, default "auto"; HF and bare: `--baseline-micro`, default 1, since their
logits do not fit at larger batches of an 8B model), with gradient accumulation making up the rest.
tokens/s counts the steps after `--warmup`. MFU = tokens/s x 4 x parameters / the GPU's dense bf16 peak
(NeMo's convention: the frozen weights need no weight gradients, attention is left out).

Appends one record to benchmarks/results/gpu.json ({"runs": [...]}) and rewrites the GPU table in
benchmarks/RESULTS.md. `--shape tiny` runs the same code on the CPU in seconds (tests/test_benchmarks_smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
}
LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LR = 2e-4


def build_model(shape: str, folder: Path) -> Path:
    """The shape's model with random weights and a word-level tokenizer, saved once under `folder`."""
    out = folder / shape
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    spec = dict(SHAPES[shape])
    vocab = spec["vocab_size"]
    config = AutoConfig.for_model(**spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # one token per word: w0 ... w{vocab-2}, and the eos token last
    words = {f"w{i}": i for i in range(vocab - 1)}
    words["<eos>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    tmp = folder / f".tmp-{shape}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"built {shape} in {time.perf_counter() - t0:.1f} s -> {out}", file=sys.stderr)
    return out


def make_rows(vocab: int, seq: int, n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` text rows of `seq - 1` random words: with the eos finetune appends, `seq` tokens each."""
    import random

    rng = random.Random(seed)
    return [
        {"text": " ".join(f"w{rng.randrange(vocab - 1)}" for _ in range(seq - 1))} for _ in range(n)
    ]


def tokenized(rows: list[dict[str, str]], model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(r["text"])["input_ids"] + [tok.eos_token_id] for r in rows]


def peak_flops() -> float | None:
    """Dense bf16 peak of this GPU, from nbtrain's own table (None: unknown GPU or CPU)."""
    import torch

    from nbtrain.telemetry.report import peak_bf16_flops

    if not torch.cuda.is_available():
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(0))


# ------------------------------------------------------------------------------------------- arms
def arm_nbtrain(
    args: argparse.Namespace, model_dir: Path, data: Path, work: Path
) -> dict[str, Any]:
    import nbtrain

    cfg = {
        "model": str(model_dir),
        "data": str(data),
        "output_dir": str(work / "nbtrain-run"),
        "overwrite": True,
        "max_steps": args.steps,
        "max_length": args.seq,
        "per_device_train_batch_size": args.nbtrain_micro,
        "global_batch_size": args.global_batch,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "logging_steps": args.warmup,
        "save_steps": None,
        "torch_compile": args.compile,
        "seed": 0,
        **LORA,
    }
    cluster = nbtrain.start(n=1, force=True)
    try:
        code = (
            "import nbtrain\n"
            f"_bench = nbtrain.finetune(nbtrain.SFTConfig(**{cfg!r}))\n"
            "_rows = _bench.history.to_dict('records')\n"
            "_plan = _bench.plan\n"
        )
        cluster.execute(code, output="rank0", live=True)
        rows = cluster.pull("_rows")[0]
        plan = cluster.pull("_plan")[0]
    finally:
        cluster.stop()
    tokens = seconds = 0.0
    prev = 0
    for r in rows:
        steps = r["step"] - prev
        if prev >= args.warmup:
            seconds += r["step_time"] * steps
            tokens += r["tokens_per_s"] * r["step_time"] * steps
        prev = r["step"]
    last = rows[-1]
    return {
        "tok_s": tokens / seconds if seconds else None,
        "mfu": last.get("mfu"),
        "peak_gb": last.get("peak_memory_gb"),
        "plan": plan,
        "loss_first": rows[0]["loss"],
        "loss_last": last["loss"],
    }


def _lora_model(model_dir: Path) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if on_gpu else torch.float32
    )
    model.config.use_cache = False
    lora = LoraConfig(
        r=LORA["lora_r"],
        lora_alpha=LORA["lora_alpha"],
        lora_dropout=LORA["lora_dropout"],
        target_modules=LORA["target_modules"],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model.to("cuda" if on_gpu else "cpu"), lora)


def _arm_result(tokens: float, seconds: float, model: Any) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"tok_s": tokens / seconds}
    peak = peak_flops()
    if peak:
        out["mfu"] = out["tok_s"] * 4 * sum(p.numel() for p in model.parameters()) / peak
    if torch.cuda.is_available():
        out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def arm_hf(args: argparse.Namespace, model_dir: Path, data: Path, work: Path) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainingArguments

    ids = tokenized([json.loads(line) for line in data.read_text().splitlines()], model_dir)
    train = [{"input_ids": x, "labels": x} for x in ids]
    model = _lora_model(model_dir)
    on_gpu = torch.cuda.is_available()
    clock = C.StepClock()
    micro = args.baseline_micro
    targs = TrainingArguments(
        output_dir=str(work / "hf-run"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.global_batch // micro,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        bf16=on_gpu,
        logging_steps=args.warmup,
        save_strategy="no",
        report_to=[],
        optim="adamw_torch_fused" if on_gpu else "adamw_torch",
        dataloader_drop_last=True,
        remove_unused_columns=False,
        seed=0,
        use_cpu=not on_gpu,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=train, callbacks=[clock.callback()])
    trainer.train()
    steps, seconds = clock.window(args.warmup)
    tokens = steps * args.global_batch * args.seq
    return _arm_result(tokens, seconds, model)


def arm_bare(args: argparse.Namespace, model_dir: Path, data: Path, work: Path) -> dict[str, Any]:
    import contextlib

    import torch

    ids = tokenized([json.loads(line) for line in data.read_text().splitlines()], model_dir)
    model = _lora_model(model_dir)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, fused=on_gpu)
    micro = args.baseline_micro
    ga = args.global_batch // micro
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else contextlib.nullcontext
    )
    t_warm = time.perf_counter()
    row = 0
    for step in range(args.steps):
        if step == args.warmup:
            if on_gpu:
                torch.cuda.synchronize()
            t_warm = time.perf_counter()
        for _ in range(ga):
            batch = torch.tensor(ids[row : row + micro], device=device)
            row += micro
            with autocast():
                loss = model(input_ids=batch, labels=batch).loss
            (loss / ga).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if on_gpu:
        torch.cuda.synchronize()
    tokens = (args.steps - args.warmup) * args.global_batch * args.seq
    return _arm_result(tokens, time.perf_counter() - t_warm, model)


ARMS = {"nbtrain": arm_nbtrain, "hf": arm_hf, "bare": arm_bare}


# ------------------------------------------------------------------------------------------- main
def _run_arm_in_subprocess(name: str, argv: list[str], out: Path) -> dict[str, Any]:
    """Each baseline arm in a fresh process, so no arm inherits another's GPU memory or patches."""
    cmd = [sys.executable, __file__, *argv, "--only-arm", name, "--arm-out", str(out)]
    proc = subprocess.run(cmd, text=True)
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"exit {proc.returncode}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--nbtrain-micro", default="auto", help='"auto" or a number')
    p.add_argument("--baseline-micro", type=int, default=1)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--arms", default="nbtrain,hf,bare")
    p.add_argument("--json", default=str(C.RESULTS / "gpu.json"), help="append the record here")
    p.add_argument("--no-render", action="store_true", help="do not rewrite RESULTS.md")
    p.add_argument("--only-arm", help=argparse.SUPPRESS)
    p.add_argument("--arm-out", help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.nbtrain_micro != "auto":
        args.nbtrain_micro = int(args.nbtrain_micro)
    if args.global_batch % args.baseline_micro:
        p.error("--global-batch must be a multiple of --baseline-micro")
    C.setup_env()
    work = C.WORK / "gpu"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args.shape, C.WORK / "models")
    data = work / f"rows-{args.shape}-{args.seq}.jsonl"
    if not data.is_file():
        vocab = SHAPES[args.shape]["vocab_size"]
        rows = make_rows(vocab, args.seq, args.steps * args.global_batch)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    if args.only_arm:
        result = ARMS[args.only_arm](args, model_dir, data, work)
        Path(args.arm_out).write_text(json.dumps(result))
        return

    results: dict[str, dict[str, Any]] = {}
    for name in args.arms.split(","):
        t0 = time.perf_counter()
        if name == "nbtrain":
            results[name] = arm_nbtrain(args, model_dir, data, work)
        else:
            results[name] = _run_arm_in_subprocess(name, raw, work / f"arm-{name}.json")
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)

    def tok(name: str) -> float | None:
        return results.get(name, {}).get("tok_s")

    record = {
        "device": device_name(),
        "shape": args.shape,
        "seq": args.seq,
        "batch": args.global_batch,
        "nbtrain_tok_s": tok("nbtrain"),
        "hf_trainer_tok_s": tok("hf"),
        "bare_tok_s": tok("bare"),
        "mfu": results.get("nbtrain", {}).get("mfu"),
        "peak_gb": results.get("nbtrain", {}).get("peak_gb"),
        "nbtrain_vs_hf": C.ratio(tok("nbtrain"), tok("hf")),
        "nbtrain_vs_bare": C.ratio(tok("nbtrain"), tok("bare")),
        "levers": results.get("nbtrain", {}).get("plan", {}).get("levers"),
        "micro_batch": results.get("nbtrain", {}).get("plan", {}).get("micro_batch"),
        "steps": args.steps,
        "warmup": args.warmup,
        "compile": args.compile,
        "arms": results,
        "commit": C.code_version()["commit"],
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(record, indent=1))
    path = Path(args.json)
    history = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    history["runs"].append(record)
    path.write_text(json.dumps(history, indent=1) + "\n")
    if not args.no_render:
        render_results(history, C.HERE / "RESULTS.md")


BEGIN, END = "<!-- gpu-table:begin -->", "<!-- gpu-table:end -->"


def gpu_table(history: dict[str, Any]) -> str:
    """The GPU runs of gpu.json as a markdown table (CPU smoke runs left out)."""

    def f(x: Any, spec: str = ",.0f") -> str:
        return "–" if x is None else format(x, spec)

    lines = [
        "| date | commit | device | shape | seq x batch (nbtrain micro) | nbtrain tok/s | MFU | peak GB | HF Trainer | bare loop | vs HF | vs bare | nbtrain levers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in history["runs"]:
        if r["device"] == "cpu":
            continue
        lines.append(
            f"| {r['date']} | {r['commit']} | {r['device']} | {r['shape']} | {r['seq']} x {r['batch']} ({r.get('micro_batch', '?')}) "
            f"| {f(r['nbtrain_tok_s'])} | {f(r['mfu'], '.1%')} | {f(r['peak_gb'], '.1f')} "
            f"| {f(r['hf_trainer_tok_s'])} | {f(r['bare_tok_s'])} | {f(r['nbtrain_vs_hf'], '.2f')} "
            f"| {f(r['nbtrain_vs_bare'], '.2f')} | {', '.join(r.get('levers') or [])} |"
        )
    return "\n".join(lines)


def render_results(history: dict[str, Any], results_md: Path) -> None:
    text = results_md.read_text() if results_md.is_file() else ""
    block = f"{BEGIN}\n{gpu_table(history)}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## GPU (benchmarks/bench_gpu.py)\n\n" + block + "\n"
    results_md.write_text(text)


if __name__ == "__main__":
    main()
