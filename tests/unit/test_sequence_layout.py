"""Long context without a process group: how the tokens of a row are dealt to sp x cp ranks (zig-zag cp chunks, sp
parts), the rank layout of sequence groups, the attention mask from global indices, and the one-line refusals of
sizes and models that cannot run (checked before any work)."""

import re
import sys
import types

import pytest
import torch

from xpar_zoo.errors import BatchError, MeshError, PlanError
from xpar_zoo.parallel.mesh import sequence_rank_layout, validate_sequence_sizes
from xpar_zoo.parallel.options import ParallelOptions
from xpar_zoo.styles.sequence import check_sequence_parallel
from xpar_zoo.styles.sequence_compressed import compressed_attention_modules, served_compressed_layer_types
from xpar_zoo.styles.sequence_halo import (
    halo_projections,
    halo_tokens,
    sequence_inputs,
    served_halo_layer_types,
)
from xpar_zoo.styles.sequence_indexed import (
    block_attention_modules,
    indexed_attention_modules,
    indexer_block_rows,
    indexer_query_bytes,
    selection_attention_modules,
    served_indexed_layer_types,
)
from xpar_zoo.styles.sequence_inner import blocked_attention, lower_right_attention
from xpar_zoo.styles.sequence_layout import (
    check_sequence_length,
    cp_chunk,
    document_ids,
    kv_repeat,
    token_layout,
)
from xpar_zoo.styles.sequence_masks import SequenceForward, lower_right_mask
from xpar_zoo.styles.sequence_mixers import sequence_mixers
from xpar_zoo.styles.sequence_paths import attention_block_rows
from xpar_zoo.styles.sequence_positioned import is_depth_attention, positioned_attention_modules
from xpar_zoo.testing import parity


@pytest.mark.parametrize("sp, cp", [(1, 2), (2, 1), (2, 2), (4, 1), (1, 4), (2, 4)])
def test_every_token_of_a_row_goes_to_exactly_one_rank(sp, cp):
    seq = 2 * sp * cp * 3
    local = torch.cat([token_layout(seq, sp, cp, s, c).local for c in range(cp) for s in range(sp)])
    assert sorted(local.tolist()) == list(range(seq))
    for c in range(cp):  # the sp ranks of a cp chunk hold it in order, so the all-to-all rebuilds it
        chunk = torch.cat([token_layout(seq, sp, cp, s, c).local for s in range(sp)])
        assert torch.equal(chunk, token_layout(seq, sp, cp, 0, c).queries)
    assert torch.equal(token_layout(seq, sp, cp, 0, 0).keys, torch.cat([cp_chunk(seq, cp, c) for c in range(cp)]))


def test_cp_deals_head_and_tail_chunks_so_causal_work_is_balanced():
    assert cp_chunk(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk(8, 2, 1).tolist() == [2, 3, 4, 5]
    work = [int(cp_chunk(64, 4, c).add(1).sum()) for c in range(4)]  # keys each rank's queries see under a causal mask
    assert len(set(work)) == 1


@pytest.mark.parametrize("seq, sp, cp, message", [
    (12, 2, 2, "sequence length 12 does not divide by 2·cp·sp = 2·2·2 = 8"),
    (6, 4, 1, "sequence length 6 does not divide by sp=4"),
    (4, 1, 4, "sequence length 4 does not divide by 2·cp·sp = 2·4·1 = 8"),
])
def test_sequence_length_that_does_not_deal_evenly_is_one_clear_line(seq, sp, cp, message):
    with pytest.raises(BatchError, match="^" + message):
        check_sequence_length(seq, sp, cp)


def test_sequence_groups_are_consecutive_ranks_by_default_with_sp_fastest():
    layout = sequence_rank_layout(8, 1, 2, 2)  # [replicate, dp, cp, sp]
    assert layout[0, 0].tolist() == [[0, 1], [2, 3]] and layout[0, 1].tolist() == [[4, 5], [6, 7]]
    strided = sequence_rank_layout(8, 1, 2, 2, {"sp": False})  # sp strided over dp and cp: [sp, dp, cp]
    assert strided[0, 0].tolist() == [[0, 4], [1, 5]]
    assert sequence_rank_layout(8, 2, 2, 1)[1, 1].tolist() == [[6, 7]]  # HSDP: a group stays in its replica


@pytest.mark.parametrize("world, replicate, sp, cp, message", [
    (4, 1, 8, 1, r"sp=8 does not divide the ranks of a replica \(4: world 4 / replicate 1\)"),
    (8, 2, 1, 8, r"cp=8 does not divide the ranks of a replica \(4: world 8 / replicate 2\)"),
    (6, 1, 2, 2, r"sp·cp=2·2=4 does not divide the ranks of a replica \(6"),
    (4, 1, 0, 1, r"sp must be a positive integer, got 0"),
])
def test_sequence_sizes_that_do_not_fit_the_world_are_one_clear_line(world, replicate, sp, cp, message):
    with pytest.raises(MeshError, match="^" + message):
        validate_sequence_sizes(world, replicate, sp, cp)


def test_key_value_heads_are_repeated_to_spread_over_sp_not_refused():
    assert kv_repeat(4, 2, 4) == 2  # 2 KV heads over sp=4: each repeated twice, one per rank
    assert kv_repeat(32, 4, 8) == 2  # Qwen3-30B-A3B's 4 KV heads over sp=8
    assert kv_repeat(8, 8, 4) == 1
    assert kv_repeat(12, 3, 4) == 4  # 3 does not divide 4: repeat to 12 (one per query head)


def test_packed_documents_start_where_positions_do_not_step_by_one():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8]
    assert document_ids(torch.arange(8)[None]) is None


