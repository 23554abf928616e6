"""GRPO on the same 2 local ranks, collocated against disaggregated: steps/s, and where each side's time goes.

    .venv/bin/python benchmarks/bench_grpo.py [--reps 3] [--steps 16] [--quick] [--out FILE]
    .venv-vllm/bin/python benchmarks/bench_grpo.py --vllm [--gpu] ...    # engine="vllm" against "hf"

With `--vllm` (the vLLM venv, `make venv-vllm`) the arms are engine="hf" and engine="vllm" in each
placement, alternating (hf, vllm, hf, ...), on a tiny Llama vLLM's CPU attention takes (head_dim 64),
and the ratio vllm / hf of steps/s, round by round, is the headline (RESULTS.md's vLLM section).
With `--gpu` as well: one rank on one GPU (collocated only: two ranks do not share a GPU), a model of
0.52B parameters built from a config, 64 new tokens per completion, and each engine's GPU memory.

One 2-engine cluster (gloo, CPU, one thread a rank) started once; the same run in both placements:
`nbtrain.finetune(GRPOConfig(...))` on a tiny Llama built by `make_tiny_model` (hidden 128, 4 layers),
the arithmetic prompts, 8 completions of 16 new tokens per prompt, 32 completions a step, a digits
reward, the same seed.
  collocated     both ranks sample 16 completions each, swap the rewards, then both train (DDP)
  disaggregated  `groups actor=0 rollout=1`: rank 1 samples step s + 1's 32 completions while rank 0
                 trains step s on 32 (staleness 1)
run alternately (collocated, disaggregated, collocated, ...), so the shared machine's drift hits both.
steps/s is taken from the rows' wall-clock times (every step logs a row), leaving out the first
`--warmup` steps. The shares: collocated, the mean of each step's generation and training time over
the step time; disaggregated, the actor's wait for completions and the rollout's wait for the adapter
over the step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MODEL = {"hidden_size": 128, "num_layers": 4, "intermediate_size": 256, "num_heads": 4}

SETUP = """
import nbtrain, torch
torch.set_num_threads(1)

def digits(completions, **kw):
    out = []
    for c in completions:
        s = c.replace(" ", "")
        out.append(sum(ch.isdigit() for ch in s) / max(len(s), 1))
    return out

rows = [{"prompt": f"What is {a} plus {b}?\\nAnswer: ", "answer": str(a + b)}
        for a in range(10) for b in range(10)]
