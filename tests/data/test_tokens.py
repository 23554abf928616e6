"""The data path for real sizes (nbtrain/data/sources.py, nbtrain/data/tokens.py): rows read a part at a
time, tokenized once across the ranks, cached on disk and read back memory-mapped.

The distributed cases run `tokens.prepare` on real processes with a gloo group (no model: the data
phase alone), and compare with the in-memory tokenization the rest of the suite checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nbtrain.data import tokens
from nbtrain.data.loader import ShardedBatches
from nbtrain.data.rows import encode_row, load_rows
from nbtrain.data.sources import Source
from nbtrain.engine.dist import Dist
from nbtrain.errors import ConfigError
from tests.recipes.test_distributed import _free_port

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "nbtrain" / "data" / "examples" / "instructions.jsonl"


@pytest.fixture(scope="module")
def tok(tiny):
    from nbtrain.model.pretrained import load_tokenizer

    return load_tokenizer(tiny)


def _rows(n=None):
    rows = [json.loads(x) for x in DATA.read_text().splitlines() if x.strip()]
    return rows[:n] if n else rows


def _prepare(src, tok, setting):
    return tokens.prepare(Source(src, "data"), tok, Dist(), setting)


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


# ------------------------------------------------------------------------------------- reading parts
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_jsonl_parts_are_every_row_once_in_order_with_their_lines(tmp_path, parts):
    rows = _rows(40)
    lines = []
    for i, r in enumerate(rows):
        if i % 9 == 4:
            lines.append("")  # blank lines: a row's line is not its index
        lines.append(json.dumps(r))
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    src = Source(p)
    got = [r for k in range(parts) for r in src.part(k, parts)]
    assert [r.value for r in got] == rows
    text_lines = p.read_text().splitlines()
    for r in got:
        assert json.loads(text_lines[src.line(r) - 1]) == r.value


def test_parquet_parts_read_only_their_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(95)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=10)
    src = Source(tmp_path / "d.parquet")
    for parts in (1, 2, 4):
        assert [r.value for k in range(parts) for r in src.part(k, parts)] == rows


def test_memory_sources_split_too():
    import pandas as pd

    rows = _rows(11)
    for data in (rows, pd.DataFrame(rows)):
        src = Source(data)
        assert [r.value for k in range(3) for r in src.part(k, 3)] == rows


def test_a_bad_row_names_its_file_line_not_its_index(tmp_path):
    rows = _rows(30)
    rows[25] = {"question": "q", "answer": "a"}
    p = tmp_path / "d.jsonl"
    p.write_text("\n\n" + "\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(
        ConfigError, match=r"d.jsonl' line 28 row 25 is in none of the known formats"
    ):
        load_rows(p)


# --------------------------------------------------------------------------------------- the cache
def test_the_store_holds_what_encode_row_makes(tmp_path, tok):
    rows = _rows()
    store = _prepare(str(DATA), tok, str(tmp_path / "cache"))
    assert len(store) == len(rows)
    for i in (0, 1, len(rows) // 2, len(rows) - 1):
        assert store.example(i) == encode_row(rows[i], tok, None)
        assert store.example(i, 16, "left") == encode_row(rows[i], tok, 16, "left")
    # memory-mapped: the tokens stay on disk, not in this process's heap
    assert isinstance(store.parts[0].ids, np.memmap)
    (folder,) = _folders(tmp_path / "cache")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["rows"] == len(rows) and meta["tokens"] == store.n_tokens
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size / store.n_tokens < 12  # the goal: at most 12 bytes a token


def test_a_second_run_reads_the_cache_without_tokenizing(tmp_path, tok, monkeypatch, capsys):
    first = _prepare(str(DATA), tok, str(tmp_path / "c"))
    capsys.readouterr()

    def refuse(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tokens, "encode_batch", refuse)
    again = _prepare(str(DATA), tok, str(tmp_path / "c"))
    out = capsys.readouterr().out
    assert f"from the cache at {tmp_path / 'c'}" in out
    assert [again.example(i) for i in range(len(again))] == [
        first.example(i) for i in range(len(first))
    ]


def test_what_changes_tokens_changes_the_cache(tmp_path, tok):
    import copy

    root = tmp_path / "c"
    _prepare(str(DATA), tok, str(root))
    other = tmp_path / "d.jsonl"
    other.write_text(DATA.read_text().replace("a", "b", 1))
    _prepare(str(other), tok, str(root))
    templated = copy.deepcopy(tok)
    templated.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    _prepare(str(DATA), templated, str(root))
    tokens.prepare(Source(str(DATA), "data"), tok, Dist(), str(root), {"enable_thinking": False})
    assert len(_folders(root)) == 4


def test_a_warm_start_reads_no_data_file_until_it_changes(tmp_path, tok, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text(DATA.read_text())
    _prepare(str(data), tok, str(tmp_path / "c"))
    reads = []
    real = Source.fingerprint

    def counted(self, memo=None):
        if memo is None:
            reads.append(self.path)
        return real(self, memo)

    monkeypatch.setattr(Source, "fingerprint", counted)
    _prepare(str(data), tok, str(tmp_path / "c"))
    assert reads == []  # the digest came from sources.json
    with data.open("a") as f:
        f.write(json.dumps({"text": "one more row"}) + "\n")
    store = _prepare(str(data), tok, str(tmp_path / "c"))
    assert reads == [data.resolve()] and len(store) == len(_rows()) + 1
    assert len(_folders(tmp_path / "c")) == 2


def test_an_incomplete_or_foreign_cache_is_never_read(tmp_path, tok, monkeypatch):
    root = tmp_path / "c"
    store = _prepare(str(DATA), tok, str(root))
    (folder,) = _folders(root)
    calls = []
    real = tokens.encode_batch
    monkeypatch.setattr(tokens, "encode_batch", lambda *a: calls.append(1) or real(*a))
    # a part cut short (a full disk, a killed writer): its size does not match meta.json
    ids = next(folder.glob("*.ids"))
    ids.write_bytes(ids.read_bytes()[:-4])
    again = _prepare(str(DATA), tok, str(root))
    assert calls and len(again) == len(store)
    # written by another nbtrain version
    meta = json.loads((folder / "meta.json").read_text())
    meta["nbtrain"] = "0.0.0-other"
    (folder / "meta.json").write_text(json.dumps(meta))
    calls.clear()
    _prepare(str(DATA), tok, str(root))
    assert calls
    # meta.json is written last: without it there is no cache
    (folder / "meta.json").unlink()
    calls.clear()
    _prepare(str(DATA), tok, str(root))
    assert calls


def test_off_keeps_nothing_and_the_environment_moves_it(tmp_path, tok, monkeypatch):
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("nbtrain-tokens-*"))
    store = _prepare(str(DATA), tok, "off")
    assert store.example(3) == encode_row(_rows()[3], tok, None)
    assert set(Path(tempfile.gettempdir()).glob("nbtrain-tokens-*")) == before
    monkeypatch.setenv("NBTRAIN_DATA_CACHE", str(tmp_path / "env"))
    _prepare(str(DATA), tok, "auto")
    assert len(_folders(tmp_path / "env")) == 1
    monkeypatch.setenv("NBTRAIN_DATA_CACHE", "off")
    assert tokens.cache_root("auto") is None


def test_sharded_batches_from_the_cache_equal_those_from_rows(tmp_path, tok):
    rows = _rows()
    store = _prepare(str(DATA), tok, str(tmp_path / "c"))
    kw = dict(max_length=24, batch_size=2, grad_accum=2, seed=5, rank=1, world_size=2)
    for packing in (False, True):
        a = ShardedBatches(rows, tok, packing=packing, **kw)
        b = ShardedBatches(None, tok, store=store, packing=packing, **kw)
        assert (a.kept, a.n_units, a.steps_per_epoch) == (b.kept, b.n_units, b.steps_per_epoch)
        for step in range(a.steps_per_epoch + 1):
            assert a.micro_batch(step, 1) == b.micro_batch(step, 1)


# ------------------------------------------------------------------------------- on several ranks
WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from nbtrain.errors import ConfigError
    from nbtrain.data import tokens
    from nbtrain.engine.dist import Dist
    from nbtrain.model.pretrained import load_tokenizer
    from nbtrain.data.sources import Source
    model, data, setting, out = sys.argv[1:5]
    # a progress line after every batch of 50 rows, so a small data set shows what a big one does
    tokens.EVERY, tokens.CHUNK = 0.0, 50
    if os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "2":
        # on a loaded machine rank 0 can end its part before rank 1 has published a count: its lines
        # wait (60 s at most) for rank 1's first, so that they show whether both ranks are counted
        import time
        update = tokens._Progress.update
        def waiting(self, rows, fraction):
            if self.store is not None:
                t = time.time()
                while not self.store.check([self._key(1)]) and time.time() - t < 60:
                    time.sleep(0.05)
            update(self, rows, fraction)
        tokens._Progress.update = waiting
    tok = load_tokenizer(model)
    calls = []
    real = tokens.encode_batch
    tokens.encode_batch = lambda rows, *a: calls.append(len(rows)) or real(rows, *a)
    try:
        store = tokens.prepare(Source(data, "data"), tok, Dist(), setting)
        res = {"rows": len(store), "tokens": store.n_tokens, "tokenized": sum(calls),
               "first": store.example(0).input_ids, "location": store.location}
    except ConfigError as e:
        res = {"error": str(e), "tokenized": sum(calls)}
    dist.barrier()  # rank 0 holds the group's store: no rank may leave while another still uses it
    dist.destroy_process_group()
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump(res, f)
    # leave without the interpreter's teardown: there torch's C++ threads once aborted rank 0
    # ("terminate called without an active exception", exit -6) after all of the above had run
    sys.stdout.flush()
    os._exit(0)
    """
)


