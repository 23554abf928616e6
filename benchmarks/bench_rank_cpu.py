"""CPU work per rank of the same fine-tune under nbtrain and under torchrun: is an engine any slower?

    .venv/bin/python benchmarks/bench_rank_cpu.py [--reps 6] [--out FILE]

bench_finetune's wall-clock ratio swings with the VM's host; a rank's own CPU time (time.thread_time of
the thread that trains) does not count stolen time or time spent waiting, so if ranks in ipyparallel
engines did more work per step (GIL hand-offs to engine threads, a colder heap, ...) it would show here.
Each round: a fresh 2-engine nbtrain cluster runs `_rank_cpu_worker.py` as a cell, then torchrun runs
the same file; each does a 20-step warm-up fine-tune, then the measured 120-step one. Then torchrun
runs it with no warm-up (the measured fine-tune is the process's first, as in bench_finetune).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_finetune import MODEL, _config, _fresh, tokens_per_s  # noqa: E402

WORKER = C.HERE / "_rank_cpu_worker.py"


def _reports(text: str) -> list[dict]:
    # two ranks writing to one pipe can share a line: find each report, not each line
    return [json.loads(m) for m in re.findall(r"RANK_CPU (\{[^}]*\})", text)]


def _torchrun(cfg: dict, *args: str) -> list[dict]:
    """The worker under `torchrun --standalone --nproc_per_node=2`; its ranks' reports."""
    proc = subprocess.run(
        [C.bin_path("torchrun"), "--standalone", "--nproc_per_node=2", str(WORKER)]
        + [json.dumps(cfg), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600,
    )
    if proc.returncode != 0:
        msg = f"torchrun {' '.join(args)} failed:\n{proc.stderr[-3000:]}"
        raise RuntimeError(msg)
    return _reports(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6, help="rounds (default 6)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.steps <= 10:
        ap.error(
            "--steps must be above 10: the first 2 logged rows (10 steps) are left out as warm-up"
        )
    C.setup_env()
    rec = C.Recorder("rank_cpu", False)
    import nbtrain
    from nbtrain.model.tiny import make_tiny_model

    model = make_tiny_model(C.WORK / "ft-model", **MODEL)
    runs: dict[str, list[dict]] = {"nbtrain": [], "torchrun": [], "torchrun_cold": []}
    code = WORKER.read_text()
    for i in range(args.reps):
        cfg = _config(model, args.steps, _fresh(C.WORK / "rank-cpu" / f"nbtrain-{i}"))
        # glibc's malloc on both sides: this compares the processes, not the allocators
        # (bench_finetune compares those)
        cluster = nbtrain.start(n=2, env={"OMP_NUM_THREADS": "1"}, allocator="system")
        try:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                cluster.execute(
                    f"import sys\nsys.argv = ['worker', {json.dumps(cfg)!r}]\n{code}",
                    output="all",
                    live=False,
                )
        finally:
            cluster.stop()
        runs["nbtrain"].append(
            {"ranks": _reports(out.getvalue()), **tokens_per_s(cfg["output_dir"], 2)}
        )
        for name, extra in (("torchrun", ()), ("torchrun_cold", ("cold",))):
            # torchrun_cold: no warm-up, the measured fine-tune is the process's first
            cfg = _config(model, args.steps, _fresh(C.WORK / "rank-cpu" / f"{name}-{i}"))
            runs[name].append(
                {"ranks": _torchrun(cfg, *extra), **tokens_per_s(cfg["output_dir"], 2)}
            )
        print(
            f"round {i + 1}/{args.reps}: "
            + " | ".join(
                f"{k} {sum(r['cpu_s'] for r in v[-1]['ranks']) / 2:.2f} s CPU per rank, "
                f"{v[-1]['tokens_per_s']:.0f} tok/s"
                for k, v in runs.items()
            ),
            file=sys.stderr,
            flush=True,
        )

    def cpu(name: str) -> list[float]:
        return [sum(r["cpu_s"] for r in run["ranks"]) / len(run["ranks"]) for run in runs[name]]

    def tok(name: str) -> list[float]:
        return [run["tokens_per_s"] for run in runs[name]]

    def paired(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b)]

    paired_cpu = paired(cpu("nbtrain"), cpu("torchrun"))
    paired_tok = paired(tok("nbtrain"), tok("torchrun"))
    paired_warm = paired(tok("torchrun"), tok("torchrun_cold"))
    rec.data.update(
        {
            "reps": args.reps,
            "steps": args.steps,
            "runs": runs,
            "paired_cpu_ratio": paired_cpu,
            "paired_tokens_ratio": paired_tok,
            "paired_tokens_ratio_torchrun_warm_over_cold": paired_warm,
        }
    )
    rec.metric(
        f"CPU seconds per rank for {args.steps} warm steps (nbtrain engine / torchrun worker)",
        C.median(cpu("nbtrain")),
        C.median(cpu("torchrun")),
        "torchrun worker",
        "s",
        "~1.0: an engine does no extra work per step",
        note=f"median of paired ratios {C.median(paired_cpu):.3f}",
    )
    rec.metric(
        "the same runs: global tokens/s (nbtrain / torchrun)",
        C.median(tok("nbtrain")),
        C.median(tok("torchrun")),
        "torchrun",
        "tok/s",
        ">= 0.97",
        note=f"median of paired ratios {C.median(paired_tok):.3f}",
    )
    rec.metric(
        "torchrun alone: tokens/s of a process's second fine-tune / its first",
        C.median(tok("torchrun")),
        C.median(tok("torchrun_cold")),
        "torchrun, first fine-tune of the process",
        "tok/s",
        "none: what bench_finetune mixes in (warm engines against a cold torchrun)",
        note=f"median of paired ratios {C.median(paired_warm):.3f}",
    )
    rec.finish(args.out)


if __name__ == "__main__":
    main()
