"""nbtrain's debug log: the one switch, `NBTRAIN_LOG=debug` (or info, warning), and its Python twin.

In [1]: import nbtrain
In [2]: nbtrain.set_log_level("debug")   # or %nbtrain log debug; or NBTRAIN_LOG=debug jupyter lab

Every module logs to its own logger (`log = logging.getLogger(__name__)`), all under "nbtrain". With a
level set, the "nbtrain" logger gets that level and one handler that writes to stderr (the cell's, in a
kernel or on an engine), as `time name level: message`. The root logger is never touched; without a
level, nothing is configured and Python's own defaults apply (warnings and errors on stderr).

The level reaches the engines through their environment: `set_log_level` sets `NBTRAIN_LOG` in this
process, which engines started later inherit, and every rank gets it again when its process group is
made (`engine_env`, read by `nbtrain.engine.setup.init_rank`).

Bottom layer: imports nothing of nbtrain but `nbtrain.errors`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "NBTRAIN_LOG"
LOGGER = "nbtrain"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is written, not when the handler was made:
    ipykernel and ipyparallel's engines replace it, so records land in the cell that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        # StreamHandler.__init__ assigns it; the property always answers sys.stderr
        pass


def level_name(level: str | int) -> str:
    """`level` ("debug", "INFO", logging.WARNING) as one of LEVELS' names; ConfigError if unknown."""
    if isinstance(level, int) and not isinstance(level, bool):
        for name, value in LEVELS.items():
            if value == level:
                return name
    elif isinstance(level, str) and level.strip().lower() in LEVELS:
        return level.strip().lower()
    msg = f"unknown log level {level!r}: use one of {', '.join(LEVELS)} (e.g. NBTRAIN_LOG=debug)."
    raise ConfigError(msg)


def set_log_level(level: str | int) -> str:
    """Show nbtrain's log from `level` up ("debug", "info", "warning", "error") on stderr.

    The Python twin of `NBTRAIN_LOG=<level>` and `%nbtrain log <level>`: sets the "nbtrain" logger's
    level, adds its stderr handler once, and sets `NBTRAIN_LOG` here so engines started later (and
    every rank at its next process group) log at the same level. Returns the level's name.
    """
    name = level_name(level)
    logger = logging.getLogger(LOGGER)
    logger.setLevel(LEVELS[name])
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
    os.environ[ENV] = name
    log.debug("nbtrain log level: %s", name)
    return name


def from_env() -> str | None:
    """Apply `NBTRAIN_LOG` if set (at `import nbtrain`, and on a rank when its group is made).

    An unknown value is reported once on stderr and ignored: a typo in a variable must not stop
    `import nbtrain`.
    """
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        return set_log_level(value)
    except ConfigError as e:
        print(f"nbtrain: {ENV}={value!r} ignored: {e}", file=sys.stderr)
        return None


def engine_env() -> dict[str, str]:
    """What an engine's environment needs to log as this process does: `NBTRAIN_LOG`, if set."""
    value = os.environ.get(ENV, "").strip()
    return {ENV: value} if value else {}
