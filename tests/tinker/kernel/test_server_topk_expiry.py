"""The Tinker service in this process (`InProcessBackend`), driven by the unchanged tinker SDK:
top-k log-probabilities of the prompt and of the samples, checked against `torch.topk` of the
model's own logits computed here; and sessions that stop heartbeating expire (saved, then unloaded)."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture()
def env(tmp_path):
    keys = ("NBTRAIN_HOME", "TINKER_TELEMETRY", "TINKER_BASE_URL", "TINKER_API_KEY")
    old = {k: os.environ.get(k) for k in keys}
    os.environ["NBTRAIN_HOME"] = str(tmp_path / "home")
    os.environ["TINKER_TELEMETRY"] = "0"
    yield tmp_path
    from nbtrain.tinker.kernel import current_service

    svc = current_service()
    if svc is not None:
        svc.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _logp(tiny, tokens):
    """log_softmax of the model's logits at every position of `tokens`, computed here alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits.float()[0]
    return torch.log_softmax(logits, dim=-1)


def test_topk_prompt_and_sample_logprobs_are_torch_topk_of_the_models_logits(tiny, env):
    import tinker
    import torch
    from tinker import types

    import nbtrain

    svc = nbtrain.serve_tinker(root=env / "svc")
    sc = tinker.ServiceClient(base_url=svc.url, api_key=svc.api_key)
    sampler = sc.create_sampling_client(base_model=tiny).result()
    prompt = [5, 17, 33, 80, 9, 41]
    k, ks = 5, 3
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=ks,
    ).result()

    logp = _logp(tiny, prompt)
    top = res.topk_prompt_logprobs
    assert top is not None and len(top) == len(prompt)
    assert top[0] is None  # nothing predicts the first prompt token (as prompt_logprobs' None)
    values, ids = torch.topk(logp[:-1], k, dim=-1)
    for i in range(1, len(prompt)):
        row = top[i]
        assert [t for t, _ in row] == ids[i - 1].tolist()  # the most likely first
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in row]), values[i - 1], rtol=1e-4, atol=1e-4
        )
        # the prompt's own token's logprob agrees with the top-k where it is among them
        if prompt[i] in ids[i - 1].tolist():
            assert res.prompt_logprobs[i] == pytest.approx(dict(row)[prompt[i]], abs=1e-4)

    for seq in res.sequences:
        assert len(seq.tokens) == 4 and seq.topk_logprobs is not None
        assert len(seq.topk_logprobs) == len(seq.tokens)
        full = _logp(tiny, prompt + seq.tokens)[len(prompt) - 1 : -1]
        v, i_ = torch.topk(full, ks, dim=-1)
        for pos, row in enumerate(seq.topk_logprobs):
            assert [t for t, _ in row] == i_[pos].tolist()
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in row]), v[pos], rtol=1e-4, atol=1e-4
            )
            # the sampled token's logprob is the same distribution's
            assert seq.logprobs[pos] == pytest.approx(float(full[pos, seq.tokens[pos]]), abs=1e-4)

    # prompt_logprobs_last_n applies to the top-k rows too; none asked: None
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        prompt_logprobs_last_n=2,
    ).result()
    assert res.topk_prompt_logprobs[:-2] == [None] * (len(prompt) - 2)
    assert [t for t, _ in res.topk_prompt_logprobs[-1]] == ids[-1, :2].tolist()
    assert res.sequences[0].topk_logprobs is None
    plain = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert plain[0] is None and plain[1] == pytest.approx(float(logp[0, prompt[1]]), abs=1e-4)
    sc.close("success").result()


def test_an_idle_session_is_saved_then_unloaded_and_load_weights_resumes_it(tiny, env, capfd):
    import time

    import tinker
    import torch
    from tinker import types

    import nbtrain

    with pytest.raises(nbtrain.ConfigError, match="session_timeout"):
        nbtrain.serve_tinker(root=env / "svc", session_timeout=-1)
    svc = nbtrain.serve_tinker(root=env / "svc", session_timeout=0)  # 0: never, while it trains
    sc = tinker.ServiceClient(base_url=svc.url, api_key=svc.api_key)
    tc = sc.create_lora_training_client(base_model=tiny, rank=4, seed=0).result()
    sid = tc.model_id.split(":")[0]
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 17, 33, 80, 9]),
        loss_fn_inputs={"target_tokens": [17, 33, 80, 9, 2], "weights": [0, 1, 1, 1, 1]},
    )
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert [r["model_id"] for r in svc.status()] == [tc.model_id]

    # the SDK heartbeats every 10 s: with a 1 s timeout the session is idle long enough at once
    svc.session_timeout = 1.0
    t0 = time.time()
    while tc.model_id in svc.verbs.models and time.time() - t0 < 30:
        time.sleep(0.1)
    waited = time.time() - t0
    assert tc.model_id not in svc.verbs.models, "the session did not expire within 30 s"
    assert 0.5 < waited < 10
    assert svc.status() == []  # the ranks hold it no more
    saved = svc.verbs.sessions[sid].expired
    assert saved is not None and "expired" in saved
    path = next(w.rstrip(".") for w in saved.split() if w.startswith("tinker://"))
    assert path.startswith(f"tinker://{tc.model_id}/weights/expired-")
    folder = svc.root / tc.model_id.replace(":", "_") / "weights" / path.rsplit("/", 1)[1]
    assert (folder / "service.json").is_file()
    assert path in capfd.readouterr().err  # logged, naming the path

    # a later request for the model: a 404 naming the path (not retried by the SDK)
    with pytest.raises(tinker.NotFoundError, match=path):
        tc.forward([d], "cross_entropy").result()
    sc.close("success").result()  # finishing an expired session is no error

    svc.session_timeout = 0
    sc2 = tinker.ServiceClient(base_url=svc.url, api_key=svc.api_key)
    tc2 = sc2.create_training_client_from_state_with_optimizer(path).result()
    again = tc2.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(again, trained)
    sc2.close("success").result()
