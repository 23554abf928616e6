"""Generation across 2 ranks: `nbtrain.generate` on a 2-engine cluster against one process of plain
transformers `generate` at the same batch size.

    .venv/bin/python benchmarks/bench_generate.py [--rounds 9] [--prompts 64] [--new 64] [--two-threads]
                                                  [--quick] [--out FILE]

The same work in every arm: `--prompts` prompts from the shipped instruction data (their lengths vary
from a few tokens to ~100), `--new` new tokens each, greedy, batch 8, on a tiny Llama built by
`make_tiny_model` (hidden 256, 4 layers) with end-of-sequence turned off (`min_new_tokens`), so every
arm generates exactly prompts x new tokens. Each arm is timed end to end, model and tokenizer loading
included (what a user's call costs):
  nbtrain2    `nbtrain.generate` in a cell on 2 engines (one torch thread each), rank 0's wall time
              from a barrier before the call to its return (the results gathered in prompt order)
  nbtrain1    `nbtrain.generate` in this process, one thread: the batching alone (prompts sorted by
              length, so a batch holds little padding), no second rank
  hf1         plain transformers in this process, one thread: `from_pretrained`, then the prompts in
              their order, 8 at a time, left-padded, `model.generate` with the KV cache
  hf2         (--two-threads) the same with two threads: one process given the whole 2-core machine;
              on a loaded machine its threads' spin-waits make it far slower than one thread
With `--vllm` (the vLLM venv, `make venv-vllm`) the arms are instead the two engines on the same 2
ranks, each started once and warm: `decode.generate_across` (what `nbtrain.generate` runs once the
model is loaded) with engine="hf" (batches of 8) and engine="vllm" (all of a rank's prompts at once),
greedy, on a model vLLM's CPU attention takes (head_dim 64); the headline is hf seconds / vllm
seconds per round, and the engine's start is reported beside it. `--gpu` as well: one rank on one
GPU, a 0.52B-parameter model built from a config, and each engine's GPU memory.
Rounds run the arms interleaved (nbtrain2, nbtrain1, hf1, ...), so load drifts over all alike. The
headline is the speed-up hf1 seconds / nbtrain2 seconds, taken in each round (the two ran within
seconds of each other) and reported as the median of the rounds with a distribution-free 90%
confidence interval; the ratio of the plain medians is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MODEL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 512, "num_heads": 4}
BATCH = 8


def prompts(n: int) -> list[str]:
    from nbtrain.data.examples import instructions_path

    out = []
    for line in Path(instructions_path()).read_text().splitlines():
        row = json.loads(line)
        if "prompt" in row and isinstance(row["prompt"], str):
            out.append(row["prompt"])
        elif "messages" in row:
            out.append(row["messages"][0]["content"])
        if len(out) == n:
            break
    while len(out) < n:  # a short data file: repeat it
        out += out[: n - len(out)]
    return out


def hf_generate(model_dir: str, texts: list[str], new: int, threads: int) -> float:
    """Plain transformers, one process: load, then batches of BATCH in prompt order, left-padded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        for i in range(0, len(texts), BATCH):
            enc = tok(texts[i : i + BATCH], return_tensors="pt", padding=True)
            with torch.no_grad():
                model.generate(
                    **enc, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True
                )
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(old)


def nbtrain_local(model_dir: str, texts: list[str], new: int) -> float:
    import torch

    import nbtrain

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        nbtrain.generate(texts, model=model_dir, max_new_tokens=new, batch_size=BATCH)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(old)


