"""Tokenized training data: made once per cluster, cached on disk, read memory-mapped by every rank.

`prepare(source, tokenizer, d, cache)` is the set-up's data phase:

1. Rank 0 fingerprints the data's content, the tokenizer (its vocabulary, merges, special tokens and
   chat template), the tokenization code and the cache format; the cache folder is named by it.
2. If every rank finds that folder complete, nothing is tokenized.
3. Otherwise the ranks that share a file system (found by each writing a probe file) split the rows
   between them: rank k of K reads part k of K of the source (JSONL by byte range, Parquet by row
   group), tokenizes it in batched fast-tokenizer calls, and streams its tokens to its own part files.
   Nodes without a shared file system each build the whole cache, split among their own ranks.
4. Bad rows (JSONL lines that are not JSON among them) are gathered from every rank and reported
   together (the first 20 and a count; one line when every row is refused alike), and the
   unfinished folder is removed: nothing is cached for a data set that has them.
5. One rank per file system writes `meta.json` last and renames the folder into place, so a reader
   sees a complete cache or none; a cache written by another nbtrain version or format is not read.

The files and the store that reads them: `store.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from nbtrain import atomic
from nbtrain.data import rows as sft_rows
from nbtrain.data import store as files
from nbtrain.data.rows import encode_batch, row_problem
from nbtrain.data.sources import BadLine, Source
from nbtrain.data.store import FORMAT, META, PartWriter, TokenStore, open_cache, part_stem, version
from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "NBTRAIN_DATA_CACHE"
OFF = ("off", "none", "false", "0")
#: the data files' digests by path, size, modification time and inode (a warm start reads no file)
SOURCES = "sources.json"
#: rows tokenized per batch: the tokenizer's call and the file writes work on this many at once
CHUNK = files.CHUNK
#: bad rows named in the message that refuses the data
SHOWN = 20
#: seconds between progress lines
EVERY = 5.0


def default_root() -> Path:
    """$NBTRAIN_HOME/data-cache where nbtrain's home is moved, else ~/.cache/nbtrain/data."""
    home = os.environ.get("NBTRAIN_HOME")
    if home:
        return Path(home).expanduser() / "data-cache"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nbtrain" / "data"


def cache_root(setting: str | None) -> Path | None:
    """Where the cache lives: `setting` ('auto', a folder, or 'off'); 'auto' reads $NBTRAIN_DATA_CACHE,
    else `default_root()`. None: caching is off."""
    value = setting if setting not in (None, "", "auto") else os.environ.get(ENV, "auto")
    if str(value).lower() in OFF:
        return None
    if value in ("", "auto"):
        return default_root()
    return Path(str(value)).expanduser()


# ------------------------------------------------------------------------------------- fingerprints
def _code_digest() -> str:
    """The tokenization code itself: a change to how rows become tokens is a different cache."""
    here = Path(__file__).parent
    h = hashlib.blake2b(digest_size=8)
    for name in ("sources.py", "rows.py", "chat.py", "store.py", "tokens.py", "prefs.py"):
        f = here / name
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Everything of a tokenizer that changes tokens: vocabulary and merges (the fast tokenizer's
    whole definition), special tokens, chat template, and its class."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": getattr(tokenizer, "special_tokens_map", None),
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "add_bos": getattr(tokenizer, "add_bos_token", None),
        "add_eos": getattr(tokenizer, "add_eos_token", None),
    }
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def fingerprint(
    source: Source,
    tokenizer: Any,
    template_kwargs: dict | None = None,
    memo: Path | None = None,
    encoder: Any = None,
) -> str:
    """The cache's name: data content, tokenizer, template arguments, tokenization code (and which
    encoder: SFT rows or preference pairs), format and nbtrain version."""
    h = hashlib.blake2b(digest_size=12)
    for piece in (
        f"format={FORMAT}",
        *([] if encoder is None else [f"encoder={encoder.__name__}"]),
        json.dumps(template_kwargs or {}, sort_keys=True, default=str),
        version(),
        _code_digest(),
        source.fingerprint(memo),
        tokenizer_fingerprint(tokenizer),
    ):
        h.update(piece.encode())
        h.update(b"\0")
    return h.hexdigest()


