"""The Tinker service's tornado handlers (nbtrain/tinker/kernel/handlers.py), served in this process:
a user's error stays a 400 (404 for an unknown id); nbtrain's own bug is a 500 whose body carries an
error id, and the kernel's log has that id with the traceback."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def service(tmp_path, monkeypatch):
    from nbtrain.tinker.kernel import verbs as verbs_module
    from nbtrain.tinker.kernel.backend import InProcessBackend
    from nbtrain.tinker.kernel.serve import TinkerService

    def planted(self, body):  # a bug in a verb: nothing the request did
        raise RuntimeError("planted bug in get_info")

    # the route table takes the verb when the service is made, so plant it first
    monkeypatch.setattr(verbs_module.Verbs, "get_info", planted)
    svc = TinkerService(InProcessBackend(), root=tmp_path / "svc")
    yield svc
    svc.stop()


def _post(svc, path, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(svc.url + path, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("X-API-Key", svc.api_key)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_a_bug_is_a_500_with_an_error_id_logged_with_its_traceback(service, caplog):
    caplog.set_level(logging.ERROR, logger="nbtrain")
    status, body = _post(service, "/api/v1/get_info", {"model_id": "m:train:0"})
    assert status == 500, body
    error_id = body["error_id"]
    assert len(error_id) == 8 and int(error_id, 16) >= 0
    assert f"error id {error_id}" in body["detail"] and "kernel's log" in body["detail"]
    assert "RuntimeError: planted bug in get_info" in body["detail"]
    records = [r for r in caplog.records if error_id in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    (rec,) = records
    assert rec.name == "nbtrain.tinker.kernel.handlers" and rec.levelno == logging.ERROR
    assert "/api/v1/get_info" in rec.getMessage()
    # the traceback, down to the planted line
    assert rec.exc_info is not None and rec.exc_info[0] is RuntimeError
    assert "planted bug in get_info" in caplog.text and "in planted" in caplog.text


def test_a_users_error_stays_a_400_or_404_and_logs_no_error(service, caplog):
    caplog.set_level(logging.DEBUG, logger="nbtrain")
    status, body = _post(service, "/api/v1/optim_step", b"{not json")
    assert status == 400 and "JSON" in body["detail"] and "error_id" not in body
    status, body = _post(service, "/api/v1/optim_step", {"model_id": "nope:train:0"})
    assert status in (400, 404) and "error_id" not in body, body
    status, body = _post(service, "/api/v1/retrieve_future", {"request_id": "req-nope"})
    assert status == 404 and "not known" in body["detail"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # each refusal is on the debug log, with its verb and status
    assert "POST /api/v1/optim_step refused (400)" in caplog.text


def test_a_config_error_from_a_verb_is_a_400(tmp_path, monkeypatch):
    from nbtrain.errors import ConfigError
    from nbtrain.tinker.kernel import verbs as verbs_module
    from nbtrain.tinker.kernel.backend import InProcessBackend
    from nbtrain.tinker.kernel.serve import TinkerService

    def refuse(self, body):
        raise ConfigError("lora rank 0 is not allowed")

    monkeypatch.setattr(verbs_module.Verbs, "get_info", refuse)
    svc = TinkerService(InProcessBackend(), root=tmp_path / "svc")
    try:
        status, body = _post(svc, "/api/v1/get_info", {"model_id": "m:train:0"})
    finally:
        svc.stop()
    assert status == 400 and body["detail"] == "lora rank 0 is not allowed"


def test_each_request_is_on_the_debug_log_with_verb_model_and_seconds(service, caplog):
    caplog.set_level(logging.DEBUG, logger="nbtrain.tinker")
    status, _ = _post(service, "/api/v1/client/config", {"model_id": "m:train:0"})
    assert status == 200
    line = next(r.getMessage() for r in caplog.records if "/api/v1/client/config" in r.getMessage())
    assert line.startswith("POST /api/v1/client/config model m:train:0: ") and line.endswith(" s")
