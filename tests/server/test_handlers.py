"""The jupyter_server extension's REST API, through a real server (pytest-jupyter's jp_fetch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# pytest-jupyter's fixtures, for this module only: as a plugin (pytest_plugins) its autouse
# fixtures would create and close an event loop and a ServerApp around every test of the session
from pytest_jupyter.jupyter_server import *  # noqa: F403
from tornado.httpclient import HTTPClientError

from nbtrain import runs
from tests.conftest import LR_RATES as RATES

FIXTURE_RUN = Path(__file__).parents[1] / "fixtures" / "runs" / "finished-sft"


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"nbtrain.server": True}}}


@pytest.fixture(autouse=True)
def nbtrain_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path / "nbtrain-home"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return tmp_path / "nbtrain-home"


@pytest.fixture
def finished_run(tmp_path):
    """The fixture run folder, copied and registered as a finished run of 200 steps."""
    out = tmp_path / "runs" / "finished-sft"
    shutil.copytree(FIXTURE_RUN, out)
    run_id = runs.register_run(out, name="finished-sft", total_steps=200)
    runs.update_run(run_id, step=200, loss=0.958, tokens_per_s=3165.6)
    runs.finish_run(run_id, "done")
    return run_id


@pytest.fixture
def fetch(jp_fetch, jp_asyncio_loop):
    """jp_fetch, run to completion (tests here are plain functions: no async plugin needed)."""

    def run(*parts, **kwargs):
        return jp_asyncio_loop.run_until_complete(jp_fetch(*parts, **kwargs))

    return run


def _json(response):
    return json.loads(response.body.decode())


def _status(fetch, *parts, **kwargs):
    try:
        response = fetch(*parts, **kwargs)
    except HTTPClientError as e:
        return e.code
    return response.code


ENDPOINTS = [
    ("GET", ("nbtrain", "api", "clusters")),
    ("GET", ("nbtrain", "api", "runs")),
    ("GET", ("nbtrain", "api", "runs", "RUNID")),
    ("GET", ("nbtrain", "api", "runs", "RUNID", "metrics")),
    ("GET", ("nbtrain", "api", "runs", "RUNID", "samples")),
    ("POST", ("nbtrain", "api", "runs", "RUNID", "stop")),
    ("GET", ("nbtrain", "api", "runs", "RUNID", "config")),
    ("DELETE", ("nbtrain", "api", "runs", "RUNID")),
]


@pytest.mark.parametrize(("method", "parts"), ENDPOINTS)
def test_every_endpoint_refuses_a_request_without_token(fetch, finished_run, method, parts):
    parts = tuple(finished_run if p == "RUNID" else p for p in parts)
    body = b"{}" if method == "POST" else None
    # an empty Authorization header overrides jp_fetch's token; no cookie, no token: 403
    code = _status(fetch, *parts, method=method, body=body, headers={"Authorization": ""})
    assert code == 403
    # and the same request with the token goes through, so the 403 above is the auth check
    assert _status(fetch, *parts, method=method, body=body) in (200, 202, 409)


def test_runs_lists_registered_runs(fetch, finished_run):
    data = _json(fetch("nbtrain", "api", "runs"))
    assert [r["id"] for r in data["runs"]] == [finished_run]
    run = data["runs"][0]
    assert run["state"] == "done"
    assert run["step"] == 200 and run["total_steps"] == 200
    assert run["ended"] >= run["started"]


def test_run_record_and_unknown_run(fetch, finished_run):
    assert _json(fetch("nbtrain", "api", "runs", finished_run))["name"] == "finished-sft"
    assert _status(fetch, "nbtrain", "api", "runs", "0123456789ab") == 404


def test_metrics_are_incremental(fetch, finished_run):
    first = _json(fetch("nbtrain", "api", "runs", finished_run, "metrics"))
    assert [r["step"] for r in first["rows"]] == list(range(1, 201))
    assert first["last_step"] == 200 and first["more"] is False
    assert first["rows"][24]["eval_loss"] == pytest.approx(
        first["rows"][24]["loss"] + 0.08, abs=1e-3
    )

    later = _json(fetch("nbtrain", "api", "runs", finished_run, "metrics", params={"after": "150"}))
    assert [r["step"] for r in later["rows"]] == list(range(151, 201))

    page = _json(
        fetch(
            "nbtrain", "api", "runs", finished_run, "metrics", params={"after": "10", "limit": "5"}
        )
    )
    assert [r["step"] for r in page["rows"]] == [11, 12, 13, 14, 15]
    assert page["more"] is True and page["last_step"] == 15

    done = _json(fetch("nbtrain", "api", "runs", finished_run, "metrics", params={"after": "200"}))
    assert done["rows"] == [] and done["last_step"] == 200


def test_metrics_follow_a_file_being_written(fetch, tmp_path):
    out = tmp_path / "live"
    out.mkdir()
    run_id = runs.register_run(out, total_steps=10)
    metrics = out / "metrics.jsonl"
    url = ("nbtrain", "api", "runs", run_id, "metrics")

    assert _json(fetch(*url))["rows"] == []  # registered before its first step
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 1, "loss": 2.0}) + "\n")
        f.write('{"step": 2, "loss": NaN}\n')
        f.write('{"step": 3, "lo')  # a line still being written
        f.flush()
        data = _json(fetch(*url))
        assert [r["step"] for r in data["rows"]] == [1, 2]
        assert data["rows"][1]["loss"] is None  # NaN would break JSON.parse in the browser
        f.write('ss": 1.5}\n')
        f.flush()
        data = _json(fetch(*url, params={"after": str(data["last_step"])}))
        assert data["rows"] == [{"step": 3, "loss": 1.5}]

    # a restarted run rewrites its folder: the reader starts over instead of serving stale rows
    metrics.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    data = _json(fetch(*url))
    assert data["rows"] == [{"step": 1, "loss": 9.0}]


def _sample(step, index, completion, **extra):
    row = {
        "step": step,
        "index": index,
        "prompt": f"prompt {index}",
        "completion": completion,
        "reference": None,
        "tokens": len(completion.split()),
        "seconds": 0.25,
    }
    return json.dumps({**row, **extra}) + "\n"


def test_samples_come_whole_steps_at_a_time_while_written(fetch, tmp_path):
    out = tmp_path / "sampling"
    out.mkdir()
    run_id = runs.register_run(out, total_steps=20)
    url = ("nbtrain", "api", "runs", run_id, "samples")
    # a run that samples nothing (or not yet) has no samples: an empty page, not an error
    empty = _json(fetch(*url))
    assert empty["rows"] == [] and empty["last_step"] is None and empty["more"] is False
    assert empty["run"]["id"] == run_id

    with (out / "samples.jsonl").open("a") as f:
        f.write(_sample(0, 0, "hello", reference="hi there"))
        f.write(_sample(0, 1, "a\nlong\nanswer"))
        f.write(_sample(10, 0, "better"))
        f.write('{"step": 10, "index": 1, "prompt": "prompt 1", "compl')  # rank 0 still writing
        f.flush()
        first = _json(fetch(*url))
        assert [(r["step"], r["index"]) for r in first["rows"]] == [(0, 0), (0, 1), (10, 0)]
        assert first["rows"][0] == {
            "step": 0,
            "index": 0,
            "prompt": "prompt 0",
            "completion": "hello",
            "reference": "hi there",
            "tokens": 1,
            "seconds": 0.25,
        }
        assert first["rows"][1]["completion"] == "a\nlong\nanswer"
        assert first["last_step"] == 10
        f.write('etion": "done", "reference": null, "tokens": 1, "seconds": NaN}\n')
        f.write("not json\n")
        f.write(json.dumps({"step": 10, "index": 2, "prompt": 3}) + "\n")  # not a sample row
        f.flush()
        # the browser asks again from its newest step: that step comes again, now whole
        again = _json(fetch(*url, params={"since": "10"}))
        assert [(r["step"], r["index"]) for r in again["rows"]] == [(10, 0), (10, 1)]
        assert again["rows"][1]["completion"] == "done" and again["rows"][1]["seconds"] is None
        assert _json(fetch(*url, params={"since": "11"}))["rows"] == []
    assert _status(fetch, *url, params={"since": "x"}) == 400


def test_samples_page_by_whole_steps(fetch, tmp_path, monkeypatch):
    from nbtrain.server import handlers

    monkeypatch.setattr(handlers, "MAX_SAMPLE_STEPS", 2)
    out = tmp_path / "many"
    out.mkdir()
    (out / "samples.jsonl").write_text(
        "".join(_sample(s, i, f"s{s}i{i}") for s in (0, 5, 10, 15) for i in range(3))
    )
    run_id = runs.register_run(out)
    url = ("nbtrain", "api", "runs", run_id, "samples")
    page = _json(fetch(*url))
    assert [r["step"] for r in page["rows"]] == [0, 0, 0, 5, 5, 5]
    assert page["more"] is True and page["last_step"] == 5
    rest = _json(fetch(*url, params={"since": str(page["last_step"] + 1)}))
    assert [r["step"] for r in rest["rows"]] == [10, 10, 10, 15, 15, 15]
    assert rest["more"] is False


def test_samples_never_read_outside_the_run_folder(fetch, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(_sample(1, 0, "hunter2"))
    out = tmp_path / "sneaky"
    out.mkdir()
    (out / "samples.jsonl").symlink_to(secret)
    run_id = runs.register_run(out)
    assert _status(fetch, "nbtrain", "api", "runs", run_id, "samples") == 403
    assert _status(fetch, "nbtrain", "api", "runs", "0123456789ab", "samples") == 404


@pytest.mark.parametrize(
    "parts",
    [
        ("runs", "..", "..", "..", "etc", "passwd"),
        ("runs", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "metrics"),
        ("runs", "..%2F..%2Fetc", "metrics"),
        ("runs", "abc.def", "metrics"),
        ("runs", "etc/passwd", "metrics"),
    ],
)
def test_traversal_is_refused(fetch, finished_run, parts):
    code = _status(fetch, "nbtrain", "api", *parts)
    assert code in (400, 403, 404)


def test_metrics_never_read_outside_the_run_folder(fetch, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"step": 1, "password": "hunter2"}) + "\n")
    out = tmp_path / "sneaky"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(secret)
    run_id = runs.register_run(out)
    # query parameters cannot point the handler somewhere else either
    code = _status(fetch, "nbtrain", "api", "runs", run_id, "metrics", params={"path": str(secret)})
    assert code == 403


def test_unregistered_folder_is_not_reachable(fetch, tmp_path):
    out = tmp_path / "never-registered"
    shutil.copytree(FIXTURE_RUN, out)
    code = _status(fetch, "nbtrain", "api", "runs", runs.run_id_for(out), "metrics")
    assert code == 404


def test_stop_sets_the_flag_a_running_run_checks(fetch, tmp_path, finished_run):
    out = tmp_path / "running"
    out.mkdir()
    run_id = runs.register_run(out, total_steps=100)
    assert not runs.stop_requested(run_id)

    response = fetch("nbtrain", "api", "runs", run_id, "stop", method="POST", body=b"")
    assert response.code == 202 and _json(response)["stop_requested"] is True
    assert runs.stop_requested(run_id)

    # a finished run cannot be stopped, an unknown one does not exist
    code = _status(fetch, "nbtrain", "api", "runs", finished_run, "stop", method="POST", body=b"")
    assert code == 409
    assert not runs.stop_requested(finished_run)
    code = _status(fetch, "nbtrain", "api", "runs", "0123456789ab", "stop", method="POST", body=b"")
    assert code == 404


def _write_side_file(profile_dir: Path, cluster_id: str, **extra) -> None:
    security = profile_dir / "security"
    security.mkdir(parents=True, exist_ok=True)
    side = {
        "cluster_id": cluster_id,
        "profile_dir": str(profile_dir),
        "state": "ready",
        "backend": "gloo",
        "world_size": 1,
        "hosts": ["node-a"],
        "ranks": [{"rank": 0, "host": "node-a", "local_rank": 0, "device": "cpu", "pid": 1}],
        "notebook": "train.ipynb",
        "started": time.time(),
        **extra,
    }
    (security / f"nbtrain-{cluster_id}.json").write_text(json.dumps(side))


@pytest.mark.timeout(120)
def test_clusters_lists_a_real_ipyparallel_cluster(fetch, jp_asyncio_loop, tmp_path):
    import ipyparallel as ipp

    assert _json(fetch("nbtrain", "api", "clusters"))["clusters"] == []

    profile_dir = tmp_path / "ipython" / "profile_default"
    cluster = ipp.Cluster(n=1, profile_dir=str(profile_dir), cluster_id="nbt-test", log_level=30)
    jp_asyncio_loop.run_until_complete(cluster.start_cluster())
    try:
        data = _json(fetch("nbtrain", "api", "clusters"))
        [model] = data["clusters"]
        assert model["cluster_id"] == "nbt-test"
        assert model["state"] == "running" and model["engines"] == 1
        assert model["nbtrain"] is False and model["notebook"] is None  # started by hand

        _write_side_file(profile_dir, "nbt-test")
        [model] = _json(fetch("nbtrain", "api", "clusters"))["clusters"]
        assert model["nbtrain"] is True
        assert model["state"] == "ready" and model["backend"] == "gloo"
        assert model["notebook"] == "train.ipynb"
        assert model["nodes"] == 1 and model["gpus"] == 0
        assert model["ranks"][0]["host"] == "node-a"
    finally:
        jp_asyncio_loop.run_until_complete(cluster.stop_cluster())

    assert _json(fetch("nbtrain", "api", "clusters"))["clusters"] == []


def test_side_file_counts_nodes_and_gpus(tmp_path):
    """Enrichment without a live cluster: a stopped cluster file and a two-node side file."""
    import ipyparallel as ipp

    from nbtrain.server.clusters import list_clusters

    profile_dir = tmp_path / "ipython" / "profile_gpu"
    cluster = ipp.Cluster(n=4, profile_dir=str(profile_dir), cluster_id="two-nodes")
    (profile_dir / "security").mkdir(parents=True)
    Path(cluster.cluster_file).write_text(json.dumps(cluster.to_dict()))
    ranks = [
        {
            "rank": r,
            "host": f"node-{r // 2}",
            "local_rank": r % 2,
            "device": f"cuda:{r % 2}",
            "pid": 1,
        }
        for r in range(4)
    ]
    _write_side_file(
        profile_dir,
        "two-nodes",
        world_size=4,
        hosts=["node-0", "node-1"],
        ranks=ranks,
        backend="nccl",
    )

    [model] = list_clusters([str(profile_dir)])
    assert model["state"] == "stopped"  # no controller is running, whatever the side file says
    assert model["nodes"] == 2 and model["gpus"] == 4 and model["world_size"] == 4
    assert model["backend"] == "nccl"


def test_scaling_report_of_a_run_and_its_own_record(fetch, tmp_path, finished_run):
    """A report saved with out= is listed as its own record and linked from the run it measured."""
    from tests.ui.fixtures import scaling_report

    run_dir = Path(runs.get_run(finished_run)["output_dir"])
    assert _status(fetch, "nbtrain", "api", "runs", finished_run, "scaling") == 404
    report, scaling_id = scaling_report(tmp_path / "scaling-out", run_dir=run_dir)

    record = _json(fetch("nbtrain", "api", "runs", scaling_id))
    assert record["kind"] == "scaling" and record["state"] == "done"
    assert record["measured"] == str(run_dir)
    listed = {r["id"]: r for r in _json(fetch("nbtrain", "api", "runs"))["runs"]}
    assert listed[finished_run]["scaling"] == str((tmp_path / "scaling-out").resolve())

    for run_id in (scaling_id, finished_run):
        data = _json(fetch("nbtrain", "api", "runs", run_id, "scaling"))
        assert data["folder"] == str((tmp_path / "scaling-out").resolve())
        rows = data["report"]["rows"]
        assert [r["nodes"] for r in rows] == [1, 2, 4, 8, 16]
        assert [r["predicted"] for r in rows] == [False, False, False, True, True]
        assert [r["tokens_per_s"] for r in rows] == pytest.approx(
            [r["tokens_per_s"] for r in report.rows]
        )
        assert data["report"]["verdict"]["line"] == report.verdict.line
        png = fetch("nbtrain", "api", "runs", run_id, "scaling.png")
        assert png.headers["Content-Type"] == "image/png"
        assert png.body == (tmp_path / "scaling-out" / "scaling.png").read_bytes()
        assert png.body[:8] == b"\x89PNG\r\n\x1a\n"

    # without a token, neither is served (the image, a page not an API call, redirects to login)
    code = _status(
        fetch, "nbtrain", "api", "runs", scaling_id, "scaling", headers={"Authorization": ""}
    )
    assert code == 403
    code = _status(
        fetch,
        "nbtrain",
        "api",
        "runs",
        scaling_id,
        "scaling.png",
        headers={"Authorization": ""},
        follow_redirects=False,
    )
    assert code in (302, 403)


def test_scaling_files_never_read_outside_the_report_folder(fetch, tmp_path):
    from tests.ui.fixtures import scaling_report

    out = tmp_path / "rep"
    _, scaling_id = scaling_report(out)
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG secret")
    (out / "scaling.png").unlink()
    (out / "scaling.png").symlink_to(secret)
    assert _status(fetch, "nbtrain", "api", "runs", scaling_id, "scaling.png") == 403
    (out / "scaling.json").unlink()
    assert _status(fetch, "nbtrain", "api", "runs", scaling_id, "scaling") == 404
    assert _status(fetch, "nbtrain", "api", "runs", scaling_id, "..%2Fsecret.png") == 404


@pytest.fixture(scope="module")
def two_real_runs(two_lr_runs):
    """The folders of tests/conftest.py's two runs that differ only in learning rate."""
    return [Path(r["cfg"].output_dir) for r in two_lr_runs["runs"]]