# -------------------------------------------------------------------------------------------- progress
class _Progress:
    """Rows done on every rank, printed by rank 0 every few seconds with rows/s and the time left.

    Ranks publish their counts in the process group's key-value store (no collective: the ranks' parts
    end at different times); alone, or where the store cannot be had, rank 0 counts its own rows."""

    def __init__(self, d: Any, label: str, run: str) -> None:
        self.d, self.label, self.run = d, label, run
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.store = None
        if d.active:
            try:
                from torch.distributed.distributed_c10d import _get_default_store

                self.store = _get_default_store()
            except Exception:  # an older torch: rank 0 reports its own share
                self.store = None

    def _key(self, rank: int) -> str:
        return f"nbtrain/data/{self.run}/{rank}"

    def update(self, rows: int, fraction: float) -> None:
        now = time.perf_counter()
        if now - self.last < EVERY:
            return
        self.last = now
        if self.store is not None:
            self.store.set(self._key(self.d.rank), f"{rows} {fraction:.6f}")
        if not self.d.is_zero:
            return
        done, fracs = rows, [fraction]
        if self.store is not None:
            done, fracs = 0, []
            for r in range(self.d.world):
                value = "0 0"
                try:
                    if self.store.check([self._key(r)]):
                        value = self.store.get(self._key(r)).decode()
                except Exception:  # a rank that has not published yet counts as not started
                    pass
                count, part_done = value.split()
                done += int(count)
                fracs.append(float(part_done))
        f = sum(fracs) / len(fracs) if fracs else 0.0
        took = now - self.t0
        line = f"nbtrain: {self.label}: {done:,} rows, {done / max(took, 1e-9):,.0f} rows/s"
        if f > 0.01:
            line += f", {100 * f:.0f}% done, about {took * (1 - f) / f:.0f} s left"
        print(line, flush=True)


# ------------------------------------------------------------------------------------------ building
def _tokenize_part(
    source: Source,
    tokenizer: Any,
    k: int,
    parts: int,
    writer: PartWriter,
    progress: _Progress,
    template_kwargs: dict | None,
    encode: Any = encode_batch,
) -> tuple[int, list[tuple[int, Any]], int, set[str]]:
    """Tokenize part k of `parts` into `writer`: (rows read, the first bad rows as (local index, row),
    how many rows are bad, how they are refused: two kinds at most, enough to tell one from many)."""
    bad: list[tuple[int, Any]] = []
    kinds: set[str] = set()
    n_bad = 0
    n = 0
    pending: list[Any] = []

    def refuse(r: Any, kind: str) -> None:
        nonlocal n_bad
        n_bad += 1
        if len(bad) < SHOWN:
            bad.append((r.local, r))
        if len(kinds) < 2:
            kinds.add(kind)

    def flush() -> None:
        results = encode([r.value for r in pending], tokenizer, template_kwargs)
        for r, res in zip(pending, results, strict=True):
            if isinstance(res, ConfigError):
                refuse(
                    r, str(res)
                )  # the encoder's words name no row: the same words, the same fault
            elif not n_bad:  # a data set with a bad row is not cached: stop writing, keep checking
                writer.add(*res)
        pending.clear()

    fraction = 0.0
    for row in source.part(k, parts, bad_lines=True):
        n += 1
        fraction = row.fraction
        if isinstance(row.value, BadLine):  # after the rows before it, so bad rows stay in order
            if pending:
                flush()
            refuse(row, "not JSON")
            continue
        pending.append(row)
        if len(pending) >= CHUNK:
            flush()
            progress.update(n, fraction)
    if pending:
        flush()
    return n, bad, n_bad, kinds


def _describe(
    source: Source,
    tokenizer: Any,
    row: Any,
    index: int,
    template_kwargs: dict | None,
    problem: Any = row_problem,
) -> str:
    if isinstance(row.value, BadLine):
        return f"{source.row_where(row)} is not valid JSON ({row.value.problem}); fix or remove that line"
    return problem(row.value, tokenizer, index, source.row_where(row), template_kwargs)


