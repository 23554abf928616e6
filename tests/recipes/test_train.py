"""finetune in a plain process (world size 1): the loop, metrics, checkpoints, resume, stop, export."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nbtrain import runs
from nbtrain.configs.sft import SFTConfig
from nbtrain.errors import ConfigError
from nbtrain.model import checkpoint as ckpt
from nbtrain.recipes.train import finetune

DATA = str(
    Path(__file__).resolve().parents[2] / "nbtrain" / "data" / "examples" / "instructions.jsonl"
)
LINE = re.compile(
    r"^step (\d+)/(\d+) \| loss \d+\.\d{4} \| grad_norm \d+\.\d{2} \| lr \d\.\d{2}e[-+]\d{2} \| "
    r"\d+\.\d{2} s \| [\d,]+ tok/s( \| eval_loss \d+\.\d{4})?$"
)

# one BLAS thread: the test machine is small and shared (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cfg(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=DATA,
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_length=48,
        logging_steps=1,
        save_steps=None,
        lora_r=8,
        lora_dropout=0.0,
    )
    base.update(kw)
    return SFTConfig(**base)


def _adapter(path):
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def _eval_loss_by_hand(base_dir, adapter_dir, rows, max_length):
    """Token-mean loss over `rows` computed independently of finetune's own eval loop."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbtrain.data.loader import encode_row

    tok = AutoTokenizer.from_pretrained(adapter_dir)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir
    ).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ex = encode_row(row, tok, max_length)
            logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0, :-1]
            labels = torch.tensor(ex.labels[1:])
            total += torch.nn.functional.cross_entropy(
                logits, labels, ignore_index=-100, reduction="sum"
            ).item()
            count += ex.n_targets
    return total / count


def test_finetune_learns_logs_checkpoints_and_exports(tiny, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eval_rows = [json.loads(x) for x in Path(DATA).read_text().splitlines()[:24]]
    out = tmp_path / "run"
    cfg = make_cfg(
        tiny, out, max_steps=40, logging_steps=5, save_steps=20, eval_data=eval_rows, eval_steps=20
    )
    t0 = time.perf_counter()
    result = finetune(cfg)
    elapsed = time.perf_counter() - t0

    h = result.history
    assert list(h["step"]) == [5, 10, 15, 20, 25, 30, 35, 40]
    for col in ("loss", "grad_norm", "learning_rate", "tokens_per_s", "step_time", "epoch"):
        assert h[col].notna().all(), col
    assert h["eval_loss"].notna().tolist() == [False, False, False, True, False, False, False, True]
    assert "mfu" not in h and "peak_memory_gb" not in h  # GPU-only metrics
    assert h["epoch"].iloc[-1] == pytest.approx(40 / (400 // 4))
    assert h["loss"].iloc[-1] < h["loss"].iloc[0] - 0.5, h["loss"].tolist()  # it learns
    assert h["eval_loss"].iloc[-1] < h["eval_loss"].iloc[3]
    assert (h["tokens_per_s"] > 0).all()
    assert result.state == "done" and result.global_step == 40
    print(f"[timing] 40 steps in {elapsed:.1f}s")

    # the log line, once per logging step, and metrics.jsonl holding the same rows as the history
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert len(lines) == 8 and all(LINE.match(x) for x in lines), lines
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert rows[-1]["loss"] == pytest.approx(h["loss"].iloc[-1])

    # checkpoints: adapter, optimizer, scheduler, RNG, data position, config
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-20", "checkpoint-40"]
    c20 = out / "checkpoint-20"
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pth",
        "trainer_state.json",
        "sft_config.json",
    ):
        assert (c20 / name).is_file(), name
    state = json.loads((c20 / "trainer_state.json").read_text())
    assert state["global_step"] == 20 and state["data_position"]["rows_consumed"] == 80
    assert json.loads((c20 / "sft_config.json").read_text())["eval_data"] == "<list of 24 rows>"

    # export: PeftModel.from_pretrained loads it; the eval number matches an independent computation
    assert result.adapter_dir == str(out / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in out.joinpath("adapter").iterdir()
    }
    torch.testing.assert_close(_adapter(result.adapter_dir), _adapter(out / "checkpoint-40"))
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny), result.adapter_dir
    )
    assert any(
        n.endswith("lora_B.default.weight") and p.abs().sum() > 0
        for n, p in model.named_parameters()
    )
    want = _eval_loss_by_hand(tiny, result.adapter_dir, eval_rows, 48)
    assert h["eval_loss"].iloc[-1] == pytest.approx(want, rel=1e-4)

    record = runs.get_run(runs.run_id_for(out))
    assert record["state"] == "done" and record["step"] == 40 and record["total_steps"] == 40


