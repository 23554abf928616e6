"""The Tinker service's rank side (`nbtrain.tinker.ranks`) on a real 2-rank local cluster (gloo),
checked against one-process PyTorch computed here: the loss and LoRA gradients of every loss, k AdamW
steps, sampling's log-probs, snapshots and the exported peft adapter.

One cluster and one tiny model (head_dim 64) for the module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nbtrain
from nbtrain.tinker import ranks as service

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
RANK = 4
LORA = {"rank": RANK, "seed": 3, "train_attn": True, "train_mlp": True, "train_unembed": True}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    # head_dim 64; a narrow embedding, so the untrained model's next-token distribution is broad
    return make_tiny_model(
        tmp_path_factory.mktemp("svc") / "tiny", hidden_size=64, num_heads=1, embed_std=0.02
    )


@pytest.fixture(scope="module")
def cluster():
    c = nbtrain.start(n=2, force=True)
    try:
        c.execute("import torch; torch.set_num_threads(1)", output="none")
        yield c
    finally:
        c.stop()


def run(cluster, fn, *args):
    """`fn(*args)` on both ranks; rank 0's answer, as the kernel side reads it, once every rank's is
    checked to be the same (dicts, lists and numpy arrays, element for element)."""
    out = cluster.run(fn, *args)
    assert len(out) == 2
    for rank, answer in enumerate(out[1:], start=1):
        np.testing.assert_equal(
            answer, out[0], err_msg=f"{fn.__name__}: rank {rank}'s answer is not rank 0's"
        )
    return out[0]


def _datums(n_datums, seed, vocab=500):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_datums):
        n = 6 + 3 * i
        toks = rng.integers(5, vocab, n + 1)
        w = (rng.random(n) > 0.3).astype(np.float32)
        out.append(
            {
                "tokens": toks[:-1].tolist(),
                "loss_fn_inputs": {"target_tokens": toks[1:].astype(np.int64), "weights": w},
            }
        )
    return out


def _reference(base, weights):
    """A one-process peft LoRA model with the adapter `weights` (peft's saved names, numpy)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(model, cfg)
    set_peft_model_state_dict(model, {k: torch.tensor(v) for k, v in weights.items()})
    model.eval()
    return model


def _ref_logprobs(model, datum):
    ids = torch.tensor([datum["tokens"]])
    logits = model(input_ids=ids).logits[0].float()
    t = torch.as_tensor(datum["loss_fn_inputs"]["target_tokens"])
    return torch.log_softmax(logits, -1).gather(-1, t[:, None]).squeeze(-1)


def _lora_grads(model):
    return {
        n.replace(".default.", "."): p.grad.numpy().copy()
        for n, p in model.named_parameters()
        if "lora_" in n and p.grad is not None
    }


def _close(a, b, atol=1e-5, rtol=1e-4):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=rtol, err_msg=k)


@pytest.fixture(scope="module")
def trained(cluster, base):
    """Model "ce": created on both ranks, one AdamW step taken so that both LoRA factors are non-zero."""
    info = run(cluster, service.create_model, "ce", base, LORA)
    assert info["is_lora"] and info["lora_rank"] == RANK and info["tokenizer_id"] == base
    run(cluster, service.forward_backward, "ce", _datums(3, 0), "cross_entropy", None, False)
    run(cluster, service.optim_step, "ce", {"learning_rate": 1e-2})
    return "ce"


