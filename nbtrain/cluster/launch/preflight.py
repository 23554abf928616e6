"""Compare the nodes' preflight reports before the process group starts, and show the odd ones.

A torch, NCCL, nbtrain or Python (major.minor) mismatch refuses to start unless allowed; a
transformers, peft or CUDA mismatch warns.

In [1]: result = compare(reports)          # reports: collect() from every engine
In [2]: print(format_table(result))
In [3]: result.raise_if_fatal()             # VersionMismatchError naming the odd node and the fix
"""

from __future__ import annotations

import html
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbtrain.cluster.ranks.topology import RankInfo
from nbtrain.errors import ClusterError

log = logging.getLogger(__name__)

ALLOW_FLAG = "--allow-version-mismatch"


class VersionMismatchError(ClusterError):
    """Nodes run different torch, NCCL, nbtrain or Python versions; the message holds the table."""

    def __init__(self, message: str, result: PreflightResult):
        super().__init__(message)
        self.result = result


def _python_minor(r: Mapping[str, Any]) -> str | None:
    v = r.get("python")
    return ".".join(str(v).split(".")[:2]) if v else None


def _cuda(r: Mapping[str, Any]) -> str | None:
    cuda = r.get("cuda") or {}
    return cuda.get("version")


@dataclass(frozen=True)
class Check:
    """One compared property: how to read it from a report, and whether a mismatch is fatal."""

    key: str
    label: str
    fatal: bool
    value: Callable[[Mapping[str, Any]], str | None]
    shown: Callable[[Mapping[str, Any]], str | None] | None = None  # the table cell, if not value


CHECKS: tuple[Check, ...] = (
    Check("python", "Python", True, _python_minor, lambda r: r.get("python")),
    Check("torch", "torch", True, lambda r: r.get("torch")),
    Check("cuda", "CUDA", False, _cuda),
    Check("nccl", "NCCL", True, lambda r: r.get("nccl")),
    Check("transformers", "transformers", False, lambda r: r.get("transformers")),
    Check("peft", "peft", False, lambda r: r.get("peft")),
    Check("nbtrain", "nbtrain", True, lambda r: r.get("nbtrain")),
)


@dataclass(frozen=True)
class Mismatch:
    """One property that differs: the value most nodes have, and the odd nodes' values."""

    key: str
    label: str
    fatal: bool
    expected: str | None  # the majority value (ties: the first node's, rank 0's host)
    expected_on: tuple[str, ...]
    odd: dict[str, str | None]  # node -> its value

    def describe(self) -> str:
        odd = "; ".join(f"{_v(v)} on {n}" for n, v in self.odd.items())
        return f"{self.label}: {odd}; {_v(self.expected)} on {', '.join(self.expected_on)}"

    def fix(self) -> str:
        nodes = ", ".join(self.odd)
        want = self.expected
        if want is None:
            return f"remove {self.label} on {nodes} or install it on every other node"
        if self.key == "python":
            return f"use Python {want} for the engines on {nodes}"
        if self.key == "nccl":
            return f"install NCCL {want} on {nodes} (it comes with the torch build: match torch)"
        if self.key == "cuda":
            return f"install a torch build for CUDA {want} on {nodes}"
        return f"pip install {self.key}=={want} on {nodes}"


def _v(value: str | None) -> str:
    return "missing" if value is None else str(value)


@dataclass
class PreflightResult:
    """Every node's report and what differs between them."""

    reports: dict[str, dict[str, Any]]  # node label -> report, in rank order
    engines: dict[str, int]  # node label -> engines that reported it
    mismatches: list[Mismatch] = field(default_factory=list)
    allow_version_mismatch: bool = False

    @property
    def fatal(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.fatal]

    @property
    def warnings(self) -> list[Mismatch]:
        return [m for m in self.mismatches if not m.fatal]

    @property
    def ok(self) -> bool:
        """True when the cluster may start: no fatal mismatch, or mismatches allowed."""
        return not self.fatal or self.allow_version_mismatch

    @property
    def odd_nodes(self) -> list[str]:
        odd = {n for m in self.mismatches for n in m.odd}
        return [n for n in self.reports if n in odd]

    def odd_value(self, node: str, key: str) -> Mismatch | None:
        for m in self.mismatches:
            if m.key == key and node in m.odd:
                return m
        return None

    def message(self) -> str:
        """One paragraph: what differs where, and the fix (empty when nothing differs)."""
        if not self.mismatches:
            return ""
        lines = []
        if self.fatal:
            head = (
                "Version mismatch across nodes (starting anyway: --allow-version-mismatch):"
                if self.allow_version_mismatch
                else "Version mismatch across nodes; refusing to start:"
            )
            lines.append(head)
            lines += [f"  {m.describe()}" for m in self.fatal]
            fixes = "; ".join(m.fix() for m in self.fatal)
            if not self.allow_version_mismatch:
                lines.append(
                    f"Install the same versions on every node ({fixes}), or pass {ALLOW_FLAG} "
                    "to start anyway."
                )
        if self.warnings:
            lines.append("Warning: versions differ across nodes (this may still work):")
            lines += [f"  {m.describe()}" for m in self.warnings]
            lines.append(f"To match them: {'; '.join(m.fix() for m in self.warnings)}.")
        return "\n".join(lines)

    def raise_if_fatal(self) -> None:
        """Raise VersionMismatchError (message and table) unless the cluster may start."""
        if self.ok:
            return
        msg = f"{self.message()}\n\n{format_table(self)}"
        raise VersionMismatchError(msg, self)

    def __str__(self) -> str:
        return format_table(self)

    def _repr_html_(self) -> str:
        return format_html(self)


