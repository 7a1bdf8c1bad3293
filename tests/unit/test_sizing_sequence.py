"""The sizer's long-context arithmetic (``xpar-zoo size --sp S --cp C --seq N``), on configs only (no process
group, no model): a rank holds ``seq/(sp·cp)`` tokens outside attention; inside it Ulysses holds whole rows of
``heads/sp`` heads and cp holds ``seq/cp`` queries against the keys and values of whole rows; eager attention keeps
a score matrix that sdpa and flash do not; impossible sizes are one clear error naming the numbers."""

import pytest

from xpar_zoo import sizing
from xpar_zoo.errors import BatchError, MeshError, PlanError
from xpar_zoo.parallel.options import ParallelOptions
from xpar_zoo.testing import parity

FLASH = "flash_attention_2"
WIDE = ParallelOptions(attention_block_mib=100000)  # a block budget that takes the whole mask and scores
KEPT = ParallelOptions(mixer_recompute=False)


def _config(**overrides):
    """8 query heads, 2 key/value heads of 16: wide enough for sp up to 8 (key/value heads repeated past 2)."""
    dims = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                moe_intermediate_size=64, vocab_size=512, num_hidden_layers=3)
    return parity.tiny_config("qwen3_moe", **{**dims, **overrides})


def _terms(cfg, seq, rows=1, **kw):
    return sizing.activation_terms(cfg, rows * seq, 4, fused_head=1, qk_norm=True, seq=seq, **kw)


@pytest.mark.parametrize("sp,cp", [(1, 1), (4, 1), (1, 4), (2, 2), (8, 1), (2, 4)])
def test_a_rank_holds_seq_over_sp_cp_tokens_outside_attention(sp, cp):
    est = sizing.estimate(_config(), 8, {}, micro_batch=2, seq=4096, sp=sp, cp=cp, param_dtype="fp32")
    assert est.tokens_per_rank == 2 * 4096 // (sp * cp)
    assert {k: est.mesh.get(k, 1) for k in ("sp", "cp")} == {"sp": sp, "cp": cp}


@pytest.mark.parametrize("kv_heads,sp,want", [(2, 1, (8, 2)), (2, 2, (4, 1)), (8, 2, (4, 4)), (2, 4, (2, 1)),
                                              (2, 8, (1, 1)), (4, 8, (1, 1)), (1, 4, (2, 1))])
def test_ulysses_gives_a_rank_heads_over_sp_and_repeats_too_few_kv_heads(kv_heads, sp, want):
    """``(query heads, key/value heads)`` per rank inside attention: fewer key/value heads than sp are repeated
    (one per rank), not refused."""
    assert sizing.attention_heads(_config(num_key_value_heads=kv_heads), sp) == want


