"""An SFT loop through the Tinker SDK against nbtrain's own SFT recipe, on the same 2 local CPU ranks.

    .venv/bin/python benchmarks/bench_tinker.py [--reps 3] [--steps 40] [--warmup 5] [--quick] [--out FILE]

One cluster (2 ranks, gloo, one thread a rank) serves both, with the same tiny Llama (`make_tiny_model`,
hidden 256, 4 layers, as bench_finetune.py), the same shipped instruction rows tokenized once by nbtrain
(its token cache, opened here), 8 rows a step (4 per rank), LoRA rank 16 on every linear layer but the
output head, max_length 256. Three arms, interleaved round by round (nbtrain, sdk, direct, nbtrain, ...):

  nbtrain  `nbtrain.finetune(SFTConfig(...))` on the ranks (a `Cluster.execute` cell); tokens/s from its
           metrics.jsonl, the first logged rows left out
  sdk      `tinker.ServiceClient(base_url=service.url)`: per step `forward_backward(batch, "cross_entropy")`
           and `optim_step(AdamParams)` submitted back to back, then both awaited; tokens/s over the
           steps after `--warmup`
  ahead    the same, one step submitted ahead, as tinker-cookbook's supervised loop does
           (submit_ahead=1: step N+1's two requests are sent before N's are awaited), so the server
           finds them queued together and runs them in one trip to the ranks; the service's status
           counts those trips
  ahead_unbatched  the same with the server's batching turned off (`executor.batch = None`): what
           submitting ahead gains alone
  direct   the same rank-side calls without HTTP: `cluster.run(service.forward_backward, ...)` and
           `cluster.run(service.optim_step, ...)` from the kernel; what the SDK arm costs over this is
           the protocol (serialization, HTTP, futures, the server's queue)

Tokens are counted alike on every arm: the length of every row's input ids (nbtrain's own count). Then the
overhead of one round trip with no work in it: a GET of the server's capabilities (HTTP alone), a
`forward` of one 1-token datum (the whole path: protobuf, HTTP, a future, both ranks), against an empty
`Cluster.execute("")` cell. And the client's protobuf encoding of one step's batch, timed alone.
Results: results/tinker.json, and a section of RESULTS.md (between markers).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MODEL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 512, "num_heads": 4}
PER_RANK, RANKS, MAX_LENGTH, LORA_R, LR = 4, 2, 256, 16, 1e-3
ARMS = ("nbtrain", "sdk", "ahead_unbatched", "ahead", "direct")
SECTION = "## Tinker service: an SDK loop vs nbtrain's SFT recipe (benchmarks/bench_tinker.py)"
BEGIN, END = "<!-- tinker-table:begin -->", "<!-- tinker-table:end -->"


def _sft_config(model: str, out: str, cache: str, steps: int) -> dict[str, Any]:
    from nbtrain.data.examples import instructions_path

    return {
        "model": model,
        "data": instructions_path(),
        "output_dir": out,
        "data_cache": cache,
        "max_steps": steps,
        "per_device_train_batch_size": PER_RANK,
        "max_length": MAX_LENGTH,
        "learning_rate": LR,
        "lora_r": LORA_R,
        "lora_dropout": 0.0,
        "logging_steps": 5,
        "save_steps": None,
        "seed": 0,
        "overwrite": True,
    }


def run_nbtrain(cluster: Any, cfg: dict[str, Any], warmup_rows: int) -> dict[str, Any]:
    cluster.push({"BENCH_CFG": cfg})
    t0 = time.perf_counter()
    cluster.execute(
        "import nbtrain\nnbtrain.finetune(nbtrain.SFTConfig(**BENCH_CFG))", output="none"
    )
    wall = time.perf_counter() - t0
    rows = [
        json.loads(x) for x in Path(cfg["output_dir"], "metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if "tokens_per_s" in r and "step_time" in r][warmup_rows:]
    tokens = sum(r["tokens_per_s"] * r["step_time"] for r in rows)
    seconds = sum(r["step_time"] for r in rows)
    return {"tokens_per_s": tokens / seconds, "step_s": seconds / len(rows), "wall_s": wall}


def cached_rows(cache: str) -> list[tuple[list[int], list[int]]]:
    """Every row of the token cache nbtrain's run made: (input ids, trained 0/1), cut to MAX_LENGTH."""
    from nbtrain.data.store import open_cache

    folders = [p for p in Path(cache).iterdir() if p.is_dir()]
    store = open_cache(folders[0]) if len(folders) == 1 else None
    if store is None:
        msg = f"expected one token cache in {cache}, found {[p.name for p in folders]}"
        raise RuntimeError(msg)
    out = []
    for i in range(len(store)):
        ex = store.example(i, MAX_LENGTH)
        out.append((ex.input_ids, [int(t != -100) for t in ex.labels]))
    return out


