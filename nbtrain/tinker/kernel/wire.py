"""The tinker SDK's wire formats: protobuf `forward_backward` requests and results, protobuf
`SampleResponse`s, and the JSON `ModelInput`. Decoding errors are 400s, never 500s (the SDK retries
5xx for minutes). The messages are the SDK's own generated ones (`tinker.proto`)."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from nbtrain.tinker.kernel.protocol import RequestError, bad, check_loss

log = logging.getLogger(__name__)

#: per-token inputs each loss needs besides target_tokens (forward_only needs none of them)
LOSS_INPUTS = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}


def pb() -> Any:
    """The SDK's generated protobuf module (the `tinker` package: pip install nbtrain[tinker])."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:  # pragma: no cover - the extra is installed wherever this is tested
        msg = (
            "the Tinker service needs the tinker SDK's protobuf messages: pip install "
            f"'nbtrain[tinker]' (tinker==0.38.0) in the kernel's environment ({e})."
        )
        raise ImportError(msg) from e
    return tinker_public_pb2


def _tensor(t: Any, name: str) -> np.ndarray:
    p = pb()
    dtypes = {
        p.DTYPE_FLOAT32: np.float32,
        p.DTYPE_INT64: np.int64,
        p.DTYPE_INT32: np.int32,
    }
    if t.dtype not in dtypes:
        raise bad(f"loss_fn_inputs[{name!r}] has dtype {t.dtype}; float32 or int64 expected.")
    if t.WhichOneof("encoding") != "dense":
        raise bad(f"loss_fn_inputs[{name!r}] is sparse; only dense tensors are supported.")
    dtype = np.dtype(dtypes[t.dtype])
    if len(t.dense) % dtype.itemsize:
        raise bad(f"loss_fn_inputs[{name!r}] holds {len(t.dense)} bytes, not whole {dtype} values.")
    arr = np.frombuffer(t.dense, dtype=dtype).copy()
    shape = list(t.shape)
    if shape:
        if math.prod(shape) != arr.size:
            raise bad(f"loss_fn_inputs[{name!r}] has shape {shape} but {arr.size} values.")
        arr = arr.reshape(shape)
    if arr.dtype == np.int32:
        arr = arr.astype(np.int64)
    return arr


def _tokens(chunks: Any) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk") if hasattr(chunk, "WhichOneof") else None
        if kind not in (None, "encoded_text"):
            raise bad(f"model_input has a {kind} chunk; nbtrain's service takes text tokens only.")
        data = chunk.encoded_text.tokens
        if len(data) % 4:
            raise bad("an encoded_text chunk's tokens are not whole int32 values.")
        tokens.extend(np.frombuffer(data, dtype=np.int32).tolist())
    return tokens


def decode_forward_backward(body: bytes) -> dict[str, Any]:
    """A `ForwardBackwardRequest` -> {model_id, seq_id, loss_fn, loss_fn_config, forward_only,
    datums: [{"tokens", "loss_fn_inputs"}]} as the rank-side service takes it."""
    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:
        raise bad(
            f"the forward_backward body is not a ForwardBackwardRequest protobuf ({e})."
        ) from e
    if not msg.model_id:
        raise bad("the forward_backward request names no model_id.")
    try:
        return _decode(msg)
    except RequestError as e:
        e.model_id, e.seq_id = msg.model_id, int(msg.seq_id) or None
        raise


def _decode(msg: Any) -> dict[str, Any]:
    check_loss(msg.loss_fn)
    config: dict[str, Any] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    datums = []
    for i, d in enumerate(msg.data):
        tokens = _tokens(d.model_input)
        if not tokens:
            raise bad(f"datum {i} has no tokens.")
        inputs = {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()}
        needed = ("target_tokens",) + (() if msg.forward_only else LOSS_INPUTS[msg.loss_fn])
        missing = [n for n in needed if n not in inputs]
        if missing:
            msg_ = (
                f"datum {i} lacks loss_fn_inputs {', '.join(missing)}, which loss_fn "
                f"{msg.loss_fn!r} needs."
            )
            raise bad(msg_)
        for name, arr in inputs.items():
            if arr.ndim == 0 or arr.shape[0] != len(tokens):
                msg_ = (
                    f"datum {i}: loss_fn_inputs[{name!r}] has {arr.shape[0] if arr.ndim else 0} "
                    f"rows but model_input has {len(tokens)} tokens; position i of model_input "
                    "predicts target_tokens[i], so they must be the same length."
                )
                raise bad(msg_)
        inputs["target_tokens"] = inputs["target_tokens"].astype(np.int64)
        if "weights" not in inputs and msg.loss_fn == "cross_entropy":
            inputs["weights"] = np.ones(len(tokens), dtype=np.float32)
        for name in ("weights", "advantages", "logprobs"):
            if name in inputs:
                inputs[name] = inputs[name].astype(np.float32)
        datums.append({"tokens": tokens, "loss_fn_inputs": inputs})
    if not datums:
        raise bad("the forward_backward request has no data.")
    return {
        "model_id": msg.model_id,
        "seq_id": int(msg.seq_id) if msg.seq_id else None,
        "loss_fn": msg.loss_fn,
        "loss_fn_config": config or None,
        "forward_only": bool(msg.forward_only),
        "datums": datums,
    }


