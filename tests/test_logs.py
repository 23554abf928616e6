"""nbtrain's debug log (nbtrain/logs.py): the NBTRAIN_LOG switch, its Python and magic twins, and the
rules that keep errors from going silent (a logger per module; no broad except that says nothing)."""

from __future__ import annotations

import ast
import io
import logging
import os
import re
import subprocess
import sys
import tokenize
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


# ----------------------------------------------------------------------------- the rules, by AST
PACKAGE = ROOT / "nbtrain"

# modules whose own `log` is nbtrain's public metrics call (nbtrain.log()), so their logger is `logger`
LOGGER_NAMED_LOGGER = {"nbtrain/engine/metrics.py"}
# the package's namespace: `nbtrain.log` is the metrics call, resolved lazily; nothing here logs
NO_LOGGER = {"nbtrain/__init__.py"}
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


def _modules() -> list[tuple[str, ast.Module, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found.append((path.relative_to(ROOT).as_posix(), ast.parse(text), text))
    assert len(found) > 100, "the walk found too few modules: the tests below would pass vacuously"
    return found


def _is_module_logger(node: ast.stmt, name: str) -> bool:
    if not isinstance(node, ast.Assign) or len(node.targets) != 1:
        return False
    target, value = node.targets[0], node.value
    return (
        isinstance(target, ast.Name)
        and target.id == name
        and isinstance(value, ast.Call)
        and ast.unparse(value.func) == "logging.getLogger"
        and [ast.unparse(a) for a in value.args] == ["__name__"]
    )


def missing_loggers(modules: list[tuple[str, ast.Module, str]]) -> list[str]:
    """Modules with a function or class but no `log = logging.getLogger(__name__)` at top level."""
    missing = []
    for rel, tree, _ in modules:
        if rel in NO_LOGGER:
            continue
        has_code = any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body
        )
        name = "logger" if rel in LOGGER_NAMED_LOGGER else "log"
        if has_code and not any(_is_module_logger(n, name) for n in tree.body):
            missing.append(rel)
    return missing


def _broad(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type
    if kinds is None:
        return True
    names = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
    return any(ast.unparse(n).split(".")[-1] in ("Exception", "BaseException") for n in names)


def _says_why(comment: str) -> bool:
    """A comment with words in it, beyond a bare `noqa`, `type: ignore` or `pragma` marker."""
    text = re.sub(
        r"noqa(:\s*[A-Z0-9, ]+)?|type:\s*ignore(\[[^\]]*\])?|pragma:\s*no cover", "", comment
    )
    return len(re.findall(r"[A-Za-z]{2,}", text)) >= 2


def silent_excepts(modules: list[tuple[str, ast.Module, str]]) -> list[str]:
    """Broad excepts (bare, Exception, BaseException, or a tuple holding one) that neither raise,
    nor call a log method, nor say why in a comment on the except line or the first of the body."""
    found = []
    for rel, tree, text in modules:
        comments: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string
        for handler in ast.walk(tree):
            if not isinstance(handler, ast.ExceptHandler) or not _broad(handler):
                continue
            inner = [n for stmt in handler.body for n in ast.walk(stmt)]
            if any(isinstance(n, ast.Raise) for n in inner):
                continue
            if any(
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in LOG_METHODS
                and ast.unparse(n.func.value) in ("log", "logger")
                for n in inner
            ):
                continue
            lines = range(handler.lineno, handler.body[0].lineno + 1)
            if any(_says_why(comments.get(i, "")) for i in lines):
                continue
            found.append(f"{rel}:{handler.lineno}")
    return found


def test_every_module_with_code_has_its_own_logger():
    missing = [m for m in missing_loggers(_modules())]
    assert not missing, "add `log = logging.getLogger(__name__)` to:\n" + "\n".join(missing)


def test_no_broad_except_is_silent():
    found = [f for f in silent_excepts(_modules())]
    assert not found, (
        "each of these broad excepts must re-raise, log the reason (log.debug/warning(..., "
        "exc_info=True)) or say in a comment why silence is right:\n" + "\n".join(found)
    )


def test_the_rules_catch_a_planted_offender():
    planted = (
        "import logging\n"
        "def f():\n"
        "    try:\n"
        "        pass\n"
        "    except Exception:\n"
        "        pass\n"
        "    try:\n"
        "        pass\n"
        "    except (OSError, BaseException):  # noqa: BLE001\n"
        "        x = 1\n"
        "    try:\n"
        "        pass\n"
        "    except:\n"
        "        log.debug('why', exc_info=True)\n"
        "    try:\n"
        "        pass\n"
        "    except Exception:\n"
        "        # the file may be gone already: nothing to clean\n"
        "        pass\n"
        "    try:\n"
        "        pass\n"
        "    except OSError:\n"
        "        pass\n"
    )
    module = [("nbtrain/planted.py", ast.parse(planted), planted)]
    assert silent_excepts(module) == ["nbtrain/planted.py:5", "nbtrain/planted.py:9"]
    assert missing_loggers(module) == ["nbtrain/planted.py"]
    fixed = planted.replace(
        "import logging\n", "import logging\nlog = logging.getLogger(__name__)\n"
    )
    assert missing_loggers([("nbtrain/planted.py", ast.parse(fixed), fixed)]) == []


def test_a_failed_registry_write_is_a_warning_naming_the_cluster_and_the_reason(
    monkeypatch, caplog
):
    """Defining groups writes the cluster's record; a write that fails leaves the cluster working
    and says so (it was dropped silently)."""
    from types import SimpleNamespace

    from nbtrain.cluster import group, registry

    def full(cluster, state="running"):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(group, "create_groups", lambda session, specs, timeout=60.0: None)
    monkeypatch.setattr(registry, "write", full)
    session = SimpleNamespace(world_size=2, cluster_id="nbtrain-1234abcd", group_specs={})
    caplog.set_level(logging.WARNING, logger="nbtrain")
    assert group.define_groups(session, {"actor": "0", "rollout": "1"}) == {
        "actor": [0],
        "rollout": [1],
    }
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = rec.getMessage()
    assert rec.name == "nbtrain.cluster.group" and "nbtrain-1234abcd" in text
    assert "No space left on device" in text and rec.exc_info is not None


@pytest.mark.timeout(600)
def test_a_local_cluster_logs_its_start_and_stop_and_the_level_reaches_the_ranks():
    """NBTRAIN_LOG=info: the launcher's start (command, pids) and stop are on stderr; a level set
    later in the kernel reaches the running ranks when their process group is made again."""
    code = (
        "import logging, nbtrain\n"
        "c = nbtrain.start(n=1, force=True)\n"
        "try:\n"
        "    level = lambda: __import__('logging').getLogger('nbtrain').level\n"
        "    print('before', c.run(level))\n"
        "    nbtrain.set_log_level('debug')\n"
        "    c.reinit_group()\n"
        "    print('after', c.run(level))\n"
        "finally:\n"
        "    c.stop()\n"
    )
    out = _fresh(code, NBTRAIN_LOG="info")
    err = out.stderr
    assert "nbtrain.cluster.launch.local INFO: cluster nbtrain-" in err, err[-3000:]
    assert "starting 1 engine(s) here: " in err and "-m nbtrain.engine.boot" in err
    assert "engine(s) up, pids [" in err and "stopping local cluster nbtrain-" in err
    # the engine inherited NBTRAIN_LOG=info; the re-init gave it the kernel's new level
    assert f"before [{logging.INFO}]" in out.stdout and f"after [{logging.DEBUG}]" in out.stdout
