"""Cold start to a ready process group on 2 local engines: nbtrain against torchrun and raw ipyparallel.

    .venv/bin/python benchmarks/bench_startup.py [--reps 5] [--quick] [--out FILE]

Variants, each a fresh process, interleaved (A, B, C, D, A, B, C, D, ...):
  A  nbtrain       `import nbtrain; nbtrain.start(n=2)`: time of the start() call, and the whole process
                   wall time (interpreter start to ready, and to exit after `stop()`)
  B  torchrun      `torchrun --standalone --nproc_per_node=2 _gloo_barrier.py` (init gloo, barrier):
                   whole command wall time, and spawn to rank 0's barrier returning
  C  raw ipp       `ipp.Cluster(n=2).start_and_connect_sync()` + a hand-written `init_process_group`
                   (gloo, env set by hand) on both engines
  D  nbtrain, timed in phases: the same `nbtrain.start(n=2)` with timing wrappers around the steps
                   it calls (controller, engines, client, registration, hello, process group), installed
                   from outside; ipyparallel is imported before start() so it can be wrapped, and its
                   import time is reported as its own phase. Used for the breakdown only.
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

N = 2


# ----------------------------------------------------------------------------------------- children
def _child_nbtrain() -> dict[str, Any]:
    t_begin = time.time()
    p0 = time.perf_counter()
    import nbtrain

    start = nbtrain.start
    p1 = time.perf_counter()
    cluster = start(n=N)
    p2 = time.perf_counter()
    t_ready = time.time()
    ok = cluster.run(_group_ok)
    p3 = time.perf_counter()
    cluster.stop()
    p4 = time.perf_counter()
    return {
        "t_begin": t_begin,
        "t_ready": t_ready,
        "import_s": p1 - p0,
        "start_s": p2 - p1,
        "stop_s": p4 - p3,
        "group_ok": ok,
    }


def _group_ok() -> list[int]:
    import torch.distributed as dist

    return [dist.get_rank(), dist.get_world_size()] if dist.is_initialized() else []


def _child_nbtrain_phases() -> dict[str, Any]:
    """nbtrain.start with timing wrappers around the steps `_start_local` takes (no nbtrain edits)."""
    pc = time.perf_counter
    p0 = pc()
    import ipyparallel as ipp

    p_ipp = pc() - p0
    import nbtrain
    from nbtrain.cluster import registry
    from nbtrain.cluster.launch import local

    marks: list[tuple[str, float, float]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            s = pc()
            try:
                return orig(*a, **k)
            finally:
                marks.append((label, s, pc()))

        setattr(owner, name, timed)

    def wrap_async(owner: Any, name: str, label: str) -> None:
        # ipyparallel makes `x_sync` on the fly from the coroutine method `x`: wrap the coroutine
        orig = getattr(owner, name)

        async def timed(*a: Any, **k: Any) -> Any:
            s = pc()
            try:
                return await orig(*a, **k)
            finally:
                marks.append((label, s, pc()))

        setattr(owner, name, timed)

    wrap_async(ipp.Cluster, "start_controller", "controller process launched")
    wrap_async(
        ipp.Cluster, "start_engines", "engine processes launched (they boot in the background)"
    )
    wrap_async(
        ipp.Cluster,
        "connect_client",
        "client connected (waits for the controller's connection file)",
    )
    wrap(ipp.Client, "wait_for_engines", "engines registered (wait_for_engines)")
    wrap(local, "init_group", "process group (init_rank on every engine: import torch, gloo)")
    wrap(registry, "write", "registry file written")

    t_start_wall = time.time()
    s = pc()
    cluster = nbtrain.start(n=N)
    e = pc()
    # engine processes' own birth times, relative to the start() call
    import psutil

    engine_birth = []
    for r in cluster.ranks:
        try:
            engine_birth.append(psutil.Process(r.pid).create_time() - t_start_wall)
        except psutil.Error:
            pass
    cluster.stop()

    by = {label: (a - s, b - s) for label, a, b in marks}
    phases: list[dict[str, Any]] = []
    prev_end = 0.0
    order = sorted(by.items(), key=lambda kv: kv[1][0])
    for label, (a, b) in order:
        if a - prev_end > 0.002:
            gap = "hello round trip + rank assignment" if "process group" in label else "in between"
            phases.append({"phase": gap, "s": a - prev_end})
        phases.append({"phase": label, "s": b - a})
        prev_end = b
    phases.append(
        {"phase": "after the process group (Cluster object, return)", "s": (e - s) - prev_end}
    )
    return {
        "import_ipyparallel_s": p_ipp,
        "start_s": e - s,
        "phases": phases,
        "engine_process_born_s": engine_birth,
    }


def _child_rawipp() -> dict[str, Any]:
    t_begin = time.time()
    p0 = time.perf_counter()
    import socket

    import ipyparallel as ipp

    cluster = ipp.Cluster(n=N)
    rc = cluster.start_and_connect_sync()
    p1 = time.perf_counter()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def init(rank: int, world: int, port: int) -> int:
        import os

        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.barrier()
        return dist.get_rank()

    ids = sorted(rc.ids)[:N]
    ars = [rc[eid].apply_async(init, rank, N, port) for rank, eid in enumerate(ids)]
    ranks = [ar.get(timeout=120) for ar in ars]
    p2 = time.perf_counter()
    t_ready = time.time()
    rc.close()
    cluster.stop_cluster_sync()
    p3 = time.perf_counter()
    return {
        "t_begin": t_begin,
        "t_ready": t_ready,
        "start_and_connect_s": p1 - p0,
        "init_group_s": p2 - p1,
        "total_s": p2 - p0,
        "stop_s": p3 - p2,
        "ranks": ranks,
    }


# ------------------------------------------------------------------------------------------ parent
def _run_child(kind: str) -> dict[str, Any]:
    t_spawn = time.time()
    proc = subprocess.run(
        [C.python(), __file__, "--child", kind],
        capture_output=True,
        text=True,
        timeout=300,
    )
    t_exit = time.time()
    if proc.returncode != 0:
        msg = f"{kind} child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        raise RuntimeError(msg)
    rep = C.last_json_line(proc.stdout)
    rep["process_wall_s"] = t_exit - t_spawn
    if "t_ready" in rep:
        rep["spawn_to_ready_s"] = rep["t_ready"] - t_spawn
    return rep


def _run_torchrun() -> dict[str, Any]:
    env = dict(os.environ)
    t_spawn = time.time()
    proc = subprocess.run(
        [
            C.bin_path("torchrun"),
            "--standalone",
            f"--nproc_per_node={N}",
            str(C.HERE / "_gloo_barrier.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    t_exit = time.time()
    if proc.returncode != 0:
        msg = f"torchrun failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        raise RuntimeError(msg)
    rep = C.last_json_line(proc.stdout)
    return {
        "process_wall_s": t_exit - t_spawn,
        "spawn_to_ready_s": rep["t_ready"] - t_spawn,
        "spawn_to_worker_script_s": rep["t_script"] - t_spawn,
        "worker_import_torch_distributed_s": rep["t_imported"] - rep["t_script"],
        "init_process_group_s": rep["t_group"] - rep["t_imported"],
        "barrier_s": rep["t_ready"] - rep["t_group"],
        "after_ready_to_exit_s": t_exit - rep["t_ready"],
    }


def _import_torch_reference() -> float:
    """A fresh interpreter's `import torch.distributed` (what every engine pays once)."""
    code = (
        "import time; t=time.perf_counter(); import torch.distributed; print(time.perf_counter()-t)"
    )
    out = subprocess.run([C.python(), "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _med(rows: list[dict[str, Any]], key: str) -> float | None:
    return C.median([r[key] for r in rows if r.get(key) is not None])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, no warm-up round")
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    C.setup_env()
    if args.child:
        fn = {
            "nbtrain": _child_nbtrain,
            "nbtrain-phases": _child_nbtrain_phases,
            "rawipp": _child_rawipp,
        }[args.child]
        print(json.dumps(fn()), flush=True)
        return

    reps = 1 if args.quick else args.reps
    rec = C.Recorder("startup", args.quick)
    variants = {
        "nbtrain": lambda: _run_child("nbtrain"),
        "torchrun": _run_torchrun,
        "rawipp": lambda: _run_child("rawipp"),
        "nbtrain-phases": lambda: _run_child("nbtrain-phases"),
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    if not args.quick:
        # one untimed round: page cache, .pyc files, ipyparallel profile folders
        for fn in variants.values():
            fn()
    for i in range(reps):
        for name, fn in variants.items():
            runs[name].append(fn())
            print(f"round {i + 1}/{reps} {name} done", file=sys.stderr, flush=True)
    torch_ref = [_import_torch_reference() for _ in range(1 if args.quick else 3)]

    nb, tr, raw, ph = runs["nbtrain"], runs["torchrun"], runs["rawipp"], runs["nbtrain-phases"]
    nb_start = _med(nb, "start_s")
    nb_ready = _med(nb, "spawn_to_ready_s")
    tr_wall = _med(tr, "process_wall_s")
    tr_ready = _med(tr, "spawn_to_ready_s")
    raw_total = _med(raw, "total_s")
    raw_ready = _med(raw, "spawn_to_ready_s")

    phase_names: list[str] = []
    for r in ph:
        for p in r["phases"]:
            if p["phase"] not in phase_names:
                phase_names.append(p["phase"])
    breakdown = []
    breakdown.append(
        {"phase": "(before start) import ipyparallel", "median_s": _med(ph, "import_ipyparallel_s")}
    )
    for name in phase_names:
        vals = [sum(p["s"] for p in r["phases"] if p["phase"] == name) for r in ph]
        breakdown.append({"phase": name, "median_s": C.median(vals)})
    breakdown.append({"phase": "start() total (instrumented run)", "median_s": _med(ph, "start_s")})

    rec.data.update(
        {
            "reps": reps,
            "summary": {
                "nbtrain_start_s": C.summary([r["start_s"] for r in nb]),
                "nbtrain_import_s": C.summary([r["import_s"] for r in nb]),
                "nbtrain_spawn_to_ready_s": C.summary([r["spawn_to_ready_s"] for r in nb]),
                "nbtrain_process_wall_incl_stop_s": C.summary([r["process_wall_s"] for r in nb]),
                "nbtrain_stop_s": C.summary([r["stop_s"] for r in nb]),
                "torchrun_command_wall_s": C.summary([r["process_wall_s"] for r in tr]),
                "torchrun_spawn_to_ready_s": C.summary([r["spawn_to_ready_s"] for r in tr]),
                "rawipp_start_and_connect_plus_init_s": C.summary([r["total_s"] for r in raw]),
                "rawipp_start_and_connect_s": C.summary([r["start_and_connect_s"] for r in raw]),
                "rawipp_init_group_s": C.summary([r["init_group_s"] for r in raw]),
                "rawipp_spawn_to_ready_s": C.summary([r["spawn_to_ready_s"] for r in raw]),
                "rawipp_process_wall_incl_stop_s": C.summary([r["process_wall_s"] for r in raw]),
                "fresh_import_torch_distributed_s": C.summary(torch_ref),
            },
            "nbtrain_breakdown": breakdown,
            "nbtrain_engine_process_born_after_start_s": C.median(
                [x for r in ph for x in r["engine_process_born_s"]]
            ),
            "torchrun_breakdown": {
                k: _med(tr, k)
                for k in (
                    "spawn_to_worker_script_s",
                    "worker_import_torch_distributed_s",
                    "init_process_group_s",
                    "barrier_s",
                    "after_ready_to_exit_s",
                )
            },
            "runs": runs,
        }
    )
    rec.metric(
        "cold start, 2 local ranks: nbtrain.start() vs torchrun command",
        nb_start,
        tr_wall,
        "torchrun --standalone (whole command)",
        "s",
        "<= 1.0 (aim 0.7)",
    )
    rec.metric(
        "cold start, process spawn to ready group (interpreter + import included)",
        nb_ready,
        tr_ready,
        "torchrun spawn to rank-0 barrier done",
        "s",
        "<= 1.0",
    )
    rec.metric(
        "cold start: nbtrain.start() vs raw ipyparallel start_and_connect_sync + manual init",
        nb_start,
        raw_total,
        "raw ipyparallel",
        "s",
        "< 1.0",
    )
    rec.metric(
        "cold start, process spawn to ready group: nbtrain vs raw ipyparallel",
        nb_ready,
        raw_ready,
        "raw ipyparallel",
        "s",
        "< 1.0",
    )
    rec.finish(args.out)


if __name__ == "__main__":
    main()