"""

RUN = """
r = nbtrain.finetune(nbtrain.GRPOConfig(**dict(grpo_kw, data=rows, reward_funcs=[digits])))
res = r.history.to_dict(orient="records")
"""


def _kw(model: str, out: str, steps: int, disaggregated: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": model,
        "num_generations": 8,
        "max_completion_length": 16,
        # 32 completions a step either way: 2 ranks x 16, or the actor's 1 rank x 32
        "per_device_train_batch_size": 32 if disaggregated else 16,
        "output_dir": out,
        "max_steps": steps,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_steps": None,
        "lora_dropout": 0.0,
        "data_cache": "off",
        "seed": 0,
        "overwrite": True,
    }
    if disaggregated:
        kw.update(actor="actor", rollout="rollout")
    return kw


def _measure(history: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    rows = history[warmup - 1 :] if warmup >= 1 else history
    span = rows[-1]["time"] - rows[0]["time"]
    n = len(rows) - 1
    later = history[warmup:]
    step_s = sum(r["step_time"] for r in later)

    def share(key: str) -> float | None:
        vals = [r.get(key) for r in later]
        vals = [v for v in vals if isinstance(v, int | float) and v == v]
        return sum(vals) / step_s if vals and step_s > 0 else None

    return {
        "steps_per_s": n / span if span > 0 else None,
        "gen_share": share("gen_s"),
        "train_share": share("train_s"),
        "actor_wait_share": share("actor_wait_s"),
        "rollout_wait_share": share("rollout_wait_s"),
        "reward_last": history[-1]["reward"],
    }


BEGIN, END = "<!-- grpo-table:begin -->", "<!-- grpo-table:end -->"
SECTION = "## GRPO: collocated vs disaggregated (benchmarks/bench_grpo.py)"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def table(data: dict[str, Any]) -> str:
    """Steps/s per round and their median for each placement, with the median time shares."""
    med = data["medians"]
    rows = [
        "| placement | steps/s per round | median | time shares (medians) |",
        "|---|---|---|---|",
    ]
    for arm, shares in (
        (
            "collocated",
            f"sampling and scoring {_pct(med['collocated']['gen_share'])}, training "
            f"{_pct(med['collocated']['train_share'])} of a step",
        ),
        (
            "disaggregated",
            f"the actor waits {_pct(med['disaggregated']['actor_wait_share'])} of a step "
            f"for completions, the rollout {_pct(med['disaggregated']['rollout_wait_share'])} for the "
            f"adapter; sampling takes {_pct(med['disaggregated']['gen_share'])} of a step",
        ),
    ):
        per = ", ".join(f"{r['steps_per_s']:.2f}" for r in data["runs"][arm])
        rows.append(f"| {arm} | {per} | {med[arm]['steps_per_s']:.2f} | {shares} |")
    ratios = [
        d["steps_per_s"] / c["steps_per_s"]
        for c, d in zip(data["runs"]["collocated"], data["runs"]["disaggregated"], strict=False)
    ]
    rows += [
        "",
        "Disaggregated / collocated, round by round: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f" (median {C.median(ratios):.2f}).",
    ]
    return "\n".join(rows)


def render_results(data: dict[str, Any], results_md: Path) -> None:
    """Put the table (between markers) into RESULTS.md's GRPO section, adding the section if missing."""
    text = results_md.read_text() if results_md.is_file() else ""
    code = data.get("code", {})
    commit = code.get("commit", "?") + (
        f" + {len(code['nbtrain_dirty_files'])} uncommitted nbtrain file(s)"
        if code.get("nbtrain_dirty_files")
        else ""
    )
    st = data.get("settings", {})
    block = (
        f"{BEGIN}\n"
        f"Measured {data['started']} on `{data['machine']['host']}` ({data['machine']['cpus']} CPUs), "
        f"commit {commit}, {st.get('reps')} rounds of {st.get('steps')} steps (the first "
        f"{st.get('warmup')} left out); load average {data['loadavg_start']} at the start, "
        f"{data['loadavg_end']} at the end; {data['wall_s']:.0f} s in all.\n\n{table(data)}\n{END}"
    )
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = (
            text.rstrip("\n") + f"\n\n{SECTION}\n\n"
            "GRPO steps/s on the same 2 local ranks (gloo, CPU, one thread a rank), collocated (both "
            "ranks sample 16 completions, swap rewards, then both train) against disaggregated "
            "(`actor=0 rollout=1`: rank 1 samples step s + 1's 32 completions while rank 0 trains step s "
            "on 32, staleness 1); otherwise the same run: a tiny Llama (hidden 128, 4 layers), 32 "
            "completions a step (4 prompts x 8), 16 new tokens each, the placements alternating. Raw "
            "numbers in `results/grpo.json`.\n\n" + block + "\n"
        )
    results_md.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 rep of 4 steps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--vllm", action="store_true", help="engine='vllm' against engine='hf'")
    ap.add_argument("--gpu", action="store_true", help="with --vllm: one GPU rank, a 0.5B model")
    ap.add_argument("--new", type=int, default=None, help="with --vllm: new tokens a completion")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 1, 4, 1
    if args.vllm:
        main_vllm(args)
        return
    C.setup_env()
    import nbtrain
    from nbtrain.model.tiny import make_tiny_model

    rec = C.Recorder("grpo", args.quick)
    model = make_tiny_model(C.WORK / "grpo-model", **MODEL)
    runs: dict[str, list[dict[str, Any]]] = {"collocated": [], "disaggregated": []}
    cluster = nbtrain.start(n=2, force=True, quiet=True)
    try:
        cluster.execute(SETUP, output="none")
        for rep in range(args.reps):
            for arm in ("collocated", "disaggregated"):
                dis = arm == "disaggregated"
                out = str(C.WORK / f"grpo-{arm}")
                cluster.push({"grpo_kw": _kw(model, out, args.steps, dis), "res": None})
                if dis:
                    cluster.groups(actor="0", rollout="1")
                try:
                    cluster.execute(RUN, output="none", live=False)
                finally:
                    if dis:
                        cluster.clear_groups()
                got = _measure(cluster.pull("res", ranks=[0])[0], args.warmup)
                got["rep"] = rep
                runs[arm].append(got)
                print(arm, got, flush=True)
    finally:
        cluster.stop()

    def med(arm: str, key: str) -> float | None:
        return C.median([r[key] for r in runs[arm] if r[key] is not None])

    col, dis = med("collocated", "steps_per_s"), med("disaggregated", "steps_per_s")
    rec.metric(
        "GRPO steps/s, disaggregated vs collocated (2 ranks)",
        dis,
        col,
        "collocated",
        "steps/s",
        "measured, not assumed",
    )
    rec.data["runs"] = runs
    rec.data["settings"] = {
        "reps": args.reps,
        "steps": args.steps,
        "warmup": args.warmup,
        "model": MODEL,
    }
    rec.data["medians"] = {
        arm: {
            k: med(arm, k)
            for k in (
                "steps_per_s",
                "gen_share",
                "train_share",
                "actor_wait_share",
                "rollout_wait_share",
            )
        }
        for arm in runs
    }
    rec.finish(args.out)