CELL = """
import time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.barrier()
_t0 = time.perf_counter()
_df = nbtrain.generate(texts, model=model_dir, max_new_tokens=new, batch_size=batch)
bench_seconds = time.perf_counter() - _t0
bench_rows = None if _df is None else (len(_df), int(_df.tokens.sum()))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--two-threads", action="store_true", help="also the hf2 arm (2 threads)")
    ap.add_argument("--quick", action="store_true", help="1 round of 8 prompts x 8 tokens")
    ap.add_argument("--out", default=None)
    ap.add_argument("--vllm", action="store_true", help="engine='vllm' against engine='hf'")
    ap.add_argument("--gpu", action="store_true", help="with --vllm: one GPU rank, a 0.5B model")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.new = 1, 8, 8
    if args.vllm:
        main_vllm(args)
        return
    C.setup_env()
    import nbtrain
    from nbtrain.model.tiny import make_tiny_model

    rec = C.Recorder("generate", args.quick)
    model_dir = make_tiny_model(C.WORK / "generate-model", **MODEL)
    # no early stop in any arm: the same prompts x new tokens of work everywhere
    cfg_path = Path(model_dir) / "generation_config.json"
    gen_cfg = json.loads(cfg_path.read_text())
    gen_cfg["min_new_tokens"] = args.new
    cfg_path.write_text(json.dumps(gen_cfg))
    texts = prompts(args.prompts)

    cluster = nbtrain.start(n=2, force=True)
    times: dict[str, list[float]] = {"nbtrain2": [], "nbtrain1": [], "hf1": []}
    if args.two_threads or args.quick:
        times["hf2"] = []
    generated = None
    try:
        cluster.execute("import nbtrain", output="none")
        cluster.push({"texts": texts, "model_dir": model_dir, "new": args.new, "batch": BATCH})
        # one untimed warm-up per arm: imports, first from_pretrained, allocator
        cluster.execute(CELL, output="none")
        nbtrain_local(model_dir, texts[:BATCH], 2)
        hf_generate(model_dir, texts[:BATCH], 2, 1)
        for _ in range(args.rounds):
            cluster.execute(CELL, output="none")
            times["nbtrain2"].append(cluster.pull("bench_seconds", ranks=0)[0])
            generated = cluster.pull("bench_rows", ranks=0)[0]
            times["nbtrain1"].append(nbtrain_local(model_dir, texts, args.new))
            times["hf1"].append(hf_generate(model_dir, texts, args.new, 1))
            if "hf2" in times:
                times["hf2"].append(hf_generate(model_dir, texts, args.new, 2))
    finally:
        cluster.stop()

    med = {k: C.median(v) for k, v in times.items()}
    tokens = args.prompts * args.new
    # the speed-up in each round: hf1 and nbtrain2 ran seconds apart, under about the same load
    paired = [h / n for h, n in zip(times["hf1"], times["nbtrain2"], strict=True)]
    ci = C.median_ci(paired)
    rec.data.update(
        {
            "rounds": args.rounds,
            "prompts": args.prompts,
            "new_tokens": args.new,
            "batch_size": BATCH,
            "model": MODEL,
            "generated_rows_and_tokens": generated,
            "seconds": {k: C.summary(v) for k, v in times.items()},
            "raw_seconds": times,
            "speedup_by_round": paired,
        }
    )
    what = f"{args.prompts} prompts x {args.new} new tokens, batch {BATCH}"
    rec.metric(
        f"generate, 2 ranks: nbtrain.generate vs one process of transformers generate, 1 thread each ({what})",
        tokens / med["nbtrain2"],
        tokens / med["hf1"],
        "transformers generate, one process, 1 thread",
        "tok/s",
        ">= 1.8",
        ratio_value=C.median(paired),
        note=(
            f"ratio: median of {len(paired)} rounds' speed-ups"
            + (f", 90% CI {ci[0]:.2f}-{ci[1]:.2f}" if ci else "")
            + f"; ratio of the plain medians {med['hf1'] / med['nbtrain2']:.2f}"
            # the fastest run of each arm is the one the machine's other load disturbed least
            + f"; of the fastest runs {min(times['hf1']) / min(times['nbtrain2']):.2f}"
            + "; model load included"
        ),
    )
    rec.metric(
        "generate: nbtrain.generate on 1 process vs transformers generate (batching by length alone)",
        tokens / med["nbtrain1"],
        tokens / med["hf1"],
        "transformers generate, one process, 1 thread",
        "tok/s",
        "",
    )
    if "hf2" in times:
        rec.metric(
            "generate, 2 ranks vs one process of transformers generate with 2 threads",
            tokens / med["nbtrain2"],
            tokens / med["hf2"],
            "transformers generate, one process, 2 threads",
            "tok/s",
            "",
        )
    rec.finish(args.out)


# ---- engine="vllm" against engine="hf" (--vllm)

VLLM_MODEL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 512, "num_heads": 4}
#: --gpu: 0.52B parameters (30 layers of 17.3M, hidden 1024, head_dim 64), built from a config
GPU_MODEL = {"hidden_size": 1024, "num_layers": 30, "intermediate_size": 4608, "num_heads": 16}

ENGINES_SETUP = """
import os, subprocess, time, torch, torch.distributed as dist
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from nbtrain.data.prompts import Entry
from nbtrain.engine.dist import Dist
from nbtrain.generation import decode, engines
from nbtrain.model.pretrained import load_tokenizer
d = Dist()
tok = load_tokenizer(model_dir)
dtype = torch.bfloat16 if d.device.type == "cuda" else torch.float32
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(d.device).eval()
prompts = decode.encode([Entry(t) for t in texts], tok)
decoding = decode.Decoding(max_new_tokens=new, batch_size=batch)
_t0 = time.perf_counter()
eng = {"hf": engines.make("hf", model=model, tokenizer=tok, device=d.device),
       "vllm": engines.make("vllm", model_path=model_dir, tokenizer=tok, device=d.device,
                            rank=d.rank, host=d.host,
                            options=engines.VLLMOptions(dtype=str(dtype).split(".")[-1]))}
