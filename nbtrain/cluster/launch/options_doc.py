"""The launchers' options table in docs/magics.md, made from what each launcher declares (`OPTIONS`).

    python -m nbtrain.cluster.launch.options_doc            # rewrite the table in docs/magics.md
    python -m nbtrain.cluster.launch.options_doc --check    # exit 1 if the committed table is stale

`tests/test_docs.py` fails when the committed table differs from `table()`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from nbtrain.cluster import launch
from nbtrain.doc_tables import GeneratedTable, cell

log = logging.getLogger(__name__)

COMMAND = "python -m nbtrain.cluster.launch.options_doc"
PAGE = Path(__file__).resolve().parents[3] / "docs" / "magics.md"


def _default(o: Any) -> str:
    if o.default_doc:
        return o.default_doc
    if o.kind == "switch":
        return "off" if not o.default else "on"
    if o.default in (None, [], {}, ""):
        return ""
    return f"`{o.default}`"


def _per_launcher(takers: list[str], texts: list[str]) -> str:
    """One text where every launcher says the same, else "slurm: ...; ray: ..."."""
    if len(set(texts)) <= 1:
        return texts[0] if texts else ""
    return "; ".join(f"{x}: {t}" for x, t in zip(takers, texts) if t)


def table() -> str:
    """One row per option, in the order the launchers declare them: the flag, the Python keyword of
    `nbtrain.start`, the launchers that take it, its default and what it does."""
    declared = launch.declared()
    rows = [
        "| option | `nbtrain.start` | launchers | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, (first, takers) in launch.flags().items():
        mine = [next(o for o in declared[x] if o.name == name) for x in takers]
        if first.cli is None:
            flag = "(Python only)"
        elif first.kind == "switch":
            flag = f"`{first.cli}`"
        else:
            flag = f"`{first.cli} {first.metavar or name.upper()}`"
        if first.kind == "choice":
            flag += f" ({', '.join(first.choices)})"
        default = _per_launcher(takers, [_default(o) for o in mine])
        meaning = _per_launcher(takers, [o.doc or o.help for o in mine])
        rows.append(
            f"| {flag} | `{name}=` | {', '.join(takers)} | {cell(default)} | {cell(meaning)} |"
        )
    return "\n".join(rows)


TABLE = GeneratedTable("launcher options table", COMMAND, PAGE, table)


def main(argv: list[str] | None = None) -> int:
    return TABLE.main(argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
