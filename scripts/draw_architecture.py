"""Draw docs/images/architecture.svg from the code: where nbtrain's code runs, and its layers.

python scripts/draw_architecture.py          # rewrites docs/images/architecture.svg
python scripts/draw_architecture.py --check  # exits 1 where the committed picture is stale

Nothing in the picture is typed here but the names of the places code runs in and of the few
modules that run as a process of their own. The layers are import-linter's contracts in
pyproject.toml (the kernel side's, the training layers', each package's own); the modules in each
box are the files on disk; the imports across places are grimp's graph of the code (the graph
`lint-imports` checks). The output is plain SVG text, the same bytes for the same tree (no dates,
sorted everywhere): tests/test_architecture_doc.py checks the committed picture against it.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbtrain"
OUT = ROOT / "docs" / "images" / "architecture.svg"

W = 1290
FONT = 11
LINE = 14
CHAR = 6.3  # DejaVu Sans at 11 px, a generous mean glyph width
PAD = 6

# the modules that run as a process of their own (beside the kernel, an engine or the server)
PROCESSES = {
    "nbtrain.generation.vllm_worker": 'the vLLM process: one per rank with engine="vllm", its LoRA sent in memory',
    "nbtrain.cluster.faults.watchdog": "the idle watchdog: stops a cluster whose kernel is gone",
    "nbtrain.engine.ray_host": "a Ray actor, running its rank's engine as a child",
}
# what crosses between places, not by import (drawn as a line between the places' boxes)
CHANNELS = [
    (
        "kernel",
        "engines",
        "ipyparallel: cells, results, engine/'s functions; torch.distributed between ranks",
    ),
    ("browser", "server", "REST (the Jupyter server's token)"),
    ("server", "files", "reads run folders and the cluster registry"),
]
FILL = {
    "kernel": "#eef4fb",
    "engines": "#eefbef",
    "shared": "#f4f4f4",
    "server": "#fbf5ee",
    "browser": "#f5eefb",
    "process": "#fff8e6",
}


def contracts() -> list[dict[str, Any]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(data["tool"]["importlinter"]["contracts"])


def _has(contract: dict[str, Any], module: str) -> bool:
    return any(module in _tails(layer) for layer in contract.get("layers", []))


def _tails(layer: str, container: str = "") -> list[str]:
    """A layer's modules (relative to its contract's container), optional ones (in parentheses)
    only where they exist."""
    names = [t.strip() for t in re.split(r"[|:]", layer)]
    full = f"{container}." if container else ""
    return [t.strip("()") for t in names if not t.startswith("(") or _exists(full + t.strip("()"))]


def _path(dotted: str) -> Path:
    return ROOT / Path(*dotted.split("."))


def _exists(dotted: str) -> bool:
    return _path(dotted).with_suffix(".py").is_file() or (_path(dotted) / "__init__.py").is_file()


def children(dotted: str) -> list[str]:
    """A package's modules and subpackages on disk (`name.py`, `name/`), sorted."""
    folder = _path(dotted)
    mods = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
    subs = [p.name + "/" for p in folder.iterdir() if (p / "__init__.py").is_file()]
    return sorted(mods + subs)


def label(dotted: str) -> str:
    rel = dotted.removeprefix("nbtrain.").replace(".", "/")
    return rel + ("/" if (_path(dotted) / "__init__.py").is_file() else ".py")


def containers() -> dict[str, list[list[str]]]:
    """Each package's own layers (its exhaustive contract), top first."""
    return {
        c: [_tails(layer, c) for layer in contract["layers"] if _tails(layer, c)]
        for contract in contracts()
        if contract["type"] == "layers"
        for c in contract.get("containers", [])
    }


def body(dotted: str) -> list[str]:
    """The lines in a package's box: its own layers, top first, where a contract orders them (else
    its modules); then a line per subpackage, its modules or its layers."""
    if not (_path(dotted) / "__init__.py").is_file():
        return []
    layers = containers().get(dotted)
    if layers:
        lines = [" · ".join(layer) for layer in layers]
        out = [f"{'›' if i else ' '} {line}" for i, line in enumerate(lines)]
    else:
        mods = [name.removesuffix(".py") for name in children(dotted) if not name.endswith("/")]
        out = [" · ".join(mods)] if mods else []
    return out + [SUB + line for line in _subpackages(dotted)]


