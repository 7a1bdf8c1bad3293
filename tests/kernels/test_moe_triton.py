"""The Triton experts kernels (the GPU path), checked on the CPU under Triton's interpreter in fp32 against
transformers' eager experts and against single-process training, including expert parallelism."""

import pytest
import torch

pytest.importorskip("triton")  # conftest.py sets TRITON_INTERPRET=1: the kernels run on the CPU
# Triton's interpreter converts 1-element arrays to scalars, which NumPy deprecates (and 2.4 refuses: hence the pin).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

from xpar_zoo.errors import KernelError
from xpar_zoo.kernels import moe_triton
from xpar_zoo.styles.experts import (
    EXPERTS_IMPLEMENTATION,
    grouped_linear,
    set_experts_kernels,
    standard_swiglu,
    triton_module_for,
)
from xpar_zoo.testing import parity

# (tokens, hidden, intermediate, experts, top-k, dead experts): groups spanning several 16-row tiles, sizes that are
# not multiples of a tile, experts that receive nothing, a single token.
SHAPES = [(37, 40, 24, 6, 2, [5]), (64, 32, 16, 4, 1, []), (1, 24, 8, 8, 4, [0, 3]), (50, 16, 40, 3, 3, [])]


def _experts(hidden, inter, experts, seed):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    module = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def _routing(tokens, experts, top_k, dead, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, dead] = -1e4
    weights, index = logits.softmax(-1).topk(top_k)
    return index, weights


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])))
def test_triton_experts_forward_and_backward_match_transformers_eager(shape):
    tokens, hidden, inter, experts, top_k, dead = shape
    module = _experts(hidden, inter, experts, seed=tokens)
    index, weights = _routing(tokens, experts, top_k, dead, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7))
    grad = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(8))

    def run(impl):
        module.config._experts_implementation = impl
        module.zero_grad(set_to_none=True)
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = module(xi, index, wi)
        y.backward(grad)
        return y.detach(), xi.grad, wi.grad, module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()

    ref = run("eager")
    assert set_experts_kernels(module, "triton") == 1
    ours = run(EXPERTS_IMPLEMENTATION)
    for name, a, b in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), ours, ref):
        assert a.shape == b.shape, name
        assert _rel(a, b) < 1e-5, f"{name}: relative error {_rel(a, b):.2e}"
    # experts that got no token get an exactly zero gradient
    for e in dead:
        assert not ours[3][e].any() and not ours[4][e].any()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused_router_grad", "materialised_dy"])
def test_both_backward_variants_agree_with_eager(fuse):
    tokens, hidden, inter, experts, top_k, dead = SHAPES[0]
    module = _experts(hidden, inter, experts, seed=1)
    index, weights = _routing(tokens, experts, top_k, dead, seed=1)
    x = torch.randn(tokens, hidden, requires_grad=True)
    w = weights.clone().requires_grad_()
    y = moe_triton.moe_experts(x, index, w, module.gate_up_proj, module.down_proj, moe_triton.INTERPRETER_TILES,
                               fuse_router_grad=fuse)
    y.square().sum().backward()
    got = (y.detach(), x.grad, w.grad, module.gate_up_proj.grad, module.down_proj.grad)
    x2, w2 = x.detach().clone().requires_grad_(), weights.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    module.config._experts_implementation = "eager"
    y2 = module(x2, index, w2)
    y2.square().sum().backward()
    for a, b in zip(got, (y2.detach(), x2.grad, w2.grad, module.gate_up_proj.grad, module.down_proj.grad)):
        assert _rel(a, b) < 1e-5


def test_grouped_swiglu_on_pregrouped_rows_matches_the_torch_path():
    counts = torch.tensor([17, 0, 33, 1])
    module = _experts(24, 20, 4, seed=3)
    x = torch.randn(int(counts.sum()), 24, requires_grad=True)
    y = moe_triton.grouped_swiglu(x, module.gate_up_proj, module.down_proj, counts, moe_triton.INTERPRETER_TILES)
    y.square().sum().backward()
    got = (y.detach(), x.grad, module.gate_up_proj.grad, module.down_proj.grad)
    x2 = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    h = grouped_linear(x2, module.gate_up_proj, counts)
    y2 = grouped_linear(module._apply_gate(h), module.down_proj, counts)
    y2.square().sum().backward()
    for a, b in zip(got, (y2.detach(), x2.grad, module.gate_up_proj.grad, module.down_proj.grad)):
        assert _rel(a, b) < 1e-5


def test_grouped_swiglu_through_a_permutation_equals_permuting_around_it():
    """EP's regrouping fused into the GEMMs: ``perm`` reads and writes rows in place of two copies."""
    counts = torch.tensor([9, 0, 21, 3])
    module = _experts(24, 20, 4, seed=4)
    n = int(counts.sum())
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 24, requires_grad=True)
    grad = torch.randn(n, 24)
    tiles = moe_triton.INTERPRETER_TILES
    y = moe_triton.grouped_swiglu(x, module.gate_up_proj, module.down_proj, counts, tiles, perm=perm)
    y.backward(grad)
    got = (y.detach(), x.grad, module.gate_up_proj.grad.clone(), module.down_proj.grad.clone())
    module.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n)
    y2 = moe_triton.grouped_swiglu(x2[perm], module.gate_up_proj, module.down_proj, counts, tiles)[inverse]
    y2.backward(grad)
    for a, b in zip(got, (y2.detach(), x2.grad, module.gate_up_proj.grad, module.down_proj.grad)):
        assert _rel(a, b) < 1e-6


