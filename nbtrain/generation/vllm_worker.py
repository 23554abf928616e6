"""The vLLM process beside a rank: `python -m nbtrain.generation.vllm_worker FD PARENT_PID`.

It runs `vllm.LLM` in this one process (vLLM's engine core in-process, no process of its own) and
answers the rank's requests over the socket FD (`multiprocessing.connection`, one pickled tuple each):
("start", kwargs), ("generate", prompts, params, lora), ("lora", id, config, safetensors bytes),
("drop_lora", id), ("sleep", level), ("wake",), ("stop",). Each answer is ("ok", value) or ("error",
text). Its output goes to the log file the rank named; the rank reads its tail when something fails.

It never outlives its rank: the kernel kills it when the rank dies (PR_SET_PDEATHSIG), a thread exits it
when its parent changes, and it exits when the socket closes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# LoRAs pushed from memory: their tensors and config, by vLLM's lora_int_id
MEMORY = "nbtrain-memory://"
_tensors: dict[int, tuple[dict, dict]] = {}


def _tie_to(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher below still ends it

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(3)
    threading.Thread(target=watch, daemon=True, name="nbtrain-parent-watch").start()


def _memory_loader(worker: Any) -> bool:
    """Teach the worker's LoRA manager to build an adapter from tensors held here (`_tensors`) when a
    request's path is MEMORY: vLLM's own loader reads only folders. Runs inside vLLM's worker."""
    mgr = worker.model_runner.lora_manager
    if getattr(mgr, "_nbtrain_memory", False):
        return True
    from_disk = mgr._load_adapter

    def load(req: Any) -> Any:
        if not req.lora_path.startswith(MEMORY):
            return from_disk(req)
        from vllm.lora.peft_helper import PEFTHelper

        tensors, config = _tensors[req.lora_int_id]
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": mgr.max_position_embeddings}
        )
        helper.validate_legal(mgr.lora_config)
        model = mgr._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = mgr._lora_model_cls.from_lora_tensors(
            lora_model_id=req.lora_int_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=mgr.lora_config.lora_dtype,
            model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        lora.is_3d_lora_weight = req.is_3d_lora_weight
        return lora

    mgr._load_adapter = load
    mgr._nbtrain_memory = True
    return True


def _ram_folder() -> str:
    """Where adapters go as files when they cannot go in memory: RAM (/dev/shm) where there is one."""
    import tempfile

    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(root, f"nbtrain-vllm-{os.getpid()}")


class Worker:
    def __init__(self) -> None:
        self.llm: Any = None
        self.memory = False  # adapters as tensors (True), or as files in RAM (vLLM's own loader)

    def start(self, kwargs: dict) -> dict:
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        if kwargs.get("enable_lora") and os.environ.get("NBTRAIN_VLLM_LORA_FILES") != "1":
            try:
                self.llm.collective_rpc(_memory_loader)
                self.memory = True
            except (AttributeError, TypeError):
                # another vLLM's internals: its own loader, from files in RAM, still works
                log.info("adapters go to vLLM as files in RAM", exc_info=True)
        # one token now: a model vLLM cannot run (the CPU build's attention refuses head_dim 24) fails
        # the start, not the first rollout, and the first call's kernel set-up is paid here
        from vllm import SamplingParams

        self.llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1), use_tqdm=False)
        return {"seconds": time.perf_counter() - t0, "pid": os.getpid(), "memory": self.memory}

    def generate(self, prompts: list[list[int]], params: list[dict], lora: Any) -> list[tuple]:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        request = None
        if lora is not None:
            lora_id, path = lora
            request = LoRARequest(f"nbtrain-{lora_id}", lora_id, path)
        outs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            [SamplingParams(**p) for p in params],
            lora_request=request,
            use_tqdm=False,
        )
        got = []
        for o in outs:
            c = o.outputs[0]
            lps = None
            if c.logprobs is not None:
                lps = [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]
            got.append((list(c.token_ids), lps, c.finish_reason))
        return got

    def lora(self, lora_id: int, config: dict, blob: bytes) -> str:
        """The adapter `lora_id` ready for a request: the path its LoRARequest names."""
        if self.memory:
            from safetensors.torch import load

            _tensors[lora_id] = (load(blob), config)
            return f"{MEMORY}{lora_id}"
        import json

        from nbtrain.runs import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

        folder = os.path.join(_ram_folder(), str(lora_id))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, ADAPTER_WEIGHTS_FILE), "wb") as f:
            f.write(blob)
        with open(os.path.join(folder, ADAPTER_CONFIG_FILE), "w") as f:
            json.dump(config, f)
        return folder

    def drop_lora(self, lora_id: int) -> bool:
        import shutil

        _tensors.pop(lora_id, None)
        shutil.rmtree(os.path.join(_ram_folder(), str(lora_id)), ignore_errors=True)
        return bool(self.llm.llm_engine.remove_lora(lora_id))

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(_ram_folder(), ignore_errors=True)

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake(self) -> None:
        self.llm.wake_up()


def main() -> None:
    from multiprocessing.connection import Connection

    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _tie_to(parent)
    conn = Connection(fd)
    worker = Worker()
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):
            worker.cleanup()
            os._exit(0)  # the rank closed its end, or is gone
        if op == "stop":
            worker.cleanup()
            conn.send(("ok", None))
            os._exit(0)
        try:
            conn.send(("ok", getattr(worker, op)(*args)))
        except Exception as e:  # the traceback to this process's log, the error to the caller
            traceback.print_exc()
            sys.stderr.flush()
            conn.send(("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    main()