SUB = "\t"  # marks a subpackage's line (drawn grey)
RED = "\v"  # marks a line of what a place never imports


def _subpackages(dotted: str) -> list[str]:
    out = []
    for name in children(dotted):
        if not name.endswith("/"):
            continue
        sub = f"{dotted}.{name[:-1]}"
        layers = containers().get(sub)
        if layers:
            mods = " › ".join(" · ".join(layer) for layer in layers)
        else:
            mods = " · ".join(n.removesuffix(".py") for n in children(sub) if not n.endswith("/"))
        out.append(f"{label(sub).removeprefix(label(dotted))} {mods or '(its __init__)'}")
        out += _subpackages(sub)
    return out


def wrap(text: str, width: float) -> list[str]:
    n = max(8, int((width - 2 * PAD) / CHAR))
    out: list[str] = []
    sub = text.startswith(SUB)
    line = ""
    for word in text.removeprefix(SUB).split(" "):
        if line and len(line) + 1 + len(word) > n:
            out.append(line)
            line = "    " + word if (sub or text.startswith(("›", " "))) else word
        else:
            line = f"{line} {word}" if line else word
    out.append(line)
    return [SUB + line for line in out] if sub else out


class Svg:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, dash: bool = False) -> None:
        d = ' stroke-dasharray="4 3"' if dash else ""
        self.parts.append(
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{h:.0f}" rx="5" '
            f'fill="{fill}" stroke="#666"{d}/>'
        )

    def text(
        self, x: float, y: float, s: str, bold: bool = False, size: int = FONT, fill: str = "#222"
    ) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(
            f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}" fill="{fill}"{weight} xml:space="preserve">{html.escape(s)}</text>'
        )

    def line(
        self,
        x1: float,
        y1: float,
        x2: float,
        y2: float,
        color: str = "#333",
        dash: bool = False,
        arrow: bool = True,
    ) -> None:
        d = ' stroke-dasharray="5 3"' if dash else ""
        m = ' marker-end="url(#a)"' if arrow else ""
        self.parts.append(
            f'<line x1="{x1:.0f}" y1="{y1:.0f}" x2="{x2:.0f}" y2="{y2:.0f}" stroke="{color}"{d}{m}/>'
        )


def box_lines(dotted: str, width: float) -> tuple[str, list[str]]:
    lines: list[str] = []
    for line in body(dotted):
        lines += wrap(line, width)
    return label(dotted), lines


def draw_stack(
    svg: Svg,
    layers: list[str],
    x: float,
    y: float,
    w: float,
    at: dict[str, tuple[float, float, float, float]],
) -> float:
    """A contract's layers as rows of boxes, top first, an arrow between rows (imports go down);
    returns the y under the last row. `at` gets each package's box."""
    for i, layer in enumerate(layers):
        mods = _tails(layer)
        gap = 8
        bw = (w - gap * (len(mods) - 1)) / len(mods)
        content = [box_lines(m, bw) for m in mods]
        h = PAD + LINE * (1 + max(len(c[1]) for c in content)) + PAD
        if i:
            svg.line(x + w / 2, y - 12, x + w / 2, y - 1)
        for j, (m, (title, lines)) in enumerate(zip(mods, content)):
            bx = x + j * (bw + gap)
            svg.rect(bx, y, bw, h, "#ffffff")
            svg.text(bx + PAD, y + PAD + 10, title, bold=True)
            for k, line in enumerate(lines):
                grey = line.startswith(SUB)
                svg.text(
                    bx + PAD,
                    y + PAD + 10 + LINE * (k + 1),
                    line.removeprefix(SUB),
                    fill="#666" if grey else "#222",
                )
            at[m] = (bx, y, bw, h)
        y += h + 14
    return y