def batches(
    rows: list[tuple[list[int], list[int]]], steps: int
) -> list[list[tuple[list[int], list[int]]]]:
    size = PER_RANK * RANKS
    return [[rows[(s * size + j) % len(rows)] for j in range(size)] for s in range(steps)]


def as_plain(batch: list[tuple[list[int], list[int]]]) -> list[dict[str, Any]]:
    """The rank-side service's datums (the kernel side's decoding of a request gives these)."""
    import numpy as np

    n_targets = max(sum(sum(t[1:]) for _, t in batch), 1)
    return [
        {
            "tokens": ids[:-1],
            "loss_fn_inputs": {
                "target_tokens": np.asarray(ids[1:], dtype=np.int64),
                # a mean over the batch's target tokens, as nbtrain's SFT loss is
                "weights": np.asarray(trained[1:], dtype=np.float32) / n_targets,
            },
        }
        for ids, trained in batch
    ]


def as_datums(batch: list[tuple[list[int], list[int]]]) -> list[Any]:
    import tinker

    return [
        tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(d["tokens"]),
            loss_fn_inputs={
                k: tinker.types.TensorData.from_numpy(v) for k, v in d["loss_fn_inputs"].items()
            },
        )
        for d in as_plain(batch)
    ]


def n_tokens(batch: list[tuple[list[int], list[int]]]) -> int:
    return sum(len(ids) for ids, _ in batch)


def run_sdk(
    sc: Any,
    model: str,
    data: list[list[Any]],
    counts: list[int],
    warmup: int,
    ahead: bool = False,
    service: Any = None,
) -> dict[str, Any]:
    import tinker

    tc = sc.create_lora_training_client(
        base_model=model, rank=LORA_R, seed=0, train_unembed=False
    ).result()
    adam = tinker.types.AdamParams(learning_rate=LR)
    marks = []
    pending: list[Any] = []
    for batch in data:
        pending.append((tc.forward_backward(batch, "cross_entropy"), tc.optim_step(adam)))
        if len(pending) > int(ahead):
            fb, opt = pending.pop(0)
            fb.result()
            opt.result()
            marks.append(time.perf_counter())
    for fb, opt in pending:
        fb.result()
        opt.result()
        marks.append(time.perf_counter())
    seconds = marks[-1] - marks[warmup - 1]
    out: dict[str, Any] = {
        "tokens_per_s": sum(counts[warmup:]) / seconds,
        "step_s": seconds / (len(data) - warmup),
    }
    if service is not None:
        # [trips that ran several requests, the requests they ran], over all of the arm's steps
        (row,) = [r for r in service.status() if r["model_id"] == tc.model_id]
        out["batched"] = row.get("batched")
    return out


def _step_on_rank(model_id: str, batch: list[dict], adam: dict) -> tuple[float, float]:
    """One step of the service's rank-side verbs, timed on the rank: (forward_backward, optim_step) s."""
    import time

    from nbtrain.tinker import ranks as service

    t0 = time.perf_counter()
    service.forward_backward(model_id, batch, "cross_entropy", None, False)
    t1 = time.perf_counter()
    service.optim_step(model_id, adam)
    return t1 - t0, time.perf_counter() - t1