def _register_done(folder: Path) -> str:
    run_id = runs.register_run(folder)
    runs.finish_run(run_id, "done")
    return run_id


def test_compare_two_real_runs(fetch, two_real_runs):
    ids = [_register_done(f) for f in two_real_runs]
    data = _json(fetch("nbtrain", "api", "compare", params={"runs": ",".join(ids)}))
    # only the learning rate differs (where each run wrote is left out of the diff by design)
    assert data["diff"] == {"learning_rate": list(RATES)}
    assert [r["id"] for r in data["runs"]] == ids
    for run, folder in zip(data["runs"], two_real_runs, strict=True):
        written = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        assert run["name"] == folder.name and run["label"] == folder.name
        assert run["output_dir"] == str(folder.resolve()) and run["state"] == "done"
        assert [r["step"] for r in run["rows"]] == [1, 2, 3, 4, 5, 6]
        assert run["rows"] == written
        assert all(isinstance(r["time"], float) for r in run["rows"])
        assert run["final"]["loss"] == written[-1]["loss"]
        assert "time" not in run["final"]
        assert run["adapter"] == str(folder.resolve() / "adapter")
        assert (Path(run["adapter"]) / "adapter_config.json").is_file()
    # a higher learning rate moved the loss further in 6 steps: the runs really differ
    assert data["runs"][0]["final"]["loss"] != data["runs"][1]["final"]["loss"]
    # runs that sampled nothing have no samples
    assert [r["samples"] for r in data["runs"]] == [[], []]

    # the same id twice is one run; the order asked is the order answered
    again = _json(
        fetch("nbtrain", "api", "compare", params={"runs": f"{ids[1]},{ids[0]},{ids[1]}"})
    )
    assert [r["id"] for r in again["runs"]] == [ids[1], ids[0]]
    assert again["diff"] == {"learning_rate": list(reversed(RATES))}


