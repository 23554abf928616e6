"""The Tinker service's rank side in one process (world size 1, no process group), as the kernel's
in-process backend runs it: refusals with their messages, several models on one base, unload."""

from __future__ import annotations

import numpy as np
import pytest

from nbtrain.errors import ConfigError
from nbtrain.tinker import ranks as service
from nbtrain.tinker.ranks import registry

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _datum(n=6, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(5, 400, n + 1)
    return {
        "tokens": toks[:-1].tolist(),
        "loss_fn_inputs": {"target_tokens": toks[1:], "weights": np.ones(n, np.float32)},
    }


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: service.forward_backward("m", [_datum()], "gspo", None, False),
            "no public formula|publishes no formula",
        ),
        (
            lambda: service.forward_backward("m", [_datum()], "ppo", {"beta": 1}, False),
            r"do not apply to 'ppo'",
        ),
        (lambda: service.optim_step("m", {"learning_rate": 1e-4, "momentum": 0.9}), "unknown keys"),
        (
            lambda: service.forward_backward("m", [_datum()], "dro", None, False),
            "needs loss_fn_config {'beta': ...}",
        ),
        (lambda: service.optim_step("m", {"beta1": 1.5}), r"beta1=1.5 must be in \[0, 1\)"),
        (lambda: service.sample({"base_model": "x"}, [1], 1, {"top_k": 0}, False), "top_k=0"),
        (lambda: service.sample({"base_model": "x"}, [], 1, {}, False), "no tokens"),
        (lambda: service.create_model("m", "x", {"rank": 0}), "rank=0"),
        (
            lambda: service.create_model(
                "m", "x", {"train_attn": False, "train_mlp": False, "train_unembed": False}
            ),
            "train nothing",
        ),
    ],
)
def test_bad_requests_are_config_errors_with_the_fix(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_several_models_share_one_base_and_unload_frees_it(tiny):
    a = service.create_model("a", tiny, {"rank": 2, "seed": 1})
    service.create_model("b", tiny, {"rank": 8, "seed": 1, "train_mlp": False})
    assert len(registry.BASES) == 1
    rows = {r["model_id"]: r for r in service.status()}
    assert rows["a"]["lora_rank"] == 2 and rows["b"]["lora_rank"] == 8
    assert rows["a"]["memory_bytes"] == a["memory_bytes"] > 0
    assert not any("mlp" in k for k in service.weights("b"))
    assert any("mlp" in k for k in service.weights("a"))
    with pytest.raises(ConfigError, match="exists already"):
        service.create_model("a", tiny, {"rank": 2})
    out = service.forward_backward("a", [_datum(), _datum(4, 1)], "cross_entropy", None, False)
    assert [len(o["logprobs"]) for o in out["outputs"]] == [6, 4]
    assert service.optim_step("a", {})["grad_norm:mean"] > 0
    assert service.status()[0]["steps"] == 1
    service.unload("a")
    assert len(registry.BASES) == 1  # b still on it
    with pytest.raises(service.UnknownModelError, match="holds no model 'a'"):
        service.forward_backward("a", [_datum()], "cross_entropy", None, True)
    service.unload("b")
    assert registry.BASES == {} and service.status() == []
