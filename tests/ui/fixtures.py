"""Run folders for the server's REST tests and the UI tests that need no training to make.

- `scaling_report`: a real `ScalingReport` (scaling_model's fit, prediction and verdict, the report's
  own files), built from a measurement of the 4-node test bed (docs/scaling.md's first example,
  weak scaling on 1, 2 and 4 simulated nodes), then recorded in the runs registry the way
  `nbtrain.scaling(..., out=...)` records it. Running a real scaling takes minutes on this machine.
- `gpu_run`: a finished run whose metrics rows carry what `Meter.row` adds on a GPU (`mfu`,
  `peak_memory_gb`, `peak_memory_gb_rank{r}`). No GPU here, so these rows are written by hand: the
  fixture run's first rows with two ranks' memory and an MFU added.
"""

from __future__ import annotations

import json
from pathlib import Path

from nbtrain import runs

REPO = Path(__file__).resolve().parents[2]
FINISHED = REPO / "tests" / "fixtures" / "runs" / "finished-sft"

# (nodes, tokens/s, step s, all-reduce wait s, all-reduce s, model all-reduce s, busbw, latency s)
TESTBED = [
    (1, 904.0, 0.0446, 0.0, 0.0, 0.0, None, None),
    (2, 1236.0, 0.0578, 0.0020, 0.0112, 0.0048, 0.530e9, 438e-6),
    (4, 1098.0, 0.1249, 0.0105, 0.0306, 0.0152, 0.265e9, 1652e-6),
]
MACHINE = (
    "4 node(s) (nbt-node1, nbt-node2, nbt-node3, nbt-node4), 1 rank(s) per node, "
    "CPU AMD EPYC (2 cores), backend gloo"
)


def scaling_report(
    out: Path,
    run_dir: Path | None = None,
    predict: tuple[int, ...] = (8, 16),
    name: str | None = None,
):
    """Save the test bed's report to `out` and record it; returns (report, scaling record id)."""
    from nbtrain.cluster.scaling.model import efficiencies, fit, verdict
    from nbtrain.cluster.scaling.model import predict as predict_rows
    from nbtrain.cluster.scaling.report import ScalingReport

    rows = [
        {
            "nodes": n,
            "ranks": n,
            "predicted": False,
            "tokens_per_s": tps,
            "tokens_per_s_per_rank": tps / n,
            "step_s": step,
            "compute_s": step - wait,
            "comm_s": wait,
            "allreduce_s": ar,
            "model_comm_s": model,
            "busbw": bw,
            "latency_s": lat,
            "grad_bytes": 2 * 2**20,
            "allreduces_per_step": 1.0,
            "assumptions": "measured",
        }
        for n, tps, step, wait, ar, model, bw, lat in TESTBED
    ]
    efficiencies(rows)
    model = fit(rows, "weak")
    top = rows[-1]
    extra = predict_rows(
        model, predict, 1, top["busbw"], top["latency_s"], "as measured at 4 nodes:"
    )
    efficiencies(extra, base=rows[0])
    report = ScalingReport(
        rows=rows + extra,
        mode="weak",
        unit="nodes",
        machine=MACHINE,
        verdict=verdict(rows, model),
        fit=model,
        threshold=0.9,
    )
    report.save(out)
    name = name or f"scaling: {(run_dir or out).name}"
    return report, runs.record_scaling(out, name=name, run_dir=run_dir)


def gpu_run(out: Path, steps: int = 60, name: str = "gpu-sft") -> str:
    """A finished two-rank run with GPU memory and MFU in its rows; returns its run id."""
    out.mkdir(parents=True, exist_ok=True)
    lines = FINISHED.joinpath("metrics.jsonl").read_text().splitlines()[:steps]
    rows = []
    for line in lines:
        row = json.loads(line)
        s = row["step"]
        # memory climbs over the first steps (allocator warm-up) then stays; rank 1 holds a bit less
        rank0 = round(10.0 + 4.0 * min(s, 20) / 20, 3)
        rank1 = round(rank0 - 0.6, 3)
        row.update(
            peak_memory_gb=max(rank0, rank1),
            peak_memory_gb_rank0=rank0,
            peak_memory_gb_rank1=rank1,
            mfu=round(0.30 + 0.1 * min(s, 10) / 10, 4),
        )
        rows.append(row)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_id = runs.register_run(out, name=name, total_steps=steps, world_size=2)
    last = rows[-1]
    runs.update_run(run_id, step=last["step"], loss=last["loss"], tokens_per_s=last["tokens_per_s"])
    runs.finish_run(run_id, "done")
    return run_id


def _register_finished(out: Path, rows: list[dict], name: str, kind: str, config: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / runs.CONFIG_FILE).write_text(json.dumps(config, indent=1))
    run_id = runs.register_run(out, name=name, total_steps=rows[-1]["step"], kind=kind)
    last = rows[-1]
    runs.update_run(run_id, step=last["step"], loss=last["loss"], tokens_per_s=last["tokens_per_s"])
    runs.finish_run(run_id, "done")
    return run_id


