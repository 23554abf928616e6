"""engine="vllm" against engine="hf" in one process (the test is the rank): greedy tokens equal for the
base and base + adapter (from a folder and from a peft model in memory), stop strings and ids alike,
and after k optimizer steps vLLM's log-probabilities of sampled completions equal the training model's.
One vLLM engine for the module (a start is 12 s on a quiet machine, 70-90 s on a loaded one); the test
that kills it runs last. Runs in the vLLM venv only (make test-vllm); elsewhere it skips, saying why.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.generation.vllm_fixtures import (
    HAVE_VLLM,
    SKIP_REASON,
    lora_adapter,
    say_skip,
    tiny_head64,
)

say_skip()
pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON),
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("one_torch_thread"),
]

CPU = torch.device("cpu")
TEXTS = [
    "Hi",
    "Add 12 and 30, then tell me a long story about a fox and a crow in a wood. " * 3,
    "What is the capital",
    "x",
    "One two three four five six",
]
# log-probabilities: both engines compute in float32 on the CPU; measured differences are ~3e-6
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbtrain.generation import decode, engines

    root = tmp_path_factory.mktemp("vllm")
    base = tiny_head64(root)
    adapter = lora_adapter(base, root / "adapter")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = [decode.Prompt(i, t, tok(t)["input_ids"]) for i, t in enumerate(TEXTS)]
    t0 = time.perf_counter()
    eng = engines.make(
        "vllm",
        model_path=base,
        tokenizer=tok,
        device=CPU,
        lora=engines.LoraSpec(r=8),
        rank=0,
        host=socket.gethostname(),
    )
    print(f"\nvLLM engine started in {time.perf_counter() - t0:.1f} s")
    yield {
        "base": base,
        "adapter": adapter,
        "tok": tok,
        "model": model,
        "prompts": prompts,
        "eng": eng,
    }
    eng.close()


def _hf(model, tok, prompts, decoding, logprobs=False):
    from nbtrain.generation import engines

    return engines.make("hf", model=model, tokenizer=tok, device=CPU).generate(
        prompts, decoding, logprobs=logprobs
    )


def test_greedy_base_equals_hf_token_for_token(setup):
    from nbtrain.generation import decode

    dec = decode.Decoding(max_new_tokens=24, batch_size=3)
    want = _hf(setup["model"], setup["tok"], setup["prompts"], dec)
    setup["eng"].set_adapter(None)
    got = setup["eng"].generate(setup["prompts"], dec)
    assert [c.index for c in got] == [c.index for c in want]
    assert [c.ids for c in got] == [c.ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    # the test model's greedy output is not one repeated token
    assert len({t for c in want for t in c.ids}) > 10


def test_greedy_adapter_equals_hf_from_a_folder_and_from_memory(setup):
    from peft import PeftModel

    from nbtrain.generation import decode

    dec = decode.Decoding(max_new_tokens=24)
    base = _hf(setup["model"], setup["tok"], setup["prompts"], dec)
    # peft puts its layers into the module's model: unload() below takes them out again
    tuned = PeftModel.from_pretrained(setup["model"], setup["adapter"]).eval()
    want = _hf(tuned, setup["tok"], setup["prompts"], dec, logprobs=True)
    assert [c.ids for c in want] != [c.ids for c in base]  # the adapter changes the output
    eng = setup["eng"]
    eng.set_adapter(setup["adapter"])
    from_folder = eng.generate(setup["prompts"], dec, logprobs=True)
    assert [c.ids for c in from_folder] == [c.ids for c in want]
    eng.set_adapter(tuned)  # the peft model's weights, in memory
    from_memory = eng.generate(setup["prompts"], dec, logprobs=True)
    assert [c.ids for c in from_memory] == [c.ids for c in want]
    for a, b in zip(from_memory, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_ATOL, rtol=0
        )
    print(f"\nset_adapter (peft model in memory): {eng.lora_seconds[-1] * 1000:.1f} ms")
    tuned.unload()


def test_stop_strings_and_ids_stop_both_engines_alike(setup):
    from nbtrain.generation import decode

    tok, eng = setup["tok"], setup["eng"]
    eng.set_adapter(None)
    free = _hf(setup["model"], tok, setup["prompts"], decode.Decoding(max_new_tokens=24))
    # a stop id and a stop string taken from the middle of two completions, so they do stop them;
    # the string whole characters (two tokens cut inside one decode to a U+FFFD, which the text of a
    # completion cut there does not keep)
    stop_id = free[1].ids[5]
    stop_text = next(
        text
        for i in range(6, 20)
        if (text := tok.decode(free[2].ids[i : i + 2], skip_special_tokens=True).strip())
        and "\ufffd" not in text
    )
    dec = decode.Decoding(max_new_tokens=24, stop=(stop_text,), stop_token_ids=(stop_id,))
    want = _hf(setup["model"], tok, setup["prompts"], dec)
    got = eng.generate(setup["prompts"], dec)
    assert [c.ids for c in got] == [c.ids for c in want]
    assert [c.stopped for c in got] == [c.stopped for c in want]
    assert len(want[1].ids) <= 6 and want[1].stopped
    assert stop_text in want[2].text and len(want[2].ids) < 24


def _train_logprobs(model, prompt_ids, completion_ids):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


def test_logprobs_of_sampled_completions_equal_the_training_models_after_each_step(setup):
    """The adapter changes in memory after every optimizer step; vLLM, given it, scores its sampled
    tokens as the training model does (GRPO's importance ratio), and before it is given the new
    adapter it does not (so the check would catch an engine that kept the old one)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from nbtrain.generation import decode

    tok, eng = setup["tok"], setup["eng"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(setup["base"], dtype=torch.float32),
            LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
        )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    batch = tok(["Add 12 and 30. The answer is 42."] * 2, return_tensors="pt")
    dec = decode.Decoding(max_new_tokens=16, do_sample=True, temperature=1.0, seed=3)
    prompts = setup["prompts"]
    eng.set_adapter(model)
    worst = 0.0
    for step in range(3):
        model.train()
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        stale = eng.generate(prompts, dec, logprobs=True)
        gaps = [
            (torch.tensor(c.logprobs) - _train_logprobs(model, p.ids, c.ids)).abs().max().item()
            for p, c in zip(prompts, stale, strict=True)
        ]
        assert max(gaps) > 1e-3, f"step {step}: the old adapter scores like the new one"
        eng.set_adapter(model)
        got = eng.generate(prompts, dec, logprobs=True)
        assert all(c.ids and len(c.logprobs) == len(c.ids) for c in got)
        for p, c in zip(prompts, got, strict=True):
            want = _train_logprobs(model, p.ids, c.ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=LOGPROB_ATOL, rtol=0)
            worst = max(worst, (torch.tensor(c.logprobs) - want).abs().max().item())
    print(f"\nlog-prob difference vLLM vs training model, 3 steps: max {worst:.2e}")


def test_a_vllm_that_fails_to_start_is_named_with_its_log(setup, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from nbtrain.generation import engines

    cfg = AutoConfig.from_pretrained(setup["base"])
    cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads = 48, 2, 1  # head_dim 24
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m24")
    setup["tok"].save_pretrained(tmp_path / "m24")
    with pytest.raises(engines.EngineError) as e:
        engines.make(
            "vllm", model_path=str(tmp_path / "m24"), tokenizer=setup["tok"], device=CPU, host="h1"
        )
    msg = str(e.value)
    assert "vLLM engine on rank 0 (h1) failed to start" in msg
    # the cause: vLLM's CPU attention loads the model but refuses head_dim 24 on its first token,
    # which the engine's start generates
    assert "Unsupported CPU attention configuration: head_dim=24" in msg
    assert 'engine="hf"' in msg
    # its log's tail, kept on disk: vLLM's own traceback
    log, tail = msg.split("Its log, ")[1].split(", ends:\n")
    assert Path(log).is_file()
    assert 'File "' in tail and "head_dim=24" in tail


def test_the_kept_engine_is_reused_only_for_what_it_was_started_for(setup):
    """`vllm_engine.kept`, which generate, samples and GRPO's rollouts share: the rank's live engine is
    handed back where the base, the device, the room for the LoRA and the start options asked for match
    (dtype "auto" is float32 on a CPU), else it would be ended and another started. Checked on the
    module's engine, so nothing starts here."""
    from nbtrain.generation import engines, vllm_engine

    eng, base = setup["eng"], setup["base"]
    fits = vllm_engine._fits
    assert fits(eng, base, CPU, 8, None)
    assert fits(eng, base, CPU, 0, engines.VLLMOptions(dtype="float32", start_timeout=5))
    assert not fits(eng, base, CPU, 8, engines.VLLMOptions(dtype="bfloat16"))
    assert not fits(eng, base, CPU, 8, engines.VLLMOptions(cpu_kv_cache_gib=2))
    assert not fits(eng, base, CPU, 32, None)  # started with max LoRA rank 8
    assert not fits(eng, base + "-other", CPU, 0, None)
    assert not fits(eng, base, torch.device("cuda", 0), 0, None)
    vllm_engine._kept["engine"] = eng
    try:
        spec = engines.LoraSpec(r=4, alpha=8, target_modules=["q_proj"])
        got = vllm_engine.kept(base, setup["tok"], CPU, spec, 0, "h", engines.VLLMOptions())
        assert got is eng and vllm_engine.current() is eng
    finally:
        vllm_engine._kept.pop("engine", None)  # the module's engine is the fixture's to close


def test_run_generate_with_vllm_equals_hf_on_the_weights_as_they_are(setup, tmp_path):
    """nbtrain.Run.generate(engine="vllm") takes the rank's kept engine (the module's: nothing starts),
    sends it the adapter as trained so far, and gives the greedy table engine="hf" gives."""
    import nbtrain
    from nbtrain.data.examples import instructions_path
    from nbtrain.generation import vllm_engine

    cfg = nbtrain.SFTConfig(
        model=setup["base"], data=instructions_path(), output_dir=str(tmp_path / "run"), max_steps=4,
        per_device_train_batch_size=4, learning_rate=5e-2, max_length=64, save_steps=None, lora_r=8,
    )  # fmt: skip
    run = nbtrain.Run(cfg)
    vllm_engine._kept["engine"] = setup["eng"]
    try:
        run.train(steps=2)
        kw = dict(max_new_tokens=12, batch_size=2)
        hf = run.generate(TEXTS, **kw)
        got = run.generate(TEXTS, engine="vllm", **kw)
        assert vllm_engine.current() is setup["eng"] and setup["eng"].lora is not None
        assert run.model.training  # the run's train mode is back
        assert got["completion"].tolist() == hf["completion"].tolist()
        assert got["tokens"].tolist() == hf["tokens"].tolist()
        base = nbtrain.generate(TEXTS, model=setup["base"], **kw)
        assert got["completion"].tolist() != base["completion"].tolist()  # the adapter counts
    finally:
        vllm_engine._kept.pop("engine", None)  # the module's engine is the fixture's to close
        run.close()


def test_the_vllm_process_dies_with_its_rank():
    """The worker, started by a process that is then SIGKILLed, ends by itself (PR_SET_PDEATHSIG)."""
    code = (
        "import os, socket, subprocess, sys, time\n"
        "a, b = socket.socketpair()\n"
        "p = subprocess.Popen([sys.executable, '-m', 'nbtrain.generation.vllm_worker',"
        " str(b.fileno()), str(os.getpid())], pass_fds=(b.fileno(),), start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    time.sleep(1.0)
    assert _alive(worker)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the vLLM worker outlived its rank"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_zz_a_vllm_that_dies_is_named_and_the_rank_goes_on(setup):
    """Last in the module: it kills the module's engine."""
    from nbtrain.generation import decode, engines

    eng = setup["eng"]
    os.kill(eng.pid, signal.SIGKILL)
    with pytest.raises(engines.EngineError) as e:
        eng.generate(setup["prompts"], decode.Decoding(max_new_tokens=4))
    msg = str(e.value)
    assert "vLLM engine on rank 0" in msg and "died during generate" in msg
    assert f"its process {eng.pid} exited with -9" in msg
    with pytest.raises(engines.EngineError, match="is closed; make a new one"):
        eng.generate(setup["prompts"], decode.Decoding(max_new_tokens=4))
    # the rank itself is fine: hf generates
    assert _hf(setup["model"], setup["tok"], setup["prompts"], decode.Decoding(max_new_tokens=4))