def test_the_mask_of_a_cp_chunk_is_causal_windowed_and_per_document_on_global_indices():
    seq, cp = 8, 2
    layout = token_layout(seq, 1, cp, 0, 1)  # cp rank 1: tokens 2..5, keys in gathered order 0,1,6,7,2,3,4,5
    docs = document_ids(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
    f = SequenceForward(layout.queries, layout.keys, docs, None)
    mask = f.mask(True, 3, None)[0, 0]
    for i, q in enumerate(layout.queries.tolist()):
        for j, k in enumerate(layout.keys.tolist()):
            expected = k <= q and q - k < 3 and (k < 4) == (q < 4)
            assert bool(mask[i, j]) == expected, (q, k)
    additive = f.mask(True, 3, torch.float32)
    assert torch.equal(additive == 0, f.mask(True, 3, None))


def _fake_mesh(sp=1, cp=1):
    return types.SimpleNamespace(sp=sp, cp=cp)


def _meta_model(model_type, **overrides):
    from xpar_zoo.zoo.registry import model_class

    config = parity.tiny_config(model_type, attn_implementation="eager", **overrides)
    with torch.device("meta"):
        return model_class(config)._from_config(config)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_lower_right_attention_equals_sdpa_under_the_dense_mask(cp):
    """Without a mask: each run of a cp rank's queries (head chunk, tail chunk) against the row-ordered key prefix
    that ends where the run ends, aligned lower-right, gives the values and gradients of sdpa under the dense
    causal mask of the gathered keys (grouped-query heads: 4 query heads over 2 key/value heads)."""
    torch.manual_seed(0)
    seq, b, d = 4 * cp, 2, 8
    q_all, k_row, v_row = torch.randn(b, 4, seq, d), torch.randn(b, 2, seq, d), torch.randn(b, 2, seq, 6)
    for c in range(cp):
        layout = token_layout(seq, 1, cp, 0, c)
        forward = SequenceForward(layout.queries, layout.keys, None, None)
        q = q_all[:, :, layout.queries].requires_grad_()
        k, v = k_row[:, :, layout.keys].requires_grad_(), v_row[:, :, layout.keys].requires_grad_()
        got = lower_right_attention(q, k, v, forward, 0.0, 0.3)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=forward.mask(True, None, q.dtype),
            scale=0.3).transpose(1, 2)
        assert got.shape == (b, seq // cp, 4, 6)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        grad = torch.randn_like(got)
        for a, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
            torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-5)


def test_the_lower_right_mask_is_one_row_seen_through_strides():
    """The causal mask of the last 3 of 7 positions, queries reversed, is one row of 3 + 7 - 1 entries: reversed
    query ``i`` sees keys ``j < 7 - i``, the dtype's min elsewhere (as the dense mask's)."""
    mask = lower_right_mask(3, 7, torch.float32, torch.device("cpu"))
    dense = SequenceForward(torch.arange(4, 7), torch.arange(7), None, None).mask(True, None, torch.float32)
    assert mask.shape == (1, 1, 3, 7) and mask.untyped_storage().nbytes() == (3 + 7 - 1) * 4
    assert torch.equal(mask, dense.flip(2))