def _run(tmp: Path, world: int, model: str, data, setting, env_of=None) -> list[dict]:
    script = tmp / "prepare_worker.py"
    script.write_text(WORKER)
    out = tmp / f"res-{os.urandom(3).hex()}"
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            **((env_of or {}).get(rank, {})),
        }
        cmd = [sys.executable, str(script), model, str(data), setting, str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, o) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{o[-3000:]}"
    return [json.loads(Path(f"{out}.{r}").read_text()) | {"out": outs[r]} for r in range(world)]


def test_two_ranks_split_the_rows_and_write_one_cache(tmp_path, tiny, tok):
    rows = _rows()
    res = _run(tmp_path, 2, tiny, DATA, str(tmp_path / "c"))
    # each rank tokenized about half, and both read the whole data set back
    assert sum(r["tokenized"] for r in res) == len(rows)
    assert all(0 < r["tokenized"] < len(rows) for r in res)
    assert all(r["rows"] == len(rows) for r in res)
    assert res[0]["first"] == res[1]["first"] == encode_row(rows[0], tok, None).input_ids
    (folder,) = _folders(tmp_path / "c")
    meta = json.loads((folder / "meta.json").read_text())
    assert [p["rows"] for p in meta["parts"]] == [r["tokenized"] for r in res]
    assert "checking and tokenizing data file" in res[0]["out"] and "cached at" in res[0]["out"]
    # rank 0's progress counts the rows of both ranks (their counts meet in the group's store)
    counts = [
        int(line.split(": ")[2].split(" rows")[0].replace(",", ""))
        for line in res[0]["out"].splitlines()
        if line.startswith("nbtrain: tokenizing data: ")
    ]
    assert counts and max(counts) > res[0]["tokenized"], res[0]["out"]
    assert "rows/s" in res[0]["out"] and not any(
        line.startswith("nbtrain: tokenizing data: ") for line in res[1]["out"].splitlines()
    )
    # a second run on three ranks (another world size) reads it without tokenizing
    again = _run(tmp_path, 3, tiny, DATA, str(tmp_path / "c"))
    assert [r["tokenized"] for r in again] == [0, 0, 0]
    assert "from the cache at" in again[0]["out"]


