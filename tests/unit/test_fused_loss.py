"""The whole-vocab fused linear + cross-entropy (``install_fused_loss``; ``parallelize``'s default on meshes without
a ``head`` plan) against transformers' own loss on the same single-process model: loss and every gradient, with
several chunks, ignored targets, ``num_items_in_batch``, ``shift_labels``, tied embeddings, a frozen head, bf16;
logits as transformers returns them without labels or inside ``full_logits``; clear errors."""

import copy

import pytest
import torch
from torch import nn

import xpar_zoo
from xpar_zoo.errors import BatchError, KernelError, PlanError
from xpar_zoo.styles.vocab import install_fused_loss
from xpar_zoo.testing import parity

BATCH, SEQ = 3, 11


def _pair(dtype=torch.float32, chunk_rows=5, kernels="torch", **overrides):
    cfg = parity.tiny_config("qwen3_moe", **overrides)
    ref = parity.build_model(cfg, experts_implementation="eager").to(dtype)
    fused = install_fused_loss(copy.deepcopy(ref), chunk_elements=chunk_rows * cfg.vocab_size, kernels=kernels)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return cfg, ref, fused, ids


def _loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref_kwargs, ref, fused, loss_tol=1e-5, grad_tol=1e-5, fused_kwargs=None):
    want, want_grads = _loss_and_grads(ref, **ref_kwargs)
    got, got_grads = _loss_and_grads(fused, **(fused_kwargs or ref_kwargs))
    assert abs(got.loss.item() - want.loss.item()) <= loss_tol * max(1.0, abs(want.loss.item()))
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        err = ((got_grads[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= grad_tol, f"{name}: relative gradient error {err:.2e}"
    return got


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 1000], ids=["row_chunks", "5_row_chunks", "one_chunk"])
def test_loss_and_gradients_match_transformers(chunk_rows, kernels):
    _, ref, fused, ids = _pair(chunk_rows=chunk_rows, kernels=kernels)
    labels = ids.clone()
    labels[0, :4] = -100
    out = _assert_same(dict(input_ids=ids, labels=labels), ref, fused)
    assert out.logits is None, "with labels the fused head returns no logits unless full_logits() asks"


def test_num_items_in_batch_shift_labels_and_ignore_index():
    _, ref, fused, ids = _pair()
    labels = ids.clone()
    labels[1, 3:] = -7
    _assert_same(dict(input_ids=ids, labels=labels, num_items_in_batch=17, ignore_index=-7), ref, fused)
    shifted = torch.roll(ids, -1, dims=1)
    shifted[:, -1] = -100
    _assert_same(dict(input_ids=ids, labels=ids, shift_labels=shifted), ref, fused)
    _assert_same(dict(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(40)), ref, fused)


def test_tied_embeddings_and_a_frozen_head():
    _, ref, fused, ids = _pair(tie_word_embeddings=True)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    _assert_same(dict(input_ids=ids, labels=ids), ref, fused)
    _, ref, fused, ids = _pair()
    for m in (ref, fused):
        m.lm_head.weight.requires_grad_(False)
    _assert_same(dict(input_ids=ids, labels=ids), ref, fused)


def test_bf16_matches_within_bf16_tolerance():
    _, ref, fused, ids = _pair(dtype=torch.bfloat16)
    _assert_same(dict(input_ids=ids, labels=ids), ref, fused, loss_tol=1e-2, grad_tol=2e-2)


def test_logits_without_labels_inside_full_logits_and_under_no_grad():
    _, ref, fused, ids = _pair()
    assert torch.equal(fused(input_ids=ids).logits, ref(input_ids=ids).logits)
    with xpar_zoo.full_logits(fused):
        out = fused(input_ids=ids, labels=ids)
    want = ref(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, want.logits) and abs(out.loss.item() - want.loss.item()) < 1e-5
    with torch.no_grad():
        evaluated = fused(input_ids=ids, labels=ids).loss
    assert not evaluated.requires_grad and abs(evaluated.item() - want.loss.item()) < 1e-5


def test_all_ignored_targets_give_zero_not_nan():
    _, ref, fused, ids = _pair()
    ignored = torch.full_like(ids, -100)
    assert torch.isnan(ref(input_ids=ids, labels=ignored).loss)
    out = fused(input_ids=ids, labels=ignored)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in fused.parameters() if p.grad is not None)


def test_heads_it_cannot_fuse_are_refused_clearly():
    cohere = parity.build_model(parity.tiny_config("cohere2_moe"))  # multiplies its logits by logit_scale
    with pytest.raises(PlanError, match=r"changes the logits before its loss \('logits = logits \* self.logit_scale'"):
        install_fused_loss(cohere)
    _, _, fused, _ = _pair()
    with pytest.raises(PlanError, match="already fused"):
        install_fused_loss(fused)
    cfg, ref, _, _ = _pair()
    ref.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
    with pytest.raises(PlanError, match="bias-free nn.Linear"):
        install_fused_loss(ref)


