"""The magics: `%nbtrain` and `%%distributed` (`cluster.py`), the fault subcommands (`faults.py`),
their shared argument types (`args.py`). Thin: parse, call the Python API, display.

`nbtrain.load_ipython_extension` calls `register`; importing this package imports IPython.
"""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.magics.cluster import NbtrainMagics, build_parser

log = logging.getLogger(__name__)


def register(ipython: Any) -> None:
    """Register the %nbtrain line magic and the %%distributed cell magic with `ipython`."""
    ipython.register_magics(NbtrainMagics)


__all__ = ["NbtrainMagics", "build_parser", "register"]