def test_cp_lower_right_on_cpu_gives_sdpa_the_strided_mask_and_grouped_heads(monkeypatch):
    """On the CPU each run's sdpa call gets the reversed queries, the key/value heads as they are (``enable_gqa``)
    and :func:`lower_right_mask`: ``n + end - 1`` entries, not a dense ``[n, end]`` mask nor a ``CausalBias``."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[2], k.shape, attn_mask.untyped_storage().nbytes(), kwargs.get("enable_gqa")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    layout = token_layout(16, 1, 2, 0, 0)  # cp rank 0 of 2: positions 0-3 and 12-15
    q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    lower_right_attention(q, k, v, SequenceForward(layout.queries, layout.keys, None, None), 0.0, 0.3)
    assert calls == [(4, (1, 2, 4, 8), (4 + 4 - 1) * 4, True), (4, (1, 2, 16, 8), (4 + 16 - 1) * 4, True)]


def test_cpu_sdpa_reads_the_lower_right_mask_in_place(tmp_path):
    """torch's CPU sdpa takes the strided mask on its flash kernel without a dense copy: a forward and backward of a
    cp rank's two query runs (1024 queries against 1024 and 4096 keys) peaks below a quarter of one run's dense fp32
    mask (16 MiB), let alone the math path's scores."""
    layout = token_layout(4096, 1, 2, 0, 0)
    forward = SequenceForward(layout.queries, layout.keys, None, None)
    q, k, v = (torch.randn(1, h, n, 8).requires_grad_() for h, n in ((2, 2048), (1, 4096), (1, 4096)))

    def step():
        lower_right_attention(q, k, v, forward, 0.0, 0.3).sum().backward()

    step()
    assert parity.live_peak_bytes(step, str(tmp_path / "trace.json")) < 4 * 2 ** 20


def test_cp_runs_without_a_dense_mask_on_cuda_and_the_cpu_and_with_it_elsewhere_unless_told():
    default = ParallelOptions()
    assert default.cp_lower_right("cuda") and default.cp_lower_right("cpu") and not default.cp_lower_right("mps")
    assert not ParallelOptions(cp_attention="dense").cp_lower_right("cpu")
    assert ParallelOptions(cp_attention="lower_right").cp_lower_right("cpu")
    assert not ParallelOptions(cp_attention="dense").cp_lower_right("cuda")
    with pytest.raises(PlanError, match="cp_attention must be one of lower_right, dense, got 'ring'"):
        ParallelOptions(cp_attention="ring")


def _rows_of(kind: str, b: int, seq: int) -> tuple:
    """``(docs, key_valid)`` of ``b`` rows of ``seq`` tokens: plain, packed (positions restart), right-padded."""
    if kind == "packed":
        pos = torch.arange(seq).repeat(b, 1)
        pos[0, 7:], pos[1, 20:] = torch.arange(seq - 7), torch.arange(seq - 20)
        return document_ids(pos), None
    if kind == "padded":
        valid = torch.ones(b, seq, dtype=torch.bool)
        valid[0, -5:] = False
        return None, valid
    if kind == "left_padded":  # queries with no key: they attend to every key, in blocks as in the whole mask
        valid = torch.ones(b, seq, dtype=torch.bool)
        valid[1, :6] = False
        return None, valid
    return None, None


