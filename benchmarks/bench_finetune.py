"""LoRA fine-tuning throughput on 2 local ranks: nbtrain against torchrun, and the live display's overhead.

    .venv/bin/python benchmarks/bench_finetune.py [--reps 16] [--steps 80] [--quick] [--out FILE]

The same run in every variant: `nbtrain.finetune(SFTConfig(...))` on a tiny Llama built by
`make_tiny_model` (hidden 256, 4 layers: ~50-100 ms a step here), the shipped instruction data, batch
4 per rank, the same steps and seed, one thread per rank (OMP_NUM_THREADS=1). Four variants:
  nolive   nbtrain: a `%%distributed --no-live` cell in a real Jupyter kernel (jupyter_client), on
           one 2-engine cluster started once, as a notebook user has it (engines with tcmalloc
           where installed: nbtrain.cluster.allocator)
  live     the same cell with the live loss / tokens/s display drawing
  torchrun `torchrun --standalone --nproc_per_node=2 _torchrun_finetune.py`, a fresh job each run,
           as a torchrun user has it (glibc's malloc)
  torchrun_tcmalloc  the same with the engines' malloc preloaded: launcher against launcher, with
           the allocator held equal
run in cycles of nolive, live, nolive, torchrun, nolive, torchrun_tcmalloc (and one last nolive), so
every live and torchrun run sits between two --no-live runs. Its ratio is taken against their geometric mean: this VM's speed
drifts by up to 10% within a minute (benchmarks/NOTES.md), and two neighbours either side cancel a
linear drift. The headline ratios are medians of those sandwiched pairs, with a distribution-free 90%
confidence interval; the ratio of the plain medians is reported beside them.
Global tokens/s comes from each run's metrics.jsonl (rank 0 writes it), leaving out the first
`--warmup-rows` logged rows; it is total tokens over total time of the remaining intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MODEL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 512, "num_heads": 4}


def _config(model: str, steps: int, output_dir: str) -> dict[str, Any]:
    from nbtrain.data.examples import instructions_path

    return {
        "model": model,
        "data": instructions_path(),
        "output_dir": output_dir,
        "max_steps": steps,
        "per_device_train_batch_size": 4,
        "max_length": 256,
        "learning_rate": 1e-3,
        "logging_steps": 5,
        "save_steps": None,
        "seed": 0,
        "overwrite": True,
    }


def _fresh(path: Path) -> str:
    """An empty run folder: the CPU meter counts metrics.jsonl rows, so no rows from an earlier run."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    return str(path)


def tokens_per_s(output_dir: str, warmup_rows: int) -> dict[str, Any]:
    """Global tokens/s of one run from its metrics.jsonl, without the first `warmup_rows` rows."""
    rows = [json.loads(line) for line in Path(output_dir, "metrics.jsonl").read_text().splitlines()]
    tokens = seconds = 0.0
    prev_step = rows[warmup_rows - 1]["step"] if warmup_rows else 0
    for row in rows[warmup_rows:]:
        n = row["step"] - prev_step
        prev_step = row["step"]
        seconds += row["step_time"] * n
        tokens += row["tokens_per_s"] * row["step_time"] * n
    return {
        "tokens_per_s": tokens / seconds if seconds else None,
        "step_time_s": seconds
        / max(1, rows[-1]["step"] - (rows[warmup_rows - 1]["step"] if warmup_rows else 0)),
        "rows": len(rows),
        "last_step": rows[-1]["step"],
        "final_loss": rows[-1]["loss"],
    }


# ------------------------------------------------------------------------------------ the kernel
class Kernel:
    """A real Jupyter kernel driven over jupyter_client, as a notebook frontend drives it."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ)
        self.km.start_kernel(env=env, cwd=str(C.REPO))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        # the kernel's process tree holds the controller, engines, nannies and the watchdog
        self.pid = self.km.provisioner.process.pid

    def run(self, code: str, timeout: float = 600) -> dict[str, Any]:
        """Execute `code`; count the output messages by type; raise if the cell failed."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        counts: Counter[str] = Counter()
        text: list[str] = []
        error = None
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            counts[kind] += 1
            if kind == "stream":
                text.append(msg["content"]["text"])
            elif kind == "error":
                error = "\n".join(msg["content"]["traceback"])
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        wall = time.perf_counter() - t0
        if error is not None:
            msg = f"the kernel cell failed:\n{code}\n{error[-4000:]}"
            raise RuntimeError(msg)
        return {"wall_s": wall, "messages": dict(counts), "text": "".join(text)}

    def close(self) -> None:
        try:
            self.run(
                "import nbtrain\n_c = nbtrain.current_cluster()\n_c and _c.stop()", timeout=120
            )
        finally:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)