def test_compare_refuses_what_is_not_a_registered_run(fetch, tmp_path, two_real_runs):
    ids = [_register_done(f) for f in two_real_runs]
    url = ("nbtrain", "api", "compare")

    def status(value, **kw):
        return _status(fetch, *url, params={"runs": value}, **kw)

    assert status(",".join(ids), headers={"Authorization": ""}) == 403
    assert _status(fetch, *url) == 400  # no runs=
    assert status("") == 400
    assert status(f"{ids[0]},../../etc") == 400
    assert status(f"{ids[0]},abc.def") == 400
    assert status(",".join([ids[0]] * 2 + [f"{i:012x}" for i in range(16)])) == 400  # too many
    assert status(f"{ids[0]},0123456789ab") == 404
    # an unregistered copy of a run folder is not reachable by its would-be id
    copy = tmp_path / "copy"
    shutil.copytree(two_real_runs[0], copy)
    assert status(f"{ids[0]},{runs.run_id_for(copy)}") == 404
    # a scaling report is listed beside runs but has no curves
    from tests.ui.fixtures import scaling_report

    _, scaling_id = scaling_report(tmp_path / "rep")
    assert status(f"{ids[0]},{scaling_id}") == 400
    # registered before its first logged step: no metrics to compare yet
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert status(f"{ids[0]},{runs.register_run(fresh)}") == 409
    # a metrics file that leads out of its folder is not followed
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"step": 1, "password": "hunter2"}) + "\n")
    sneaky = tmp_path / "sneaky"
    sneaky.mkdir()
    (sneaky / "metrics.jsonl").symlink_to(secret)
    assert status(f"{ids[0]},{_register_done(sneaky)}") == 403
    # and neither is a samples file
    sneaky2 = tmp_path / "sneaky2"
    shutil.copytree(two_real_runs[1], sneaky2)
    (sneaky2 / "samples.jsonl").symlink_to(secret)
    assert status(f"{ids[0]},{_register_done(sneaky2)}") == 403