def _inner(inner: str):
    """transformers' own inner attention (sdpa, or qwen3's eager) as the sp/cp wrapper calls it: ``call(q, k, v,
    mask) -> [b, q, h, dv]`` for 4 query heads over 2 key/value heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    fn = sdpa_attention_forward if inner == "sdpa" else eager_attention_forward
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=True)
    return lambda q, k, v, mask: fn(module, q, k, v, mask, dropout=0.0, scaling=0.3)[0]


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["plain", "packed", "padded", "left_padded"])
@pytest.mark.parametrize("causal, window", [(True, None), (True, 5), (False, None)])
@pytest.mark.parametrize("cp", [1, 4])
def test_blocked_attention_equals_the_whole_mask_in_values_and_gradients(inner, kind, causal, window, cp):
    """Queries in blocks of 3 (each block's mask built from the global positions against the keys it may see,
    checkpointed) give the values and gradients of one call under the whole ``[b, 1, S/cp, S]`` mask: causal,
    sliding window, packed documents, right padding (a padded query attends to all keys), every cp rank."""
    torch.manual_seed(0)
    seq, b, call = 32, 2, _inner(inner)
    docs, valid = _rows_of(kind, b, seq)
    for c in range(cp):
        layout = token_layout(seq, 1, cp, 0, c)
        batch = SequenceForward(layout.queries, layout.keys, docs, valid)
        q = torch.randn(b, 4, seq // cp, 8, requires_grad=True)
        k, v = torch.randn(b, 2, seq, 8, requires_grad=True), torch.randn(b, 2, seq, 6, requires_grad=True)
        want = call(q, k, v, batch.mask(causal, window, q.dtype))
        got = blocked_attention(call, q, k, v, batch, causal, window, 3)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        grad = torch.randn_like(want)
        for a, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
            torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-5)


def test_a_causal_block_sees_only_the_keys_before_its_last_query_and_never_crosses_a_cp_chunk():
    layout = token_layout(16, 1, 2, 0, 0)  # cp rank 0: queries 0..3 and 12..15; gathered keys 0..3 12..15 4..11
    plain = SequenceForward(layout.queries, layout.keys, None, None)
    blocks = plain.blocks(3, True, None)
    assert [(s, n) for s, n, _ in blocks] == [(0, 3), (3, 1), (4, 3), (7, 1)]
    seen = [sorted(layout.keys[k].tolist()) for _, _, k in blocks]
    assert seen == [list(range(3)), list(range(4)), list(range(15)), list(range(16))]
    assert blocks[0][2] == slice(0, 3)  # consecutive in the gathered order: a view, no copy
    windowed = [sorted(layout.keys[k].tolist()) for _, _, k in plain.blocks(3, True, 4)]
    assert windowed[2] == list(range(9, 15))  # queries 12..14 with a window of 4: keys 9..14
    left = torch.ones(1, 16, dtype=torch.bool)
    left[0, :2] = False  # queries 0 and 1 have no key: they attend to all, so no block is trimmed
    left_padded = SequenceForward(layout.queries, layout.keys, None, left)
    assert all(k == slice(None) for _, _, k in left_padded.blocks(3, True, None))
    right = torch.ones(1, 16, dtype=torch.bool)
    right[0, -3:] = False  # every query sees token 0: trimmed as without padding
    right_padded = SequenceForward(layout.queries, layout.keys, None, right)
    trimmed = [sorted(layout.keys[k].tolist()) for *_, k in right_padded.blocks(3, True, None)]
    assert trimmed == seen


def test_a_causal_block_on_packed_rows_sees_no_key_before_its_documents():
    """Packed rows: a block's keys start where its first query's document starts (the earliest over the rows),
    so a block deep in a row of several documents skips the keys of the documents before it."""
    pos = torch.arange(16).repeat(2, 1)
    pos[0, 6:], pos[1, 9:] = torch.arange(10), torch.arange(7)  # row 0: documents at 0 and 6; row 1: at 0 and 9
    pos[0, 12:] = torch.arange(4)  # row 0: a third document at 12
    layout = token_layout(16, 1, 1, 0, 0)
    batch = SequenceForward(layout.queries, layout.keys, document_ids(pos), None)
    seen = [(s, sorted(layout.keys[k].tolist())) for s, _, k in batch.blocks(3, True, None)]
    # queries 9..11: row 0's document from 6, row 1's from 9 -> keys from 6; queries 12..14: from 9 (row 1)
    assert seen[3] == (9, list(range(6, 12))) and seen[4] == (12, list(range(9, 15)))
    assert seen[0] == (0, [0, 1, 2]) and seen[2] == (6, list(range(9)))  # 6..8: row 1's document from 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_blocked_attention_nests_in_layer_checkpointing_and_keeps_no_mask_for_backward(reentrant):
    """Under the layer's activation checkpointing (transformers' non-reentrant default, and reentrant) the
    gradients are those of the whole mask; what autograd keeps holds no ``[queries, keys]`` mask or scores."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    seq, cp, call = 256, 4, _inner("eager")
    layout = token_layout(seq, 1, cp, 0, 1)
    batch = SequenceForward(layout.queries, layout.keys, *_rows_of("packed", 2, seq))
    q = torch.randn(2, 4, seq // cp, 8, requires_grad=True)
    k, v = torch.randn(2, 2, seq, 8, requires_grad=True), torch.randn(2, 2, seq, 6, requires_grad=True)
    want = call(q, k, v, batch.mask(True, None, q.dtype))
    grad = torch.randn_like(want)
    wanted = torch.autograd.grad(want, (q, k, v), grad)
    got = checkpoint(blocked_attention, call, q, k, v, batch, True, None, 8, use_reentrant=reentrant)
    got.backward(grad)  # the reentrant checkpoint does not take autograd.grad
    for t, w in zip((q, k, v), wanted):
        torch.testing.assert_close(t.grad, w, atol=1e-6, rtol=1e-5)
    kept = parity.saved_for_backward_bytes(lambda: blocked_attention(call, q, k, v, batch, True, None, 8),
                                           exclude=(q, k, v))
    mask_bytes = 2 * (seq // cp) * seq * 4
    assert kept < mask_bytes / 4, (kept, mask_bytes)  # the output and block bookkeeping only


def test_the_block_size_comes_from_a_byte_budget_the_options_can_set():
    default = ParallelOptions()
    assert default.block_budget(None) == default.block_budget("cpu") == 16 * 2 ** 20
    # on an accelerator a block is a kernel launch and a host step (twice, with the recompute): fewer, larger blocks
    assert default.block_budget("cuda") == 256 * 2 ** 20
    budget = default.block_budget("cpu")
    # sdpa: a query costs its additive mask (4) and boolean terms (2) per key; the whole 2048 x 8192 mask is 96 MiB
    assert attention_block_rows(1, 4, 2048, 8192, 4, False, budget) == 16 * 2 ** 20 // (8192 * 6)
    assert attention_block_rows(1, 4, 512, 4096, 4, False, budget) is None  # 12 MiB: the whole mask, once per forward
    assert attention_block_rows(1, 4, 512, 4096, 4, True, budget) == 16 * 2 ** 20 // (4096 * (6 + 4 * 16))  # scores
    half = ParallelOptions(attention_block_mib=0.5)
    assert half.block_budget("cuda") == half.block_budget("cpu") == 2 ** 19  # the option rules on every device
    assert attention_block_rows(1, 4, 2048, 8192, 4, False, half.block_budget("cpu")) == 2 ** 19 // (8192 * 6)
    with pytest.raises(PlanError, match="attention_block_mib must be a positive number of MiB, got 0"):
        ParallelOptions(attention_block_mib=0)


@pytest.mark.parametrize("model_type, mixers", [
    ("qwen3_next", ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]),  # gated delta net
    ("minimax", ["model.layers.0.self_attn"]),  # lightning attention (layer 1: attention through the interface)
    ("jamba", ["model.layers.1.mamba", "model.layers.3.mamba"]),
    ("nemotron_h", ["model.layers.0.mixer"]),  # its 'moe' layers mix no tokens
    ("kimi_linear", ["model.layers.0.self_attn", "model.layers.2.self_attn"]),  # not its MLA KimiLinearAttention
    ("lfm2_moe", ["model.layers.0.conv", "model.layers.2.conv"]),
])
def test_hybrid_models_run_their_sequence_mixers_on_whole_rows(model_type, mixers):
    """sp/cp take hybrid models: each linear-attention / SSM / short-convolution mixer (the decoder layer's child
    that takes the hidden states and the 2-D padding mask) runs on the group's gathered whole rows."""
    model = _meta_model(model_type)
    assert list(sequence_mixers(model)) == mixers
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=1, cp=2)) == "eager"


