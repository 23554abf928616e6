"""The picker's status line follows a start's progress lines (nbtrain/display/picker/results.py)."""

from __future__ import annotations

import logging
import threading

from nbtrain.display.picker.results import Progress


def test_progress_takes_the_launchers_lines_from_this_thread_only() -> None:
    level = logging.getLogger("nbtrain").level
    # a launcher logs under its own module's name, below "nbtrain" (the Slurm launcher's pending line)
    slurm = logging.getLogger("nbtrain.cluster.launch.slurm")
    progress = Progress()
    with progress.from_this_thread():
        slurm.info("nbtrain: slurm job 4711 pending (Resources)")
        assert progress.last == "slurm job 4711 pending (Resources)"
        other = threading.Thread(target=slurm.info, args=("nbtrain: another start's line",))
        other.start()
        other.join()
        slurm.debug("a debug line is not a progress line")
    assert progress.last == "slurm job 4711 pending (Resources)"
    # after the start the handler is gone and the level is back
    slurm.info("after the start")
    assert progress.last == "slurm job 4711 pending (Resources)"
    assert progress not in logging.getLogger("nbtrain").handlers
    assert logging.getLogger("nbtrain").level == level