def _graph() -> Any:
    import grimp

    return grimp.build_graph("nbtrain", exclude_type_checking_imports=True, cache_dir=None)


def draw() -> str:
    cs = contracts()
    kernel = next(c for c in cs if c["type"] == "layers" and _has(c, "nbtrain.cluster"))
    training = next(c for c in cs if c["type"] == "layers" and _has(c, "nbtrain.recipes"))
    shared = [layer for layer in kernel["layers"] if layer in training["layers"]]
    server = next(
        c for c in cs if c["type"] == "forbidden" and c["source_modules"] == ["nbtrain.server"]
    )
    on_ranks = next(
        c for c in cs if c["type"] == "forbidden" and "nbtrain.engine" in c["source_modules"]
    )
    allowed = next(c for c in cs if c["type"] == "forbidden" and c.get("ignore_imports"))
    svg = Svg()
    at: dict[str, tuple[float, float, float, float]] = {}

    # the kernel and the engines, side by side; the primitives both use, under both
    kx, kw, ex, ew, top = 10, 730, 770, W - 780, 10
    kernel_layers = [layer for layer in kernel["layers"] if layer not in shared and _tails(layer)]
    training_layers = [
        layer for layer in training["layers"] if layer not in shared and _tails(layer)
    ]
    probe = Svg()
    kh = draw_stack(probe, kernel_layers, kx + 10, top + 24, kw - 20, {}) - top
    eh = draw_stack(probe, training_layers, ex + 10, top + 24, ew - 20, {}) - top
    h = max(kh, eh) + 40
    svg.rect(kx, top, kw, h, FILL["kernel"])
    svg.text(
        kx + 10, top + 16, "the notebook kernel (the client): imports go down", bold=True, size=12
    )
    draw_stack(svg, kernel_layers, kx + 10, top + 24, kw - 20, at)
    svg.rect(ex, top, ew, h, FILL["engines"])
    svg.text(
        ex + 10,
        top + 16,
        "every engine (an ipyparallel engine: one process per rank)",
        bold=True,
        size=12,
    )
    draw_stack(svg, training_layers, ex + 10, top + 24, ew - 20, at)
    foot = "never imports: " + ", ".join(
        m.removeprefix("nbtrain.") for m in on_ranks["forbidden_modules"]
    )
    for k, line in enumerate(wrap(foot, ew - 20)):
        svg.text(ex + 12, top + h - 24 + LINE * k, line, fill="#a33")

    y = top + h + 12
    sy = y
    probe_y = draw_stack(Svg(), shared, 20, y + 24, W - 40, {})
    svg.rect(10, y, W - 20, probe_y - y + 2, FILL["shared"])
    svg.text(
        20,
        y + 16,
        "shared primitives: every side imports them (the server too); they import no layer above",
        bold=True,
        size=12,
    )
    y = draw_stack(svg, shared, 20, y + 24, W - 40, at) + 2
    svg.line(kx + kw / 2, top + h, kx + kw / 2, sy, arrow=True)
    svg.line(ex + ew / 2, top + h, ex + ew / 2, sy, arrow=True)

    # the kernel side's allowed imports of the training layers (the forbidden contract's list)
    graph = _graph()
    pairs: dict[tuple[str, str], list[str]] = {}
    for expr in sorted(allowed["ignore_imports"]):
        src, dst = (s.strip() for s in expr.split("->"))
        a = next(
            m for m in sorted(at, key=len, reverse=True) if src == m or src.startswith(m + ".")
        )
        b = next(
            m for m in sorted(at, key=len, reverse=True) if dst == m or dst.startswith(m + ".")
        )
        pairs.setdefault((a, b), []).append(
            src.removeprefix(a + ".") + " → " + dst.removeprefix("nbtrain.")
        )
    for i, (a, b) in enumerate(sorted(pairs)):
        ax, ay, aw, ah = at[a]
        bx, by, bw, bh = at[b]
        y1 = ay + ah / 2 + 8 * (i % 3) - 8
        y2 = by + 12 + 5 * (i % 4)
        svg.line(ax + aw, y1, bx, y2, color="#c60", dash=True)
    # the legend of those imports
    ly = y + 8
    allowed_lines = [
        "the kernel side imports the training layers only here (a contract lists each):"
    ]
    allowed_lines += [
        f"  {a.removeprefix('nbtrain.')}: {', '.join(n)}" for (a, b), n in sorted(pairs.items())
    ]

    # the server, the browser, the processes of their own
    srv = "nbtrain.server"
    srv_imports = sorted(
        {
            b
            for a in graph.find_descendants(srv) | {srv}
            for b in graph.find_modules_directly_imported_by(a)
            if not b.startswith(srv)
        }
    )
    server_lines = [" · ".join(c.removesuffix(".py") for c in children(srv))]
    server_lines.append("imports: " + ", ".join(m.removeprefix("nbtrain.") for m in srv_imports))
    server_lines.append(
        "never imports: "
        + ", ".join(m.removeprefix("nbtrain.") for m in server["forbidden_modules"])
    )
    src = ROOT / "labextension" / "src"
    browser_lines = [" · ".join(sorted(p.stem for p in src.glob("*.ts*")))]
    proc_lines = [f"{label(m)}: {what}" for m, what in sorted(PROCESSES.items()) if _exists(m)]
    cw = (W - 40) / 3
    blocks = [
        ("the Jupyter server (nbtrain/server/, REST handlers)", server_lines, FILL["server"]),
        ("the browser (labextension/src/)", browser_lines, FILL["browser"]),
        ("processes of their own", proc_lines, FILL["process"]),
    ]
    # a line of what a place never imports is red, its continuations too
    wrapped = [
        [
            RED + ln if line.startswith("never") else ln
            for line in lines
            for ln in wrap(line, cw - 10)
        ]
        for _, lines, _ in blocks
    ]
    bh = 26 + LINE * max(len(w_) for w_ in wrapped)
    for i, ((title, _, fill), lines) in enumerate(zip(blocks, wrapped)):
        bx = 10 + i * (cw + 10)
        svg.rect(bx, ly, cw, bh, fill)
        svg.text(bx + 8, ly + 16, title, bold=True, size=12)
        for k, line in enumerate(lines):
            red = line.startswith(RED)
            svg.text(
                bx + 8,
                ly + 16 + LINE * (k + 1),
                line.removeprefix(RED),
                fill="#a33" if red else "#222",
            )
    # the vLLM process beside the generation layer
    gen = at.get("nbtrain.generation")
    if gen and _exists("nbtrain.generation.vllm_worker"):
        gx, gy, gw, gh = gen
        svg.line(gx + gw - 30, gy + gh, 10 + 2 * (cw + 10) + cw / 2, ly, color="#986", dash=True)
    y = ly + bh + 10
    legend = (
        allowed_lines
        + [f"{a} ↔ {b}: {what}" for a, b, what in CHANNELS]
        + [
            "boxes side by side are one layer; › orders a package's own modules, top first (its contract in pyproject.toml)",
            "drawn by scripts/draw_architecture.py from pyproject.toml's import-linter contracts and the files on disk",
        ]
    )
    lh = 12 + LINE * len(legend)
    svg.rect(10, y, W - 20, lh, "#ffffff")
    for k, line in enumerate(legend):
        svg.text(20, y + 16 + LINE * k, line, fill="#c60" if line.startswith("  ") else "#222")
    height = y + lh + 10
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height:.0f}" '
        f'viewBox="0 0 {W} {height:.0f}" font-family="DejaVu Sans, Arial, sans-serif">\n'
        '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#333"/></marker></defs>\n'
        f'<rect x="0" y="0" width="{W}" height="{height:.0f}" fill="#ffffff"/>\n'
        + "\n".join(svg.parts)
        + "\n</svg>\n"
    )


if __name__ == "__main__":
    new = draw()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == new else 1)
    OUT.write_text(new)
    print(f"wrote {OUT.relative_to(ROOT)}")