@pytest.mark.parametrize("vocab", [200, 5000], ids=["one_block", "two_blocks"])
def test_triton_chunk_kernels_match_torch(vocab):
    """The Triton kernels (interpreted, fp32) on a chunk whose rows own their target or not (vocab-parallel)."""
    from xpar_zoo.kernels import loss_triton

    g = torch.Generator().manual_seed(1)
    z = torch.randn(7, vocab, generator=g) * 4
    target = torch.randint(0, vocab, (7,), generator=g)
    owned = torch.tensor([True, False, True, True, False, True, True])
    coef = torch.rand(7, generator=g)
    stats = loss_triton.row_stats(z, target, owned)
    assert torch.allclose(stats[0], torch.logsumexp(z, -1), rtol=1e-6, atol=1e-6)
    assert torch.equal(stats[1], torch.where(owned, z.gather(1, target[:, None])[:, 0], 0.0))
    lse = stats[0] + 0.5  # as if other ranks held more of the vocab
    want = (torch.softmax(z, -1) * torch.exp(torch.logsumexp(z, -1) - lse)[:, None]
            - torch.nn.functional.one_hot(target, vocab) * owned[:, None]) * coef[:, None]
    got = loss_triton.softmax_grad_(z.clone(), lse, target, owned, coef)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    _, _, fused, ids = _pair(kernels="triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelError, match="need CUDA tensors"):
        fused(input_ids=ids, labels=ids)
    with pytest.raises(KernelError, match="kernels must be one of"):
        _pair(kernels="cuda")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_standalone_function_matches_torch_cross_entropy(kernels):
    from xpar_zoo.loss.fused import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (2, 9), generator=g)
    targets[0, :3] = -100
    got = fused_linear_cross_entropy(hidden, weight, targets, chunk_elements=4 * 300, kernels=kernels)
    want = torch.nn.functional.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten())
    assert abs(got.item() - want.item()) < 1e-5
    g_got = torch.autograd.grad(got * 3, (hidden, weight))
    g_want = torch.autograd.grad(want * 3, (hidden, weight))
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(BatchError, match="targets of shape"):
        fused_linear_cross_entropy(hidden, weight, targets.flatten())


@pytest.mark.parametrize("hidden_dtype,weight_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                       (torch.float32, torch.float32)])
def test_under_autocast_the_head_computes_like_nn_linear_would(hidden_dtype, weight_dtype):
    """Mixed input dtypes under ``torch.autocast``: one compute dtype (autocast's), gradients in each input's own
    dtype, close to transformers' way (logits by autocast, fp32 cross-entropy) within bf16 tolerance."""
    from xpar_zoo.loss.fused import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 7, 32, generator=g).to(hidden_dtype).requires_grad_()
    weight = (torch.randn(200, 32, generator=g) * 0.1).to(weight_dtype).requires_grad_()
    targets = torch.randint(0, 200, (3, 7), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(hidden, weight, targets, chunk_elements=5 * 200)
        want = torch.nn.functional.cross_entropy((hidden @ weight.t()).float().flatten(0, 1), targets.flatten())
    got_grads = torch.autograd.grad(got, (hidden, weight))
    want_grads = torch.autograd.grad(want, (hidden, weight))
    assert abs(got.item() - want.item()) < 2e-2
    for a, b, x in zip(got_grads, want_grads, (hidden, weight)):
        assert a.dtype == x.dtype
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 3e-2


def test_a_target_outside_the_vocabulary_is_an_error_not_a_silent_loss():
    from xpar_zoo.loss.fused import fused_linear_cross_entropy

    hidden, weight = torch.randn(4, 8), torch.randn(50, 8)
    with pytest.raises(RuntimeError, match=r"outside the vocabulary \[0, 50\)"):
        fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 50, -100]))
    assert torch.isfinite(fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 49, -100])))


def test_the_torch_path_holds_one_chunk_of_logits_at_a_time(tmp_path):
    """The log-sum-exp and the softmax reuse the chunk's own logits in place: forward and backward together peak
    at one chunk of fp32 logits (plus the small gradients), where ``torch.logsumexp`` alone makes a second."""
    from xpar_zoo.loss.fused import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    tokens, vocab = 1024, 2048
    hidden = torch.randn(tokens, 8, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    chunk_bytes = tokens * vocab * 4
    peak = parity.live_peak_bytes(lambda: fused_linear_cross_entropy(hidden, weight, targets,
                                                                     chunk_elements=tokens * vocab).backward(),
                                  str(tmp_path / "trace.json"))
    assert chunk_bytes <= peak < 1.25 * chunk_bytes, f"peak {peak / chunk_bytes:.2f} chunks of logits"
