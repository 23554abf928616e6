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


# -- signalling and stopping: only processes these tests start ----------------------------------
_SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
# a child that ignores SIGTERM (as a rank stuck in a C call may): only SIGKILL ends it
_DEAF = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)",
]


def _ready(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_signal_process_takes_a_popen_a_pid_or_a_psutil_process():
    for as_what in (lambda p: p, lambda p: p.pid, lambda p: psutil.Process(p.pid)):
        proc = subprocess.Popen(_SLEEP)
        try:
            assert procs.signal_process(as_what(proc), signal.SIGTERM) is True
            assert proc.wait(10) == -signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # exited and reaped: nothing to signal (signal 0 only asks, so a reused pid is never hurt)
        assert procs.signal_process(proc, signal.SIGTERM) is False


def test_signal_process_of_an_exited_process_says_so():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watched = psutil.Process(proc.pid)
    procs.stop(proc, grace=0)
    # signal 0 delivers nothing: were the pid taken by another process already, it is not touched
    assert procs.signal_process(watched, 0) is False
    assert procs.signal_process(proc, 0) is False


def test_stop_terminates_then_waits():
    proc = subprocess.Popen(_SLEEP)
    assert procs.stop(proc, grace=10) == -signal.SIGTERM


def test_stop_kills_what_ignores_sigterm_after_the_grace():
    proc = _ready(subprocess.Popen(_DEAF, stdout=subprocess.PIPE, text=True))
    t0 = time.monotonic()
    assert procs.stop(proc, grace=0.5) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - t0 < 10
    proc.stdout.close()


def test_stop_with_no_grace_kills_at_once_and_an_ended_child_keeps_its_code():
    proc = _ready(subprocess.Popen(_DEAF, stdout=subprocess.PIPE, text=True))
    assert procs.stop(proc, grace=0) == -signal.SIGKILL
    proc.stdout.close()
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    done.wait(10)
    assert procs.stop(done) == 4  # nothing sent: it had ended


def test_interrupt_is_a_keyboard_interrupt_in_the_child():
    code = (
        "import sys, time\n"
        "try:\n    print('ready', flush=True)\n    time.sleep(60)\n"
        "except KeyboardInterrupt:\n    sys.exit(7)\n"
    )
    proc = _ready(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True))
    try:
        procs.interrupt(proc.pid)
        assert proc.wait(10) == 7
    finally:
        procs.stop(proc, grace=0)
        proc.stdout.close()


def test_signal_engine_is_a_request_to_ipyparallel():
    class Client:
        def __init__(self):
            self.calls = []

        def send_signal(self, sig, targets=None, block=None):
            self.calls.append((sig, targets, block))

    client = Client()
    procs.signal_engine(client, signal.SIGINT, 3)
    assert client.calls == [(signal.SIGINT, [3], False)]
