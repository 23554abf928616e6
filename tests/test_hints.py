"""Every code hint nbtrain prints runs: each call in a message (`finetune(SFTConfig(..., resume='latest'))`,
`cluster.restart()`, `nbtrain.start(n=2)`) compiles and binds to the real signature, and each
`%nbtrain SUBCOMMAND --flag` names a subcommand and flags that exist.

The hints are collected from the string literals of every nbtrain module (docstrings aside: those are
checked by the docs build and the doctest-like examples) and from the inline code of the docs.
`...` in a hint stands for the user's own arguments: it may stand anywhere, and only the names given
with it are checked.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import nbtrain
from nbtrain.cluster.facade import Cluster
from nbtrain.magics.cluster import NbtrainMagics, parser

ROOT = Path(__file__).resolve().parent.parent
# a call a user is told to type: nbtrain's public functions, SFTConfig, and the Cluster's methods
CALL = re.compile(
    r"(?<![\w.])(?P<name>(?:nbtrain\.)?(?:finetune|SFTConfig|start|connect|check|attach)"
    r"|cluster\.[a-z_]+)\("
)
MAGIC = re.compile(r"%nbtrain (?P<rest>[a-z][^\n`'\"]*)")
CELL_MAGIC = re.compile(r"%%distributed (?P<rest>--[^\n`'\"]*)")


def _strings(path: Path) -> list[str]:
    """The string literals of a module, docstrings left out; f-strings by their literal parts."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.append(node.value)
    return out


def _balanced(text: str, start: int) -> str | None:
    """The call that opens at `text[start:]`, up to its closing parenthesis."""
    depth = 0
    for i in range(text.index("(", start), len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    return None  # cut off (the rest is in an f-string's expression): not a whole hint


def _sources() -> list[tuple[str, str]]:
    found = [
        (str(p.relative_to(ROOT)), s)
        for p in sorted((ROOT / "nbtrain").rglob("*.py"))
        for s in _strings(p)
    ]
    for md in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        found.extend(
            (str(md.relative_to(ROOT)), c) for c in re.findall(r"`([^`\n]+)`", md.read_text())
        )
    return found


def _hints(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    out = []
    for where, text in _sources():
        for m in pattern.finditer(text):
            hint = _balanced(text, m.start()) if pattern is CALL else m["rest"]
            if hint and (where, hint) not in out:
                out.append((where, hint))
    return out


def _target(call: ast.Call):
    """The callable a hint's call names, or None for calls inside it that are not nbtrain's."""
    name = ast.unparse(call.func)
    if name.startswith("cluster."):
        return getattr(Cluster, name.split(".", 1)[1], "missing")
    name = name.removeprefix("nbtrain.")
    if name in ("finetune", "SFTConfig", "start", "connect", "check", "attach"):
        return getattr(nbtrain, name, "missing")
    return None


def _check_call(call: ast.Call) -> None:
    fn = _target(call)
    if fn is None:
        return
    assert fn != "missing", f"{ast.unparse(call.func)} does not exist"
    sig = inspect.signature(fn)
    params = sig.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for kw in call.keywords:
        if kw.arg is not None:
            assert kw.arg in params or takes_kwargs, f"{ast.unparse(call.func)} has no {kw.arg}="
    given = [*call.args, *(kw.value for kw in call.keywords)]
    if any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in given):
        return  # `...` stands for the user's own arguments: their number is theirs
    args = [None] * len(call.args)
    kwargs = {kw.arg: None for kw in call.keywords if kw.arg is not None}
    if name := getattr(fn, "__qualname__", ""):
        if "." in name and inspect.isfunction(fn):  # a method: bind `self` too
            args.insert(0, None)
    sig.bind(*args, **kwargs)


CALLS = _hints(CALL)


def test_hints_were_found():
    # the restart hint and a few more: a pattern that matched nothing would pass everything
    texts = [h for _, h in CALLS]
    assert "finetune(SFTConfig(..., resume='latest'))" in texts
    assert any(h.startswith("cluster.restart(") for h in texts)
    assert len(CALLS) >= 10, CALLS


@pytest.mark.parametrize("where, hint", CALLS, ids=[f"{w}:{h}" for w, h in CALLS])
def test_every_call_hint_compiles_and_binds(where, hint):
    if re.search(r"\(\w+: \w", hint):
        return  # a signature in prose (architecture.md's launcher contract), not a call
    # `f(a=1, ...)`: the user's further keywords; Python wants them before, so read them as absent
    hint = re.sub(r",\s*\.\.\.(?=\s*\))", "", hint)
    try:
        tree = ast.parse(hint, mode="eval")
    except SyntaxError as e:
        pytest.fail(f"{where}: hint {hint!r} does not compile: {e}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            try:
                _check_call(node)
            except (AssertionError, TypeError) as e:
                pytest.fail(f"{where}: hint {hint!r} would fail: {e}")


def test_the_old_restart_hint_is_caught():
    # what the fault messages said before: finetune takes no resume=
    with pytest.raises(AssertionError, match="has no resume="):
        _check_call(ast.parse("finetune(..., resume='latest')", mode="eval").body)


def _subparsers():
    return next(a for a in parser()._actions if a.dest == "command").choices


MAGICS = _hints(MAGIC)


@pytest.mark.parametrize("where, rest", MAGICS, ids=[f"{w}:%nbtrain {r}" for w, r in MAGICS])
def test_every_magic_hint_names_a_subcommand_and_its_flags(where, rest):
    words = _command_words(rest)
    sub = _subparsers().get(words[0])
    if sub is None:
        if words[0] in ("is", "and", "or", "in", "to", "the", "with"):
            return  # prose about the magic ("%nbtrain is ..."), not a command
        pytest.fail(f"{where}: %nbtrain {words[0]} is no subcommand ({', '.join(_subparsers())})")
    for word in words[1:]:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in sub._option_string_actions, f"{where}: %nbtrain {words[0]} has no {flag}"


def _command_words(rest: str) -> list[str]:
    """The words of a command in prose, up to its end: a comment, a ';', or a word closing a
    sentence or parenthesis ("run %nbtrain restart (cluster.restart())." ends at restart)."""
    out = []
    for word in rest.split():
        if word.startswith(("#", "%")):
            break
        bare = word.rstrip(".,;:)")
        if bare:
            out.append(bare)
        if bare != word:
            break
    return out or [""]


def test_every_cell_magic_hint_names_its_flags():
    options = NbtrainMagics.distributed.parser._option_string_actions
    for where, rest in _hints(CELL_MAGIC):
        for word in _command_words(rest):
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag != "--help":  # --help: answered before parsing
                assert flag in options, f"{where}: %%distributed has no {flag}"
