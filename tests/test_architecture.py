"""The shape of the code holds: import-linter's contracts (pyproject.toml), each shown failing on a
break planted on purpose and every module under one; no private names imported across modules; no
oversized files or folders. docs/architecture.md draws the layers these check.

Two lint-imports runs (about half a second each here): the tree as it is, and one copy with a break
of every contract planted at once."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbtrain"
LINT = Path(sys.executable).with_name("lint-imports")
LONG_OK: list[str] = []  # modules allowed past MAX_LINES, by path under nbtrain/: none
MAX_LINES = 520


def _contracts() -> list[dict[str, Any]]:
    """import-linter's contracts, as pyproject.toml declares them."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _lint(where: Path) -> subprocess.CompletedProcess[str]:
    if not LINT.exists():
        pytest.fail(
            f"lint-imports is not installed next to {sys.executable} (pip install -e '.[test]'): "
            "the contracts cannot be checked"
        )
    return subprocess.run(
        [str(LINT), "--config", str(where / "pyproject.toml"), "--no-cache"],
        cwd=where,
        # a wide console: a contract's name is printed on one line, so it can be looked up
        env={"PYTHONPATH": str(where), "PATH": "/usr/bin:/bin", "COLUMNS": "1000"},
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


# One planted break per line, each in a module of its own: (the start of the contract's name, the
# module, the import added to it). Chosen to break their own contract (a layer or package reaching up,
# or a sibling of an independent layer); where every upward import also makes a cycle (the scaling
# report's three modules), the cycle contract breaks too. Every contract in pyproject.toml needs one.
BREAKS = [
    # a cycle between two siblings of a package no other break touches
    ("no import cycles", "losses/sft.py", "from nbtrain.losses import dpo"),
    # the training layers: data reaching up to a recipe, the model to generation, a loss to telemetry
    # (data, losses and telemetry are independent of each other)
    ("training: recipes on top", "data/rows.py", "from nbtrain.recipes import hooks"),
    ("training: recipes on top", "model/build.py", "from nbtrain.generation import decode"),
    ("training: recipes on top", "losses/grpo.py", "from nbtrain.telemetry import tracking"),
    # a recipe importing its sibling in the same layer
    ("recipes: one per workload", "recipes/grpo/rollout.py", "from nbtrain.recipes import dpo"),
    ("the scaling report", "cluster/scaling/model.py", "from nbtrain.cluster.scaling import sweep"),
    # the shared helpers reaching up to the widgets; the plots (the bottom) up to the net helpers
    ("kernel side: magics and widgets", "net.py", "from nbtrain import display"),
    ("kernel side: magics and widgets", "plots/numbers.py", "from nbtrain import net"),
    # a kernel-side import of a training layer that is not in the allowed list
    ("kernel side uses the training layers", "magics/groups.py", "from nbtrain.model import tiny"),
    # a primitive reaching up to the facade: a layer broken, and a cycle
    (
        "cluster: the facade on top",
        "cluster/ranks/topology.py",
        "from nbtrain.cluster import facade",
    ),
    # the idle watchdog (its own process) importing the recovery (a layer above it in faults/)
    (
        "cluster faults:",
        "cluster/faults/watchdog.py",
        "from nbtrain.cluster.faults import recovery",
    ),
    # the picker's results view importing a page
    ("the cluster picker", "display/picker/results.py", "from nbtrain.display.picker import local"),
    # one launcher importing another
    ("launchers are plug-ins", "cluster/launch/mpi.py", "from nbtrain.cluster.launch import ssh"),
    # the rank's environment reaching up to its metrics
    ("the rank runtime", "engine/network.py", "from nbtrain.engine import metrics"),
    # the kernel side's runs reaching up to its sampler
    (
        "the Tinker service's kernel side",
        "tinker/kernel/tracking.py",
        "from nbtrain.tinker.kernel import sampling",
    ),
    # a model's lifecycle reaching up to its training verbs
    (
        "the Tinker service's rank side",
        "tinker/ranks/lifecycle.py",
        "from nbtrain.tinker.ranks import train",
    ),
    # engine-side code importing the kernel side: the cluster, the live display, run comparison
    ("code that runs on engines", "engine/rank.py", "from nbtrain.cluster import session"),
    ("code that runs on engines", "recipes/span.py", "from nbtrain import live"),
    ("code that runs on engines", "telemetry/report.py", "from nbtrain.compare import data"),
    ("code that runs on engines", "generation/sampling.py", "from nbtrain.cluster import session"),
    # the server reaching into the fine-tuning loop for a file name, or into the Tinker service
    ("the Jupyter server side", "server/metrics.py", "from nbtrain.model import checkpoint"),
    ("the Jupyter server side", "server/clusters.py", "from nbtrain.tinker.kernel import protocol"),
]
PLANTED = "planted_module"  # a new module in every exhaustive contract's container


def _sections(stdout: str) -> dict[str, str]:
    """Each broken contract's report, by the contract's name."""
    names = [c["name"] for c in _contracts()]
    broken = stdout.split("Broken contracts", 1)[-1]
    starts = sorted((broken.find(f"\n{n}\n"), n) for n in names if f"\n{n}\n" in broken)
    ends = [s for s, _ in starts[1:]] + [len(broken)]
    return {n: broken[s:e] for (s, n), e in zip(starts, ends)}


def _imported(line: str) -> str:
    """The module `from A import B` imports: A.B (each break imports a module, not a name)."""
    m = re.fullmatch(r"from (\S+) import (\w+)", line)
    assert m, line
    return f"{m[1]}.{m[2]}"


def _reported(section: str, contract: dict[str, Any], module: str, line: str, lineno: int) -> bool:
    """Whether a broken contract's report shows the break planted at `module`:`lineno` (not only
    a chain some other break opened): the cycle contract names the package whose siblings import
    each other, the others list the planted import itself, line number included."""
    if contract["type"] == "acyclic_siblings":
        return f"No cycles are allowed in {_dotted(module).rpartition('.')[0]}." in section
    hop = f"{_dotted(module)} -> {_imported(line)} ("
    return any(hop in row and f"l.{lineno}" in row for row in section.splitlines())


def _dotted(module: str) -> str:
    return "nbtrain." + module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_every_contract_fails_on_a_planted_break(tmp_path: Path) -> None:
    """One copy of the tree with every break of BREAKS planted, and a new module in every exhaustive
    contract's container; one lint run. Each contract is reported broken, by its own break: its
    report names the module the break was planted in."""
    contracts = _contracts()
    for c in contracts:
        assert any(c["name"].startswith(start) for start, _, _ in BREAKS), (
            f"no planted break shows this contract can fail (add one to BREAKS): {c['name']}"
        )
    for start, _, _ in BREAKS:
        assert sum(c["name"].startswith(start) for c in contracts) == 1, start
    modules = [m for _, m, _ in BREAKS]
    assert len(set(modules)) == len(modules), "plant each break in a module of its own"
    copy = _copy(tmp_path)
    linenos = []
    for _, module, line in BREAKS:
        path = copy / "nbtrain" / module
        text = path.read_text().rstrip("\n") + f"\n\n{line}  # noqa\n"
        path.write_text(text)
        linenos.append(text.count("\n"))
    exhaustive = {
        c["name"]: container
        for c in contracts
        if c.get("exhaustive")
        for container in c["containers"]
    }
    for container in exhaustive.values():
        folder = copy / Path(*container.split("."))
        (folder / f"{PLANTED}.py").write_text('"""A module no layer names."""\n')
    proc = _lint(copy)
    assert proc.returncode != 0, proc.stdout
    sections = _sections(proc.stdout)
    missing = []
    for (start, module, line), lineno in zip(BREAKS, linenos):
        contract = next(c for c in contracts if c["name"].startswith(start))
        if not _reported(sections.get(contract["name"], ""), contract, module, line, lineno):
            missing.append(f"{contract['name']}: {module}:{lineno} ({line})")
    for name, container in exhaustive.items():
        if f"- {container}.{PLANTED}" not in sections.get(name, ""):
            missing.append(f"{name}: the unlisted {container}.{PLANTED}")
    assert not missing, "kept despite the break planted:\n" + "\n".join(missing) + proc.stdout


def test_every_contract_over_a_package_is_exhaustive() -> None:
    """A layers contract with containers lists every module of its package (exhaustive), so a new
    module there fails lint until it is given a layer; test_every_contract_fails_on_a_planted_break
    plants one."""
    loose = [
        c["name"] for c in _contracts() if c.get("containers") and c.get("exhaustive") is not True
    ]
    assert not loose, "set exhaustive = true on:\n" + "\n".join(loose)


def _named(contract: dict[str, Any]) -> set[str]:
    """The modules a contract constrains: its layers (under each container), its independent
    modules, the sources of a forbidden contract."""
    tails = [
        t.strip().strip("()")
        for layer in contract.get("layers", [])
        for t in re.split(r"[|:]", layer)
        if t.strip()
    ]
    if contract.get("containers"):
        tails = [f"{c}.{t}" for c in contract["containers"] for t in tails]
    return set(tails) | set(contract.get("modules", [])) | set(contract.get("source_modules", []))


# package __init__s with no code of their own but the public names, resolved lazily (PEP 562)
UNCONTRACTED = {"nbtrain", "nbtrain.tinker"}


def test_every_module_is_under_a_contract() -> None:
    """Every module of nbtrain, or a package above it, is a layer, an independent module or a
    forbidden contract's source in some contract (the cycle contract, over all of nbtrain, aside)."""
    named = set().union(*(_named(c) for c in _contracts()))
    free = []
    for path in _modules():
        dotted = (
            _dotted(path.relative_to(PACKAGE).as_posix())
            if path != PACKAGE / "__init__.py"
            else "nbtrain"
        )
        parts = dotted.split(".")
        above = {".".join(parts[: i + 1]) for i in range(len(parts))}
        if dotted not in UNCONTRACTED and not above & named:
            free.append(dotted)
    assert not free, "give these a layer in pyproject.toml's contracts:\n" + "\n".join(free)


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


def test_no_module_is_longer_than_520_lines() -> None:
    """No exemption by docstring: a module past MAX_LINES is split by job, or listed in LONG_OK."""
    long = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        lines = path.read_text().count("\n")
        if lines > MAX_LINES and rel not in LONG_OK:
            long.append(f"{rel}: {lines} lines")
    assert not long, f"split these by job (at most {MAX_LINES} lines):\n" + "\n".join(long)


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