@pytest.mark.parametrize("model_type, attention", [
    ("deepseek_v32", ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"]),
    ("glm_moe_dsa", ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"]),
    # layer 2: sliding and dense (no indexer; given the mask placeholder only)
    ("dots3_note_text", ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn"]),
])
def test_indexed_sparse_attention_is_served_with_its_indexer_on_whole_rows(model_type, attention):
    """sp/cp take DSA models: each indexed attention module (its indexer, or none on a layer that reuses the
    previous layer's top-k) is wrapped, and the indexed layer type counts as attention."""
    model = _meta_model(model_type, index_topk_pattern="FSF") if model_type == "glm_moe_dsa" else _meta_model(
        model_type)
    assert list(indexed_attention_modules(model)) == attention
    assert served_indexed_layer_types(model, model.config) == {"indexed_attention"}
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=2, cp=2)) == "eager"


def test_a_selection_indexer_is_served_with_the_whole_rows_keys():
    """qwen4_exp's QSA attention (an indexer that returns a dense selection mask, folded into the attention's own
    mask) counts as indexed attention: the attention and its indexer are wrapped."""
    model = _meta_model("qwen4_exp_text")
    assert list(selection_attention_modules(model)) == ["model.layers.1.self_attn"]
    assert served_indexed_layer_types(model, model.config) == {"indexed_attention"}
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=2, cp=2)) == "eager"


def test_a_block_indexer_is_served_with_the_whole_rows_keys():
    """minimax_m3's sparse layers (an indexer choosing blocks of keys per key/value head, handed to the attention
    function as block_indices) count as indexed attention; its full layers are plain attention."""
    model = _meta_model("minimax_m3_vl_text")
    assert list(block_attention_modules(model)) == ["model.layers.0.self_attn"]
    assert served_indexed_layer_types(model, model.config) == {"minimax_m3_sparse"}
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=2, cp=2)) == "eager"