# ---- engine="vllm" against engine="hf" (--vllm)

#: head_dim 64 (vLLM's CPU attention refuses 32 and 24)
VLLM_MODEL = {"hidden_size": 128, "num_layers": 4, "intermediate_size": 256, "num_heads": 2}
#: --gpu: 0.52B parameters (30 layers of 17.3M, hidden 1024, head_dim 64), built from a config
GPU_MODEL = {"hidden_size": 1024, "num_layers": 30, "intermediate_size": 4608, "num_heads": 16}

# after a run, on every rank: the GPU memory of this rank's process (torch's peak) and of its vLLM
# process (nvidia-smi's per-process figure), in GiB; None on a CPU
GPU_MEMORY = """
import subprocess
gpu_mem = None
if torch.cuda.is_available():
    from nbtrain.recipes.grpo import rollout as _ro
    _eng = _ro._ENGINE.get("engine")
    _smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    _by_pid = {int(a): float(b) / 1024 for a, b in (l.split(",") for l in _smi.splitlines() if "," in l)}
    gpu_mem = {"rank_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
               "rank_process_gib": _by_pid.get(os.getpid()),
               "vllm_process_gib": _by_pid.get(getattr(_eng, "pid", None))}
    torch.cuda.reset_peak_memory_stats()
"""


def main_vllm(args: argparse.Namespace) -> None:
    """engine='hf' and engine='vllm' in each placement, alternating, on one cluster."""
    import time

    C.setup_env()
    import nbtrain
    from nbtrain.model.tiny import make_tiny_model

    name = "grpo-vllm-gpu" if args.gpu else "grpo-vllm"
    if args.new and args.new != (64 if args.gpu else 16):
        name += f"-{args.new}"
    rec = C.Recorder(name, args.quick)
    spec = GPU_MODEL if args.gpu else VLLM_MODEL
    model = make_tiny_model(C.WORK / f"{name}-model", **spec)
    n = 1 if args.gpu else 2
    new = args.new or (64 if args.gpu else 16)
    placements = ("collocated",) if args.gpu else ("collocated", "disaggregated")
    arms = [f"{p}/{e}" for p in placements for e in ("hf", "vllm")]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    cluster = nbtrain.start(n=n, force=True, quiet=True)
    try:
        cluster.execute(SETUP + "\nimport os, time\n", output="none")
        for rep in range(args.reps):
            for arm in arms:
                placement, engine = arm.split("/")
                dis = placement == "disaggregated"
                kw = _kw(model, str(C.WORK / f"{name}-{placement}-{engine}"), args.steps, dis)
                kw.update(engine=engine, max_completion_length=new)
                if n == 1:  # the step's 32 completions on the one rank
                    kw["per_device_train_batch_size"] = 32
                cluster.push({"grpo_kw": kw, "res": None})
                if dis:
                    cluster.groups(actor="0", rollout="1")
                t0 = time.perf_counter()
                try:
                    cluster.execute(RUN + GPU_MEMORY, output="none", live=False)
                finally:
                    if dis:
                        cluster.clear_groups()
                got = _measure(cluster.pull("res", ranks=[0])[0], args.warmup)
                # the first vLLM run of each rank includes its engine's start
                got.update(rep=rep, wall_s=time.perf_counter() - t0)
                got["gpu_memory"] = cluster.pull("gpu_mem")
                runs[arm].append(got)
                print(arm, got, flush=True)
    finally:
        cluster.stop()

    def med(arm: str, key: str) -> float | None:
        return C.median([r[key] for r in runs[arm] if r.get(key) is not None])

    where = "1 GPU rank" if args.gpu else "2 CPU ranks"
    for p in placements:
        hf, vl = runs[f"{p}/hf"], runs[f"{p}/vllm"]
        paired = [v["steps_per_s"] / h["steps_per_s"] for h, v in zip(hf, vl, strict=True)]
        rec.metric(
            f"GRPO steps/s, {p}, engine='vllm' vs engine='hf' ({where})",
            med(f"{p}/vllm", "steps_per_s"),
            med(f"{p}/hf", "steps_per_s"),
            "engine='hf'",
            "steps/s",
            "measured, not assumed",
            ratio_value=C.median(paired),
            note="ratio: median of the rounds' ratios " + ", ".join(f"{r:.2f}" for r in paired),
        )
    rec.data.update(
        runs=runs,
        settings={
            "reps": args.reps,
            "steps": args.steps,
            "warmup": args.warmup,
            "model": spec,
            "new_tokens": new,
            "ranks": n,
            "gpu": args.gpu,
        },  # fmt: skip
        medians={
            a: {k: med(a, k) for k in ("steps_per_s", "gen_share", "train_share")} for a in arms
        },
    )
    data = rec.finish(args.out)
    if not args.quick:
        render_vllm(data, C.HERE / "RESULTS.md")


