"""The `nbtrain` command: `nbtrain demo` runs the quickstart notebook headless, in a real Jupyter kernel.

    $ nbtrain demo --out nbtrain-demo
    nbtrain demo: running 01-quickstart.ipynb in a python3 kernel (/.../bin/python)
    [1/9] OUT = os.environ.get("NBTRAIN_DEMO_OUT", "nbtrain-demo") ... 0.1 s
    ...

Everything the notebook writes (the executed notebook, the tiny model, the run folder with
metrics.jsonl and the exported adapter, the kernel's own log, the tokenized-data cache, matplotlib's
font cache) lands under `--out`, except two things it names when it starts: the run's record in the
run registry (`$NBTRAIN_HOME/runs`, which the Lab sidebar lists) and the IPython folder (`~/.ipython`:
the kernel's profile and the cluster's `profile_nbtrain`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

QUICKSTART = "01-quickstart.ipynb"
DEFAULT_OUT = "nbtrain-demo"
# the notebook reads its output folder from this variable (its first code cell)
OUT_ENV = "NBTRAIN_DEMO_OUT"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def quickstart_path() -> Path:
    """The quickstart notebook shipped inside the package (a copy of notebooks/01-quickstart.ipynb)."""
    return Path(__file__).with_name("notebooks") / QUICKSTART


# Seconds a kernel gets to exit after a shutdown request before it is sent SIGTERM (half of it) and
# killed. Jupyter's 5 s is less than stopping a cluster at exit takes today (~10 s on 2 CPU engines),
# and a killed kernel leaves its engines running: the demo waits longer, so a failed cell leaves
# nothing behind.
SHUTDOWN_WAIT = 30.0


def _kernel_manager(shutdown_wait_time: float = SHUTDOWN_WAIT) -> Any:
    """A KernelManager whose python3 kernel is this interpreter, whatever kernelspecs are installed.

    A python3 kernelspec in ~/.local/share/jupyter could point at another Python, one without nbtrain.
    """
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager

    class _ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            return KernelSpec(
                argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                display_name=f"Python 3 ({sys.executable})",
                language="python",
                resource_dir="",
                metadata={},
            )

    return KernelManager(
        kernel_name="python3",
        kernel_spec_manager=_ThisPython(),
        shutdown_wait_time=shutdown_wait_time,
    )


def _label(source: str, width: int = 60) -> str:
    """The first line that says something: a magic or code, not a comment."""
    lines = [ln.strip() for ln in source.splitlines() if ln.strip()]
    meaningful = [ln for ln in lines if not ln.startswith("#")]
    text = (meaningful or lines or ["(empty)"])[0]
    return text if len(text) <= width else text[: width - 3] + "..."


def _labels(cells: list[Any]) -> dict[int, str]:
    """Each code cell's name in progress lines: the heading above it, else its first line of code."""
    out: dict[int, str] = {}
    heading = None
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    heading = line.lstrip("#").strip()
                    break
        elif cell.cell_type == "code":
            out[i] = heading or _label(cell.source)
    return out


class DemoError(Exception):
    """A cell of the notebook failed; the message names the cell and the error."""


def run_notebook(
    notebook: Path,
    out: Path,
    timeout: float = 600.0,
    echo: Any = print,
) -> Path:
    """Execute `notebook` in a fresh kernel with its working directory and OUT set to `out`.

    Writes the executed notebook to `out/<name>` (also when a cell fails) and returns its path.
    Raises `DemoError` naming the failing cell and its error.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(str(notebook), as_version=4)
    executed = out / notebook.name
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    ordinal = {index: n + 1 for n, index in enumerate(code_cells)}
    labels = _labels(nb.cells)
    started: dict[int, float] = {}

    def on_execute(cell: Any, cell_index: int) -> None:
        started[cell_index] = time.monotonic()
        echo(f"[{ordinal[cell_index]}/{len(code_cells)}] {labels[cell_index]} ...", end="")

    def on_executed(cell: Any, cell_index: int, execute_reply: Any = None) -> None:
        status = (execute_reply or {}).get("content", {}).get("status", "ok")
        elapsed = time.monotonic() - started.get(cell_index, time.monotonic())
        echo(f" {elapsed:.1f} s" if status == "ok" else f" failed after {elapsed:.1f} s")

    env = {**demo_env(out), OUT_ENV: str(out)}
    client = NotebookClient(
        nb,
        km=_kernel_manager(),
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(out)}},
        on_cell_execute=on_execute,
        on_cell_executed=on_executed,
    )

    def where(index: int) -> str:
        if index not in ordinal:
            return "the notebook"
        first = _label(nb.cells[index].source)
        return f"cell {ordinal[index]} of {len(code_cells)} ({labels[index]}; `{first}`)"

    # the kernel's own chatter (transport warnings, engine launch logs) goes to a file, not the terminal
    with open(out / "kernel.log", "w") as kernel_log:
        try:
            # cleanup_kc: nbclient leaves a kernel it was handed running; shut it down here, so its
            # atexit hook stops the cluster (a kernel that dies with this process would not)
            client.execute(env=env, stdout=kernel_log, stderr=kernel_log, cleanup_kc=True)
        except CellExecutionError as e:
            index = max(started) if started else -1
            error = _ANSI.sub("", f"{e.ename}: {e.evalue}".strip())
            msg = f"{where(index)} failed:\n{error}"
            raise DemoError(msg) from None
        except CellTimeoutError:
            index = max(started) if started else -1
            msg = f"{where(index)} ran past the {timeout:g} s per-cell limit and was stopped."
            raise DemoError(msg) from None
        except DeadKernelError as e:
            index = max(started) if started else -1
            msg = f"the kernel died during {where(index)}: {e}. See {out / 'kernel.log'}."
            raise DemoError(msg) from None
        finally:
            nbformat.write(nb, str(executed))
    return executed


def demo_env(out: Path) -> dict[str, str]:
    """The kernel's environment: caches a user has not placed elsewhere go under `out`."""
    env = dict(os.environ)
    env.setdefault("NBTRAIN_DATA_CACHE", str(out / "data-cache"))  # the tokenized rows
    env.setdefault("MPLCONFIGDIR", str(out / "matplotlib"))  # matplotlib's font cache
    return env