def test_the_indexer_runs_a_block_of_queries_at_a_time_beyond_the_budget():
    per_query = indexer_query_bytes(1, 64, 131072)  # 64 float32 score heads and their ReLU against 128k keys
    assert per_query == 131072 * (8 * 64 + 9)
    assert indexer_block_rows(1, 64, 100, 131072, 256 * 2 ** 20) == (256 * 2 ** 20) // per_query
    assert indexer_block_rows(1, 2, 8, 16, 16 * 2 ** 20) is None  # all at once where they fit
    assert indexer_block_rows(1, 64, 8, 131072, 1.0) == 1  # never fewer than one query


def test_sequence_mixing_that_cannot_run_on_gathered_rows_is_refused_with_the_reason(monkeypatch):
    """inkling2's bias over the distances its model hands the attention, without the modeling module's function
    that computes them from the cache protocol (the row cache cannot widen them): one line naming the module."""
    model = _meta_model("inkling2_text")
    monkeypatch.delattr(sys.modules[type(model).__module__], "get_relative_distance")
    why = ("layer type 'hybrid_sliding': Inkling2RelativePositionBias (self_attn.relative_position_bias): a dense "
           "relative-position bias")
    with pytest.raises(PlanError, match=rf"^cp=2: \w+ has sequence mixing that sp/cp cannot run on whole rows "
                                        rf"\(.*{re.escape(why)}.*no get_relative_distance.*\); sp and cp are "
                                        rf"refused for it$"):
        check_sequence_parallel(model, types.SimpleNamespace(sp=1, cp=2))


def test_compressed_attention_is_served_with_its_compressor_on_whole_row_windows():
    """deepseek_v4's compressed layers (CSA: a compressor with its own indexer; HCA) count as attention: each
    compressor is wrapped, its window projections (and its indexer's) return the group's whole rows."""
    model = _meta_model("deepseek_v4", layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                                                    "sliding_attention"])
    assert list(compressed_attention_modules(model)) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert served_compressed_layer_types(model, model.config) == {"compressed_sparse_attention",
                                                                 "heavily_compressed_attention"}
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=2, cp=2)) == "eager"


def test_inkling_attention_takes_its_positions_from_a_row_cache_and_its_convolutions_a_halo():
    """inkling's attention (a relative-position bias and query scaling from the positions its cache gives) is
    served through a row cache, its four short convolutions a layer (two on the keys and values inside the
    attention) with a halo of their kernel less one."""
    model = _meta_model("inkling_text", layer_types=["hybrid_sliding", "hybrid", "hybrid"])
    assert list(positioned_attention_modules(model)) == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert len(halo_projections(model)) == 12 and {halo_tokens(m) for m in halo_projections(model).values()} == {
        model.config.sconv_kernel_size - 1, model.config.conv_kernel_size - 1}
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=2, cp=2)) == "eager"


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_attention_takes_its_distances_from_a_row_cache_and_its_convolutions_a_halo(model_type):
    """inkling2's attention (a bias over the distances its model hands it, computed by its modeling module's
    get_relative_distance from the cache protocol) is served through a row cache; its four short convolutions a
    layer (the dynamic ones on the keys and values with their second input) with a halo of their kernel less one;
    its attention over each token's own layer states (the block and message residuals) runs as it is."""
    model = _meta_model(model_type, layer_types=["hybrid_sliding", "hybrid", "hybrid"])
    assert list(positioned_attention_modules(model)) == [f"model.layers.{i}.self_attn" for i in range(3)]
    halos = halo_projections(model)
    assert len(halos) == 12 and {halo_tokens(m) for m in halos.values()} == {
        model.config.sconv_kernel_size - 1, model.config.conv_kernel_size - 1}
    assert sequence_inputs(type(halos["model.layers.1.self_attn.k_proj.sconv"])) == ("hidden_states", "dynamic_input")
    depth = [name for name, m in model.named_modules() if is_depth_attention(m)]
    assert "model.layers.1.attention_input" in depth and "model.final_input" in depth
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=2, cp=2)) == "eager"


def test_zaya_attention_runs_its_convolutional_projection_with_a_halo():
    """zaya's CCA projection (causal convolutions of kernel 2 and 2 over q/k, a value half from the previous token)
    reads the 3 tokens before each position: sp/cp run it on each run of a rank's tokens with those before it."""
    model = _meta_model("zaya")
    projections = halo_projections(model)
    assert list(projections) == ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.qkv_proj"]
    assert {halo_tokens(m) for m in projections.values()} == {3}
    assert served_halo_layer_types(model, model.config) == {"hybrid"}
    assert check_sequence_parallel(model, types.SimpleNamespace(sp=2, cp=2)) == "eager"