def prepare(
    source: Source,
    tokenizer: Any,
    d: Any,
    setting: str | None = "auto",
    template_kwargs: dict | None = None,
    encoder: Any = None,
) -> TokenStore:
    """The tokenized rows of `source` on every rank of `d`: from the cache, or made now and cached.

    `template_kwargs` go to the chat template of every row (SFTConfig.chat_template_kwargs).
    `encoder` is the module that turns rows into tokens (its `encode_batch`, `row_problem`,
    `alike` and `ACCEPTED`): None for SFT rows (`nbtrain.data.rows`), `nbtrain.data.prefs` for preference pairs.

    Every step runs on every rank (each phase through `d.agree`, so one rank's failure stops all of
    them instead of leaving the others waiting in a collective)."""
    root = cache_root(setting)
    t0 = time.perf_counter()
    key, run = d.agree(
        lambda: (
            (
                fingerprint(source, tokenizer, template_kwargs, root and root / SOURCES, encoder),
                uuid.uuid4().hex[:12],
            )
            if d.is_zero
            else None
        )
    ) or (None, None)
    key, run = d.broadcast_object((key, run))
    temporary = root is None
    if root is None:  # caching off: a folder of this run's, removed once every rank has it mapped
        root = Path(tempfile.gettempdir()) / f"nbtrain-tokens-{run}"
    final = root / key

    found = open_cache(final)
    if all(d.gather_objects(found is not None)):
        assert found is not None
        if d.is_zero:
            print(
                f"nbtrain: {source.name}: {len(found):,} rows, {found.n_tokens:,} tokens, from the "
                f"cache at {final} (SFTConfig(data_cache=...) or ${ENV} moves it; 'off' turns it off)",
                flush=True,
            )
        return found

    # ---- who builds with whom: the ranks that see each other's probe files share a file system
    work = root / f"{key}.tmp-{run}"

    def probe() -> None:
        work.mkdir(parents=True, exist_ok=True)
        (work / f"probe-{d.rank}").write_text(socket.gethostname())

    d.agree(probe)
    d.barrier()
    seen = d.agree(lambda: sorted(int(p.name.split("-")[1]) for p in work.glob("probe-*")))
    sites = d.gather_objects(tuple(seen))
    site = [r for r in range(d.world) if sites[r] == tuple(seen)]
    k, parts = site.index(d.rank), len(site)
    leader = site[0] == d.rank
    if d.is_zero:
        n_sites = len(set(sites))
        shared = "one file system" if n_sites == 1 else f"{n_sites} file systems, a cache on each"
        print(
            f"nbtrain: {source.name}: checking and tokenizing {source.where} on {d.world} rank(s) "
            f"({shared}); the cache goes to {final}",
            flush=True,
        )

    # ---- each rank's part
    progress = _Progress(d, f"tokenizing {source.name}", run)
    writer = PartWriter(part_stem(work, k))
    bad: list[Any] = []
    kinds: set[str] = set()

    def tokenize() -> tuple[int, int, dict[str, int]]:
        nonlocal bad, kinds
        n, bad, n_bad, kinds = _tokenize_part(
            source,
            tokenizer,
            k,
            parts,
            writer,
            progress,
            template_kwargs,
            encoder.encode_batch if encoder is not None else encode_batch,
        )
        return n, n_bad, writer.close()

    try:
        n, n_bad, counts = d.agree(tokenize)
    except BaseException:
        if leader:
            shutil.rmtree(work, ignore_errors=True)
        raise
    everyone = d.gather_objects((d.rank, n, n_bad, counts))
    mine = [e for e in everyone if e[0] in site]
    before = sum(e[1] for e in mine if site.index(e[0]) < k)
    # each file system's ranks read the whole data between them: count one site's bad rows
    total_bad = sum(e[2] for e in mine)
    if any(e[2] for e in everyone):
        # every rank words its own bad rows with their global index and line, then all raise alike
        module = encoder if encoder is not None else sft_rows
        words = [
            (
                before + local,
                _describe(
                    source, tokenizer, row, before + local, template_kwargs, module.row_problem
                ),
                None if isinstance(row.value, BadLine) else module.alike(row.value),
            )
            for local, row in bad
        ]
        gathered = d.gather_objects((words, sorted(kinds)))
        shown = sorted(w for ws, _ in gathered for w in ws)
        unique = sorted({w[0]: w[1:] for w in shown}.items())[:SHOWN]
        d.barrier()
        if leader:
            shutil.rmtree(work, ignore_errors=True)
        n_rows = sum(e[1] for e in mine)
        one_kind = len({k for _, ks in gathered for k in ks}) == 1
        raise ConfigError(_refusal(source.where, n_rows, total_bad, unique, one_kind))
    if not sum(e[1] for e in mine):
        d.barrier()
        if leader:
            shutil.rmtree(work, ignore_errors=True)
        accepted = (
            encoder.ACCEPTED
            if encoder is not None
            else "'prompt' + 'completion', 'messages' or 'text'"
        )
        msg = f"{source.where} has no rows; give at least one row with {accepted}"
        raise ConfigError(msg)

    # ---- the site's first rank makes it one cache: meta.json last, then the folder into place
    d.barrier()

    def publish() -> None:
        if not leader:
            return
        for p in work.glob("probe-*"):
            p.unlink()
        site_parts = [e[3] for e in sorted(mine, key=lambda e: site.index(e[0]))]
        meta = {
            "format": FORMAT,
            "nbtrain": version(),
            "fingerprint": key,
            "source": source.where,
            "tokenizer": getattr(tokenizer, "name_or_path", ""),
            "rows": sum(p["rows"] for p in site_parts),
            "tokens": sum(p["tokens"] for p in site_parts),
            "parts": site_parts,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        atomic.write_json(work / META, meta, indent=1)
        # an unreadable cache of the same name (cut short, another version's) is replaced: set aside
        # until this one is in place; a readable one is kept
        stale = final.exists() and open_cache(final) is None
        try:
            atomic.commit_dir(work, final, replace=stale)
        except OSError:  # another run made the same cache first: use that one
            shutil.rmtree(work, ignore_errors=True)

    d.agree(publish)
    d.barrier()
    store = d.agree(lambda: open_cache(final) or _fail_open(final))
    if temporary:
        d.barrier()  # every rank has its memory maps: the files can go (the maps keep the data)
        if leader:
            shutil.rmtree(root, ignore_errors=True)
        store.location = None
    if d.is_zero:
        took = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in final.glob("*")) if final.exists() else 0
        per = size / max(store.n_tokens, 1)
        where = "not kept (data_cache='off')" if temporary else f"cached at {final}"
        print(
            f"nbtrain: {source.name}: {len(store):,} rows, {store.n_tokens:,} tokens in {took:.1f} s "
            f"({len(store) / max(took, 1e-9):,.0f} rows/s), {where}"
            + ("" if temporary else f", {size / 2**20:,.1f} MiB ({per:.1f} bytes/token)"),
            flush=True,
        )
    return store


def _refusal(
    where: str, n_rows: int, total_bad: int, shown: list[tuple[int, Any]], one_kind: bool
) -> str:
    """The message that refuses the data: every bad row shown (the first SHOWN of them), or one
    line when every row is refused alike (CSV columns of another name, SFT rows given to DPO)."""
    done = "nothing was trained or cached"
    if one_kind and total_bad == n_rows > 1:
        first, alike = shown[0][1]
        if alike:  # "all 40 rows have keys 'input', 'output'; SFT rows need ..."
            return f"{where}: all {n_rows} rows {alike}; {done}"
        return f"{where}: all {n_rows} rows are refused alike, {done}; the first: {first}"
    more = f"\n... and {total_bad - len(shown)} more" if total_bad > len(shown) else ""
    return (
        f"{where}: {total_bad} of {n_rows} rows are refused, {done}; fix or remove them:\n"
        + "\n".join(text for _, (text, _alike) in shown)
        + more
    )


def _fail_open(folder: Path) -> TokenStore:
    msg = (
        f"the token cache at {folder} could not be read back after it was written; check the disk "
        f"(free space, permissions), or set SFTConfig(data_cache='off') or ${ENV}=off"
    )
    raise ConfigError(msg)
