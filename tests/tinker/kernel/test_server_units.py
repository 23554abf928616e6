"""nbtrain.tinker's parts that need no cluster: seq_id ordering, paths that cannot escape, keys,
and the protobuf round trip through the SDK's own decoder."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from nbtrain.errors import ConfigError
from nbtrain.tinker.kernel import protocol, wire
from nbtrain.tinker.kernel.futures import Executor
from nbtrain.tinker.kernel.serve import check_key


def _executor():
    return Executor(lambda e: ("server", str(e), False))


def test_each_models_requests_run_in_seq_id_order_whatever_order_they_arrive_in():
    ex = _executor()
    ran: list[tuple[str, int]] = []
    gate = threading.Event()

    def job(model, seq):
        def run():
            gate.wait(5)
            ran.append((model, seq))
            return ("json", {"seq": seq})

        return run

    ex.expect("a", 1)
    ex.expect("b", 1)
    futs = [ex.submit("x", job("a", s), "a", s) for s in (3, 2)]
    assert not any(f.finished() for f in futs)
    futs.append(ex.submit("x", job("b", 1), "b", 1))
    futs.append(ex.submit("x", job("a", 1), "a", 1))
    # a retried request gets the future it got the first time, and runs once
    assert ex.submit("x", job("a", 2), "a", 2) is futs[1]
    gate.set()
    for f in futs:
        f.done.result(5)
    assert [s for m, s in ran if m == "a"] == [1, 2, 3]
    assert ("b", 1) in ran and len(ran) == 4
    ex.stop()


def test_a_refused_requests_seq_id_does_not_hold_the_next_ones():
    ex = _executor()
    ex.expect("m", 1)
    later = ex.submit("x", lambda: ("json", {"ok": 3}), "m", 3)
    ex.skip("m", 2)  # refused with a 400 before it was queued
    assert not later.finished()
    ex.skip("m", 1)
    assert later.done.result(5) == ("json", {"ok": 3})
    ex.stop()


def test_a_fatal_failure_fails_every_pending_request_and_later_ones():
    ex = Executor(lambda e: ("server", f"rank 1 on hostx died: {e}", True))
    ex.expect("m", 1)
    held = ex.submit("x", lambda: ("json", {}), "m", 2)  # waits for seq 1, which fails

    def boom():
        raise RuntimeError("killed")

    first = ex.submit("x", boom, "m", 1)
    kind, ans = first.done.result(5)
    assert ans == {"error": "rank 1 on hostx died: killed", "category": "server"}
    deadline = time.time() + 5
    while not held.finished() and time.time() < deadline:
        time.sleep(0.01)
    assert held.answer()[1]["category"] == "server"
    later = ex.submit("x", lambda: ("json", {"ok": 1}), None, None)
    assert "died" in later.answer()[1]["error"]
    ex.stop()


@pytest.mark.parametrize(
    "path",
    [
        "tinker://../weights/x",
        "tinker://m/weights/../../etc",
        "tinker://m/weights/a/b",
        "tinker://m/other/x",
        "/etc/passwd",
        "tinker://m/weights/.hidden..",
    ],
)
def test_paths_that_would_leave_the_service_folder_are_400(path):
    with pytest.raises(protocol.RequestError) as e:
        protocol.parse_path(path)
    assert e.value.status == 400


def test_names_map_under_the_root_and_absolute_or_dotted_names_are_refused(tmp_path):
    folder = protocol.local_folder(tmp_path, "s1:train:0", "weights", "step-10")
    assert folder == (tmp_path / "s1_train_0" / "weights" / "step-10").resolve()
    for name in ("/abs", "..", "a/../b", "", "a b"):
        with pytest.raises(protocol.RequestError):
            protocol.local_folder(tmp_path, "s1:train:0", "weights", name)


def test_unsupported_losses_are_refused_naming_the_supported_ones():
    protocol.check_loss("ppo")
    with pytest.raises(protocol.RequestError) as e:
        protocol.check_loss("gspo")
    assert e.value.status == 400 and "cross_entropy" in str(e.value)


def test_a_key_is_required_beyond_the_loopback_and_has_the_sdks_shape():
    check_key("127.0.0.1", None)
    check_key("::1", None)
    with pytest.raises(ConfigError, match="api_key"):
        check_key("0.0.0.0", None)
    with pytest.raises(ConfigError, match="tml-"):
        check_key("0.0.0.0", "secret-key-1234")
    check_key("0.0.0.0", "tml-0123456789abcdef")


def test_forward_backward_round_trips_through_the_sdks_own_protobuf_code():
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(1, n + 1))),
            loss_fn_inputs={
                "target_tokens": list(range(2, n + 2)),
                "logprobs": [-1.0] * n,
                "advantages": [0.5] * n,
            },
        )
        for n in (3, 5)
    ]
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=datums, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="s:train:0",
        seq_id=4,
    )
    got = wire.decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
    assert got["seq_id"] == 4 and got["loss_fn"] == "ppo"
    assert got["loss_fn_config"] == {"clip_low_threshold": pytest.approx(0.7)}
    assert [d["tokens"] for d in got["datums"]] == [[1, 2, 3], [1, 2, 3, 4, 5]]
    assert got["datums"][1]["loss_fn_inputs"]["target_tokens"].tolist() == [2, 3, 4, 5, 6]
    outs = [{"logprobs": np.arange(n, dtype=np.float32)} for n in (3, 5)]
    back = deserialize_forward_backward_output(
        wire.encode_forward_backward({"outputs": outs, "metrics": {"loss:sum": 2.5}})
    )
    assert back.metrics == {"loss:sum": 2.5}
    assert [o["logprobs"].tolist() for o in back.loss_fn_outputs] == [[0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize(
    "body",
    [b"\xff\xff\xff garbage", b""],
)
def test_bad_protobuf_or_a_missing_input_is_400(body):
    with pytest.raises(protocol.RequestError) as e:
        wire.decode_forward_backward(body)
    assert e.value.status == 400


def test_the_client_lock_makes_a_cell_wait_for_a_verb_and_says_so_once(capsys):
    """`Session.client_lock`: re-entrant in its holder, one line for a cell behind the service's
    verb, no line for a verb behind a cell, and no wait at all under `rescue()` (a restart)."""
    from nbtrain.cluster.session import ClientLock

    lock = ClientLock()
    taken, release = threading.Event(), threading.Event()

    def verb():
        with lock.held("the Tinker service's optim_step"):
            with lock.held():  # Session.run inside the held verb
                assert lock.holder == "the Tinker service's optim_step"
            taken.set()
            release.wait(10)

    worker = threading.Thread(target=verb)
    worker.start()
    assert taken.wait(10)
    with lock.rescue(), lock.held(say=True):  # does not wait: it is there to end a stuck call
        pass
    assert capsys.readouterr().err == ""
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    with lock.held(say=True):
        waited = time.monotonic() - t0
        assert lock.holder is None
    worker.join(10)
    assert waited >= 0.25
    assert capsys.readouterr().err == (
        "nbtrain: waiting for the Tinker service's optim_step to finish\n"
    )
    # a verb behind a cell (no name, say=False) waits without a word
    done = threading.Event()

    def behind():
        with lock.held("the Tinker service's forward"):
            done.set()

    with lock.held(say=True):
        t = threading.Thread(target=behind)
        t.start()
        assert not done.wait(0.2)
    assert done.wait(5)
    t.join(5)
    assert capsys.readouterr().err == ""