def test_compare_gives_each_runs_last_samples(fetch, tmp_path, two_real_runs):
    folders = []
    for n, folder in enumerate(two_real_runs):
        copy = tmp_path / folder.name
        shutil.copytree(folder, copy)
        (copy / "samples.jsonl").write_text(
            _sample(0, 1, "base one")
            + _sample(0, 0, "base zero")
            + _sample(6, 1, f"run {n} one")
            + _sample(6, 0, f"run {n} zero")
        )
        folders.append(copy)
    ids = [_register_done(f) for f in folders]
    data = _json(fetch("nbtrain", "api", "compare", params={"runs": ",".join(ids)}))
    for n, run in enumerate(data["runs"]):
        # the newest step only, in prompt order
        assert [(s["step"], s["index"], s["completion"]) for s in run["samples"]] == [
            (6, 0, f"run {n} zero"),
            (6, 1, f"run {n} one"),
        ]


def test_a_preempted_dpo_run_is_listed_so_with_its_kind(fetch, tmp_path):
    """issue 34, 1 and 20: the REST API gives a preempted run's state, step and checkpoint, and a
    DPO run's kind, also in a comparison (where the Lab titles the loss by it)."""
    out = tmp_path / "runs" / "dpo"
    shutil.copytree(FIXTURE_RUN, out)
    run_id = runs.register_run(out, name="dpo", total_steps=200, kind="dpo")
    runs.finish_run(run_id, "preempted", step=57, checkpoint=str(out / "checkpoint-57"))
    record = _json(fetch("nbtrain", "api", "runs", run_id))
    assert (record["state"], record["step"], record["checkpoint"], record["kind"]) == (
        "preempted",
        57,
        str(out / "checkpoint-57"),
        "dpo",
    )
    assert record["ended"] is not None
    data = _json(fetch("nbtrain", "api", "compare", params={"runs": run_id}))
    assert [(r["state"], r["kind"]) for r in data["runs"]] == [("preempted", "dpo")]


