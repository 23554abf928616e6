"""Losing a rank, an interrupt or a killed save in the middle of `finetune` costs only the steps since the
last checkpoint: after `cluster.restart()`, `finetune(resume="latest")` ends with the same adapter as an
uninterrupted run, and metrics.jsonl has every step once.

(Split from test_faults.py so each file stays under two minutes on a 2-core machine.)
"""

from __future__ import annotations

import _thread
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import nbtrain
from nbtrain.data.examples import instructions_path
from nbtrain.errors import RankDiedError
from nbtrain.model.tiny import make_tiny_model
from nbtrain.runs import get_run, run_id_for

pytestmark = pytest.mark.timeout(300)

STEPS = 8
RUN = "import nbtrain\nresult = nbtrain.finetune(nbtrain.SFTConfig(**cfg))"
# RUN with every micro-batch 0.3 s slower, so a test can act between two steps
SLOW_RUN = (
    "import time, nbtrain.recipes.step as T\n"
    "_orig = T.loss_sum\n"
    "def _slow(*a, **k):\n"
    "    time.sleep(0.3)\n"
    "    return _orig(*a, **k)\n"
    "T.loss_sum = _slow\n"
    "try:\n"
    "    result = nbtrain.finetune(nbtrain.SFTConfig(**cfg))\n"
    "finally:\n"
    "    T.loss_sum = _orig\n"
)


def _cfg(model, out, **kw):
    base = dict(
        model=str(model),
        data=instructions_path(),
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        logging_steps=1,
        save_steps=2,
        max_length=64,
        lora_dropout=0.0,
        seed=7,
    )
    return base | kw


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults-resume")
    model = make_tiny_model(tmp / "tiny")
    cluster = nbtrain.start(n=2, force=True)
    # the uninterrupted reference, on the same 2 ranks
    cluster.push({"cfg": _cfg(model, tmp / "ref")})
    cluster.execute(RUN, live=False)
    ref = load_file(str(tmp / "ref" / "adapter" / "adapter_model.safetensors"))
    yield cluster, model, tmp, ref
    cluster.stop()


def _idle_soon(cluster, timeout: float = 5.0) -> bool:
    """Every rank idle within `timeout` s: a rank's queue status reaches the client a moment after the
    cell's failure does (ipyparallel's queue_status), more so on a loaded machine."""
    deadline = time.monotonic() + timeout
    while {r["state"] for r in cluster.status()} != {"idle"}:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_adapter(out: Path, ref: dict) -> None:
    got = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key])


def _resume(cluster, model, out):
    cluster.push({"cfg": _cfg(model, out, resume="latest")})
    cluster.execute(RUN, live=False)
    return cluster.pull("result")[0]


def test_rank_killed_mid_run_restart_resume_equals_uninterrupted(setup):
    cluster, model, tmp, ref = setup
    out = tmp / "killed"
    cluster.push({"cfg": _cfg(model, out)})
    # rank 1 is SIGKILLed in the loss of step 5 (after checkpoint-4): step.loss_sum runs once per micro-batch
    kill = (
        "import os, signal, nbtrain.recipes.step as T\n"
        "_orig = T.loss_sum\n"
        "_calls = [0]\n"
        "def _dying(*a, **k):\n"
        "    _calls[0] += 1\n"
        "    if rank == 1 and _calls[0] == 5:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _orig(*a, **k)\n"
        "T.loss_sum = _dying\n"
    )
    with pytest.raises(RankDiedError) as info:
        cluster.execute(kill + RUN + "\nT.loss_sum = _orig", live=False)
    assert "rank 1 on" in str(info.value) and "SIGKILL" in str(info.value)
    note = cluster.restart()
    assert "in-memory state of the replaced ranks was lost" in note
    # a rank that was only interrupted kept its patched function: put the real one back
    cluster.execute("try:\n    T.loss_sum = _orig\nexcept NameError:\n    pass", live=False)
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-2", "checkpoint-4"]
    result = _resume(cluster, model, out)
    assert result.global_step == STEPS
    assert _steps(out) == list(range(1, STEPS + 1))  # no gap, no repeated step
    _assert_same_adapter(out, ref)


