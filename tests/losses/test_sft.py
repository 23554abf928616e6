"""nbtrain.losses.sft: the fused lm_head + cross-entropy against the plain logits path, on CPU (and GPU)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nbtrain.errors import ConfigError
from nbtrain.losses.sft import (
    causal_lm_loss_sum,
    default_chunk_size,
    fused_loss_supported,
    linear_cross_entropy_sum,
    select_loss_impl,
)

REPO = Path(__file__).resolve().parents[2]
gpu_test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here")

# one BLAS thread: the test machine is small and shared (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _token_loss_sum(model, batch, autocast):
    """The reference: nbtrain.recipes.train._token_loss_sum (now nbtrain.recipes.step.token_loss_sum) as it was before the fused loss (full logits)."""
    with autocast():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def _reference(h, w, y, b=None, softcap=None):
    logits = (h @ w.t() if b is None else h @ w.t() + b).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")


def _data(n, hdim, vocab, dtype, *, bias=False, w_grad=False, ignored=0.3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=g) * 0.3).to(device, dtype).requires_grad_(w_grad)
    b = (
        (torch.randn(vocab, generator=g) * 0.5).to(device, dtype).requires_grad_(w_grad)
        if bias
        else None
    )
    y = torch.randint(0, vocab, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    return h, w, b, y.to(device)


def _grads(loss, *ts):
    return torch.autograd.grad(loss, [t for t in ts if t is not None and t.requires_grad])


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


# ----------------------------------------------------------------------------- linear_cross_entropy_sum
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("bias,w_grad", [(False, False), (True, True), (False, True)])
def test_matches_cross_entropy_and_its_gradients(dtype, chunk, bias, w_grad):
    # 50 tokens: 7 leaves a short last chunk, 64 is one chunk bigger than the input
    h, w, b, y = _data(50, 16, 97, dtype, bias=bias, w_grad=w_grad)
    want = _reference(h, w, y, b)
    got = linear_cross_entropy_sum(h, w, y, bias=b, chunk_size=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[dtype])
    for g_got, g_want, t in zip(_grads(got * 3.0, h, w, b), _grads(want * 3.0, h, w, b), (h, w, b)):
        assert g_got.dtype == t.dtype
        torch.testing.assert_close(g_got.float(), g_want.float(), **TOL[dtype])


def test_frozen_weight_gets_no_gradient_and_nothing_is_computed_for_it():
    h, w, _, y = _data(20, 8, 33, torch.float32)
    loss = linear_cross_entropy_sum(h, w, y, chunk_size=6)
    loss.backward()
    assert w.grad is None and h.grad is not None


def test_batch_and_time_dims_are_flattened():
    h, w, _, y = _data(2 * 13, 16, 41, torch.float32)
    h3 = h.detach().reshape(2, 13, 16).requires_grad_()
    got = linear_cross_entropy_sum(h3, w, y.reshape(2, 13), chunk_size=5)
    want = _reference(h, w, y)
    torch.testing.assert_close(got, want)
    (g3,) = torch.autograd.grad(got, h3)
    (g,) = torch.autograd.grad(want, h)
    torch.testing.assert_close(g3.reshape(26, 16), g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_matches_gemma2_capping(dtype):
    h, w, b, y = _data(30, 16, 50, dtype, bias=True, w_grad=True)
    h = (h.detach() * 4).requires_grad_()  # logits well into tanh's curve
    want = _reference(h, w, y, b, softcap=5.0)
    got = linear_cross_entropy_sum(h, w, y, bias=b, chunk_size=8, softcap=5.0)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert abs(float(got) - float(_reference(h, w, y, b))) > 1.0  # the cap does change the loss
    for g_got, g_want in zip(_grads(got, h, w, b), _grads(want, h, w, b)):
        torch.testing.assert_close(g_got.float(), g_want.float(), **TOL[dtype])


def test_all_ignored_gives_zero_loss_and_zero_gradients():
    h, w, b, y = _data(17, 8, 29, torch.float32, bias=True, w_grad=True, ignored=1.0)
    assert (y == -100).all()
    loss = linear_cross_entropy_sum(h, w, y, bias=b, chunk_size=4)
    assert float(loss) == 0.0
    for g in _grads(loss, h, w, b):
        assert torch.equal(g, torch.zeros_like(g))


def test_all_ignored_chunk_among_others():
    h, w, _, y = _data(24, 8, 29, torch.float32, ignored=0.0)
    y[8:16] = -100  # the middle chunk of three has no targets
    got = linear_cross_entropy_sum(h, w, y, chunk_size=8)
    torch.testing.assert_close(got, _reference(h, w, y))
    (g,) = torch.autograd.grad(got, h)
    assert torch.equal(g[8:16], torch.zeros_like(g[8:16]))
    torch.testing.assert_close(g, torch.autograd.grad(_reference(h, w, y), h)[0])


def test_autocast_matches_autocast_reference():
    # fp32 inputs under CPU bf16 autocast: the matmul runs in bf16 as autocast would run the lm_head
    h, w, _, y = _data(40, 16, 70, torch.float32, w_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _reference(h, w, y)
        got = linear_cross_entropy_sum(h, w, y, chunk_size=9)
    assert not torch.allclose(got, _reference(h, w, y), rtol=0, atol=1e-6)  # bf16 did happen
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g_got, g_want in zip(_grads(got, h, w), _grads(want, h, w)):
        assert g_got.dtype == torch.float32
        torch.testing.assert_close(g_got, g_want, rtol=2e-2, atol=2e-2)


def test_no_grad_computes_the_loss_only():
    h, w, _, y = _data(20, 8, 33, torch.float32)
    with torch.no_grad():
        got = linear_cross_entropy_sum(h, w, y, chunk_size=3)
    assert not got.requires_grad
    torch.testing.assert_close(got, _reference(h, w, y).detach())


def test_bad_shapes_are_refused():
    h, w, _, y = _data(10, 8, 20, torch.float32)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy_sum(h, w, y[:9])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy_sum(h, w[:, :7], y)


def test_default_chunk_size_is_a_byte_budget():
    assert default_chunk_size(128256) == 512  # Llama 3: 256 MiB of fp32 logits
    assert default_chunk_size(32000) == 2048
    assert default_chunk_size(10**9) == 64  # never fewer than 64 tokens


def test_no_tensor_as_big_as_the_logits_is_ever_made():
    """A deterministic stand-in for peak memory on CPU: the biggest tensor any op creates."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Biggest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    n, hdim, vocab, chunk = 512, 16, 4096, 32
    h, w, _, y = _data(n, hdim, vocab, torch.float32)
    with Biggest() as fused:
        loss = linear_cross_entropy_sum(h, w, y, chunk_size=chunk)
        loss.backward()
    with Biggest() as plain:
        _reference(h, w, y).backward()
    assert plain.numel >= n * vocab
    # the weight itself (vocab x hidden) is the biggest thing besides one chunk of logits
    assert fused.numel <= max(chunk * vocab, vocab * hdim)