def test_the_lab_titles_losses_as_nbtrain_does():
    """The Lab's loss titles (labextension/src: unitOf, lossTitle) are nbtrain's: nats/token for
    SFT only (nbtrain.runs.LOSS_UNITS), and the same title where SFT runs meet others."""
    from nbtrain.compare.view import MIXED_LOSS_TITLE

    src = Path(__file__).parents[2] / "labextension" / "src"
    assert runs.LOSS_UNITS == {"sft": "nats/token"}
    assert "'nats/token'" in (src / "metrics.ts").read_text()
    assert f"'{MIXED_LOSS_TITLE}'" in (src / "model.ts").read_text()


# -- issue 38: every metric, a run's config and cluster, deleting a record ----------------------


def _dpo_folder(tmp_path):
    """A DPO run folder as finetune writes one: its config and rows holding DPO's reward metrics."""
    out = tmp_path / "runs" / "dpo"
    out.mkdir(parents=True)
    cfg = {"model": "tiny", "beta": 0.1, "learning_rate": 5e-6, "precompute_ref_log_probs": False}
    (out / runs.CONFIG_FILE).write_text(json.dumps({**cfg, "max_grad_norm": float("nan")}))
    rows = [
        {
            "step": s,
            "loss": 0.69 - 0.01 * s,
            "rewards/margins": 0.1 * s,
            "rewards/accuracies": 0.5,
            "logps/chosen": -30.0,
            "grad_norm": 1.0,
            "peak_memory_gb_rank1": 2.5,
            "time": 1_795_750_000.0 + s,
            "note": "text",
        }
        for s in (1, 2, 3)
    ]
    (out / runs.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out, cfg


def test_every_metric_of_a_dpo_run_is_served_with_its_config_and_cluster(fetch, tmp_path):
    out, cfg = _dpo_folder(tmp_path)
    cluster_id = "1795750000-abcd"
    run_id = runs.register_run(out, name="dpo", total_steps=3, kind="dpo", cluster_id=cluster_id)
    runs.finish_run(run_id, "done")
    # the cluster's side file, as nbtrain.cluster.registry writes it while the cluster runs
    security = tmp_path / "ipython" / "profile_default" / "security"
    security.mkdir(parents=True)
    side = {"hosts": ["node-a", "node-b"], "backend": "gloo", "notebook": "work/dpo.ipynb"}
    (security / f"nbtrain-{cluster_id}.json").write_text(json.dumps(side))

    rows = _json(fetch("nbtrain", "api", "runs", run_id, "metrics"))["rows"]
    assert set(rows[0]) >= {"rewards/margins", "rewards/accuracies", "logps/chosen", "grad_norm"}
    assert rows[2]["peak_memory_gb_rank1"] == 2.5

    got = _json(fetch("nbtrain", "api", "runs", run_id, "config"))
    assert got["kind"] == "dpo"
    assert got["config"] == {**cfg, "max_grad_norm": None}  # NaN would break JSON.parse
    assert got["config_file"] == str(out.resolve() / runs.CONFIG_FILE)
    assert got["cluster"] == {
        "cluster_id": cluster_id,
        "world_size": 1,
        "host": runs.get_run(run_id)["host"],
        "hosts": ["node-a", "node-b"],
        "backend": "gloo",
        "notebook": "work/dpo.ipynb",
    }
    # the cluster stopped (its side file gone): what the record knows, nulls for the rest
    (security / f"nbtrain-{cluster_id}.json").unlink()
    cluster = _json(fetch("nbtrain", "api", "runs", run_id, "config"))["cluster"]
    assert cluster["hosts"] == [cluster["host"]] and cluster["backend"] is None

    # compare's final values: every numeric metric and the step; no time, no text
    data = _json(fetch("nbtrain", "api", "compare", params={"runs": run_id}))
    final = data["runs"][0]["final"]
    assert final["step"] == 3 and final["rewards/margins"] == pytest.approx(0.3)
    assert "time" not in final and "note" not in final


def test_config_of_an_old_record_a_scaling_report_and_an_unknown_run(fetch, finished_run, tmp_path):
    # a record from before kinds says "finetune": served as sft, its folder has no config
    record = runs.get_run(finished_run)
    record["kind"] = "finetune"
    (runs.registry_dir() / f"{finished_run}.json").write_text(json.dumps(record))
    assert _json(fetch("nbtrain", "api", "runs", finished_run))["kind"] == "sft"
    assert [r["kind"] for r in _json(fetch("nbtrain", "api", "runs"))["runs"]] == ["sft"]
    got = _json(fetch("nbtrain", "api", "runs", finished_run, "config"))
    assert (got["kind"], got["config"], got["config_file"]) == ("sft", {}, None)

    report = tmp_path / "scaling-report"
    report.mkdir()
    scaling_id = runs.record_scaling(report, name="scaling")
    got = _json(fetch("nbtrain", "api", "runs", scaling_id, "config"))
    assert (got["kind"], got["config"]) == ("scaling", {})
    assert _status(fetch, "nbtrain", "api", "runs", "0123456789ab", "config") == 404


def test_a_config_file_that_escapes_its_folder_is_refused(fetch, tmp_path):
    out, _ = _dpo_folder(tmp_path)
    elsewhere = tmp_path / "secret.json"
    elsewhere.write_text("{}")
    (out / runs.CONFIG_FILE).unlink()
    (out / runs.CONFIG_FILE).symlink_to(elsewhere)
    run_id = runs.register_run(out, name="dpo", kind="dpo")
    assert _status(fetch, "nbtrain", "api", "runs", run_id, "config") == 403


def test_deleting_a_record_keeps_the_run_folder(fetch, finished_run, tmp_path):
    folder = Path(runs.get_run(finished_run)["output_dir"])
    running_out = tmp_path / "running"
    running_out.mkdir()
    running = runs.register_run(running_out, name="running")
    # a running run is not deleted: the message says to stop it first
    try:
        fetch("nbtrain", "api", "runs", running, method="DELETE")
        raise AssertionError("a running run's record was deleted")
    except HTTPClientError as e:
        assert e.code == 409
        assert "stop it first" in json.loads(e.response.body)["message"]
    assert runs.get_run(running) is not None

    got = _json(fetch("nbtrain", "api", "runs", finished_run, method="DELETE"))
    assert got == {"id": finished_run, "deleted": True}
    assert runs.get_run(finished_run) is None
    assert (folder / runs.METRICS_FILE).is_file()  # the folder stays
    assert [r["id"] for r in _json(fetch("nbtrain", "api", "runs"))["runs"]] == [running]
    assert _status(fetch, "nbtrain", "api", "runs", finished_run, method="DELETE") == 404


def _refused(fetch, run_id):
    try:
        fetch("nbtrain", "api", "runs", run_id, method="DELETE")
    except HTTPClientError as e:
        assert e.code == 409
        return json.loads(e.response.body)["message"]
    raise AssertionError(f"the live run {run_id}'s record was deleted")


def test_a_run_left_running_by_a_dead_process_can_be_deleted(fetch, tmp_path):
    """A killed kernel leaves its record "running": the sidebar may delete it, not a live run's."""
    # a process that ran and ended: its pid is the dead rank 0 of the run
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "killed"
    out.mkdir()
    killed = runs.register_run(out, name="killed")
    runs.update_run(killed, pid=dead.pid)
    # a pid this machine reuses for a process that began after the run (after a reboot, say)
    reused_out = tmp_path / "reused"
    reused_out.mkdir()
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reused = runs.register_run(reused_out, name="reused")
        runs.update_run(reused, pid=later.pid, started=time.time() - 600)
        listed = {r["id"]: r for r in _json(fetch("nbtrain", "api", "runs"))["runs"]}
        assert listed[killed]["live"] is False
        assert f"process {dead.pid}" in listed[killed]["stale"]
        assert "gone" in listed[killed]["stale"]
        assert listed[reused]["live"] is False and "another's" in listed[reused]["stale"]
        assert listed[reused]["state"] == "running"  # the record is served as written
        # a stop request would never be read: it is refused, naming why and what to do instead
        with pytest.raises(HTTPClientError) as refused:
            fetch("nbtrain", "api", "runs", killed, "stop", method="POST", body=b"")
        assert refused.value.code == 409
        message = json.loads(refused.value.response.body)["message"]
        assert "is gone" in message and "delete its record instead" in message
        assert not runs.stop_requested(killed)
        for run_id in (killed, reused):
            got = _json(fetch("nbtrain", "api", "runs", run_id, method="DELETE"))
            assert got == {"id": run_id, "deleted": True}
            assert runs.get_run(run_id) is None
    finally:
        later.kill()
        later.wait()
    assert out.is_dir() and reused_out.is_dir()  # the folders stay

    # a run on another host: its pid cannot be checked here, its last write decides
    away_out = tmp_path / "away"
    away_out.mkdir()
    (away_out / runs.METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n')
    away = runs.register_run(away_out, name="away")
    long_ago = time.time() - runs.STALE_AFTER_S - 60
    runs.update_run(away, host="elsewhere.invalid", pid=1, started=long_ago)
    assert _json(fetch("nbtrain", "api", "runs", away))["live"] is True
    assert "stop it first" in _refused(fetch, away)
    # its metrics file alone is a sign of life (the record's own mtime is old now)
    os.utime(runs.registry_dir() / f"{away}.json", (long_ago, long_ago))
    assert _json(fetch("nbtrain", "api", "runs", away))["live"] is True
    os.utime(away_out / runs.METRICS_FILE, (long_ago, long_ago))
    got = _json(fetch("nbtrain", "api", "runs", away))
    assert got["live"] is False and "elsewhere.invalid" in got["stale"]
    assert _json(fetch("nbtrain", "api", "runs", away, method="DELETE"))["deleted"] is True


def test_run_kinds_and_loss_units(tmp_path):
    assert runs.loss_unit("sft") == runs.loss_unit(None) == runs.loss_unit("finetune")
    assert runs.loss_unit("sft") == "nats/token"
    assert runs.loss_unit("dpo") == runs.loss_unit("grpo") == runs.loss_unit("tinker") == "loss"
    assert runs.get_run(runs.register_run(tmp_path / "t", kind="tinker"))["kind"] == "tinker"
    with pytest.raises(ValueError, match="one of sft, dpo, grpo, tinker"):
        runs.register_run(tmp_path / "x", kind="ppo")