def test_sp_larger_than_the_query_heads_suggests_cp():
    model = _meta_model("qwen3_moe")  # 4 query heads
    with pytest.raises(PlanError, match=r"^sp=8 does not divide the 4 query heads of Qwen3MoeForCausalLM; use sp=4, "
                                        r"cp=2 instead \(cp is not limited by heads\)$"):
        check_sequence_parallel(model, _fake_mesh(sp=8))
    assert check_sequence_parallel(model, _fake_mesh(cp=8)) == "eager"  # cp is not limited by heads


def test_an_attention_implementation_the_wrapper_cannot_serve_is_one_clear_line():
    model = _meta_model("qwen3_moe")
    model.config._attn_implementation_internal = "paged|sdpa"
    with pytest.raises(PlanError, match=r"^sp=2: attention implementation 'paged\|sdpa' is not supported"):
        check_sequence_parallel(model, _fake_mesh(sp=2))


def test_flex_and_flash_are_served_as_inner_attention():
    model = _meta_model("qwen3_moe")
    for inner in ("flex_attention", "flash_attention_2", "flash_attention_3"):
        model.config._attn_implementation_internal = inner
        assert check_sequence_parallel(model, _fake_mesh(sp=2, cp=2)) == inner


def _cp_batch(seq, cp, c, window_docs_padding):
    """A cp rank's SequenceForward over rows with packed documents and left padding (or neither)."""
    layout = token_layout(seq, 1, cp, 0, c)
    if not window_docs_padding:
        return SequenceForward(layout.queries, layout.keys, None, None)
    pos = torch.arange(seq).repeat(2, 1)
    pos[0, 5:], pos[1, 3:] = torch.arange(seq - 5), torch.arange(seq - 3)
    valid = torch.ones(2, seq, dtype=torch.bool)
    valid[1, :2] = False
    return SequenceForward(layout.queries, layout.keys, document_ids(pos), valid)


