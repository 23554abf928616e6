"""`forward_backward` and `optim_step` of the Tinker service, run on every rank with the same arguments.

The datums are split across the ranks (`datums[rank::world]`); each rank sums its datums' losses (Tinker's
losses are sums, never means), backpropagates, and the fresh gradients are all-reduced with SUM and added
to what earlier calls left, until `optim_step` steps and zeroes them. A rank with no datum still takes part
in the all-reduce with zeros. The per-datum outputs are gathered to every rank in the datums' order.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from nbtrain.engine import metrics
from nbtrain.errors import ConfigError
from nbtrain.losses import tinker as losses
from nbtrain.tinker.ranks import preemption, registry

log = logging.getLogger(__name__)

#: a rank's datums go through the model in padded micro-batches of at most this many tokens
TOKENS_PER_BATCH = 4096


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Positions into `lengths`, grouped so that a group's padded size stays within `budget`."""
    out: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for i, n in enumerate(lengths):
        if cur and max(width, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        out.append(cur)
    return out


def _check_datum(i: int, datum: dict[str, Any], loss_fn: str, forward_only: bool) -> int:
    n = len(datum["tokens"])
    if n == 0:
        msg = f"datum {i} has no tokens; every datum needs a model_input"
        raise ConfigError(msg)
    inputs = datum.get("loss_fn_inputs") or {}
    if "target_tokens" not in inputs:
        msg = f"datum {i} has no loss_fn_inputs['target_tokens']; every datum needs them"
        raise ConfigError(msg)
    missing = [k for k in losses.SUPPORTED[loss_fn] if k not in inputs]
    if missing and not forward_only:
        msg = (
            f"datum {i} lacks loss_fn_inputs {missing}, which loss_fn {loss_fn!r} needs "
            f"({', '.join(losses.SUPPORTED[loss_fn])})"
        )
        raise ConfigError(msg)
    for name, value in inputs.items():
        if len(value) != n:
            msg = (
                f"datum {i}: loss_fn_inputs[{name!r}] has {len(value)} entries but model_input has {n} "
                "tokens; position i of model_input predicts target_tokens[i], so they must match"
            )
            raise ConfigError(msg)
    return n


def _fill_forward_inputs(inputs: dict[str, Any], lp: Any) -> None:
    """`forward()` needs only target_tokens: a loss input it lacks gets a neutral value (weights
    1, so cross_entropy's loss is the targets' NLL; the sampler's log-probs the learner's own, and
    advantages 0, so an RL loss is 0)."""
    import torch

    neutral = {
        "weights": lambda: torch.ones_like(lp, device="cpu"),
        "logprobs": lambda: lp.detach().cpu(),
        "advantages": lambda: torch.zeros_like(lp, device="cpu"),
    }
    for name, make in neutral.items():
        if name not in inputs:
            inputs[name] = make()


def learner_logprobs(model: Any, batch: list[dict[str, Any]], device: Any) -> list[Any]:
    """Each datum's log-probabilities of its `target_tokens` (1-D, float32), from one padded forward."""
    import torch

    width = max(len(x["tokens"]) for x in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    mask = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    targets = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    for j, x in enumerate(batch):
        n = len(x["tokens"])
        ids[j, :n] = torch.as_tensor(x["tokens"], dtype=torch.long)
        mask[j, :n] = 1
        targets[j, :n] = torch.as_tensor(x["loss_fn_inputs"]["target_tokens"], dtype=torch.long)
    # right padding: a causal model's real positions never see the pad after them
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return [lp[j, : len(x["tokens"])] for j, x in enumerate(batch)]


def _reduce_new_grads(d: Any, params: list[Any], before: list[Any]) -> None:
    """All-reduce (sum) the gradients this call made, then add back what earlier calls left."""
    import torch

    fresh = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if d.active:
        flat = torch.cat([g.reshape(-1) for g in fresh])
        d.sum_(flat)
        fresh = [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params)]
    for p, g, old in zip(params, fresh, before):
        p.grad = g if old is None else old + g


def forward_backward(
    model_id: str,
    datums: list[dict[str, Any]],
    loss_fn: str,
    loss_fn_config: dict[str, Any] | None = None,
    forward_only: bool = False,
) -> dict[str, Any]:
    """The learner's log-probs and `loss_fn`'s loss on `datums`; unless `forward_only`, its gradients
    added to the model's. Returns {"outputs": [{"logprobs", "elementwise_loss"} per datum, in order],
    "metrics": {"loss:sum": ...}} on every rank."""
    # a preemption notice meanwhile is written once the gradients are whole (as are all verbs that
    # change state; ipyparallel sends a function by its code, so this is a with, not a decorator)
    with preemption.guarded():
        return _forward_backward(model_id, datums, loss_fn, loss_fn_config, forward_only)


def _forward_backward(
    model_id: str,
    datums: list[dict[str, Any]],
    loss_fn: str,
    loss_fn_config: dict[str, Any] | None,
    forward_only: bool,
) -> dict[str, Any]:
    import numpy as np
    import torch

    losses.check(loss_fn, loss_fn_config)
    for i, datum in enumerate(datums):
        _check_datum(i, datum, loss_fn, forward_only)
    d = registry.dist()
    mine = list(range(d.rank, len(datums), d.world))
    held: list[Any] = []  # (trainee, its gradients from earlier calls), once this rank has them

    def local() -> tuple[list[tuple[int, Any, Any]], float, int]:
        trainee = registry.get(model_id)
        params = [p for _, p in trainee.params]
        held[:] = [trainee, [p.grad for p in params]]
        for p in params:
            p.grad = None
        rows: list[tuple[int, Any, Any]] = []
        local_loss, tokens = 0.0, 0
        with registry.active(trainee) as model, torch.set_grad_enabled(not forward_only):
            for group in _micro_batches([len(datums[i]["tokens"]) for i in mine], TOKENS_PER_BATCH):
                batch = [datums[mine[g]] for g in group]
                lps = learner_logprobs(model, batch, trainee.base.device)
                total = None
                for g, x, lp in zip(group, batch, lps):
                    inputs = {
                        k: torch.as_tensor(np.asarray(v))
                        for k, v in x["loss_fn_inputs"].items()
                        if k != "target_tokens"
                    }
                    if forward_only:
                        _fill_forward_inputs(inputs, lp)
                    loss, per_token = losses.datum_loss(loss_fn, lp, inputs, loss_fn_config)
                    total = loss if total is None else total + loss
                    tokens += int((inputs[losses.SUPPORTED[loss_fn][-1]] != 0).sum())
                    rows.append(
                        (
                            mine[g],
                            lp.detach().cpu().numpy().astype(np.float32),
                            per_token.detach().float().cpu().numpy().astype(np.float32),
                        )
                    )
                assert total is not None
                local_loss += float(total.detach())
                if not forward_only:
                    total.backward()
        return rows, local_loss, tokens

    def put_back() -> None:
        if held:
            for (_, p), old in zip(held[0].params, held[1]):
                p.grad = old

    try:
        gathered = registry.exchange(d, local)
    except Exception:
        put_back()  # a failed call adds nothing, on any rank
        raise
    trainee, before = held
    if forward_only:
        put_back()
    else:
        _reduce_new_grads(d, [p for _, p in trainee.params], before)
    by_index = {i: (lp, el) for part, _, _ in gathered for i, lp, el in part}
    loss_sum = math.fsum(part_loss for _, part_loss, _ in gathered)
    n_tokens = sum(t for _, _, t in gathered)
    if not forward_only:
        trainee.pending_loss += loss_sum
        trainee.pending_tokens += n_tokens
    outputs = [
        {"logprobs": by_index[i][0], "elementwise_loss": by_index[i][1]} for i in range(len(datums))
    ]
    return {"outputs": outputs, "metrics": {"loss:sum": loss_sum}}


def check_adam(adam: dict[str, Any]) -> dict[str, float]:
    """Tinker's AdamParams with its defaults, checked."""
    out = {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    unknown = sorted(set(adam) - set(out))
    if unknown:
        msg = f"adam_params has unknown keys {unknown}; Tinker's AdamParams are {', '.join(out)}"
        raise ConfigError(msg)
    for k, v in adam.items():
        if v is not None:
            out[k] = float(v)
    problems = []
    if not out["learning_rate"] >= 0:
        problems.append(f"learning_rate={out['learning_rate']} must be >= 0")
    for b in ("beta1", "beta2"):
        if not 0 <= out[b] < 1:
            problems.append(f"{b}={out[b]} must be in [0, 1)")
    if not out["eps"] >= 0:
        problems.append(f"eps={out['eps']} must be >= 0")
    if problems:
        raise ConfigError("adam_params: " + "; ".join(problems))
    return out


def optim_step(model_id: str, adam: dict[str, Any]) -> dict[str, float]:
    """One AdamW step (Tinker's AdamParams: decoupled weight decay, `grad_clip_norm` 0 = no clipping) on
    the gradients accumulated since the last step, then zero them. Rank 0 logs the step for the live
    plot. Returns {"grad_norm:mean", "learning_rate:mean"}."""
    with preemption.guarded():
        return _optim_step(model_id, adam)


def _optim_step(model_id: str, adam: dict[str, Any]) -> dict[str, float]:
    import torch

    a = check_adam(adam)
    trainee = registry.get(model_id)
    params = [p for _, p in trainee.params]
    for p in params:
        if p.grad is None:  # no forward_backward since the last step: a step on zero gradients
            p.grad = torch.zeros_like(p)
    for group in trainee.optimizer.param_groups:
        group.update(
            lr=a["learning_rate"],
            betas=(a["beta1"], a["beta2"]),
            eps=a["eps"],
            weight_decay=a["weight_decay"],
        )
    clip = a["grad_clip_norm"] if a["grad_clip_norm"] > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)
    trainee.steps += 1
    mean_loss = trainee.pending_loss / trainee.pending_tokens if trainee.pending_tokens else None
    if os.environ.get("NBTRAIN_ENGINE") == "1":
        # on a cluster's engines rank 0 publishes the row (nbtrain.log); in a plain process (the
        # in-process backend) the kernel's own tracking of the run draws the plot, not a second one
        metrics.log(
            step=trainee.steps,
            loss=mean_loss,
            loss_sum=trainee.pending_loss,
            tokens=trainee.pending_tokens,
            grad_norm=grad_norm,
            learning_rate=a["learning_rate"],
        )
    trainee.pending_loss, trainee.pending_tokens = 0.0, 0
    return {"grad_norm:mean": grad_norm, "learning_rate:mean": a["learning_rate"]}