def _labels(
    reports: Sequence[Mapping[str, Any]], checks: Sequence[Check]
) -> tuple[dict[str, dict], dict[str, int]]:
    """Collapse the engines of one host into one node when they agree; keep them apart if not."""
    by_host: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for i, r in enumerate(reports):
        by_host.setdefault(str(r.get("hostname", f"engine {i}")), []).append((i, r))
    out: dict[str, dict] = {}
    engines: dict[str, int] = {}
    for host, items in by_host.items():
        groups: dict[tuple, list[tuple[int, Mapping[str, Any]]]] = {}
        for i, r in items:
            groups.setdefault(tuple(c.value(r) for c in checks), []).append((i, r))
        # the group of the host's first engine keeps the plain host name; others are told apart
        for n, group in enumerate(groups.values()):
            ids = ", ".join(str(i) for i, _ in group)
            label = host if n == 0 else f"{host} (engine {ids})"
            out[label] = dict(group[0][1])
            engines[label] = len(group)
    return out, engines


def compare(
    reports: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    *,
    allow_version_mismatch: bool = False,
    checks: Sequence[Check] = CHECKS,
) -> PreflightResult:
    """Compare preflight reports (one per engine in rank order, or node label -> report).

    Engines on one host that agree count as one node. A node is odd for a property when its value
    differs from the one most nodes have; on a tie, the first node's (rank 0's host) counts as
    expected. `checks` are the compared properties (`%nbtrain check` adds the GPUs).
    """
    if isinstance(reports, Mapping):
        nodes = {str(k): dict(v) for k, v in reports.items()}
        engines = dict.fromkeys(nodes, 1)
    else:
        nodes, engines = _labels(list(reports), checks)
    result = PreflightResult(nodes, engines, allow_version_mismatch=allow_version_mismatch)
    if len(nodes) < 2:
        return result
    for check in checks:
        values = {n: check.value(r) for n, r in nodes.items()}
        counts = Counter(values.values())
        if len(counts) == 1:
            continue
        order = list(values.values())
        expected = min(counts, key=lambda v: (-counts[v], order.index(v)))
        odd = {n: v for n, v in values.items() if v != expected}
        on = tuple(n for n, v in values.items() if v == expected)
        result.mismatches.append(Mismatch(check.key, check.label, check.fatal, expected, on, odd))
    return result


# -- display ---------------------------------------------------------------------------------------

FATAL_MARK = "*"
WARN_MARK = "~"
Rows = list[tuple[str, list[tuple[str, str]]]]  # per node: (row mark, [(cell, mark)])


def gpu_summary(r: Mapping[str, Any]) -> str:
    """A report's GPUs in one cell: "2x NVIDIA H100 80 GiB", or "none"."""
    gpus = r.get("gpus") or []
    if not gpus:
        return "none"
    kinds = Counter((g.get("name"), round(g.get("memory_bytes", 0) / 2**30)) for g in gpus)
    return ", ".join(f"{k}x {name} {mem} GiB" for (name, mem), k in kinds.items())


def _rdma(r: Mapping[str, Any]) -> str:
    devs = r.get("infiniband") or []
    if not devs:
        return "-"
    parts = []
    for d in devs:
        layers = {p.get("link_layer") for p in d.get("ports", [])}
        kind = "RoCE" if layers == {"Ethernet"} else "IB" if layers == {"InfiniBand"} else "RDMA"
        parts.append(f"{d['device']} ({kind})")
    return ", ".join(parts)


