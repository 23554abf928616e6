"""GRPO on the same 2 local ranks, collocated against disaggregated: steps/s, and where each side's time goes.

    .venv/bin/python benchmarks/bench_grpo.py [--reps 3] [--steps 16] [--quick] [--out FILE]

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
    args = ap.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 1, 4, 1
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


if __name__ == "__main__":
    main()
