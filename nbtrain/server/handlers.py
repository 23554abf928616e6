"""REST handlers under ``/nbtrain/api/``: clusters, runs, a run's metrics (every key of every row),
samples, config and scaling report, stopping a run, deleting a run's record, comparing runs.

Every handler requires an authenticated user (a request without the server's token gets 403).
Run folders are reached only through the runs registry: the URL carries a run id, never a path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.utils import url_path_join

from nbtrain import runs
from nbtrain.server.clusters import list_clusters, run_cluster
from nbtrain.server.metrics import (
    MetricsReader,
    RefusedPath,
    finite_json,
    folder_file,
    parse_sample,
    rows_after,
    samples_since,
)

log = logging.getLogger(__name__)

# a run id is what nbtrain.runs.run_id_for makes: hex; anything else (dots, slashes) never routes
_RUN_ID = r"(?P<run_id>[A-Za-z0-9]{1,64})"
_RUN_ID_RE = re.compile(r"[A-Za-z0-9]{1,64}")
MAX_ROWS = 5000
# sampled steps per samples page: each holds one row per prompt, each row a prompt and a completion
MAX_SAMPLE_STEPS = 50
MAX_COMPARED = 16


class _Base(APIHandler):
    @property
    def metrics_reader(self) -> MetricsReader:
        return self.settings["nbtrain_metrics_reader"]

    @property
    def samples_reader(self) -> MetricsReader:
        return self.settings["nbtrain_samples_reader"]

    def _run_or_404(self, run_id: str) -> dict[str, Any]:
        return _run_or_404(run_id)

    def _run_file(self, record: dict[str, Any], name: str) -> Path:
        """File `name` of the run's folder; 403 (and a log line) when it escapes the folder."""
        try:
            return folder_file(record["output_dir"], name)
        except RefusedPath as e:
            self.log.warning("nbtrain: refused %s", e)
            raise tornado.web.HTTPError(403, f"{name} is outside its run folder") from e


def _run_or_404(run_id: str) -> dict[str, Any]:
    record = runs.get_run(run_id)
    if record is None:
        raise tornado.web.HTTPError(404, f"no run {run_id!r} is registered")
    return served(record)


def served(record: dict[str, Any]) -> dict[str, Any]:
    """A run record as the browser reads it: a record from before kinds (none, or "finetune") is
    an SFT run; a "running" one says whether its process still runs (`live`) and, where it does
    not, why (`stale`)."""
    if record.get("kind") in (None, "finetune"):
        record = {**record, "kind": "sft"}
    if record.get("state") == "running":
        # a "running" record whose process died is listed as such, and may be deleted
        live, why = runs.liveness(record)
        record = {**record, "live": live, **({} if live else {"stale": why})}
    return record


class ClustersHandler(_Base):
    @tornado.web.authenticated
    async def get(self) -> None:
        """GET /nbtrain/api/clusters: {clusters: [...]}"""
        # loading checks each controller's and engines' pids: keep that off the event loop
        clusters = await asyncio.to_thread(list_clusters)
        self.finish({"clusters": clusters})


class RunsHandler(_Base):
    @tornado.web.authenticated
    def get(self) -> None:
        """GET /nbtrain/api/runs: {runs: [...]}, newest first."""
        self.finish({"runs": [served(r) for r in runs.list_runs()]})


class RunHandler(_Base):
    @tornado.web.authenticated
    def get(self, run_id: str) -> None:
        """GET /nbtrain/api/runs/<id>: the run's record."""
        self.finish(self._run_or_404(run_id))

    @tornado.web.authenticated
    def delete(self, run_id: str) -> None:
        """DELETE /nbtrain/api/runs/<id>: forget the run's record (the sidebar lists it no more);
        its folder, metrics and checkpoints stay. 409 while it runs; a record left "running" by a
        process that died (`runs.liveness`) is deleted."""
        record = self._run_or_404(run_id)
        if record.get("live"):
            msg = (
                f"run {record.get('name')!r} is running (process {record.get('pid')} on "
                f"{record.get('host')}): stop it first, then delete its record"
            )
            raise tornado.web.HTTPError(409, msg)
        runs.forget_run(run_id)
        self.log.info(
            "nbtrain: forgot the record of run %s (%s)%s",
            run_id,
            record.get("output_dir"),
            f", left running: {record['stale']}" if record.get("stale") else "",
        )
        self.finish({"id": run_id, "deleted": True})