def run_direct(
    cluster: Any, model: str, data: list[list[dict]], counts: list[int], warmup: int, k: int
) -> dict[str, Any]:
    """The service's verbs without the server: one `cluster.run` a step (the server makes two)."""
    from nbtrain.tinker import ranks as service

    model_id = f"bench-direct-{k}"
    lora = {
        "rank": LORA_R,
        "seed": 0,
        "train_mlp": True,
        "train_attn": True,
        "train_unembed": False,
    }
    cluster.run(service.create_model, model_id, model, lora)
    adam = {"learning_rate": LR, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}
    adam.update(weight_decay=0.0, grad_clip_norm=0.0)
    marks, on_rank = [], []
    try:
        for batch in data:
            # the slower rank's times: the step ends when both have
            on_rank.append(max(cluster.run(_step_on_rank, model_id, batch, adam), key=sum))
            marks.append(time.perf_counter())
    finally:
        cluster.run(service.unload, model_id)
    seconds = marks[-1] - marks[warmup - 1]
    return {
        "tokens_per_s": sum(counts[warmup:]) / seconds,
        "step_s": seconds / (len(data) - warmup),
        "rank_forward_backward_s": statistics.median(fb for fb, _ in on_rank[warmup:]),
        "rank_optim_step_s": statistics.median(op for _, op in on_rank[warmup:]),
    }


def _get(conn: Any, path: str) -> None:
    conn.request("GET", path)
    reply = conn.getresponse()
    reply.read()
    if reply.status != 200:
        msg = f"GET {path}: HTTP {reply.status}"
        raise RuntimeError(msg)


def round_trips(cluster: Any, service: Any, sc: Any, model: str, n: int) -> dict[str, Any]:
    import tinker

    tc = sc.create_lora_training_client(
        base_model=model, rank=LORA_R, seed=0, train_unembed=False
    ).result()
    one = [
        tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints([1]),
            loss_fn_inputs={
                "target_tokens": tinker.types.TensorData.from_numpy(__import__("numpy").array([1]))
            },
        )
    ]

    host, port = service.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)  # kept alive, as the SDK's

    def timed(fn: Any) -> list[float]:
        fn()  # warm
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    return {
        "healthz_ms": C.summary(timed(lambda: _get(conn, "/api/v1/healthz"))),
        "forward_1_token_ms": C.summary(timed(lambda: tc.forward(one, "cross_entropy").result())),
        "execute_empty_ms": C.summary(timed(lambda: cluster.execute("", output="none"))),
    }