def dpo_run(out: Path, steps: int = 80, name: str = "dpo-prefs") -> str:
    """A finished DPO run whose rows carry TRL's DPO metrics (nbtrain/losses/dpo.py METRICS) and an
    eval every 20 steps. No training runs here: the rows are written by hand in the recipe's layout
    (the fixture SFT run's timings, a margin that grows and an accuracy that climbs)."""
    base = FINISHED.joinpath("metrics.jsonl").read_text().splitlines()
    rows = []
    for s in range(1, steps + 1):
        src = json.loads(base[s - 1])
        margin = round(0.02 * s**0.8, 4)
        row = {
            **{k: src[k] for k in ("grad_norm", "learning_rate", "tokens_per_s", "step_time")},
            "step": s,
            "epoch": round(s / steps, 4),
            "loss": round(0.6931 - 0.25 * (1 - 0.985**s), 4),
            "rewards/chosen": round(margin / 2, 4),
            "rewards/rejected": round(-margin / 2, 4),
            "rewards/accuracies": round(min(1.0, 0.5 + s / (1.6 * steps)), 4),
            "rewards/margins": margin,
            "logps/chosen": round(-45.0 + margin, 3),
            "logps/rejected": round(-47.0 - margin, 3),
        }
        if s % 20 == 0:
            row.update(
                eval_loss=round(row["loss"] + 0.03, 4), **{"eval_rewards/margins": margin * 0.9}
            )
        rows.append(row)
    config = {"model": "tiny-llama", "beta": 0.1, "learning_rate": 5e-6, "max_steps": steps}
    return _register_finished(out, rows, name, "dpo", config)


def grpo_run(out: Path, steps: int = 60, name: str = "grpo-math") -> str:
    """A finished GRPO run whose rows carry the rollout's and the loss's metrics under TRL's names
    (nbtrain/recipes/grpo/rollout.py finish, nbtrain/losses/grpo.py), two reward functions. Written
    by hand in the recipe's layout, as `dpo_run`."""
    rows = []
    for s in range(1, steps + 1):
        fmt = round(min(1.0, 0.2 + s / steps), 4)
        exact = round(0.1 + 0.5 * s / steps, 4)
        rows.append(
            {
                "step": s,
                "loss": round(0.01 * (1 + (s % 5)) / 5, 5),
                "grad_norm": round(0.5 + 0.1 * (s % 3), 3),
                "learning_rate": 1e-6,
                "tokens_per_s": 900.0 + 3 * s,
                "step_time": 1.2,
                "reward": round(fmt + exact, 4),
                "reward_std": 0.3,
                "frac_reward_zero_std": 0.1,
                "completions/mean_length": 40.0 + s / 2,
                "completions/clipped_ratio": 0.05,
                "rewards/format/mean": fmt,
                "rewards/format/std": 0.2,
                "rewards/exact/mean": exact,
                "rewards/exact/std": 0.3,
                "kl": round(0.0005 * s, 5),
                "clip_ratio/region_mean": 0.0,
            }
        )
    config = {"model": "tiny-llama", "num_generations": 4, "beta": 0.04, "max_steps": steps}
    return _register_finished(out, rows, name, "grpo", config)


def sweep_runs(base: Path, steps: int = 50) -> list[str]:
    """Three finished SFT runs of a sweep whose configs differ in many settings (long paths, a long
    list), so the compare view's table is wider than the panel. Rows: the fixture SFT run's, the loss
    scaled per run."""
    src = [json.loads(line) for line in FINISHED.joinpath("metrics.jsonl").read_text().splitlines()]
    ids = []
    for i, lr in enumerate((1e-4, 3e-4, 1e-3)):
        out = base / f"sweep-lr-{lr:g}"
        rows = [
            {**r, "loss": round(r["loss"] * (1 - 0.1 * i), 4), "time": 1.7e9 + 2 * r["step"]}
            for r in src[:steps]
        ]
        config = {
            "learning_rate": lr,
            "warmup_steps": 5 * (i + 1),
            "lora_r": 8 * (i + 1),
            "lora_alpha": 16 * (i + 1),
            "lora_dropout": 0.05 * i,
            "output_dir": str(out),
            "data_path": f"/home/someone/datasets/instructions/very/long/path/split-{i}.jsonl",
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"][
                : 3 + i
            ],
            # a long list: the compare table folds it under its first items
            "layers_to_transform": list(range(24 + 8 * i)),
            "seed": 1000 + i,
            "gradient_accumulation_steps": 1 + i,
            "max_length": 256 * (i + 1),
            "weight_decay": 0.01 * i,
        }
        ids.append(_register_finished(out, rows, f"sweep-lr-{lr:g}", "sft", config))
    return ids
