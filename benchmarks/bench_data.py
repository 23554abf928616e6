"""Data set-up at real sizes: nbtrain against TRL, time to the first step, peak memory, cache on disk.

    .venv/bin/python benchmarks/bench_data.py [--sizes 10000 100000 400000] [--big] [--out FILE]
    .venv/bin/python benchmarks/bench_data.py --quick                 # one size, 2k rows (smoke)
    .venv/bin/python benchmarks/bench_data.py --render FILE.json      # its table into RESULTS.md

Everything is written here, nothing is downloaded (cached in benchmarks/_work/data-bench/):
- a chat data set in TRL's conversational format (`{"messages": [...]}`, 1-3 user/assistant turns,
  sometimes a system prompt, about 244 tokens a row), English-like text from a seeded Zipf draw over a
  vocabulary of common English words and made-up ones, deterministic from the seed (the first rows of
  a bigger size are the rows of a smaller one), as JSONL, one file per size;
- a 32k byte-level BPE tokenizer (`tokenizers`, trained on the first 5,000 rows) with ChatML special
  tokens and a chat template with `{% generation %}` markers (TRL's `assistant_only_loss=True`), and a
  tiny `LlamaForCausalLM` (hidden 64, 2 layers), both saved with `save_pretrained`: training costs
  next to nothing, so the time is the data set-up's.

Arms, per size, each a fresh process (or torchrun job), one after the other:
  nbtrain_2r_cold  `torchrun --standalone --nproc_per_node=2 _data_rank.py` (OMP_NUM_THREADS=1),
                   max_steps=1, batch 2, max_length 1024, a fresh data cache folder
  nbtrain_2r_warm  the same again on the same cache folder
  nbtrain_1p_cold  `python _data_rank.py`: one process (world size 1), a fresh cache folder
  trl_cold         `_data_trl.py`: trl.SFTTrainer (dataset_num_proc=2, assistant_only_loss=True,
                   max_length 1024, max_steps 1, batch 2), data from `datasets.load_dataset("json",
                   cache_dir=<fresh>)`
  trl_warm         the same again on the same datasets cache
Time to first step: from the process's start (its /proc start time: interpreter start-up, imports,
loading, tokenizing) to the end of the first optimizer step; for torchrun the slower rank's. The JSONL
sits in the OS page cache for every arm (it was just written or read): "cold" is about the data cache.
Peak RSS: `ru_maxrss` of each rank (TRL: of its main process; its map workers' largest is also kept).
Cache: the disk usage (st_blocks) of the cache folder after the run, per token of the data set (tokens
counted once here: the rendered chat texts through the tokenizer's batch encode).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# bump when the generator, tokenizer or model change: cached files under another version are ignored
VERSION = 1
DATA = C.WORK / f"data-bench-v{VERSION}"
SEED = 0
CHUNK = 1000  # rows per seeded chunk: row i comes from chunk i // CHUNK, whatever the size
TOKENIZER_ROWS = 5000
VOCAB = 32_000
SIZES = (10_000, 100_000, 400_000)
BIG = 1_000_000
ARMS = ("nbtrain_2r_cold", "nbtrain_2r_warm", "nbtrain_1p_cold", "trl_cold", "trl_warm")
LABELS = {
    "nbtrain_2r_cold": "nbtrain cold, 2 ranks",
    "nbtrain_2r_warm": "nbtrain warm, 2 ranks",
    "nbtrain_1p_cold": "nbtrain cold, 1 process",
    "trl_cold": "TRL cold",
    "trl_warm": "TRL warm",
}
GOALS = {"cold": 0.5, "warm": 1.0, "rss_gb_400k": 1.5, "bytes_per_token": 12.0}

PAD, IM_START, IM_END = "<|pad|>", "<|im_start|>", "<|im_end|>"
# ChatML; the assistant's content and its <|im_end|> inside {% generation %}, so TRL's
# assistant_only_loss trains the model to stop
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def render(messages: list[dict[str, str]]) -> str:
    """What CHAT_TEMPLATE renders (checked against apply_chat_template), without Jinja's cost."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


