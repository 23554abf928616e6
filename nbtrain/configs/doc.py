"""The SFTConfig reference table in docs/fine-tuning.md, generated from the dataclass so it cannot drift.

    python -m nbtrain.configs.doc            # rewrite the table in docs/fine-tuning.md
    python -m nbtrain.configs.doc --check    # exit 1 if the committed table is stale

The table sits between two marker comments in the page; everything outside them is left as written.
`tests/test_docs.py` fails when the committed table differs from `table()`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from nbtrain.configs.sft import SFTConfig
from nbtrain.doc_tables import GeneratedTable, cell

log = logging.getLogger(__name__)

COMMAND = "python -m nbtrain.configs.doc"
# where the page is in a checkout (the docs do not ship in the wheel)
PAGE = Path(__file__).resolve().parents[2] / "docs" / "fine-tuning.md"


def _type(f: Field[Any]) -> str:
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return " or ".join(part.strip() for part in name.split("|"))


def _default(f: Field[Any]) -> str:
    default: Any = f.default
    factory: Any = f.default_factory
    if default is MISSING and factory is not MISSING:
        default = factory()
    if default is MISSING:
        return "required"
    return f"`{default!r}`"


def table() -> str:
    """The markdown table: one row per SFTConfig field, in declaration order, with its default and help."""
    rows = ["| field | type | default | what it does |", "|---|---|---|---|"]
    for f in fields(SFTConfig):
        help_text = f.metadata.get("help")
        if not help_text:
            msg = f"SFTConfig.{f.name} has no metadata['help']; give it one line of help"
            raise ValueError(msg)
        rows.append(f"| `{f.name}` | `{_type(f)}` | {_default(f)} | {cell(help_text)} |")
    return "\n".join(rows)


TABLE = GeneratedTable("SFTConfig table", COMMAND, PAGE, lambda: table())
BEGIN, END = TABLE.begin, TABLE.end


def render(page_text: str) -> str:
    """`page_text` with the text between the markers replaced by the current table."""
    return TABLE.render(page_text)


def main(argv: list[str] | None = None) -> int:
    return TABLE.main(argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