# ------------------------------------------------------------------------------------- select_loss_impl
def test_select_on_cpu_is_the_chunked_loss():
    assert select_loss_impl(torch.device("cpu")) == ("chunked", linear_cross_entropy_sum)
    assert select_loss_impl("cpu", "chunked")[0] == "chunked"


def test_select_liger_where_it_cannot_run_is_an_error():
    with pytest.raises(ConfigError, match="liger loss cannot run on cpu"):
        select_loss_impl("cpu", "liger")
    with pytest.raises(ConfigError, match="'auto', 'liger' or 'chunked'"):
        select_loss_impl("cpu", "fast")


# --------------------------------------------------------------------------- the model's side
def _lora(base, targets=("q_proj", "v_proj", "down_proj")):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    # init_lora_weights=False: B is random too, so A's gradients are not all zero
    cfg = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), init_lora_weights=False
    )
    return get_peft_model(base, cfg)


def _batch(vocab, rows=3, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    labels = ids.clone()
    for r in range(rows):
        prompt, pad = 2 + r, r * 2  # prompt tokens are not targets; right padding
        labels[r, :prompt] = -100
        if pad:
            mask[r, -pad:] = 0
            labels[r, -pad:] = -100
            ids[r, -pad:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _compare_with_logits_path(model, batch, autocast, tol):
    got = causal_lm_loss_sum(model, batch, autocast, linear_cross_entropy_sum)
    got.backward()
    mine = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    want = _token_loss_sum(model, batch, autocast)
    want.backward()
    ref = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(got, want, **tol)
    assert mine.keys() == ref.keys() and len(ref) > 0
    assert any(g.abs().sum() > 0 for g in ref.values())
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], **tol, msg=name)


