"""`%nbtrain scaling`: the same short `finetune` on the ranks of the first 1, 2, 4... nodes of the
running cluster, each on its own sub-group (no restart); a model fitted to it predicts larger sizes
and says what limits scaling.

In [1]: report = nbtrain.scaling(cfg, nodes=[1, 2, 4], steps=30, predict=[8, 16])
In [2]: report.table

Each size starts from `cfg`'s seed and trains into a scratch folder on rank 0's machine, removed
afterwards: nothing is written to `cfg.output_dir`, and the report goes only where `out` says.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbtrain.cluster.probe import bus_bandwidth, network_warnings
from nbtrain.cluster.scaling.model import (
    NEAR_LINEAR,
    check_predict,
    comm_terms,
    efficiencies,
    fit,
    parse_sizes,
)
from nbtrain.cluster.scaling.model import predict as predict_rows
from nbtrain.cluster.scaling.model import verdict as make_verdict
from nbtrain.cluster.scaling.report import ScalingReport
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

# steps left out of the figures at the start of each size (DDP's bucket rebuild, warm caches)
WARMUP_STEPS = 2


def node_order(ranks: Sequence[Any]) -> list[str]:
    """The cluster's hosts in the order of their first rank (rank 0's host first)."""
    hosts: list[str] = []
    for r in sorted(ranks, key=lambda r: r.rank):
        if r.host not in hosts:
            hosts.append(r.host)
    return hosts


def ranks_of_size(session: Any, size: int, unit: str) -> list[int]:
    """The world ranks of a size: those of the first `size` nodes, or ranks 0..size-1."""
    if unit == "ranks":
        return list(range(size))
    hosts = node_order(session.ranks)[:size]
    return sorted(r.rank for r in session.ranks if r.host in hosts)


def _settings(cfg: Any, steps: int, mode: str) -> dict[str, Any]:
    """`cfg` as each size runs it, checked the way finetune checks it."""
    from nbtrain.configs.sft import SFTConfig

    if not isinstance(cfg, SFTConfig):
        msg = f"scaling needs an nbtrain.SFTConfig, got {type(cfg).__name__}; build one with nbtrain.SFTConfig(...)"
        raise ConfigError(msg)
    if cfg.per_device_train_batch_size == "auto":
        msg = (
            "per_device_train_batch_size='auto' measures a batch per size, so sizes would not train "
            "alike; give a number (the one 'auto' chose is in result.plan['micro_batch'])."
        )
        raise ConfigError(msg)
    if steps < WARMUP_STEPS + 2:
        msg = f"--steps {steps}: time at least {WARMUP_STEPS + 2} steps ({WARMUP_STEPS} warm-up steps are left out)."
        raise ConfigError(msg)
    if mode == "weak" and cfg.global_batch_size is not None:
        msg = (
            f"weak scaling keeps the per-device batch, but global_batch_size={cfg.global_batch_size} "
            "fixes the global one: use --mode strong, or set global_batch_size=None."
        )
        raise ConfigError(msg)
    d = cfg.to_dict()
    d.update(
        max_steps=steps,
        save_steps=None,
        logging_steps=1,
        eval_data=None,
        eval_steps=None,
        resume=None,
        overwrite=True,
    )
    try:
        SFTConfig(**d)
    except ConfigError as e:
        msg = f"finetune would refuse this config: {e}"
        raise ConfigError(msg) from None
    return d


def _strong_batch(d: dict[str, Any], sizes_ranks: list[int]) -> int:
    """The global batch strong scaling keeps, checked to divide at every size."""
    from nbtrain.data.batch import split_global

    micro = int(d["per_device_train_batch_size"])
    fixed = (
        d.get("global_batch_size") or micro * int(d["gradient_accumulation_steps"]) * sizes_ranks[0]
    )
    for n in sizes_ranks:
        try:
            split_global(fixed, n, micro)
        except ConfigError as e:
            msg = f"--mode strong at {n} rank(s): {e}"
            if not d.get("global_batch_size"):
                # the default (the smallest size's global batch) rarely divides at the larger sizes
                every = math.lcm(*sizes_ranks) * micro
                msg += (
                    f". Without global_batch_size, strong scaling keeps the smallest size's global "
                    f"batch ({fixed} rows); set one that every size divides, a multiple of {every}: "
                    f"SFTConfig(..., global_batch_size={every})"
                )
            raise ConfigError(msg) from None
    return int(fixed)


def _machine(session: Any, results: list[dict[str, Any]], hosts: list[str]) -> str:
    devices = sorted({r["device"] for r in results})
    per_node = {h: sum(1 for r in session.ranks if r.host == h) for h in hosts}
    counts = sorted(set(per_node.values()))
    return (
        f"{len(hosts)} node(s) ({', '.join(hosts)}), {'/'.join(map(str, counts))} rank(s) per node, "
        f"{'; '.join(devices)}, backend {session.backend}"
    )


def _scratch(session: Any, rank0: int, path: str | None) -> str:
    """Make (path None) or remove a scratch folder on a rank's machine, and its run's record."""

    def make() -> str:
        import tempfile

        return tempfile.mkdtemp(prefix="nbtrain-scaling-")

    def remove(p: str) -> None:
        import shutil

        from nbtrain.runs import forget_run, run_id_for

        # the size's run leaves no record behind in the runs sidebar: its folder is gone
        forget_run(run_id_for(f"{p}/run"))
        shutil.rmtree(p, ignore_errors=True)

    if path is None:
        return str(session.run(make, ranks=[rank0])[0])
    session.run(remove, path, ranks=[rank0])
    return path


def measure_size(
    session: Any, members: list[int], d: dict[str, Any], iters: int, timeout: float | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run one size; its measured row and the members' raw results."""
    from nbtrain.recipes.scaling import run_size

    got = session.run(run_size, members, d, iters, timeout=timeout)
    results = [g for g in got if g is not None]
    first = results[0]
    n = len(members)
    hist = [h for h in first["history"] if h["step"] > WARMUP_STEPS]
    step_s = statistics.median(h["step_time"] for h in hist)
    tokens = sum(h["tokens_per_s"] * h["step_time"] for h in hist)
    tokens_per_s = tokens / sum(h["step_time"] for h in hist)
    comm_s = busbw = latency = allreduce_s = 0.0
    calls = 0.0
    if n > 1:
        # the last rank to hand its gradients over waits only for the transfer; the others' extra
        # wait is for that rank's compute, so the minimum across ranks is the all-reduce's own time
        per_step = list(zip(*[r["comm"][WARMUP_STEPS:] for r in results], strict=False))
        waits = [min(c["wait_s"] for c in step) for step in per_step]
        comm_s = statistics.median(waits) if waits else 0.0
        # the all-reduces' own time, overlapped with the backward pass or not: the model's figure
        spans = [min(c["span_s"] for c in step) for step in per_step]
        allreduce_s = statistics.median(spans) if spans else 0.0
        calls = statistics.median(c["buckets"] for c in first["comm"])
        # the slowest rank's time is the collective's time (as in probe)
        probe = [max(r["probe"][i]["seconds"] for r in results) for i in range(2)]
        latency = probe[0]
        busbw = bus_bandwidth(first["probe"][1]["bytes"], probe[1], n)[1]
    row = {
        "nodes": len({r["host"] for r in results}),
        "ranks": n,
        "predicted": False,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_rank": tokens_per_s / n,
        "step_s": step_s,
        "compute_s": max(step_s - comm_s, 0.0),
        "comm_s": comm_s,
        "allreduce_s": allreduce_s,
        "model_comm_s": sum(comm_terms(n, first["grad_bytes"], busbw, latency, calls)),
        "busbw": busbw or None,
        "latency_s": latency or None,
        "grad_bytes": first["grad_bytes"],
        "allreduces_per_step": calls,
        "global_batch": first["plan"]["global_batch"],
        "steps_timed": len(hist),
        "assumptions": "measured",
    }
    return row, results


