"""`nbtrain.scaling` / `Cluster.scaling` / `%nbtrain scaling` end to end on a real 4-rank local gloo
cluster (one host, so sizes are given in ranks): a row per size from real sub-group fine-tunes, the
all-reduce wait measured, efficiencies from tokens/s, predicted rows marked, the report's files, and
bad input refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nbtrain.configs.sft import SFTConfig
from nbtrain.errors import ConfigError
from tests.conftest import quiet

REPO = Path(__file__).resolve().parents[3]
DATA = str(REPO / "nbtrain" / "data" / "examples" / "instructions.jsonl")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(gloo4):
    return gloo4


def _cfg(tiny, out, **kw):
    base = dict(
        model=tiny,
        data=DATA,
        output_dir=str(out),
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_length=48,
        lora_r=8,
        lora_dropout=0.0,
        seed=3,
    )
    base.update(kw)
    return SFTConfig(**base)


def test_scaling_report_on_ranks(cluster, tiny, tmp_path):
    import nbtrain
    from nbtrain.runs import list_runs

    before = list_runs()
    cfg = _cfg(tiny, tmp_path / "user-run")
    report = nbtrain.scaling(cfg, ranks=[1, 2, 4], steps=5, predict=[8], out=str(tmp_path / "rep"))
    # the sizes' scratch runs leave no record in the runs sidebar; the report, saved with out=, has one
    new = [r for r in list_runs() if r["id"] not in {b["id"] for b in before}]
    assert [(r["kind"], r["state"]) for r in new] == [("scaling", "done")]
    assert new[0]["scaling"] == str((tmp_path / "rep").resolve())
    assert new[0]["measured"] == str((tmp_path / "user-run").resolve())
    t = report.table
    assert list(t["ranks"]) == [1, 2, 4, 8]
    assert list(t["kind"]) == ["measured", "measured", "measured", "predicted"]
    rows = report.measured
    # weak scaling: the global batch grows with the ranks
    assert [r["global_batch"] for r in rows] == [2, 4, 8]
    assert all(r["steps_timed"] == 3 for r in rows)  # 5 steps, 2 warm-up steps left out
    for r in rows:
        assert r["efficiency"] == pytest.approx(
            r["tokens_per_s"] / (rows[0]["tokens_per_s"] * r["ranks"])
        )
        assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / r["ranks"])
        assert r["compute_s"] + r["comm_s"] == pytest.approx(r["step_s"])
    assert rows[0]["comm_s"] == 0.0 and rows[0]["busbw"] is None
    for r in rows[1:]:
        # a real all-reduce was timed in the step and probed on the sub-group
        assert 0 < r["comm_s"] < r["step_s"] and r["comm_s"] <= r["allreduce_s"]
        assert r["busbw"] > 0 and r["latency_s"] > 0 and r["model_comm_s"] > 0
        assert r["allreduces_per_step"] == 1 and 0 < r["grad_bytes"] < 2**20
    pred = report.predicted[0]
    assert pred["assumptions"].startswith("predicted: as measured at 4 ranks:")
    assert pred["busbw"] == rows[-1]["busbw"]
    assert report.verdict.limit in ("compute-bound", "bandwidth-bound", "latency-bound")
    assert "CPU" in report.machine and "backend gloo" in report.machine
    # the report in the folder named, and nothing at all in the config's output_dir
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "scaling.json",
        "scaling.md",
        "scaling.png",
    ]
    data = json.loads((tmp_path / "rep" / "scaling.json").read_text())
    assert [r["ranks"] for r in data["rows"]] == [1, 2, 4, 8]
    # the model's parameters: the base's own and the LoRA's, whose gradients the all-reduce carries
    from transformers import AutoModelForCausalLM

    params = data["settings"]["params"]
    base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny).parameters())
    assert params["total"] - params["trainable"] == base
    assert params["active"] == params["total"]  # dense
    assert rows[1]["grad_bytes"] == 4 * params["trainable"]  # fp32 gradients
    md = (tmp_path / "rep" / "scaling.md").read_text()
    assert f"Model: {params['total']:,} parameters; {params['trainable']:,} trained" in md
    assert not (tmp_path / "user-run").exists()
    # the scratch folders were removed
    left = cluster.run(lambda: __import__("glob").glob("/tmp/nbtrain-scaling-*"), ranks=[0])[0]
    assert left == []


def test_strong_scaling_keeps_the_global_batch(cluster, tiny, tmp_path):
    import nbtrain

    cfg = _cfg(tiny, tmp_path / "user-run", per_device_train_batch_size=1, global_batch_size=4)
    report = nbtrain.scaling(cfg, ranks="1,2,4", steps=4, mode="strong")
    assert [r["global_batch"] for r in report.measured] == [4, 4, 4]
    assert report.predicted == [] and report.folder is None
    assert report.fit.mode == "strong"


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(ranks=[1, 8]), "this cluster has 4 ranks"),
        (dict(nodes=[1, 2]), "this cluster has 1 nodes"),
        (dict(ranks=[0, 2]), "sizes start at 1"),
        (dict(ranks=[1, 2], predict=[2]), "not past the largest measured size"),
        (dict(ranks=[1], predict=[4]), "--busbw"),
        # the default global batch (the smallest size's) does not divide: the message says which does
        (
            dict(ranks=[1, 4], mode="strong"),
            r"(?s)cannot be split into 4 rank.*multiple of 8: SFTConfig\(\.\.\., global_batch_size=8\)",
        ),
        (dict(ranks=[1, 2], steps=3), "at least 4 steps"),
        (dict(ranks=[1, 2], nodes=[1]), "one of them"),
        (dict(ranks=[1, 2], cfg={"model": "x"}), "needs an nbtrain.SFTConfig"),
        (dict(ranks=[1, 2], cfg="auto"), "per_device_train_batch_size='auto'"),
        (dict(ranks=[1, 2], cfg="global"), "weak scaling keeps the per-device batch"),
        (dict(ranks=[1, 2], cfg="gone"), "(?s)finetune would refuse this config:.*data file"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(cluster, tiny, tmp_path, kw, words):
    import nbtrain
    from nbtrain.runs import list_runs

    cfg = kw.pop("cfg", None)
    if cfg == "auto":
        cfg = _cfg(tiny, tmp_path / "o", per_device_train_batch_size="auto")
    elif cfg == "global":
        cfg = _cfg(tiny, tmp_path / "o", global_batch_size=8)
    elif cfg == "gone":
        # valid when made, its data file deleted since
        data = tmp_path / "rows.jsonl"
        data.write_text(Path(DATA).read_text())
        cfg = _cfg(tiny, tmp_path / "o", data=str(data))
        data.unlink()
    elif cfg is None:
        cfg = _cfg(tiny, tmp_path / "o")
    before = len(list_runs())
    with pytest.raises(ConfigError, match=words):
        nbtrain.scaling(cfg, **{"steps": 4, **kw})
    assert len(list_runs()) == before  # no size started
    assert not (tmp_path / "o").exists()


def test_the_magic(ip, cluster, tiny, tmp_path):
    ip.user_ns["scale_cfg"] = _cfg(tiny, tmp_path / "user-run")
    out = quiet(
        ip.run_line_magic,
        "nbtrain",
        f"scaling --config scale_cfg --ranks 1,2 --steps 4 --predict 4 --busbw 0.5 --latency 100 --out {tmp_path / 'm'}",
    )
    assert "report written to" in out
    data = json.loads((tmp_path / "m" / "scaling.json").read_text())
    pred = data["rows"][-1]
    assert pred["predicted"] and pred["ranks"] == 4
    assert pred["busbw"] == 0.5e9 and pred["latency_s"] == pytest.approx(1e-4)
    assert pred["assumptions"].startswith("predicted: given busbw 0.5 GB/s, latency 100 us")
    with pytest.raises(Exception, match="no such name"):
        ip.run_line_magic("nbtrain", "scaling --config nope --ranks 1")