@pytest.mark.parametrize("cp, window", [(2, None), (2, 3), (4, 5)])
def test_the_flex_block_mask_allows_what_the_global_indices_allow(cp, window):
    """The BlockMask's mask_mod (arithmetic on the local indices: no captured index tensor) allows exactly the keys
    before the query, inside the window, of its document and not padding, for every cp rank (a query with no key
    left gets none: flex's own semantics; the dense mask lets it attend to all)."""
    seq = 4 * cp
    for c in range(cp):
        f = _cp_batch(seq, cp, c, True)
        block = f.flex_block_mask(True, window)
        got = block.mask_mod(torch.arange(2)[:, None, None], torch.tensor(0), torch.arange(seq // cp)[:, None],
                             torch.arange(seq)[None, :])
        q, k = f.queries[None, :, None], f.keys[None, None, :]
        want = (k <= q) & (q - k < (window or seq)) & (f.docs[:, f.queries][:, :, None] == f.docs[:, f.keys][
            :, None, :]) & f.key_valid[:, f.keys][:, None, :]
        assert torch.equal(got, want), c
        assert torch.equal(f.mask(True, window, None)[:, 0][want.any(-1)], want[want.any(-1)])


@pytest.mark.parametrize("band", [1 << 22, 128 * 128 * 2 * 8])
def test_the_banded_block_mask_is_torchs_create_block_mask(band, monkeypatch):
    """Built a band of query blocks at a time (here also one block per band), the BlockMask holds the same blocks in
    the same order as torch's create_block_mask over the whole mask at once: rows with documents and padding, a
    window, cp rank 1 of 4 (head and tail chunks), lengths that are not multiples of the 128-token blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    from xpar_zoo.styles import sequence_masks

    monkeypatch.setattr(sequence_masks, "BLOCK_MASK_BAND_ENTRIES", band)
    seq = 8 * 136
    layout = token_layout(seq, 1, 4, 0, 1)
    pos = torch.arange(seq).repeat(2, 1)
    pos[0, 300:], pos[1, 700:] = torch.arange(seq - 300), torch.arange(seq - 700)
    valid = torch.ones(2, seq, dtype=torch.bool)
    valid[1, :130] = False
    for docs, keep, window in ((None, None, None), (document_ids(pos), valid, 200)):
        f = SequenceForward(layout.queries, layout.keys, docs, keep)
        got = f.flex_block_mask(True, window)
        rows = None if docs is None else 2
        want = create_block_mask(got.mask_mod, rows, None, layout.queries.numel(), seq, device="cpu")
        assert got.shape == want.shape
        for a, w in zip(got.as_tuple()[2:7], want.as_tuple()[2:7]):
            assert torch.equal(a, w)


@pytest.mark.parametrize("cp, window, packed", [(1, None, True), (2, None, False), (2, 3, True), (4, None, True)])
def test_flash_inner_equals_sdpa_under_the_dense_mask(cp, window, packed):
    """transformers' flash forward on the reference flash kernels (xpar_zoo.testing.flash_reference), called per
    query run against the row-ordered key prefix (varlen for packed documents and padding), gives the values and
    gradients of sdpa under the dense mask of the global indices, on every cp rank (valid queries; 4 query heads
    over 2 key/value heads; value head dim 6)."""
    from xpar_zoo.compat import config_with_attn_implementation
    from xpar_zoo.styles.sequence_inner import flash_inner
    from xpar_zoo.testing import flash_reference

    module = torch.nn.Linear(2, 2)
    module.is_causal, module.config = True, config_with_attn_implementation(types.SimpleNamespace(), "flash_attention_2")
    torch.manual_seed(0)
    seq, b, d = 4 * cp if cp > 1 else 8, 2, 8
    q_all, k_row, v_row = torch.randn(b, 4, seq, d), torch.randn(b, 2, seq, d), torch.randn(b, 2, seq, 6)
    with flash_reference.installed("flash_attention_2"):
        for c in range(cp):
            f = _cp_batch(seq, cp, c, packed)
            q = q_all[:, :, f.queries].requires_grad_()
            k, v = k_row[:, :, f.keys].requires_grad_(), v_row[:, :, f.keys].requires_grad_()
            got = flash_inner(f, module, q, k, v, True, 0.0, 0.3, window, {})
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=f.mask(True, window, q.dtype),
                scale=0.3).transpose(1, 2)
            valid = f.key_valid[:, f.queries] if f.key_valid is not None else torch.ones(b, seq // cp, dtype=bool)
            assert got.shape == (b, seq // cp, 4, 6)
            torch.testing.assert_close(got[valid], want[valid], atol=1e-6, rtol=1e-5)
            assert not got[~valid].any()  # a padded query: no output, as flash's own unpadding gives
            grad = torch.randn_like(got) * valid[..., None, None]
            for a, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
                torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-5)


def test_the_reference_flash_kernel_keeps_flashs_contract():
    """The stand-in the flash tests run on: causal aligned bottom-right when there are fewer queries than keys,
    window_size around that diagonal, grouped key/value heads and a per-head sink in the softmax denominator, as
    sdpa with torch's causal_lower_right and an explicit window computes them; varlen is per sequence."""
    from torch.nn.attention.bias import causal_lower_right

    from xpar_zoo.testing.flash_reference import flash_attn_func, flash_attn_varlen_func

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    got = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1), v.transpose(1, 2).repeat_interleave(2, 1),
        attn_mask=causal_lower_right(3, 7), scale=0.3).transpose(1, 2)
    torch.testing.assert_close(got, want)
    qpos, kpos = torch.arange(3)[:, None] + 4, torch.arange(7)[None]
    windowed = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(2, 2))
    mask = (kpos <= qpos) & (qpos - kpos <= 2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1), v.transpose(1, 2).repeat_interleave(2, 1),
        attn_mask=mask, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(windowed, want)
    sink = torch.randn(4)
    sunk = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, s_aux=sink)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 0.3
    scores = scores.masked_fill(~(kpos <= qpos), float("-inf"))
    probs = torch.softmax(torch.cat([scores, sink.view(1, 4, 1, 1).expand(2, 4, 3, 1)], -1), -1)[..., :-1]
    torch.testing.assert_close(sunk, torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(2, 2)))
    cu_q, cu_k = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([0, 7, 14], dtype=torch.int32)
    flat = flash_attn_varlen_func(q.reshape(6, 4, 8), k.reshape(14, 2, 8), v.reshape(14, 2, 8), cu_q, cu_k, 3, 7,
                                  softmax_scale=0.3, causal=True)
    torch.testing.assert_close(flat.view(2, 3, 4, 8), got)


def test_consecutive_runs_are_the_blocks_of_held_indices_and_query_positions():
    from xpar_zoo.parallel.state import consecutive_runs

    assert consecutive_runs([4, 5, 6, 0, 1, 9]) == [(0, 4, 3), (3, 0, 2), (5, 9, 1)]
    assert consecutive_runs([3, 3, 2]) == [(0, 3, 1), (1, 3, 1), (2, 2, 1)]
    assert consecutive_runs([]) == []