def test_ranks_without_a_shared_file_system_each_build_what_they_need(tmp_path, tiny):
    # each rank's cache folder is its own, as on nodes with local disks: every rank builds alone
    env = {r: {"NBTRAIN_DATA_CACHE": str(tmp_path / f"node{r}")} for r in range(2)}
    res = _run(tmp_path, 2, tiny, DATA, "auto", env)
    n = len(_rows())
    assert [r["tokenized"] for r in res] == [n, n]
    for r in range(2):
        (folder,) = _folders(tmp_path / f"node{r}")
        assert json.loads((folder / "meta.json").read_text())["rows"] == n


def test_bad_rows_on_every_rank_are_reported_together_and_nothing_is_cached(tmp_path, tiny):
    rows = _rows()
    n = len(rows)
    bad = [3, n // 2 + 5] + list(range(n - 25, n))  # on both ranks' parts: 27 in all
    for i in bad:
        rows[i] = {"messages": [{"role": "user", "content": "no answer"}]}
    p = tmp_path / "bad.jsonl"
    p.write_text("\n" + "\n".join(json.dumps(r) for r in rows) + "\n")  # line = index + 2
    res = _run(tmp_path, 2, tiny, p, str(tmp_path / "c"))
    err = res[0]["error"]
    assert err == res[1]["error"]
    assert f"27 of {n} rows are refused" in err
    assert "bad.jsonl' line 5 row 3:" in err and f"line {n // 2 + 7} row {n // 2 + 5}:" in err
    assert "... and 7 more" in err  # the first 20 are shown
    assert len([x for x in err.splitlines() if " row " in x]) == 20
    assert not any((tmp_path / "c").glob("*/meta.json"))
    assert not _folders(tmp_path / "c")  # the unfinished folder is gone too


def test_lines_that_are_not_json_are_reported_with_the_other_bad_rows(tmp_path, tiny):
    """A line that is not JSON does not stop the check: every rank goes on, and the message lists it
    (file, line, the parser's words) among the other bad rows, the later ones included."""
    rows = _rows()
    n = len(rows)
    lines = [json.dumps(r) for r in rows]
    lines[2] = '{"text": oops}'  # in rank 0's part
    lines[n // 2 + 4] = '{"prompt": "a" "completion": "b"}'  # in rank 1's
    lines[n - 3] = json.dumps({"question": "q", "answer": "a"})  # a bad row after both
    lines[n - 1] = '{"text": "no end'  # the last line, without a newline: an unterminated string
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines))
    res = _run(tmp_path, 2, tiny, p, str(tmp_path / "c"))
    err = res[0]["error"]
    assert err == res[1]["error"]
    assert err.splitlines() == [
        f"data file {str(p)!r}: 4 of {n} rows are refused, nothing was trained or cached; fix or "
        "remove them:",
        f"data file {str(p)!r} line 3 is not valid JSON (Expecting value at column 10); fix or "
        "remove that line",
        f"data file {str(p)!r} line {n // 2 + 5} is not valid JSON (Expecting ',' delimiter at "
        "column 16); fix or remove that line",
        f"data file {str(p)!r} line {n - 2} row {n - 3} is in none of the known formats: keys "
        "found 'question', 'answer'; each row needs 'prompt' + 'completion', 'messages' (a list "
        "of {'role', 'content'}), or 'text'",
        f"data file {str(p)!r} line {n} is not valid JSON (Unterminated string starting at "
        "column 10); fix or remove that line",
    ]
    assert not _folders(tmp_path / "c")


def test_rows_all_refused_alike_are_told_in_one_line(tmp_path, tiny):
    """A CSV whose columns are named otherwise: one line naming its keys and what SFT rows need, on
    every rank, instead of 20 identical lines and a count."""
    import pandas as pd

    p = tmp_path / "wrong.csv"
    pd.DataFrame({"input": [f"q{i}" for i in range(40)], "output": ["a"] * 40}).to_csv(
        p, index=False
    )
    res = _run(tmp_path, 2, tiny, p, str(tmp_path / "c"))
    assert (
        res[0]["error"]
        == res[1]["error"]
        == (
            f"data file {str(p)!r}: all 40 rows have keys 'input', 'output'; SFT rows need 'prompt' + "
            "'completion', 'messages' (a list of {'role', 'content'}), or 'text'; nothing was trained "
            "or cached"
        )
    )
    # one bad row among good ones is still named where it is
    q = tmp_path / "one.jsonl"
    q.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"input": "q"}) + "\n")
    res = _run(tmp_path, 2, tiny, q, str(tmp_path / "c"))
    assert f"{str(q)!r} line 2 row 1 is in none of the known formats" in res[0]["error"]