def test_causal_lm_loss_equals_the_logits_path_on_tiny_llama_with_lora(tiny):
    from transformers import AutoModelForCausalLM

    model = _lora(AutoModelForCausalLM.from_pretrained(tiny))
    ok, why = fused_loss_supported(model)
    assert ok, why
    batch = _batch(model.get_base_model().config.vocab_size)
    _compare_with_logits_path(model, batch, contextlib.nullcontext, dict(rtol=1e-5, atol=1e-5))
    # the lm_head is itself again afterwards
    head = model.get_base_model().get_output_embeddings()
    assert "forward" not in head.__dict__
    logits = model(input_ids=batch["input_ids"]).logits
    assert logits.shape[-1] == head.out_features


def test_causal_lm_loss_without_targets_is_zero_with_zero_lora_gradients(tiny):
    # a rank whose micro-batch is all prompt must still run backward for DDP, with zero gradients
    from transformers import AutoModelForCausalLM

    model = _lora(AutoModelForCausalLM.from_pretrained(tiny))
    batch = _batch(model.get_base_model().config.vocab_size)
    batch["labels"][:] = -100
    loss = causal_lm_loss_sum(model, batch, contextlib.nullcontext, linear_cross_entropy_sum)
    assert float(loss) == 0.0
    loss.backward()
    grads = _lora_grads(model)
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


def test_causal_lm_loss_under_no_grad_is_the_eval_loss(tiny):
    from transformers import AutoModelForCausalLM

    model = _lora(AutoModelForCausalLM.from_pretrained(tiny)).eval()
    batch = _batch(model.get_base_model().config.vocab_size, seed=2)
    with torch.no_grad():
        got = causal_lm_loss_sum(model, batch, contextlib.nullcontext, linear_cross_entropy_sum)
        want = _token_loss_sum(model, batch, contextlib.nullcontext)
    assert not got.requires_grad
    torch.testing.assert_close(got, want)


def test_the_lm_head_is_put_back_when_the_forward_fails(tiny):
    from transformers import AutoModelForCausalLM

    model = _lora(AutoModelForCausalLM.from_pretrained(tiny))
    batch = _batch(model.get_base_model().config.vocab_size)
    batch["input_ids"][0, 0] = 10**6  # no such token: the embedding lookup raises
    with pytest.raises(IndexError):
        causal_lm_loss_sum(model, batch, contextlib.nullcontext, linear_cross_entropy_sum)
    assert "forward" not in model.get_base_model().get_output_embeddings().__dict__


def test_importing_the_module_does_not_import_torch():
    code = "import sys, nbtrain.losses.sft; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_causal_lm_loss_under_bf16_autocast(tiny):
    from transformers import AutoModelForCausalLM

    model = _lora(AutoModelForCausalLM.from_pretrained(tiny))
    batch = _batch(model.get_base_model().config.vocab_size, seed=1)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    _compare_with_logits_path(model, batch, autocast, dict(rtol=2e-2, atol=2e-2))


