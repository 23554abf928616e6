"""Samples while training (SFTConfig.sample_prompts): samples.jsonl, the live table, TensorBoard and
MLflow, and, above all, that sampling does not change training (losses and adapter bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import nbtrain
from nbtrain.data.examples import instructions_path
from nbtrain.errors import ConfigError
from nbtrain.live import LiveDisplay
from nbtrain.runs import SAMPLES_FILE
from tests.conftest import magic_cluster

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [
    "Add 12 and 30.",
    [{"role": "user", "content": "Say hi"}],
    {"prompt": "Name a colour.", "completion": " Blue."},
]
KEYS = ["step", "index", "prompt", "completion", "reference", "tokens", "seconds"]


def _cfg(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=instructions_path(),
        output_dir=str(out),
        max_steps=5,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_length=48,
        logging_steps=1,
        save_steps=None,
        lora_r=4,
        # dropout on: a generation that drew dropout masks would change the training after it
        lora_dropout=0.1,
        seed=5,
    )
    base.update(kw)
    return nbtrain.SFTConfig(**base)


def _samples(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / SAMPLES_FILE).read_text().splitlines()]


def _adapter(out):
    return load_file(str(Path(out) / "adapter" / "adapter_model.safetensors"))


def _same_training(a, b):
    assert list(a.history["loss"]) == list(b.history["loss"])  # bit for bit, not close
    assert list(a.history["grad_norm"]) == list(b.history["grad_norm"])
    x, y = _adapter(a.output_dir), _adapter(b.output_dir)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory):
    """The run without samples, once for the module."""
    return nbtrain.finetune(_cfg(tiny, tmp_path_factory.mktemp("plain") / "run"))


def test_sampling_does_not_change_training_and_writes_samples_jsonl(
    tiny, plain, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "samples")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sampled"
    sampled = nbtrain.finetune(
        _cfg(
            tiny,
            out,
            sample_prompts=PROMPTS,
            sample_steps=2,
            sample_max_new_tokens=6,
            report_to=["tensorboard", "mlflow"],
        )
    )
    _same_training(plain, sampled)

    rows = _samples(out)
    assert all(list(r) == KEYS for r in rows)
    assert [(r["step"], r["index"]) for r in rows] == [
        (s, i) for s in (0, 2, 4, 5) for i in range(3)
    ]
    assert rows[1]["prompt"] == "user: Say hi"
    assert [r["reference"] for r in rows[:3]] == [None, None, " Blue."]
    assert all(1 <= r["tokens"] <= 6 and r["seconds"] > 0 for r in rows)
    # step 0 is the base model (LoRA B starts at zero): the same text nbtrain.generate gives
    base = nbtrain.generate(PROMPTS, model=tiny, max_new_tokens=6)
    assert [r["completion"] for r in rows[:3]] == list(base.completion)
    # the final adapter's samples are what generate gives with it
    last = nbtrain.generate(PROMPTS, adapter=sampled, max_new_tokens=6)
    assert [r["completion"] for r in rows[-3:]] == list(last.completion)

    # its time has a column of its own, in the rows of the steps it ran after (step 0: the first row)
    h = sampled.history.set_index("step")
    assert sorted(h["sample_seconds"].dropna().index) == [1, 2, 4, 5]
    assert "sample_seconds" not in plain.history

    # TensorBoard: a text table per sampled step; MLflow: samples.jsonl as an artifact
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "runs"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [0, 2, 4, 5]
    assert "Blue." in texts[0].tensor_proto.string_val[0].decode()
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert SAMPLES_FILE in [a.path for a in MlflowClient().list_artifacts(run_id)]


def test_a_resumed_run_keeps_the_samples_before_its_checkpoint(tiny, tmp_path):
    out = tmp_path / "run"
    kw = dict(sample_prompts=PROMPTS[:2], sample_steps=2, sample_max_new_tokens=3, save_steps=2)
    nbtrain.finetune(_cfg(tiny, out, max_steps=3, **kw))
    assert sorted({r["step"] for r in _samples(out)}) == [0, 2, 3]
    # resume from checkpoint-2 (of 3) onwards to 5: step 3's samples are redone, not doubled
    nbtrain.finetune(_cfg(tiny, out, max_steps=5, resume=str(out / "checkpoint-2"), **kw))
    steps = [r["step"] for r in _samples(out)]
    assert steps == [s for s in (0, 2, 4, 5) for _ in range(2)]


def test_bad_sample_settings_are_refused_where_the_config_is_built(tiny, tmp_path):
    with pytest.raises(ConfigError, match="sample_steps=3 needs sample_prompts"):
        _cfg(tiny, tmp_path, sample_steps=3)
    with pytest.raises(ConfigError, match=r"sample_prompts\[0\] is not a prompt"):
        _cfg(tiny, tmp_path, sample_prompts=[{"question": "?"}])
    with pytest.raises(ConfigError, match="sample_prompts file 'nope.jsonl' not found"):
        _cfg(tiny, tmp_path, sample_prompts="nope.jsonl")
    with pytest.raises(ConfigError, match="sample_max_new_tokens=0 must be an integer >= 1"):
        _cfg(tiny, tmp_path, sample_prompts=["hi"], sample_max_new_tokens=0)


def test_the_live_display_draws_each_prompts_completion_by_step_newest_first():
    d = LiveDisplay()
    d.feed({"kind": "begin", "total_steps": 10, "name": "s"})
    rows = lambda text: [  # noqa: E731
        {"index": 0, "prompt": "Add <2>", "completion": text, "reference": "4", "tokens": 2},
        {"index": 1, "prompt": "Hi", "completion": text + "!", "reference": None, "tokens": 1},
    ]
    d.feed({"kind": "samples", "step": 0, "rows": rows("zero")})
    d.feed({"kind": "row", "row": {"step": 1, "loss": 2.0}})
    d.feed({"kind": "samples", "step": 5, "rows": rows("five")})
    page = d.bundle()["text/html"]
    assert page.index("step 5") < page.index("step 0")  # newest first
    assert page.index("five") < page.index("zero")
    assert "Add &lt;2&gt;" in page and "<th style='text-align:left'>reference</th>" in page
    final = d.bundle(final=True)
    assert "samples at step 5" in final["text/plain"] and "five!" in final["text/html"]


@pytest.fixture(scope="module")
def two(ip):
    with magic_cluster(ip, 2) as c:
        c.execute("import torch; torch.set_num_threads(1); import nbtrain", output="none")
        yield c


def test_two_ranks_ddp_and_fsdp_sample_without_changing_training(two, tiny, tmp_path):
    kw = dict(
        model=tiny,
        data=instructions_path(),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_length=48,
        logging_steps=1,
        save_steps=None,
        lora_r=4,
        lora_dropout=0.1,
        seed=5,
    )
    samples = dict(sample_prompts=PROMPTS, sample_steps=2, sample_max_new_tokens=4)
    two.push({"kw": kw, "samples": samples, "root": str(tmp_path)})
    two.execute(
        "plain = nbtrain.finetune(nbtrain.SFTConfig(output_dir=root + '/plain', **kw))\n"
        "sampled = nbtrain.finetune(nbtrain.SFTConfig(output_dir=root + '/sampled', **kw, **samples))\n"
        "fsdp = nbtrain.finetune(nbtrain.SFTConfig(output_dir=root + '/fsdp', shard='fsdp', **kw, "
        "**samples))"
    )
    plain, sampled = two.pull("plain", ranks=0)[0], two.pull("sampled", ranks=0)[0]
    _same_training(plain, sampled)
    ddp_rows, fsdp_rows = _samples(tmp_path / "sampled"), _samples(tmp_path / "fsdp")
    assert [(r["step"], r["index"]) for r in ddp_rows] == [
        (s, i) for s in (0, 2, 3) for i in range(3)
    ]
    # FSDP's samples are generated by the sharded model on both ranks (synced decoding)
    assert [(r["step"], r["index"]) for r in fsdp_rows] == [
        (r["step"], r["index"]) for r in ddp_rows
    ]
    assert [r["completion"] for r in fsdp_rows[:3]] == [r["completion"] for r in ddp_rows[:3]]