# ------------------------------------------------------------------------------------------ the data
COMMON = (
    "the of and to a in is that it for as with was on be by this are or from at which but not have "
    "an they you can one all their has more its were there been if when will other would what so "
    "some these about into than them only also may then time any two like most each such how first "
    "used over could new after very should because both between well where through many much even "
    "being make same before under while those every three must here often does just part people "
    "over number way since without during another work still data system value file each list "
    "function model step line code set use given need point case result order state example"
).split()
ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl cr dr fl gr pl pr sh st th tr".split()
VOWELS = "a e i o u ai ea ee io ou y".split()
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rt", "ck"]


def vocabulary(seed: int = SEED, made_up: int = 30_000) -> tuple[Any, Any]:
    """Words and the cumulative Zipf probabilities to draw them with (common English words first)."""
    import numpy as np

    rng = np.random.default_rng((seed, 1))
    words = list(dict.fromkeys(COMMON))
    seen = set(words)
    while len(words) < len(COMMON) + made_up:
        n = int(rng.choice([1, 2, 2, 3, 3, 4]))
        w = "".join(
            ONSETS[rng.integers(len(ONSETS))]
            + VOWELS[rng.integers(len(VOWELS))]
            + CODAS[rng.integers(len(CODAS))]
            for _ in range(n)
        )
        if w not in seen:
            seen.add(w)
            words.append(w)
    weights = 1.0 / (np.arange(len(words)) + 2.7) ** 1.05
    return np.array(words, dtype=object), np.cumsum(weights / weights.sum())


class _Chunk:
    """The rows of one seeded chunk."""

    def __init__(self, words: Any, cdf: Any, index: int, seed: int) -> None:
        import numpy as np

        self.rng = np.random.default_rng((seed, 2, index))
        self.words, self.cdf = words, cdf
        self.pool: list[str] = []
        self.at = 0

    def _draw(self, n: int) -> list[str]:
        import numpy as np

        if self.at + n > len(self.pool):
            ids = np.searchsorted(self.cdf, self.rng.random(100_000))
            ids = np.minimum(ids, len(self.words) - 1)
            self.pool = self.pool[self.at :] + self.words[ids].tolist()
            self.at = 0
        self.at += n
        return self.pool[self.at - n : self.at]

    def sentence(self) -> str:
        rng = self.rng
        w = self._draw(int(rng.integers(6, 28)))
        if rng.random() < 0.15:
            w[int(rng.integers(len(w)))] = str(int(rng.integers(0, 2030)))
        if len(w) > 7 and rng.random() < 0.4:
            k = int(rng.integers(2, len(w) - 2))
            w[k] += ","
        w[0] = w[0].capitalize()
        return " ".join(w) + str(rng.choice([".", ".", ".", "?", "!", ":"]))

    def text(self, lo: int, hi: int) -> str:
        return " ".join(self.sentence() for _ in range(int(self.rng.integers(lo, hi + 1))))

    def row(self) -> dict[str, Any]:
        rng = self.rng
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": self.text(1, 2)})
        for _ in range(int(rng.choice([1, 2, 3], p=[0.45, 0.35, 0.2]))):
            messages.append({"role": "user", "content": self.text(1, 3)})
            messages.append({"role": "assistant", "content": self.text(2, 6)})
        return {"messages": messages}


