"""Draw docs/images/architecture.svg: where nbtrain's code runs, and its layers (plain SVG text).

python scripts/draw_architecture.py        # rewrites docs/images/architecture.svg
"""

from __future__ import annotations

import html
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "images" / "architecture.svg"
W = 980

# (title, [(row label, modules)]) per place code runs; rows top to bottom = layers, imports go down
KERNEL = [
    ("magics, widgets", "magics/ (cluster, faults, args) · display/picker/ (a module per page)"),
    ("facade", "cluster/api.py (start, connect, attach) · cluster/facade.py (Cluster)"),
    ("workers on a session", "attach · cell · probe · check · scaling/ · faults/"),
    (
        "launchers",
        "launch/ local · ssh · slurm · mpi · ray · connect  (+ base · network · preflight)",
    ),
    ("process group, session", "cluster/group.py · cluster/session.py"),
    ("primitives", "options · topology · procs · failures · plan · registry · ranges · allocator"),
    ("shared, no client", "nbtrain/live.py · nbtrain/net.py · nbtrain/errors.py · nbtrain/runs.py"),
]
ENGINE = [
    "engine/boot.py (entry point)",
    "engine/setup.py · torchrun.py (rank env, group)",
    "engine/metrics.py (log)",
    "engine/faults.py (stack dumps, NCCL)",
    "engine/oom.py · probe.py · network.py",
    "recipes/ > generation/ > model/ > configs/ > data/ losses/ telemetry/",
    "never imports the kernel or server side",
]
SERVER = [
    "server/handlers.py (REST, authenticated)",
    "server/clusters.py · server/metrics.py",
    "never imports the notebook side",
]
BROWSER = ["labextension/src: sidebar, run panels, status bar"]
FAULTS = [
    "dead rank: faults.DeathWatch → faults.fail_cell → RankDiedError",
    "hung cell / --timeout: cell._on_timeout → diagnose.diagnose → procs (end engines)",
    "interrupt: cell._stop_ranks → group.repair / Session.restart_ranks (launch/local.replace)",
    "%nbtrain restart: faults.restart → launcher's replace → group.reinit",
    "kernel gone: watchdog (own process) → procs.kill_with_children",
]


def box(x: int, y: int, w: int, h: int, fill: str, text: list[str], bold: bool = False) -> str:
    out = [f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" fill="{fill}" stroke="#555"/>']
    for i, t in enumerate(text):
        weight = ' font-weight="bold"' if bold and i == 0 else ""
        out.append(
            f'<text x="{x + 8}" y="{y + 17 + 16 * i}" font-size="12"{weight}>{html.escape(t)}</text>'
        )
    return "\n".join(out)


def draw() -> str:
    parts = []
    y = 10
    parts.append(
        box(10, y, 620, 30 + 40 * len(KERNEL), "#eef4fb", ["the notebook kernel (client)"], True)
    )
    for i, (label, mods) in enumerate(KERNEL):
        yy = y + 28 + 40 * i
        parts.append(box(20, yy, 600, 34, "#ffffff", [label, mods]))
        if i:
            parts.append(
                f'<line x1="320" y1="{yy - 6}" x2="320" y2="{yy}" stroke="#333" marker-end="url(#a)"/>'
            )
    ky = y + 30 + 40 * len(KERNEL)
    parts.append(
        box(
            650,
            10,
            320,
            26 + 16 * len(ENGINE),
            "#eefbef",
            ["every engine (one per rank)", *ENGINE],
            True,
        )
    )
    sy = 26 + 16 * len(ENGINE) + 24
    parts.append(
        box(650, sy, 320, 26 + 16 * len(SERVER), "#fbf5ee", ["the Jupyter server", *SERVER], True)
    )
    by = sy + 26 + 16 * len(SERVER) + 14
    parts.append(box(650, by, 320, 46, "#f5eefb", ["the browser", *BROWSER], True))
    fy = ky + 16
    parts.append(box(10, fy, 960, 26 + 16 * len(FAULTS), "#fff8e6", ["fault paths", *FAULTS], True))
    height = fy + 26 + 16 * len(FAULTS) + 10
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'font-family="DejaVu Sans, Arial, sans-serif">\n'
        '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="4" refY="4" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#333"/></marker></defs>\n'
        + "\n".join(parts)
        + "\n</svg>\n"
    )


if __name__ == "__main__":
    OUT.write_text(draw())
    print(f"wrote {OUT}")
