"""A model's training requests queued back to back run in one trip to the ranks (`Executor`'s
batches, the rank side's `batch`), each future answered as it would have been alone: the worker
with a stand-in trip first, then the real service in this process (`InProcessBackend`) against the
same requests made one at a time."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

import numpy as np
import pytest

from nbtrain.errors import ConfigError
from nbtrain.tinker.kernel.futures import Executor, Step

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


def _blocked(ex):
    """Hold the worker until the returned event is set (what is submitted meanwhile queues)."""
    gate = threading.Event()
    ex.submit("gate", lambda: (gate.wait(30), ("json", {}))[1])
    return gate


def _wait_queued(ex, n):
    deadline = time.time() + 30
    while ex.pending() < n and time.time() < deadline:
        time.sleep(0.01)
    assert ex.pending() >= n


def test_queued_steps_of_one_model_are_one_trip_and_a_failure_fails_only_its_own_future():
    trips: list[list[str]] = []

    def batch(calls):
        trips.append([verb for verb, _ in calls])
        return [
            RuntimeError(f"{args[0]} failed") if verb == "bad" else args[0] for verb, args in calls
        ]

    def alone(verb, *args):
        trips.append([verb])
        return args[0]

    ex = Executor(lambda e: ("server", str(e), False), batch)
    ex.expect("a", 1)
    ex.expect("b", 1)
    finished: list[str] = []

    def step(verb, tag):
        return Step(alone, verb, (tag,), lambda v: (finished.append(v), ("json", {"v": v}))[1])

    gate = _blocked(ex)
    futs = [
        ex.submit("x", step("forward_backward", "a1"), "a", 1),
        ex.submit("x", step("bad", "a2"), "a", 2),
        ex.submit("x", step("optim_step", "a3"), "a", 3),
        ex.submit("x", step("forward_backward", "b1"), "b", 1),  # another model: its own trip
        ex.submit("x", lambda: ("json", {"v": "plain"}), "a", 4),  # not a Step: runs alone
        ex.submit("x", step("optim_step", "a5"), "a", 5),  # nothing of a behind it: alone
    ]
    _wait_queued(ex, 7)
    gate.set()
    answers = [f.done.result(10)[1] for f in futs]
    assert answers == [
        {"v": "a1"},
        {"error": "a2 failed", "category": "server"},
        {"v": "a3"},
        {"v": "b1"},
        {"v": "plain"},
        {"v": "a5"},
    ]
    assert trips == [
        ["forward_backward", "bad", "optim_step"],
        ["forward_backward"],
        ["optim_step"],
    ]
    assert finished == ["a1", "a3", "b1", "a5"]  # each finished in order, the failed one not
    assert ex.batched == {"a": [1, 3]}
    ex.stop()


def test_a_trip_that_fails_as_a_whole_fails_each_of_its_requests():
    def batch(calls):
        raise RuntimeError("the ranks could not be reached")

    ex = Executor(lambda e: ("server", str(e), False), batch)
    ex.expect("m", 1)
    gate = _blocked(ex)
    futs = [
        ex.submit("x", Step(lambda *a: 1, v, (), lambda r: ("json", {})), "m", s)
        for s, v in ((1, "forward_backward"), (2, "optim_step"))
    ]
    _wait_queued(ex, 3)
    gate.set()
    for f in futs:
        assert f.done.result(10)[1]["error"] == "the ranks could not be reached"
    ex.stop()


# --- the real service in this process ------------------------------------------------------------


@pytest.fixture()
def home(tmp_path):
    old = {k: os.environ.get(k) for k in ("NBTRAIN_HOME", "TINKER_TELEMETRY")}
    os.environ["NBTRAIN_HOME"] = str(tmp_path / "home")
    os.environ["TINKER_TELEMETRY"] = "0"
    yield tmp_path
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _body(model_id, seq, datums):
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def _datums(seed, bad=False):
    from tinker import types

    rng = np.random.default_rng(seed)
    out = []
    for n in (6, 9):
        toks = rng.integers(5, 500, n + 1)
        w = (rng.random(n) > 0.3).astype(np.float32)
        if bad:  # a token past the vocabulary: the ranks fail it, not the door
            toks[2] = 10**6
        inputs = {"target_tokens": toks[1:].tolist(), "weights": w.tolist()}
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1].tolist()), loss_fn_inputs=inputs
            )
        )
    return out


def _requests(verbs, mid):
    """Step 1 (forward_backward, optim_step), a forward_backward the ranks fail and the optim_step
    behind it (on zero gradients), then step 3's forward_backward: (kind, seq, body) in seq order."""
    adam = {"model_id": mid, "adam_params": {"learning_rate": 1e-2}}
    return [
        (verbs.forward_backward, _body(mid, 1, _datums(1))),
        (verbs.optim_step, {**adam, "seq_id": 2}),
        (verbs.forward_backward, _body(mid, 3, _datums(2, bad=True))),
        (verbs.optim_step, {**adam, "seq_id": 4}),
        (verbs.forward_backward, _body(mid, 5, _datums(3))),
        (verbs.optim_step, {**adam, "seq_id": 6}),
    ]


