"""The shape of the code holds: import-linter's contracts (pyproject.toml), no private names imported
across modules, no oversized files. docs/architecture.md draws the layers these check."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbtrain"
LINT = Path(sys.executable).with_name("lint-imports")
LONG_OK: set[str] = set()  # every file in nbtrain/ is within MAX_LINES
MAX_LINES = 520


def _lint(where: Path) -> subprocess.CompletedProcess[str]:
    if not LINT.exists():
        pytest.skip(
            f"lint-imports is not installed next to {sys.executable} (pip install import-linter)"
        )
    return subprocess.run(
        [str(LINT), "--config", str(where / "pyproject.toml"), "--no-cache"],
        cwd=where,
        env={"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "nbtrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_contract() -> None:
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "upward", "contract"),
    [
        # a primitive reaching up to the facade: a layer broken, and a cycle
        (
            "cluster/ranks/topology.py",
            "from nbtrain.cluster import facade",
            "cluster: the facade on top",
        ),
        # an engine module importing the kernel side
        ("engine/rank.py", "from nbtrain.cluster import session", "code that runs on engines"),
        # the fine-tuning loop (engine side too) importing the live display or the run comparison
        ("recipes/span.py", "from nbtrain import live", "code that runs on engines"),
        ("telemetry/report.py", "from nbtrain.compare import data", "code that runs on engines"),
        # the server reaching into the fine-tuning loop for a file name
        ("server/metrics.py", "from nbtrain.model import checkpoint", "the Jupyter server side"),
        # one launcher importing another
        (
            "cluster/launch/mpi.py",
            "from nbtrain.cluster.launch import ssh",
            "launchers are plug-ins",
        ),
        # a cycle between two sibling packages
        (
            "net.py",
            "from nbtrain import display",
            "no import cycles",
        ),  # the training layers: data reaching up to a recipe, the model to generation, a loss to
        # telemetry (data, losses and telemetry are independent of each other)
        ("data/rows.py", "from nbtrain.recipes import hooks", "training: recipes on top"),
        ("model/build.py", "from nbtrain.generation import decode", "training: recipes on top"),
        ("losses/grpo.py", "from nbtrain.telemetry import tracking", "training: recipes on top"),
        # the set-up every recipe shares importing one recipe
        ("recipes/run_setup.py", "from nbtrain.recipes import dpo", "recipes: one per workload"),
        # generation (engine side) importing the cluster
        (
            "generation/sampling.py",
            "from nbtrain.cluster import session",
            "code that runs on engines",
        ),
    ],
)
def test_an_upward_import_fails_lint(
    tmp_path: Path, module: str, upward: str, contract: str
) -> None:
    copy = _copy(tmp_path)
    path = copy / "nbtrain" / module
    path.write_text(path.read_text() + f"\n{upward}  # noqa\n")
    proc = _lint(copy)
    assert proc.returncode != 0, proc.stdout
    broken = proc.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, proc.stdout


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_private_name_is_imported_from_another_module() -> None:
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nbtrain"):
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
        # module._name through an imported nbtrain module (`core._kill_tree`)
        imported = {
            a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nbtrain")
            for a in node.names
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported
                and re.match(r"_[a-z]", node.attr)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_no_module_is_long_without_saying_why() -> None:
    long = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and rel not in LONG_OK and "longer than" not in doc:
            long.append(f"{rel}: {lines} lines")
    assert not long, (
        "split these by job (or say in the docstring why one file is longer than ~500 lines):\n"
        + "\n".join(long)
    )


MAX_MODULES = 15


def test_no_package_holds_more_than_15_modules() -> None:
    """A folder past 15 modules no longer says what it holds: split it by job."""
    crowded = []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES:
            crowded.append(f"{folder.relative_to(ROOT)}: {len(modules)} modules")
    assert not crowded, "split these by job (docs/architecture.md):\n" + "\n".join(crowded)


def test_module_names_do_not_repeat_their_folder() -> None:
    """`data/data.py`, `grpo/grpo_loss.py`: the folder already says it."""
    repeated = [
        p.relative_to(ROOT).as_posix()
        for p in _modules()
        if p.stem == p.parent.name or p.stem.startswith(p.parent.name + "_")
    ]
    assert not repeated, "rename these:\n" + "\n".join(repeated)


def test_the_public_surface_is_the_packages_names() -> None:
    """`nbtrain.X` for every name in `__all__` resolves (lazily, PEP 562) in a fresh interpreter,
    the training names to the new packages, and `import nbtrain` alone imports none of them."""
    code = (
        "import sys, nbtrain\n"
        "heavy = [m for m in ('torch', 'transformers', 'nbtrain.recipes') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "for name in nbtrain.__all__:\n"
        "    getattr(nbtrain, name)\n"
        "print(nbtrain.Hooks.__module__, nbtrain.finetune.__module__, nbtrain.SFTConfig.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.split()
    assert out == ["nbtrain.recipes.hooks", "nbtrain.recipes.train", "nbtrain.configs.sft"]