def scaling(
    session: Any,
    cfg: Any,
    nodes: Any = None,
    steps: int = 30,
    mode: str = "weak",
    predict: Any = (),
    out: str | None = None,
    ranks: Any = None,
    busbw: float | None = None,
    latency: float | None = None,
    threshold: float = NEAR_LINEAR,
    iters: int = 5,
    timeout: float | None = None,
) -> ScalingReport:
    """Measure `cfg`'s short fine-tune on the first k nodes for each k in `nodes` (or the first k
    ranks, `ranks=`), fit the scaling model, predict `predict` sizes; write the report to `out`.

    Everything is checked before anything runs. `busbw` (bytes/s) and `latency` (s) are assumed for
    the predicted sizes; by default they are the largest measured size's.
    """
    if (nodes is None) == (ranks is None):
        msg = "give the sizes to measure either as nodes (--nodes 1,2,4) or as ranks (--ranks 1,2,4), one of them"
        raise ConfigError(msg)
    unit = "nodes" if nodes is not None else "ranks"
    sizes = parse_sizes(nodes if nodes is not None else ranks, f"--{unit}")
    have = len(node_order(session.ranks)) if unit == "nodes" else session.world_size
    if sizes[-1] > have:
        msg = (
            f"--{unit} {','.join(map(str, sizes))}: this cluster has {have} {unit}; measure up to "
            f"{have} and predict larger sizes with --predict."
        )
        raise ConfigError(msg)
    if mode not in ("weak", "strong"):
        msg = f"--mode {mode!r}: choose weak (same per-device batch) or strong (same global batch)."
        raise ConfigError(msg)
    if not 0 < threshold <= 1:
        msg = f"--threshold {threshold}: an efficiency between 0 and 1 (the checklist's near-linear is 0.9)."
        raise ConfigError(msg)
    wanted = parse_sizes(predict, "--predict") if predict else []
    if wanted:
        check_predict(wanted, sizes, unit)
    members = {k: ranks_of_size(session, k, unit) for k in sizes}
    if wanted and len(members[sizes[-1]]) < 2 and busbw is None:
        msg = (
            "--predict needs an all-reduce to extrapolate from: measure a size of 2 ranks or more, "
            "or give the bandwidth and latency to assume (--busbw, --latency)."
        )
        raise ConfigError(msg)
    d = _settings(cfg, steps, mode)
    if mode == "strong":
        d["global_batch_size"] = _strong_batch(d, [len(members[k]) for k in sizes])
        d["gradient_accumulation_steps"] = 1

    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for k in sizes:
        scratch = _scratch(session, members[k][0], None)
        try:
            run_d = dict(d, output_dir=f"{scratch}/run", run_name=f"scaling {k} {unit}")
            row, got = measure_size(session, members[k], run_d, iters, timeout)
        finally:
            _scratch(session, members[k][0], scratch)
        rows.append(row)
        results += got
    efficiencies(rows, unit)
    model = fit(rows, mode)
    top = max(rows, key=lambda r: r["ranks"])
    n_top = top["ranks"]
    per_node = max(1, n_top // top[unit]) if unit == "nodes" else 1
    assumed_bw = busbw if busbw is not None else (top["busbw"] or 0.0)
    assumed_lat = latency if latency is not None else (top["latency_s"] or 0.0)
    source = "given" if busbw is not None else f"as measured at {top[unit]} {unit}:"
    extra = predict_rows(model, wanted, per_node, assumed_bw, assumed_lat, source, unit)
    efficiencies(extra, unit, base=min(rows, key=lambda r: r[unit]))
    warnings: list[str] = []
    if n_top > 1:
        used = [r for r in session.ranks if r.rank in members[sizes[-1]]]
        reports = getattr(session, "preflight_reports", None)
        if reports:
            warnings, _ = network_warnings(
                [reports[r.rank] for r in used],
                [r.interface for r in used],
                [r.host for r in used],
                session.backend,
                top["busbw"] or 0.0,
            )
    report = ScalingReport(
        rows=rows + extra,
        mode=mode,
        unit=unit,
        machine=_machine(session, results, node_order(session.ranks)),
        verdict=make_verdict(rows, model, threshold, warnings, unit),
        fit=model,
        threshold=threshold,
        settings={
            "steps": steps,
            "warmup_steps": WARMUP_STEPS,
            "sizes": sizes,
            "predict": wanted,
            "config": d,
            # total, active (an MoE's routed experts at top-k of E) and trained parameters
            "params": results[0]["plan"].get("params", {}) if results else {},
        },
        warnings=warnings,
    )
    if out is not None:
        from nbtrain.runs import record_scaling

        report.save(out)
        # the sidebar lists the report, and the run panel of cfg.output_dir's run shows it
        record_scaling(
            out,
            name=f"scaling: {cfg.run_name or Path(cfg.output_dir).name}",
            run_dir=cfg.output_dir,
        )
    return report
