"""DPO on a real 2-rank local cluster (gloo): 2 ranks x 2 pairs train as 1 process x 4 pairs, the reward
metrics are reduced over both ranks, and a run resumed from its checkpoint ends as the uninterrupted one.

One cluster for the module; the runs are tiny (8 and 6 steps of a 110K-parameter model).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import nbtrain
from nbtrain.data.examples import preferences_path
from nbtrain.losses.dpo import METRICS

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def cluster():
    c = nbtrain.start(n=2, force=True)
    try:
        c.execute("import torch; torch.set_num_threads(1)", output="none")
        yield c
    finally:
        c.stop()


def _cfg(model, out, batch, **kw):
    return {
        "model": str(model),
        "data": preferences_path(),
        "output_dir": str(out),
        "max_steps": 8,
        "per_device_train_batch_size": batch,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "save_steps": None,
        "max_length": 64,
        "data_cache": "off",
        "seed": 7,
        **kw,
    }


def _on_cluster(cluster, kw):
    cluster.push({"dpo_kwargs": kw})
    cluster.execute("import nbtrain\nresult = nbtrain.finetune(nbtrain.DPOConfig(**dpo_kwargs))")
    return cluster.pull("result")


def _adapter(out):
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _close_adapters(a, b):
    assert a.keys() == b.keys()
    for key in a:
        # Adam magnifies float rounding in near-zero gradients; values agree to ~1e-5
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-3)


def _eval_rows(n=5):
    """`n` pairs of the shipped data to evaluate on: 5 split 3 and 2 over two ranks."""
    import json

    return [json.loads(x) for x in open(preferences_path()).read().splitlines()[-n:]]


EVAL_KEYS = ("eval_loss", *(f"eval_{k}" for k in METRICS))


def test_two_ranks_equal_one_process_with_double_batch(cluster, tiny, tmp_path):
    kw = {"eval_data": _eval_rows(), "eval_steps": 4}
    ref = nbtrain.finetune(nbtrain.DPOConfig(**_cfg(tiny, tmp_path / "one", 4, **kw)))
    results = _on_cluster(cluster, _cfg(tiny, tmp_path / "two", 2, **kw))
    assert results[0].adapter_dir == str(tmp_path / "two" / "adapter")
    assert results[1].adapter_dir is None  # only rank 0 exports
    two, one = results[0].history, ref.history
    # every rank logs the same rows: the metrics are reduced over both ranks' pairs
    assert two.dropna(subset=["eval_loss"])["step"].to_list() == [4, 8]
    for k in ("loss", *METRICS, *EVAL_KEYS):
        torch.testing.assert_close(
            torch.tensor(two[k].to_list()),
            torch.tensor(one[k].to_list()),
            rtol=1e-4,
            atol=1e-5,
            equal_nan=True,  # the eval columns hold values at steps 4 and 8 only
        )
        torch.testing.assert_close(
            torch.tensor(results[1].history[k].to_list()),
            torch.tensor(two[k].to_list()),
            equal_nan=True,
        )
    # the policy moved away from the reference: equal rows of zeros would prove nothing
    assert float(one["rewards/margins"].abs().max()) > 1e-3
    _close_adapters(_adapter(tmp_path / "one"), _adapter(tmp_path / "two"))


def test_resume_equals_uninterrupted(cluster, tiny, tmp_path):
    """2 ranks, reference log-probs precomputed: 6 steps straight, and 6 steps resumed from step 3's
    checkpoint of the same run in another folder, log the same rows 4-6 and export the same adapter."""
    kw = {"max_steps": 6, "save_steps": 3, "precompute_ref_log_probs": True, "loss_type": "ipo"}
    straight = _on_cluster(cluster, _cfg(tiny, tmp_path / "straight", 2, **kw))[0]
    resumed = _on_cluster(
        cluster,
        _cfg(
            tiny,
            tmp_path / "resumed",
            2,
            **{**kw, "resume": str(tmp_path / "straight" / "checkpoint-3")},
        ),
    )[0]
    assert resumed.global_step == straight.global_step == 6
    a, b = straight.history, resumed.history
    b = b[b["step"] > 3]
    assert b["step"].to_list() == [4, 5, 6]
    for k in ("loss", *METRICS):
        torch.testing.assert_close(
            torch.tensor(b[k].to_list()),
            torch.tensor(a[a["step"] > 3][k].to_list()),
            rtol=1e-4,
            atol=1e-5,
        )
    _close_adapters(_adapter(tmp_path / "straight"), _adapter(tmp_path / "resumed"))


def test_fsdp_equals_ddp(cluster, tiny, tmp_path):
    """shard='fsdp' on 2 ranks (each rank holds half the base; the reference forward without the adapter
    gathers the weights as the policy's does) logs what DDP logs."""
    rows = {}
    for shard in ("ddp", "fsdp"):
        out = tmp_path / shard
        kw = {"max_steps": 4, "shard": shard, "eval_data": _eval_rows()}
        result = _on_cluster(cluster, _cfg(tiny, out, 2, **kw))[0]
        rows[shard] = result.history
        if shard == "fsdp":
            assert "fsdp over 2 rank(s)" in result.plan["levers"]
            held, total = result.plan["base_params_held"]
            assert held < total
    for k in ("loss", *METRICS, *EVAL_KEYS):
        torch.testing.assert_close(
            torch.tensor(rows["fsdp"][k].to_list()),
            torch.tensor(rows["ddp"][k].to_list()),
            rtol=1e-4,
            atol=1e-5,
            equal_nan=True,
        )
    _close_adapters(_adapter(tmp_path / "ddp"), _adapter(tmp_path / "fsdp"))


def test_an_epochs_short_last_step(cluster, tiny, tmp_path):
    """9 pairs, 2 ranks x 2: the last step has one pair, so rank 1 trains on a stand-in pair that counts
    for nothing (it still joins the gradient all-reduce); the run equals one process of 4 pairs a step."""
    import json

    rows = [json.loads(x) for x in open(preferences_path()).read().splitlines()[:9]]
    kw = {"data": rows, "max_steps": -1, "num_train_epochs": 1}
    one = nbtrain.finetune(nbtrain.DPOConfig(**_cfg(tiny, tmp_path / "one", 4, **kw))).history
    two = _on_cluster(cluster, _cfg(tiny, tmp_path / "two", 2, **kw))[0].history
    assert two["step"].to_list() == [1, 2, 3]
    for k in ("loss", *METRICS):
        torch.testing.assert_close(
            torch.tensor(two[k].to_list()), torch.tensor(one[k].to_list()), rtol=1e-4, atol=1e-5
        )
    _close_adapters(_adapter(tmp_path / "one"), _adapter(tmp_path / "two"))
