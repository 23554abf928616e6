"""`%nbtrain serve tinker` with no cluster: the service in this process (`InProcessBackend`, world
size 1) over the real rank-side service, driven by the tinker SDK found through the environment
the magic sets; and `--host` beyond the loopback refused without a key."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture()
def clean_env(tmp_path):
    keys = ("NBTRAIN_HOME", "TINKER_TELEMETRY", "TINKER_BASE_URL", "TINKER_API_KEY")
    old = {k: os.environ.get(k) for k in keys}
    for k in ("TINKER_BASE_URL", "TINKER_API_KEY"):
        os.environ.pop(k, None)
    os.environ["NBTRAIN_HOME"] = str(tmp_path / "home")
    os.environ["TINKER_TELEMETRY"] = "0"
    yield tmp_path
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_serve_in_this_kernel_trains_through_the_sdk_and_stops(ip, tiny, clean_env, capsys):
    import signal

    import tinker
    from tinker import types

    import nbtrain
    from nbtrain.tinker import ranks as service
    from nbtrain.tinker.kernel import current_service
    from nbtrain.tinker.ranks.state import checkpoint_folder

    before = signal.getsignal(signal.SIGUSR1)

    with pytest.raises(nbtrain.ConfigError, match="api_key"):
        ip.run_line_magic("nbtrain", "serve tinker --host 0.0.0.0")
    with pytest.raises(nbtrain.ConfigError, match="port=99999 is not a TCP port"):
        ip.run_line_magic("nbtrain", "serve tinker --port 99999")
    assert current_service() is None
    ip.run_line_magic("nbtrain", f"serve tinker --root {clean_env / 'svc'}")
    out = capsys.readouterr().out
    svc = current_service()
    assert svc is not None and svc.url in out and svc.api_key in out
    assert nbtrain.tinker_url() == svc.url == os.environ["TINKER_BASE_URL"]
    try:
        sc = tinker.ServiceClient()  # TINKER_BASE_URL and TINKER_API_KEY, as the magic set them
        tc = sc.create_lora_training_client(base_model=tiny, rank=4, seed=0).result()
        d = types.Datum(
            model_input=types.ModelInput.from_ints([5, 17, 33, 80, 9]),
            loss_fn_inputs={"target_tokens": [17, 33, 80, 9, 2], "weights": [0, 1, 1, 1, 1]},
        )
        fb = tc.forward_backward([d], "cross_entropy").result()
        lp = fb.loss_fn_outputs[0]["logprobs"].to_numpy()
        assert fb.metrics["loss:sum"] == pytest.approx(-float(lp[1:].sum()), rel=1e-4)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert float(after[1:].sum()) > float(lp[1:].sum())  # one step up the weighted tokens
        # served from this kernel's main thread: a preemption notice here saves the model
        assert svc.preemption_folder == svc.root / "preempted"
        os.kill(os.getpid(), signal.SIGUSR1)
        saved = service.preemption_status()
        assert saved["signal"] == "SIGUSR1" and saved["saved"] == [
            checkpoint_folder(str(svc.preemption_folder), tc.model_id)
        ]
        assert (svc.preemption_folder / tc.model_id.replace(":", "_") / "service.json").is_file()
        rows = svc.status()
        assert [r["model_id"] for r in rows] == [tc.model_id] and rows[0]["steps"] == 1
        capsys.readouterr()
        ip.run_line_magic("nbtrain", "status")
        assert f"{tc.model_id}  base {tiny}  LoRA rank 4  steps 1" in capsys.readouterr().out
        # a second serve while this one serves is refused, naming it; this one serves on
        with pytest.raises(nbtrain.ConfigError, match=f"already serving at {svc.url}.*serve stop"):
            ip.run_line_magic("nbtrain", "serve tinker")
        assert current_service() is svc and os.environ["TINKER_BASE_URL"] == svc.url
        assert tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"] is not None
        sc.close("success").result()
    finally:
        ip.run_line_magic("nbtrain", "serve stop")
    assert current_service() is None and "TINKER_BASE_URL" not in os.environ
    assert signal.getsignal(signal.SIGUSR1) == before  # the stop put the old handlers back
    assert "stopped" in capsys.readouterr().out
    assert np.isfinite(lp).all()