def encode_forward_backward(result: dict[str, Any]) -> bytes:
    """{"outputs": [{name: array}], "metrics": {...}} -> a `ForwardBackwardOutput` protobuf: one
    ArrayRecord whose fields hold every datum's array back to back, with byte offsets."""
    p = pb()
    out = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in (result.get("metrics") or {}).items():
        out.metrics[k] = float(v)
    outputs = result.get("outputs") or []
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(outputs)
    names = sorted(set().union(*(o.keys() for o in outputs))) if outputs else []
    for name in names:
        arrays = [np.asarray(o[name]) for o in outputs if name in o]
        if len(arrays) != len(outputs):
            continue  # a field only some datums have cannot be sliced per datum
        is_int = np.issubdtype(arrays[0].dtype, np.integer)
        dtype = np.int64 if is_int else np.float32
        arrays = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = p.DTYPE_INT64 if is_int else p.DTYPE_FLOAT32
        bt.trailing_shape.extend(list(arrays[0].shape[1:]))
    return out.SerializeToString()


#: the SDK's filler for a top-k cell with nothing in it (tinker.types.topk_logprobs.MASK_LOGPROB)
TOPK_EMPTY = -99999.0


def _encode_topk(msg: Any, rows: list[Any]) -> None:
    """Per position None or [(token_id, logprob), ...] -> a `TopkLogprobs` message: two (positions,
    k) matrices, empty cells (a None position) holding token 0 and `TOPK_EMPTY`, as the SDK reads them."""
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), TOPK_EMPTY, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (t, lp) in enumerate(row or []):
            ids[i, j], lps[i, j] = t, lp
    msg.token_ids = ids.tobytes()
    msg.logprobs = lps.tobytes()
    msg.k = k
    msg.length = len(rows)


def encode_sample(result: dict[str, Any], prompt_logprobs_last_n: int | None = None) -> bytes:
    """The engine's {"sequences", "prompt_logprobs", "topk_prompt_logprobs"} -> a `SampleResponse`
    protobuf (None -> NaN, or an empty top-k row); `prompt_logprobs_last_n` blanks the positions
    before the prompt's last n."""
    p = pb()
    out = p.SampleResponse()
    for seq in result.get("sequences") or []:
        s = out.sequences.add()
        s.stop_reason = (
            p.STOP_REASON_LENGTH if seq.get("stop_reason") == "length" else p.STOP_REASON_STOP
        )
        s.tokens = np.asarray(seq["tokens"], dtype=np.int32).tobytes()
        if seq.get("logprobs") is not None:
            s.logprobs = np.asarray(seq["logprobs"], dtype=np.float32).tobytes()
        if seq.get("topk_logprobs") is not None:
            _encode_topk(s.topk_sampled_logprobs, seq["topk_logprobs"])
    plp = result.get("prompt_logprobs")
    if plp is not None:
        values = np.array([np.nan if v is None else v for v in plp], dtype=np.float32)
        if prompt_logprobs_last_n is not None:
            values[: len(values) - prompt_logprobs_last_n] = np.nan
        out.prompt_logprobs = values.tobytes()
    top = result.get("topk_prompt_logprobs")
    if top is not None:
        top = list(top)
        if prompt_logprobs_last_n is not None:
            top[: len(top) - prompt_logprobs_last_n] = [None] * (len(top) - prompt_logprobs_last_n)
        _encode_topk(out.topk_prompt_logprobs, top)
    return out.SerializeToString()


def model_input_tokens(value: Any, what: str = "prompt") -> list[int]:
    """A JSON `ModelInput` ({"chunks": [{"type": "encoded_text", "tokens": [...]}]}) -> tokens."""
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise bad(f"{what} must be a ModelInput: {{'chunks': [{{'tokens': [...]}}]}}.")
    tokens: list[int] = []
    for chunk in value["chunks"]:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise bad(f"{what} has a {kind} chunk; nbtrain's service takes text tokens only.")
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise bad(f"{what}: an encoded_text chunk's tokens must be a list of integers.")
        tokens.extend(toks)
    if not tokens:
        raise bad(f"{what} has no tokens.")
    return tokens
