"""Run every benchmark, one after the other; write results/results.json and RESULTS.md beside this file.

    .venv/bin/python benchmarks/run_all.py            # the full set (~15 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # smoke run; writes into benchmarks/_work/ instead
    .venv/bin/python benchmarks/run_all.py --data     # also bench_data.py (nbtrain vs TRL data set-up, 20+ min)

Each benchmark runs in its own process (`bench_*.py --out FILE`), so one's engines and imports never
share a process with the next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

BENCHES = ("startup", "cell", "finetune", "generate", "grpo")
# long benchmarks, run only when asked for by their flag
LONG = ("data",)


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if unit == "s":
            return f"{x:.2f} s"
        if unit == "ms":
            return f"{x:.2f} ms"
        if unit == "%":
            return f"{x:.2f}%"
        if unit == "tok/s":
            return f"{x:,.0f} tok/s"
        return f"{x:.3f}"
    return str(x)


def render_markdown(results: dict[str, Any]) -> str:
    b = results["benchmarks"]
    lines = [
        "# nbtrain benchmark results",
        "",
        f"Measured {results['started']} on `{results['machine']['host']}` ({results['machine']['cpus']} CPUs, "
        f"{results['machine']['platform']}, Python {results['machine']['python']}), "
        f"{'QUICK smoke run, not figures to quote' if results['quick'] else 'full run'}; "
        f"`benchmarks/run_all.py` wrote this file and `results/results.json` (every run's raw numbers).",
        "",
        "This is a small shared VM (2 cores; its host's load moves under it, so one run's speed can "
        "swing by 2x): variants were interleaved (A, B, C, A, B, C, ...) so load drifts over all of them "
        "alike, and medians are shown. Load average (1, 5, 15 min) "
        "at the start and end of each benchmark (on 2 cores, a load above 2 means other jobs were "
        "competing with the benchmark for CPU):",
        "",
        "| benchmark | started | commit | load at start | load at end | wall |",
        "|---|---|---|---|---|---|",
    ]
    for name in BENCHES:
        if name in b:
            r = b[name]
            code = r.get("code", {})
            commit = code.get("commit", "?")
            if code.get("nbtrain_dirty_files"):
                commit += f" + {len(code['nbtrain_dirty_files'])} uncommitted nbtrain file(s)"
            lines.append(
                f"| {name} | {r['started']} | {commit} | {r['loadavg_start']} | {r['loadavg_end']} | "
                f"{r['wall_s']:.0f} s |"
            )
    lines += [
        "",
        "## Summary",
        "",
        "Ratio is nbtrain / baseline: for times lower is better, for tokens/s higher is better.",
        "",
        "| metric | nbtrain | baseline | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for name in BENCHES:
        for m in b.get(name, {}).get("metrics", []):
            note = f" ({m['note']})" if m.get("note") else ""
            lines.append(
                f"| {m['metric']} | {_fmt(m['nbtrain'], m['unit'])} | {_fmt(m['baseline'], m['unit'])} "
                f"({m['baseline_name']}) | {_fmt(m['ratio'])}{note} | {m['target'] or '–'} |"
            )
    if "startup" in b:
        s = b["startup"]
        sm = s["summary"]
        lines += [
            "",
            "## Where nbtrain's cold start goes",
            "",
            f"Medians over {s['reps']} runs of `nbtrain.start(n=2)` with timing wrappers around the steps it "
            "takes (installed from outside; nbtrain's code is unchanged). ipyparallel is imported before "
            "start() in this instrumented variant so it can be wrapped.",
            "",
            "| phase | median |",
            "|---|---|",
        ]
        for p in s["nbtrain_breakdown"]:
            lines.append(f"| {p['phase']} | {_fmt(p['median_s'], 's')} |")
        lines += [
            "",
            "Other figures (medians):",
            "",
            f"- `import nbtrain` (+ `nbtrain.start` lookup): {_fmt(sm['nbtrain_import_s']['median'], 's')}; "
            f"`cluster.stop()`: {_fmt(sm['nbtrain_stop_s']['median'], 's')}; whole nbtrain process incl. "
            f"interpreter start and stop: {_fmt(sm['nbtrain_process_wall_incl_stop_s']['median'], 's')}.",
            f"- A fresh interpreter's `import torch.distributed` (each engine pays it inside the process-group "
            f"step): {_fmt(sm['fresh_import_torch_distributed_s']['median'], 's')}.",
            f"- torchrun: command wall {_fmt(sm['torchrun_command_wall_s']['median'], 's')}, spawn to rank-0 "
            f"barrier done {_fmt(sm['torchrun_spawn_to_ready_s']['median'], 's')}; "
            + ", ".join(f"{k} {_fmt(v, 's')}" for k, v in s["torchrun_breakdown"].items())
            + ".",
            f"- raw ipyparallel: `start_and_connect_sync` {_fmt(sm['rawipp_start_and_connect_s']['median'], 's')} "
            f"(ipyparallel's default 3 s heartbeat), then the manual `init_process_group` "
            f"{_fmt(sm['rawipp_init_group_s']['median'], 's')}.",
        ]
    if "cell" in b:
        c = b["cell"]
        lines += [
            "",
            "## Where an empty `%%distributed` cell's time goes",
            "",
            f"{c['runs']} interleaved runs of each variant on the same two engines: nbtrain "
            f"median {_fmt(c['summary_ms']['nbtrain']['median'], 'ms')} / p90 "
            f"{_fmt(c['summary_ms']['nbtrain']['p90'], 'ms')}; raw `view.execute('').get()` median "
            f"{_fmt(c['summary_ms']['raw']['median'], 'ms')} / p90 {_fmt(c['summary_ms']['raw']['p90'], 'ms')}. "
            f"Steps of one cell, timed with wrappers over {c['profiled_runs']} more runs (medians, ms):",
            "",
            "| step | median | p90 |",
            "|---|---|---|",
        ]
        for k, v in c["phases_ms"].items():
            lines.append(f"| {k} | {v['median_ms']:.3f} | {v['p90_ms']:.3f} |")
        lines += [
            "",
            "cProfile of nbtrain's cell (top by internal time) is in `results/results.json` "
            "(`benchmarks.cell.cprofile_nbtrain`), next to the raw variant's.",
        ]
    if "finetune" in b:
        f = b["finetune"]
        lines += [
            "",
            "## LoRA fine-tuning",
            "",
            f"Tiny Llama {f['model']}, {f['steps']} steps, batch 4 per rank, max_length 256, seed 0, one "
            f"thread per rank (nbtrain ranks: {', '.join(f['nbtrain_threads_per_rank'])}; torchrun ranks "
            f"(rank, threads): {f['torchrun_threads_per_rank']}); first {f['warmup_rows_skipped']} logged rows "
            f"(5 steps each) left out. nbtrain runs are `Cluster.execute(code, live=True/False)` cells (what "
            f"`%%distributed [--no-live]` calls) in a real Jupyter kernel "
            f"(`in_kernel()` = {f['kernel_in_kernel']}); the live variant sent "
            f"{f['live_display_messages_per_run']} display messages per run, the --no-live one "
            f"{f['nolive_display_messages_per_run']}. The engines' malloc: "
            f"{f.get('nbtrain_engine_allocator', 'system')} (torchrun_tcmalloc preloads "
            f"`{f.get('tcmalloc')}` into torchrun's ranks, so launcher meets launcher at equal malloc).",
            "",
            "| variant | tokens/s median | min | max | max/min | step time median |",
            "|---|---|---|---|---|---|",
        ]
        for name, sm in f["summary"].items():
            t = sm["tokens_per_s"]
            lines.append(
                f"| {name} | {_fmt(t['median'], 'tok/s')} | {_fmt(t['min'], 'tok/s')} | "
                f"{_fmt(t['max'], 'tok/s')} | {t['max'] / t['min']:.2f} | "
                f"{_fmt(sm['step_time_ms']['median'], 'ms')} |"
            )
        lines += [
            "",
            "Runs went in cycles of --no-live, live, --no-live, torchrun, --no-live, torchrun_tcmalloc, "
            "so each live and torchrun run "
            "sits between two --no-live runs and is compared with their geometric mean (a drift of the "
            "VM's speed that is linear over the cycle cancels). Those sandwiched ratios, "
            f"nbtrain --no-live / torchrun: "
            f"{', '.join(f'{x:.3f}' for x in f['paired_ratio_nbtrain_over_torchrun'])}; "
            f"nbtrain --no-live / torchrun_tcmalloc: "
            f"{', '.join(f'{x:.3f}' for x in f.get('paired_ratio_nbtrain_over_torchrun_tcmalloc', []))}; "
            f"live / --no-live: {', '.join(f'{x:.3f}' for x in f['paired_ratio_live_over_nolive'])}. "
            "The tables' ratio is their median, with a distribution-free 90% confidence interval in the "
            "note. The same method applied to --no-live against itself (the second --no-live run of a "
            "cycle against the --no-live runs two places either side), which only noise can move: "
            f"{', '.join(f'{x:.3f}' for x in f.get('null_ratio_nolive_over_nolive', []))}"
            + (
                f" (median {C.median(f['null_ratio_nolive_over_nolive']):.3f})."
                if f.get("null_ratio_nolive_over_nolive")
                else "."
            )
            + " A variant's max/min far above 1 is the machine's speed moving during the run.",
        ]
        if "outside_ranks_share_of_machine" in f:
            shares = f["outside_ranks_share_of_machine"]
            one = f["runs"]["nbtrain_nolive"][0]["cpu"] if f["runs"]["nbtrain_nolive"] else {}
            lines += [
                "",
                "CPU used outside the two ranks while they trained (psutil per-thread times over the "
                "same steps as tokens/s; median share of the machine's 2 cores): "
                + ", ".join(f"{name} {100 * v:.2f}%" for name, v in shares.items() if v is not None)
                + ". On a machine whose cores the ranks fill, that CPU is taken from them, so it bounds "
                "the launcher's cost whatever the wall-clock noise. Where it went in the first "
                "--no-live run: "
                + ", ".join(
                    f"`{cmd.strip()}` {sec:.2f} s" for cmd, sec in one.get("outside_top", [])
                )
                + ".",
            ]
    return "\n".join(lines) + "\n"


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """RESULTS.md: the table above, and bench_data's and bench_grpo's sections where the results hold
    them."""
    path.write_text(render_markdown(results))
    if "data" in results["benchmarks"]:
        import bench_data

        bench_data.render_results(results["benchmarks"]["data"], path)
    if "grpo" in results["benchmarks"]:
        import bench_grpo

        bench_grpo.render_results(results["benchmarks"]["grpo"], path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run of every benchmark")
    ap.add_argument("--only", nargs="*", choices=BENCHES, default=list(BENCHES))
    ap.add_argument(
        "--finetune-reps", type=int, default=None, help="cycles of bench_finetune (its default: 16)"
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where results.json and RESULTS.md go (default: benchmarks/results/ and benchmarks/, or benchmarks/_work with --quick)",
    )
    ap.add_argument(
        "--data",
        action="store_true",
        help="also run bench_data.py: nbtrain's data set-up against TRL at 10k-400k rows (long: 20+ min)",
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="only rewrite RESULTS.md from the existing results.json",
    )
    args = ap.parse_args()
    C.setup_env()
    out_dir = Path(args.out_dir) if args.out_dir else (C.WORK if args.quick else C.HERE)
    # the committed run keeps its raw numbers in benchmarks/results/, RESULTS.md at the top
    json_dir = C.RESULTS if out_dir == C.HERE else out_dir
    if args.render:
        results = json.loads((json_dir / "results.json").read_text())
        write_markdown(results, out_dir / "RESULTS.md")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    json_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quick": args.quick,
        "machine": C.machine(),
        "loadavg_start": C.loadavg(),
        "benchmarks": {},
    }
    previous = json_dir / "results.json"
    if previous.is_file():
        # a partial re-run keeps the other benchmarks' last results (each carries its own date and
        # load), and a run without --data keeps the last bench_data results
        old = json.loads(previous.read_text())
        if old.get("quick") == args.quick:
            kept = old.get("benchmarks", {})
            if set(args.only) == set(BENCHES):
                kept = {k: v for k, v in kept.items() if k in LONG}
            results["benchmarks"].update(kept)
    failed = []
    for name in [*args.only, *(["data"] if args.data else [])]:
        part = C.WORK / f"{name}{'-quick' if args.quick else ''}.json"
        cmd = [C.python(), str(C.HERE / f"bench_{name}.py"), "--out", str(part)]
        if args.quick:
            cmd.append("--quick")
        elif name == "finetune" and args.finetune_reps:
            cmd += ["--reps", str(args.finetune_reps)]
        print(f"== {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if proc.returncode != 0:
            failed.append(name)
            continue
        results["benchmarks"][name] = json.loads(part.read_text())
    results["loadavg_end"] = C.loadavg()
    (json_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    write_markdown(results, out_dir / "RESULTS.md")
    print(f"wrote {json_dir / 'results.json'} and {out_dir / 'RESULTS.md'}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