vllm_start_s = time.perf_counter() - _t0
"""

ENGINES_CELL = """
if d.device.type == "cuda":
    torch.cuda.reset_peak_memory_stats()
eng[arm].wake()
dist.barrier()
_t0 = time.perf_counter()
_rows = decode.generate_across(model, tok, prompts, d, decoding, engine=eng[arm])
bench_seconds = time.perf_counter() - _t0
bench_out = None if _rows is None else [r["completion"] for r in _rows]
bench_tokens = None if _rows is None else sum(r["tokens"] for r in _rows)
gpu_mem = None
if d.device.type == "cuda":
    _smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    _by_pid = {int(a): float(b) / 1024 for a, b in (l.split(",") for l in _smi.splitlines() if "," in l)}
    gpu_mem = {"rank_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
               "rank_process_gib": _by_pid.get(os.getpid()),
               "vllm_process_gib": _by_pid.get(getattr(eng["vllm"], "pid", None))}
eng[arm].sleep()
"""


def main_vllm(args: argparse.Namespace) -> None:
    """The two engines, warm, on the same ranks and prompts, alternating round by round."""
    C.setup_env()
    import nbtrain
    from nbtrain.model.tiny import make_tiny_model

    name = "generate-vllm-gpu" if args.gpu else "generate-vllm"
    rec = C.Recorder(name, args.quick)
    spec = GPU_MODEL if args.gpu else VLLM_MODEL
    model_dir = make_tiny_model(C.WORK / f"{name}-model", **spec)
    texts = prompts(args.prompts)
    n = 1 if args.gpu else 2
    times: dict[str, list[float]] = {"hf": [], "vllm": []}
    tokens: dict[str, int | None] = {}
    memory: dict[str, Any] = {}
    same = None
    cluster = nbtrain.start(n=n, force=True, quiet=True)
    try:
        cluster.push({"texts": texts, "model_dir": model_dir, "new": args.new, "batch": BATCH})
        cluster.execute(ENGINES_SETUP, output="none")
        start_s = cluster.pull("vllm_start_s")
        for arm in ("hf", "vllm"):  # untimed warm-up: first calls, allocators
            cluster.push({"arm": arm})
            cluster.execute(ENGINES_CELL, output="none")
        outs = {}
        for _ in range(args.rounds):
            for arm in ("hf", "vllm"):
                cluster.push({"arm": arm})
                cluster.execute(ENGINES_CELL, output="none")
                times[arm].append(cluster.pull("bench_seconds", ranks=0)[0])
                tokens[arm] = cluster.pull("bench_tokens", ranks=0)[0]
                outs[arm] = cluster.pull("bench_out", ranks=0)[0]
                memory[arm] = cluster.pull("gpu_mem")
        same = sum(a == b for a, b in zip(outs["hf"], outs["vllm"], strict=True))
    finally:
        cluster.stop()

    med = {k: C.median(v) for k, v in times.items()}
    paired = [h / v for h, v in zip(times["hf"], times["vllm"], strict=True)]
    ci = C.median_ci(paired)
    where = "1 GPU rank" if args.gpu else "2 CPU ranks"
    rec.data.update(
        rounds=args.rounds, prompts=args.prompts, new_tokens=args.new, model=spec, ranks=n,
        seconds={k: C.summary(v) for k, v in times.items()}, raw_seconds=times,
        gpu=args.gpu, speedup_by_round=paired, tokens=tokens, vllm_start_s=start_s, gpu_memory=memory,
        greedy_completions_equal=f"{same} of {args.prompts}",
    )  # fmt: skip
    rec.metric(
        f"generate, engine='vllm' vs engine='hf', warm engines, {where} "
        f"({args.prompts} prompts x {args.new} new tokens, greedy)",
        (tokens["vllm"] or 0) / med["vllm"],
        (tokens["hf"] or 0) / med["hf"],
        f"engine='hf' (transformers generate, batch {BATCH})",
        "tok/s",
        "measured, not assumed",
        ratio_value=C.median(paired),
        note=(
            f"ratio: median of {len(paired)} rounds' hf s / vllm s"
            + (f", 90% CI {ci[0]:.2f}-{ci[1]:.2f}" if ci else "")
            + f"; tokens generated hf {tokens['hf']}, vllm {tokens['vllm']}; greedy completions "
            + f"equal {same} of {args.prompts}; vLLM's start (each rank, in parallel) "
            + ", ".join(f"{s:.0f} s" for s in start_s)
            + ", not in the ratio"
        ),
    )
    data = rec.finish(args.out)
    if not args.quick:
        render_vllm(data, C.HERE / "RESULTS.md")


def render_vllm(data: dict[str, Any], results_md: Path) -> None:
    """The generate vLLM rows (between their markers) in RESULTS.md, one block per device kind."""
    kind = "gpu" if data["gpu"] else "cpu"
    begin, end = f"<!-- generate-vllm-{kind}:begin -->", f"<!-- generate-vllm-{kind}:end -->"
    m = data["metrics"][0]
    mem = ""
    for arm, per_rank in (data.get("gpu_memory") or {}).items():
        if per_rank and per_rank[0]:
            g = per_rank[0]
            mem += (
                f"\n- GPU memory with {arm} generating: rank process "
                f"{g.get('rank_process_gib') or 0:.1f} GiB (torch peak {g['rank_peak_gib']:.1f} GiB), "
                f"vLLM process {g.get('vllm_process_gib') or 0:.1f} GiB"
            )
    s = data["seconds"]
    block = (
        f"{begin}\nMeasured {data['started']} on `{data['machine']['host']}` "
        f"({data['machine']['cpus']} CPUs), commit {data['code'].get('commit', '?')}, {data['ranks']} "
        f"rank(s), {data['rounds']} rounds, model {data['model']}; load {data['loadavg_start']} -> "
        f"{data['loadavg_end']}.\n\n"
        f"- hf: median {s['hf']['median']:.2f} s, {m['baseline']:.0f} tok/s; vllm: median "
        f"{s['vllm']['median']:.2f} s, {m['nbtrain']:.0f} tok/s\n"
        f"- **vllm / hf: {m['ratio']:.2f}x** ({m['note']}){mem}\n{end}"
    )
    text = results_md.read_text() if results_md.is_file() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        title = "on a GPU" if kind == "gpu" else "on 2 CPU ranks"
        text = (
            text.rstrip("\n") + f"\n\n## generate: engine='vllm' vs engine='hf', {title} "
            "(benchmarks/bench_generate.py --vllm)\n\nThe same prompts through each engine, both "
            "started once and warm, greedy, rounds alternating. Raw numbers in `results/"
            + data["benchmark"]
            + ".json`.\n\n"
            + block
            + "\n"
        )
    results_md.write_text(text)


if __name__ == "__main__":
    main()