def test_flash_ulysses_activations_are_one_rank_with_seq_over_sp_plus_the_output_copy():
    """With a kernel that keeps key/value heads as they are (flash), a rank of ``sp`` holds exactly what one rank
    holds for rows of ``seq/sp`` (whole rows of heads/sp heads are as many values), plus the second copy of the
    attention output that Ulysses' output all-to-all makes for the output projection."""
    cfg = _config()
    seq, sp = 4096, 2
    q_width = cfg.num_attention_heads * cfg.head_dim
    got = _terms(cfg, seq, sp=sp, attention=FLASH)
    alone = _terms(cfg, seq // sp, attention=FLASH)
    extra = cfg.num_hidden_layers * seq // sp * q_width * 4
    assert got["activations"] == alone["activations"] + extra
    assert got["attention scores"] == 0 and got["attention mask"] == 0  # flash: no mask under sp (varlen)


def test_flash_cp_keeps_queries_over_cp_against_the_keys_and_values_of_whole_rows():
    """cp: a rank keeps ``seq/cp`` queries and gathers the keys and values of the whole row: exactly one rank's
    values at ``seq/cp`` plus the other chunks' keys and values."""
    cfg = _config()
    seq, cp = 4096, 4
    kv_width = cfg.num_key_value_heads * cfg.head_dim
    got = _terms(cfg, seq, cp=cp, attention=FLASH)
    alone = _terms(cfg, seq // cp, attention=FLASH)
    gathered = cfg.num_hidden_layers * 2 * (seq - seq // cp) * kv_width * 4
    assert got["activations"] == alone["activations"] + gathered


def test_sdpa_cp_keeps_no_mask_and_repeats_the_key_value_heads():
    """A GPU's sdpa under cp on plain rows runs each query chunk against its key prefix, aligned lower-right: no
    ``seq²`` mask (eager still gets one, within the block budget), and the key/value heads repeated to the query
    heads (flash keeps them)."""
    cfg = _config()
    seq, cp = 4096, 4
    got = _terms(cfg, seq, cp=cp, attention="sdpa", options=WIDE)
    assert got["attention mask"] == 0 and got["attention scores"] == 0
    assert _terms(cfg, seq, cp=cp, attention="eager", options=WIDE)["attention mask"] == seq // cp * seq * 4
    repeated = cfg.num_hidden_layers * 2 * seq * (cfg.num_attention_heads - cfg.num_key_value_heads) * cfg.head_dim
    assert got["activations"] == _terms(cfg, seq, cp=cp, attention=FLASH, options=WIDE)["activations"] + repeated * 4
    assert not any("mask" in k for k in sizing.estimate(cfg, 4, {}, seq=seq, cp=cp, options=WIDE).memory)


@pytest.mark.parametrize("sp,cp", [(4, 1), (1, 4), (2, 2)])
def test_eager_scores_are_heads_over_sp_times_queries_over_cp_times_whole_rows(sp, cp):
    """eager keeps its fp32 softmax, ``rows · heads/sp · seq/cp · seq`` per layer (and its copy in a lower compute
    dtype); every split of a group of 4 keeps a quarter of one rank's (within a block budget that takes them)."""
    cfg = _config()
    rows, seq = 2, 1024
    one = _terms(cfg, seq, rows, attention="eager", options=WIDE)["attention scores"]
    assert one == cfg.num_hidden_layers * rows * cfg.num_attention_heads * seq * seq * 4
    assert _terms(cfg, seq, rows, sp=sp, cp=cp, attention="eager", options=WIDE)["attention scores"] == one / 4
    bf16 = sizing.activation_terms(cfg, rows * seq, 2, seq=seq, attention="eager", options=WIDE)["attention scores"]
    assert bf16 == one / 4 * (4 + 2)


@pytest.mark.parametrize("attention", ["sdpa", FLASH])
def test_sdpa_and_flash_keep_no_score_matrix(attention):
    cfg = _config()
    assert _terms(cfg, 1024, attention=attention)["attention scores"] == 0
    est = sizing.estimate(cfg, 4, {}, seq=1024, attention=attention)
    assert not any("scores" in k or "eager" in k for k in est.memory)


def test_eager_rows_of_the_estimate_name_the_quadratic_terms():
    est = sizing.estimate(_config(), 4, {}, seq=1024, sp=2, cp=2, attention="eager", options=WIDE)
    for row in ("attention scores (eager, seq²)", "attention mask (sp/cp, seq²)", "eager backward temporaries (seq²)"):
        assert est.memory[row] > 0, row


@pytest.mark.parametrize("sp,cp", [(4, 1), (1, 4), (2, 2)])
def test_eager_over_the_block_budget_keeps_no_scores_or_mask_only_one_block(sp, cp):
    """Where eager's sp/cp mask and scores exceed the block budget, the attention runs a block of queries at a
    time, checkpointed: no ``seq²`` term is kept, the key/value heads stay as gathered (not repeated), and one
    block's mask and scores (within the budget) is the only quadratic term, transient."""
    cfg, seq = _config(), 4096
    heads, _ = sizing.attention_heads(cfg, sp)
    got = _terms(cfg, seq, sp=sp, cp=cp, attention="eager")
    assert got["attention scores"] == 0 and got["attention mask"] == 0
    per_query = seq * (4 + 2 + heads * (8 + 8))
    block = 16 * 2 ** 20 // per_query * per_query  # within the default budget of 16 MiB
    mlp = cfg.hidden_size + 2 * cfg.num_experts + cfg.num_experts_per_tok * 2 * (cfg.hidden_size
                                                                                 + cfg.moe_intermediate_size)
    freed = seq // (sp * cp) * (mlp + 2 * cfg.hidden_size) * 4  # the layer's values after attention
    assert got["attention block"] == block - freed and block <= 16 * 2 ** 20
    # the values of flash (key/value heads as they are), less Ulysses' output copy that eager does not make
    flash = _terms(cfg, seq, sp=sp, cp=cp, attention=FLASH)["activations"]
    output_copy = cfg.num_hidden_layers * seq // cp * heads * cfg.head_dim * 4 if sp > 1 else 0
    assert got["activations"] == flash - output_copy
    est = sizing.estimate(cfg, 4, {}, seq=seq, sp=sp, cp=cp, attention="eager", param_dtype="fp32")
    assert not any("seq²" in k for k in est.memory)
    loss = est.memory["fused loss temporaries"]
    assert est.memory["attention block (sp/cp, one block of queries, beyond the loss temporaries)"] == (
        got["attention block"] - loss)


def test_activations_shrink_with_the_sequence_group_at_long_sequences():
    """At 32k tokens the linear activations of a rank of a group of 4 are near a quarter of one rank's: what sp and
    cp are for (the gathered keys and values, and Ulysses' output copy, are the rest)."""
    cfg = _config()
    one = _terms(cfg, 32768, attention=FLASH)["activations"]
    for sp, cp in [(4, 1), (1, 4), (2, 2)]:
        ratio = _terms(cfg, 32768, sp=sp, cp=cp, attention=FLASH)["activations"] / one
        assert 0.25 < ratio < 0.35, (sp, cp, ratio)


def test_sp_and_cp_communication_terms():
    """Ulysses: q, k, v and the output, ``(sp-1)/sp`` of the rank's tokens' values, forward and backward; cp: the
    rank's chunk of keys and values to the ``cp-1`` others, forward, and their gradients back."""
    cfg = _config()
    layers, d = cfg.num_hidden_layers, cfg.head_dim
    seq = 4096
    est = sizing.estimate(cfg, 4, {}, seq=seq, sp=4, param_dtype="fp32")
    local = seq // 4
    per_token = 2 * 8 * d + 2 * (2 * 2) * d  # q and output (8 heads); k and v after repeating 2 heads to 4
    assert est.comm["all_to_all (sp: sequence <-> heads)"] == layers * 2 * 3 / 4 * local * per_token * 4
    est = sizing.estimate(cfg, 4, {}, seq=seq, cp=4, param_dtype="fp32")
    assert est.comm["all_to_all (cp: keys/values gathered)"] == layers * 2 * 3 * local * 2 * 2 * d * 4
    assert "all_to_all (sp: sequence <-> heads)" not in sizing.estimate(cfg, 4, {}, seq=seq).comm


def test_parameter_memory_does_not_change_with_sp_or_cp():
    cfg = _config()
    base = sizing.estimate(cfg, 4, {"ep": 2}, seq=4096)
    long = sizing.estimate(cfg, 4, {"ep": 2}, seq=4096, sp=2, cp=2)
    for row in ("parameters (fp32 shards)", "gradients (fp32 shards)", "optimizer states (adamw)"):
        assert long.memory[row] == base.memory[row]


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(world=8, sp=3), MeshError, "sp=3 does not divide the ranks of a replica (8"),
    (dict(world=8, sp=2, cp=2, replicate=4), MeshError, "sp·cp=2·2=4 does not divide the ranks of a replica (2"),
    (dict(world=12, sp=2, cp=4), MeshError, "sp·cp=2·4=8 does not divide the ranks of a replica (12"),
    (dict(world=16, sp=16), PlanError, "sp=16 does not divide the 8 query heads of qwen3_moe; use sp=8, cp=2"),
    (dict(world=12, sp=6), PlanError, "sp=6 does not divide the 8 query heads"),
    (dict(world=8, sp=4, seq=1001), BatchError, "sequence length 1001 does not divide by sp=4"),
    (dict(world=8, sp=2, cp=2, seq=1004), BatchError, "does not divide by 2·cp·sp = 2·2·2 = 8"),
    (dict(world=8, cp=2, attention="paged|sdpa"), PlanError, "attention 'paged|sdpa' is not one of sdpa, eager"),
    (dict(world=4, sp=-1), MeshError, "sp must be a positive integer"),
])
def test_impossible_sizes_are_one_clear_error(kwargs, error, message):
    kwargs = {"seq": 4096, **kwargs}
    world, replicate = kwargs.pop("world"), kwargs.pop("replicate", 1)
    with pytest.raises(error) as e:
        sizing.estimate(_config(), world, {}, replicate, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sequence_mixing_sp_cp_cannot_gather_is_refused_with_the_reason():
    cfg = _config()
    cfg.layer_types = ["linear_attention", "full_attention", "full_attention"]  # no mixer module to gather around
    with pytest.raises(PlanError, match="layer type 'linear_attention': its layers hold no sequence mixer module"):
        sizing.check_long_context(cfg, 4, 1, 4096, sp=2)
    assert sizing.sequence_splits(cfg, 4, 4096) == [(1, 1)]


def test_hybrid_mixer_layers_hold_whole_rows_of_activations_under_sp_cp():
    """qwen3_next's gated delta net layers run on the group's whole rows: kept for backward
    (``ParallelOptions(mixer_recompute=False)``) their activations are not divided by sp·cp (the attention and MoE
    layers' are)."""
    cfg = parity.tiny_config("qwen3_next", hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=16, num_hidden_layers=4,
                             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    assert sizing.sequence_splits(cfg, 4, 4096)[1:] == [(2, 1), (4, 1)]
    assert sizing.whole_row_layers(cfg) == 2
    plain, split = (_terms(cfg, 4096, sp=sp, options=KEPT)["activations"] for sp in (1, 4))
    cfg.layer_types = ["full_attention"] * 4
    all_attention = _terms(cfg, 4096, sp=4, options=KEPT)["activations"]
    assert all_attention < split < plain
    # the two mixer layers keep whole rows: [4096, 2H + 2q + 2kv] each, against [1024, …] of an attention layer
    assert split - all_attention > 2 * 3072 * 2 * 128 * 4


def test_recomputed_hybrid_mixer_layers_keep_their_local_values_and_one_whole_row_transient():
    """By default a mixer's whole-row forward is recomputed in backward: the mixer layers keep what an attention
    layer's MLP keeps, and one mixer's whole rows are a transient, not one per mixer layer."""
    cfg = parity.tiny_config("qwen3_next", hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=16, num_hidden_layers=6, layer_types=["linear_attention"] * 4 + [
                                 "full_attention"] * 2)
    kept = _terms(cfg, 4096, sp=4, options=KEPT)["activations"]
    recomputed = _terms(cfg, 4096, sp=4)["activations"]
    whole = 4096 * (2 * 128 + 2 * 128 + 2 * 32) * 4  # one mixer's whole rows: [S, 2H + 2q + 2kv] fp32
    assert kept - recomputed == pytest.approx(3 * whole)  # four mixer layers' whole rows -> one


def test_suggest_grows_sp_up_to_the_heads_then_cp():
    """One split per sequence group size: sp as large as the query heads allow, cp for the rest (16 ranks, 8
    heads: sp=8, cp=2); lengths that do not divide are left out."""
    cfg = _config()
    assert sizing.sequence_splits(cfg, 16, 4096) == [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2)]
    assert sizing.sequence_splits(cfg, 16, 4104) == [(1, 1), (2, 1), (4, 1), (8, 1)]  # 4104 = 8·513: not 32
    assert sizing.sequence_splits(cfg, 16, 4096, attention=FLASH) == [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2)]


