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