def test_cross_entropy_on_two_ranks_matches_one_process_sum(cluster, base, trained):
    datums = _datums(5, 1)
    # two calls, 3 + 2 datums dealt across 2 ranks: the gradients add up until optim_step
    a = run(cluster, service.forward_backward, trained, datums[:3], "cross_entropy", None, False)
    b = run(cluster, service.forward_backward, trained, datums[3:], "cross_entropy", None, False)
    grads = run(cluster, service.weights, trained, True)

    model = _reference(base, run(cluster, service.weights, trained))
    lps = [_ref_logprobs(model, x) for x in datums]
    loss = -sum(
        (lp * torch.as_tensor(x["loss_fn_inputs"]["weights"])).sum() for lp, x in zip(lps, datums)
    )
    loss.backward()
    got = a["metrics"]["loss:sum"] + b["metrics"]["loss:sum"]
    assert got == pytest.approx(float(loss), rel=1e-5)
    for out, lp in zip(a["outputs"] + b["outputs"], lps):
        np.testing.assert_allclose(out["logprobs"], lp.detach().numpy(), atol=1e-5)
    _close(grads, _lora_grads(model))
    assert any(np.abs(g).max() > 0 for k, g in grads.items() if "lora_A" in k)
    run(cluster, service.optim_step, trained, {"learning_rate": 0.0})  # zero the gradients


def _rl_formula(name, lp, q, adv, cfg):
    r = torch.exp(lp - q)
    if name == "importance_sampling":
        return -(r * adv).sum()
    if name == "ppo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv).sum()
    if name == "cispo":
        return -(torch.clamp(r, 0.8, 1.2).detach() * lp * adv).sum()
    return -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()  # dro


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("importance_sampling", None),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", None),
        ("dro", {"beta": 0.3}),
    ],
)
def test_rl_losses_match_their_formulas(cluster, base, trained, name, cfg):
    model = _reference(base, run(cluster, service.weights, trained))
    rng = np.random.default_rng(2)
    datums = []
    for x in _datums(3, 5):
        n = len(x["tokens"])
        lp = _ref_logprobs(model, x).detach().numpy()
        # the sampler's log-probs off by up to 0.3 nats, so that some ratios fall outside the clip
        q = (lp + rng.uniform(-0.3, 0.3, n)).astype(np.float32)
        adv = rng.normal(size=n).astype(np.float32)
        inputs = {
            "target_tokens": x["loss_fn_inputs"]["target_tokens"],
            "logprobs": q,
            "advantages": adv,
        }
        datums.append({"tokens": x["tokens"], "loss_fn_inputs": inputs})
    out = run(cluster, service.forward_backward, trained, datums, name, cfg, False)
    grads = run(cluster, service.weights, trained, True)
    run(cluster, service.optim_step, trained, {"learning_rate": 0.0})

    full = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **(cfg or {})}
    loss = sum(
        _rl_formula(
            name,
            _ref_logprobs(model, x),
            torch.as_tensor(x["loss_fn_inputs"]["logprobs"]),
            torch.as_tensor(x["loss_fn_inputs"]["advantages"]),
            full,
        )
        for x in datums
    )
    loss.backward()
    assert out["metrics"]["loss:sum"] == pytest.approx(float(loss), rel=1e-5, abs=1e-5)
    _close(grads, _lora_grads(model))


def test_unknown_and_refused_losses_are_config_errors(cluster, trained):
    from nbtrain.errors import ConfigError

    for name in ("gspo", "nope"):
        with pytest.raises(
            ConfigError, match="cross_entropy, importance_sampling, ppo, cispo, dro"
        ):
            service.forward_backward(trained, _datums(1, 0), name, None, False)


