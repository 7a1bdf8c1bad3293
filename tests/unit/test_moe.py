"""The experts path's grouped GEMM: grouped_mm where it applies is bit-identical to the per-expert loop, and the
single-process experts forward equals transformers' eager experts; the default gate keeps no activation output."""

import pytest
import torch

from xpar_zoo.styles import experts as moe
from xpar_zoo.styles.experts import (
    EXPERTS_IMPLEMENTATION,
    GatedDown,
    SiluGate,
    grouped_linear,
    grouped_mm_loop,
    grouped_mm_supported,
)
from xpar_zoo.testing import parity


@pytest.mark.parametrize("counts", [[0, 10, 0, 6], [0, 0, 0, 0], [3, 0, 13, 0], [4, 4, 4, 4]])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_linear_is_bit_identical_to_the_per_expert_loop(counts, transposed):
    g = torch.Generator().manual_seed(sum(counts))
    c = torch.tensor(counts)
    n = int(c.sum())
    x = torch.randn(n, 8, generator=g, requires_grad=True)
    w = torch.randn(4, *((8, 12) if transposed else (12, 8)), generator=g, requires_grad=True)
    b = torch.randn(4, 12, generator=g, requires_grad=True)
    y = grouped_linear(x, w, c, transposed=transposed, bias=b)
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y2 = grouped_mm_loop(x2, w2 if transposed else w2.transpose(-2, -1), c)
    y2 = y2 + torch.repeat_interleave(b2, c, dim=0, output_size=n)
    y2.backward(grad)
    assert torch.equal(y, y2) and torch.equal(w.grad, w2.grad) and torch.equal(b.grad, b2.grad)
    if n:
        assert torch.equal(x.grad, x2.grad)


def test_grouped_mm_is_used_on_aligned_cpu_fp32_and_not_on_unaligned():
    assert grouped_mm_supported(torch.zeros(4, 8), torch.zeros(2, 12, 8))
    assert not grouped_mm_supported(torch.zeros(4, 6), torch.zeros(2, 12, 6))
    assert not grouped_mm_supported(torch.zeros(0, 8), torch.zeros(2, 12, 8))
    assert not grouped_mm_supported(torch.zeros(4, 8, dtype=torch.float64), torch.zeros(2, 12, 8, dtype=torch.float64))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_single_process_experts_forward_matches_transformers_eager(arch):
    cfg = parity.tiny_config(arch)
    model = parity.build_model(cfg, experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.02)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids).loss
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    ours = model(input_ids=ids, labels=ids).loss
    assert abs(ours.item() - ref.item()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 11, 16], [0, 0, 32, 0]])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_recomputing_gate_is_bit_identical_to_autograds_graph(dtype, counts, transposed):
    """SiluGate (the loop path's) and GatedDown (grouped_mm's, gate and down projection together) against autograd
    on transformers' default gate followed by grouped_linear: outputs and every gradient equal to the bit."""
    g = torch.Generator().manual_seed(3)
    c = torch.tensor(counts)
    h = torch.randn(int(c.sum()), 32, generator=g).to(dtype).requires_grad_()
    w = torch.randn(4, *((16, 8) if transposed else (8, 16)), generator=g).to(dtype).requires_grad_()
    grad = torch.randn(h.shape[0], 8, generator=g).to(dtype)
    h2, w2 = (t.detach().clone().requires_grad_() for t in (h, w))
    gate, up = h2.chunk(2, dim=-1)
    want = grouped_linear(torch.nn.functional.silu(gate) * up, w2, c, transposed=transposed)
    want.backward(grad)
    for got in (grouped_linear(SiluGate.apply(h), w, c, transposed=transposed),
                GatedDown.apply(h, w if transposed else w.transpose(-2, -1), c)):
        h.grad = w.grad = None
        got.backward(grad)
        assert torch.equal(got, want) and torch.equal(h.grad, h2.grad) and torch.equal(w.grad, w2.grad)


def test_experts_keep_no_activation_output_for_backward(monkeypatch):
    """The experts path keeps ``[gate; up]`` and recomputes ``silu(gate) * up`` in backward instead of keeping
    ``silu(gate)`` and the product: two ``[rows, I]`` tensors less per layer for the whole step than autograd's graph
    of the default gate and the down projection."""
    cfg = parity.tiny_config("qwen3_moe")
    model = parity.build_model(cfg, experts_implementation=EXPERTS_IMPLEMENTATION)
    experts = model.model.layers[0].mlp.experts
    tokens, k = 16, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, cfg.hidden_size, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g, requires_grad=True)
    ours = parity.saved_for_backward_bytes(lambda: experts(x, index, weights), exclude=experts.parameters())
    monkeypatch.setattr(moe, "_default_silu_gate", lambda module: False)
    autograds = parity.saved_for_backward_bytes(lambda: experts(x, index, weights), exclude=experts.parameters())
    assert autograds - ours == 2 * tokens * k * cfg.moe_intermediate_size * x.element_size()


def test_fixed_routes_reach_every_experts_module_and_are_read_back():
    from xpar_zoo.styles.routes import Routes, fixed_routes, install_routes

    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    experts = moe.experts_modules(model)
    assert experts == [m for n, m in model.named_modules() if n.endswith("mlp.experts")] and experts
    assert moe.set_experts_kernels(model, "torch") == len(experts)
    assert install_routes(experts, Routes(2.0)) == len(experts)
    assert all(fixed_routes(m) == Routes(2.0) for m in experts) and fixed_routes(model) is None
