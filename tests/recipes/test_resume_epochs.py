"""A run resumed on another world size ends where it was asked to: after num_train_epochs of its data
(every row once an epoch), or at max_steps; its epoch column and learning rate follow the data.

A one-rank run is checkpointed midway and the checkpoint resumed on two real ranks (gloo), as a crash
leaves it (tests/recipes/test_distributed.py's run_ranks). Which rows each step trained is recorded on every
rank by wrapping nbtrain.recipes.step.loss_sum, through which the loop computes every micro-batch's loss.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from nbtrain.configs.sft import SFTConfig
from nbtrain.recipes import step as one_step
from nbtrain.recipes.train import finetune
from tests.recipes import test_distributed as tsd
from tests.recipes.test_distributed import DATA, _kw, run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR = 1e-2
# 32 distinct rows: one epoch is 16 steps on one rank with batch 2, and 8 on two ranks with batch 2 each
ROWS = list({x: json.loads(x) for x in Path(DATA).read_text().splitlines()[:40]}.values())[:32]
ONE_EPOCH = dict(
    data=ROWS,
    max_steps=-1,
    num_train_epochs=1,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=1,
    learning_rate=LR,
    save_steps=3,
)


def record_into(path: str) -> None:
    """From now on, append the rows of every micro-batch this process trains on to `path`, one JSON
    list of token ids a line; a rank's stand-in row with no target (an epoch's last step) is left out."""
    inner = one_step.loss_sum

    def recording(net, batch, *args, **kwargs):
        with open(path, "a") as f:
            for ids, labels, mask in zip(
                batch["input_ids"].tolist(),
                batch["labels"].tolist(),
                batch["attention_mask"].tolist(),
                strict=True,
            ):
                if any(t != -100 for t in labels):
                    f.write(json.dumps([t for t, m in zip(ids, mask, strict=True) if m]) + "\n")
        return inner(net, batch, *args, **kwargs)

    one_step.loss_sum = recording


RECORDING_WORKER = (
    "import os\n"
    "from tests.recipes.test_resume_epochs import record_into\n"
    "record_into(os.environ['NBTRAIN_TEST_ROWS'] + '.' + os.environ['RANK'])\n" + tsd.WORKER
)


def _read(path: Path) -> list[tuple[int, ...]]:
    return [tuple(json.loads(x)) for x in path.read_text().splitlines()] if path.exists() else []


def _crash_copy(run: Path, step: int, to: Path) -> None:
    """What a crash after checkpoint-`step` leaves: the checkpoint and the rows logged up to it."""
    to.mkdir()
    shutil.copytree(run / f"checkpoint-{step}", to / f"checkpoint-{step}")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (to / "metrics.jsonl").write_text("\n".join(lines[:step]) + "\n")


def _resume_on_two(tmp: Path, crashed: Path, monkeypatch, **kw) -> tuple[list[dict], list]:
    """Resume `crashed` on two ranks; (rank 0's result, the rows both ranks trained on)."""
    monkeypatch.setattr(tsd, "WORKER", RECORDING_WORKER)
    log = tmp / f"rows-{crashed.name}"
    monkeypatch.setenv("NBTRAIN_TEST_ROWS", str(log))
    two = run_ranks(tmp, 2, **kw)
    return two[0], _read(Path(f"{log}.0")) + _read(Path(f"{log}.1"))


@pytest.fixture(scope="module")
def one_rank(tiny, tmp_path_factory):
    """The uninterrupted one-rank epoch (16 steps, a checkpoint every 3) and the rows of each step."""
    import torch

    tmp = tmp_path_factory.mktemp("one-rank")
    log = tmp / "rows"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture: one_torch_thread is not set up yet
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(one_step, "loss_sum", one_step.loss_sum)  # undone after the run
            record_into(str(log))
            result = finetune(SFTConfig(**_kw(tiny, tmp / "run", **ONE_EPOCH)))
    finally:
        torch.set_num_threads(threads)
    assert result.global_step == 16
    rows = _read(log)
    assert len(rows) == 32 and len(set(rows)) == 32  # 2 rows a step for 16 steps: every row once
    return tmp / "run", result, rows


@pytest.mark.parametrize(
    ("at", "first_data_step"),
    [
        # 18 rows done: 4 of the 8 two-rank steps and half of the fifth, whose rows 16-17 are skipped
        (9, 4),
        # 24 rows done: exactly 6 two-rank steps
        (12, 6),
    ],
)
def test_one_epoch_resumed_on_two_ranks_ends_after_one_epoch(
    one_rank, tiny, tmp_path, monkeypatch, at, first_data_step
):
    run, one, one_rows = one_rank
    crashed = tmp_path / f"crashed-{at}"
    _crash_copy(run, at, crashed)
    two, rows = _resume_on_two(
        tmp_path, crashed, monkeypatch, **_kw(tiny, crashed, resume="latest", **ONE_EPOCH)
    )

    # the run ends when the epoch's data is done: 8 - first_data_step steps after the checkpoint,
    # not at the 16 steps it was on one rank, nor after another epoch
    last = at + 8 - first_data_step
    h = two["history"]
    assert two["state"] == "done" and [r["step"] for r in h] == list(range(1, last + 1))
    assert h[-1]["epoch"] == 1.0
    # the epoch column after the checkpoint is the two-rank data position
    assert [r["epoch"] for r in h[at:]] == [(p + 1) / 8 for p in range(first_data_step, 8)]

    # every row once: the one-rank steps before the checkpoint, and the resumed steps, which take
    # the rest of the epoch's rows (2 of them in a step that starts inside the checkpoint's batch)
    assert Counter(one_rows[: 2 * at] + rows) == Counter(one_rows)
    state = json.loads((crashed / f"checkpoint-{last}" / "trainer_state.json").read_text())
    assert state["data_position"]["rows_consumed"] == 32 and state["epoch"] == 1.0

    # the learning-rate schedule runs on data steps, to zero at the run's end: linear from the
    # fraction of the data the checkpoint had trained, first_data_step / 8 (one rank: at / 16)
    lrs = [r["learning_rate"] for r in h[at:]]
    assert lrs == pytest.approx([LR * (8 - p) / 8 for p in range(first_data_step, 8)], rel=1e-6)
    if 2 * first_data_step == at:  # aligned: the same rates the one-rank run used at those points
        assert lrs == pytest.approx(one.history["learning_rate"].tolist()[at::2], rel=1e-6)


def test_max_steps_run_resumed_on_two_ranks_ends_at_max_steps(tiny, tmp_path, monkeypatch):
    kw = dict(ONE_EPOCH, max_steps=6)
    finetune(SFTConfig(**_kw(tiny, tmp_path / "one", **kw)))
    crashed = tmp_path / "crashed"
    _crash_copy(tmp_path / "one", 3, crashed)
    two, rows = _resume_on_two(
        tmp_path, crashed, monkeypatch, **_kw(tiny, crashed, resume="latest", **kw)
    )

    h = two["history"]
    assert two["state"] == "done" and [r["step"] for r in h] == [1, 2, 3, 4, 5, 6]
    # 6 rows before the checkpoint; then 2 (the rest of the two-rank step they end in) + 4 + 4
    assert len(rows) == 10 and h[-1]["epoch"] == 4 / 8
    state = json.loads((crashed / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["data_position"]["rows_consumed"] == 16
    # a max_steps schedule keeps its steps: linear to zero at step 6
    assert [r["learning_rate"] for r in h[3:]] == pytest.approx(
        [LR * (6 - s) / 6 for s in (3, 4, 5)], rel=1e-6
    )