def test_k_steps_equal_plain_torch_adamw(cluster, base):
    run(cluster, service.create_model, "adam", base, {**LORA, "seed": 11})
    model = _reference(base, run(cluster, service.weights, "adam"))
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    adam = {
        "learning_rate": 3e-3,
        "beta1": 0.8,
        "beta2": 0.9,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "grad_clip_norm": 2.0,
    }
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    for step in range(3):
        datums = _datums(4, 10 + step)
        run(cluster, service.forward_backward, "adam", datums, "cross_entropy", None, False)
        got = run(cluster, service.optim_step, "adam", adam)
        loss = -sum(
            (_ref_logprobs(model, x) * torch.as_tensor(x["loss_fn_inputs"]["weights"])).sum()
            for x in datums
        )
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 2.0)
        assert got["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-4)
        opt.step()
        opt.zero_grad()
    ref = {
        n.replace(".default.", "."): p.detach().numpy()
        for n, p in model.named_parameters()
        if "lora_" in n
    }
    _close(run(cluster, service.weights, "adam"), ref, atol=2e-5, rtol=1e-3)
    assert service.status() == []  # the test process itself holds nothing
    rows = run(cluster, service.status)
    assert {r["model_id"] for r in rows} >= {"adam"}
    assert all(r["memory_bytes"] > 0 for r in rows)
    run(cluster, service.unload, "adam")


def test_compute_logprobs_equals_forward(cluster, base, trained):
    prompt = _datums(1, 7)[0]["tokens"]
    got = run(cluster, service.sample, {"model_id": trained}, prompt, 1, {"max_tokens": 1}, True)
    # forward() sends target_tokens only: weights count as ones
    datum = {
        "tokens": prompt[:-1],
        "loss_fn_inputs": {"target_tokens": np.array(prompt[1:], np.int64)},
    }
    fwd = run(cluster, service.forward_backward, trained, [datum], "cross_entropy", None, True)
    assert fwd["metrics"]["loss:sum"] == pytest.approx(
        -float(np.sum(fwd["outputs"][0]["logprobs"])), rel=1e-5
    )
    assert got["prompt_logprobs"][0] is None
    np.testing.assert_allclose(got["prompt_logprobs"][1:], fwd["outputs"][0]["logprobs"], atol=1e-5)

    # the base model, no adapter (a KL reference), as transformers alone computes it here
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    ref = run(cluster, service.sample, {"base_model": base}, prompt, 1, {"max_tokens": 1}, True)
    with torch.no_grad():
        expected = _ref_logprobs(plain, datum).numpy()
    np.testing.assert_allclose(ref["prompt_logprobs"][1:], expected, atol=1e-5)
    assert not np.allclose(expected, fwd["outputs"][0]["logprobs"], atol=1e-3)


def test_samples_stop_tokens_and_their_logprobs(cluster, base, trained):
    prompt = [7, 8, 9, 10]
    stop = list(range(5, 300))  # most of the vocabulary: samples stop within a few tokens
    got = run(
        cluster,
        service.sample,
        {"model_id": trained},
        prompt,
        4,
        {"max_tokens": 12, "seed": 5, "stop": stop},
        False,
    )
    assert len(got["sequences"]) == 4
    for s in got["sequences"]:
        if s["stop_reason"] == "stop":
            assert s["tokens"][-1] in stop and not set(s["tokens"][:-1]) & set(stop)
        else:
            assert len(s["tokens"]) == 12
    assert any(s["stop_reason"] == "stop" for s in got["sequences"])
    # the sampled tokens' log-probs are the learner's on the same sequence
    datums = []
    for s in got["sequences"]:
        seq = prompt + s["tokens"]
        tgt = np.array(seq[1:], np.int64)
        datums.append(
            {
                "tokens": seq[:-1],
                "loss_fn_inputs": {"target_tokens": tgt, "weights": np.ones(len(tgt), np.float32)},
            }
        )
    fwd = run(cluster, service.forward_backward, trained, datums, "cross_entropy", None, True)
    for s, out in zip(got["sequences"], fwd["outputs"]):
        np.testing.assert_allclose(s["logprobs"], out["logprobs"][len(prompt) - 1 :], atol=1e-4)
    # stop strings: a sample ends with the token that completes one, and none occurs before it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    strings = ["e", "a"]
    by_text = run(
        cluster,
        service.sample,
        {"model_id": trained},
        prompt,
        6,
        {"max_tokens": 30, "seed": 2, "stop": strings},
        False,
    )
    for s in by_text["sequences"]:
        head = tok.decode(s["tokens"][:-1])
        assert not any(x in head for x in strings)
        if s["stop_reason"] == "stop":
            assert any(x in tok.decode(s["tokens"]) for x in strings)
    assert any(s["stop_reason"] == "stop" for s in by_text["sequences"])
    never = run(
        cluster,
        service.sample,
        {"model_id": trained},
        prompt,
        2,
        {"max_tokens": 6, "seed": 1, "stop": []},
        False,
    )
    assert [len(s["tokens"]) for s in never["sequences"]] == [6, 6]
    assert {s["stop_reason"] for s in never["sequences"]} == {"length"}


def test_snapshot_does_not_change_as_training_goes_on(cluster, base, tmp_path):
    run(cluster, service.create_model, "snap", base, {**LORA, "seed": 5})
    run(cluster, service.forward_backward, "snap", _datums(2, 3), "cross_entropy", None, False)
    run(cluster, service.optim_step, "snap", {"learning_rate": 1e-2})
    run(cluster, service.snapshot, "snap", "snap-1")
    prompt, params = [11, 12, 13], {"max_tokens": 4, "temperature": 0.0}
    before = run(cluster, service.sample, {"sampler_id": "snap-1"}, prompt, 1, params, True)
    for step in range(2):
        run(
            cluster,
            service.forward_backward,
            "snap",
            _datums(2, 20 + step),
            "cross_entropy",
            None,
            False,
        )
        run(cluster, service.optim_step, "snap", {"learning_rate": 1e-2})
    run(cluster, service.snapshot, "snap", "snap-2")
    later = run(cluster, service.sample, {"sampler_id": "snap-2"}, prompt, 1, params, True)
    after = run(cluster, service.sample, {"sampler_id": "snap-1"}, prompt, 1, params, True)
    now = run(cluster, service.sample, {"model_id": "snap"}, prompt, 1, params, True)
    assert after == before
    assert now["prompt_logprobs"] != before["prompt_logprobs"]
    assert later["prompt_logprobs"][1:] == pytest.approx(now["prompt_logprobs"][1:], abs=1e-6)

    # the exported adapter loads with peft and gives the service's log-probs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tmp_path / "sampler"
    run(cluster, service.save_sampler, "snap", str(path))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(path)).eval()
    datum = _datums(1, 4)[0]
    fwd = run(cluster, service.forward_backward, "snap", [datum], "cross_entropy", None, True)
    with torch.no_grad():
        np.testing.assert_allclose(
            _ref_logprobs(model, datum).numpy(), fwd["outputs"][0]["logprobs"], atol=1e-5
        )
    from_path = run(cluster, service.sample, {"path": str(path)}, prompt, 1, params, True)
    assert from_path["prompt_logprobs"][1:] == pytest.approx(now["prompt_logprobs"][1:], abs=1e-5)
    run(cluster, service.unload, "snap")


