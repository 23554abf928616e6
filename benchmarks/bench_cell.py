"""Round trip of an empty `%%distributed` cell on 2 local engines, against raw ipyparallel on the same engines.

    .venv/bin/python benchmarks/bench_cell.py [--runs 200] [--quick] [--out FILE]

One `nbtrain.start(n=2)` cluster; interleaved, one after the other:
  A  nbtrain   `cluster.execute("")`, what a `%%distributed` cell runs (CellRun: stream hooks, output
               wait, error grouping)
  B  raw ipp   `view.execute("", block=False).get()` on a DirectView over the same two engines

Then, untimed for the ratio, where nbtrain's extra time goes: every step CellRun.run takes, timed with
wrappers installed from outside (no nbtrain edits), and a cProfile of both variants.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _phases(cluster: Any, view: Any, runs: int) -> dict[str, Any]:
    """Median time of each step of CellRun.run (and of raw execute/get), from timing wrappers."""
    import ipyparallel as ipp

    from nbtrain.cluster import cell, facade

    pc = time.perf_counter
    acc: dict[str, float] = defaultdict(float)
    per_run: dict[str, list[float]] = defaultdict(list)
    restore: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        restore.append((owner, name, orig))

        def timed(*a: Any, **k: Any) -> Any:
            s = pc()
            try:
                return orig(*a, **k)
            finally:
                acc[label] += pc() - s

        setattr(owner, name, timed)

    wrap(facade.Cluster, "view", "Cluster.view (new DirectView per cell)")
    wrap(ipp.DirectView, "execute", "DirectView.execute (send the request)")
    wrap(cell.CellRun, "_hook", "CellRun._hook (install stream callbacks on the IO thread)")
    wrap(ipp.AsyncResult, "wait", "AsyncResult.wait (reply from both engines)")
    wrap(ipp.AsyncResult, "wait_for_output", "AsyncResult.wait_for_output (iopub idle from both)")
    wrap(cell.CellRun, "_drain", "CellRun._drain")
    wrap(cell.CellRun, "_feed_metrics", "CellRun._feed_metrics")
    wrap(ipp.AsyncResult, "get", "AsyncResult.get")
    wrap(cell, "raise_for_failures", "raise_for_failures")
    try:
        for variant in ("nbtrain", "raw"):
            for _ in range(runs):
                acc.clear()
                s = pc()
                if variant == "nbtrain":
                    cluster.execute("")
                else:
                    view.execute("", block=False).get()
                total = pc() - s
                for k, v in acc.items():
                    per_run[f"{variant}: {k}"].append(v)
                per_run[f"{variant}: total"].append(total)
                # raw's get() calls wait() inside it; nbtrain's get() finds the result ready
                nested = ("AsyncResult.wait",) if variant == "raw" else ()
                inner = sum(v for k, v in acc.items() if not k.startswith(nested or "\0"))
                per_run[f"{variant}: not inside the steps above"].append(total - inner)
    finally:
        for owner, name, orig in reversed(restore):
            setattr(owner, name, orig)
    out = {
        k: {"median_ms": 1e3 * C.median(v), "p90_ms": 1e3 * C.quantile(v, 0.9)}
        for k, v in per_run.items()
    }
    return dict(sorted(out.items(), key=lambda kv: (kv[0].split(":")[0], -kv[1]["median_ms"])))


def _cprofile(fn: Any, runs: int, top: int = 15) -> dict[str, Any]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        fn()
    prof.disable()
    out: dict[str, Any] = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        out[key] = buf.getvalue()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--runs", type=int, default=200, help="timed runs of each variant (default 200)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 runs each, short profile")
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    args = ap.parse_args()
    C.setup_env()
    runs = 20 if args.quick else args.runs
    rec = C.Recorder("cell", args.quick)

    import nbtrain

    t = time.perf_counter()
    cluster = nbtrain.start(n=2)
    rec.data["cluster_start_s"] = time.perf_counter() - t
    try:
        view = cluster.client.direct_view(targets=cluster.engine_ids())
        variants = {
            "nbtrain": lambda: cluster.execute(""),
            "raw": lambda: view.execute("", block=False).get(),
        }
        for _ in range(5 if args.quick else 20):  # warm-up: first cells import and cache
            for fn in variants.values():
                fn()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(runs):
            for name, fn in variants.items():
                s = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - s)
        ms = {k: [1e3 * x for x in v] for k, v in times.items()}
        rec.data["runs"] = runs
        rec.data["summary_ms"] = {k: C.summary(v) for k, v in ms.items()}
        rec.data["phases_ms"] = _phases(cluster, view, 10 if args.quick else 100)
        prof_runs = 10 if args.quick else 100
        rec.data["cprofile_nbtrain"] = _cprofile(variants["nbtrain"], prof_runs)
        rec.data["cprofile_raw"] = _cprofile(variants["raw"], prof_runs)
        rec.data["profiled_runs"] = prof_runs
    finally:
        cluster.stop()

    nb, raw = rec.data["summary_ms"]["nbtrain"], rec.data["summary_ms"]["raw"]
    rec.metric(
        "empty %%distributed cell round trip, 2 ranks (median)",
        nb["median"],
        raw["median"],
        "raw ipyparallel view.execute + get",
        "ms",
        "nbtrain <= 10 ms",
    )
    rec.metric(
        "empty %%distributed cell round trip, 2 ranks (p90)",
        nb["p90"],
        raw["p90"],
        "raw ipyparallel view.execute + get",
        "ms",
        "",
    )
    rec.finish(args.out)


if __name__ == "__main__":
    main()
