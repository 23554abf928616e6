"""tinker-cookbook 0.6.1's recipes, unchanged, against nbtrain's Tinker service on 2 local CPU ranks.

The recipes run as the user runs them, `python -m tinker_cookbook.recipes...` in a process of their own with
TINKER_BASE_URL and TINKER_API_KEY, against one cluster and one server for the module. The model is a tiny
Llama built from a config with a Llama-3-style tokenizer (the recipes' `renderer_name=llama3`): nothing is
downloaded. What is checked is what the cookbook's own logs say: its exit status, `metrics.jsonl` and
`checkpoints.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker", minversion="0.38.0")
cookbook = pytest.importorskip("tinker_cookbook")

import nbtrain  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]

CONVERSATIONS = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
# the Llama 3 renderer's special tokens (tinker_cookbook/renderers/llama3.py), single tokens here as there
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
RECIPE_TIMEOUT = 240


def _corpus():
    with open(CONVERSATIONS) as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["role"]
                yield m["content"]
    for i in range(200):  # the arithmetic environment's questions and answers
        yield f"What is {i} + {i * 7 % 100}? {i + i * 7 % 100}"


def make_llama3_model(path: Path) -> str:
    """nbtrain's tiny Llama (random weights, built from a config) with Llama 3's chat tokens added."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbtrain.model.tiny import _quiet_saves, make_tiny_model

    make_tiny_model(path, corpus=_corpus())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    for c in (model.config, model.generation_config):
        c.bos_token_id, c.eos_token_id = tok.bos_token_id, tok.eos_token_id
    with _quiet_saves():
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_llama3_model(tmp_path_factory.mktemp("llama3") / "model")


@pytest.fixture(scope="module")
def service():
    cluster = nbtrain.start(n=2, force=True)
    try:
        cluster.execute("import torch; torch.set_num_threads(1)", output="none")
        svc = cluster.serve_tinker()
        try:
            yield svc
        finally:
            svc.stop()
    finally:
        cluster.stop()


def recipe(svc, module: str, log_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m tinker_cookbook.recipes.<module>.train` as a user runs it from a terminal."""
    env = dict(os.environ)
    env.update(
        TINKER_BASE_URL=svc.url,
        TINKER_API_KEY=svc.api_key or "tml-nbtrain-test",
        TINKER_TELEMETRY="0",
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", f"tinker_cookbook.recipes.{module}.train", f"log_path={log_path}"]
    proc = subprocess.run(
        cmd + list(args), env=env, capture_output=True, text=True, timeout=RECIPE_TIMEOUT
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd + list(args))} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    )
    return proc


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_chat_sl_trains_and_saves_a_final_checkpoint(service, model, tmp_path):
    log = tmp_path / "chat_sl"
    recipe(
        service,
        "chat_sl",
        log,
        f"model_name={model}",
        "renderer_name=llama3",
        f"dataset={CONVERSATIONS}",
        "batch_size=16",
        "max_length=128",
        "lora_rank=8",
        "learning_rate=1e-2",
        "lr_schedule=constant",
        "max_steps=6",
        "save_every=3",
        "eval_every=0",
        "infrequent_eval_every=0",
        "behavior_if_log_dir_exists=delete",
    )
    metrics = [r for r in rows(log / "metrics.jsonl") if "train_mean_nll" in r]
    nll = [r["train_mean_nll"] for r in metrics]
    assert len(nll) == 6, metrics
    assert all(math.isfinite(x) for x in nll), nll
    # six batches of different conversations: compare the ends, not each step
    assert sum(nll[-2:]) < sum(nll[:2]), nll
    final = rows(log / "checkpoints.jsonl")[-1]
    assert final["name"] == "final", final
    assert final["state_path"].startswith("tinker://"), final
    assert final["sampler_path"].startswith("tinker://"), final


# the mean reward of the step's episodes, as math_rl logs it (every environment's `reward/total`)
REWARD = "env/all/reward/total"
RL_ARGS = (
    "env=arithmetic",
    "loss_fn=importance_sampling",
    "renderer_name=llama3",
    "lora_rank=8",
    "group_size=4",
    "groups_per_batch=4",
    "max_tokens=5",
    "learning_rate=1e-3",
    "eval_every=0",
    "save_every=1",
)


def final_trained(log: Path) -> int:
    return rows(log / "checkpoints.jsonl")[-1]["cumulative_tokens"]["trained"]


@pytest.fixture(scope="module")
def rl_run(service, model, tmp_path_factory) -> Path:
    log = tmp_path_factory.mktemp("math_rl") / "log"
    recipe(
        service,
        "math_rl",
        log,
        f"model_name={model}",
        *RL_ARGS,
        "max_steps=2",
        "behavior_if_log_dir_exists=delete",
    )
    return log


def test_math_rl_importance_sampling_reports_rewards(rl_run):
    metrics = rows(rl_run / "metrics.jsonl")
    rewarded = [r for r in metrics if REWARD in r]
    assert [r["step"] for r in rewarded] == [0, 1], metrics
    assert all(math.isfinite(r[REWARD]) for r in rewarded), rewarded
    # the steps trained: the recipe counts the tokens it sent to forward_backward
    assert final_trained(rl_run) > 0
    final = rows(rl_run / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["batch"] == 2, final
    assert final["state_path"].startswith("tinker://"), final


def test_math_rl_resumes_from_its_checkpoint(service, model, rl_run, tmp_path):
    # a copy of the first run's log folder: the resumed run appends to it, and
    # test_math_rl_importance_sampling_reports_rewards reads the first run's whichever runs first
    log = tmp_path / "log"
    shutil.copytree(rl_run, log)
    before = final_trained(log)
    proc = recipe(
        service,
        "math_rl",
        log,
        f"model_name={model}",
        *RL_ARGS,
        "max_steps=4",
        "behavior_if_log_dir_exists=resume",
    )
    said = proc.stdout + proc.stderr
    assert "Resumed training from tinker://" in said, said[-3000:]
    rewarded = [r for r in rows(log / "metrics.jsonl") if REWARD in r]
    # the first run's steps kept, the resumed run's appended from its checkpoint's batch
    assert [r["step"] for r in rewarded] == [0, 1, 2, 3], rewarded
    final = rows(log / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["batch"] == 4, final
    # the token totals went on from the checkpoint's: two more steps trained on top
    assert final_trained(log) > before
