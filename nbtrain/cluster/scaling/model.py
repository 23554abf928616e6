"""The scaling model behind `%nbtrain scaling`: a step is compute plus a ring all-reduce of the
trainable parameters' gradients; fitted to the measured sizes, it predicts larger ones and says what
limits scaling. Pure arithmetic on measured rows (no torch, no cluster), so it is tested alone.

A step on n ranks takes
    compute(n) + fit x (2 (n - 1) / n x grad_bytes / busbw + latency x all-reduces per step)
where compute(n) is the compute time measured at the largest size (weak scaling: the same per rank
at every size; strong scaling: the global batch's compute divided by n), busbw and latency are `probe`'s figures
for the n ranks, and `fit` is the least-squares ratio of measured to modelled all-reduce time (1 when
the probe's figures explain the training's all-reduces exactly).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

NEAR_LINEAR = 0.9
# an all-reduce that takes at most this share of the step leaves the job compute-bound
COMPUTE_BOUND_SHARE = 0.2


def parse_sizes(text: Any, what: str = "--nodes") -> list[int]:
    """'1,2,4' (or [1, 2, 4]) -> [1, 2, 4]: positive, distinct, in increasing order."""
    items = str(text).split(",") if isinstance(text, str) else list(text)
    sizes: list[int] = []
    for item in items:
        try:
            size = int(str(item).strip())
        except ValueError:
            msg = f"{what} {text!r}: {item!r} is not a whole number; write sizes like 1,2,4."
            raise ConfigError(msg) from None
        if size < 1:
            msg = f"{what} {text!r}: a size of {size} has no ranks to run on; sizes start at 1."
            raise ConfigError(msg)
        sizes.append(size)
    if not sizes:
        msg = f"{what} is empty; give at least one size, e.g. 1,2,4."
        raise ConfigError(msg)
    if len(set(sizes)) != len(sizes):
        msg = f"{what} {text!r} names a size twice; give each size once."
        raise ConfigError(msg)
    return sorted(sizes)


def check_predict(predict: Sequence[int], measured: Sequence[int], unit: str = "nodes") -> None:
    """Predicted sizes must lie past the largest measured one (smaller ones are measured, not modelled)."""
    top = max(measured)
    low = [p for p in predict if p <= top]
    if low:
        msg = (
            f"--predict {','.join(map(str, predict))}: {low[0]} {unit} is not past the largest "
            f"measured size ({top} {unit}); predict only sizes above {top}, or measure {low[0]} "
            "with --nodes."
        )
        raise ConfigError(msg)


def ring_bytes_factor(n: int) -> float:
    """The share of the buffer each rank sends (and receives) in a ring all-reduce: 2 (n - 1) / n."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def comm_terms(
    n: int, grad_bytes: float, busbw: float, latency: float, calls: float
) -> tuple[float, float]:
    """(bandwidth term, latency term) in seconds of one step's gradient all-reduces on n ranks."""
    if n <= 1:
        return 0.0, 0.0
    bw = ring_bytes_factor(n) * grad_bytes / busbw if busbw > 0 else float("inf")
    return bw, latency * calls


@dataclass
class Fit:
    """The model's parameters, fitted to the measured sizes."""

    mode: str  #: "weak" or "strong"
    compute_s: (
        float  #: weak: compute per step at any size; strong: compute of the global batch on 1 rank
    )
    tokens_per_step: float  #: weak: tokens per rank per step; strong: tokens per global step
    comm_fit: float  #: measured / modelled all-reduce time (least squares; 1.0 with nothing to fit)
    grad_bytes: float
    calls: float  #: gradient all-reduces per step (DDP buckets)

    def compute_at(self, n: int) -> float:
        return self.compute_s if self.mode == "weak" else self.compute_s / n

    def tokens_at(self, n: int) -> float:
        return self.tokens_per_step * n if self.mode == "weak" else self.tokens_per_step

    def step_at(self, n: int, busbw: float, latency: float) -> tuple[float, float, float, float]:
        """(step, compute, bandwidth term, latency term) in seconds, with the fit applied."""
        bw, lat = comm_terms(n, self.grad_bytes, busbw, latency, self.calls)
        bw, lat = bw * self.comm_fit, lat * self.comm_fit
        compute = self.compute_at(n)
        return compute + bw + lat, compute, bw, lat


def fit(rows: Sequence[dict[str, Any]], mode: str) -> Fit:
    """Fit the model to measured rows (keys: ranks, step_s, comm_s, tokens_per_s, busbw, latency_s,
    grad_bytes, allreduces_per_step)."""
    if mode not in ("weak", "strong"):
        msg = f"--mode {mode!r}: choose weak (same per-device batch) or strong (same global batch)."
        raise ConfigError(msg)
    if not rows:
        msg = "no measured sizes to fit the scaling model to"
        raise ConfigError(msg)
    computes, tokens = [], []
    for r in rows:
        n = r["ranks"]
        compute = max(r["step_s"] - r["comm_s"], 0.0)
        step_tokens = r["tokens_per_s"] * r["step_s"]
        computes.append(compute if mode == "weak" else compute * n)
        tokens.append(step_tokens / n if mode == "weak" else step_tokens)
    multi = [r for r in rows if r["ranks"] > 1]
    modelled = [
        sum(
            comm_terms(
                r["ranks"], r["grad_bytes"], r["busbw"], r["latency_s"], r["allreduces_per_step"]
            )
        )
        for r in multi
    ]
    den = sum(m * m for m in modelled)
    comm_fit = (
        sum(m * r["comm_s"] for m, r in zip(modelled, multi, strict=True)) / den if den > 0 else 1.0
    )
    top = max(rows, key=lambda r: r["ranks"])
    return Fit(
        mode=mode,
        # the largest size's: per-rank compute often grows with size (stragglers, shared cores), and
        # the largest measured size is the nearest to the sizes predicted
        compute_s=computes[rows.index(top)],
        tokens_per_step=sum(tokens) / len(tokens),
        comm_fit=comm_fit if comm_fit > 0 else 1.0,
        grad_bytes=float(top["grad_bytes"]),
        calls=float(top["allreduces_per_step"]),
    )


