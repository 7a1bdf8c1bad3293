"""The GPU experts path: SwiGLU expert MLPs as Triton grouped GEMMs, with the permute and unpermute fused in.

For rows sorted by expert, four kernels do all the work of one MoE layer, forward and backward, with no padding,
no host sync and no transposed weight copies:

- ``_rows_gemm``: ``C[rows of g] = A[rows of g] @ B_g`` for every group, rows optionally gathered, with SwiGLU
  forward / backward epilogues;
- ``_k_gemm``: the weight gradients, written straight into the weight's own layout;
- ``_gather_sum``: the unpermute with the router weights (or a gather's gradient);
- ``_combine_backward``: the router weights' gradient in one pass over the rows.

Used by :mod:`xpar_zoo.styles.experts` when a model's experts are set to ``"triton"`` (:func:`xpar_zoo.styles.experts.set_experts_kernels`);
runs under ``TRITON_INTERPRET=1`` on the CPU, which is how the tests check it. Details: ``docs/design.md``, "The
Triton experts kernels".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..environment import triton_interpreter

if triton_interpreter() and type(tl.sum).__name__ != "InterpretedFunction":
    raise ImportError("TRITON_INTERPRET=1 was set after Triton was first imported (transformers imports it early): "
                      "set it in the environment before Python starts")

# --------------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _group_of_tile(tile_end_ptr, row_end_ptr, pid, G, G_P2: tl.constexpr):
    """(group, first row of the group, one past its last row, first tile of the group) for M-tile ``pid``; group is
    ``G`` when ``pid`` is past the last tile."""
    ge = tl.arange(0, G_P2)
    tile_end = tl.load(tile_end_ptr + ge, mask=ge < G, other=2147483647)
    g = tl.sum((tile_end <= pid).to(tl.int32), axis=0)
    gc = tl.minimum(g, G - 1)
    has_prev = gc > 0
    prev = tl.maximum(gc - 1, 0)
    tile_lo = tl.where(has_prev, tl.load(tile_end_ptr + prev), 0)
    row_lo = tl.where(has_prev, tl.load(row_end_ptr + prev), 0)
    row_hi = tl.load(row_end_ptr + gc)
    return g, row_lo, row_hi, tile_lo


@triton.jit
def _swiglu(gate, up):
    """``silu(gate) * up`` in fp32: the forward's activation and the backward's recomputation of it, one formula."""
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _rows_gemm(
    a_ptr, src_ptr, stride_am, stride_ak,
    b_ptr, stride_bg, stride_bk, stride_bn,
    c_ptr, stride_cm, stride_cn,
    h_ptr, stride_hm, stride_hn, scale_ptr, dst_ptr, act_ptr, stride_actm,
    row_end_ptr, tile_end_ptr, G, N, K,
    GATHER: tl.constexpr, ROW_SCALE: tl.constexpr, SCATTER: tl.constexpr, EPILOGUE: tl.constexpr,
    ACT_OUT: tl.constexpr, G_P2: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # EPILOGUE 0: C = A @ B_g.  1: SwiGLU forward, B_g has 2N columns [gate | up]; h = [A@B_gate | A@B_up],
    # C = silu(gate) * up of h as stored (rounded to h's dtype), so that the backward can recompute C exactly.
    # 2: SwiGLU backward, acc = dA; reads h, writes C = [d gate | d up] and (ACT_OUT) act = silu(gate) * up.
    # ROW_SCALE: row r of A is taken times scale[r] (applied to the accumulator: (diag(s) A) B = diag(s) (A B)).
    # SCATTER: row r of C is stored at row dst[r] (h stays in grouped order).
    # N-tiles vary fastest: the programs resident at once share a few A row-tiles and one expert's B, both in L2.
    num_n = tl.cdiv(N, BN)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    g, row_lo, row_hi, tile_lo = _group_of_tile(tile_end_ptr, row_end_ptr, pid_m, G, G_P2)
    if g < G:
        rm = row_lo + (pid_m - tile_lo) * BM + tl.arange(0, BM)
        m_mask = rm < row_hi
        if GATHER:
            src = tl.load(src_ptr + rm, mask=m_mask, other=0).to(tl.int64)
        else:
            src = rm.to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        rk = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + g.to(tl.int64) * stride_bg + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            k_mask = rk < K - k * BK
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            if EPILOGUE == 1:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc_up = tl.dot(a, b_up, acc_up)
            a_ptrs += BK * stride_ak
            b_ptrs += BK * stride_bk
        if ROW_SCALE:
            acc = acc * tl.load(scale_ptr + rm, mask=m_mask, other=0.0).to(tl.float32)[:, None]
        rows = rm.to(tl.int64)[:, None]
        mask = m_mask[:, None] & n_mask[None, :]
        if SCATTER:
            c_rows = tl.load(dst_ptr + rm, mask=m_mask, other=0).to(tl.int64)[:, None]
        else:
            c_rows = rows
        c_ptrs = c_ptr + c_rows * stride_cm + rn[None, :] * stride_cn
        if EPILOGUE == 0:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        elif EPILOGUE == 1:
            h_ptrs = h_ptr + rows * stride_hm + rn[None, :] * stride_hn
            gate = acc.to(h_ptr.dtype.element_ty)
            up = acc_up.to(h_ptr.dtype.element_ty)
            tl.store(h_ptrs, gate, mask=mask)
            tl.store(h_ptrs + N * stride_hn, up, mask=mask)
            act = _swiglu(gate.to(tl.float32), up.to(tl.float32))
            tl.store(c_ptrs, act.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            h_ptrs = h_ptr + rows * stride_hm + rn[None, :] * stride_hn
            gate = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptrs + N * stride_hn, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            if ACT_OUT:  # first: stored after the gradients, sm_90 code holds ~250 registers a thread, not ~135
                act_ptrs = act_ptr + rows * stride_actm + rn[None, :]
                tl.store(act_ptrs, _swiglu(gate, up).to(act_ptr.dtype.element_ty), mask=mask)
            d_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
            d_up = acc * gate * sig
            tl.store(c_ptrs, d_gate.to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(c_ptrs + N * stride_cn, d_up.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _k_gemm(
    l_ptr, l_src_ptr, l_scale_ptr, stride_ls, stride_lp,
    r_ptr, src_ptr, stride_rs, stride_rq,
    o_ptr, stride_og, stride_op, stride_oq,
    row_end_ptr, P, Q,
    GATHER: tl.constexpr, L_GATHER: tl.constexpr, L_SCALE: tl.constexpr,
    BP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
):
    # O_g[p, q] = sum over rows s of group g of L[s, p] * R[s, q], where R[s] = R[src[s]] when GATHER and
    # L[s] = L[l_src[s]] (L_GATHER) times l_scale[s] (L_SCALE, rounded back to L's dtype as a stored copy would be)
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_q = tl.cdiv(Q, BQ)
    rp = (pid // num_q) * BP + tl.arange(0, BP)
    rq = (pid % num_q) * BQ + tl.arange(0, BQ)
    p_mask = rp < P
    q_mask = rq < Q
    row_lo = tl.where(g > 0, tl.load(row_end_ptr + tl.maximum(g - 1, 0)), 0)
    row_hi = tl.load(row_end_ptr + g)
    rs = tl.arange(0, BK)
    acc = tl.zeros((BP, BQ), dtype=tl.float32)
    for s0 in range(row_lo, row_hi, BK):
        s = s0 + rs
        s_mask = s < row_hi
        if GATHER:
            r_rows = tl.load(src_ptr + s, mask=s_mask, other=0).to(tl.int64)
        else:
            r_rows = s.to(tl.int64)
        if L_GATHER:
            l_rows = tl.load(l_src_ptr + s, mask=s_mask, other=0).to(tl.int64)
        else:
            l_rows = s.to(tl.int64)
        lt = tl.load(l_ptr + l_rows[None, :] * stride_ls + rp[:, None] * stride_lp,
                     mask=p_mask[:, None] & s_mask[None, :], other=0.0)
        if L_SCALE:
            scale = tl.load(l_scale_ptr + s, mask=s_mask, other=0.0).to(tl.float32)
            lt = (lt.to(tl.float32) * scale[None, :]).to(l_ptr.dtype.element_ty)
        r = tl.load(r_ptr + r_rows[:, None] * stride_rs + rq[None, :] * stride_rq,
                    mask=s_mask[:, None] & q_mask[None, :], other=0.0)
        acc = tl.dot(lt, r, acc)
    o_ptrs = o_ptr + g.to(tl.int64) * stride_og + rp[:, None] * stride_op + rq[None, :] * stride_oq
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])


@triton.jit
def _gather_sum(
    y_ptr, stride_ys, slots_ptr, w_ptr, out_ptr, stride_ot, H,
    TOP_K: tl.constexpr, HAS_W: tl.constexpr, BH: tl.constexpr,
):
    # out[t] = sum_j w[t, j] * y[slots[t, j]]   (w = 1 without HAS_W); fp32 accumulation
    t = tl.program_id(0)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    h_mask = rh < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in range(TOP_K):
        slot = tl.load(slots_ptr + t * TOP_K + j).to(tl.int64)
        y = tl.load(y_ptr + slot * stride_ys + rh, mask=h_mask, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        acc += y
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + rh, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _combine_backward(
    dout_ptr, stride_dt, y_ptr, stride_ys, order_ptr, w_ptr, dy_ptr, stride_dys, dw_ptr, H,
    TOP_K: tl.constexpr, WRITE_DY: tl.constexpr, BH: tl.constexpr,
):
    # row s holds slot order[s] = t * TOP_K + j:  dw[slot] = <dout[t], y[s]>;  dy[s] = w[slot] * dout[t] when
    # WRITE_DY (else the consumers of dy read dout through the same gather and scale)
    s = tl.program_id(0).to(tl.int64)
    slot = tl.load(order_ptr + s).to(tl.int64)
    t = slot // TOP_K
    w = tl.load(w_ptr + slot).to(tl.float32)
    dot = tl.zeros((BH,), dtype=tl.float32)
    for h0 in range(0, H, BH):
        rh = h0 + tl.arange(0, BH)
        h_mask = rh < H
        d = tl.load(dout_ptr + t * stride_dt + rh, mask=h_mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + s * stride_ys + rh, mask=h_mask, other=0.0).to(tl.float32)
        dot += d * y
        if WRITE_DY:
            tl.store(dy_ptr + s * stride_dys + rh, (d * w).to(dy_ptr.dtype.element_ty), mask=h_mask)
    tl.store(dw_ptr + slot, tl.sum(dot, axis=0).to(dw_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------------------------------
# launchers


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of the kernels (``bm × bn × bk`` for the row GEMMs, ``bp × bq × bk`` for the
    weight-gradient GEMMs, ``bh`` for the gather/combine passes)."""

    bm: int = 128
    bn: int = 128
    bn_swiglu: int = 64
    bk: int = 64
    bp: int = 128
    bq: int = 128
    bk_w: int = 64
    bh: int = 1024
    warps: int = 8
    stages: int = 3