def encode_ms(data: list[list[Any]]) -> float:
    """The client's protobuf encoding of one step's forward_backward request (what the SDK does per call)."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    times = []
    for batch in data[:20]:
        req = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=batch, loss_fn="cross_entropy"),
            model_id="m",
            seq_id=1,
        )
        t0 = time.perf_counter()
        forward_backward_request_to_proto(req).SerializeToString()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def table(data: dict[str, Any]) -> str:
    arms = data["arms"]
    med = {a: statistics.median(r["tokens_per_s"] for r in arms[a]) for a in arms}
    step = {a: statistics.median(r["step_s"] for r in arms[a]) * 1e3 for a in arms}
    rt = data["round_trip"]
    lines = [
        "| arm | tokens/s per round | median tokens/s | ms a step (median) | / nbtrain |",
        "|---|---|---|---|---|",
    ]
    names = {
        "nbtrain": "nbtrain.finetune (its own SFT recipe)",
        "sdk": "tinker SDK loop over HTTP (forward_backward + optim_step, then both awaited)",
        "ahead_unbatched": "the SDK loop one step ahead (the cookbook's submit_ahead=1), batching off",
        "ahead": "the SDK loop one step ahead, the server batching queued requests",
        "direct": "the service's rank-side calls from the kernel, no HTTP",
    }
    for a in ARMS:
        per = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in arms[a])
        lines.append(
            f"| {names[a]} | {per} | {med[a]:,.0f} | {step[a]:.1f} | {med[a] / med['nbtrain']:.2f}x |"
        )
    for a in ARMS[1:]:
        paired = [x["tokens_per_s"] / n["tokens_per_s"] for x, n in zip(arms[a], arms["nbtrain"])]
        per = ", ".join(f"{r:.2f}" for r in paired)
        lines.append(
            f"| {a} / nbtrain, round by round | {per} | median {statistics.median(paired):.2f}x | | |"
        )
    lines += [
        "",
        "| one round trip, no work | median | p90 |",
        "|---|---|---|",
        f"| GET /api/v1/healthz (the server's HTTP alone) | {rt['healthz_ms']['median']:.2f} ms | {rt['healthz_ms']['p90']:.2f} ms |",
        f"| `forward` of one 1-token datum (protobuf, HTTP, future, 2 ranks) | {rt['forward_1_token_ms']['median']:.2f} ms | {rt['forward_1_token_ms']['p90']:.2f} ms |",
        f'| empty `Cluster.execute("")` (nbtrain\'s own round trip to 2 ranks) | {rt["execute_empty_ms"]["median"]:.2f} ms | {rt["execute_empty_ms"]["p90"]:.2f} ms |',
        "",
        f"Client-side protobuf encoding of one step's batch: {data['encode_ms']:.2f} ms (median).",
        "",
        batching(data),
        "",
        "Where a step's time goes (medians, ms): " + where_time_goes(data),
    ]
    return "\n".join(lines)


def batching(data: dict[str, Any]) -> str:
    """How often the server ran a step's requests in one trip, per arm (its status's counter)."""
    st = data["settings"]
    parts = []
    for a in ARMS[1:-1]:
        got = [r.get("batched") or [0, 0] for r in data["arms"][a]]
        trips, reqs = sum(g[0] for g in got), sum(g[1] for g in got)
        parts.append(f"{a}: {trips} trips ran {reqs} of {2 * st['steps'] * len(got)} requests")
    return (
        "Requests run several to a trip (the service's status, all steps of all rounds): "
        + "; ".join(parts)
        + "."
    )


def where_time_goes(data: dict[str, Any]) -> str:
    arms = data["arms"]

    def med(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in arms[arm]) * 1e3

    nb, sdk, direct = med("nbtrain", "step_s"), med("sdk", "step_s"), med("direct", "step_s")
    fb, opt = med("direct", "rank_forward_backward_s"), med("direct", "rank_optim_step_s")
    return (
        f"nbtrain's own step {nb:.1f} on the ranks. The service's verbs on the slower rank: "
        f"forward_backward {fb:.1f} + optim_step {opt:.1f} = {fb + opt:.1f} ({fb + opt - nb:+.1f} against nbtrain's step: "
        f"the verbs' own work). Called from the kernel without HTTP, one cluster.run a step: {direct:.1f} "
        f"({direct - fb - opt:+.1f}: ipyparallel's round trip, the batch's pickling included). "
        f"Through the SDK: {sdk:.1f} "
        f"({sdk - direct:+.1f} over that: HTTP, protobuf, futures and the server's second call to the "
        "ranks, as forward_backward and optim_step are two requests)."
    )


def render_results(data: dict[str, Any], results_md: Path) -> None:
    """Put the tables (between markers) into RESULTS.md's Tinker section, adding the section if missing."""
    text = results_md.read_text() if results_md.is_file() else ""
    code = data.get("code", {})
    commit = code.get("commit", "?") + (
        f" + {len(code['nbtrain_dirty_files'])} uncommitted nbtrain file(s)"
        if code.get("nbtrain_dirty_files")
        else ""
    )
    st = data["settings"]
    block = (
        f"{BEGIN}\n"
        f"Measured {data['started']} on `{data['machine']['host']}` ({data['machine']['cpus']} CPUs), commit "
        f"{commit}: {st['reps']} rounds of {st['steps']} steps (the first {st['warmup']} left out); load "
        f"average {data['loadavg_start']} at the start, {data['loadavg_end']} at the end; {data['wall_s']:.0f} s "
        f"in all.\n\n{table(data)}\n{END}"
    )
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = (
            text.rstrip("\n") + f"\n\n{SECTION}\n\n"
            "The same LoRA SFT steps on the same 2 local ranks (gloo, CPU, one thread a rank) and the same "
            "rows (nbtrain's token cache), 8 rows a step, a tiny Llama (hidden 256, 4 layers), LoRA rank 16: "
            "nbtrain's own recipe, a loop through the tinker 0.38.0 SDK against `Cluster.serve_tinker()`, and "
            "the service's rank-side calls made from the kernel without HTTP. Raw numbers in "
            "`results/tinker.json`.\n\n" + block + "\n"
        )
    results_md.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trips", type=int, default=50, help="round trips timed per kind")
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 round of 6 steps, 5 round trips"
    )
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument(
        "--no-render", action="store_true", help="do not write RESULTS.md or results/tinker.json"
    )
    args = ap.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup, args.trips = 1, 6, 2, 5
    C.setup_env()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    t_start = time.perf_counter()
    load0 = C.loadavg()

    import tinker

    import nbtrain
    from nbtrain.model.tiny import make_tiny_model

    work = C.WORK / ("tinker-quick" if args.quick else "tinker")
    model = str(work / "model")
    if not (work / "model" / "config.json").is_file():
        make_tiny_model(model, **MODEL)
    cache = str(work / "cache")
    cluster = nbtrain.start(n=RANKS, force=True)
    service = None
    try:
        cluster.execute("import torch; torch.set_num_threads(1)", output="none")
        service = cluster.serve_tinker()
        sc = tinker.ServiceClient(base_url=service.url, api_key=service.api_key or "tml-bench")
        warmup_rows = max(1, args.warmup // 5)
        arms: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
        data = sdk_data = counts = None
        for k in range(args.reps):
            cfg = _sft_config(model, str(work / f"nbtrain-{k}"), cache, args.steps)
            arms["nbtrain"].append(run_nbtrain(cluster, cfg, warmup_rows))
            if data is None:
                plain_rows = cached_rows(cache)
                data = batches(plain_rows, args.steps)
                counts = [n_tokens(b) for b in data]
                sdk_data = [as_datums(b) for b in data]
            assert data is not None and sdk_data is not None and counts is not None
            arms["sdk"].append(run_sdk(sc, model, sdk_data, counts, args.warmup, False, service))
            batch, service.verbs.executor.batch = service.verbs.executor.batch, None
            try:
                arms["ahead_unbatched"].append(
                    run_sdk(sc, model, sdk_data, counts, args.warmup, True, service)
                )
            finally:
                service.verbs.executor.batch = batch
            arms["ahead"].append(run_sdk(sc, model, sdk_data, counts, args.warmup, True, service))
            arms["direct"].append(
                run_direct(cluster, model, [as_plain(b) for b in data], counts, args.warmup, k)
            )
            print(
                f"round {k + 1}/{args.reps}: "
                + ", ".join(f"{a} {v[-1]['tokens_per_s']:,.0f} tok/s" for a, v in arms.items()),
                file=sys.stderr,
            )
        result = {
            "started": started,
            "machine": C.machine(),
            "code": C.code_version(),
            "settings": {
                "reps": args.reps,
                "steps": args.steps,
                "warmup": args.warmup,
                "rows_per_step": PER_RANK * RANKS,
                "max_length": MAX_LENGTH,
                "lora_r": LORA_R,
                "model": MODEL,
                "quick": args.quick,
            },
            "arms": arms,
            "round_trip": round_trips(cluster, service, sc, model, args.trips),
            "encode_ms": encode_ms(sdk_data),
            "loadavg_start": load0,
            "loadavg_end": C.loadavg(),
        }
    finally:
        if service is not None:
            service.stop()
        cluster.stop()
    result["wall_s"] = time.perf_counter() - t_start
    med = {a: statistics.median(r["tokens_per_s"] for r in v) for a, v in result["arms"].items()}
    result["ratio_sdk_over_nbtrain"] = med["sdk"] / med["nbtrain"]
    result["ratio_sdk_over_direct"] = med["sdk"] / med["direct"]
    arms = result["arms"]
    for a in ARMS[1:]:
        result[f"paired_{a}_over_nbtrain"] = statistics.median(
            s["tokens_per_s"] / n["tokens_per_s"] for s, n in zip(arms[a], arms["nbtrain"])
        )
    result["ratio_ahead_over_nbtrain"] = med["ahead"] / med["nbtrain"]
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not args.no_render and not args.quick:
        C.RESULTS.mkdir(exist_ok=True)
        (C.RESULTS / "tinker.json").write_text(text + "\n")
        render_results(result, C.HERE / "RESULTS.md")
    print(table(result))


if __name__ == "__main__":
    main()
