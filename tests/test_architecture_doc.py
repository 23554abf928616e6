"""docs/architecture.md and its picture are true of the code: the picture is what
scripts/draw_architecture.py draws from the contracts and the files now, the page names every module
of nbtrain/ (and no module that is gone), and each "one place" claim holds when grepped."""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbtrain"
DOC = ROOT / "docs" / "architecture.md"
CLAIMS_HEADING = "## One place for each risky thing"


@functools.cache
def _draw() -> str:
    spec = importlib.util.spec_from_file_location(
        "draw_architecture", ROOT / "scripts" / "draw_architecture.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.draw())


def test_the_picture_is_drawn_from_the_code_as_it_is() -> None:
    committed = (ROOT / "docs" / "images" / "architecture.svg").read_text()
    assert committed == _draw(), (
        "docs/images/architecture.svg is stale: run python scripts/draw_architecture.py"
    )


def test_the_picture_shows_every_place() -> None:
    svg = _draw()
    for shown in [
        "tinker/kernel/",
        "tinker/ranks/",
        "compare/",
        "plots/",
        "the vLLM process",
        "the Jupyter server",
        "engine/",
        "the browser",
    ]:
        assert shown in svg, shown


def _sections(text: str) -> list[tuple[str, str]]:
    """(package folder, text) per section of the page: the folder a heading names in backticks
    (`nbtrain/x/`), else the enclosing heading's; paths in a section may be relative to it."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[int, str]] = []
    for part in re.split(r"(?m)^(?=#{1,4} )", text):
        m = re.match(r"(#{1,4}) (.*)", part)
        level = len(m[1]) if m else 0
        named = re.search(r"`(nbtrain/[\w/]*/)`", m[2]) if m else None
        stack = [(lv, pkg) for lv, pkg in stack if lv < level]
        pkg = named[1] if named else (stack[-1][1] if stack else "")
        stack.append((level, pkg))
        out.append((pkg, part))
    return out


def _tokens(text: str) -> set[str]:
    """What the page names in backticks, a span split at spaces and commas (`a.py: f`, `x, y`)."""
    return {
        t.strip(":;.()")
        for span in re.findall(r"`([^`\n]+)`", text)
        for t in re.split(r"[\s,]+", span)
        if t.strip(":;.()")
    }


def test_the_page_names_every_module() -> None:
    """Every nbtrain/**/*.py but an __init__ is named: by its path (from the root, or from nbtrain/),
    or in its package's section by its path from that package."""
    sections = [(pkg, _tokens(part)) for pkg, part in _sections(DOC.read_text())]
    everywhere = set().union(*(t for _, t in sections))
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT).as_posix()
        names = {rel, rel.removeprefix("nbtrain/")}
        if names & everywhere:
            continue
        if not any(
            rel.startswith(pkg) and rel.removeprefix(pkg) in tokens
            for pkg, tokens in sections
            if pkg
        ):
            unnamed.append(rel)
    assert not unnamed, (
        "docs/architecture.md names no such module (add it to its package's table):\n"
        + "\n".join(unnamed)
    )


def test_the_page_names_no_module_that_is_gone() -> None:
    """A `.py` the page names is a file: from its section's package, nbtrain/ or the root (a bare
    name: some module under the section's package)."""
    gone = []
    for pkg, part in _sections(DOC.read_text()):
        base = ROOT / (pkg or "nbtrain/")
        for token in sorted(_tokens(part)):
            if not token.endswith(".py") or "<" in token:
                continue
            if "/" not in token:
                found = any(base.rglob(token))
            else:
                found = any((where / token).is_file() for where in (base, PACKAGE, ROOT))
            if not found:
                gone.append(f"{token} (section of {pkg or 'the page'})")
    assert not gone, "docs/architecture.md names modules that do not exist:\n" + "\n".join(gone)


def _claims() -> list[tuple[str, list[str], list[str]]]:
    """(line, modules, patterns) of each claim: a list item naming modules (`nbtrain/x.py`) and,
    in its last parentheses, the patterns that occur in those modules only."""
    text = DOC.read_text().split(CLAIMS_HEADING, 1)[1]
    text = re.split(r"(?m)^## ", text, maxsplit=1)[0]
    claims = []
    for line in text.splitlines():
        if not line.startswith("- "):
            continue
        last = re.search(r"\((`.*`)\)\s*$", line)  # the patterns, (`a`, `b()`), end the line
        assert last, f"a claim ends with its patterns in parentheses: {line}"
        modules = re.findall(r"`([^`]+\.py)`", line[: last.start()])
        patterns = re.findall(r"`([^`]+)`", last[1])
        assert modules and patterns, (
            f"a claim names modules, then its patterns in parentheses: {line}"
        )
        claims.append((line, modules, patterns))
    return claims


@functools.cache
def _code_and_strings(path: Path) -> tuple[str, set[str]]:
    """A module's code with its comments and strings blanked, and the values of its string
    literals (docstrings aside)."""
    src = path.read_text()
    lines = [list(line) for line in src.splitlines(keepends=True)]
    strings: set[str] = set()
    docs = {
        node.body[0].value.lineno
        for node in ast.walk(ast.parse(src))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        if tok.type == tokenize.STRING and tok.start[0] not in docs:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                value = None
            if isinstance(value, str):
                strings.add(value)
        (sr, sc), (er, ec) = tok.start, tok.end
        for r in range(sr, er + 1):
            row = lines[r - 1]
            for c in range(sc if r == sr else 0, ec if r == er else len(row)):
                if row[c] != "\n":
                    row[c] = " "
    return "".join("".join(row) for row in lines), strings


def _occurs(pattern: str, code: str, strings: set[str]) -> bool:
    if pattern[0] == pattern[-1] == '"':
        return pattern[1:-1] in strings
    regex = re.escape(pattern)
    if pattern[0].isalnum() or pattern[0] == "_":
        regex = r"(?<![\w])" + regex
    if pattern[-1].isalnum() or pattern[-1] == "_":
        regex += r"(?![\w])"
    return re.search(regex, code) is not None


def test_the_claims_are_read() -> None:
    assert len(_claims()) >= 5


@pytest.mark.parametrize("claim", _claims(), ids=lambda c: c[1][0])
def test_each_one_place_claim_holds(claim: tuple[str, list[str], list[str]]) -> None:
    line, modules, patterns = claim
    for m in modules:
        assert (ROOT / m).is_file(), f"{m} does not exist: {line}"
    where: dict[str, set[str]] = {p: set() for p in patterns}
    for path in sorted(PACKAGE.rglob("*.py")):
        code, strings = _code_and_strings(path)
        for p in patterns:
            if _occurs(p, code, strings):
                where[p].add(path.relative_to(ROOT).as_posix())
    elsewhere = {
        p: sorted(found - set(modules)) for p, found in where.items() if found - set(modules)
    }
    assert not elsewhere, f"not the one place: {line}\nalso in: {elsewhere}"
    idle = [m for m in modules if not any(m in found for found in where.values())]
    assert not idle, f"named, but no pattern occurs there: {idle} ({line})"
