"""The `nbtrain` command: `nbtrain demo` runs the quickstart notebook end to end in a real kernel."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from nbtrain import __version__
from nbtrain.cli import main
from tests.conftest import wait_gone

PNG = b"\x89PNG\r\n\x1a\n"


def _nbtrain(*args: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    script = Path(sys.executable).with_name("nbtrain")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nbtrain.cli"]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"nbtrain {__version__}"
    assert main([]) == 0  # no command: the help
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--out DIR" in capsys.readouterr().out


def test_console_script_help():
    proc = _nbtrain("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: nbtrain" in proc.stdout and "demo" in proc.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"  # does not exist yet: the demo creates it
    # a home of its own, with no nbtrain, IPython or XDG folders moved: whatever the demo writes
    # outside --out shows up there (tests/test_cli.py::test_demo_writes_only_under_out_and_says_where_else)
    home = tmp_path_factory.mktemp("demo-home")
    moved = ("NBTRAIN_HOME", "IPYTHONDIR", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
    env = {k: v for k, v in os.environ.items() if k not in moved} | {"HOME": str(home)}
    proc = _nbtrain("demo", "--out", str(out), env=env)
    return out, proc, home


def test_demo_runs_end_to_end(demo):
    out, proc, _ = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # progress per cell, then the summary
    assert re.search(r"^\[1/\d+\] .* \d+\.\d s$", proc.stdout, re.M), proc.stdout
    assert "nbtrain demo: done in" in proc.stdout
    run = out / "runs" / "quickstart"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (run / "adapter" / name).stat().st_size > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 40
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # it learned something
    assert f"final loss    {rows[-1]['loss']:.4f}" in proc.stdout
    assert f"adapter       {run / 'adapter'}" in proc.stdout
    assert (out / "tiny-llama" / "config.json").exists()


def test_quickstart_page_shows_what_the_demo_prints(demo):
    # the demo is deterministic: docs/quickstart.md's sample output has this run's losses
    _, proc, _ = demo
    line = re.compile(
        r"final loss +(\d+\.\d+) \(first logged (\d+\.\d+), (\d+) rows, last step (\d+)\)"
    )
    page = (Path(__file__).resolve().parents[1] / "docs" / "quickstart.md").read_text()
    shown, ran = line.search(page), line.search(proc.stdout)
    assert shown and ran, proc.stdout
    assert shown.groups()[2:] == ran.groups()[2:]
    # four decimals as printed; a CPU with other vector kernels may differ in the last ones
    for doc, now in zip(shown.groups()[:2], ran.groups()[:2]):
        assert abs(float(doc) - float(now)) < 0.01, (shown.group(0), ran.group(0))
    assert "nbtrain demo: outside it, the run's record goes to the run registry" in page


def test_demo_writes_only_under_out_and_says_where_else(demo):
    out, proc, home = demo
    assert proc.returncode == 0, proc.stdout + proc.stderr
    registry = home / ".local" / "share" / "nbtrain" / "runs"
    ipython = home / ".ipython"
    assert (
        f"outside it, the run's record goes to the run registry {registry} and the kernel's and "
        f"the cluster's profiles to the IPython folder {ipython}"
    ) in proc.stdout
    elsewhere = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.is_relative_to(registry) for p in elsewhere)  # the run's record, named above
    stray = [p for p in elsewhere if not (p.is_relative_to(registry) or p.is_relative_to(ipython))]
    assert stray == [], (
        stray
    )  # no cache in ~/.cache: the data and matplotlib caches went under --out


def test_demo_notebook_keeps_plot_table_history_and_generation(demo):
    out, _, _ = demo
    nb = nbformat.read(str(out / "01-quickstart.ipynb"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "every code cell ran"
    assert not any(o.output_type == "error" for c in code for o in c.outputs)
    finetune = next(c for c in code if "nbtrain.finetune(cfg)" in c.source)
    finals = [
        o
        for o in finetune.outputs
        if o.output_type == "display_data" and "(finished)" in o.data.get("text/html", "")
    ]
    assert len(finals) == 1, "one live display, left in its final state"
    html = finals[0].data["text/html"]
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)
    assert len(images) == 1 and base64.b64decode(images[0])[:8] == PNG
    assert "<table>" in html and ">loss<" in html and ">step<" in html
    stdout = "".join(o.get("text", "") for o in finetune.outputs if o.output_type == "stream")
    assert "step 40/40 | loss" in stdout
    history = next(c for c in code if "result.history" in c.source)
    table = next(o for o in history.outputs if o.output_type == "execute_result")
    assert "<table" in table.data["text/html"] and "tokens_per_s" in table.data["text/plain"]
    generate = next(c for c in code if "PeftModel.from_pretrained" in c.source)
    assert "with the adapter:" in "".join(o.get("text", "") for o in generate.outputs)
    # no progress-bar widgets or other bulk: the plot is the only image
    assert (out / "01-quickstart.ipynb").stat().st_size < 200_000


def test_demo_failing_cell_names_it_and_leaves_nothing_running(tmp_path):
    nb = new_notebook(
        cells=[
            new_markdown_cell("## Start"),
            new_code_cell(
                "%load_ext nbtrain\n%nbtrain start -n 2\n"
                "import psutil\n"
                "print('PIDS', *[p.pid for p in psutil.Process().children(recursive=True)])"
            ),
            new_markdown_cell("## Fail"),
            new_code_cell("%%distributed\nif rank == 1:\n    raise KeyError('no such column')"),
            new_code_cell("print('never reached')"),
        ]
    )
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "bad.ipynb"
    nbformat.write(nb, str(path))
    out = tmp_path / "out"
    proc = _nbtrain("demo", "--out", str(out), "--notebook", str(path), timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cell 2 of 3 (Fail; `%%distributed`) failed" in proc.stderr, proc.stderr
    assert "KeyError: 'no such column'  [rank 1 on" in proc.stderr
    assert str(out / "bad.ipynb") in proc.stderr
    executed = nbformat.read(str(out / "bad.ipynb"), as_version=4)
    assert [o.output_type for o in executed.cells[3].outputs][-1] == "error"
    # the kernel got time to stop its cluster on the way out
    text = "".join(o.get("text", "") for o in executed.cells[1].outputs)
    line = next(ln for ln in text.splitlines() if ln.startswith("PIDS "))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) >= 3  # controller, 2 engines (and their helpers)
    left = wait_gone(pids, timeout=10)
    for pid in left:  # a failing check must not leak engines onto the machine
        psutil.Process(pid).kill()
    assert left == [], f"cluster processes outlived the demo's kernel: {left}"


def test_the_lockfile_installs_as_it_is(tmp_path):
    # `make dev` builds the Lab extension through hatch-jupyter-builder, which runs `npm install`:
    # a lockfile out of step with package.json (optional platform bindings missing) is rewritten
    # there and leaves the clone modified. npm ci accepts only a lockfile in step.
    import shutil

    if shutil.which("npm") is None:
        pytest.skip("npm is not installed")
    lab = Path(__file__).resolve().parents[1] / "labextension"
    for name in ("package.json", "package-lock.json"):
        shutil.copy(lab / name, tmp_path / name)
    proc = subprocess.run(
        ["npm", "ci", "--dry-run", "--ignore-scripts", "--no-audit", "--no-fund"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if "ENOTFOUND" in proc.stderr or "EAI_AGAIN" in proc.stderr:
        pytest.skip("the npm registry cannot be reached")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "package-lock.json").read_bytes() == (lab / "package-lock.json").read_bytes()


def test_demo_out_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """--out that is a file, or under one: one line that says why, exit code 2, no traceback."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for out, why in (
        (a_file, f"--out {a_file} is a file, not a folder"),
        (a_file / "demo", f"--out {a_file / 'demo'} cannot be made: {a_file} is a file"),
    ):
        assert main(["demo", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"nbtrain demo: {why}; pass a folder you can write to\n"
    assert a_file.read_text() == "mine"
    # the console script as a user runs it: the same line, and no traceback
    proc = _nbtrain("demo", "--out", str(a_file / "demo"), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"nbtrain demo: --out {a_file / 'demo'} cannot be made: {a_file} is a file; pass a "
        "folder you can write to"
    ]
