"""nbtrain's debug log (nbtrain/logs.py): the NBTRAIN_LOG switch, its Python and magic twins, and the
rules that keep errors from going silent (a logger per module; no broad except that says nothing)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nbtrain
from nbtrain import logs
from nbtrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# a debug record from a module's own logger, as every nbtrain module logs
EMIT = (
    "import logging, nbtrain\n"
    "logging.getLogger('nbtrain.cluster.launch.local').debug('engine 3 started, pid %d', 42)\n"
    "logging.getLogger('nbtrain.tinker.kernel.handlers').warning('a warning')\n"
)


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != logs.ENV}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**clean, **env},
        timeout=120,
        check=True,
    )


@pytest.fixture
def restore_logger():
    """Put the "nbtrain" logger and NBTRAIN_LOG back as they were."""
    logger = logging.getLogger("nbtrain")
    level, handlers, env = logger.level, list(logger.handlers), os.environ.get(logs.ENV)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers
    if env is None:
        os.environ.pop(logs.ENV, None)
    else:
        os.environ[logs.ENV] = env


def test_nbtrain_log_debug_shows_debug_records_on_stderr_with_time_name_and_level():
    err = _fresh(EMIT, NBTRAIN_LOG="debug").stderr
    line = next(x for x in err.splitlines() if "engine 3 started" in x)
    # time, the module's logger name, the level, the message
    assert " nbtrain.cluster.launch.local DEBUG: engine 3 started, pid 42" in line, err
    assert line[:4].isdigit() and line[4] == "-", line
    assert "nbtrain.tinker.kernel.handlers WARNING: a warning" in err


def test_by_default_no_debug_record_is_shown_and_nothing_is_configured():
    code = EMIT + (
        "lg = logging.getLogger('nbtrain')\n"
        "print(lg.level, len(lg.handlers), len(logging.getLogger().handlers))\n"
    )
    out = _fresh(code)
    assert "engine 3 started" not in out.stderr
    # warnings still reach stderr through Python's own last resort, as before
    assert "a warning" in out.stderr
    assert out.stdout.split() == ["0", "0", "0"]


def test_nbtrain_log_info_hides_debug_but_shows_info():
    code = EMIT + "logging.getLogger('nbtrain.runs').info('an info line')\n"
    err = _fresh(code, NBTRAIN_LOG="INFO").stderr
    assert "engine 3 started" not in err and "nbtrain.runs INFO: an info line" in err


def test_an_unknown_level_is_reported_and_ignored_import_still_works():
    out = _fresh(EMIT + "print(nbtrain.__version__)", NBTRAIN_LOG="verbose")
    assert "NBTRAIN_LOG='verbose' ignored" in out.stderr and "unknown log level" in out.stderr
    assert "engine 3 started" not in out.stderr and out.stdout.strip()


def test_the_root_logger_is_never_touched():
    code = EMIT + "print(len(logging.getLogger().handlers), logging.getLogger().level)\n"
    out = _fresh(code, NBTRAIN_LOG="debug")
    assert out.stdout.split() == ["0", str(logging.WARNING)]


def test_set_log_level_is_the_python_twin(restore_logger, capsys):
    os.environ.pop(logs.ENV, None)
    assert nbtrain.set_log_level("debug") == "debug"
    assert nbtrain.set_log_level is logs.set_log_level
    logging.getLogger("nbtrain.cluster.launch.ssh").debug("ssh node1 started")
    err = capsys.readouterr().err
    assert "nbtrain.cluster.launch.ssh DEBUG: ssh node1 started" in err
    # engines started from here on inherit it, and each rank gets it when its group is made
    assert os.environ[logs.ENV] == "debug" and logs.engine_env() == {logs.ENV: "debug"}
    # called again: one handler, not two
    nbtrain.set_log_level(logging.WARNING)
    assert sum(isinstance(h, logs._Stderr) for h in restore_logger.handlers) == 1
    logging.getLogger("nbtrain.cluster.launch.ssh").debug("hidden now")
    assert "hidden now" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown log level 'loud'"):
        nbtrain.set_log_level("loud")


def test_the_handler_writes_to_the_stderr_of_the_moment(restore_logger, monkeypatch):
    """ipykernel and ipyparallel's engines replace sys.stderr: records go to the current one."""
    import io

    nbtrain.set_log_level("info")
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("nbtrain.x").info("to the current stderr")
    assert "nbtrain.x INFO: to the current stderr" in later.getvalue()


def test_the_magic_sets_the_level(restore_logger, ip, capsys):
    ip.run_line_magic("load_ext", "nbtrain")
    ip.run_line_magic("nbtrain", "log debug")
    out = capsys.readouterr().out
    assert "log level debug in this kernel" in out
    assert logging.getLogger("nbtrain").level == logging.DEBUG
    with pytest.raises(ConfigError, match="invalid choice: 'loud'"):
        ip.run_line_magic("nbtrain", "log loud")
