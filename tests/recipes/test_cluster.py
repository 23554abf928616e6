"""finetune through nbtrain's own cluster: 2 engines in a %%distributed cell equal 1 plain process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import nbtrain
from nbtrain.data.examples import instructions_path
from nbtrain.model.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(300)


def _cfg(model, out, batch):
    return dict(
        model=str(model),
        data=instructions_path(),
        output_dir=str(out),
        max_steps=8,
        per_device_train_batch_size=batch,
        learning_rate=5e-3,
        logging_steps=1,
        save_steps=4,
        max_length=96,
        lora_dropout=0.0,
        seed=7,
    )


def test_two_engines_equal_one_process_with_double_batch(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    # reference: one plain process (world size 1), batch 4
    ref = nbtrain.finetune(nbtrain.SFTConfig(**_cfg(model, tmp_path / "one", 4)))

    cluster = nbtrain.start(n=2, force=True)
    try:
        cluster.push({"cfg_kwargs": _cfg(model, tmp_path / "two", 2)})
        cluster.execute(
            "import nbtrain\nresult = nbtrain.finetune(nbtrain.SFTConfig(**cfg_kwargs))"
        )
        results = cluster.pull("result")
    finally:
        cluster.stop()

    assert results[0].adapter_dir == str(tmp_path / "two" / "adapter")
    assert results[1].adapter_dir is None  # only rank 0 exports
    two = results[0].history
    torch.testing.assert_close(
        torch.tensor(two["loss"].to_list()), torch.tensor(ref.history["loss"].to_list())
    )
    a = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        # Adam magnifies float rounding in near-zero gradients; values agree to ~1e-5
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-3)
    # the global throughput is counted over both ranks
    assert (two["tokens_per_s"] > 0).all()
