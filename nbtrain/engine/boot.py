"""Engine entry point: `python -m nbtrain.engine.boot` = ipyparallel's engine, with torch warming up.

An engine spends its first second importing ipyparallel and waiting for the controller's connection
file; importing torch (the largest part of bringing a rank up) in a thread meanwhile means the process
group is ready that much sooner. The import lock makes a later `import torch` simply wait for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger(__name__)


def _warm() -> None:
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # a broken torch shows itself, with its own message, when the rank is set up
        pass


# what tornado's run_sync raises when SIGTERM stops the engine's loop (ipyparallel's handler does)
_STOPPED = "Event loop stopped before Future completed"


# set by a launcher whose engine must not outlive the process that started it (Ray: the actor
# holding the rank's resources); the engine checks its parent and exits when it has gone
EXIT_WITH_PARENT_ENV = "NBTRAIN_EXIT_WITH_PARENT"


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            # the last line of the engine's log, which the death message shows: why it ended
            with contextlib.suppress(OSError):
                os.write(
                    2,
                    f"nbtrain: this engine's parent (pid {parent}) ended, so the engine exits; "
                    "with --launcher ray its Ray actor was killed or its node's Ray stopped\n".encode(),
                )
            os._exit(1)


def main() -> None:
    threading.Thread(target=_warm, name="nbtrain-warm-torch", daemon=True).start()
    if os.environ.get(EXIT_WITH_PARENT_ENV) == "1":
        watcher = threading.Thread(
            target=_exit_with_parent, args=(os.getppid(),), name="nbtrain-parent", daemon=True
        )
        watcher.start()
    from ipyparallel.engine.app import main as engine_main

    try:
        engine_main()
    except RuntimeError as e:
        # a stop (SIGTERM) is the normal end of an engine: no traceback in the notebook server's log
        if _STOPPED not in str(e):
            raise


if __name__ == "__main__":
    main()
