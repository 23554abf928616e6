"""The SFT loss without the [tokens, vocab] logits: the lm_head and cross-entropy fused, chunk by chunk.

In [1]: name, loss_fn = select_loss_impl(device)            # "liger" on CUDA when installed, else "chunked"
In [2]: ok, why = fused_loss_supported(model)               # once, at set-up
In [3]: loss_sum = causal_lm_loss_sum(model, batch, autocast, loss_fn)

For Llama-3.1-8B (vocab 128256) at 4 x 2048 tokens the plain path holds the logits in bf16 (2 GiB), again
in fp32 (4 GiB) and their gradient (4 GiB). Here the loss and the gradient w.r.t. the hidden states are
computed together in the forward, a few hundred tokens at a time, so only one chunk's logits ever exist:
the trick of Liger's fused linear cross-entropy (and of mgmalek/efficient_cross_entropy before it).

How the hidden states are obtained under DDP. DDP syncs gradients only for a backward that follows a call
of `DDP.forward` (that call arms its reducer); calling the inner decoder (`base.model(...)`) directly
would train each rank on its own gradients, silently. So the model is called as before, through every
wrapper, and for the length of that call its lm_head is the identity: the CausalLM's `.logits` are then
its last hidden states, and the loss applies the lm_head weight itself. The options weighed:
- `output_hidden_states=True` with `logits_to_keep` set to an empty index: no mutation, but it relies on
  each model's recording of hidden states (is the last one normed?) and keeps every layer's output;
- patching the CausalLM's forward: per-architecture code;
- the identity lm_head (chosen): one attribute, set and restored around the call (so not for two threads
  sharing a model, nor for an lm_head behind accelerate's offloading hooks, which is refused), and valid
  only where the forward is `logits = lm_head(hidden)`, plus Gemma-2's soft-cap which the loss takes
  over. `fused_loss_supported` checks exactly that with one probe forward, so a model that scales its
  logits (Granite, Cohere) is refused instead of trained on the wrong loss.

torch is imported inside the functions: `nbtrain.recipes.train` imports this module, and importing `nbtrain`
(which names `TrainResult` from there) must not pull torch in.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

# Logits are built CHUNK_BYTES of fp32 at a time: 256 MiB is 512 tokens of a 128K vocab (Llama 3), 2048 of
# a 32K one. A chunk holds at most its bf16 logits, their fp32 log-probabilities and the gradient cast back
# to bf16. Measured on an H100 with Llama-3-8B shapes (8192 tokens, bf16, frozen lm_head, forward and
# backward): 0.61 GiB transient and 36.7 ms, against 11.7 GiB and 39.4 ms for the full logits; chunks of
# 1024 or 2048 were no faster. On CPU the same budget is harmless and the matmuls dominate.
CHUNK_BYTES = 256 * 2**20

LossFn = Callable[..., Any]
"""`fn(hidden [N, H], weight [V, H], labels [N], *, bias=None, ignore_index=-100, softcap=None)` -> the
summed cross-entropy (fp32 scalar). Both `select_loss_impl` choices have this signature."""


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk for a vocabulary: CHUNK_BYTES of fp32 logits, a multiple of 64 (at least 64)."""
    tokens = CHUNK_BYTES // (4 * max(1, vocab_size))
    return max(64, tokens // 64 * 64)


# ----------------------------------------------------------------------------------- chunked kernel
@functools.cache
def _function() -> Any:
    """The autograd.Function, built on first use so that importing this module does not import torch."""
    import torch

    class _LinearCrossEntropySum(torch.autograd.Function):
        """sum_t CE(h_t @ W^T + b, y_t), with the gradients computed in forward and scaled in backward."""

        @staticmethod
        def forward(  # type: ignore[override]
            ctx: Any,
            hidden: Any,
            weight: Any,
            labels: Any,
            bias: Any,
            chunk_size: int,
            ignore_index: int,
            softcap: float | None,
            compute_dtype: Any,
            needs: tuple[bool, bool, bool],
        ) -> Any:
            need_h, need_w, need_b = needs
            dev = hidden.device
            n = hidden.shape[0]
            acc = torch.promote_types(compute_dtype, torch.float32)
            # casts are explicit (autocast's choice, made by the caller), so that backward() has nothing
            # to redo and the numbers match what autocast gives the unfused lm_head
            with torch.autocast(device_type=dev.type, enabled=False):
                w = weight.to(compute_dtype)
                b = bias.to(compute_dtype) if bias is not None else None
                loss = torch.zeros((), dtype=torch.float32, device=dev)
                grad_h = torch.empty_like(hidden) if need_h else None
                grad_w = (
                    torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
                )
                grad_b = (
                    torch.zeros(weight.shape[0], dtype=torch.float32, device=dev)
                    if need_b
                    else None
                )
                for start in range(0, n, chunk_size):
                    end = min(start + chunk_size, n)
                    h = hidden[start:end].to(compute_dtype)
                    y = labels[start:end]
                    valid = y != ignore_index
                    # ignored rows get target 0 and are masked on the narrow [chunk, H] side below:
                    # no data-dependent branch, no host sync, no extra pass over [chunk, V]
                    target = torch.where(valid, y, torch.zeros_like(y)).unsqueeze(1)
                    logits = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()
                    tanh = None
                    if softcap is not None:
                        tanh = torch.tanh(logits.to(acc) / softcap)
                        del logits
                        logits = tanh * softcap
                    # one kernel reads the low-precision logits and writes fp32 log-probabilities
                    logp = torch.log_softmax(logits, dim=-1, dtype=acc)
                    del logits
                    picked = logp.gather(1, target).squeeze(1)
                    loss -= torch.where(valid, picked, torch.zeros_like(picked)).sum()
                    if not (need_h or need_w or need_b):
                        continue
                    # d loss / d logits = softmax - onehot; the target column is written from fp32
                    # (p_y - 1), so it rounds as autograd's fp32 gradient would
                    fix = (picked.exp() - 1.0).unsqueeze(1)
                    if tanh is not None:
                        g = logp.exp_().scatter_(1, target, fix)
                        g.mul_(tanh.mul_(tanh).neg_().add_(1.0))  # through c * tanh(x / c)
                        del tanh
                        gc = g.to(compute_dtype)
                        del g
                    elif acc == compute_dtype:
                        gc = logp.exp_().scatter_(1, target, fix)
                    else:
                        gc = torch.exp(
                            logp, out=torch.empty(logp.shape, dtype=compute_dtype, device=dev)
                        )
                        gc.scatter_(1, target, fix.to(compute_dtype))
                    del logp
                    keep = valid.unsqueeze(1).to(compute_dtype)
                    if grad_h is not None:
                        grad_h[start:end] = ((gc @ w) * keep).to(hidden.dtype)
                    if grad_w is not None:
                        grad_w += (gc.t() @ (h * keep)).float()
                    if grad_b is not None:
                        grad_b += (keep.squeeze(1) @ gc).float()
                    del gc
            ctx.save_for_backward(grad_h, grad_w, grad_b)
            ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
            return loss

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:  # type: ignore[override]
            grad_h, grad_w, grad_b = ctx.saved_tensors
            dh, dw, db = ctx.dtypes
            # out of place: the saved gradients stay valid for a second backward (retain_graph)
            scaled = [
                None if g is None else (g * grad_out).to(dt)
                for g, dt in ((grad_h, dh), (grad_w, dw), (grad_b, db))
            ]
            return scaled[0], scaled[1], None, scaled[2], None, None, None, None, None

    return _LinearCrossEntropySum


def linear_cross_entropy_sum(
    hidden: Any,
    weight: Any,
    labels: Any,
    *,
    bias: Any = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> Any:
    """Summed cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, never holding all the logits.

    In [1]: linear_cross_entropy_sum(h, lm_head.weight, y)    # == F.cross_entropy(h @ W.T, y, reduction="sum")

    `hidden` is [N, H] or [B, T, H] with `labels` [N] or [B, T], aligned: row t predicts labels[t] (the
    caller shifts). Rows labelled `ignore_index` add nothing. The matmuls run in autocast's dtype when
    autocast is on (else the inputs' own), logsumexp and the sum in fp32. `softcap` applies Gemma-2's
    `c * tanh(logits / c)` before the softmax. `chunk_size` tokens at a time (default
    `default_chunk_size(V)`); the gradients w.r.t. `hidden`, `weight` and `bias` are computed only for
    those that require grad, and only when grad mode is on.
    """
    import torch

    h_dim = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != h_dim:
        msg = f"weight must be [vocab, {h_dim}] to match hidden {tuple(hidden.shape)}, got {tuple(weight.shape)}"
        raise ValueError(msg)
    if labels.shape != hidden.shape[:-1]:
        msg = f"labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} without its last dim"
        raise ValueError(msg)
    if softcap is not None and softcap <= 0:
        msg = f"softcap must be a positive number or None, got {softcap}"
        raise ValueError(msg)
    hidden2 = hidden.reshape(-1, h_dim)
    labels1 = labels.reshape(-1)
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    if chunk < 1:
        msg = f"chunk_size must be a positive number of tokens, got {chunk_size}"
        raise ValueError(msg)
    dev_type = hidden.device.type
    if torch.is_autocast_enabled(dev_type) and hidden.is_floating_point():
        compute_dtype = torch.get_autocast_dtype(dev_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    return _function().apply(
        hidden2, weight, labels1, bias, chunk, ignore_index, softcap, compute_dtype, needs
    )


# ------------------------------------------------------------------------------------ liger or ours
def _liger_loss_class() -> Any:
    """Liger's fused linear cross-entropy module class, or None when liger-kernel (or Triton) is missing."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
    except Exception:  # ImportError, or Triton failing to initialise without a GPU
        return None
    return LigerFusedLinearCrossEntropyLoss


def _liger_fn(cls: Any) -> LossFn:
    def liger_sum(
        hidden: Any,
        weight: Any,
        labels: Any,
        *,
        bias: Any = None,
        ignore_index: int = -100,
        softcap: float | None = None,
    ) -> Any:
        # liger-kernel >= 0.5: keyword arguments here, and forward(lin_weight, _input, target, bias)
        loss = cls(ignore_index=ignore_index, reduction="sum", softcap=softcap)
        h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        return loss(weight, h, labels.reshape(-1).contiguous(), bias)

    return liger_sum


def select_loss_impl(
    device: Any, prefer: str = "auto", *, log: Callable[[str], Any] | None = None
) -> tuple[str, LossFn]:
    """The fused loss to use on `device`: ("liger", fn) on CUDA when liger-kernel imports, else ("chunked", fn).

    In [1]: name, loss_fn = select_loss_impl(torch.device("cuda"), log=print if is_zero else None)

    `prefer` is "auto", "liger" or "chunked"; "liger" where it cannot run is an error. `log` gets one line
    when CUDA runs without liger-kernel (pass it on rank 0 only).
    """
    import torch

    from nbtrain.errors import ConfigError

    dev = torch.device(device)
    if prefer not in ("auto", "liger", "chunked"):
        msg = f"loss implementation {prefer!r} is unknown; use 'auto', 'liger' or 'chunked'"
        raise ConfigError(msg)
    if prefer == "chunked":
        return "chunked", linear_cross_entropy_sum
    cls = _liger_loss_class() if dev.type == "cuda" else None
    if cls is not None:
        return "liger", _liger_fn(cls)
    if prefer == "liger":
        why = "it needs a CUDA device" if dev.type != "cuda" else "liger-kernel does not import"
        msg = (
            f"the liger loss cannot run on {dev} ({why}); pip install liger-kernel on a GPU machine, "
            "or use the built-in chunked loss (prefer='auto' or 'chunked')"
        )
        raise ConfigError(msg)
    if dev.type == "cuda" and log is not None:
        log(
            "nbtrain: liger-kernel is not installed; using the chunked fused loss "
            "(pip install liger-kernel for the Triton kernel)"
        )
    return "chunked", linear_cross_entropy_sum


# ------------------------------------------------------------------------------ the model's side
def _unwrap(model: Any) -> Any:
    """The transformers causal LM inside DDP and peft wrappers."""
    inner = getattr(model, "module", model)  # DDP / DataParallel
    get_base = getattr(inner, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else inner


def _softcap_of(base: Any) -> float | None:
    value = getattr(base.config, "final_logit_softcapping", None)
    return float(value) if value else None


@contextlib.contextmanager
def _hidden_states_out(base: Any) -> Iterator[tuple[Any, float | None]]:
    """While inside, the causal LM's forward returns its last hidden states as `.logits`.

    The lm_head becomes the identity (an instance attribute over the class's forward) and Gemma-2's final
    soft-capping is switched off in the config, to be applied by the loss instead. Both are put back on
    the way out, exceptions included. Yields (lm_head, softcap).
    """
    head = base.get_output_embeddings()
    softcap = _softcap_of(base)
    had_own_forward = "forward" in head.__dict__
    own_forward = head.__dict__.get("forward")
    try:
        head.forward = _identity
        if softcap is not None:
            base.config.final_logit_softcapping = None
        yield head, softcap
    finally:
        if had_own_forward:
            head.forward = own_forward
        else:
            del head.forward
        if softcap is not None:
            base.config.final_logit_softcapping = softcap


def _identity(x: Any) -> Any:
    return x


def fused_loss_supported(
    model: Any, *, probe: bool = True, autocast: Any = None
) -> tuple[bool, str]:
    """Whether `causal_lm_loss_sum` computes this model's true loss: (True, "") or (False, why).

    In [1]: ok, why = fused_loss_supported(peft_model)

    Static checks first (a plain nn.Linear lm_head, not LoRA-wrapped, no offloading hooks), then, with
    `probe`, one forward of two tokens without grad, in eval mode, that compares the model's own logits
    with lm_head(hidden states) (soft-capped where the config says): any other post-processing of the
    logits (Cohere's logit_scale, Granite's logits_scaling, ...) fails there and is reported.
    """
    import torch

    base = _unwrap(model)
    name = type(base).__name__
    get_out = getattr(base, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None:
        return False, f"{name} has no output embeddings (lm_head) that transformers can find"
    if type(head) is not torch.nn.Linear:
        return False, (
            f"{name}'s lm_head is a {type(head).__name__}, not a plain nn.Linear (LoRA or "
            "modules_to_save on lm_head, or a quantised head); its logits need the module's own forward"
        )
    get_in = getattr(base, "get_input_embeddings", None)
    if callable(get_in) and get_in() is head:
        return False, f"{name} uses one module as both input embedding and lm_head"
    if hasattr(head, "_hf_hook") or "forward" in head.__dict__:
        return (
            False,
            f"{name}'s lm_head has a hook that replaces its forward (accelerate offloading?)",
        )
    if not probe:
        return True, ""
    try:
        ok, why = _probe(base, head, autocast or contextlib.nullcontext)
    except Exception as e:  # a model whose forward needs more than input_ids
        return False, f"the probe forward of {name} failed: {type(e).__name__}: {e}"
    return ok, why


def _probe(base: Any, head: Any, autocast: Any) -> tuple[bool, str]:
    import torch

    name = type(base).__name__
    seen: dict[str, Any] = {}

    def record(_m: Any, args: Any, out: Any) -> None:
        seen["in"], seen["out"] = args[0], out

    modes = {m: m.training for m in base.modules()}
    ids = torch.tensor([[1, 2, 3]], device=head.weight.device)
    hook = head.register_forward_hook(record)
    try:
        base.eval()
        # under the run's autocast: a bf16 model whose fp32 LoRA layers take bf16 inputs needs it
        with torch.no_grad(), autocast():
            logits = base(input_ids=ids, use_cache=False).logits
            hook.remove()
            with _hidden_states_out(base) as (_, softcap):
                hidden = base(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
        for m, training in modes.items():
            m.training = training
    if "in" not in seen:
        return False, f"{name}'s forward does not call its lm_head"
    # what the fused loss sees must be what the lm_head saw ...
    if hidden.shape != seen["in"].shape or not torch.allclose(
        hidden, seen["in"], rtol=1e-4, atol=1e-5
    ):
        return False, (
            f"{name} post-processes what its lm_head returns (a logit scale?), which the fused "
            "loss would skip"
        )
    # ... and the model's logits must be the lm_head's output, soft-capped where the config says
    mine = seen["out"].float()
    if softcap is not None:
        mine = softcap * torch.tanh(mine / softcap)
    logits = logits.float()
    scale = max(1.0, float(logits.abs().max()))
    if mine.shape != logits.shape or not torch.allclose(mine, logits, rtol=1e-4, atol=1e-4 * scale):
        return False, (
            f"{name}'s logits are not its lm_head's output: the model post-processes them, which "
            "the fused loss would skip"
        )
    return True, ""


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a causal LM's forward gets from a collated batch. Packed and padding-free
    batches have position_ids and no attention mask: transformers then keeps each sequence (its
    position ids restarting at 0) to itself."""
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch.get("attention_mask"),
        "position_ids": batch.get("position_ids"),
        "use_cache": False,
    }


def last_hidden_states(model: Any, batch: dict[str, Any], autocast: Any) -> tuple[Any, Any, Any]:
    """(the last hidden states [B, T, H], the lm_head, its soft-cap) of `batch`, without the logits.

    For a loss that needs per-token log-probabilities rather than a sum (DPO's sequence log-probs).
    `model` is called through its own top-level forward, DDP and peft wrappers included, with the
    lm_head made the identity for the call, as `causal_lm_loss_sum` does; only a model that
    `fused_loss_supported` passes gives the true states.
    """
    base = _unwrap(model)
    with _hidden_states_out(base) as (head, softcap), autocast():
        hidden = model(**model_inputs(batch)).logits
    return hidden, head, softcap


def chunked_token_logps(
    hidden: Any, weight: Any, bias: Any, labels: Any, softcap: Any, temperature: float = 1.0
) -> Any:
    """log p(labels[i]) under softmax((hidden[i] @ weight.T + bias) / temperature), fp32, [N].

    A chunk of rows at a time, each chunk's logits recomputed in backward (`torch.utils.checkpoint`),
    so only one chunk's [rows, vocab] logits exist at once (DPO's sequence and GRPO's token
    log-probabilities). `softcap` is applied before the temperature, as the model's own logits are."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def chunk(h: Any, y: Any) -> Any:
        logits = h @ weight.t().to(h.dtype)
        if bias is not None:
            logits = logits + bias.to(h.dtype)
        logits = logits.float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if temperature != 1.0:
            logits = logits / temperature
        return torch.log_softmax(logits, dim=-1).gather(1, y.unsqueeze(1)).squeeze(1)

    size = default_chunk_size(weight.shape[0])
    parts = []
    for start in range(0, hidden.shape[0], size):
        h, y = hidden[start : start + size], labels[start : start + size]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(chunk, h, y, use_reentrant=False))
        else:
            parts.append(chunk(h, y))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def causal_lm_loss_sum(
    model: Any, batch: dict[str, Any], autocast: Any, impl: LossFn, aux: Any = None
) -> Any:
    """Summed next-token cross-entropy over the batch's target tokens, without the [B, T, V] logits.

    In [1]: loss_sum = causal_lm_loss_sum(ddp_model, batch, autocast, loss_fn)
    In [2]: (loss_sum * scale).backward()

    The same number as `F.cross_entropy(model(...).logits[:, :-1].float(), labels[:, 1:], reduction="sum")`.
    `model` may be DDP- and peft-wrapped: it is called through its own top-level forward, so DDP's
    gradient sync fires as usual, with the lm_head made the identity for the call so that the output
    is the last hidden states. Only target rows reach the loss (one host sync to find them), which
    also skips the lm_head for prompt and padding tokens. `autocast` is a context-manager factory.
    `aux`: an MoE's router loss to ask the forward for (`nbtrain.losses.router.RouterAux`), which
    keeps it; the sum returned is the cross-entropy alone.
    """
    import torch

    base = _unwrap(model)
    extra = aux.kwargs if aux is not None else {}
    with _hidden_states_out(base) as (head, softcap), autocast():
        out = model(**model_inputs(batch), **extra)
    if aux is not None:
        aux.seen(out)
    hidden = out.logits
    # position t predicts labels[t + 1]; the last position predicts nothing
    labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100).reshape(-1)
    # found on the CPU by the caller where it could (a GPU nonzero() waits for the forward to finish)
    rows = batch.get("target_rows")
    if rows is None:
        rows = (labels != -100).nonzero().squeeze(1)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    if rows.numel() == 0:
        # no targets here (a rank can get only prompts): a zero that still reaches every LoRA weight,
        # so that DDP's backward completes on this rank as on the others (Liger would divide by zero)
        return hidden.float().sum()
    with autocast():
        return impl(
            hidden, head.weight, labels.index_select(0, rows), bias=head.bias, softcap=softcap
        )