def generate(n: int, path: Path, seed: int = SEED) -> None:
    """`n` rows as JSONL at `path` (written beside, then renamed)."""
    words, cdf = vocabulary(seed)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for c in range(-(-n // CHUNK)):
            chunk = _Chunk(words, cdf, c, seed)
            for _ in range(min(CHUNK, n - c * CHUNK)):
                f.write(json.dumps(chunk.row()) + "\n")
    tmp.replace(path)


def rows_file(n: int) -> Path:
    path = DATA / f"chat-{n}.jsonl"
    if not path.is_file():
        DATA.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        generate(n, path)
        print(
            f"generated {n:,} rows in {time.perf_counter() - t:.1f} s: {path}",
            file=sys.stderr,
            flush=True,
        )
    return path


def _texts(path: Path, limit: int | None = None) -> list[str]:
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            out.append(render(json.loads(line)["messages"]))
    return out


def model_dir() -> Path:
    """The tokenizer (trained on the first TOKENIZER_ROWS rows) and a tiny Llama, save_pretrained."""
    out = DATA / "model"
    if (out / "config.json").is_file():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t = time.perf_counter()
    sample = rows_file(TOKENIZER_ROWS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(sample), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
        model_max_length=2048,
    )
    rows = [json.loads(line) for line in sample.read_text().splitlines()[:50]]
    for r in rows:  # the fast renderer used for counting must be the template
        assert tokenizer.apply_chat_template(r["messages"], tokenize=False) == render(r["messages"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = DATA / ".model-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out)
    print(
        f"tokenizer ({len(tokenizer):,} tokens) and model in {time.perf_counter() - t:.1f} s: {out}",
        file=sys.stderr,
        flush=True,
    )
    return out


def data_stats(n: int, model: Path) -> dict[str, Any]:
    """Rows, tokens (rendered chat texts through the tokenizer's batch encode) and bytes of size `n`."""
    path = rows_file(n)
    stats_path = path.with_suffix(".stats.json")
    if stats_path.is_file():
        return json.loads(stats_path.read_text())
    from transformers import AutoTokenizer

    t = time.perf_counter()
    backend = AutoTokenizer.from_pretrained(model).backend_tokenizer
    tokens = rows = longest = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal tokens, longest
        for enc in backend.encode_batch(batch, add_special_tokens=False):
            tokens += len(enc.ids)
            longest = max(longest, len(enc.ids))
        batch.clear()

    with path.open(encoding="utf-8") as f:
        for line in f:
            batch.append(render(json.loads(line)["messages"]))
            rows += 1
            if len(batch) == 10_000:
                flush()
    flush()
    stats = {
        "rows": rows,
        "tokens": tokens,
        "tokens_per_row": tokens / rows,
        "longest_row_tokens": longest,
        "jsonl_bytes": path.stat().st_size,
        "count_s": round(time.perf_counter() - t, 1),
    }
    stats_path.write_text(json.dumps(stats, indent=1) + "\n")
    return stats


# ------------------------------------------------------------------------------------------ the arms
def disk_usage(path: Path) -> dict[str, int]:
    """Bytes the folder takes on disk (what du reports: allocated blocks) and its files' sizes."""
    used = size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            used += st.st_blocks * 512
            size += st.st_size
            files += 1
    return {"disk_bytes": used, "apparent_bytes": size, "files": files}


def nbtrain_has_data_cache() -> bool:
    from dataclasses import fields

    import nbtrain

    return "data_cache" in {f.name for f in fields(nbtrain.SFTConfig)}


def _launch(
    cmd: list[str], env: dict[str, str], log: Path, timeout: float
) -> tuple[float, float, list[dict[str, Any]]]:
    """Run `cmd`; (launch time, command wall, the JSON lines its processes printed)."""
    t_launch = time.time()
    t0 = time.perf_counter()
    with log.open("w") as err:
        proc = subprocess.run(
            cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        msg = f"{' '.join(cmd[:3])} ... failed ({proc.returncode}); stderr in {log}:\n{proc.stdout[-2000:]}\n{tail}"
        raise RuntimeError(msg)
    reports = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"rank"')]
    if not reports:
        msg = f"no report from {' '.join(cmd[:3])} ...; its output:\n{proc.stdout[-2000:]}"
        raise RuntimeError(msg)
    return t_launch, wall, reports


def run_arm(
    arm: str, model: Path, data: Path, run: Path, timeout: float, out_tag: str
) -> dict[str, Any]:
    """One arm in fresh processes; its time to first step, peak RSS and cache on disk."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(DATA / "hf-home"),
        PYTHONUNBUFFERED="1",
    )
    load_before = C.loadavg()
    output_dir = run / f"out-{out_tag}"
    shutil.rmtree(output_dir, ignore_errors=True)
    if arm.startswith("nbtrain"):
        cache = run / ("nbtrain-cache-2r" if "2r" in arm else "nbtrain-cache-1p")
        if arm.endswith("cold"):
            shutil.rmtree(cache, ignore_errors=True)
        cfg = {
            "model": str(model),
            "data": str(data),
            "output_dir": str(output_dir),
            "max_steps": 1,
            "save_steps": None,
            "max_length": 1024,
            "per_device_train_batch_size": 2,
            "seed": 42,
            "overwrite": True,
            "data_cache": str(cache),
        }
        # the pipeline reads the field, or (before the field exists) this variable
        env["NBTRAIN_DATA_CACHE"] = str(cache)
        script = str(C.HERE / "_data_rank.py")
        if "2r" in arm:
            env["OMP_NUM_THREADS"] = "1"
            cmd = [C.bin_path("torchrun"), "--standalone", "--nproc_per_node=2", script]
        else:
            cmd = [C.python(), script]
        cmd.append(json.dumps(cfg))
    else:
        cache = run / "trl-cache"
        if arm.endswith("cold"):
            shutil.rmtree(cache, ignore_errors=True)
        args = {
            "model": str(model),
            "data": str(data),
            "cache_dir": str(cache),
            "output_dir": str(output_dir),
            "num_proc": 2,
        }
        cmd = [C.python(), str(C.HERE / "_data_trl.py"), json.dumps(args)]
    before = disk_usage(cache)["disk_bytes"]
    t_launch, wall, reports = _launch(cmd, env, run / f"{out_tag}.stderr.log", timeout)
    reports.sort(key=lambda r: r["rank"])
    firsts = [r.get("first_step_end") for r in reports]
    if any(f is None for f in firsts):
        msg = f"{arm}: a process ended without an optimizer step (reports: {reports})"
        raise RuntimeError(msg)
    per_rank = [r["first_step_end"] - r["proc_start"] for r in reports]
    rss = [r["maxrss_bytes"] for r in reports]
    shutil.rmtree(output_dir, ignore_errors=True)
    out = {
        "arm": arm,
        "start_to_first_step_s": max(per_rank),
        "start_to_first_step_per_rank_s": per_rank,
        # torchrun's own start-up included (its agent spawns the ranks)
        "launch_to_first_step_s": max(firsts) - t_launch,
        "command_wall_s": wall,
        "imports_s": [r["imported"] - r["proc_start"] for r in reports],
        "peak_rss_bytes": max(rss),
        "peak_rss_per_rank_bytes": rss,
        "threads": [r["threads"] for r in reports],
        "cache": disk_usage(cache),
        # a warm run that writes more than a few files' worth missed the cache (a changed key)
        "cache_grew_bytes": disk_usage(cache)["disk_bytes"] - before,
        "loadavg_before": load_before,
        "loadavg_after": C.loadavg(),
    }
    if arm.startswith("trl"):
        r = reports[0]
        out["children_peak_rss_bytes"] = r["children_maxrss_bytes"]
        out["phases_s"] = {
            "start_to_imported": r["imported"] - r["proc_start"],
            "load_dataset": r["dataset_loaded"] - r["imported"],
            "SFTTrainer_init (tokenize)": r["trainer_built"] - r["dataset_loaded"],
            "to_first_step": r["first_step_end"] - r["trainer_built"],
        }
    else:
        out["phases_s"] = {
            "start_to_imported": max(r["imported"] - r["proc_start"] for r in reports),
            "finetune_to_first_step": max(
                r["first_step_end"] - r["finetune_start"] for r in reports
            ),
        }
        out["plan"] = reports[0].get("plan")
        # what nbtrain's cache says it holds, beside the benchmark's own count
        metas = []
        for meta in sorted(cache.glob("*/meta.json")):
            try:
                metas.append(json.loads(meta.read_text()).get("tokens"))
            except (OSError, ValueError):
                continue
        out["nbtrain_cache_tokens"] = metas
    return out


# ----------------------------------------------------------------------------------------- reporting
def _med(runs: list[dict[str, Any]], key: str) -> float | None:
    return C.median([r[key] for r in runs if r.get(key) is not None])


def summarize(size: dict[str, Any]) -> dict[str, Any]:
    """Medians per arm, the cache per token and the goal ratios of one size."""
    tokens = size["data"]["tokens"]
    out: dict[str, Any] = {}
    for arm, runs in size["runs"].items():
        if not runs:
            continue
        cache = C.median([r["cache"]["disk_bytes"] for r in runs])
        out[arm] = {
            "start_to_first_step_s": _med(runs, "start_to_first_step_s"),
            "launch_to_first_step_s": _med(runs, "launch_to_first_step_s"),
            "peak_rss_bytes": _med(runs, "peak_rss_bytes"),
            "cache_disk_bytes": cache,
            "cache_bytes_per_token": None if cache is None else cache / tokens,
            # the cache grew by more than a tenth: this warm run rebuilt it
            "warm_missed": arm.endswith("warm")
            and any(r.get("cache_grew_bytes", 0) > 0.1 * r["cache"]["disk_bytes"] for r in runs),
        }

    def t(arm: str) -> float | None:
        return out.get(arm, {}).get("start_to_first_step_s")

    bpt = out.get("nbtrain_2r_cold", {}).get("cache_bytes_per_token")
    out["ratios"] = {
        "cold_2r_over_trl_cold": C.ratio(t("nbtrain_2r_cold"), t("trl_cold")),
        "warm_2r_over_trl_warm": C.ratio(t("nbtrain_2r_warm"), t("trl_warm")),
        "cold_1p_over_trl_cold": C.ratio(t("nbtrain_1p_cold"), t("trl_cold")),
        "nbtrain_cache_bytes_per_token": bpt,
        "trl_cache_bytes_per_token": out.get("trl_cold", {}).get("cache_bytes_per_token"),
    }
    return out


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f} s"


def _gb(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e9:.2f} GB"


def _r(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(data: dict[str, Any]) -> str:
    """The Markdown table of a bench_data report: one line per size."""
    arms = [a for a in ARMS if any(a in s["summary"] for s in data["sizes"].values())]
    head = ["rows (tokens)", *(f"{LABELS[a]}: time / peak RSS" for a in arms)]
    head += [
        "cache B/token nbtrain / TRL (goal ≤ 12)",
        "cold 2 ranks / TRL cold (goal ≤ 0.5)",
        "warm / TRL warm (goal ≤ 1.0)",
        "load before → after",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, s in sorted(data["sizes"].items(), key=lambda kv: int(kv[0])):
        sm, ra = s["summary"], s["summary"]["ratios"]
        cells = [f"{int(n):,} ({s['data']['tokens'] / 1e6:.1f}M)"]
        for a in arms:
            x = sm.get(a, {})
            miss = " (cache MISSED)" if x.get("warm_missed") else ""
            cells.append(
                f"{_s(x.get('start_to_first_step_s'))} / {_gb(x.get('peak_rss_bytes'))}{miss}"
            )
        cells += [
            f"{_r(ra['nbtrain_cache_bytes_per_token'], '.1f')} / {_r(ra['trl_cache_bytes_per_token'], '.1f')}",
            _r(ra["cold_2r_over_trl_cold"]),
            _r(ra["warm_2r_over_trl_warm"]),
        ]
        runs = [r for rs in s["runs"].values() for r in rs]
        cells.append(
            f"{runs[0]['loadavg_before'][0]} → {runs[-1]['loadavg_after'][0]}" if runs else "–"
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


BEGIN, END = "<!-- data-table:begin -->", "<!-- data-table:end -->"


def render_results(data: dict[str, Any], results_md: Path) -> None:
    """Put the table (between markers) into RESULTS.md's "Data set-up" section, adding it if missing."""
    text = results_md.read_text() if results_md.is_file() else ""
    code = data.get("code", {})
    commit = code.get("commit", "?") + (
        f" + {len(code['nbtrain_dirty_files'])} uncommitted nbtrain file(s)"
        if code.get("nbtrain_dirty_files")
        else ""
    )
    block = (
        f"{BEGIN}\n"
        f"Measured {data['started']} on `{data['machine']['host']}` ({data['machine']['cpus']} CPUs), "
        f"commit {commit}, {data.get('reps', 1)} run(s) per arm (medians), nbtrain data cache "
        f"{'in SFTConfig.data_cache' if data.get('nbtrain_data_cache_field') else 'NOT in this nbtrain (no cache: tokenized in memory on every rank)'}; "
        f"load average {data['loadavg_start']} at the start, {data['loadavg_end']} at the end; "
        f"{data['wall_s']:.0f} s in all"
        + (
            f" (the TRL arms' runs are from the run started {data['reused']['started']}, "
            f"commit {data['reused']['code'].get('commit', '?')})"
            if data.get("reused")
            else ""
        )
        + f".\n\n{table(data)}\n{END}"
    )
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = (
            text.rstrip("\n") + "\n\n## Data set-up: nbtrain vs TRL (benchmarks/bench_data.py)\n\n"
            "Time from process start to the end of the first optimizer step (for torchrun the slower "
            "rank), with peak RSS (the largest rank; TRL's main process), on the generated chat data "
            "(about 244 tokens a row, 32k BPE, tiny Llama: the time is the data set-up's). Cold: a "
            "fresh data cache folder; warm: the same folder again. Raw numbers in "
            "`results/data.json`.\n\n" + block + "\n"
        )
    results_md.write_text(text)


def add_metrics(rec: C.Recorder, sizes: dict[str, Any]) -> None:
    for n, s in sorted(sizes.items(), key=lambda kv: int(kv[0])):
        sm, ra = s["summary"], s["summary"]["ratios"]

        def t(arm: str, sm: dict[str, Any] = sm) -> float | None:
            return sm.get(arm, {}).get("start_to_first_step_s")

        tag = f"{int(n):,} rows"
        rec.metric(
            f"data set-up {tag}: process start to first step, 2 ranks cold / TRL cold",
            t("nbtrain_2r_cold"),
            t("trl_cold"),
            "TRL SFTTrainer, fresh datasets cache",
            "s",
            "<= 0.5",
        )
        rec.metric(
            f"data set-up {tag}: process start to first step, 2 ranks warm / TRL warm",
            t("nbtrain_2r_warm"),
            t("trl_warm"),
            "TRL SFTTrainer, same datasets cache",
            "s",
            "<= 1.0",
        )
        rss = sm.get("nbtrain_2r_cold", {}).get("peak_rss_bytes")
        rec.metric(
            f"data set-up {tag}: peak RSS per rank, 2 ranks cold (GB)",
            None if rss is None else rss / 1e9,
            None
            if "trl_cold" not in sm or sm["trl_cold"]["peak_rss_bytes"] is None
            else sm["trl_cold"]["peak_rss_bytes"] / 1e9,
            "TRL main process",
            "GB",
            "<= 1.5 at 400k rows" if int(n) == 400_000 else "",
        )
        rec.metric(
            f"data set-up {tag}: cache on disk, bytes per token",
            ra["nbtrain_cache_bytes_per_token"],
            ra["trl_cache_bytes_per_token"],
            "TRL's datasets cache",
            "B/token",
            "<= 12",
        )


# --------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", type=int, nargs="*", default=None, help="rows per size (default 10k 100k 400k)"
    )
    ap.add_argument("--big", action="store_true", help="also 1M rows")
    ap.add_argument("--quick", action="store_true", help="smoke run: one size of 2,000 rows")
    ap.add_argument("--arms", nargs="*", choices=ARMS, default=list(ARMS), help="arms to run")
    ap.add_argument("--reps", type=int, default=1, help="runs of every arm per size (medians)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one arm may take")
    ap.add_argument("--keep", action="store_true", help="keep the cache folders after the run")
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    ap.add_argument(
        "--reuse",
        metavar="JSON",
        default=None,
        help="take the arms not run now from this earlier report (same sizes), e.g. TRL's",
    )
    ap.add_argument(
        "--results-md", action="store_true", help="put the table into benchmarks/RESULTS.md"
    )
    ap.add_argument(
        "--render", metavar="JSON", default=None, help="only put FILE's table into RESULTS.md"
    )
    args = ap.parse_args()
    if args.render:
        render_results(json.loads(Path(args.render).read_text()), C.HERE / "RESULTS.md")
        return
    C.setup_env()
    sizes = [2000] if args.quick else list(args.sizes or SIZES) + ([BIG] if args.big else [])
    rec = C.Recorder("data", args.quick)
    earlier = json.loads(Path(args.reuse).read_text()) if args.reuse else None
    model = model_dir()
    rec.data.update(
        {
            "reps": args.reps,
            "arms": args.arms,
            "reused": None
            if earlier is None
            else {"from": args.reuse, "started": earlier["started"], "code": earlier["code"]},
            "nbtrain_data_cache_field": nbtrain_has_data_cache(),
            "model": {"hidden_size": 64, "num_layers": 2, "vocab": VOCAB, "path": str(model)},
            "sizes": {},
        }
    )
    for n in sizes:
        stats = data_stats(n, model)
        data = rows_file(n)
        print(
            f"== {n:,} rows, {stats['tokens']:,} tokens ({stats['tokens_per_row']:.0f}/row)",
            file=sys.stderr,
            flush=True,
        )
        run = DATA / f"run-{n}"
        run.mkdir(parents=True, exist_ok=True)
        size: dict[str, Any] = {"data": stats, "runs": {a: [] for a in args.arms}}
        rec.data["sizes"][str(n)] = size
        for rep in range(args.reps):
            for arm in args.arms:
                r = run_arm(arm, model, data, run, args.timeout, f"{arm}-{rep}")
                size["runs"][arm].append(r)
                print(
                    f"  {arm}: {r['start_to_first_step_s']:.1f} s to first step "
                    f"(launch {r['launch_to_first_step_s']:.1f} s), peak RSS "
                    f"{r['peak_rss_bytes'] / 1e9:.2f} GB, cache "
                    f"{r['cache']['disk_bytes'] / 1e6:.1f} MB, load {r['loadavg_after']}",
                    file=sys.stderr,
                    flush=True,
                )
        if earlier is not None and str(n) in earlier["sizes"]:
            for arm, runs in earlier["sizes"][str(n)]["runs"].items():
                if arm not in args.arms and runs:
                    size["runs"][arm] = [dict(r, reused_from=earlier["started"]) for r in runs]
        size["summary"] = summarize(size)
        if not args.keep:
            for cache in ("nbtrain-cache-2r", "nbtrain-cache-1p", "trl-cache"):
                shutil.rmtree(run / cache, ignore_errors=True)
    add_metrics(rec, rec.data["sizes"])
    data = rec.finish(args.out)
    print("\n" + table(data), file=sys.stderr)
    if args.results_md:
        render_results(data, C.HERE / "RESULTS.md")


if __name__ == "__main__":
    main()
