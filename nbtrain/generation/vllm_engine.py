"""engine="vllm": a vLLM engine beside the rank, in a process of its own (`vllm_worker`) tied to the rank's.

In [1]: eng = engines.make("vllm", model_path=base, tokenizer=tok, device=d.device, rank=d.rank,
   ...:                    host=d.host, lora=engines.LoraSpec(r=8))
In [2]: eng.set_adapter(peft_model)   # the LoRA's current weights reach vLLM in memory, no file

Why a process and not `vllm.LLM` in the rank: vLLM sets up torch.distributed for itself, which the rank's
process group already owns; its threads and memory stay out of the rank; and a vLLM that crashes ends
its process, not the rank, which is told why (`EngineError`, with the log's tail) and stays usable.

The base weights load once, when the engine starts. A LoRA reaches vLLM as tensors (safetensors bytes
over the socket) under a new adapter id; the one before is dropped. On a GPU vLLM shares the rank's
device: it takes `gpu_memory_utilization` of it, and with `sleep` it frees its weights and KV cache
(vLLM's sleep mode, level 1) while training runs, as TRL's colocate mode does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from nbtrain import procs
from nbtrain.generation import decode
from nbtrain.generation.engine_base import (
    Completion,
    Engine,
    EngineError,
    LoraSpec,
    VLLMOptions,
    check_vllm,
)
from nbtrain.generation.utf8 import decode_completion
from nbtrain.runs import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
# the rank's process group must not leak into vLLM's own (a group of one, in its process)
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NBTRAIN_DEVICE")  # fmt: skip
TAIL_LINES = 30


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of the engine's log that say something ("" when it has none)."""
    text = path.read_text(errors="replace")
    kept = [x for x in text.splitlines() if x.strip() and not x.startswith("WARNING: Location")]
    return "\n".join(kept[-lines:])