def render_vllm(data: dict[str, Any], results_md: Path) -> None:
    """The vLLM table (between its markers) in RESULTS.md, one per device kind."""
    kind = "gpu" if data["settings"]["gpu"] else "cpu"
    if data["settings"]["new_tokens"] != (64 if kind == "gpu" else 16):  # a table of its own
        kind += f"-{data['settings']['new_tokens']}"
    begin, end = f"<!-- grpo-vllm-{kind}:begin -->", f"<!-- grpo-vllm-{kind}:end -->"
    rows = ["| placement / engine | steps/s per round | median | sampling share | GPU memory |",
            "|---|---|---|---|---|"]  # fmt: skip
    for arm, got in data["runs"].items():
        per = ", ".join(f"{r['steps_per_s']:.2f}" for r in got)
        mem = got[-1].get("gpu_memory") or [None]
        mem0 = mem[0] or {}
        gib = "–" if not mem0 else (
            f"rank {mem0.get('rank_process_gib') or 0:.1f} GiB (torch peak {mem0['rank_peak_gib']:.1f}), "
            f"vLLM {mem0.get('vllm_process_gib') or 0:.1f} GiB"
        )  # fmt: skip
        m = data["medians"][arm]
        rows.append(f"| {arm} | {per} | {m['steps_per_s']:.2f} | {_pct(m['gen_share'])} | {gib} |")
    ratios = "; ".join(
        f"{x['metric']}: **{x['ratio']:.2f}x** ({x['note']})" for x in data["metrics"]
    )
    st = data["settings"]
    block = (
        f"{begin}\nMeasured {data['started']} on `{data['machine']['host']}` "
        f"({data['machine']['cpus']} CPUs), commit {data['code'].get('commit', '?')}, {st['reps']} rounds "
        f"of {st['steps']} steps (the first {st['warmup']} left out), {st['ranks']} rank(s), model "
        f"{st['model']}, {st['new_tokens']} new tokens a completion; load {data['loadavg_start']} -> "
        f"{data['loadavg_end']}.\n\n" + "\n".join(rows) + f"\n\n{ratios}\n{end}"
    )
    text = results_md.read_text() if results_md.is_file() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        title = "on a GPU" if kind.startswith("gpu") else "on 2 CPU ranks"
        title += f", {data['settings']['new_tokens']} new tokens"
        text = (
            text.rstrip("\n") + f"\n\n## GRPO: engine='vllm' vs engine='hf', {title} "
            "(benchmarks/bench_grpo.py --vllm)\n\nThe same GRPO run with its rollouts sampled by "
            "transformers' generate (hf) and by a vLLM engine beside each sampling rank (vllm), the arms "
            "alternating; steps/s from the rows' times. Raw numbers in `results/"
            + data["benchmark"]
            + ".json`.\n\n"
            + block
            + "\n"
        )
    results_md.write_text(text)


if __name__ == "__main__":
    main()