def test_merge_writes_a_model_equal_to_base_plus_adapter(tiny, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    # the model given by a relative path, as a notebook next to its model folder would
    monkeypatch.chdir(Path(tiny).parent)
    cfg = make_cfg(tiny, tmp_path / "m", model=Path(tiny).name, max_steps=3, save_steps=3)
    result = finetune(cfg, merge=True)
    monkeypatch.undo()
    assert result.merged_dir == str(tmp_path / "m" / "merged")
    # the adapter names its base by absolute path, so it loads from any working directory
    for folder in (result.adapter_dir, tmp_path / "m" / "checkpoint-3"):
        base = json.loads(Path(folder, "adapter_config.json").read_text())
        assert base["base_model_name_or_path"] == str(Path(tiny).resolve()), folder
    # training turns the KV cache off; the merged model gets the base model's setting back
    assert AutoConfig.from_pretrained(tiny).use_cache is True
    assert AutoConfig.from_pretrained(result.merged_dir).use_cache is True
    merged = AutoModelForCausalLM.from_pretrained(result.merged_dir).eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny), result.adapter_dir
    ).eval()
    x = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=x).logits, peft(input_ids=x).logits, atol=1e-5, rtol=1e-4
        )


def test_resume_latest_equals_uninterrupted(tiny, tmp_path):
    # dropout on, so the restored RNG state matters too
    kw = dict(
        max_steps=6, save_steps=3, lora_dropout=0.1, lr_scheduler_type="cosine", warmup_steps=2
    )
    full = finetune(make_cfg(tiny, tmp_path / "full", **kw))

    # the interrupted run: what a crash after step 4 leaves (checkpoint-3, rows logged up to step 4)
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", crashed / "checkpoint-3")
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")
    (crashed / ".tmp-checkpoint-6-999").mkdir()  # a save cut short by the crash

    resumed = finetune(make_cfg(tiny, crashed, resume="latest", **kw))
    assert list(resumed.history["step"]) == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(
        torch.tensor(resumed.history["loss"].to_numpy()),
        torch.tensor(full.history["loss"].to_numpy()),
    )
    torch.testing.assert_close(_adapter(resumed.adapter_dir), _adapter(full.adapter_dir))
    steps = [json.loads(x)["step"] for x in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # rows after the checkpoint were dropped, then redone
    # the cut-short save's leftover was swept by the next save
    assert not list(crashed.glob(".tmp-*"))

    # a checkpoint path works too, and without dropout restored RNG would not matter: check it does
    again = finetune(
        make_cfg(tiny, tmp_path / "again", resume=str(tmp_path / "full" / "checkpoint-3"), **kw)
    )
    torch.testing.assert_close(_adapter(again.adapter_dir), _adapter(full.adapter_dir))


def _tensors(obj, where="checkpoint"):
    """Every tensor in a nested structure of dicts, lists and tuples, with where it sits."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{where}[{k!r}]")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{where}[{i}]")


def _as_if_saved_on_gpu(path, monkeypatch):
    """Rewrite a torch.save file so its storages say cuda:0, as a file saved on a GPU does."""
    obj = torch.load(path, weights_only=False)
    with monkeypatch.context() as m:
        # torch.save asks this registry where each storage lives: the first answer wins
        registry = torch.serialization._package_registry
        m.setattr(
            torch.serialization,
            "_package_registry",
            [(0, lambda storage: "cuda:0", lambda storage, location: None), *registry],
        )
        torch.save(obj, path)


def test_checkpoint_loads_onto_the_cpu_even_when_written_on_a_gpu(tiny, tmp_path, monkeypatch):
    kw = dict(max_steps=4, save_steps=2, lora_dropout=0.1)
    full = finetune(make_cfg(tiny, tmp_path / "full", **kw))
    ck = tmp_path / "gpu-run" / "checkpoint-2"
    shutil.copytree(tmp_path / "full" / "checkpoint-2", ck)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth"):
        _as_if_saved_on_gpu(ck / name, monkeypatch)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(ck / "optimizer.pt", weights_only=False)  # the file really says cuda:0

    loaded = ckpt.load_checkpoint(ck)
    found = list(_tensors(loaded))
    assert any("exp_avg_sq" in where for where, _ in found)  # the optimizer state was walked
    assert [where for where, t in found if t.device.type != "cpu"] == []

    # and it resumes, on this CPU, to the same adapter as the uninterrupted run
    again = finetune(make_cfg(tiny, tmp_path / "gpu-run", resume="latest", **kw))
    assert again.global_step == 4
    torch.testing.assert_close(_adapter(again.adapter_dir), _adapter(full.adapter_dir))


def test_resume_keeps_the_run_length_and_refuses_when_nothing_is_left(tiny, tmp_path):
    out = tmp_path / "run"
    kw = dict(save_steps=3, lr_scheduler_type="linear")
    first = finetune(make_cfg(tiny, out, max_steps=5, **kw))
    # the last step is checkpointed too, though 5 is not a multiple of save_steps
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-3", "checkpoint-5"]
    before = (out / "metrics.jsonl").read_text()

    # a finished run has nothing left: refuse rather than report "done" without a step
    with pytest.raises(ConfigError) as e:
        finetune(make_cfg(tiny, out, max_steps=5, resume="latest", **kw))
    for words in ("checkpoint-5", "at step 5", "5 steps long", "max_steps larger than 5"):
        assert words in str(e.value)
    # an explicit max_steps below the checkpoint's step is refused too, naming both numbers
    with pytest.raises(ConfigError) as e:
        finetune(make_cfg(tiny, out, max_steps=2, resume=str(out / "checkpoint-3"), **kw))
    for words in ("at step 3", "2 steps long (max_steps=2)", "max_steps larger than 3"):
        assert words in str(e.value)
    assert (out / "metrics.jsonl").read_text() == before  # nothing was written
    assert runs.get_run(runs.run_id_for(out))["state"] == "done"

    # a longer max_steps continues: the schedule is then the new length's
    more = finetune(make_cfg(tiny, out, max_steps=7, resume="latest", **kw))
    assert more.global_step == 7 and list(more.history["step"]) == list(range(1, 8))
    lr = more.history["learning_rate"].to_numpy()
    torch.testing.assert_close(
        torch.tensor(lr[5:]), torch.tensor([1e-2 * (7 - 5) / 7, 1e-2 * (7 - 6) / 7]).double()
    )
    torch.testing.assert_close(
        torch.tensor(lr[:5]), torch.tensor(first.history["learning_rate"].to_numpy())
    )


def test_final_checkpoint_and_save_total_limit(tiny, tmp_path):
    out = tmp_path / "limited"
    result = finetune(make_cfg(tiny, out, max_steps=7, save_steps=3, save_total_limit=2))
    # saved at 3, 6 and the last step 7; the oldest went once there were more than two
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-6", "checkpoint-7"]
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".old-*"))
    assert json.loads((out / "checkpoint-7" / ckpt.STATE_FILE).read_text())["global_step"] == 7
    torch.testing.assert_close(_adapter(out / "checkpoint-7"), _adapter(result.adapter_dir))
    with pytest.raises(ConfigError, match=r"save_total_limit=0 must be an integer >= 1"):
        make_cfg(tiny, out, save_total_limit=0)


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / ckpt.STATE_FILE).write_text("{}")
    (tmp_path / "checkpoint-8").mkdir()  # incomplete (no state file): neither counted nor deleted
    # a run resumed from checkpoint-2 of an output_dir that holds later ones just wrote checkpoint-2
    gone = ckpt.prune_checkpoints(tmp_path, 2, tmp_path / "checkpoint-2")
    assert [p.name for p in gone] == ["checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-2",
        "checkpoint-6",
        "checkpoint-8",
    ]
    assert ckpt.prune_checkpoints(tmp_path, 2, tmp_path / "checkpoint-6") == []


def test_stop_request_checkpoints_and_exports(tiny, tmp_path):
    out = tmp_path / "stop"
    run_id = runs.run_id_for(out)

    def stopper():
        deadline = time.time() + 60
        while time.time() < deadline:
            rec = runs.get_run(run_id)
            if rec and rec.get("state") == "running" and (rec.get("step") or 0) >= 2:
                runs.request_stop(run_id)
                return
            time.sleep(0.002)

    t = threading.Thread(target=stopper)
    t.start()
    result = finetune(make_cfg(tiny, out, max_steps=2000))
    t.join()
    assert result.state == "stopped"
    assert 2 <= result.global_step < 2000
    assert ckpt.list_checkpoints(out)[-1].name == f"checkpoint-{result.global_step}"
    assert Path(result.adapter_dir, "adapter_model.safetensors").is_file()
    assert runs.get_run(run_id)["state"] == "stopped"
    assert not runs.stop_requested(run_id)
    assert result.history["step"].iloc[-1] == result.global_step


def test_atomic_save_leaves_previous_checkpoint(tmp_path):
    def good(tmp):
        (tmp / "a.txt").write_text("v1")
        (tmp / ckpt.STATE_FILE).write_text("{}")

    def dies(tmp):
        (tmp / "a.txt").write_text("v2")
        raise KeyboardInterrupt  # a kill mid-save

    ckpt.write_atomic_dir(tmp_path / "checkpoint-1", good)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_atomic_dir(tmp_path / "checkpoint-1", dies)
    assert (tmp_path / "checkpoint-1" / "a.txt").read_text() == "v1"
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_atomic_dir(tmp_path / "checkpoint-2", dies)
    assert not (tmp_path / "checkpoint-2").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]
    # a folder without its state file (written last) is not a checkpoint
    (tmp_path / "checkpoint-3").mkdir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-1"]


# --------------------------------------------------------------------------------------- bad inputs
def _not_causal(tmp_path):
    from transformers import T5Config

    path = tmp_path / "t5"
    T5Config(d_model=16, num_layers=1).save_pretrained(path)
    return str(path)


def _no_config(tmp_path):
    path = tmp_path / "empty-model"
    path.mkdir()
    return str(path)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("bad_row", ["row 3", "'question'", "'prompt' + 'completion'"]),
        ("target", ["['nope']", "not found", "q_proj", "down_proj", "all-linear"]),
        ("not_causal", ["not a causal language model", "t5"]),
        ("no_config", ["no config.json"]),
        ("too_small", ["too few rows", "lower the batch size"]),
        ("bad_json", ["line 2 is not valid JSON"]),
        ("hub", ["not a local folder", "Hub"]),
    ],
)
def test_bad_input_fails_before_any_step_and_writes_nothing(
    tiny, tmp_path, monkeypatch, case, words
):
    out = tmp_path / "out"
    kw: dict = {}
    if case == "bad_row":
        kw["data"] = [{"text": "a"}] * 3 + [{"question": "q", "answer": "a"}]
    elif case == "target":
        kw["target_modules"] = ["nope"]
    elif case == "not_causal":
        kw["model"] = _not_causal(tmp_path)
    elif case == "no_config":
        kw["model"] = _no_config(tmp_path)
    elif case == "too_small":
        kw["data"] = [{"text": "a"}] * 3
    elif case == "bad_json":
        p = tmp_path / "bad.jsonl"
        p.write_text('{"text": "a"}\n{"text": \n')
        kw["data"] = str(p)
    elif case == "hub":
        import huggingface_hub.constants

        # no network here: offline mode gives the same failure without minutes of retries
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        kw["model"] = "nbtrain-test/no-such-model"
    cfg = make_cfg(tiny, out, **kw)
    with pytest.raises(ConfigError) as e:
        finetune(cfg)
    for w in words:
        assert w in str(e.value)
    assert not out.exists()
    assert runs.get_run(runs.run_id_for(out)) is None


def test_output_dir_with_another_runs_checkpoints(tiny, tmp_path):
    out = tmp_path / "used"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(
        ConfigError,
        match=r"holds another run's checkpoints \(checkpoint-5\).*resume='latest'.*overwrite=True",
    ):
        finetune(make_cfg(tiny, out))
    assert sorted(p.name for p in out.iterdir()) == before
    # resume='latest' needs a complete checkpoint
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        finetune(make_cfg(tiny, out, resume="latest"))
    with pytest.raises(ConfigError, match="resume='latest' but output_dir"):
        finetune(make_cfg(tiny, tmp_path / "fresh", resume="latest"))
    assert not (tmp_path / "fresh").exists()
    # overwrite=True starts over, removing only nbtrain's own files
    result = finetune(make_cfg(tiny, out, max_steps=2, overwrite=True))
    assert result.global_step == 2
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter",
        "metrics.jsonl",
        "notes.txt",
        "sft_config.json",
    ]
    assert json.loads((out / "sft_config.json").read_text())["max_steps"] == 2


def test_a_finished_run_without_checkpoints_is_not_overwritten(tiny, tmp_path):
    # save_steps=None leaves no checkpoint, only the adapter, the metrics, the config and a record
    out = tmp_path / "done"
    first = finetune(make_cfg(tiny, out, max_steps=2), merge=True)
    assert not ckpt.list_checkpoints(out)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    with pytest.raises(ConfigError) as e:
        finetune(make_cfg(tiny, out, max_steps=3))
    text = str(e.value)
    for words in (
        "adapter",
        "merged",
        "metrics.jsonl",
        "sft_config.json",
        "a done run in the runs registry",
        "overwrite=True",
        "new output_dir",
    ):
        assert words in text, (words, text)
    assert "resume='latest'" not in text  # there is nothing to resume from
    # nothing was written: every file is as the first run left it, and its record still says done
    assert sorted(p for p in out.rglob("*") if p.is_file()) == files
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before
    assert runs.get_run(runs.run_id_for(out))["state"] == "done"
    assert first.global_step == 2

    # each thing a run leaves is enough on its own, the registry's record included
    for left in ("adapter", "merged", "metrics.jsonl", "sft_config.json", "samples.jsonl", None):
        one = tmp_path / f"only-{left}"
        one.mkdir()
        if left is None:
            runs.register_run(one)
            left = "a running run in the runs registry"
        elif "." in left:
            (one / left).write_text("{}\n")
        else:
            (one / left).mkdir()
        with pytest.raises(ConfigError, match=re.escape(f"holds another run ({left})")):
            finetune(make_cfg(tiny, one))

    # overwrite=True starts over
    again = finetune(make_cfg(tiny, out, max_steps=3, overwrite=True))
    assert again.global_step == 3
    assert not (out / "merged").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]


def test_finetune_needs_an_sftconfig():
    with pytest.raises(ConfigError, match="nbtrain.SFTConfig"):
        finetune({"model": "x"})  # type: ignore[arg-type]


def test_epochs_packing_and_gradient_checkpointing(tiny, tmp_path):
    rows = [{"text": f"the number {i} comes after {i - 1}"} for i in range(1, 41)]
    result = finetune(
        make_cfg(
            tiny,
            tmp_path / "ep",
            data=rows,
            max_steps=-1,
            num_train_epochs=2,
            packing=True,
            max_length=16,
            gradient_checkpointing=True,
            logging_steps=100,
            dtype="float32",
        )
    )
    from nbtrain.data.loader import encode_row
    from nbtrain.model.pretrained import load_tokenizer

    tok = load_tokenizer(tiny)
    # packed rows are not cut at max_length: a row longer than a block continues in the next one,
    # and the last block and the last step of an epoch take what is left
    tokens = sum(len(encode_row(r, tok, None).input_ids) for r in rows)
    steps_per_epoch = -(-tokens // 16) // 4 + (-(-tokens // 16) % 4 > 0)
    assert result.global_step == 2 * steps_per_epoch
    assert list(result.history["step"]) == [2 * steps_per_epoch]
    assert result.history["epoch"].iloc[-1] == pytest.approx(2.0)
    # the blocks hold the data's tokens and no pad: each epoch counts exactly its tokens
    row = result.history.iloc[-1]
    assert row["tokens_per_s"] * row["step_time"] == pytest.approx(tokens / steps_per_epoch)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 autocast, MFU, peak memory)"
)
def test_gpu_bf16_metrics(tiny, tmp_path):
    result = finetune(make_cfg(tiny, tmp_path / "gpu", max_steps=4, logging_steps=2))
    h = result.history
    assert (h["peak_memory_gb"] > 0).all() and (h["peak_memory_gb_rank0"] > 0).all()
    name = torch.cuda.get_device_name()
    if torch.cuda.is_bf16_supported() and any(k in name for k in ("H100", "H200", "A100")):
        assert (h["mfu"] > 0).all() and (h["mfu"] < 1).all()
    assert h["loss"].notna().all()