#: Small tiles for the CPU interpreter (and tests that want many tiles per group).
INTERPRETER_TILES = Tiles(bm=16, bn=16, bn_swiglu=16, bk=16, bp=16, bq=16, bk_w=16, bh=32, warps=1, stages=1)


def _launch(kernel, grid, tiles: Tiles, *args, **meta):
    kernel[grid](*args, num_warps=tiles.warps, num_stages=tiles.stages, **meta)


def group_layout(counts: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_end, tile_end)``: cumulative rows and cumulative M-tiles of ``block_m`` rows per group (int32)."""
    counts = counts.to(torch.int32)
    row_end = torch.cumsum(counts, 0, dtype=torch.int32)
    tile_end = torch.cumsum((counts + block_m - 1) // block_m, 0, dtype=torch.int32)
    return row_end, tile_end


def rows_gemm(
    a: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int], n: int, k: int,
    row_end: torch.Tensor, tile_end: torch.Tensor, rows: int, tiles: Tiles, *,
    src: torch.Tensor | None = None, scale: torch.Tensor | None = None, dst: torch.Tensor | None = None,
    epilogue: int = 0, h: torch.Tensor | None = None, act_out: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Grouped ``A @ B_g`` over ``rows`` output rows (``A`` rows gathered through ``src`` and scaled by ``scale``,
    output row ``r`` stored at ``dst[r]``); see :func:`_rows_gemm`. ``b_strides`` = (group, k, n). Returns ``C``;
    ``(C, h)`` for the SwiGLU forward; ``(C, act)`` for the SwiGLU backward with ``act_out``."""
    groups = row_end.numel()
    out_cols = 2 * n if epilogue == 2 else n
    c = torch.empty(rows, out_cols, device=a.device, dtype=a.dtype)
    if epilogue == 1:
        h = torch.empty(rows, 2 * n, device=a.device, dtype=a.dtype)
    act = torch.empty(rows, n, device=a.device, dtype=h.dtype) if epilogue == 2 and act_out else None
    bn = tiles.bn_swiglu if epilogue else tiles.bn
    if rows:
        grid = ((triton.cdiv(rows, tiles.bm) + groups) * triton.cdiv(n, bn),)
        hh = h if h is not None else c
        aa = act if act is not None else c
        _launch(_rows_gemm, grid, tiles,
                a, src if src is not None else row_end, a.stride(0), a.stride(1),
                b, *b_strides, c, c.stride(0), c.stride(1), hh, hh.stride(0), hh.stride(1),
                scale if scale is not None else c, dst if dst is not None else row_end, aa, aa.stride(0),
                row_end, tile_end, groups, n, k,
                GATHER=src is not None, ROW_SCALE=scale is not None, SCATTER=dst is not None, EPILOGUE=epilogue,
                ACT_OUT=act is not None, G_P2=triton.next_power_of_2(groups), BM=tiles.bm, BN=bn, BK=tiles.bk)
    if epilogue == 1:
        return c, h
    return (c, act) if act is not None else c


