"""The docs cannot drift from the code: their snippets run, their reference tables match the code.

A fenced Python snippet in `README.md` or `docs/*.md` runs here when the line before its fence is the
marker comment `<!-- run -->` (invisible on GitHub and in the built site). The runnable snippets of one
page run in order, in one IPython shell with nbtrain loaded (so `%nbtrain` and `%%distributed` work),
in a fresh working directory, sharing one namespace, like the cells of a notebook. Snippets that need
a GPU, Slurm, several machines or the Hub are not marked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MARKER = "<!-- run -->"
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)


# snippets that need Slurm run on the single-machine Slurm test bed (tests/cluster/launch/test_slurm.py), with the
# names of a real cluster (partition, account, shared paths) replaced by the test bed's
SLURM_MARKER = "<!-- run: slurm -->"


def snippets(path: Path, marker: str = MARKER) -> list[tuple[int, str]]:
    """(line number, code) of every snippet of a page marked with `marker`, in order."""
    text = path.read_text(encoding="utf-8")
    found = []
    for m in re.finditer(re.escape(marker), text):
        line = text.count("\n", 0, m.start()) + 1
        fence = FENCE.match(text, m.end() + 1)
        if fence is None or fence.group("info").strip() != "python":
            msg = f"{path.name}:{line}: {marker} must be followed on the next line by a ```python fence"
            raise AssertionError(msg)
        found.append((line + 1, fence.group("code")))
    return found


# what the pages say their snippets print, checked (the rest of the output is free to change)
EXPECT = {
    "fine-tuning.md": ["[5, 10, 15, 20, 25, 30]", "TrainResult(state='done', global_step=20"],
    "magics.md": ["rank 0 of 2 on cpu: sum 1.0", "[0, 10]", "[10]", "cluster stopped"],
    "groups.md": [
        "[rank 2] rollout 5.0",
        "[rank 3] 3 is 1 of 2 in rollout: 2.0",
        "cluster stopped",
    ],
    "own-loop.md": ["world size 2, 6 steps", "final loss", "cluster stopped"],
    "install.md": ["0.1.0"],
    "tracking.md": ["FINISHED 0.005", "[2, 4, 6, 8, 10]\n[2, 4, 6, 8, 10]"],
    # the diff holds the one setting the two runs differ in
    "compare.md": ["learning_rate    0.001     0.01\n         learning_rate"],
    "README.md": ["tensor([1.])", "cluster stopped"],
    # the disaggregated GRPO snippet ran its 5 steps on the two groups
    "rl.md": ["TrainResult(state='done', global_step=5", "cluster stopped"],
}

RUNNABLE = [p for p in [ROOT / "README.md", *PAGES] if MARKER in p.read_text(encoding="utf-8")]


def test_markers_mark_python_fences():
    for page in [ROOT / "README.md", *PAGES]:
        snippets(page)  # raises on a marker that marks nothing
        snippets(page, SLURM_MARKER)
    # the Slurm recipe: start, train, stop (run by tests/cluster/launch/test_slurm.py on the Slurm test bed)
    assert len(snippets(DOCS / "multinode.md", SLURM_MARKER)) == 3


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_snippets_run(ip, page, tmp_path, monkeypatch, capsys):
    from nbtrain.cluster.facade import current_cluster

    monkeypatch.chdir(tmp_path)
    # IPython's test shell has no `kernel`; ipyparallel's client asks for one when an engine sends
    # a widget message (a progress bar), and without it the client's iopub stream dies and every later
    # cell output is lost. A notebook kernel's `kernel` is never missing.
    monkeypatch.setattr(ip, "kernel", None, raising=False)
    before = set(ip.user_ns)
    try:
        for line, code in snippets(page):
            result = ip.run_cell(code, store_history=False)
            if not result.success:
                out = capsys.readouterr()
                err = result.error_before_exec or result.error_in_exec
                msg = (
                    f"{page.name}:{line}: the snippet failed: {type(err).__name__}: {err}\n"
                    f"--- its code ---\n{code}--- output ---\n{out.out[-3000:]}{out.err[-3000:]}"
                )
                raise AssertionError(msg)
        out = capsys.readouterr()
        if os.environ.get("NBTRAIN_DOCS_SHOW"):
            # NBTRAIN_DOCS_SHOW=1 pytest -s tests/test_docs.py: see what the snippets printed
            with capsys.disabled():
                print(f"\n--- {page.name} ---\n{out.out}{out.err}")
        missing = [e for e in EXPECT.get(page.name, ()) if e not in out.out]
        assert not missing, (
            f"{page.name}: the snippets did not print {missing}; they printed:\n{out.out}"
        )
        left = current_cluster()
        assert left is None, f"{page.name} left a cluster running; end the page with %nbtrain stop"
    finally:
        cluster = current_cluster()
        if cluster is not None:
            cluster.stop()
        for name in set(ip.user_ns) - before:
            del ip.user_ns[name]


# ----------------------------------------------------------------------------- generated tables
def test_sftconfig_table_is_current():
    from nbtrain.configs import doc as config_doc

    page = DOCS / "fine-tuning.md"
    text = page.read_text(encoding="utf-8")
    assert text == config_doc.render(text), (
        f"the SFTConfig table in {page.relative_to(ROOT)} differs from the dataclass; regenerate it "
        f"with: {config_doc.COMMAND}"
    )


def test_sftconfig_table_lists_every_field():
    # the generator itself: one row per field, with its default and help, in declaration order
    from dataclasses import fields

    from nbtrain.configs.doc import table
    from nbtrain.configs.sft import SFTConfig

    rows = table().splitlines()[2:]
    names = [re.match(r"\| `(\w+)` \|", r).group(1) for r in rows]
    assert names == [f.name for f in fields(SFTConfig)]
    lr = next(r for r in rows if r.startswith("| `learning_rate` |"))
    assert "`0.0002`" in lr and "Peak AdamW learning rate." in lr


def test_config_doc_regenerates_a_stale_table(tmp_path):
    from nbtrain.configs import doc as config_doc

    page = tmp_path / "page.md"
    page.write_text(f"intro\n{config_doc.BEGIN}\n| old | table |\n{config_doc.END}\noutro\n")
    assert config_doc.main([str(page), "--check"]) == 1  # stale: says so, changes nothing
    assert "| old | table |" in page.read_text()
    assert config_doc.main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n")
    assert config_doc.table() in text and "| old |" not in text
    assert config_doc.main([str(page), "--check"]) == 0
    page.write_text("no markers here\n")
    with pytest.raises(ValueError, match="markers"):
        config_doc.main([str(page)])


def test_launcher_options_table_is_current():
    from nbtrain.cluster.launch import options_doc

    page = DOCS / "magics.md"
    text = page.read_text(encoding="utf-8")
    assert text == options_doc.TABLE.render(text), (
        f"the launcher options table in {page.relative_to(ROOT)} differs from the launchers' "
        f"declarations; regenerate it with: {options_doc.COMMAND}"
    )


def test_model_matrix_table_is_current():
    from nbtrain.model import matrix

    text = matrix.PAGE.read_text(encoding="utf-8")
    assert text == matrix.TABLE.render(text), (
        f"the model matrix table in docs/models.md differs from the matrix; regenerate it with: "
        f"{matrix.COMMAND}"
    )


def test_history_columns_are_documented():
    # every column finetune can write (report.py's Meter.row) has a row in the history table
    import inspect

    from nbtrain.telemetry import report

    source = inspect.getsource(report.Meter.row)
    written = set(re.findall(r'row\[f?"(\w+)', source)) | set(re.findall(r'"(\w+)": ', source))
    written.discard("peak_memory_gb_rank")
    text = (DOCS / "fine-tuning.md").read_text(encoding="utf-8")
    section = text.split("## The history", 1)[1]
    documented = set(re.findall(r"^\| `(\w+)", section, re.M))
    assert written - documented == set(), (
        f"history columns missing from docs: {written - documented}"
    )
    assert "peak_memory_gb_rank<r>" in section


def test_every_make_target_named_is_in_the_makefile():
    # a reader who types the `make X` a page (or a comment in the repo's own files) names gets that target
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    files = [
        ROOT / "README.md",
        ROOT / ".gitignore",
        *PAGES,
        *sorted((ROOT / "scripts").glob("*.sh")),
    ]
    named = {
        (f.name, t)
        for f in files
        for t in re.findall(r"`make ([a-z][\w-]*)", f.read_text(encoding="utf-8"))
    }
    assert named and {"dev", "test", "demo"} <= targets
    assert {(f, t) for f, t in named if t not in targets} == set()


def test_quickstart_prose_gives_the_demo_losses():
    # the sample output on the page is the demo's (tests/test_cli.py runs it); the prose says the same
    page = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    sample = re.search(
        r"final loss +(\d+\.\d+) \(first logged (\d+\.\d+), \d+ rows, last step (\d+)\)", page
    )
    prose = re.search(r"loss to fall visibly \(from (\d+\.\d+) to (\d+\.\d+) in (\d+) steps", page)
    assert sample and prose
    last, first, steps = sample.groups()
    assert prose.groups() == (f"{float(first):.2f}", f"{float(last):.2f}", steps)


# ----------------------------------------------------------------------------- the magics page
def _subcommands():
    from nbtrain.magics import build_parser

    parser = build_parser()
    return parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]


def _section(text: str, heading: str) -> str:
    """The text under a `## heading` up to the next `## `."""
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end > 0 else len(text)]


def test_every_nbtrain_subcommand_and_option_is_documented():
    text = (DOCS / "magics.md").read_text(encoding="utf-8")
    missing = []
    for name, sub in _subcommands().items():
        heading = f"## `%nbtrain {name}`"
        if heading not in text:
            missing.append(heading)
            continue
        section = _section(text, heading)
        for action in sub._actions:
            for opt in action.option_strings:
                if opt in ("-h", "--help"):
                    continue
                if not re.search(rf"`{re.escape(opt)}[` =\]]", section):
                    missing.append(f"%nbtrain {name} {opt}")
            if not action.option_strings and action.dest != "help":
                if action.dest.upper() not in section:
                    missing.append(f"%nbtrain {name} {action.dest.upper()}")
    assert not missing, f"docs/magics.md lacks: {', '.join(missing)}"


def test_every_distributed_option_is_documented():
    from nbtrain.magics import NbtrainMagics

    text = _section((DOCS / "magics.md").read_text(encoding="utf-8"), "## `%%distributed`")
    parser = NbtrainMagics.distributed.parser
    opts = [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert opts, "no options found: the test would pass vacuously"
    missing = [o for o in opts if f"`{o}" not in text]
    assert not missing, f"docs/magics.md's %%distributed section lacks: {missing}"


def test_python_api_signatures_are_documented():
    import inspect

    import nbtrain
    from nbtrain.cluster.launch import flags

    text = (DOCS / "magics.md").read_text(encoding="utf-8")
    missing = []
    for fn in (nbtrain.start, nbtrain.connect):
        for p in inspect.signature(fn).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                continue
            if not re.search(rf"\b{p.name}=", text):
                missing.append(f"{fn.__name__}({p.name}=...)")
    for name in flags():
        if not re.search(rf"`{name}`|\b{name}=", text):
            missing.append(f"launch option {name}")
    assert not missing, f"docs/magics.md lacks: {', '.join(missing)}"


# ----------------------------------------------------------------------------- site structure
def test_every_page_is_in_the_nav_and_linked_from_index():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in PAGES:
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M), (
            f"{page.name} not in mkdocs.yml nav"
        )
        if page.name != "index.md":
            assert f"]({page.name}" in index, f"docs/index.md does not link {page.name}"