def test_suggest_ranks_long_context_meshes_first_when_only_they_fit():
    """At a long sequence with a budget that one rank's whole rows exceed, the suggestions that fit split the
    sequence; with no budget, the least communication first. (A wide model, where the tokens'
    values outweigh the gathered keys and values.)"""
    cfg = _config(hidden_size=2048, head_dim=128, moe_intermediate_size=1024)
    common = dict(micro_batch=1, seq=8192, param_dtype="fp32")
    everything = sizing.suggest(cfg, 8, top=100, **common)
    comm = [e.comm_total for e in everything]
    assert comm == sorted(comm) and any(e.mesh.get("sp", 1) * e.mesh.get("cp", 1) == 1 for e in everything)
    budget = sorted(e.peak_bytes for e in everything)[len(everything) // 4]
    fitting = sizing.suggest(cfg, 8, memory_budget=budget, top=100, **common)
    assert fitting and all(e.peak_bytes <= budget for e in fitting)
    assert all(e.mesh.get("sp", 1) * e.mesh.get("cp", 1) > 1 for e in fitting)
    assert any(e.mesh.get("sp", 1) > 1 for e in fitting)
    closest = sizing.suggest(cfg, 8, memory_budget=1.0, top=3, **common)  # nothing fits: least memory first
    assert [e.peak_bytes for e in closest] == sorted(e.peak_bytes for e in everything)[:3]


@pytest.mark.parametrize("sp,cp", [(1, 1), (4, 1), (1, 4), (2, 2)])
def test_flex_is_sized_as_flash_no_mask_and_grouped_key_value_heads(sp, cp):
    """flex_attention (a BlockMask of block indices, enable_gqa) keeps what flash keeps; the size command takes it."""
    cfg = _config()
    assert _terms(cfg, 4096, sp=sp, cp=cp, attention="flex_attention") == _terms(cfg, 4096, sp=sp, cp=cp,
                                                                                  attention=FLASH)


@pytest.mark.parametrize("attention", sizing.ATTENTION_IMPLEMENTATIONS)
def test_the_size_command_offers_every_attention_the_sizer_models(attention):
    from xpar_zoo.commands import cli

    args = cli.build_parser().parse_args(["size", "qwen3_moe", "--world", "4", "--attention", attention])
    assert args.attention == attention


@pytest.mark.parametrize("sp,cp", [(1, 1), (1, 4), (2, 2)])
def test_the_sizer_counts_the_dsa_indexer_scores_and_its_masks(sp, cp):
    """deepseek_v32: without sp/cp transformers' indexer scores the whole row (``[b, S, heads, S]`` float32, its ReLU,
    the summed scores and the mask) and every layer keeps its ``[b, 1, S, S]`` mask with the top-k folded in; under
    sp/cp the indexer runs a block of queries at a time under the budget, and a layer's mask beyond it is a block's."""
    from xpar_zoo.styles.sequence_indexed import indexer_query_bytes

    config = parity.tiny_config("deepseek_v32", index_n_heads=4, num_hidden_layers=2, layer_types=None)
    seq = 8192
    est = sizing.estimate(config, 4, {}, micro_batch=1, seq=seq, sp=sp, cp=cp, param_dtype="fp32")
    transient = est.memory["indexer scores (one layer's, transient)"]
    if sp * cp == 1:
        assert transient == indexer_query_bytes(1, 4, seq) * seq  # 8·heads + 9 bytes per query and key
        assert est.memory["indexed attention masks (seq², kept per indexed layer)"] == 2 * seq * seq  # sdpa: bool
    else:
        assert transient <= ParallelOptions().block_budget(None)
        assert "indexed attention masks (seq², kept per indexed layer)" not in est.memory