def _answer(fut):
    kind, value = fut.done.result(60)
    if kind == "proto":
        from tinker.proto.response_conv import deserialize_forward_backward_output

        out = deserialize_forward_backward_output(value)
        return {
            "metrics": out.metrics,
            "logprobs": [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs],
        }
    return value


def test_requests_queued_together_are_one_trip_and_answer_as_one_at_a_time(home, tiny):
    from nbtrain.tinker import ranks as service
    from nbtrain.tinker.kernel import protocol as proto
    from nbtrain.tinker.kernel.backend import InProcessBackend
    from nbtrain.tinker.kernel.verbs import Verbs

    class Counting(InProcessBackend):
        """Counts the trips to the ranks, by rank-side verb."""

        def __init__(self):
            self.trips: Counter[str] = Counter()

        def call(self, verb, *args):
            self.trips[verb] += 1
            return super().call(verb, *args)

    backend = Counting()
    verbs = Verbs(backend, home / "svc")
    sid = verbs.create_session({})["session_id"]
    mids = []
    for seq in (0, 1):
        body = {"session_id": sid, "model_seq_id": seq, "base_model": tiny}
        verbs.create_model({**body, "lora_config": {"rank": 4, "seed": 3}}).done.result(120)
        mids.append(proto.model_id(sid, seq))
    alone, together = mids
    try:
        # one at a time: each request answered before the next is made
        backend.trips.clear()
        one_by_one = [_answer(fn(body)) for fn, body in _requests(verbs, alone)]
        assert backend.trips == Counter({"forward_backward": 3, "optim_step": 3})
        # the same requests queued behind a busy worker: one trip
        backend.trips.clear()
        gate = _blocked(verbs.executor)
        futs = [fn(body) for fn, body in _requests(verbs, together)]
        _wait_queued(verbs.executor, 7)
        gate.set()
        batched = [_answer(f) for f in futs]
        assert backend.trips == Counter({"batch": 1})
        assert verbs.executor.batched == {together: [1, 6]}

        assert batched == one_by_one  # losses, log-probs, grad norms: bit for bit
        error = batched[2]
        assert error["category"] == "server" and "rank 0 on" in error["error"]
        assert "index out of range" in error["error"], error
        assert batched[3]["metrics"]["grad_norm:mean"] == 0.0  # it stepped as it would alone
        a, b = service.weights(alone), service.weights(together)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

        # the kernel's tracking ran per request, in order: the same rows for both runs
        def rows(mid):
            path = verbs.models[mid].run.folder / "metrics.jsonl"
            drop = ("time", "tokens_per_s")
            return [
                {k: v for k, v in json.loads(x).items() if k not in drop}
                for x in path.read_text().splitlines()
            ]

        assert rows(together) == rows(alone) and [r["step"] for r in rows(alone)] == [1, 2, 3]
        status = {r["model_id"]: r for r in verbs.status()}
        assert status[together]["batched"] == [1, 6] and status[alone]["batched"] == [0, 0]
    finally:
        for mid in mids:
            service.unload(mid)
        verbs.close()


def test_the_engine_side_batch_runs_only_the_training_verbs():
    from nbtrain.tinker import ranks as service

    with pytest.raises(
        ConfigError, match="batch runs only forward_backward, optim_step, not save_state"
    ):
        service.batch([("optim_step", ("m", {})), ("save_state", ("m", "/tmp/x", True))])
