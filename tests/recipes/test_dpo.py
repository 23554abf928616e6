"""The DPO recipe in one process: the reference is the model with its adapter off, so before the first
update the policy is the reference (LoRA's B starts at zero): the first step's loss is log 2 and every
reward is 0, here on a 4-bit (QLoRA) base, whose frozen weights the reference forward shares."""

from __future__ import annotations

import math

import pytest

import nbtrain
from nbtrain.data.examples import preferences_path
from nbtrain.losses.dpo import METRICS

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


def test_qlora_first_step_is_the_reference(tiny, tmp_path):
    pytest.importorskip("bitsandbytes")
    cfg = nbtrain.DPOConfig(
        model=tiny,
        data=preferences_path(),
        output_dir=str(tmp_path / "q"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        logging_steps=1,
        save_steps=None,
        max_length=64,
        data_cache="off",
        load_in_4bit=True,
    )
    result = nbtrain.finetune(cfg)
    assert "4-bit NF4 base" in result.plan["levers"]
    first, last = result.history.iloc[0], result.history.iloc[-1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[k] == pytest.approx(0.0, abs=1e-6)
    assert first["logps/chosen"] < 0 and set(METRICS) <= set(result.history.columns)
    # then the adapter moves the policy away from the reference
    assert abs(last["rewards/margins"]) > 1e-4
    assert (tmp_path / "q" / "adapter" / "adapter_model.safetensors").is_file()


def test_logits_path_and_checkpointing_agree(tiny, tmp_path):
    """The sequence log-probs through the logits (fused_cross_entropy=False, as for a model whose logits
    are post-processed) equal those from the hidden states with gradient checkpointing on."""
    import torch

    rows = {}
    for fused in (False, True):
        cfg = nbtrain.DPOConfig(
            model=tiny,
            data=preferences_path(),
            output_dir=str(tmp_path / f"fused-{fused}"),
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=5e-3,
            logging_steps=1,
            save_steps=None,
            max_length=64,
            data_cache="off",
            fused_cross_entropy=fused,
            gradient_checkpointing=fused,
        )
        result = nbtrain.finetune(cfg)
        assert ("loss chunked" if fused else "loss logits") in result.plan["levers"]
        rows[fused] = result.history
    for k in ("loss", *METRICS):
        torch.testing.assert_close(
            torch.tensor(rows[True][k].to_list()),
            torch.tensor(rows[False][k].to_list()),
            rtol=1e-5,
            atol=1e-6,
        )


def test_preemption_records_the_run_and_names_dpoconfig(tiny, tmp_path):
    """SIGUSR1 during a DPO run: Preempted (not a ValueError from the run record), whose resume hint
    names DPOConfig; the record says preempted, at which step, and the checkpoint it wrote."""
    import os
    import signal

    from nbtrain import runs
    from nbtrain.recipes.hooks import Hooks

    hooks = Hooks()

    @hooks.on_step
    def signal_at_step_2(recipe, step, **kw):
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    out = tmp_path / "dpo"
    cfg = nbtrain.DPOConfig(
        model=tiny,
        data=preferences_path(),
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=None,
        max_length=64,
        data_cache="off",
    )
    with pytest.raises(nbtrain.Preempted) as info:
        nbtrain.finetune(cfg, hooks=hooks)
    msg = str(info.value)
    assert "preempted at step 2/6 on rank 0" in msg and "SIGUSR1" in msg
    assert "this run's DPOConfig (or the same DPOConfig(...) with resume='latest')" in msg
    assert "SFTConfig" not in msg
    record = runs.get_run(runs.run_id_for(out))
    assert record["state"] == "preempted" and record["ended"] is not None
    assert (record["step"], record["checkpoint"]) == (2, str(out / "checkpoint-2"))
    assert record["kind"] == "dpo"
    assert (out / "checkpoint-2").is_dir()