def test_interrupt_mid_finetune_stops_every_rank_then_resumes(setup):
    cluster, model, tmp, ref = setup
    out = tmp / "interrupted"
    cluster.push({"cfg": _cfg(model, out)})
    slow = SLOW_RUN
    sent = {}

    def interrupt_after_checkpoint():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "checkpoint-4").is_dir():
            time.sleep(0.05)
        sent["t"] = time.monotonic()
        _thread.interrupt_main()

    threading.Thread(target=interrupt_after_checkpoint, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        cluster.execute("import nbtrain\n" + slow, live=False)
    stopped_in = time.monotonic() - sent["t"]
    print(f"interrupt: every rank stopped {stopped_in:.2f} s after the interrupt")
    assert stopped_in < 10.0
    assert _idle_soon(cluster)
    result = _resume(cluster, model, out)
    assert result.global_step == STEPS
    assert _steps(out) == list(range(1, STEPS + 1))
    _assert_same_adapter(out, ref)


def test_rank0_killed_during_checkpoint_save(setup):
    cluster, model, tmp, ref = setup
    out = tmp / "killed-save"
    cluster.push({"cfg": _cfg(model, out)})
    # rank 0 dies halfway through writing checkpoint-4 (adapter and optimizer written, the rest not)
    kill = (
        "import os, signal, torch\n"
        "_save = torch.save\n"
        "def _dying_save(obj, f, *a, **k):\n"
        "    if rank == 0 and '.tmp-checkpoint-4' in str(f) and str(f).endswith('scheduler.pt'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _save(obj, f, *a, **k)\n"
        "torch.save = _dying_save\n"
    )
    with pytest.raises(RankDiedError) as info:
        cluster.execute(kill + RUN, live=False)
    assert "rank 0 on" in str(info.value)
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-2" in names and "checkpoint-4" not in names, names
    assert "adapter" not in names  # never half written: absent until complete
    from nbtrain.model.checkpoint import list_checkpoints, load_checkpoint

    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    assert load_checkpoint(out / "checkpoint-2")["state"]["global_step"] == 2
    cluster.restart()
    cluster.execute(
        "import torch\ntry:\n    torch.save = _save\nexcept NameError:\n    pass", live=False
    )
    result = _resume(cluster, model, out)
    assert result.global_step == STEPS
    assert _steps(out) == list(range(1, STEPS + 1))
    _assert_same_adapter(out, ref)
    files = {p.name for p in (out / "adapter").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files


def test_preemption_signal_checkpoints_then_resume_equals_uninterrupted(setup):
    """SIGUSR1 (Slurm's --signal) to one rank mid-run: every rank ends its step, one checkpoint is
    written for it, the cell fails with one message whose resume hint runs; after a restart, resuming
    ends with the uninterrupted run's adapter."""
    import dataclasses
    import os
    import re
    import signal

    from nbtrain.errors import DistributedCellError

    cluster, model, tmp, ref = setup
    out = tmp / "preempted"
    # no periodic checkpoint: the one the signal asks for is all there is to resume from
    cluster.push({"cfg": _cfg(model, out, save_steps=None)})
    slow = SLOW_RUN
    pid = cluster.ranks[1].pid

    def preempt_after_step_3():
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        os.kill(pid, signal.SIGUSR1)

    threading.Thread(target=preempt_after_step_3, daemon=True).start()
    with pytest.raises(DistributedCellError) as info:
        cluster.execute("import nbtrain\n" + slow, live=False)
    msg = str(info.value)
    found = re.search(
        r"preempted at step (\d+)/8 on rank 1 \((.+?), SIGUSR1\); checkpoint at (\S+);", msg
    )
    assert found, msg
    step = int(found.group(1))
    assert 3 <= step < STEPS
    assert Path(found.group(3)) == out / f"checkpoint-{step}"
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{step}"]
    assert _steps(out) == list(range(1, step + 1))
    # every rank raised the same Preempted, and nothing else (no error from the run's record)
    assert [(g["ename"], g["ranks"]) for g in info.value.failures] == [("Preempted", [0, 1])]
    assert "this run's SFTConfig" in msg
    # the record says so: preempted, ended, at the step, with the checkpoint, on this cluster
    record = get_run(run_id_for(out))
    assert (record["state"], record["step"], record["checkpoint"]) == (
        "preempted",
        step,
        str(out / f"checkpoint-{step}"),
    )
    assert record["ended"] is not None
    assert (record["kind"], record["cluster_id"]) == ("sft", cluster.cluster_id)
    # the hint is code: it runs with this run's config
    hint = re.search(r"resume with (nbtrain\.finetune\(.+?\)\)) where cfg", msg).group(1)
    compile(hint, "<hint>", "eval")
    assert (
        dataclasses.replace(nbtrain.SFTConfig(**_cfg(model, out)), resume="latest").resume
        == "latest"
    )
    # the engines caught the signal and live on: the handler they had is back after the run
    assert _idle_soon(cluster)
    cluster.restart()
    result = _resume(cluster, model, out)
    assert result.global_step == STEPS
    assert _steps(out) == list(range(1, STEPS + 1))
    _assert_same_adapter(out, ref)