def efficiencies(
    rows: list[dict[str, Any]], unit: str = "nodes", base: dict[str, Any] | None = None
) -> None:
    """Set each row's efficiency: its tokens/s against (size / base size) x the base's tokens/s; the
    base is the smallest size among `rows` unless given (predicted rows take the measured one)."""
    base = base or min(rows, key=lambda r: r[unit])
    for r in rows:
        ideal = base["tokens_per_s"] * r[unit] / base[unit]
        r["efficiency"] = r["tokens_per_s"] / ideal if ideal > 0 else 0.0


def predict(
    model: Fit,
    sizes: Sequence[int],
    ranks_per_node: int,
    busbw: float,
    latency: float,
    assumed: str,
    unit: str = "nodes",
) -> list[dict[str, Any]]:
    """Rows for sizes (in `unit`) nobody measured; each says what it assumed."""
    out = []
    for k in sizes:
        n = k * ranks_per_node if unit == "nodes" else k
        step, compute, bw, lat = model.step_at(n, busbw, latency)
        tps = model.tokens_at(n) / step if step > 0 else 0.0
        out.append(
            {
                "nodes": k if unit == "nodes" else None,
                "ranks": n,
                "predicted": True,
                "tokens_per_s": tps,
                "tokens_per_s_per_rank": tps / n,
                "step_s": step,
                "compute_s": compute,
                "comm_s": bw + lat,
                "model_comm_s": bw + lat,
                "busbw": busbw,
                "latency_s": latency,
                "assumptions": (
                    f"predicted: {assumed} busbw {busbw / 1e9:.3g} GB/s, latency "
                    f"{latency * 1e6:.0f} us, "
                    + (f"{ranks_per_node} rank(s) per node, " if unit == "nodes" else "")
                    + "compute "
                    f"{'per rank' if model.mode == 'weak' else 'of the global batch / ranks'} as at the largest measured size, "
                    f"all-reduce fit x{model.comm_fit:.2f}"
                ),
            }
        )
    return out


@dataclass
class Verdict:
    """What limits scaling, whether it is near-linear, and what would help."""

    limit: str  #: "compute-bound", "bandwidth-bound" or "latency-bound"
    near_linear: bool
    line: str
    advice: list[str] = field(default_factory=list)
    comm_share: float = 0.0


def limit_of(row: dict[str, Any], model: Fit) -> tuple[str, float]:
    """What bounds one row's step: the all-reduce share of its step, split by the model's terms."""
    step = row["step_s"]
    share = row["comm_s"] / step if step > 0 else 0.0
    if share <= COMPUTE_BOUND_SHARE:
        return "compute-bound", share
    bw, lat = comm_terms(
        row["ranks"], model.grad_bytes, row["busbw"], row["latency_s"], model.calls
    )
    return ("bandwidth-bound" if bw >= lat else "latency-bound"), share


def verdict(
    measured: list[dict[str, Any]],
    model: Fit,
    threshold: float = NEAR_LINEAR,
    warnings: Sequence[str] = (),
    unit: str = "nodes",
) -> Verdict:
    """The verdict at the largest measured size, against the checklist's near-linear threshold."""
    top = max(measured, key=lambda r: r["ranks"])
    limit, share = limit_of(top, model)
    worst = min(measured, key=lambda r: r.get("efficiency", 1.0))
    eff = worst.get("efficiency", 1.0)
    near = eff >= threshold
    line = (
        f"{'near-linear' if near else 'not near-linear'}: efficiency {eff:.2f} at {worst[unit]} "
        f"{unit} ({'>=' if near else '<'} {threshold:g}); at {top[unit]} {unit} the gradient "
        f"all-reduce is {share:.0%} of a step: {limit}"
    )
    advice: list[str] = []
    base = min(measured, key=lambda r: r["ranks"])
    # compute per step as it would be had it scaled: the same per rank (weak), or split (strong)
    expected = base["compute_s"] * (1 if model.mode == "weak" else base["ranks"] / top["ranks"])
    if limit == "compute-bound" and top["compute_s"] > expected / threshold:
        advice.append(
            f"the all-reduce is not the limit, compute is: a step's compute took "
            f"{top['compute_s']:.3g} s at {top[unit]} {unit} where {expected:.3g} s would scale; "
            "the ranks share cores or memory bandwidth (simulated nodes on one machine do), or one "
            "is slower than the others"
        )
    elif limit == "compute-bound":
        advice.append(
            "more nodes add throughput nearly in proportion; the all-reduce is not the limit"
        )
    else:
        advice.append(
            "a bigger per-device batch or more gradient accumulation: fewer all-reduces per token"
        )
        if limit == "bandwidth-bound":
            advice.append(
                "a faster interconnect (the all-reduce moves 2(n-1)/n x the gradients per step)"
            )
        else:
            advice.append(
                "fewer, larger all-reduces (a larger DDP bucket_cap_mb); a lower-latency network"
            )
    fallback = [w for w in warnings if "TCP" in w or "sockets" in w]
    if fallback:
        advice.append("fix the TCP fallback probe reported: " + fallback[0])
    return Verdict(limit=limit, near_linear=near, line=line, advice=advice, comm_share=share)