class ConfigHandler(_Base):
    @tornado.web.authenticated
    def get(self, run_id: str) -> None:
        """GET /nbtrain/api/runs/<id>/config: the settings the run ran with, its kind, and where
        it ran: {kind, config, config_file, cluster}."""
        from nbtrain.compare.data import run_kind

        record = self._run_or_404(run_id)
        config: dict[str, Any] = {}
        config_file = None
        if record["kind"] != runs.SCALING_KIND:
            path = self._run_file(record, runs.CONFIG_FILE)
            if path.is_file():
                try:
                    loaded = json.loads(path.read_text())
                except (OSError, ValueError) as e:
                    msg = f"{path} is not JSON ({e}): the run's folder holds a damaged config"
                    raise tornado.web.HTTPError(500, msg) from e
                config = loaded if isinstance(loaded, dict) else {}
                config_file = str(path)
        kind = record["kind"] if record["kind"] == runs.SCALING_KIND else run_kind(record, config)
        self.finish(
            finite_json(
                {
                    "kind": kind,
                    "config": config,
                    "config_file": config_file,
                    "cluster": run_cluster(record),
                }
            )
        )


class MetricsHandler(_Base):
    @tornado.web.authenticated
    def get(self, run_id: str) -> None:
        """GET /nbtrain/api/runs/<id>/metrics?after=K&limit=N: rows with step > K."""
        record = self._run_or_404(run_id)
        try:
            after = float(self.get_query_argument("after", "-1"))
            limit = int(self.get_query_argument("limit", str(MAX_ROWS)))
        except ValueError as e:
            raise tornado.web.HTTPError(400, "after and limit must be numbers") from e
        limit = max(1, min(limit, MAX_ROWS))
        path = self._run_file(record, runs.METRICS_FILE)
        picked, more = rows_after(self.metrics_reader.rows(path), after, limit)
        last = picked[-1]["step"] if picked else after
        self.finish({"run": record, "rows": picked, "last_step": last, "more": more})


class SamplesHandler(_Base):
    @tornado.web.authenticated
    def get(self, run_id: str) -> None:
        """GET /nbtrain/api/runs/<id>/samples?since=K: the completions sampled at steps >= K (whole
        steps, oldest first, at most MAX_SAMPLE_STEPS of them; `more` when steps remain)."""
        record = self._run_or_404(run_id)
        try:
            since = float(self.get_query_argument("since", "-1"))
        except ValueError as e:
            raise tornado.web.HTTPError(400, "since must be a number") from e
        path = self._run_file(record, runs.SAMPLES_FILE)
        picked, more = samples_since(self.samples_reader.rows(path), since, MAX_SAMPLE_STEPS)
        last = picked[-1]["step"] if picked else None
        self.finish({"run": record, "rows": picked, "last_step": last, "more": more})


def _scaling_file(record: dict[str, Any], name: str) -> Path:
    """A file of the run's scaling report: 404 when it has none, 403 when it escapes its folder."""
    folder = record.get("scaling")
    if not folder:
        raise tornado.web.HTTPError(404, f"run {record['id']!r} has no scaling report")
    try:
        path = folder_file(folder, name)
    except RefusedPath as e:
        raise tornado.web.HTTPError(403, f"{name} is outside its report folder") from e
    if not path.is_file():
        raise tornado.web.HTTPError(404, f"the scaling report {folder} has no {name}")
    return path


class ScalingHandler(_Base):
    @tornado.web.authenticated
    def get(self, run_id: str) -> None:
        """GET /nbtrain/api/runs/<id>/scaling: the run's scaling.json, and its folder."""
        record = self._run_or_404(run_id)
        path = _scaling_file(record, runs.SCALING_JSON)
        try:
            report = json.loads(path.read_text())
        except ValueError as e:
            raise tornado.web.HTTPError(500, f"{path} is not JSON: {e}") from e
        self.finish({"folder": record["scaling"], "report": finite_json(report)})


class ScalingImageHandler(JupyterHandler):
    # not an APIHandler: that one answers every request as JSON
    @tornado.web.authenticated
    def get(self, run_id: str) -> None:
        """GET /nbtrain/api/runs/<id>/scaling.png: the report's figure."""
        path = _scaling_file(_run_or_404(run_id), runs.SCALING_PNG)
        self.set_header("Content-Type", "image/png")
        self.set_header("Cache-Control", "no-cache")
        self.finish(path.read_bytes())


