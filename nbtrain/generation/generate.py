"""`nbtrain.generate`: completions for a list of prompts, generated across the ranks of the cell (or in one
process), from the base model, a LoRA adapter, a merged model, or several of them side by side.

In [1]: %%distributed
   ...: table = nbtrain.generate(["Add 12 and 30.", [{"role": "user", "content": "Say hi"}]],
   ...:                          model="tiny-llama", adapter="runs/first/adapter", max_new_tokens=64)
In [2]: nbtrain.generate("prompts.jsonl", adapter=["base", "runs/a/adapter", "runs/b/adapter"])

The prompts are split across the ranks and batched with left padding and a KV cache
(`nbtrain.generation.decode`); rank 0 gets a pandas DataFrame in prompt order, every other rank None.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nbtrain.data.prompts import read_prompts
from nbtrain.engine.dist import Dist
from nbtrain.engine.signals import interrupts
from nbtrain.errors import ConfigError
from nbtrain.generation import decode, engines
from nbtrain.runs import ADAPTER_CONFIG_FILE, ADAPTER_DIR, ADAPTER_WEIGHTS_FILE, MERGED_DIR

log = logging.getLogger(__name__)

BASE = "base"
SHARDS = ("ddp", "fsdp")
# an adapter folder a rank cannot see is sent to it from rank 0 (adapters are small); a model is not
_SHIP_LIMIT = 1 << 30


@dataclass
class _Model:
    """One column of the table: the base, an adapter on it, or a model folder of its own."""

    label: str
    kind: str  #: "base", "adapter" or "model"
    path: str | None = None


def _adapter_path(value: Any) -> str:
    if hasattr(value, "output_dir") and hasattr(value, "adapter_dir"):  # a TrainResult
        # adapter_dir is set on rank 0 only; every rank knows the output folder it is in
        return str(Path(value.output_dir) / ADAPTER_DIR)
    if isinstance(value, str | os.PathLike):
        return os.fspath(value)
    msg = (
        f"adapter entry {value!r} is a {type(value).__name__}; give 'base', an adapter folder, a model "
        "folder, or the TrainResult finetune returned"
    )
    raise ConfigError(msg)


_RUN_PARTS = (ADAPTER_DIR, MERGED_DIR)


def _tail(path: str, k: int) -> str:
    """The last `k` parts of `path` ("runs/sft/merged", 2 -> "sft/merged")."""
    parts = [q for q in Path(os.path.normpath(path)).parts if q not in ("/", "\\")]
    return "/".join(parts[-k:]) or path


def _name_columns(models: list[_Model]) -> None:
    """Labels for the columns the caller did not name: the run's name (runs/first/adapter -> "first"),
    and where two would be the same, as much of each path as tells them apart (runs/sft/adapter and
    runs/sft/merged -> "sft/adapter", "sft/merged"); the same folder twice is numbered."""
    if len(models) == 1:
        models[0].label = "completion"
        return
    auto = [m for m in models if not m.label]
    fixed = {m.label for m in models if m.label}
    for m in auto:
        assert m.path is not None
        p = Path(os.path.normpath(m.path))
        # the run's name says more than "adapter"
        m.label = p.parent.name if p.name in _RUN_PARTS and p.parent.name else p.name or m.path
    k = 2
    while True:
        # a longer label cannot tell the same folder twice apart: that one is numbered below
        clash = [
            m
            for m in auto
            if m.label in fixed or any(o.label == m.label and o.path != m.path for o in auto)
        ]
        longer = [m for m in clash if _tail(str(m.path), k) != m.label]
        if not longer:
            break
        for m in longer:
            m.label = _tail(str(m.path), k)
        k += 1
    taken = set(fixed)
    for m in auto:
        label, n = m.label, 2
        while label in taken:
            label, n = f"{m.label}-{n}", n + 1
        m.label = label
        taken.add(label)


def _run_adapter(path: str) -> str:
    """A run folder (a finetune's output_dir) stands for the adapter the run exported into it."""
    from nbtrain.model.checkpoint import list_checkpoints
    from nbtrain.runs import CONFIG_FILE, METRICS_FILE

    p = Path(path).expanduser()
    if not p.is_dir() or any((p / f).is_file() for f in (ADAPTER_CONFIG_FILE, "config.json")):
        return path
    if (p / ADAPTER_DIR / ADAPTER_CONFIG_FILE).is_file():
        return os.path.join(path, ADAPTER_DIR)
    saved = list_checkpoints(p)
    if not (saved or (p / CONFIG_FILE).is_file() or (p / METRICS_FILE).is_file()):
        return path  # not a run folder: _classify says what it lacks
    hint = f", or generate from its latest checkpoint: adapter={str(saved[-1])!r}" if saved else ""
    msg = (
        f"adapter {path!r} is a run folder without an adapter/: finetune exports the adapter when "
        f"the run ends, and this run did not finish. Finish it (finetune with the same config and "
        f"resume='latest'){hint}"
    )
    raise ConfigError(msg)


def _models(adapter: Any) -> list[_Model]:
    """The columns asked for: None is the base alone; a list or a {label: entry} dict side by side."""
    if adapter is None:
        return [_Model("completion", BASE)]
    items: list[tuple[str | None, Any]]
    if isinstance(adapter, dict):
        items = [(str(k), v) for k, v in adapter.items()]
    elif isinstance(adapter, list | tuple):
        items = [(None, v) for v in adapter]
    else:
        items = [(None, adapter)]
    if not items:
        msg = "adapter=[] names no model; give 'base', adapter folders, or leave adapter out"
        raise ConfigError(msg)
    out: list[_Model] = []
    taken: set[str] = set()
    for label, value in items:
        if value is None or value == BASE:
            m = _Model(label or BASE, BASE)
        else:
            # unnamed ("") until the run folders are resolved: _name_columns
            m = _Model(label or "", "adapter", _adapter_path(value))
        if m.label and m.label in taken:
            msg = f"two adapter entries are both labelled {m.label!r}; give adapter as a dict {{label: folder}}"
            raise ConfigError(msg)
        taken.add(m.label)
        out.append(m)
    return out


def _ship(d: Dist, path: str) -> str:
    """`path` as this rank can read it: itself where every rank sees it, else a copy of rank 0's files
    in a temporary folder (ranks on another node without shared storage)."""
    seen = d.gather_objects(Path(path).expanduser().is_dir())
    if all(seen):
        return path
    if not seen[0]:
        msg = f"adapter folder {path!r} not found on rank 0 on {d.host}; check the path (relative paths are from {os.getcwd()})"
        raise ConfigError(msg)
    files = None
    if d.is_zero:
        folder = Path(path).expanduser()
        files = {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}
        if sum(len(b) for b in files.values()) > _SHIP_LIMIT:
            files = {}
    files = d.broadcast_object(files)
    if seen[d.rank]:
        return path
    if not files:
        msg = f"folder {path!r} is on rank 0 only and too large to send; put it on storage every rank sees"
        raise ConfigError(msg)
    tmp = Path(tempfile.mkdtemp(prefix="nbtrain-adapter-"))
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return str(tmp)


def _classify(m: _Model) -> None:
    """An adapter entry is a PEFT adapter (adapter_config.json) or a model folder (config.json: a
    merged model); anything else is refused."""
    if m.kind != "adapter" or m.path is None:
        return
    p = Path(m.path).expanduser()
    if (p / ADAPTER_CONFIG_FILE).is_file():
        return
    if (p / "config.json").is_file():
        m.kind = "model"
        return
    msg = (
        f"adapter {m.path!r} holds neither adapter_config.json (a PEFT adapter) nor config.json (a model "
        "such as finetune(cfg, merge=True) writes); give a run folder (finetune's output_dir), the "
        "adapter folder finetune exported (result.adapter_dir, output_dir/adapter) or a merged model folder"
    )
    raise ConfigError(msg)


def _base_of(models: list[_Model]) -> str | None:
    import json

    for m in models:
        if m.kind == "adapter" and m.path:
            cfg = json.loads((Path(m.path).expanduser() / ADAPTER_CONFIG_FILE).read_text())
            base = cfg.get("base_model_name_or_path")
            if base:
                return str(base)
    return None


def _settings(
    model: str, shard: str, load_in_4bit: bool, dtype: str, lora: dict | None = None
) -> Any:
    """What the loaders in build/quant/shard read off an SFTConfig, for generation."""
    lora = lora or {}
    targets = lora.get("target_modules") or "all-linear"
    return SimpleNamespace(
        model=model,
        shard=shard,
        load_in_4bit=load_in_4bit,
        load_in_8bit=False,
        dtype=dtype,
        gradient_checkpointing=False,
        torch_compile=False,
        use_liger_kernel=False,
        lora_r=int(lora.get("r") or 1),
        lora_alpha=lora.get("lora_alpha") or 1,
        lora_dropout=0.0,
        target_modules=sorted(targets) if isinstance(targets, list | set) else targets,
        seed=0,
    )


class _Loader:
    """The models of the columns on this rank, one after another.

    Unsharded, the base is loaded once and every adapter goes onto it with peft (`disable_adapter` for
    the base column). Sharded, each column's model is built with FSDP2 by `nbtrain.model.shard` (an
    adapter's LoRA weights filled in, each rank its own rows); a merged model is its own load."""

    def __init__(self, d: Dist, base: str, shard: str, load_in_4bit: bool, dtype: str) -> None:
        from nbtrain.model.build import compute_dtype

        self.d, self.base, self.shard = d, base, shard
        self.load_in_4bit, self.dtype = load_in_4bit, dtype
        self.sharded = shard != "ddp"
        self.compute_dtype = compute_dtype(_settings(base, shard, False, dtype), d.device)
        self.mesh: Any = None
        self._base: Any = None
        self._peft: Any = None
        self._names: dict[str, str] = {}

    def _weights_dtype(self) -> Any:
        import torch

        return (
            self.compute_dtype
            if self.d.device.type == "cuda" and self.compute_dtype
            else torch.float32
        )

    def _plain(self, path: str) -> Any:
        from nbtrain.model import quant
        from nbtrain.model.pretrained import load_model

        cfg = _settings(path, "ddp", self.load_in_4bit, self.dtype)
        if self.load_in_4bit:
            return quant.load_quantized(cfg, self.d.device, self.compute_dtype)
        return load_model(path, self._weights_dtype(), self.d.device)

    def _sharded(self, path: str, adapter: str | None) -> Any:
        import json

        import torch

        from nbtrain.model import shard

        lora = None
        if adapter is not None:
            lora = json.loads((Path(adapter) / ADAPTER_CONFIG_FILE).read_text())
            odd = [k for k in ("use_dora", "use_rslora") if lora.get(k)]
            if odd or lora.get("modules_to_save") or lora.get("peft_type", "LORA") != "LORA":
                what = ", ".join(odd) or "modules_to_save or a non-LoRA type"
                msg = (
                    f"adapter {adapter!r} uses {what}, which nbtrain cannot load into a sharded model; "
                    "generate from it with shard='ddp'"
                )
                raise ConfigError(msg)
        cfg = _settings(path, self.shard, self.load_in_4bit, self.dtype, lora)
        if self.mesh is None:
            self.mesh = shard.make_mesh(self.d, self.shard, self.d.group)
        # shard.build_sharded replays peft's LoRA init from a seed: the caller's RNG stays as it was
        with torch.random.fork_rng(devices=[]):
            model = shard.build_sharded(
                cfg, self.d, self.mesh, self._weights_dtype(), self.compute_dtype, lambda b: None
            )
        if adapter is not None:
            _fill_lora(model, adapter)
        model.eval()
        return model

    @contextlib.contextmanager
    def model(self, m: _Model) -> Iterator[Any]:
        """The model of column `m`, ready to generate from."""
        from nbtrain.model.pretrained import quiet_hf

        with quiet_hf():
            if self.sharded:
                path = m.path if m.kind == "model" else self.base
                assert path is not None
                built = self._sharded(path, m.path if m.kind == "adapter" else None)
                with built.disable_adapter() if m.kind != "adapter" else contextlib.nullcontext():
                    yield built
                del built
                return
            if m.kind == "model":
                assert m.path is not None
                yield self._plain(m.path)
                return
            if self._base is None:
                self._base = self._plain(self.base)
            if m.kind == BASE:
                with (
                    self._peft.disable_adapter()
                    if self._peft is not None
                    else contextlib.nullcontext()
                ):
                    yield self._peft if self._peft is not None else self._base
                return
            assert m.path is not None
            yield self._with_adapter(m.path)

    def _with_adapter(self, path: str) -> Any:
        from peft import PeftModel

        name = self._names.get(path)
        if name is None:
            name = f"nbtrain{len(self._names)}"
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self._base, path, adapter_name=name)
            else:
                self._peft.load_adapter(path, adapter_name=name)
            self._names[path] = name
        self._peft.set_adapter(name)
        self._peft.eval()
        return self._peft