def _cell(cfg: dict[str, Any], live: bool) -> str:
    # Cluster.execute is what `%%distributed [--no-live]` calls (the magic only parses its line): the
    # benchmark drives the Python twin so it does not depend on the magics module's argument parser
    code = f"import nbtrain\n_result = nbtrain.finetune(nbtrain.SFTConfig(**{cfg!r}))\n"
    return f"nbtrain.current_cluster().execute({code!r}, live={live!r})\n"


def _run_torchrun(
    cfg: dict[str, Any], warmup_rows: int, preload: str | None = None
) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if preload:
        env["LD_PRELOAD"] = preload
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            C.bin_path("torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            str(C.HERE / "_torchrun_finetune.py"),
            json.dumps(cfg),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    with C.CpuMeter([proc.pid], Path(cfg["output_dir"], "metrics.jsonl")) as cpu:
        stdout, stderr = proc.communicate(timeout=600)
    if proc.returncode != 0:
        msg = f"torchrun finetune failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
        raise RuntimeError(msg)
    reports = [json.loads(x) for x in stdout.splitlines() if x.startswith('{"rank"')]
    return {
        "wall_s": time.perf_counter() - t0,
        "threads": sorted((r["rank"], r["threads"]) for r in reports),
        "cpu": cpu.report(warmup_rows),
    }


# One cycle of the schedule. Every torchrun run and every live run sits between two --no-live runs, and
# is compared with their geometric mean: this VM's speed drifts by up to 10% over tens of seconds, and
# the two runs either side cancel a drift that is linear over the cycle (a per-round pair does not).
CYCLE = (
    "nbtrain_nolive",
    "nbtrain_live",
    "nbtrain_nolive",
    "torchrun",
    "nbtrain_nolive",
    "torchrun_tcmalloc",
)


def sandwich_ratios(
    runs: dict[str, list[dict[str, Any]]],
    order: list[tuple[str, int]],
    name: str,
    invert: bool = False,
) -> list[float]:
    """tokens/s of each `name` run over the geometric mean of the --no-live runs just before and after.

    `invert` gives the --no-live mean over the run instead (nbtrain / torchrun).
    """
    out = []
    for k, (variant, i) in enumerate(order):
        if variant != name or k == 0 or k + 1 >= len(order):
            continue
        before, after = order[k - 1], order[k + 1]
        if before[0] != "nbtrain_nolive" or after[0] != "nbtrain_nolive":
            continue
        ref = (
            runs[before[0]][before[1]]["tokens_per_s"] * runs[after[0]][after[1]]["tokens_per_s"]
        ) ** 0.5
        mine = runs[variant][i]["tokens_per_s"]
        out.append(ref / mine if invert else mine / ref)
    return out


def null_ratios(
    runs: dict[str, list[dict[str, Any]]], order: list[tuple[str, int]], period: int = len(CYCLE)
) -> list[float]:
    """The method on itself: the second --no-live run of each cycle against the geometric mean of the
    --no-live runs two places either side of it (as far apart as a sandwich's neighbours).

    Nothing differs but time, so these ratios scatter around 1 by the noise alone: how wide they spread
    says how far apart two variants must be before the sandwiched ratios can tell them apart.
    """
    out = []
    for k in range(0, len(order) - 4, period):
        first, mid, nxt = order[k], order[k + 2], order[k + 4]
        if not all(v == "nbtrain_nolive" for v, _ in (first, mid, nxt)):
            continue
        tps = [runs[v][i]["tokens_per_s"] for v, i in (first, mid, nxt)]
        out.append(tps[1] / (tps[0] * tps[2]) ** 0.5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=16, help="cycles of the schedule (default 16)")
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps per run (default 80)")
    ap.add_argument(
        "--warmup-rows", type=int, default=2, help="logged rows left out (5 steps each)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1 round of 20 steps, no warm-up"
    )
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    args = ap.parse_args()
    C.setup_env()
    reps, steps = (1, 20) if args.quick else (args.reps, args.steps)
    rec = C.Recorder("finetune", args.quick)

    from nbtrain.model.tiny import make_tiny_model

    model = make_tiny_model(C.WORK / "ft-model", **MODEL)
    rec.data["model"] = MODEL
    runs_dir = C.WORK / "ft-runs"

    kernel = Kernel()
    try:
        t = time.perf_counter()
        kernel.run("import nbtrain\ncluster = nbtrain.start(n=2, env={'OMP_NUM_THREADS': '1'})")
        rec.data["kernel_cluster_start_s"] = time.perf_counter() - t
        threads = kernel.run(
            "cluster.execute('import torch; print(\"threads\", torch.get_num_threads())', output='all')"
        )["text"]
        rec.data["nbtrain_threads_per_rank"] = threads.strip().splitlines()
        in_kernel = kernel.run("from nbtrain.cluster.cell import in_kernel\nprint(in_kernel())")[
            "text"
        ].strip()
        rec.data["kernel_in_kernel"] = in_kernel
        rec.data["nbtrain_engine_allocator"] = kernel.run("print(cluster.allocator)")[
            "text"
        ].strip()
        from nbtrain.cluster.allocator import find_tcmalloc

        tcmalloc = find_tcmalloc()
        rec.data["tcmalloc"] = tcmalloc

        def nbtrain_variant(live: bool, tag: str) -> dict[str, Any]:
            out = _fresh(runs_dir / tag)
            cfg = _config(model, steps, out)
            with C.CpuMeter([kernel.pid], Path(out, "metrics.jsonl")) as cpu:
                res = kernel.run(_cell(cfg, live))
            msgs = res["messages"]
            return {
                "output_dir": out,
                "wall_s": res["wall_s"],
                "display_messages": msgs.get("display_data", 0),
                "display_updates": msgs.get("update_display_data", 0),
                "stream_messages": msgs.get("stream", 0),
                "cpu": cpu.report(args.warmup_rows),
            }

        def torchrun_variant(tag: str, preload: str | None = None) -> dict[str, Any]:
            out = _fresh(runs_dir / tag)
            return {
                "output_dir": out,
                **_run_torchrun(_config(model, steps, out), args.warmup_rows, preload),
            }

        variants = {
            "nbtrain_live": lambda tag: nbtrain_variant(True, tag),
            "torchrun": torchrun_variant,
            "nbtrain_nolive": lambda tag: nbtrain_variant(False, tag),
        }
        cycle = CYCLE
        if tcmalloc:
            variants["torchrun_tcmalloc"] = lambda tag: torchrun_variant(tag, tcmalloc)
        else:  # no tcmalloc here: the engines run glibc's malloc too, and there is no like-for-like arm
            cycle = CYCLE[:4]
        if not args.quick:
            # engines import transformers/peft once; page cache for torchrun's imports
            for name, fn in variants.items():
                fn(f"warmup-{name}")
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
        order: list[tuple[str, int]] = []  # (variant, index in runs[variant]) in the order run
        schedule = [n for _ in range(reps) for n in cycle] + ["nbtrain_nolive"]
        for k, name in enumerate(schedule):
            i = len(runs[name])
            r = variants[name](f"{name}-{i}")
            r.update(tokens_per_s(r["output_dir"], args.warmup_rows))
            runs[name].append(r)
            order.append((name, i))
            print(
                f"run {k + 1}/{len(schedule)} {name}: {r['tokens_per_s']:.0f} tok/s, "
                f"{1e3 * r['step_time_s']:.0f} ms/step, outside the ranks "
                f"{100 * (r['cpu']['outside_ranks_share_of_machine'] or 0):.2f}% of the machine",
                file=sys.stderr,
                flush=True,
            )
    finally:
        kernel.close()

    def med(name: str, key: str = "tokens_per_s") -> float | None:
        return C.median([r[key] for r in runs[name] if r.get(key) is not None])

    live, tr, nolive = med("nbtrain_live"), med("torchrun"), med("nbtrain_nolive")
    tr_tc = med("torchrun_tcmalloc") if runs.get("torchrun_tcmalloc") else None
    paired_tr = sandwich_ratios(runs, order, "torchrun", invert=True)
    paired_tc = sandwich_ratios(runs, order, "torchrun_tcmalloc", invert=True)
    paired_live = sandwich_ratios(runs, order, "nbtrain_live")
    null = null_ratios(runs, order, len(cycle))

    def outside(name: str) -> float | None:
        return C.median(
            [
                r["cpu"]["outside_ranks_share_of_machine"]
                for r in runs[name]
                if r["cpu"]["outside_ranks_share_of_machine"] is not None
            ]
        )

    def ci_note(xs: list[float], a: float | None, b: float | None) -> str:
        if not xs:
            return ""
        ci = C.median_ci(xs)
        text = f"ratio: median of {len(xs)} sandwiched pairs"
        text += f", 90% CI {ci[0]:.3f}-{ci[1]:.3f}" if ci else ""
        plain = C.ratio(a, b)
        return text + (f"; ratio of the plain medians {plain:.3f}" if plain else "")

    rec.data.update(
        {
            "reps": reps,
            "steps": steps,
            "warmup_rows_skipped": args.warmup_rows,
            "summary": {
                name: {
                    "tokens_per_s": C.summary([r["tokens_per_s"] for r in rs]),
                    "step_time_ms": C.summary([1e3 * r["step_time_s"] for r in rs]),
                }
                for name, rs in runs.items()
            },
            "paired_ratio_nbtrain_over_torchrun": paired_tr,
            "paired_ratio_nbtrain_over_torchrun_tcmalloc": paired_tc,
            "paired_ratio_ci90_nbtrain_over_torchrun_tcmalloc": C.median_ci(paired_tc),
            "paired_ratio_live_over_nolive": paired_live,
            "paired_ratio_ci90_nbtrain_over_torchrun": C.median_ci(paired_tr),
            "paired_ratio_ci90_live_over_nolive": C.median_ci(paired_live),
            "null_ratio_nolive_over_nolive": null,
            "null_ratio_ci90": C.median_ci(null),
            "outside_ranks_share_of_machine": {name: outside(name) for name in runs},
            "live_display_messages_per_run": [
                r["display_messages"] + r["display_updates"] for r in runs["nbtrain_live"]
            ],
            "nolive_display_messages_per_run": [
                r["display_messages"] + r["display_updates"] for r in runs["nbtrain_nolive"]
            ],
            "torchrun_threads_per_rank": runs["torchrun"][0]["threads"]
            if runs["torchrun"]
            else None,
            "runs": runs,
        }
    )
    rec.metric(
        "LoRA finetune, 2 ranks: global tokens/s (nbtrain --no-live / torchrun)",
        nolive,
        tr,
        "torchrun, same finetune",
        "tok/s",
        ">= 0.97",
        ratio_value=C.median(paired_tr),
        note=ci_note(paired_tr, nolive, tr),
    )
    rec.metric(
        "LoRA finetune, 2 ranks: tokens/s (nbtrain --no-live / torchrun with the same malloc)",
        nolive,
        tr_tc,
        "torchrun, tcmalloc preloaded",
        "tok/s",
        "",
        ratio_value=C.median(paired_tc),
        note=ci_note(paired_tc, nolive, tr_tc)
        + "; launcher against launcher: both sides run tcmalloc",
    )
    rec.metric(
        "LoRA finetune: tokens/s with the live display drawing / --no-live (real kernel)",
        live,
        nolive,
        "nbtrain --no-live",
        "tok/s",
        ">= 0.99",
        ratio_value=C.median(paired_live),
        note=ci_note(paired_live, live, nolive),
    )
    # noise-free view of the same question: CPU the launcher side burns while the ranks train is
    # taken from the ranks' cores (2 ranks, 2 cores), so its share of the machine bounds the slowdown
    for name, label in (("nbtrain_nolive", "--no-live"), ("nbtrain_live", "live display")):
        o, t = outside(name), outside("torchrun")
        rec.metric(
            f"CPU outside the 2 ranks while training, share of the machine (nbtrain {label} / torchrun)",
            None if o is None else 100 * o,
            None if t is None else 100 * t,
            "torchrun's agent",
            "%",
            "<= 3% (i.e. >= 0.97x tok/s)" if name == "nbtrain_nolive" else "<= 1% over --no-live",
            ratio_value=None if o is None or t is None else o - t + 1.0,
            note="ratio column here: 1 + (nbtrain share - torchrun share); the controller, nanny, "
            "watchdog and kernel for nbtrain, the elastic agent for torchrun",
        )
    rec.metric(
        "LoRA finetune, 2 ranks: global tokens/s (nbtrain live / torchrun)",
        live,
        tr,
        "torchrun, same finetune",
        "tok/s",
        "",
    )
    rec.finish(args.out)


if __name__ == "__main__":
    main()