class StopHandler(_Base):
    @tornado.web.authenticated
    def post(self, run_id: str) -> None:
        """POST /nbtrain/api/runs/<id>/stop: ask the run to checkpoint and end at its next step."""
        record = self._run_or_404(run_id)
        live, why = runs.liveness(record)
        if record.get("state") == "running" and not live:
            # nothing would ever read the stop request: say so, and what to do instead
            raise tornado.web.HTTPError(
                409, f"run {run_id!r} cannot be stopped: {why}; delete its record instead"
            )
        if not runs.request_stop(run_id):
            raise tornado.web.HTTPError(
                409, f"run {run_id!r} is {record.get('state')}, not running"
            )
        self.set_status(202)
        self.finish({"id": run_id, "stop_requested": True})


def _compared_run(record: dict[str, Any]) -> Any:
    """One registered run read for a comparison (nbtrain.compare.load_run), its files checked."""
    from nbtrain.compare.data import load_run
    from nbtrain.errors import NotARunError

    if record.get("kind") == "scaling":
        msg = f"{record['name']!r} is a scaling report, not a training run: it has no curves"
        raise tornado.web.HTTPError(400, msg)
    try:
        for name in (runs.CONFIG_FILE, runs.METRICS_FILE, runs.SAMPLES_FILE):
            folder_file(record["output_dir"], name)
    except RefusedPath as e:
        raise tornado.web.HTTPError(403, "a run file is outside its run folder") from e
    try:
        return load_run(record["output_dir"])
    except NotARunError as e:
        raise tornado.web.HTTPError(409, f"run {record['name']!r}: {e}") from e


class CompareHandler(_Base):
    @tornado.web.authenticated
    async def get(self) -> None:
        """GET /nbtrain/api/compare?runs=<id>,<id>: each run's rows, last values, adapter and last
        samples, and the settings that differ between them."""
        from nbtrain.compare.data import config_diff, labels

        ids = [i for i in self.get_query_argument("runs", "").split(",") if i]
        if not ids or len(ids) > MAX_COMPARED:
            raise tornado.web.HTTPError(400, f"runs=<id>,<id>,...: 1 to {MAX_COMPARED} run ids")
        bad = [i for i in ids if not _RUN_ID_RE.fullmatch(i)]
        if bad:
            raise tornado.web.HTTPError(400, f"not a run id: {bad[0][:80]!r}")
        ids = list(dict.fromkeys(ids))
        records = [self._run_or_404(i) for i in ids]
        # reading every metrics file is the one slow part: keep it off the event loop
        loaded = await asyncio.to_thread(lambda: [_compared_run(r) for r in records])
        names = labels(loaded)
        runs_out = [
            {
                "id": record["id"],
                "name": run.name,
                "label": label,
                "state": record.get("state"),
                "kind": run.kind,
                "output_dir": run.path,
                "rows": run.rows,
                "final": run.final,
                "adapter": run.adapter,
                "samples": run.samples,
            }
            for record, run, label in zip(records, loaded, names, strict=True)
        ]
        self.finish(finite_json({"runs": runs_out, "diff": config_diff(loaded)}))


def setup_handlers(web_app: Any) -> None:
    """Add the nbtrain routes to the server's tornado application."""
    base = url_path_join(web_app.settings["base_url"], "nbtrain", "api")
    web_app.settings["nbtrain_metrics_reader"] = MetricsReader()
    web_app.settings["nbtrain_samples_reader"] = MetricsReader(parse=parse_sample)
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "clusters"), ClustersHandler),
            (url_path_join(base, "runs"), RunsHandler),
            (url_path_join(base, "compare"), CompareHandler),
            (url_path_join(base, "runs", _RUN_ID), RunHandler),
            (url_path_join(base, "runs", _RUN_ID, "metrics"), MetricsHandler),
            (url_path_join(base, "runs", _RUN_ID, "config"), ConfigHandler),
            (url_path_join(base, "runs", _RUN_ID, "samples"), SamplesHandler),
            (url_path_join(base, "runs", _RUN_ID, "scaling"), ScalingHandler),
            (url_path_join(base, "runs", _RUN_ID, r"scaling\.png"), ScalingImageHandler),
            (url_path_join(base, "runs", _RUN_ID, "stop"), StopHandler),
        ],
    )