def k_gemm(
    left: torch.Tensor, right: torch.Tensor, out_shape: tuple[int, int, int], row_end: torch.Tensor, tiles: Tiles,
    dtype: torch.dtype, *, src: torch.Tensor | None = None, left_src: torch.Tensor | None = None,
    left_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-group ``left_g^T @ right_g`` as a ``[G, P, Q]`` tensor (the weight's own layout): ``right`` rows gathered
    through ``src``, ``left`` rows through ``left_src`` and scaled by ``left_scale``."""
    groups, p, q = out_shape
    out = torch.empty(groups, p, q, device=left.device, dtype=dtype)
    grid = (triton.cdiv(p, tiles.bp) * triton.cdiv(q, tiles.bq), groups)
    _launch(_k_gemm, grid, tiles,
            left, left_src if left_src is not None else row_end, left_scale if left_scale is not None else left,
            left.stride(0), left.stride(1), right, src if src is not None else row_end,
            right.stride(0), right.stride(1), out, out.stride(0), out.stride(1), out.stride(2), row_end, p, q,
            GATHER=src is not None, L_GATHER=left_src is not None, L_SCALE=left_scale is not None,
            BP=tiles.bp, BQ=tiles.bq, BK=tiles.bk_w)
    return out


def gather_sum(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None, tiles: Tiles,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[slots[t, j]]`` (fp32 accumulation)."""
    tokens, top_k = slots.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, device=y.device, dtype=out_dtype)
    if tokens:
        bh = min(tiles.bh, triton.next_power_of_2(hidden))
        _launch(_gather_sum, (tokens, triton.cdiv(hidden, bh)), tiles,
                y, y.stride(0), slots, weights if weights is not None else slots, out, out.stride(0), hidden,
                TOP_K=top_k, HAS_W=weights is not None, BH=bh)
    return out


def combine_backward(dout: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                     tiles: Tiles, *, write_dy: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(dy, dw)`` of :func:`gather_sum` with (contiguous) weights (``dy`` only when ``write_dy``); ``dw`` in
    fp32."""
    top_k = weights.shape[-1]
    dy = torch.empty_like(y) if write_dy else None
    dw = torch.empty(weights.numel(), device=y.device, dtype=torch.float32)
    hidden = y.shape[1]
    if y.shape[0]:
        bh = min(tiles.bh, triton.next_power_of_2(hidden))
        target = dy if dy is not None else y
        _launch(_combine_backward, (y.shape[0],), tiles,
                dout, dout.stride(0), y, y.stride(0), order, weights, target, target.stride(0), dw,
                hidden, TOP_K=top_k, WRITE_DY=write_dy, BH=bh)
    return dy, dw.view_as(weights)


# --------------------------------------------------------------------------------------------------------------------
# autograd


def transposed(w: torch.Tensor) -> tuple[int, int, int]:
    """``b_strides`` that read ``B_g = w[g]^T`` (``w`` is ``[G, N, K]``, transformers' ``[E, out, in]``)."""
    return w.stride(0), w.stride(2), w.stride(1)


def as_is(w: torch.Tensor) -> tuple[int, int, int]:
    """``b_strides`` that read ``B_g = w[g]`` (``w`` is ``[G, K, N]``)."""
    return w.stride(0), w.stride(1), w.stride(2)


def route(top_k_index: torch.Tensor, num_experts: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing on the device, no host sync: ``order`` (row ``s`` of the expert-sorted rows serves slot
    ``order[s] = t * k + j``), ``counts`` per expert, ``src`` (the token of each row) and ``slots [T, k]`` (the row
    of each slot, the inverse of ``order``); all int32."""
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # counted by scatter-add, not bincount: bincount sizes its output from max(flat), a host sync on CUDA
    counts = torch.zeros(num_experts, device=flat.device, dtype=torch.int32)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    slots = torch.empty_like(order, dtype=torch.int32)
    slots[order] = torch.arange(order.numel(), device=order.device, dtype=torch.int32)
    order = order.to(torch.int32)
    return order, counts, torch.div(order, top_k, rounding_mode="floor"), slots.view(tokens, top_k)


def _mlp_forward(x, gate_up, down, counts, src, tiles, dst=None):
    """``y`` and what the backward needs: the SwiGLU expert MLPs of rows ``x[src[s]]`` (``x[s]``) grouped by expert,
    row ``s`` of ``y`` stored at ``dst[s]`` (at ``s``). The activation ``silu(gate) * up`` is not kept: the
    backward recomputes it from ``h = [gate | up]`` (``k·I`` values per token and layer fewer, as on the torch
    path)."""
    inter, hidden = down.shape[2], down.shape[1]
    rows = src.numel() if src is not None else x.shape[0]
    row_end, tile_end = group_layout(counts, tiles.bm)
    act, h = rows_gemm(x, gate_up, transposed(gate_up), inter, hidden, row_end, tile_end, rows, tiles, src=src, epilogue=1)
    y = rows_gemm(act, down, transposed(down), hidden, inter, row_end, tile_end, rows, tiles, dst=dst)
    return y, (row_end, tile_end, h)


def _recomputed_act(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` with torch ops, for the one backward with no ``dh`` GEMM to fuse
    it into (input and gate/up weights frozen, down trainable); equal to the kernels' to a few fp32 ulps."""
    gate, up = h.float().chunk(2, dim=1)
    return (gate * torch.sigmoid(gate) * up).to(h.dtype)


def _mlp_backward(dy, x, gate_up, down, src, slots, row_end, tile_end, h, tiles, dy_src=None, dy_scale=None,
                  *, permuted=False, need):
    """``(dx, d_gate_up, d_down)`` for output gradients ``dy`` (row ``s``'s: ``dy[dy_src[s]] * dy_scale[s]``);
    ``permuted``: ``src`` is a permutation, so ``dx`` rows are stored straight through it (no gather-sum). Only the
    gradients ``need`` asks for are computed (frozen experts skip both weight-gradient GEMMs). The activation the
    down weight's gradient needs is recomputed in the ``dh`` GEMM's epilogue, which reads ``h`` anyway, and lives
    only until that gradient is made."""
    need_x, need_gate_up, need_down = need
    experts, hidden, inter = down.shape
    rows = h.shape[0]
    dx = d_gate_up = d_down = dh = None
    if need_x or need_gate_up:
        out = rows_gemm(dy, down, as_is(down), inter, hidden, row_end, tile_end, rows, tiles, src=dy_src,
                        scale=dy_scale, epilogue=2, h=h, act_out=need_down)
        dh, act = out if need_down else (out, None)
    elif need_down:
        act = _recomputed_act(h)
    if need_down:
        d_down = k_gemm(dy, act, (experts, hidden, inter), row_end, tiles, down.dtype, left_src=dy_src,
                        left_scale=dy_scale)
        del act
    if dh is None:
        return dx, d_gate_up, d_down
    if need_gate_up:
        d_gate_up = k_gemm(dh, x, (experts, 2 * inter, hidden), row_end, tiles, gate_up.dtype, src=src)
    if need_x:
        dxs = rows_gemm(dh, gate_up, as_is(gate_up), hidden, 2 * inter, row_end, tile_end, rows, tiles,
                        dst=src if permuted else None)
        dx = gather_sum(dxs, slots, None, tiles, x.dtype) if src is not None and not permuted else dxs
    return dx, d_gate_up, d_down


class SwiGLUExperts(torch.autograd.Function):
    """``y[s] = (silu(x_s @ Wg_e^T) * (x_s @ Wu_e^T)) @ Wd_e^T`` for rows ``s`` grouped by expert ``e``, where
    ``x_s = x[src[s]]`` (or ``x[s]`` without ``src``) and ``gate_up = [E, 2I, H]``, ``down = [E, H, I]`` (the
    transformers layout). ``slots[t]`` lists the rows that read ``x[t]`` (the inverse of ``src``), so the input
    gradient is a gather, not a scatter. With ``perm`` (a permutation; no ``src``/``slots``) row ``s`` reads
    ``x[perm[s]]`` and is written to ``y[perm[s]]``: the MLP runs in grouped order on ungrouped buffers."""

    @staticmethod
    def forward(ctx, x, gate_up, down, counts, src, slots, tiles, perm=None):
        if perm is not None:
            src = perm
        y, saved = _mlp_forward(x, gate_up, down, counts, src, tiles, dst=perm)
        ctx.save_for_backward(x, gate_up, down, src, slots, *saved)
        ctx.tiles, ctx.permuted = tiles, perm is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate_up, down, src, *rest = ctx.saved_tensors
        grads = _mlp_backward(dy.contiguous(), x, gate_up, down, src, *rest, ctx.tiles,
                              dy_src=src if ctx.permuted else None, permuted=ctx.permuted,
                              need=ctx.needs_input_grad[:3])
        return *grads, None, None, None, None, None


class Combine(torch.autograd.Function):
    """``out[t] = sum_j w[t, j] * y[slots[t, j]]``; ``order[s]`` is the slot ``t * k + j`` that row ``s`` serves
    (the inverse of ``slots``)."""

    @staticmethod
    def forward(ctx, y, weights, slots, order, tiles):
        weights = weights.contiguous()
        ctx.save_for_backward(y, weights, order)
        ctx.tiles = tiles
        return gather_sum(y, slots, weights, tiles, y.dtype)

    @staticmethod
    def backward(ctx, dout):
        y, weights, order = ctx.saved_tensors
        dy, dw = combine_backward(dout.contiguous(), y, weights, order, ctx.tiles, write_dy=True)
        return dy, dw.to(weights.dtype), None, None, None


class RoutedSwiGLUExperts(torch.autograd.Function):
    """:class:`SwiGLUExperts` then :class:`Combine` as one function, so that the backward never materialises
    ``dy = w · dout[token]``: the two GEMMs that consume it gather ``dout`` rows and scale them by the router weight
    themselves."""

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, counts, src, slots, order, tiles):
        weights = weights.contiguous()
        y, saved = _mlp_forward(x, gate_up, down, counts, src, tiles)
        ctx.save_for_backward(x, weights, gate_up, down, src, slots, order, y, *saved)
        ctx.tiles = tiles
        return gather_sum(y, slots, weights, tiles, y.dtype)

    @staticmethod
    def backward(ctx, dout):
        x, weights, gate_up, down, src, slots, order, y, *saved = ctx.saved_tensors
        dout = dout.contiguous()
        _, dw = combine_backward(dout, y, weights, order, ctx.tiles, write_dy=False)
        row_weight = weights.reshape(-1)[order.long()]
        need = ctx.needs_input_grad
        dx, d_gate_up, d_down = _mlp_backward(dout, x, gate_up, down, src, slots, *saved, ctx.tiles,
                                              dy_src=src, dy_scale=row_weight, need=(need[0], need[2], need[3]))
        return dx, dw.to(weights.dtype), d_gate_up, d_down, None, None, None, None, None


def moe_experts(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, tiles: Tiles = Tiles(), *, fuse_router_grad: bool = True,
) -> torch.Tensor:
    """One layer's SwiGLU experts with every expert local: ``x [T, H]`` routed by ``top_k_index / top_k_weights
    [T, k]``. Routing stays on the device (sort + scatter-add counts, no host sync); the permute and the unpermute
    are fused into the kernels, and (``fuse_router_grad``) so is ``dy = w · dout[token]`` in the backward — which
    saves writing and twice reading ``dy`` but feeds one weight-gradient GEMM an operand it must scale in registers;
    ``bench/gpu_moe.py`` times both."""
    order, counts, src, slots = route(top_k_index, gate_up.shape[0])
    if fuse_router_grad:
        return RoutedSwiGLUExperts.apply(x, top_k_weights, gate_up, down, counts, src, slots, order, tiles)
    y = SwiGLUExperts.apply(x, gate_up, down, counts, src, slots, tiles)
    return Combine.apply(y, top_k_weights, slots, order, tiles)


def grouped_swiglu(
    rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor, tiles: Tiles = Tiles(),
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert MLPs on rows grouped by expert (``counts[e]`` rows each), e.g. after an EP all-to-all. With
    ``perm`` the rows are not grouped in memory: grouped row ``s`` is ``rows[perm[s]]`` and its output goes to the
    same place — the regrouping copies (and their gradients) fused into the GEMMs."""
    return SwiGLUExperts.apply(rows, gate_up, down, counts, None, None, tiles,
                               perm.to(torch.int32) if perm is not None else None)