def _fill_lora(model: Any, adapter: str) -> None:
    """An adapter's LoRA weights into a sharded peft model's (default) LoRA layers, each rank its rows."""
    from safetensors.torch import load_file

    from nbtrain.model.shard import fill_adapter

    path = Path(adapter) / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        msg = f"adapter {adapter!r} has no adapter_model.safetensors; save it with peft's save_pretrained (safetensors)"
        raise ConfigError(msg)
    stray, missing = fill_adapter(model, load_file(str(path)))
    if stray:
        msg = f"adapter {adapter!r}: weight {stray[0]} has no place in the model; is it this model's adapter?"
        raise ConfigError(msg)
    if missing:
        msg = f"adapter {adapter!r} lacks {len(missing)} LoRA weight(s) of its own config ({missing[0]}...)"
        raise ConfigError(msg)


def frame(columns: list[tuple[str, list[dict[str, Any]]]]) -> Any:
    """The table rank 0 returns: (label, `decode.generate_across`'s rows) a column of completions each;
    one column alone gives prompt, <label>, reference where known, tokens, seconds."""
    import pandas as pd

    first = columns[0][1]
    table: dict[str, list[Any]] = {"prompt": [r["prompt"] for r in first]}
    single = len(columns) == 1
    texts = {"prompt", "reference", *(label for label, _ in columns)}
    for label, rows in columns:
        table[label] = [r["completion"] for r in rows]
    if any(r["reference"] is not None for r in first):
        table["reference"] = [r["reference"] for r in first]
    for label, rows in columns:
        table["tokens" if single else f"tokens_{label}"] = [r["tokens"] for r in rows]
    for label, rows in columns:
        table["seconds" if single else f"seconds_{label}"] = [r["seconds"] for r in rows]
    # text columns as objects: a reference that is not known stays None (pandas' string dtype makes it NaN)
    return pd.DataFrame(
        {k: pd.Series(v, dtype=object if k in texts else None) for k, v in table.items()}
    )