def _steps(cluster, model_id, seeds):
    for s in seeds:
        run(
            cluster, service.forward_backward, model_id, _datums(3, s), "cross_entropy", None, False
        )
        run(cluster, service.optim_step, model_id, {"learning_rate": 5e-3, "weight_decay": 0.01})


def test_state_resumes_as_uninterrupted_and_models_stay_apart(cluster, base, tmp_path):
    run(cluster, service.create_model, "r1", base, {**LORA, "seed": 9})
    _steps(cluster, "r1", [30, 31])
    saved = run(cluster, service.save_state, "r1", str(tmp_path / "r1-step2"), True)
    assert saved["steps"] == 2 and (tmp_path / "r1-step2" / "service.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    _steps(cluster, "r1", [32, 33])
    uninterrupted = run(cluster, service.weights, "r1")

    # a second model on the same base, loaded from the save with its AdamW state; r1's pending
    # gradients must neither reach r2 nor be touched by r2's steps
    run(cluster, service.forward_backward, "r1", _datums(2, 40), "cross_entropy", None, False)
    pending = run(cluster, service.weights, "r1", True)
    loaded = run(cluster, service.load_state, "r2", str(tmp_path / "r1-step2"), True, None, None)
    assert loaded["steps"] == 2
    _steps(cluster, "r2", [32, 33])
    resumed = run(cluster, service.weights, "r2")
    assert resumed.keys() == uninterrupted.keys()
    for k in resumed:
        np.testing.assert_array_equal(resumed[k], uninterrupted[k], err_msg=k)
    _close(run(cluster, service.weights, "r1", True), pending, atol=0, rtol=0)

    # without the optimizer state the same steps end elsewhere (AdamW's moments start afresh)
    run(cluster, service.load_state, "r3", str(tmp_path / "r1-step2"), False, None, None)
    _steps(cluster, "r3", [32, 33])
    fresh = run(cluster, service.weights, "r3")
    assert any(not np.array_equal(fresh[k], uninterrupted[k]) for k in fresh)

    folders = run(cluster, service.checkpoint_all, str(tmp_path / "preempted"))
    live = {r["model_id"] for r in run(cluster, service.status)}
    assert {"r1", "r2", "r3"} <= live and len(folders) == len(live)
    assert all((tmp_path / "preempted" / f / "optimizer.pt").is_file() for f in folders)
    for m in ("r1", "r2", "r3"):
        run(cluster, service.unload, m)
    with pytest.raises(Exception, match="holds no model 'r1'"):
        cluster.run(service.optim_step, "r1", {})
    with pytest.raises(Exception, match="no saved training state"):
        cluster.run(service.load_state, "r4", str(tmp_path / "nowhere"), True, base, LORA)


def test_a_preemption_notice_checkpoints_every_live_model(cluster, base, tmp_path):
    import os
    import signal
    import time

    run(cluster, service.create_model, "pre", base, {**LORA, "seed": 4})
    _steps(cluster, "pre", [50])
    folder = tmp_path / "preempted"
    assert cluster.run(service.arm_preemption, str(folder)) == [True, True]
    try:
        for pid in cluster.run(os.getpid):
            os.kill(pid, signal.SIGUSR1)  # Slurm's --signal=USR1@90 notice: the engines serve on
        deadline = time.monotonic() + 20
        while not (folder / "pre" / "service.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        got = cluster.run(service.preemption_status)
        assert [g["signal"] for g in got] == ["SIGUSR1", "SIGUSR1"]
        assert got[1]["saved"] == [] and str(folder / "pre") in got[0]["saved"], got
        assert got[0]["errors"] == []
    finally:
        cluster.run(service.disarm_preemption)
    # what was written is the model as it was, optimizer included
    run(cluster, service.load_state, "pre-back", str(folder / "pre"), True, None, None)
    _close(
        run(cluster, service.weights, "pre-back"),
        run(cluster, service.weights, "pre"),
        atol=0,
        rtol=0,
    )
    for m in ("pre", "pre-back"):
        run(cluster, service.unload, m)


def test_a_rank_without_the_model_fails_every_rank_not_a_hang(cluster, base):
    # as after a restart that replaced rank 1: rank 0 still holds the model, rank 1 does not
    run(cluster, service.create_model, "half", base, {**LORA, "seed": 2})
    _steps(cluster, "half", [60])
    run(cluster, service.forward_backward, "half", _datums(2, 61), "cross_entropy", None, False)
    pending = cluster.run(service.weights, "half", True, ranks=[0])[0]
    cluster.run(service.unload, "half", ranks=[1])
    with pytest.raises(Exception, match="rank 1 on .*holds no model 'half'") as err:
        cluster.run(
            service.forward_backward,
            "half",
            _datums(2, 62),
            "cross_entropy",
            None,
            False,
            timeout=30,
        )
    assert "UnknownModelError" in str(err.value)
    # rank 0 added nothing, and still serves what needs no peer
    _close(cluster.run(service.weights, "half", True, ranks=[0])[0], pending, atol=0, rtol=0)
    cluster.run(service.unload, "half", ranks=[0])
    with pytest.raises(Exception, match="holds no model"):
        cluster.run(
            service.sample, {"model_id": "half"}, [5, 6], 2, {"max_tokens": 2}, False, timeout=30
        )