def written_elsewhere() -> list[tuple[str, Path]]:
    """What the demo writes outside `--out`: shared with every notebook of this user, so kept where
    nbtrain and IPython always keep them."""
    from IPython.paths import get_ipython_dir

    from nbtrain.runs import nbtrain_home

    return [
        ("run registry", nbtrain_home() / "runs"),
        ("IPython folder", Path(get_ipython_dir())),
    ]


def _summary(out: Path) -> list[str]:
    """Final loss, adapter and metrics of the newest run under `out`, if it trained one."""
    from nbtrain.runs import ADAPTER_CONFIG_FILE, METRICS_FILE

    lines = []
    metrics = sorted(out.rglob(METRICS_FILE), key=lambda p: p.stat().st_mtime)
    if metrics:
        rows = [json.loads(ln) for ln in metrics[-1].read_text().splitlines() if ln.strip()]
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
        if losses:
            lines.append(
                f"  final loss    {losses[-1]:.4f} (first logged {losses[0]:.4f}, "
                f"{len(rows)} rows, last step {rows[-1].get('step')})"
            )
        lines.append(f"  metrics       {metrics[-1]}")
    adapters = sorted(out.rglob(ADAPTER_CONFIG_FILE), key=lambda p: p.stat().st_mtime)
    adapters = [p for p in adapters if "checkpoint" not in p.parent.parent.name]
    if adapters:
        lines.append(f"  adapter       {adapters[-1].parent}")
    return lines


def _unusable(out: Path) -> str | None:
    """Why `out` cannot hold the demo's files (after making it), or None when it can."""
    if out.exists() and not out.is_dir():
        return "is a file, not a folder"
    above = next(p for p in out.parents if p.exists())
    if not above.is_dir():
        return f"cannot be made: {above} is a file"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".nbtrain-demo-{os.getpid()}"  # an existing folder may still be read-only
        probe.touch()
        probe.unlink()
    except OSError as e:
        where = f": {e.filename}" if e.filename and e.filename != str(out) else ""
        return f"cannot be made or written to ({e.strerror or e}{where})"
    return None


def _cmd_demo(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser().resolve()
    notebook = Path(args.notebook).resolve() if args.notebook else quickstart_path()
    if not notebook.is_file():
        print(f"nbtrain demo: notebook {notebook} not found.", file=sys.stderr)
        return 2
    unusable = _unusable(out)
    if unusable:
        msg = f"nbtrain demo: --out {out} {unusable}; pass a folder you can write to"
        print(msg, file=sys.stderr)
        return 2
    print(
        f"nbtrain demo: running {notebook.name} in a python3 kernel ({sys.executable}); "
        f"output in {out}",
        flush=True,
    )
    registry, ipython = (path for _, path in written_elsewhere())
    print(
        f"nbtrain demo: outside it, the run's record goes to the run registry {registry} and the "
        f"kernel's and the cluster's profiles to the IPython folder {ipython}",
        flush=True,
    )

    def echo(text: str, end: str = "\n") -> None:
        print(text, end=end, flush=True)

    t0 = time.monotonic()
    try:
        executed = run_notebook(notebook, out, timeout=args.timeout, echo=echo)
    except DemoError as e:
        print(file=sys.stderr)
        print(f"nbtrain demo: {e}", file=sys.stderr)
        print(
            f"nbtrain demo: the executed notebook, with the error in place, is {out / notebook.name}",
            file=sys.stderr,
        )
        return 1
    elapsed = time.monotonic() - t0
    print(f"nbtrain demo: done in {elapsed:.1f} s")
    print(f"  notebook      {executed}")
    for line in _summary(out):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from nbtrain import __version__

    parser = argparse.ArgumentParser(
        prog="nbtrain",
        description="Jupyter-native distributed training. In a notebook: %load_ext nbtrain.",
    )
    parser.add_argument("--version", action="version", version=f"nbtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run the quickstart notebook headless: 2 CPU ranks fine-tune a tiny model with LoRA",
        description=(
            "Execute the quickstart notebook in a fresh Jupyter kernel of this Python: start 2 local "
            "engines, fine-tune a tiny model with LoRA on the shipped dataset, load the adapter and "
            "generate. Everything it writes (the executed notebook, the model, metrics.jsonl, the "
            "adapter, the caches) goes under --out, except the run's record in the run registry "
            "($NBTRAIN_HOME/runs) and the IPython folder (~/.ipython), named when it starts."
        ),
    )
    demo.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"folder for everything the run writes (default: ./{DEFAULT_OUT})",
    )
    demo.add_argument(
        "--notebook",
        default=None,
        metavar="PATH",
        help="run this notebook instead of the shipped quickstart, the same way",
    )
    demo.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="fail a cell that runs longer than S seconds (default 600)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nbtrain` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _cmd_demo(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