@interrupts.held  # an interrupt while the models load waits for the batches' check
def generate(
    prompts: Any,
    model: str | None = None,
    adapter: Any = None,
    *,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    batch_size: int = 8,
    chat_template_kwargs: dict | None = None,
    shard: str = "ddp",
    load_in_4bit: bool = False,
    dtype: str = "auto",
    group: Any = None,
    engine: str = "hf",
) -> Any:
    """Completions of `prompts` from `model` (with `adapter`), generated across the ranks of the cell.

    In [1]: table = nbtrain.generate(["Add 12 and 30."], model="tiny-llama", adapter=result)
    In [2]: nbtrain.generate("eval.jsonl", adapter=["base", "runs/a/adapter"])   # side by side

    `prompts`: a string, a list of strings and/or message lists (rendered with the chat template and
    its generation prompt; `chat_template_kwargs` such as {'enable_thinking': False} passed through),
    or rows / a .jsonl/.json/.parquet/.csv file in the formats `finetune` reads (a row's completion,
    or its last assistant turn, is the `reference` column).
    `model`: the base model (Hub id or folder); default: the base the first adapter names.
    `adapter`: None (the base), a run folder (its adapter/), a PEFT adapter folder (unmerged), a
    merged model folder, the `TrainResult` of a `finetune` (its exported adapter), or a list of them
    (`"base"` for none; a dict {label: entry} names the columns): one completion column per model.
    Greedy unless `do_sample` (then `temperature`, `top_p`, `top_k`, drawn with its own generator
    seeded by `seed`, which leaves the global RNG as it was). `shard="fsdp"` and `load_in_4bit`
    load as `finetune` does. Every rank of the cell must call it (`group`: the ranks of a sub-group).
    `engine`: "hf" (transformers, the reference) or "vllm" (a vLLM engine per rank; docs/generate.md).

    Returns on rank 0 a pandas DataFrame in prompt order: prompt, completion (or one column per
    model), reference where known, tokens (generated, with the end-of-sequence token) and seconds
    (of the batch it was in); None on the other ranks.
    """
    decoding = decode.Decoding(
        max_new_tokens, do_sample, temperature, top_p, top_k, seed, batch_size
    )
    problems = engines.call_problems(decoding, engine, chat_template_kwargs)
    if shard not in SHARDS:
        problems.append(
            f"shard={shard!r} is not supported by generate; use one of {', '.join(SHARDS)}"
        )
    if engine == "vllm" and (shard != "ddp" or load_in_4bit):
        problems.append(
            'engine="vllm" loads its own weights: use it with shard="ddp", no load_in_4bit'
        )
    if not isinstance(load_in_4bit, bool):
        problems.append(f"load_in_4bit={load_in_4bit!r} must be True or False")
    if model is not None and not isinstance(model, str | os.PathLike):
        problems.append(f"model={model!r} must be a Hub id or a model folder (a string)")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        msg = f"invalid nbtrain.generate arguments:\n{lines}"
        raise ConfigError(msg)
    entries = read_prompts(prompts)
    models = _models(adapter)

    d = Dist(group)
    # rank 0 reads a run folder as its adapter; every rank then takes rank 0's paths
    paths = d.agree(
        lambda: [_run_adapter(m.path) if m.path and d.is_zero else m.path for m in models]
    )
    for m, path in zip(models, d.broadcast_object(paths), strict=True):
        m.path = path
    _name_columns(models)
    for m in models:
        if m.kind == "adapter" and m.path is not None:
            m.path = _ship(d, m.path)

    def check() -> tuple[str, Any]:
        from nbtrain.model.pretrained import check_causal_lm, load_tokenizer, quiet_hf

        for m in models:
            _classify(m)
        base = os.fspath(model) if model is not None else _base_of(models)
        if base is None:
            if all(m.kind == "model" for m in models):
                base = str(models[0].path)
            else:
                msg = "generate needs model= (a Hub id or model folder): no adapter names its base model"
                raise ConfigError(msg)
        check_causal_lm(base)
        if engine == "vllm":  # before any model loads, on every rank
            engines.check_vllm(
                d.rank, d.host, base, d.device, any(m.kind == "adapter" for m in models)
            )
        if load_in_4bit:
            from nbtrain.model import quant

            quant.check_quant(_settings(base, shard, True, dtype), d.device, d.rank, d.host)
        with quiet_hf():
            return base, load_tokenizer(base)

    base, tokenizer = d.agree(check)
    tokenized = d.agree(lambda: decode.encode(entries, tokenizer, chat_template_kwargs))
    if engine == "vllm":
        from nbtrain.generation import vllm_engine

        columns = vllm_engine.columns(models, base, tokenizer, tokenized, d, decoding)
        return frame([(m.label, rows) for m, rows in columns]) if d.is_zero else None
    loader = _Loader(d, base, shard, load_in_4bit, dtype)
    synced = loader.sharded and d.world > 1
    done: list[tuple[str, list[dict[str, Any]]]] = []
    for m in models:
        with loader.model(m) as net:
            rows = engines.from_model(net, tokenizer, tokenized, d, decoding, synced=synced)
        if rows is not None:
            done.append((m.label, rows))
    return frame(done) if d.is_zero else None
