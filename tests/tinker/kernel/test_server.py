"""The official tinker 0.38.0 SDK against nbtrain's Tinker service on a real 2-rank local cluster
(gloo, a tiny model built here): sessions and futures, two LoRA models on one base, forward_backward
and optim_step, save and load with resume, sampler snapshots, sampling, the run registry, and the
errors a client must get as 400 / 404 (never a 500, which the SDK retries for minutes).

One cluster, one service and one ServiceClient for the module.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import numpy as np
import pytest

import nbtrain

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

RANK = 4


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    old = {k: os.environ.get(k) for k in ("NBTRAIN_HOME", "TINKER_TELEMETRY")}
    home = tmp_path_factory.mktemp("home")
    os.environ["NBTRAIN_HOME"] = str(home)
    os.environ["TINKER_TELEMETRY"] = "0"
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from nbtrain.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("svc") / "tiny", hidden_size=64, num_heads=1)


@pytest.fixture(scope="module")
def svc(home, base):
    cluster = nbtrain.start(n=2, force=True)
    try:
        cluster.execute("import torch; torch.set_num_threads(1)", output="none")
        service = cluster.serve_tinker(root=home / "tinker")
        yield service
    finally:
        cluster.stop()
    assert service.stopped  # the cluster's stop stops its service


@pytest.fixture(scope="module")
def sc(svc):
    import tinker

    client = tinker.ServiceClient(base_url=svc.url)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def tc(sc, base):
    return sc.create_lora_training_client(base_model=base, rank=RANK, seed=1).result()


def _datum(n, seed):
    from tinker import types

    rng = np.random.default_rng(seed)
    toks = rng.integers(5, 500, n + 1)
    w = (rng.random(n) > 0.3).astype(np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
        loss_fn_inputs={"target_tokens": toks[1:].tolist(), "weights": w.tolist()},
    )


def _lp(client, datums):
    out = client.forward(datums, "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _http(svc, path, body=None, key=None, ctype="application/json"):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        svc.url + path, data=data, method="POST" if data is not None else "GET"
    )
    req.add_header("Content-Type", ctype)
    req.add_header("X-API-Key", key or svc.api_key)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_forward_backward_sums_the_loss_and_optim_step_is_a_run(svc, sc, base):
    # a model of its own: its first optim_step is step 1 of its run whatever ran before (the
    # module's `tc` has taken as many steps as the tests before this one)
    tc = sc.create_lora_training_client(base_model=base, rank=RANK, seed=1).result()
    data = [_datum(7, 1), _datum(11, 2)]
    fb = tc.forward_backward(data, "cross_entropy").result()
    lps = [o["logprobs"].to_numpy() for o in fb.loss_fn_outputs]
    assert [len(x) for x in lps] == [7, 11]
    weights = [np.asarray(d.loss_fn_inputs["weights"].data) for d in data]
    # Tinker's cross_entropy: -sum(logprob * weight) over tokens and datums, no mean
    want = -sum(float((lp * w).sum()) for lp, w in zip(lps, weights))
    assert fb.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    step = tc.optim_step(__import__("tinker").types.AdamParams(learning_rate=1e-2)).result()
    assert "grad_norm:mean" in (step.metrics or {})
    after = _lp(tc, data)
    assert not np.allclose(after[0], lps[0]), "optim_step changed nothing"
    # the model is a run: registry record of kind tinker and a metrics.jsonl row for the step
    from nbtrain import runs

    rows = [r for r in runs.list_runs() if r.get("kind") == "tinker" and tc.model_id in r["name"]]
    assert len(rows) == 1 and rows[0]["step"] == 1
    lines = open(os.path.join(rows[0]["output_dir"], runs.METRICS_FILE)).read().strip().splitlines()
    assert json.loads(lines[-1])["loss"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)
    status = {r["model_id"]: r for r in svc.status()}
    assert status[tc.model_id]["steps"] == 1 and status[tc.model_id]["memory_bytes"] > 0


def test_two_lora_models_on_one_base_keep_their_own_weights(sc, base, tc):
    from tinker import types

    other = sc.create_lora_training_client(base_model=base, rank=2, seed=7).result()
    assert other.model_id != tc.model_id
    assert other.get_info().lora_rank == 2 and other.get_info().model_data.tokenizer_id == base
    data = [_datum(9, 3)]
    before = _lp(other, data)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_array_equal(_lp(other, data)[0], before[0])


def test_forward_backward_custom_steps_as_cross_entropy_does(sc, base):
    """The client-side custom loss (a forward, then cross_entropy with weights -dL/dlp), with L the
    cross_entropy sum itself, takes the same AdamW step as cross_entropy on a twin model."""
    from tinker import types

    data = [_datum(6, 9), _datum(9, 10)]
    a = sc.create_lora_training_client(base_model=base, rank=RANK, seed=11).result()
    b = sc.create_lora_training_client(base_model=base, rank=RANK, seed=11).result()
    np.testing.assert_array_equal(_lp(a, data)[1], _lp(b, data)[1])

    def summed_nll(batch, logprobs):
        loss = sum(
            -(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs)
        )
        return loss, {"nll": float(loss)}

    ce = a.forward_backward(data, "cross_entropy").result()
    custom = b.forward_backward_custom(data, summed_nll).result()
    assert custom.metrics["nll"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-5)
    for c in (a, b):
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_allclose(_lp(a, data)[1], _lp(b, data)[1], rtol=1e-5, atol=1e-6)


def test_save_and_load_with_the_optimizer_resumes_as_uninterrupted(sc, tc):
    from tinker import types

    data = [_datum(8, 4), _datum(5, 5)]
    saved = tc.save_state("resume-point").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/resume-point"
    at_save = _lp(tc, data)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    went_on = _lp(tc, data)

    resumed = sc.create_training_client_from_state_with_optimizer(saved.path).result()
    session = tc.model_id.split(":")[0]
    assert resumed.model_id.startswith(f"{session}:train:")  # the id the SDK derives itself
    np.testing.assert_allclose(_lp(resumed, data)[0], at_save[0], rtol=1e-5, atol=1e-6)
    resumed.forward_backward(data, "cross_entropy").result()
    resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_allclose(_lp(resumed, data)[0], went_on[0], rtol=1e-4, atol=1e-5)


def test_a_sampler_snapshot_samples_and_does_not_move_when_training_goes_on(svc, sc, base, tc):
    from tinker import types

    prompt = types.ModelInput.from_ints([11, 42, 7, 99, 3])
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=4, seed=5)
    ).result()
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length") and seq.sequence_id
    # the samples are shown in the model's run (samples.jsonl, the Lab's samples panel), decoded
    shown = svc.root / tc.model_id.replace(":", "_") / "samples.jsonl"
    rows = [json.loads(line) for line in shown.read_text().splitlines()]
    assert len(rows) == 3 and [r["tokens"] for r in rows] == [len(q.tokens) for q in out.sequences]
    assert isinstance(rows[0]["prompt"], str) and rows[0]["prompt"]
    lp = sampler.compute_logprobs(prompt).result()
    assert lp[0] is None and len(lp) == 5
    assert len(shown.read_text().splitlines()) == 3  # compute_logprobs is not a sample
    fwd = _lp(
        tc,
        [
            types.Datum(
                model_input=types.ModelInput.from_ints([11, 42, 7, 99]),
                loss_fn_inputs={"target_tokens": [42, 7, 99, 3]},
            )
        ],
    )[0]
    np.testing.assert_allclose(lp[1:], fwd, rtol=1e-4, atol=1e-5)
    tc.forward_backward([_datum(9, 6)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    np.testing.assert_allclose(sampler.compute_logprobs(prompt).result()[1:], lp[1:], rtol=1e-6)
    # a named sampler path, and the base model, sample too
    path = tc.save_weights_for_sampler("named").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/named"
    named = sc.create_sampling_client(model_path=path).result()
    assert len(named.compute_logprobs(prompt).result()) == 5
    plain = sc.create_sampling_client(base_model=base).result()
    assert plain.get_base_model() == base
    assert not np.allclose(plain.compute_logprobs(prompt).result()[1:], lp[1:])


def test_user_errors_are_400_or_404_never_500(svc, tc):
    import tinker

    with pytest.raises(tinker.BadRequestError, match="cross_entropy, importance_sampling"):
        tc.forward_backward([_datum(5, 7)], "gspo").result()
    with pytest.raises(tinker.BadRequestError, match="checkpoint name"):
        tc.save_state("../escape").result()
    status, body = _http(
        svc, "/api/v1/forward_backward", b"\x08\xff\xff", ctype="application/x-protobuf"
    )
    assert status == 400 and "protobuf" in body["detail"]
    status, body = _http(svc, "/api/v1/optim_step", b"{not json")
    assert status == 400 and "JSON" in body["detail"]
    status, body = _http(svc, "/api/v1/get_info", {"model_id": "nope:train:0"})
    assert status == 404 and "not held" in body["detail"]
    status, body = _http(
        svc,
        "/api/v1/load_weights",
        {"model_id": tc.model_id, "path": "tinker://x/weights/..", "optimizer": True},
    )
    assert status == 400
    status, body = _http(
        svc,
        "/api/v1/load_weights",
        {"model_id": tc.model_id, "path": "tinker://x/weights/missing", "optimizer": True},
    )
    assert status == 404
    status, body = _http(svc, "/api/v1/retrieve_future", {"request_id": "req-nope"})
    assert status == 404


def test_a_checkpoint_is_deleted_through_the_rest_client(svc, sc, tc):
    path = tc.save_state("rolling-1").result().path
    folder = svc.root / tc.model_id.replace(":", "_") / "weights" / "rolling-1"
    assert folder.is_dir()
    sc.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
    assert not folder.exists()
    with pytest.raises(Exception, match="404"):
        sc.create_rest_client().delete_checkpoint_from_tinker_path(path).result()


def test_a_key_is_checked_when_bound_beyond_the_loopback(svc, base):
    from nbtrain.tinker.kernel import InProcessBackend, TinkerService

    # the module's service (svc) is running and exported its url and key, as serve_tinker does
    exported = {k: os.environ.get(k) for k in ("TINKER_BASE_URL", "TINKER_API_KEY")}
    key = "tml-test-0123456789"
    other = TinkerService(InProcessBackend(), host="0.0.0.0", port=0, api_key=key, root=None)
    try:
        local = type("S", (), {"url": f"http://127.0.0.1:{other.port}", "api_key": key})()
        assert _http(local, "/api/v1/healthz")[0] == 200
        assert _http(local, "/api/v1/healthz", key="tml-wrong-0123456789")[0] == 401
        assert (
            _http(local, "/api/v1/create_session", {"tags": []}, key="tml-wrong-0123456789")[0]
            == 401
        )
    finally:
        other.stop()
    # stopping a service that was never exported leaves the running one's variables (a client made
    # after this test still finds the module's service: test_a_checkpoint_is_deleted_...)
    assert {k: os.environ.get(k) for k in exported} == exported


def _usr1_handler():
    import signal

    handler = signal.getsignal(signal.SIGUSR1)
    return getattr(handler, "__name__", str(handler))


def _weights(cluster, model_id):
    from nbtrain.tinker import ranks as service

    return cluster.run(service.weights, model_id, ranks=[0], timeout=60)[0]


def test_a_preemption_notice_checkpoints_every_live_model_and_reload_prefers_it(svc, sc, base):
    """SIGUSR1 (Slurm's --signal=USR1@90) on both ranks' engines: rank 0 writes every live model's
    state under <root>/preempted while the engines go on serving; a reload then takes that state
    where it is newer than the model's last named save, and the model's run goes on from its step."""
    import signal
    import time

    from tinker import types

    from nbtrain import runs
    from nbtrain.tinker import ranks as service
    from nbtrain.tinker.ranks.state import checkpoint_folder

    cluster = svc.backend.session
    assert svc.preemption_folder == svc.root / "preempted"
    assert [s["signal"] for s in cluster.run(service.preemption_status)] == [None, None]
    data = [_datum(7, 21)]
    p = sc.create_lora_training_client(base_model=base, rank=RANK, seed=3).result()
    named = p.save_state("named").result().path
    p.forward_backward(data, "cross_entropy").result()
    p.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    at_notice = _weights(cluster, p.model_id)

    for r in cluster.ranks:
        os.kill(r.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while True:
        st = cluster.run(service.preemption_status, timeout=30)
        if st[0]["saved"] or st[0]["errors"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [s["signal"] for s in st] == ["SIGUSR1", "SIGUSR1"] and not st[0]["errors"]
    live = sorted(r["model_id"] for r in svc.status())
    folder = checkpoint_folder(str(svc.preemption_folder), p.model_id)
    assert sorted(st[0]["saved"]) == sorted(
        checkpoint_folder(str(svc.preemption_folder), m) for m in live
    )
    assert st[1]["saved"] == []  # rank 0 alone writes: every rank holds the same state
    # the engines still serve, and the folder is a state load_state accepts, with these weights
    cluster.run(service.load_state, "probe:train:0", folder, True, timeout=60)
    probe = _weights(cluster, "probe:train:0")
    cluster.run(service.unload, "probe:train:0", timeout=60)
    for name, w in at_notice.items():
        np.testing.assert_array_equal(probe[name], w)

    # a step after the notice; the reload goes back to the notice's state, not to the named save
    p.forward_backward(data, "cross_entropy").result()
    p.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    said = svc.reload()
    assert (
        f"{p.model_id}: reloaded from its preemption checkpoint {folder} (newer than {named}), "
        "at step 1" in said
    )
    for name, w in _weights(cluster, p.model_id).items():
        np.testing.assert_array_equal(w, at_notice[name])
    # the run continues: the next step is step 2 of the same record
    p.forward_backward(data, "cross_entropy").result()
    p.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    record = next(r for r in runs.list_runs() if p.model_id in r["name"])
    assert record["step"] == 2 and record["state"] == "running"
    rows = (svc.root / p.model_id.replace(":", "_") / runs.METRICS_FILE).read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 2]
    # re-armed by the reload: a later notice would save again
    assert [s["signal"] for s in cluster.run(service.preemption_status)] == [None, None]


def test_a_cell_waits_for_a_running_service_verb_and_a_verb_waits_for_a_cell(svc, tc, capfd):
    """The cluster's ipyparallel client is shared by the service's worker and the notebook's cells:
    a cell issued while a (made slow) forward_backward runs says it waits, runs after it, and both
    answers are right; a verb sent while a cell holds the client stays pending until it ends."""
    import threading
    import time

    from tinker import types

    cluster = svc.backend.session
    cluster.execute(
        # ipyparallel sends the verb by its code, which looks its helper up in the module then
        "import time as _t, nbtrain.tinker.ranks.train as _svc_train\n"
        "_fb = _svc_train._forward_backward\n"
        "def _slow(*a):\n"
        "    out = _fb(*a); _t.sleep(2.0)\n"
        "    globals()['fb_end'] = _t.time(); return out\n"
        "_svc_train._forward_backward = _slow",
        output="none",
    )
    data = [_datum(8, 31)]
    try:
        fut = tc.forward_backward(data, "cross_entropy")
        deadline = time.monotonic() + 30
        while cluster.client_lock.holder != "the Tinker service's forward_backward":
            assert time.monotonic() < deadline, "the verb never took the client"
            time.sleep(0.01)
        capfd.readouterr()
        out = cluster.execute("cell_start = _t.time(); print(6 * 7)")
        said = capfd.readouterr()
        fb = fut.result()
    finally:
        cluster.execute("_svc_train._forward_backward = _fb", output="none")
    assert (
        said.err.count("nbtrain: waiting for the Tinker service's forward_backward to finish") == 1
    )
    assert "42" in said.out and len(out) == 2
    ends, starts = cluster.pull("fb_end"), cluster.pull("cell_start")
    assert all(s >= e for s, e in zip(starts, ends)), "the cell ran while the verb held the client"
    lp = fb.loss_fn_outputs[0]["logprobs"].to_numpy()
    w = np.asarray(data[0].loss_fn_inputs["weights"].data)
    assert fb.metrics["loss:sum"] == pytest.approx(-float((lp * w).sum()), rel=1e-4)
    np.testing.assert_allclose(_lp(tc, data)[0], lp, rtol=1e-5, atol=1e-6)  # no step between

    # the other way round: a verb behind a cell is pending (the SDK's try_again), then answers
    with cluster.client_lock.held():
        pending = tc.forward(data, "cross_entropy")
        time.sleep(0.5)
        queued = [f for f in svc.verbs.executor._futures.values() if not f.finished()]
        assert queued, "the verb ran while a cell held the client"
    done = threading.Event()
    threading.Thread(target=lambda: (pending.result(), done.set()), daemon=True).start()
    assert done.wait(60)
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # drop the accumulated gradients


def test_queued_training_requests_are_one_trip_and_a_failed_one_names_its_rank(svc, tc):
    """A forward_backward, one that fails on rank 1 and an optim_step, queued behind a busy
    worker: one trip to the ranks; the failed one's error names rank 1 and its host, the others
    answer."""
    import threading
    import time

    import tinker

    ex = svc.verbs.executor
    before = list(ex.batched.get(tc.model_id, [0, 0]))
    gate = threading.Event()
    ex.submit("gate", lambda: (gate.wait(30), ("json", {}))[1])
    past_vocab = tinker.types.Datum(  # rank 1's datum (the second): a token past the vocabulary
        model_input=tinker.types.ModelInput.from_ints([7, 10**6, 9, 11, 12]),
        loss_fn_inputs={"target_tokens": [8, 9, 11, 12, 13], "weights": [1.0] * 5},
    )
    bad = [_datum(5, 40), past_vocab]
    good = tc.forward_backward([_datum(6, 42)], "cross_entropy")
    failed = tc.forward_backward(bad, "cross_entropy")
    step = tc.optim_step(tinker.types.AdamParams(learning_rate=0.0))
    deadline = time.monotonic() + 30
    while ex.pending() < 4:
        assert time.monotonic() < deadline, "the requests never reached the queue"
        time.sleep(0.01)
    gate.set()
    assert np.isfinite(good.result().metrics["loss:sum"])
    with pytest.raises(tinker.RequestFailedError) as e:
        failed.result()
    host = svc.backend.session.ranks[1].host
    assert f"rank 1 on {host}" in str(e.value) and "index out of range" in str(e.value)
    assert "grad_norm:mean" in (step.result().metrics or {})
    assert ex.batched[tc.model_id] == [before[0] + 1, before[1] + 3]


def test_a_dead_rank_fails_the_futures_and_restart_reloads_the_last_saved_state(svc, tc):
    """It kills rank 1 (this module's own engine) and restarts it: the tests after it find the
    cluster whole again and `tc` reloaded (run 6th and 9th of 12 in random orders, all passed)."""
    import signal

    import tinker

    data = [_datum(6, 8)]
    tc.save_state("before-kill").result()
    saved = _lp(tc, data)[0]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(tinker.types.AdamParams(learning_rate=5e-2)).result()
    cluster = svc.backend.session
    os.kill(cluster.ranks[1].pid, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as e:
        _lp(tc, data)
    assert e.value.category == tinker.types.RequestErrorCategory.Server
    assert "rank 1" in str(e.value) and cluster.ranks[1].host in str(e.value)
    said = cluster.restart()
    assert f"{tc.model_id}: reloaded from tinker://{tc.model_id}/weights/before-kill" in said
    np.testing.assert_allclose(_lp(tc, data)[0], saved, rtol=1e-5, atol=1e-6)
    # the fresh rank 1 is armed again for a preemption notice, as rank 0 still is
    assert cluster.run(_usr1_handler) == ["_on_signal", "_on_signal"]
