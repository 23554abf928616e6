"""The scaling report: its table (a DataFrame), its plot (measured and predicted drawn apart), and
`scaling.md`, `scaling.png` and `scaling.json` in a folder the user names."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nbtrain import atomic, runs
from nbtrain.cluster.scaling.model import Fit, Verdict

log = logging.getLogger(__name__)

COLUMNS = (
    ("nodes", "nodes"),
    ("ranks", "ranks"),
    ("kind", "row"),
    ("tokens_per_s", "tokens/s"),
    ("tokens_per_s_per_rank", "tokens/s/rank"),
    ("efficiency", "efficiency"),
    ("step_s", "step s"),
    ("compute_s", "compute s"),
    ("comm_s", "all-reduce wait s"),
    ("allreduce_s", "all-reduce s"),
    ("model_comm_s", "model all-reduce s"),
    ("busbw", "busbw GB/s"),
    ("latency_s", "latency us"),
)


@dataclass
class ScalingReport:
    """What `nbtrain.scaling` returns: `.table`, `.verdict`, `.figure()`, `.save(folder)`.

    In [1]: report = nbtrain.scaling(cfg, nodes=[1, 2, 4], steps=30, predict=[8, 16])
    In [2]: report.table
    In [3]: print(report.verdict.line)
    """

    rows: list[dict[str, Any]]  #: measured rows, then predicted rows (`predicted` True)
    mode: str  #: "weak" or "strong"
    unit: str  #: what a size counts: "nodes", or "ranks" (--ranks)
    machine: str  #: where it ran, in words
    verdict: Verdict
    fit: Fit
    threshold: float
    settings: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    folder: str | None = None  #: where save() last wrote the report

    @property
    def measured(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if not r.get("predicted")]

    @property
    def predicted(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("predicted")]

    @property
    def table(self) -> Any:
        """One row per size, measured then predicted; the predicted ones say what they assumed."""
        import pandas as pd

        frame = pd.DataFrame(self.rows)
        frame["kind"] = ["predicted" if p else "measured" for p in frame["predicted"]]
        # counts stay integers: a size predicted in ranks has no node count, and one missing value
        # made pandas show the column as floats (1.0, 2.0, NaN); pandas' nullable Int64 shows 1 and <NA>
        for count in ("nodes", "ranks"):
            if count in frame:
                frame[count] = frame[count].astype("Int64")
        keep = [c for c in (*(c for c, _ in COLUMNS), "assumptions") if c in frame]
        return frame[keep].reset_index(drop=True)

    def figure(self) -> Any:
        """Tokens/s and efficiency against size; measured as filled dots, predicted as open ones.
        In the notebook plots' look (`nbtrain.plots`): within the output area, transparent."""
        from nbtrain.plots import INK, PALETTE_LIGHT, legend, new_figure, nice_ticks, style_axes

        fig, (ax_t, ax_e) = new_figure(2, height_px=340)
        base = min(self.measured, key=lambda r: r[self.unit])
        xs_all = [r[self.unit] for r in self.rows]
        ideal = [base["tokens_per_s"] * x / base[self.unit] for x in xs_all]
        ax_t.plot(xs_all, ideal, ":", color=INK, label="linear")
        for rows, style, label in (
            (self.measured, dict(marker="o", linestyle="-"), "measured"),
            (self.predicted, dict(marker="o", linestyle="--", mfc="none"), "predicted"),
        ):
            if not rows:
                continue
            xs = [r[self.unit] for r in rows]
            tps = [r["tokens_per_s"] for r in rows]
            ax_t.plot(xs, tps, color=PALETTE_LIGHT[0], label=label, **style)
            eff = [r["efficiency"] for r in rows]
            ax_e.plot(xs, eff, color=PALETTE_LIGHT[1], label=label, **style)
        ax_e.axhline(
            self.threshold, color=INK, linestyle=":", label=f"near-linear {self.threshold:g}"
        )
        sizes = sorted(set(xs_all))
        for ax, what in ((ax_t, "tokens/s (global)"), (ax_e, "efficiency")):
            ax.set_xscale("log", base=2)
            style_axes(ax, title=what, ylabel=what, xlabel=self.unit)
            # a tick at every size, written as the count it is
            ax.set_xticks(sizes, [str(int(x)) for x in sizes])
            ax.minorticks_off()
            legend(ax)
        # efficiency from 0, to the tick at or above its largest value (1 or more)
        top = max([1.0, *(r["efficiency"] for r in self.rows if r.get("efficiency") is not None)])
        ticks = nice_ticks(0.0, top)
        ax_e.set_yticks(ticks)
        ax_e.set_ylim(ticks[0], ticks[-1])
        fig.suptitle(
            f"{self.mode} scaling: {self.verdict.limit}  ({self.machine})", fontsize=9, color=INK
        )
        return fig

    def png(self) -> bytes:
        from nbtrain.plots import png_bytes

        return png_bytes(self.figure())

    def markdown(self) -> str:
        """The report as Markdown: machine, verdict, advice, the table, the model's fit."""
        head = "| " + " | ".join(title for _, title in COLUMNS) + " | assumptions |"
        lines = [
            f"# Scaling report ({self.mode} scaling)",
            "",
            f"Machine: {self.machine}",
            "",
            *_params_line(self.settings.get("params") or {}),
            f"**Verdict:** {self.verdict.line}",
            "",
            *[f"- {a}" for a in self.verdict.advice],
            "",
            head,
            "|" + "---|" * (len(COLUMNS) + 1),
        ]
        for r in self.rows:
            cells = [_cell(key, r) for key, _ in COLUMNS]
            lines.append("| " + " | ".join(cells) + f" | {r.get('assumptions', '')} |")
        f = self.fit
        lines += [
            "",
            "Model: step = compute + fit x (2(n-1)/n x grad bytes / busbw + latency x all-reduces "
            f"per step); compute {f.compute_s:.4f} s "
            f"({'per rank' if f.mode == 'weak' else 'of the global batch on one rank'}, as "
            "measured at the largest size), gradient "
            f"{f.grad_bytes / 2**20:.3f} MiB in {f.calls:g} all-reduce(s) per step, fit x{f.comm_fit:.2f}.",
            "",
            "All-reduce wait: measured in DDP's communication hook, from the hand-over of a step's "
            "last gradient bucket to the completion of its all-reduces (the part of the step spent "
            "only waiting); all-reduce: from the first bucket's hand-over to the last completion (the "
            "all-reduces' own time, part of it overlapped with the backward pass); both on the last "
            "rank to hand over (the minimum across ranks). Model all-reduce: the ring formula with "
            "the bus bandwidth and latency probed on the same ranks, before the fit.",
        ]
        lines += [f"\nWarning: {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "unit": self.unit,
            "machine": self.machine,
            "threshold": self.threshold,
            "verdict": asdict(self.verdict),
            "fit": asdict(self.fit),
            "settings": self.settings,
            "warnings": self.warnings,
            "rows": self.rows,
        }

    def save(self, folder: str | Path) -> Path:
        """Write scaling.md, scaling.png and scaling.json into `folder` (made if missing)."""
        path = Path(folder).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        # each file whole or not at all: the Jupyter server reads scaling.json and scaling.png
        atomic.write_text(path / runs.SCALING_MD, self.markdown())
        atomic.write_bytes(path / runs.SCALING_PNG, self.png())
        atomic.write_json(path / runs.SCALING_JSON, self.to_json(), indent=1, default=str)
        self.folder = str(path)
        return path

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def __repr__(self) -> str:
        sizes = ",".join(str(r[self.unit]) for r in self.measured)
        return f"<ScalingReport {self.mode}, {self.unit} {sizes}: {self.verdict.line}>"


def _cell(key: str, row: dict[str, Any]) -> str:
    value = row.get(key)
    if key == "kind":
        return "predicted" if row.get("predicted") else "measured"
    if value is None:
        return ""
    if key == "busbw":
        return f"{value / 1e9:.3f}"
    if key == "latency_s":
        return f"{value * 1e6:.0f}"
    if key in ("tokens_per_s", "tokens_per_s_per_rank"):
        return f"{value:,.0f}"
    if key == "efficiency":
        return f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _params_line(params: dict[str, int]) -> list[str]:
    """The model's parameters as the report's second paragraph; nothing where they are not known."""
    if not params.get("total"):
        return []
    total, active, trained = (
        params["total"],
        params.get("active", params["total"]),
        params.get("trainable", 0),
    )
    per_token = (
        ""
        if active == total
        else f", {active:,} of them per token (MoE: the routed experts at top-k)"
    )
    return [
        f"Model: {total:,} parameters{per_token}; {trained:,} trained (LoRA), whose gradients the "
        "all-reduce carries.",
        "",
    ]
