"""Expert parallelism: the ``experts`` style.

Registered in transformers' ``ExpertsInterface`` as ``"xpar_zoo"``, so any experts class decorated with
``@use_experts_implementation`` runs through here without touching the modeling file. Per layer: sort the (token,
k) pairs by expert; with EP, all-to-all each row to the rank owning its expert; two grouped GEMMs with the
activation between; with EP, all-to-all back; unsort, weight by the router and sum over k.

Kernels per module (:func:`set_experts_kernels`): ``"torch"`` (the default; ``grouped_mm`` where it applies, else
an exact per-expert loop) or ``"triton"`` (:mod:`xpar_zoo.kernels.moe_triton`, SwiGLU experts in transformers' standard
layout). Design: ``docs/design.md``, "EP dispatch".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface

from ..compat import applies_default_gate, apply_gate
from ..errors import KernelError
from ..kernels import triton_runs_on
from ..parallel.collectives import all_to_all, all_to_all_counts, to_local
from ..zoo.plan import WRAPPED_ATTR, is_fused_experts
from .routes import fixed_routes

if TYPE_CHECKING:  # the experts path imports nothing of FSDP's (the GPU bench runs it on an older torch)
    from ..kernels.moe_triton import Tiles
    from ..parallel.mesh import PlanShard

EXPERTS_IMPLEMENTATION = "xpar_zoo"
KERNELS = ("torch", "triton")

# What this style keeps on an experts module, each attribute named once here: set with setattr (nn.Module types
# attributes set with `.` as tensors or modules), read with getattr and a default. (Fixed routes: styles/routes.py.)
_EP, _KERNELS, _TILES, _ADAPTERS = "_xpar_ep", "_xpar_kernels", "_xpar_tiles", "_xpar_adapters"


@functools.cache
def _triton_module():
    try:
        from ..kernels import moe_triton
    except ModuleNotFoundError:  # no triton (e.g. a CPU-only install): the torch path
        return None
    return moe_triton


def _default_silu_gate(module: nn.Module) -> bool:
    """Whether an experts module's activation is transformers' default gate (``silu(gate) * up`` on ``[gate;up]``)."""
    return (getattr(module, "has_gate", True)
            and applies_default_gate(type(module))
            and isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU)))


def recomputes_activation(module: nn.Module) -> bool:
    """Whether an experts module's backward recomputes its activation from ``[gate; up]`` (transformers' default
    SwiGLU gate: only ``[gate; up]`` is kept); another gate runs under autograd, which keeps its intermediates."""
    return _default_silu_gate(module)


def standard_swiglu(module: nn.Module) -> bool:
    """Whether an experts module is plain SwiGLU in transformers' standard layout (what the Triton kernels do)."""
    return (_default_silu_gate(module) and not getattr(module, "has_bias", False)
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_post_expert_norm", False))


def triton_module_for(module: nn.Module, x: torch.Tensor, weight: torch.Tensor):
    """The Triton module when this module's experts are set to ``"triton"``, else ``None``; the inputs' dtype and
    device are checked here (the module's layout and Triton itself when the kernels were chosen)."""
    if getattr(module, _KERNELS, "torch") != "triton":
        return None
    if _adapters(module):
        raise KernelError(f"{type(module).__name__}: the Triton experts kernels do not run expert adapters (LoRA); "
                          "keep kernels='torch' for this model")
    if x.dtype != weight.dtype:
        raise KernelError(f"{type(module).__name__}: the Triton experts kernels need matching dtypes (got {x.dtype} "
                          f"rows, {weight.dtype} weights)")
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):  # fp32 tl.dot would round through TF32
        raise KernelError(f"{type(module).__name__}: the Triton experts kernels run bf16 or fp16 on CUDA (got "
                          f"{x.dtype}); fp32 experts stay on the exact torch path")
    if not triton_runs_on(x):
        raise KernelError(f"{type(module).__name__}: the Triton experts kernels run on CUDA tensors (on the CPU only "
                          f"under TRITON_INTERPRET=1, for tests); these are on {x.device}")
    return _triton_module()


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every fused experts module of ``model`` (a 3-D ``down_proj`` parameter: transformers' ``[E, H, I]``)."""
    return [m for m in model.modules() if is_fused_experts(m)]


def set_experts_kernels(model: nn.Module, kernels: str, tiles: Tiles | None = None) -> int:
    """Choose the kernels of every fused experts module in ``model``: ``"torch"`` (the default: grouped_mm and torch
    routing, exact on the CPU) or ``"triton"`` (:mod:`xpar_zoo.kernels.moe_triton`; on the CPU it needs
    ``TRITON_INTERPRET=1``, which is how the tests run it). ``tiles``: a :class:`xpar_zoo.kernels.moe_triton.Tiles`
    (default: its defaults on CUDA, small tiles under the interpreter). Raises :class:`~xpar_zoo.errors.KernelError`
    now, before any module is changed, when Triton is missing or an experts module is not plain SwiGLU in
    transformers' standard layout (the rows' dtype and device are checked at the forward).

    Triton is opt-in until the H200 bench (``bench/gpu_moe.py``) has compiled, checked and timed the kernels on a
    GPU; the CPU interpreter proves their arithmetic, not their speed. Returns the number of modules set."""
    if kernels not in KERNELS:
        raise KernelError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    experts = experts_modules(model)
    if kernels == "triton":
        if _triton_module() is None:
            raise KernelError("the Triton experts kernels need Triton (pip install xpar_zoo[triton]; CUDA builds of "
                              "torch bring it)")
        odd = sorted({type(m).__name__ for m in experts
                      if not standard_swiglu(m) or _adapters(m)})
        if odd:
            raise KernelError(f"the Triton experts kernels run plain SwiGLU experts in transformers' standard layout "
                              f"(gate_up_proj [E, 2I, H], down_proj [E, H, I], no biases, the default gate); {odd} "
                              "are not, or carry expert adapters (LoRA): keep kernels='torch' for this model")
    for module in experts:
        setattr(module, _KERNELS, kernels)
        setattr(module, _TILES, tiles)
    return len(experts)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` takes these operands: bf16 on CUDA, bf16 or fp32 on CPU (where it
    is bit-identical to the per-expert loop and several times faster), rows and columns 16-byte aligned."""
    if not hasattr(F, "grouped_mm") or x.shape[0] == 0 or x.dtype != w.dtype:
        return False
    if x.is_cuda:
        ok = x.dtype == torch.bfloat16
    else:
        ok = x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
    align = 16 // x.element_size()
    return ok and x.shape[-1] % align == 0 and w.shape[-1] % align == 0 and w.shape[-2] % align == 0


def _dense_rows(grad: torch.Tensor) -> torch.Tensor:
    # grouped_mm's backward refuses gradients with zero or unusual strides (e.g. from a sum): make them row-major.
    if grad.dim() == 2 and grad.stride() == (grad.shape[1], 1):
        return grad
    return grad.new_empty(grad.shape).copy_(grad)


def grouped_mm_loop(x: torch.Tensor, w_in_out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The exact reference: one ``mm`` per group (``w_in_out`` is ``[G, in, out]``). Always touches group 0 so the
    weight joins the graph (its gradient exists) even when no row arrives."""
    pieces, start = [], 0
    for g, n in enumerate(counts.tolist()):
        if n or g == 0:
            pieces.append(x[start:start + n] @ w_in_out[g])
        start += n
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    if bias is None:
        return out
    return out + torch.repeat_interleave(bias, counts, dim=0, output_size=out.shape[0])


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, transposed: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of ``x`` sorted by group, ``counts[g]`` rows for group ``g``; ``y[rows of g] = x[rows] @ W_g^T (+ b_g)``.

    ``weight`` is ``[G, out, in]`` (``[G, in, out]`` when ``transposed``); ``bias`` is ``[G, out]``. Uses
    ``grouped_mm`` where it applies (no host sync), else :func:`grouped_mm_loop`."""
    w_in_out = weight if transposed else weight.transpose(-2, -1)  # [G, in, out]
    if grouped_mm_supported(x, weight):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        out = F.grouped_mm(x.contiguous(), w_in_out, offs=offs)
        if out.requires_grad:
            out.register_hook(_dense_rows)
    else:
        out = grouped_mm_loop(x, w_in_out, counts)
    return _add_bias(out, bias, counts)


def _silu_gate(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operands of transformers' default gate on ``h = [gate; up]``: ``(gate, up, silu(gate))``; the gate's
    output is ``silu(gate) * up``, made only where it is needed."""
    gate, up = h.chunk(2, dim=-1)
    return gate, up, F.silu(gate)


def _silu_gate_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, silu: torch.Tensor) -> torch.Tensor:
    """``d h`` of the default gate ``silu(gate) * up`` (autograd's own formulas for ``silu`` and ``mul``, on the same
    operands)."""
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * silu], dim=-1)


class SiluGate(torch.autograd.Function):
    """``silu(gate) * up`` of ``h = [gate; up]`` (transformers' default gate) keeping only ``h`` for backward, where
    ``silu(gate)`` is recomputed: autograd's own graph of the same two ops keeps ``silu(gate)`` as well, a
    ``[rows, I]`` tensor per layer for the whole step. Forward and gradients are bit-identical to that graph's (the
    same ops on the same operands). The path of the per-expert loop; :class:`GatedDown` is grouped_mm's."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        _, up, silu = _silu_gate(h)
        return silu * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return _silu_gate_backward(grad, *_silu_gate(h))


class GatedDown(torch.autograd.Function):
    """The default gate and the down projection in one: ``grouped_mm(silu(gate) * up, W)`` for ``h = [gate; up]``
    and ``W = w_in_out [G, I, H]``, keeping only ``h`` (and the weight) for backward, where ``silu(gate) * up`` is
    recomputed (two elementwise passes): autograd's graph of the same ops keeps ``silu(gate)`` and the gate's output
    as well, two ``[rows, I]`` tensors per layer for the whole step. The backward runs grouped_mm's own gradient
    formulas, so forward and gradients are bit-identical to that graph's."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w_in_out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        ctx.save_for_backward(h, w_in_out, offs)
        _, up, silu = _silu_gate(h)
        return F.grouped_mm(silu * up, w_in_out, offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, w_in_out, offs = ctx.saved_tensors
        grad = _dense_rows(grad)
        gate, up, silu = _silu_gate(h)
        grad_w = None
        if ctx.needs_input_grad[1]:  # in the weight's own layout, as autograd's _grouped_mm_mat2_backward does
            act = silu * up  # recomputed only for the weight's gradient (frozen experts skip it)
            if w_in_out.stride(-2) == 1 and w_in_out.stride(-1) != 1:  # column-major: transformers' [G, out, in]
                grad_w = F.grouped_mm(grad.t(), act, offs=offs).transpose(-2, -1)
            else:
                grad_w = F.grouped_mm(act.t(), grad, offs=offs)
            del act
        grad_act = F.grouped_mm(grad, w_in_out.transpose(-2, -1), offs=offs)
        return _silu_gate_backward(grad_act, gate, up, silu), grad_w, None


def _adapted(out: torch.Tensor, adapter, x: torch.Tensor, counts: torch.Tensor, first: int, num: int) -> torch.Tensor:
    """``out`` plus an expert adapter's contribution for rows ``x`` grouped by local expert (see
    :func:`install_expert_adapter`); the adapter returns ``None`` while it is disabled."""
    delta = adapter(x, counts, first, num) if adapter is not None else None
    return out if delta is None else out + delta.to(out.dtype)


def _experts_mlp(module: nn.Module, x: torch.Tensor, counts: torch.Tensor, first: int, num: int,
                 triton_path=None, tiles=None, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The expert MLPs for rows grouped by local expert (``counts`` rows each), experts ``first … first+num-1``;
    with ``triton_path`` (:mod:`xpar_zoo.kernels.moe_triton`) through its kernels, where with ``perm`` grouped row ``s`` is
    ``x[perm[s]]`` and its output goes to row ``perm[s]``."""
    has_gate = getattr(module, "has_gate", True)
    has_bias = getattr(module, "has_bias", False)
    transposed = getattr(module, "is_transposed", False)
    up_name = "gate_up_proj" if has_gate else "up_proj"
    up_w, down_w = _local(module, up_name), _local(module, "down_proj")
    up_b = _local(module, f"{up_name}_bias") if has_bias else None
    down_b = _local(module, "down_proj_bias") if has_bias else None
    if up_w.shape[0] != num:  # not EP-sharded: every expert is local
        up_w, down_w = up_w[first:first + num], down_w[first:first + num]
        up_b = up_b[first:first + num] if up_b is not None else None
        down_b = down_b[first:first + num] if down_b is not None else None
    if triton_path is not None:
        return triton_path.grouped_swiglu(x, up_w, down_w, counts, tiles, perm=perm)
    adapters = _adapters(module)
    h = _adapted(grouped_linear(x, up_w, counts, transposed=transposed, bias=up_b), adapters.get(up_name),
                 x, counts, first, num)
    if "down_proj" in adapters:  # the adapter needs the activation itself
        act = (SiluGate.apply(h) if _default_silu_gate(module) and h.requires_grad
               else apply_gate(module, h) if has_gate else _submodule(module, "act_fn")(h))
        y = _adapted(grouped_linear(act, down_w, counts, transposed=transposed, bias=down_b), adapters["down_proj"],
                     act, counts, first, num)
    elif _default_silu_gate(module) and h.requires_grad:
        # keep only h for backward (the activation is recomputed); under autocast autograd's own graph keeps the
        # dtypes autocast chose, so GatedDown (whose backward recomputes in h's dtype) stays out of it
        if grouped_mm_supported(h, down_w) and not torch.is_autocast_enabled(h.device.type):
            y = GatedDown.apply(h, down_w if transposed else down_w.transpose(-2, -1), counts)
            y = _add_bias(y, down_b, counts)
        else:
            y = grouped_linear(SiluGate.apply(h), down_w, counts, transposed=transposed, bias=down_b)
    else:
        h = apply_gate(module, h) if has_gate else _submodule(module, "act_fn")(h)
        y = grouped_linear(h, down_w, counts, transposed=transposed, bias=down_b)
    if getattr(module, "has_post_expert_norm", False):
        y = _submodule(module, "post_expert_norm")(y)
    return y


def _local(module: nn.Module, name: str) -> torch.Tensor:
    """This rank's part of the experts module's weight or bias ``name`` (its local experts under EP)."""
    return to_local(getattr(module, name))


def _submodule(module: nn.Module, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts module's activation (``act_fn``) or norm (``post_expert_norm``): a module or a function."""
    return getattr(module, name)


def _adapters(module: nn.Module) -> dict[str, ExpertAdapter]:
    """The expert adapters of ``module`` by projection (:func:`install_expert_adapter`); empty without."""
    return getattr(module, _ADAPTERS, None) or {}


def _tiles(module: nn.Module, triton_path, x: torch.Tensor):
    tiles = getattr(module, _TILES, None)
    if tiles is not None:
        return tiles
    return triton_path.Tiles() if x.is_cuda else triton_path.INTERPRETER_TILES


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _source_major_to_expert_major(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Rows arrive as ``[source rank][local expert]`` blocks of sizes ``recv[s, e]`` (``total`` rows); the index that
    reorders them as ``[local expert][source rank]``."""
    sizes = recv.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    order = torch.arange(sizes.numel(), device=recv.device).view_as(recv).t().reshape(-1)
    sizes_e, starts_e = sizes[order], starts[order]
    # position p inside the output block b maps to starts_e[b] + (p - block_start_e[b])
    block_start_e = torch.cumsum(sizes_e, 0) - sizes_e
    shift = torch.repeat_interleave(starts_e - block_start_e, sizes_e, output_size=total)
    return torch.arange(total, device=recv.device) + shift


def _route_counts(module: nn.Module, flat: torch.Tensor, num_experts: int, ep: PlanShard | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, list[int], list[int]]:
    """``(rows per expert, [source rank, local expert] rows received, send splits, receive splits)`` of the routed
    (token, k) pairs ``flat``: counted (with EP, exchanged: one host sync), or where the module has fixed routes
    (:class:`~xpar_zoo.styles.routes.Routes`, a simulated run) taken from them."""
    routes = fixed_routes(module)
    size, local = (ep.size, ep.rows) if ep else (1, num_experts)
    if routes is not None:
        sent, received = routes.expert_counts(flat.numel(), size, local)
        device = flat.device
        return (torch.tensor(sent, device=device), torch.tensor(received, device=device) if ep else None,
                [sum(sent[i * local:(i + 1) * local]) for i in range(size)], [sum(r) for r in received])
    counts = torch.bincount(flat, minlength=num_experts)
    if ep is None:
        return counts, None, [], []
    send = counts.view(ep.size, ep.rows)
    recv = all_to_all_counts(send, ep.group)
    return counts, recv, send.sum(1).tolist(), recv.sum(1).tolist()


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``ExpertsInterface`` entry: the MoE experts of one layer for ``hidden_states [T, H]`` routed by
    ``top_k_index / top_k_weights [T, k]``, with expert parallelism when the module has an EP group."""
    ep: PlanShard | None = getattr(self, _EP, None)
    num_tokens, top_k = top_k_index.shape
    down = _local(self, "down_proj")
    num_experts = down.shape[0] * (ep.size if ep else 1)
    triton_path = triton_module_for(self, hidden_states, down)
    tiles = _tiles(self, triton_path, hidden_states) if triton_path is not None else None
    if ep is None and triton_path is not None:  # routing, permute and unpermute fused into the kernels
        out = triton_path.moe_experts(hidden_states, top_k_index, top_k_weights, _local(self, "gate_up_proj"),
                                      down, tiles)
        return out.to(hidden_states.dtype)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts, recv, send_splits, recv_splits = _route_counts(self, flat, num_experts, ep)
    rows = hidden_states[order // top_k]
    if ep is None:
        out = _experts_mlp(self, rows, counts, 0, num_experts)
    else:
        assert recv is not None  # _route_counts receives rows under EP
        received = all_to_all(rows, recv_splits, send_splits, ep.group)
        regroup = _source_major_to_expert_major(recv, sum(recv_splits))
        if triton_path is not None:  # the regrouping happens inside the GEMMs' loads and stores
            out = _experts_mlp(self, received, recv.sum(0), ep.offset, ep.rows, triton_path, tiles, perm=regroup)
        else:
            out = _experts_mlp(self, received[regroup], recv.sum(0), ep.offset, ep.rows)[_inverse(regroup)]
        out = all_to_all(out, send_splits, recv_splits, ep.group)
    if triton_path is not None:
        slots = _inverse(order).to(torch.int32).view(num_tokens, top_k)
        out = triton_path.Combine.apply(out, top_k_weights, slots, order.to(torch.int32), tiles)
        return out.to(hidden_states.dtype)
    out = out[_inverse(order)] * top_k_weights.reshape(-1, 1).to(out.dtype)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)


def install_expert_parallel(module: nn.Module, ep: PlanShard | None) -> None:
    """Give an experts module its EP group (``None``: all experts local); ``ep.rows`` experts live here. ``module``
    may be an adapter wrapper around the experts module (PEFT's ``ParamWrapper``): the group goes to every module of
    the chain."""
    chain: nn.Module | None = module
    while isinstance(chain, nn.Module):
        setattr(chain, _EP, ep)
        chain = getattr(chain, WRAPPED_ATTR, None)


ExpertAdapter = Callable[[torch.Tensor, torch.Tensor, int, int], "torch.Tensor | None"]


def install_expert_adapter(module: nn.Module, param: str, adapter: ExpertAdapter) -> None:
    """Add an adapter to the projection ``param`` (``gate_up_proj``, ``up_proj`` or ``down_proj``) of an experts
    module: ``adapter(rows, counts, first, num)`` gets the projection's input rows grouped by local expert
    (``counts[g]`` rows for expert ``first + g``, ``num`` experts) and returns what to add to its output (or
    ``None``, e.g. while disabled). It runs inside the same EP dispatch, after the grouped GEMM
    (:func:`grouped_linear` serves it as well). The Triton kernels refuse such modules."""
    adapters = dict(_adapters(module))
    adapters[param] = adapter
    setattr(module, _ADAPTERS, adapters)