def test_frozen_experts_skip_their_weight_gradients_and_keep_the_input_gradient(monkeypatch):
    """Fine-tuning with frozen experts: no weight-gradient GEMM runs, and the input and router gradients are the
    same as with trainable experts."""
    tokens, hidden, inter, experts, top_k, dead = SHAPES[0]
    module = _experts(hidden, inter, experts, seed=5)
    index, weights = _routing(tokens, experts, top_k, dead, seed=5)
    x = torch.randn(tokens, hidden)
    tiles = moe_triton.INTERPRETER_TILES

    def grads():
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        moe_triton.moe_experts(xi, index, wi, module.gate_up_proj, module.down_proj, tiles).square().sum().backward()
        return xi.grad, wi.grad

    trainable = grads()
    module.zero_grad(set_to_none=True)
    module.requires_grad_(False)
    calls = []
    real = moe_triton.k_gemm
    monkeypatch.setattr(moe_triton, "k_gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    frozen = grads()
    assert calls == [] and module.gate_up_proj.grad is None
    for a, b in zip(frozen, trainable):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused_router_grad", "materialised_dy"])
def test_triton_experts_keep_no_activation_for_backward(fuse):
    """What the kernels keep per layer: the input, the router weights, ``h = [gate | up]``, the expert outputs (for
    the router gradient) and int32 routing; the activation ``silu(gate) * up`` (``rows × I``) is recomputed."""
    tokens, hidden, inter, experts, top_k, dead = SHAPES[0]
    module = _experts(hidden, inter, experts, seed=6)
    index, weights = _routing(tokens, experts, top_k, dead, seed=6)
    x, w = torch.randn(tokens, hidden, requires_grad=True), weights.clone().requires_grad_()
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        moe_triton.moe_experts(x, index, w, module.gate_up_proj, module.down_proj, moe_triton.INTERPRETER_TILES,
                               fuse_router_grad=fuse)
    rows = tokens * top_k
    assert (rows, 2 * inter) in shapes and (rows, inter) not in shapes
    saved = parity.saved_for_backward_bytes(
        lambda: moe_triton.moe_experts(x, index, w, module.gate_up_proj, module.down_proj,
                                       moe_triton.INTERPRETER_TILES, fuse_router_grad=fuse),
        exclude=module.parameters())
    floats = tokens * hidden + tokens * top_k + rows * hidden + rows * 2 * inter  # x, weights, y, h
    ints = rows + rows + rows + 2 * experts  # src, slots, order, row_end and tile_end
    assert saved == 4 * (floats + ints)


def test_a_trainable_down_projection_alone_gets_the_recomputed_activations_gradient():
    """Input and gate/up frozen, down trainable (no ``dh`` GEMM to fuse the recomputation into): the down weight's
    gradient is the one a fully trainable step computes."""
    tokens, hidden, inter, experts, top_k, dead = SHAPES[0]
    module = _experts(hidden, inter, experts, seed=7)
    index, weights = _routing(tokens, experts, top_k, dead, seed=7)
    x = torch.randn(tokens, hidden)
    tiles = moe_triton.INTERPRETER_TILES

    def down_grad(x):
        module.zero_grad(set_to_none=True)
        y = moe_triton.moe_experts(x, index, weights, module.gate_up_proj, module.down_proj, tiles)
        y.square().sum().backward()
        return module.down_proj.grad

    full = down_grad(x.clone().requires_grad_())
    module.gate_up_proj.requires_grad_(False)
    alone = down_grad(x)
    assert module.gate_up_proj.grad is None
    assert _rel(alone, full) < 1e-6


def test_a_rank_that_receives_no_rows_gets_empty_outputs_and_zero_weight_gradients():
    module = _experts(16, 8, 4, seed=2)  # under EP a rank can receive no token at all
    x = torch.zeros(0, 16, requires_grad=True)
    y = moe_triton.grouped_swiglu(x, module.gate_up_proj, module.down_proj, torch.zeros(4, dtype=torch.long),
                                  moe_triton.INTERPRETER_TILES)
    (y.sum() + 0 * module.gate_up_proj.sum() + 0 * module.down_proj.sum()).backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16)
    assert not module.gate_up_proj.grad.any() and not module.down_proj.grad.any()


def test_torch_is_the_default_and_triton_refuses_experts_it_cannot_run():
    module = _experts(16, 8, 4, seed=0)
    x = torch.zeros(3, 16)
    assert standard_swiglu(module)
    assert triton_module_for(module, x, module.down_proj) is None  # the default: the exact torch path
    set_experts_kernels(module, "triton")
    assert triton_module_for(module, x, module.down_proj) is moe_triton
    with pytest.raises(KernelError, match="matching dtypes"):
        triton_module_for(module, x.double(), module.down_proj)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        with pytest.raises(KernelError, match="run on CUDA tensors"):
            triton_module_for(module, x, module.down_proj)
    cfg = parity.tiny_config("gpt_oss")  # transposed, biased, custom gate: not the kernels' layout
    gpt_oss = parity.build_model(cfg, experts_implementation=EXPERTS_IMPLEMENTATION)
    # refused when the kernels are chosen, naming the class, before any module is changed
    with pytest.raises(KernelError, match="GptOssExperts.*keep kernels='torch'"):
        set_experts_kernels(gpt_oss, "triton")
    assert not any(getattr(m, "_xpar_kernels", None) for m in gpt_oss.modules())
    with pytest.raises(KernelError, match="kernels must be one of"):
        set_experts_kernels(gpt_oss, "cuda")
