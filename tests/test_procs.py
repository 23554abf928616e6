"""nbtrain/procs.py on real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import psutil

from nbtrain import procs


def _waiting_like_ipyparallel(proc: psutil.Popen) -> threading.Thread:
    # ipyparallel's LocalProcessLauncher._wait: a thread polling wait() on the same psutil object
    def wait() -> None:
        while True:
            try:
                proc.wait(timeout=0.5)
                return
            except psutil.TimeoutExpired:
                continue

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def test_exit_code_of_a_killed_child_that_a_launcher_thread_also_waits_on():
    """The launcher's thread and exit_code both wait on the process: without `waiter`, whichever
    reaps it second gets None and psutil keeps it ("exit status unknown" for a SIGKILLed rank)."""
    for _ in range(20):
        proc = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        waiter = _waiting_like_ipyparallel(proc)
        time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert procs.exit_code(proc, wait=5.0, waiter=waiter) == -signal.SIGKILL


def test_exit_code_waits_for_the_process_itself_without_a_waiter():
    proc = psutil.Popen([sys.executable, "-c", "raise SystemExit(3)"], stdout=subprocess.DEVNULL)
    assert procs.exit_code(proc, wait=10.0) == 3
    live = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert procs.exit_code(live, wait=0.2) is None  # still running: unknown, not a guess
    finally:
        live.kill()
        live.wait()