def log_note(path: Path) -> str:
    """The sentence an engine's error ends with: where its log is and its tail, or that there is none."""
    try:
        end = tail(path)
    except OSError as e:
        return f"Its log, {path}, cannot be read ({type(e).__name__}: {e.strerror or e})."
    if not end:
        return f"Its log is {path}: the vLLM process wrote nothing to it."
    return f"Its log, {path}, ends:\n{end}"


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        device: Any,
        lora: LoraSpec | None,
        rank: int,
        host: str,
        options: VLLMOptions,
    ) -> None:
        check_vllm(rank, host, model_path, device, lora is not None)  # before anything loads
        self.model_path = model_path
        self.tokenizer, self.device, self.rank, self.host = tokenizer, device, rank, host
        self.options, self.lora_spec = options, lora
        self.gpu = getattr(device, "type", str(device)) == "cuda"
        self.lora: tuple[int, str] | None = None
        self._next_id = 1
        self.asleep = False
        self.closed = False
        self.failed = False  # a failed engine's log is kept: its error names it
        self.log = Path(tempfile.mkdtemp(prefix="nbtrain-vllm-")) / "vllm.log"
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.pid: int | None = None
        self.start_seconds = 0.0
        self.lora_seconds: list[float] = []  # each set_adapter's time, rank side and vLLM side
        self.eos = _eos(model_path, tokenizer)
        t0 = time.perf_counter()
        self._spawn()
        started = self._call(
            "start", self._llm_kwargs(model_path), timeout=options.start_timeout, what="start"
        )
        #: the LoRA goes to vLLM as tensors (True), or as files in RAM where vLLM's internals differ
        self.lora_in_memory = bool(started.get("memory"))
        self.start_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------------------------ process
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        # the engine core in the worker's own process: no third process
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # the worker imports this nbtrain, wherever the rank found it
        here = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if self.gpu:
            index = self.device.index or 0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        else:
            import torch

            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.options.cpu_kv_cache_gib)
            # the rank and its vLLM share the cores they were given: no pinning to cores of its own
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.options.cpu_threads or torch.get_num_threads())
        return env

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        with self.log.open("wb") as log:
            # a session of its own: a Ctrl-C meant for the rank's process group does not reach it;
            # its life is tied to the rank's by the worker itself (vllm_worker._tie_to)
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nbtrain.generation.vllm_worker",
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],  # fmt: skip
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
            )
        theirs.close()
        self.pid = self.proc.pid
        self.conn = Connection(ours.detach())

    def _llm_kwargs(self, model_path: str) -> dict[str, Any]:
        o = self.options
        kw: dict[str, Any] = {
            "model": model_path,
            "tokenizer": model_path,
            "seed": 0,
            "enforce_eager": o.enforce_eager,
            # the CPU rank trains and generates in float32; on a GPU vLLM's own choice (bf16/fp16)
            "dtype": o.dtype if o.dtype != "auto" or self.gpu else "float32",
        }
        if o.max_model_len is not None:
            kw["max_model_len"] = o.max_model_len
        if self.lora_spec is not None:
            r = next((x for x in LORA_RANKS if x >= self.lora_spec.r), None)
            if r is None:
                msg = f"lora r={self.lora_spec.r} is above vLLM's largest ({LORA_RANKS[-1]})"
                raise EngineError(msg)
            kw.update(enable_lora=True, max_lora_rank=r, max_loras=1)
        if self.gpu:
            kw["gpu_memory_utilization"] = o.gpu_memory_utilization
            kw["enable_sleep_mode"] = o.sleep
        kw.update(o.extra)
        return kw

    def _failed(self, what: str, cause: str, gone: bool = True) -> EngineError:
        """The error for a failure; `gone`: the process ended or its connection broke."""
        self.failed = True
        code = self.proc.poll() if self.proc is not None else None
        if gone and code is None and self.proc is not None:
            # a broken connection is often seen before the process's end: give that a moment
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(2)
        if code is not None:
            cause += f" (its process {self.pid} exited with {code})"
        msg = (
            f"vLLM engine on rank {self.rank} ({self.host}) {what}: {cause}. The rank is usable; "
            f'start a new engine or use engine="hf". {log_note(self.log)}'
        )
        return EngineError(msg)

    def _call(self, op: str, *args: Any, timeout: float | None = None, what: str = "") -> Any:
        if self.closed or self.conn is None:
            msg = f"vLLM engine on rank {self.rank} ({self.host}) is closed; make a new one"
            raise EngineError(msg)
        verb = "failed to start" if what == "start" else f"died during {op}"
        try:
            self.conn.send((op, *args))
            t0 = time.monotonic()
            # wait in slices, so a process that died is seen at once, not at the timeout
            while not self.conn.poll(0.5):
                if self.proc is not None and self.proc.poll() is not None:
                    raise self._failed(verb, "the vLLM process ended")
                if timeout is not None and time.monotonic() - t0 > timeout:
                    self._kill()
                    raise self._failed(verb, f"no answer within {timeout:.0f} s; it was ended")
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            err = self._failed(verb, f"its connection broke ({type(e).__name__})")
            self.close()
            raise err from None
        except BaseException:
            # dead, timed out, or interrupted mid-call (its answer unread): not to be used again
            self.close()
            raise
        if status != "ok":
            err = self._failed(
                "failed to start" if what == "start" else f"refused {op}", value, gone=False
            )
            if op in ("start", "generate"):
                # vLLM's scheduler after a failed step is not to be trusted: a new engine is
                self.close()
            raise err
        return value

    def _kill(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, grace=0, kill_wait=10)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            if self.conn is not None and self.proc is not None and self.proc.poll() is None:
                self.conn.send(("stop",))
                self.proc.wait(10)
        self._kill()
        if self.conn is not None:
            self.conn.close()
        if not self.failed:
            shutil.rmtree(self.log.parent, ignore_errors=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ----------------------------------------------------------------------------------- the work
    def _params(self, p: decode.Prompt, decoding: decode.Decoding, logprobs: bool) -> dict:
        params: dict[str, Any] = {
            "max_tokens": decoding.max_new_tokens,
            "stop_token_ids": [*self.eos, *decoding.stop_token_ids],
            "stop": list(decoding.stop) or None,
            "include_stop_str_in_output": True,
            "detokenize": bool(decoding.stop),
            "logprobs": 0 if logprobs else None,
            # a prompt's draws depend on the seed and the prompt's place, not on the rank
            "seed": hash((decoding.seed, p.index)) % (2**31),
        }
        if decoding.do_sample:
            params.update(
                temperature=decoding.temperature,
                top_p=decoding.top_p,
                top_k=decoding.top_k if decoding.top_k > 0 else -1,
            )
        else:
            params.update(temperature=0.0)
        return params

    def generate(
        self, prompts: list[decode.Prompt], decoding: decode.Decoding, logprobs: bool = False
    ) -> list[Completion]:
        if not prompts:
            return []
        if self.asleep:
            self.wake()
        t0 = time.perf_counter()
        got = self._call(
            "generate",
            [p.ids for p in prompts],
            [self._params(p, decoding, logprobs) for p in prompts],
            self.lora,
        )
        took = time.perf_counter() - t0
        stops = set(self.eos) | set(decoding.stop_token_ids)
        out = []
        for p, (ids, lps, _) in zip(prompts, got, strict=True):
            n, stopped = decode.cut(ids, stops, decoding.stop, self.tokenizer)
            out.append(
                Completion(
                    p.index,
                    ids[:n],
                    decode_completion(self.tokenizer, ids[:n]),
                    lps[:n] if lps is not None else None,
                    stopped,
                    took,
                )
            )
        return out

    def set_adapter(self, adapter: Any) -> None:
        """`adapter`: a peft model (its active adapter's current weights, sent in memory), a PEFT
        adapter folder (read here and sent the same way), or None (the base from now on)."""
        if adapter is None:
            self._drop()
            return
        if self.lora_spec is None:
            msg = f"vLLM engine on rank {self.rank} ({self.host}) was started without lora=; it cannot take an adapter"
            raise EngineError(msg)
        t0 = time.perf_counter()
        tensors, config = lora_tensors(adapter)
        from safetensors.torch import save

        blob = save(tensors)
        lora_id = self._next_id
        self._next_id += 1
        path = self._call("lora", lora_id, config, blob)
        self._drop()
        self.lora = (lora_id, path)
        self.lora_seconds.append(time.perf_counter() - t0)

    def _drop(self) -> None:
        if self.lora is not None:
            old, self.lora = self.lora[0], None
            self._call("drop_lora", old)

    def sleep(self) -> None:
        if self.gpu and self.options.sleep and not self.asleep:
            self._call("sleep", 1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self._call("wake")
            self.asleep = False


def _eos(model_path: str, tokenizer: Any) -> list[int]:
    """The ids that end a completion, as the "hf" engine finds them: the model's generation_config's
    eos, else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def lora_tensors(adapter: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, adapter config) of a peft model's active adapter, as peft would save them, or of an
    adapter folder; tensors contiguous on the CPU."""
    import json

    if isinstance(adapter, str | os.PathLike):
        from safetensors.torch import load_file

        folder = Path(adapter)
        config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
        return load_file(str(folder / ADAPTER_WEIGHTS_FILE)), config
    from peft import get_peft_model_state_dict

    name = adapter.active_adapter
    state = get_peft_model_state_dict(adapter, adapter_name=name)
    config = adapter.peft_config[name].to_dict()
    config = json.loads(
        json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    )
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    return tensors, config


# this rank's engine, kept between calls: a start costs a minute on a loaded CPU (docs/generate.md).
# Every user of vLLM on a rank goes through `kept` (generate, samples, GRPO's rollouts): one engine a rank
_kept: dict[str, VLLMEngine] = {}


def _start_options(options: VLLMOptions, gpu: bool) -> tuple[Any, ...]:
    """What of `options` an engine is started with (all but the start's timeout), its dtype resolved
    as `VLLMEngine` resolves "auto" on a CPU (float32), so that "auto" and "float32" are one engine."""
    dtype = options.dtype if options.dtype != "auto" or gpu else "float32"
    return (
        options.gpu_memory_utilization, options.sleep, options.max_model_len, options.enforce_eager,
        dtype, options.cpu_kv_cache_gib, options.cpu_threads, sorted(options.extra.items(), key=str),
    )  # fmt: skip


def _fits(
    old: VLLMEngine, model_path: str, device: Any, need: int, options: VLLMOptions | None
) -> bool:
    """Whether the kept engine serves what is asked: alive, the same base on the same device, room for
    a LoRA of rank `need` (0: none), and started with `options` where they are given."""
    alive = not old.closed and (old.proc is None or old.proc.poll() is None)
    room = need == 0 or (old.lora_spec is not None and old.lora_spec.r >= need)
    same = options is None or _start_options(options, old.gpu) == _start_options(
        old.options, old.gpu
    )
    return (
        alive and old.model_path == model_path and str(old.device) == str(device) and room and same
    )


def kept(
    model_path: str,
    tokenizer: Any,
    device: Any,
    lora: LoraSpec | None,
    rank: int,
    host: str,
    options: VLLMOptions | None = None,
) -> VLLMEngine:
    """The rank's vLLM engine on `model_path`, started once and kept for the next `generate`, sample or
    GRPO run: the one kept is reused where it is alive, serves the same model on the same device, has
    room for `lora`'s rank and was started with `options` (None: any; a new engine gets the defaults),
    else ended first and a new one started, so a rank never holds two (on a GPU each takes its share
    of the memory). It ends with its rank, or with `forget()`. Its adapter is whatever the last user
    set: set yours (`set_adapter`) before generating."""
    old = _kept.get("engine")
    need = (lora.r if lora is not None else 0) or 0
    if old is not None and _fits(old, model_path, device, need, options):
        return old
    forget()
    # room for the adapters a notebook tries next: vLLM sizes its LoRA slots once
    spec = None if lora is None else LoraSpec(max(need, 16), lora.alpha, lora.target_modules)
    eng = VLLMEngine(model_path, tokenizer, device, spec, rank, host, options or VLLMOptions())
    _kept["engine"] = eng
    return eng


def current() -> VLLMEngine | None:
    """The rank's kept engine, if it has one (closed or dead included: `kept` replaces those)."""
    return _kept.get("engine")


def forget() -> None:
    """End the kept engine, if any."""
    old = _kept.pop("engine", None)
    if old is not None:
        old.close()


def columns(
    models: list[Any],
    base: str,
    tokenizer: Any,
    prompts: list[decode.Prompt],
    d: Any,
    decoding: Any,
) -> list[tuple[Any, list[dict[str, Any]]]]:
    """`nbtrain.generate(engine="vllm")`'s columns on this rank, with the rank's kept engine (`kept`):
    the base's adapters put on it in turn, in memory; a merged model folder gets an engine of its own.
    Rank 0 gets [(column, rows)], the others []."""
    import json

    ranks = [
        json.loads((Path(str(m.path)) / ADAPTER_CONFIG_FILE).read_text()).get("r", 8)
        for m in models
        if m.kind == "adapter"
    ]
    lora = LoraSpec(r=max(ranks)) if ranks else None
    done = []
    for m in models:
        path = str(m.path) if m.kind == "model" else base
        # every rank has its engine before any generates: one that fails stops all of them
        eng = d.agree(
            lambda path=path: kept(
                path, tokenizer, d.device, lora if path == base else None, d.rank, d.host
            )  # fmt: skip
        )
        try:
            if path == base:
                eng.set_adapter(str(m.path) if m.kind == "adapter" else None)
            rows = decode.generate_across(None, tokenizer, prompts, d, decoding, engine=eng)
        except BaseException:
            forget()  # an engine that failed, or was interrupted mid-call, is not kept
            raise
        if rows is not None:
            done.append((m, rows))
    eng.sleep()  # on a GPU, its memory back to training until the next call
    return done
