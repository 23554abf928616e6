"""tests/ mirrors nbtrain/: a package nbtrain/X/Y/ has its tests in tests/X/Y/ (a module nbtrain/X/y.py in
tests/X/test_y.py), and every place that names a test file names one that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nbtrain"
TESTS = ROOT / "tests"

#: folders of tests/ that mirror no package, and why
NOT_MIRRORS = {
    "fixtures": "data the tests read (a finished run, chat templates)",
    "multinode": "the simulated-node lane (make test-nodes): tests across packages on network namespaces",
    "ui": "the browser tests' helpers (a Lab server, run writers), run by labextension/run-tests.sh",
}

#: files outside tests/ that name test files to run or read
NAMERS = [
    "Makefile",
    "labextension/run-tests.sh",
    "scripts/lanes.sh",
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
]


def _packages() -> list[Path]:
    """nbtrain's packages (folders with an __init__.py), relative to nbtrain/, nbtrain/ itself left out."""
    return sorted(p.parent.relative_to(PKG) for p in PKG.rglob("__init__.py") if p.parent != PKG)


def _test_folders() -> list[Path]:
    """tests/'s folders, relative to tests/, less caches and the folders that mirror no package."""
    out = []
    for p in TESTS.rglob("*"):
        rel = p.relative_to(TESTS)
        if p.is_dir() and "__pycache__" not in rel.parts and not rel.parts[0].startswith("_"):
            if rel.parts[0] not in NOT_MIRRORS:
                out.append(rel)
    return sorted(out)


def test_every_package_has_its_tests_in_the_same_path():
    missing = []
    for rel in _packages():
        folder = TESTS / rel
        own = [m for m in (PKG / rel).glob("*.py") if m.name != "__init__.py"]
        # a package with modules of its own has tests beside them; one that only holds packages
        # (nbtrain/display: picker/) has them below
        tests = list(folder.glob("test_*.py")) if own else list(folder.rglob("test_*.py"))
        if not tests:
            missing.append(f"nbtrain/{rel}/ has no tests/{rel}/test_*.py")
        elif not (folder / "__init__.py").is_file():
            missing.append(
                f"tests/{rel}/ has no __init__.py (the tests are packages, tests/__init__.py)"
            )
    assert not missing, "\n".join(missing)


def test_no_tests_folder_mirrors_a_package_that_is_gone():
    packages = set(_packages())
    stale = [f"tests/{rel}/ (no nbtrain/{rel}/)" for rel in _test_folders() if rel not in packages]
    assert not stale, "tests/ folders that mirror no package:\n" + "\n".join(stale)


def test_the_rule_catches_a_missing_and_a_stale_folder(tmp_path, monkeypatch):
    """The two checks above can fail: a package without tests and a test folder without a package."""
    import pytest

    (tmp_path / "nbtrain" / "a").mkdir(parents=True)
    (tmp_path / "nbtrain" / "__init__.py").write_text("")
    (tmp_path / "nbtrain" / "a" / "__init__.py").write_text("")
    (tmp_path / "nbtrain" / "a" / "m.py").write_text("")
    (tmp_path / "tests" / "gone").mkdir(parents=True)
    (tmp_path / "tests" / "gone" / "test_x.py").write_text("")
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "PKG", tmp_path / "nbtrain")
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "TESTS", tmp_path / "tests")
    with pytest.raises(AssertionError, match=r"nbtrain/a/ has no tests/a/test_\*\.py"):
        test_every_package_has_its_tests_in_the_same_path()
    with pytest.raises(AssertionError, match=r"tests/gone/ \(no nbtrain/gone/\)"):
        test_no_tests_folder_mirrors_a_package_that_is_gone()


def test_every_test_path_named_outside_tests_exists():
    """Makefile's lanes, labextension/run-tests.sh and the docs name test files that exist."""
    named = re.compile(r"\btests/[\w/.*-]*?\.py\b")
    gone = []
    for name in NAMERS:
        path = ROOT / name
        if not path.is_file():
            continue
        for ref in sorted(set(named.findall(path.read_text()))):
            if not list(ROOT.glob(ref)):
                gone.append(f"{name}: {ref}")
    assert not gone, "test files named but not there:\n" + "\n".join(gone)