def _rows(result: PreflightResult) -> tuple[list[str], Rows]:
    """Header, and per node (row mark, [(cell, mark)]) with mark "", FATAL_MARK or WARN_MARK."""
    header = ["node", "engines"] + [c.label for c in CHECKS] + ["GPUs", "IB/RoCE"]
    rows = []
    for node, r in result.reports.items():
        cells: list[tuple[str, str]] = [(node, ""), (str(result.engines.get(node, 1)), "")]
        for c in CHECKS:
            value = (c.shown or c.value)(r)
            m = result.odd_value(node, c.key)
            mark = "" if m is None else FATAL_MARK if m.fatal else WARN_MARK
            cells.append((_v(value) if value is not None else "-", mark))
        cells += [(gpu_summary(r), ""), (_rdma(r), "")]
        marks = {mark for _, mark in cells}
        row_mark = "!" if FATAL_MARK in marks else "?" if WARN_MARK in marks else ""
        rows.append((row_mark, cells))
    return header, rows


def format_table(result: PreflightResult) -> str:
    """A plain-text table of the nodes; odd nodes marked '!' (refuses) or '?' (warns).

    A value marked '*' differs from the other nodes and refuses to start; '~' only warns.
    """
    header, rows = _rows(result)
    lines = [render_text(header, rows)]
    if result.mismatches:
        lines.append(
            f"{FATAL_MARK} differs from the other nodes: refuses to start unless {ALLOW_FLAG}; "
            f"{WARN_MARK} differs: warning only"
        )
    return "\n".join(lines)


def render_text(header: Sequence[str], rows: Rows) -> str:
    """Rows as aligned plain text: a row's mark in front of it, a cell's mark in front of the cell."""
    text_rows = [[f"{mark}{cell}" for cell, mark in cells] for _, cells in rows]
    widths = [max(len(h), *(len(r[i]) for r in text_rows)) for i, h in enumerate(header)]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for (row_mark, _), cells in zip(rows, text_rows, strict=True):
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
        lines.append(f"{row_mark or ' '} {line}")
    return "\n".join(lines)


_CELL_STYLE = {
    FATAL_MARK: "background:#f8d7da;color:#842029;font-weight:bold",
    WARN_MARK: "background:#fff3cd;color:#664d03;font-weight:bold",
}


def format_html(result: PreflightResult) -> str:
    """The same table as HTML for the notebook, odd values highlighted (red: refuses, amber: warns)."""
    header, rows = _rows(result)
    return render_html(header, rows, result.message())


def render_html(
    header: Sequence[str], rows: Rows, caption: str = "", table_class: str = "nbtrain-preflight"
) -> str:
    """Rows as an HTML table, marked cells highlighted (red: '*', amber: '~'), `caption` above."""
    out = [f'<table class="{table_class}">']
    if caption:
        out.append(
            f'<caption style="text-align:left;white-space:pre-wrap">{html.escape(caption)}</caption>'
        )
    out.append(
        "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>"
    )
    out.append("<tbody>")
    for row_mark, cells in rows:
        tds = []
        for cell, mark in cells:
            style = f' style="{_CELL_STYLE[mark]}"' if mark else ""
            title = ' title="differs from the other nodes"' if mark else ""
            tds.append(f"<td{style}{title}>{html.escape(cell)}</td>")
        cls = ' class="nbtrain-odd"' if row_mark else ""
        out.append(f"<tr{cls}>" + "".join(tds) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


@dataclass
class PreflightRun:
    """Preflight's verdict and every rank's report, in rank order."""

    result: Any
    reports_by_rank: list[dict[str, Any]]


def run_preflight(
    client: Any,
    ranks: Sequence[RankInfo],
    allow: bool,
    remaining: Callable[[], float],
    say: Callable[[str], None],
) -> PreflightRun:
    """Ask every rank for its versions, compare them; warn, or raise on a fatal mismatch."""
    from nbtrain.engine import preflight as engine_preflight

    ids = [r.engine_id for r in ranks]
    reports = (
        client.direct_view(targets=ids)
        .apply_async(engine_preflight.collect)
        .get(timeout=remaining())
    )
    result = compare(list(reports), allow_version_mismatch=allow)
    result.raise_if_fatal()
    if result.mismatches:
        text = result.message()
        say(text.splitlines()[0])
        warnings.warn(text, stacklevel=4)
    return PreflightRun(result, list(reports))
