"""finetune across real processes and a real gloo process group (no mocks).

Each rank is a separate Python process launched with the torchrun-style environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so finetune sets up the group itself through env://, as under torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nbtrain.configs.sft import SFTConfig
from nbtrain.recipes.train import finetune

REPO = Path(__file__).resolve().parents[2]
DATA = str(REPO / "nbtrain" / "data" / "examples" / "instructions.jsonl")

# one rank of run_ranks: finetune on the kw in argv[1], its result to the file argv[2].<rank>
WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from nbtrain.configs.sft import SFTConfig
    from nbtrain.recipes.train import finetune

    kw = json.loads(sys.argv[1])
    merge = kw.pop("merge", False)
    result = finetune(SFTConfig(**kw), merge=merge)
    rank = int(os.environ["RANK"])
    with open(sys.argv[2] + f".{rank}", "w") as f:
        json.dump({"rank": rank, "adapter_dir": result.adapter_dir, "merged_dir": result.merged_dir,
                   "state": result.state, "plan": result.plan,
                   "history": result.history.to_dict(orient="records")}, f)
    """
)

# one BLAS thread: the test machine is small and shared (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999 by default): the ports the
    kernel hands out for every outgoing connection (and a bind to port 0) meanwhile, under a busy CI,
    cannot take it before the rendezvous binds it. Ray's workers use 10002-19999."""
    import random

    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    tmp: Path, world: int, local_world: int | None = None, check: bool = True, **kw
) -> list[dict]:
    """Run finetune(SFTConfig(**kw)) on `world` processes with the torchrun environment, as nodes of
    `local_world` ranks each (default: one node of all); `merge=True` in `kw` is passed to finetune.
    Return each rank's result: rank, adapter_dir, merged_dir, state, plan and history (a list of rows).
    A rank that fails fails the call with an AssertionError holding the tail of its output; with
    `check=False` each rank's exit code and output are returned instead, as {"rc", "output"}."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    results = tmp / f"result-{os.urandom(4).hex()}"
    port = _free_port()
    local = local_world or world
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % local),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), json.dumps(kw), str(results)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        deadline = time.monotonic() + 300
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        # a rank that waits for ever (its peer died before the rendezvous, say): every rank's own
        # output says why, not only the timeout of the one waited on
        for p in procs:
            p.kill()
        # the ranks already read keep what was read; the others give theirs now
        outputs += [p.communicate()[0] for p in procs[len(outputs) :]]
        said = [
            f"rank {r} (rc {p.returncode}):\n{out[-3000:]}"
            for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
        ]
        raise AssertionError(
            f"{world} ranks did not end within 300 s:\n" + "\n".join(said)
        ) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if not check:
        return [{"rc": p.returncode, "output": out} for p, out in zip(procs, outputs, strict=True)]
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
    return [json.loads(Path(f"{results}.{r}").read_text()) for r in range(world)]


def _kw(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=DATA,
        output_dir=str(out),
        max_steps=5,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_length=48,
        logging_steps=1,
        save_steps=None,
        lora_r=8,
        lora_dropout=0.0,
        seed=3,
    )
    base.update(kw)
    return base


def _adapter(path):
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def _losses(history):
    # computed in float32: compare at float32 tolerances
    return torch.tensor([row["loss"] for row in history], dtype=torch.float32)


def test_two_ranks_equal_one_rank_with_twice_the_batch(tiny, tmp_path):
    eval_rows = [
        json.loads(x) for x in Path(DATA).read_text().splitlines()[:21]
    ]  # odd: uneven shards
    two = run_ranks(tmp_path, 2, **_kw(tiny, tmp_path / "two", eval_data=eval_rows, eval_steps=5))
    one = finetune(
        SFTConfig(
            **_kw(
                tiny,
                tmp_path / "one",
                per_device_train_batch_size=4,
                eval_data=eval_rows,
                eval_steps=5,
            )
        )
    )

    h2, h1 = two[0]["history"], one.history.to_dict(orient="records")
    assert [r["step"] for r in h2] == [1, 2, 3, 4, 5]

    # every rank returns the same history (timings are each rank's own clock)
    def untimed(h):
        return [
            {k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time", "eval_loss")}
            for r in h
        ]

    assert untimed(two[1]["history"]) == untimed(h2)
    torch.testing.assert_close(_losses(h2), _losses(h1))
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in h2]), torch.tensor([r["grad_norm"] for r in h1])
    )
    # evaluation gives the same number whatever the world size
    assert h2[-1]["eval_loss"] == pytest.approx(h1[-1]["eval_loss"], rel=1e-5)
    # global tokens: two ranks process the same tokens per step as one rank with the whole batch
    a2, a1 = _adapter(two[0]["adapter_dir"]), _adapter(one.adapter_dir)
    assert a2.keys() == a1.keys()
    # gradients agree to float32 rounding (summation order differs), but Adam divides each update by
    # sqrt(v): a near-zero gradient component can move by a sizeable fraction of lr, hence the atol
    torch.testing.assert_close(a2, a1, atol=1e-4, rtol=1e-3)
    # the adapter moved away from its init (lora_B starts at zero), so the comparison means something
    assert max(v.abs().max().item() for k, v in a2.items() if "lora_B" in k) > 1e-3

    # rank 1 exports nothing and writes nothing; rank 0 wrote the run folder
    assert two[0]["adapter_dir"] == str(tmp_path / "two" / "adapter")
    assert two[1]["adapter_dir"] is None
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "adapter",
        "metrics.jsonl",
        "sft_config.json",
    ]


def test_resume_latest_on_two_ranks_equals_uninterrupted(tiny, tmp_path):
    kw = dict(max_steps=4, save_steps=2, lora_dropout=0.1)
    full = run_ranks(tmp_path, 2, **_kw(tiny, tmp_path / "full", **kw))
    ck = tmp_path / "full" / "checkpoint-2"
    assert sorted(p.name for p in ck.glob("rng_state_*.pth")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]

    # what a kill after step 3 leaves: checkpoint-2 and the rows logged so far
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(ck, crashed / "checkpoint-2")
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    resumed = run_ranks(tmp_path, 2, **_kw(tiny, crashed, resume="latest", **kw))

    assert [r["step"] for r in resumed[0]["history"]] == [1, 2, 3, 4]
    torch.testing.assert_close(_losses(resumed[0]["history"]), _losses(full[0]["history"]))
    torch.testing.assert_close(
        _adapter(resumed[0]["adapter_dir"]), _adapter(full[0]["adapter_dir"])
    )


def test_config_error_on_two_ranks_is_raised_everywhere(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"nope": 1}\n')
    with pytest.raises(AssertionError) as e:
        run_ranks(tmp_path, 2, **_kw(tiny, tmp_path / "bad-out", data=str(bad)))
    assert "rank 0 failed" in str(e.value) and "row 1 is in none of the known formats" in str(
        e.value
    )
    assert not (tmp_path / "bad-out").exists()


def test_a_finished_run_is_refused_on_every_rank_before_any_write(tiny, tmp_path):
    out = tmp_path / "done"
    run_ranks(tmp_path, 2, **_kw(tiny, out, max_steps=2))
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    ranks = run_ranks(tmp_path, 2, check=False, **_kw(tiny, out, max_steps=3))
    for r in ranks:
        assert r["rc"] != 0
        assert f"output_dir {str(out)!r} holds another run (adapter, metrics.jsonl" in r["output"]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_resume_on_more_ranks_ends_after_its_epochs_on_the_same_schedule(tiny, tmp_path):
    # one epoch of 32 rows: 16 steps on one rank with batch 2, but 8 on two ranks with batch 2 each
    rows = [json.loads(x) for x in Path(DATA).read_text().splitlines()[:32]]
    kw = dict(
        data=rows,
        max_steps=-1,
        num_train_epochs=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        save_steps=4,
    )
    one = finetune(SFTConfig(**_kw(tiny, tmp_path / "one", **kw)))
    assert one.global_step == 16

    # the one-rank run stopped after step 9 and goes on on two ranks
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(tmp_path / "one" / "checkpoint-8", crashed / "checkpoint-8")
    lines = (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:9]) + "\n")
    two = run_ranks(tmp_path, 2, **_kw(tiny, crashed, resume="latest", **kw))

    # checkpoint-8 had trained 16 of the 32 rows: the other 16 are 4 steps of 4 rows on two ranks,
    # so the one epoch asked for ends at step 12 (not at the 16 steps one rank needed)
    h = two[0]["history"]
    assert two[0]["state"] == "done" and [r["step"] for r in h] == list(range(1, 13))
    assert h[-1]["epoch"] == pytest.approx(1.0)
    # the learning rate follows the data: step 8+k is where the one-rank run was after 8+2k steps
    lr_one = one.history["learning_rate"].to_numpy()
    torch.testing.assert_close(
        torch.tensor([r["learning_rate"] for r in h], dtype=torch.float64),
        torch.tensor([*lr_one[:8], lr_one[8], lr_one[10], lr_one[12], lr_one[14]]),
    )
    assert all(r["loss"] > 0 for r in h[8:])
    moved = [
        (a - b).abs().max().item()
        for a, b in zip(
            _adapter(two[0]["adapter_dir"]).values(),
            _adapter(crashed / "checkpoint-8").values(),
            strict=True,
        )
    ]
    assert max(moved) > 1e-4  # it trained after the checkpoint
    assert [p.name for p in sorted(crashed.glob("checkpoint-*"))] == [
        "checkpoint-12",
        "checkpoint-8",
    ]