def test_gemma2_softcap_is_applied_by_the_loss():
    from transformers import AutoModelForCausalLM, Gemma2Config

    cfg = Gemma2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=2.0,  # small, so that it bites on random logits
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = _lora(AutoModelForCausalLM.from_config(cfg))
    ok, why = fused_loss_supported(model)
    assert ok, why
    _compare_with_logits_path(
        model, _batch(300), contextlib.nullcontext, dict(rtol=1e-5, atol=1e-5)
    )
    assert model.get_base_model().config.final_logit_softcapping == 2.0


def test_models_whose_logits_are_not_lm_head_of_hidden_are_refused():
    from transformers import AutoModelForCausalLM, GraniteConfig

    cfg = GraniteConfig(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=8.0,
    )
    torch.manual_seed(0)
    ok, why = fused_loss_supported(_lora(AutoModelForCausalLM.from_config(cfg)))
    assert not ok
    assert "post-processes" in why


def test_lora_on_the_lm_head_is_refused(tiny):
    from transformers import AutoModelForCausalLM

    model = _lora(AutoModelForCausalLM.from_pretrained(tiny), targets=("q_proj", "lm_head"))
    ok, why = fused_loss_supported(model, probe=False)
    assert not ok
    assert "not a plain nn.Linear" in why


# ------------------------------------------------------------------------------------------- DDP
DDP_WORKER = textwrap.dedent(
    """
    import contextlib, sys
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, sys.argv[4])
    from tests.losses.test_sft import _batch, _lora
    from nbtrain.losses.sft import causal_lm_loss_sum, linear_cross_entropy_sum

    store, rank, out, _, tiny = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model = _lora(AutoModelForCausalLM.from_pretrained(tiny))
    full = _batch(model.get_base_model().config.vocab_size, rows=4)
    n_targets = float((full["labels"][:, 1:] != -100).sum())
    mine = {k: v[2 * rank : 2 * rank + 2] for k, v in full.items()}
    ddp = DDP(model)
    loss = causal_lm_loss_sum(ddp, mine, contextlib.nullcontext, linear_cross_entropy_sum)
    # as finetune does: DDP averages over ranks, so scale by world to get the global sum
    (loss * (2 / n_targets)).backward()
    torch.save({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, out)
    dist.destroy_process_group()
    """
)


def test_ddp_gradients_are_synchronised_through_the_wrapper(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                DDP_WORKER,
                str(tmp_path / "store"),
                str(r),
                str(tmp_path / f"grads-{r}.pt"),
                str(REPO),
                tiny,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    g0, g1 = (torch.load(tmp_path / f"grads-{r}.pt") for r in range(2))

    # one process, the whole batch, the plain logits path
    model = _lora(AutoModelForCausalLM.from_pretrained(tiny))
    full = _batch(model.get_base_model().config.vocab_size, rows=4)
    n_targets = float((full["labels"][:, 1:] != -100).sum())
    (_token_loss_sum(model, full, contextlib.nullcontext) / n_targets).backward()
    want = _lora_grads(model)
    assert g0.keys() == g1.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(g0[name], g1[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(g0[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------ GPU
@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_and_uses_far_less_memory(dtype):
    n, hdim, vocab = 8192, 1024, 128256
    h, w, _, y = _data(n, hdim, vocab, dtype, device="cuda")
    torch.cuda.synchronize()

    def peak(fn):
        h.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), h.grad.clone(), torch.cuda.max_memory_allocated() - base

    want, g_want, plain = peak(lambda: _reference(h, w, y))
    got, g_got, fused = peak(lambda: linear_cross_entropy_sum(h, w, y))
    torch.testing.assert_close(got, want, rtol=1e-4 if dtype == torch.float32 else 2e-3, atol=1e-2)
    torch.testing.assert_close(g_got.float(), g_want.float(), **TOL[dtype])
    assert plain > n * vocab * 4  # the fp32 logits alone
    assert fused < plain / 4, (fused, plain)
