"""finetune on a sub-group of a running 4-rank gloo cluster (`finetune(cfg, group=...)`): ranks 0-1
train exactly as a 2-rank cluster would, ranks 2-3 take no part, and a rank outside is refused.
`generate` on a sub-group under FSDP gives the whole model's tokens, with ranks 2-3 idle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nbtrain.configs.sft import SFTConfig
from nbtrain.generation.utf8 import decode_completion
from nbtrain.recipes.train import finetune
from tests.generation.test_generate import NEW, PROMPTS, models, refs  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
DATA = str(REPO / "nbtrain" / "data" / "examples" / "instructions.jsonl")

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def cluster(gloo4):
    return gloo4


def _kw(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=DATA,
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        max_length=48,
        logging_steps=1,
        save_steps=None,
        lora_r=8,
        lora_dropout=0.0,
        seed=3,
    )
    base.update(kw)
    return base


def _losses(history):
    return torch.tensor([row["loss"] for row in history], dtype=torch.float32)


def test_finetune_on_a_sub_group_equals_a_two_rank_run(ip, cluster, tiny, tmp_path):
    cluster.groups(pair="0-1")
    cluster.push({"kw": _kw(tiny, tmp_path / "pair"), "res": None})
    cluster.execute(
        "import nbtrain\n"
        "from nbtrain.telemetry import commtime\n"
        "with commtime.timing() as timer:\n"
        "    r = nbtrain.finetune(nbtrain.SFTConfig(**kw), group=group)\n"
        "res = {'history': r.history.to_dict(orient='records'), 'adapter': r.adapter_dir,\n"
        "       'plan': r.plan, 'comm': timer.steps(), 'grad_bytes': timer.grad_bytes}\n",
        group="pair",
        output="none",
    )
    got = cluster.pull("res")
    # ranks 2 and 3 did nothing
    assert got[2] is None and got[3] is None
    # two ranks of 2 rows: a global batch of 4
    assert got[0]["plan"]["global_batch"] == 4 and got[1]["plan"]["global_batch"] == 4
    assert got[0]["adapter"] == str(tmp_path / "pair" / "adapter") and got[1]["adapter"] is None
    assert [r["step"] for r in got[0]["history"]] == [1, 2, 3, 4]
    # the all-reduce of every step was timed, on both ranks: LoRA's gradients in one DDP bucket
    for rank in (0, 1):
        comm = got[rank]["comm"]
        assert len(comm) == 4 and all(c["buckets"] == 1 for c in comm)
        assert all(0 < c["wait_s"] <= c["span_s"] for c in comm)
        assert all(c["wait_s"] < r["step_time"] for c, r in zip(comm, got[rank]["history"]))
    # float32 LoRA A and B of r=8 on the tiny model's projections: a few hundred KiB at most
    assert 0 < got[0]["grad_bytes"] == got[1]["grad_bytes"] < 2**20
    # 2 ranks x 2 rows train as 1 rank x 4 rows (tests/recipes/test_distributed.py shows a 2-rank
    # cluster does the same)
    one = finetune(SFTConfig(**_kw(tiny, tmp_path / "one", per_device_train_batch_size=4)))
    torch.testing.assert_close(_losses(got[0]["history"]), _losses(one.history.to_dict("records")))
    assert (
        json.loads((tmp_path / "pair" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    )
    # the group's rank 0 wrote the run folder, no other rank wrote anything
    assert sorted(p.name for p in (tmp_path / "pair").iterdir()) == [
        "adapter",
        "metrics.jsonl",
        "sft_config.json",
    ]


def test_a_rank_outside_the_group_is_refused(ip, cluster, tiny, tmp_path):
    cluster.groups(pair="0-1")
    cluster.push({"kw": _kw(tiny, tmp_path / "never")}, ranks=[2, 3])
    cluster.execute(
        "import nbtrain\n"
        "from nbtrain.errors import ConfigError\n"
        "try:\n"
        "    nbtrain.finetune(nbtrain.SFTConfig(**kw), group=groups['pair'])\n"
        "    refused = None\n"
        "except ConfigError as e:\n"
        "    refused = str(e)\n",
        ranks=[2, 3],
        output="none",
    )
    refused = cluster.pull("refused", ranks=[2, 3])
    assert all("not a member" in r for r in refused), refused
    assert not (tmp_path / "never").exists()


def _stopping_model(base_dir: str, out: Path) -> tuple[str, list[str], list[int]]:
    """The test base with a second end-of-sequence token, the one its greedy completions produce
    most, so that several stop early; with transformers' own completions and token counts."""
    from collections import Counter

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.generation.test_generate import _reference_ids

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = [_reference_ids(tok, p) for p in PROMPTS]

    def greedy(i):
        out = model.generate(
            ids[i], attention_mask=torch.ones_like(ids[i]), max_new_tokens=NEW, do_sample=False
        )
        return out[0, ids[i].shape[1] :].tolist()

    seen = Counter(t for i in range(len(PROMPTS)) for t in greedy(i)[: NEW - 1])
    stop = seen.most_common(1)[0][0]
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    texts, counts = [], []
    for i in range(len(PROMPTS)):
        gen = greedy(i)
        n = next((k + 1 for k, t in enumerate(gen) if t in (tok.eos_token_id, stop)), len(gen))
        # the text of these ids as every writer of a completion decodes it: less the half character a
        # length cut leaves (tests/generation/test_utf8.py checks that rule on its own)
        texts.append(decode_completion(tok, gen[:n]))
        counts.append(n)
    return str(out), texts, counts


def test_fsdp_generate_on_a_sub_group_gives_the_whole_models_tokens(ip, cluster, request, tmp_path):
    # test_generate's models and references (its fixtures, imported above)
    paths, ref = request.getfixturevalue("models"), request.getfixturevalue("refs")
    stops, texts, counts = _stopping_model(paths["base"], tmp_path / "stops")
    # the test can tell: completions that end at an eos before N tokens, beside ones that run to N
    assert any(n < NEW for n in counts) and any(n == NEW for n in counts), counts
    # transformers' synced decoding all-reduces over every rank, which would wait for ranks 2-3
    # forever: on a sub-group each rank decodes the full length and cuts at the eos itself
    cluster.groups(pair="0-1")
    cluster.push({"P": PROMPTS, "M": paths, "S": stops, "N": NEW, "fs": None, "st": None})
    cluster.execute(
        "import nbtrain\n"
        "fs = nbtrain.generate(P, model=M['base'], adapter=['base', M['adapter']], shard='fsdp',\n"
        "                      max_new_tokens=N, batch_size=3, group=group)\n"
        "st = nbtrain.generate(P, model=S, shard='fsdp', max_new_tokens=N, batch_size=3,\n"
        "                      group=group)\n",
        group="pair",
        output="none",
        timeout=300,
    )
    fs, st = cluster.pull("fs"), cluster.pull("st")
    assert fs[1:] == [None] * 3 and st[1:] == [None] * 3
    assert list(fs[0]["base"]) == ref["base"][0]
    assert list(fs[0]["tokens_base"]) == ref["base"][1]
    assert list(fs[0]["run"]) == ref["adapter"][0]
    assert list(fs[0]["tokens_run"]) == ref["adapter"][1]
    assert list(st[0]["completion"]) == texts
    assert list(st[0]["tokens"]) == counts
