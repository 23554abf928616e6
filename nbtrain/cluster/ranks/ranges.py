"""Parsing of rank selections such as ``0``, ``0,2`` and ``1-3``."""

from __future__ import annotations

import logging

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)


def parse_ranks(spec: str | int | list[int] | None, world_size: int) -> list[int]:
    """The sorted ranks a selection names; every rank when `spec` is None or ``"all"``."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "all")):
        return list(range(world_size))
    if isinstance(spec, int):
        items: list[int] = [spec]
    elif isinstance(spec, (list, tuple)):
        items = [int(r) for r in spec]
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                if "-" in part[1:]:
                    lo_s, hi_s = part.split("-", 1)
                    lo, hi = int(lo_s), int(hi_s)
                    if hi < lo:
                        msg = f"--ranks {spec!r}: the range {part!r} runs backwards; write it as {hi}-{lo}."
                        raise ConfigError(msg)
                    items.extend(range(lo, hi + 1))
                else:
                    items.append(int(part))
            except ValueError as e:
                if isinstance(e, ConfigError):
                    raise
                msg = (
                    f"--ranks {spec!r}: {part!r} is not a rank or range. "
                    "Use forms like 0, 0,2 or 1-3."
                )
                raise ConfigError(msg) from None
    outside = sorted({r for r in items if r < 0 or r >= world_size})
    if outside:
        msg = (
            f"--ranks {spec!r}: rank(s) {', '.join(map(str, outside))} outside the world of "
            f"{world_size} rank(s); valid ranks are 0-{world_size - 1}."
        )
        raise ConfigError(msg)
    return sorted(set(items))
