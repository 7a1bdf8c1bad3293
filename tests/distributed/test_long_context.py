"""Long context (sp: Ulysses, cp: context parallelism) trains exactly like single-process transformers on the whole
global batch (4 gloo ranks, fp32, one SGD(lr=1) step): loss within 1e-5, gradient norm within 1e-5 (relative),
every parameter within 1e-4 of its update. Each rank of an sp·cp group passes the same full-length rows (its data
shard: ``xpar_zoo.data_shard``); the reference runs every micro-batch at once. Labels ignore a random prefix of
every row (one micro-batch has none), so the ranks hold unequal numbers of valid targets.

Cases: qwen3_moe on sp, sp+ep, sp=4 over 2 key/value heads (repeated), cp+ep, sp+cp, sp+ep+emb+head, on plain
and on packed rows (position_ids restart per document: no token attends across a boundary, also across cp
chunks) and right-padded rows, with eager and sdpa inner attention; a dense model (qwen3) on sp=4 and cp=4;
mixtral and gemma4_text with a sliding window; gpt_oss (attention sinks, sliding and full layers); deepseek_v2/v3
(MLA: q/k head dim 16, v head dim 8); hybrid qwen3_next (gated delta net layers on the group's whole rows) on sp+ep,
cp, sp+cp, packed, right-padded and checkpointed, and minimax (lightning attention), jamba and granitemoehybrid
(mamba), lfm2_moe (short convolution) and kimi_linear (delta attention) right-padded; activation
checkpointing; DSA indexers (deepseek_v32, glm_moe_dsa), zaya's convolutional projection and deepseek_v4's
compressed attention (CSA and HCA layers) on sp+ep, cp, cp+ep and sp+cp, plain and packed; inkling's and
inkling2's (plain and loop) relative-position biases, log-scaled queries and short convolutions, qwen4_exp's selection indexer and minimax_m3's block indexer on
sp+ep and cp or sp+cp, plain and packed; the blocked masked
attention under a tiny block budget (sdpa and eager, cp and sp+cp, packed,
padded, windows, sinks, with checkpointing); three clipped AdamW steps. The
same launched run checks ``shard_sequence``, ``data_shard`` and the refusals that need ranks. One 4-rank run for
all (the zoo's: tests/conftest.py ``zoo_proofs``)."""

import pytest

from xpar_zoo.testing import parity

SEQ = 16
QWEN3_MOE = ("qwen3_moe", {})
QWEN3_NEXT = ("qwen3_next", {})
# indexed sparse attention (DSA): the indexer keeps 4 of a row's 16 keys per query, so the top-k over the whole row
# decides what each query sees; glm_moe_dsa's middle layer reuses the first layer's top-k ("FSF")
DSA_V32 = ("deepseek_v32", {"index_topk": 4})
DSA_GLM = ("glm_moe_dsa", {"index_topk": 4, "index_topk_pattern": "FSF"})
# compressed attention (deepseek_v4): a CSA layer pools windows of 2 tokens (8 entries a row of 16, its indexer
# keeps 3 per query), an HCA layer windows of 4, a sliding layer (window 4) keys of its own
V4 = ("deepseek_v4", {"compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                      "index_topk": 3, "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention",
                                                       "sliding_attention"]})
# a relative-position bias and log-scaled queries from the positions the attention is given (inkling): a sliding
# layer (window 4), two full layers whose bias reaches 6 tokens back and whose queries scale beyond position 2
INKLING = ("inkling_text", {"layer_types": ["hybrid_sliding", "hybrid", "hybrid"], "log_scaling_n_floor": 2,
                            "rel_extent": 6})
# inkling2: the bias over the distances its model hands the attention, recomputed by its modeling module from the
# row cache; its dynamic short convolutions (taps projected per token from a second input) with a halo of both
# inputs; the loop model runs its middle layer twice
INKLING2 = {"layer_types": ["hybrid_sliding", "hybrid", "hybrid"], "log_scaling_n_floor": 2, "rel_extent": 6}
CASES = {
    # name: ((model_type, config overrides), mesh, rows: plain (False), packed (True) or right-"padded")
    "qwen3_moe_sp2": (QWEN3_MOE, {"sp": 2}, False),
    "qwen3_moe_sp2_sdpa": (("qwen3_moe", {"attn_implementation": "sdpa"}), {"sp": 2}, False),
    "qwen3_moe_sp2_ep2": (QWEN3_MOE, {"sp": 2, "ep": 2}, False),
    "qwen3_moe_sp4_kv2": (QWEN3_MOE, {"sp": 4}, False),
    "qwen3_moe_cp2_ep2": (QWEN3_MOE, {"cp": 2, "ep": 2}, False),
    "qwen3_moe_sp2_cp2": (QWEN3_MOE, {"sp": 2, "cp": 2}, False),
    "qwen3_moe_sp2_ep2_emb2_head2": (QWEN3_MOE, {"sp": 2, "ep": 2, "emb": 2, "head": 2}, False),
    "qwen3_moe_cp2_strided_sp2": (QWEN3_MOE, {"sp": 2, "cp": 2, "innermost": {"sp": False}}, False),
    "packed_qwen3_moe_sp2": (QWEN3_MOE, {"sp": 2}, True),
    "packed_qwen3_moe_sp2_ep2": (QWEN3_MOE, {"sp": 2, "ep": 2}, True),
    "packed_qwen3_moe_sp4_kv2": (QWEN3_MOE, {"sp": 4}, True),
    "packed_qwen3_moe_cp2_ep2": (QWEN3_MOE, {"cp": 2, "ep": 2}, True),
    "packed_qwen3_moe_cp2_ep2_sdpa": (("qwen3_moe", {"attn_implementation": "sdpa"}), {"cp": 2, "ep": 2}, True),
    "packed_qwen3_moe_sp2_cp2": (QWEN3_MOE, {"sp": 2, "cp": 2}, True),
    "packed_qwen3_moe_sp2_ep2_emb2_head2": (QWEN3_MOE, {"sp": 2, "ep": 2, "emb": 2, "head": 2}, True),
    "padded_qwen3_moe_sp2_cp2": (QWEN3_MOE, {"sp": 2, "cp": 2}, "padded"),
    "padded_qwen3_moe_sp2_ep2_sdpa": (("qwen3_moe", {"attn_implementation": "sdpa"}), {"sp": 2, "ep": 2}, "padded"),
    "qwen3_sp4": (("qwen3", {}), {"sp": 4}, False),
    "qwen3_cp4": (("qwen3", {}), {"cp": 4}, False),
    "packed_qwen3_cp4": (("qwen3", {}), {"cp": 4}, True),
    "mixtral_window4_sp2_cp2": (("mixtral", {"sliding_window": 4}), {"sp": 2, "cp": 2}, True),
    "gpt_oss_sinks_sp2_ep2": (("gpt_oss", {}), {"sp": 2, "ep": 2}, False),
    # not packed: transformers' gpt_oss attends across packed documents in one process (its mask ignores them)
    "gpt_oss_sinks_cp2_sp2": (("gpt_oss", {}), {"cp": 2, "sp": 2}, False),
    "gemma4_text_window4_sp2_cp2": (("gemma4_text", {}), {"sp": 2, "cp": 2}, True),
    "deepseek_v2_mla_sp2_cp2": (("deepseek_v2", {}), {"sp": 2, "cp": 2}, True),
    "deepseek_v3_mla_sp2_ep2": (("deepseek_v3", {}), {"sp": 2, "ep": 2}, False),
    "deepseek_v3_mla_cp4": (("deepseek_v3", {}), {"cp": 4}, True),
    # hybrid: the gated delta net layers run on the group's whole rows (xpar_zoo.styles.sequence_mixers); packed
    # rows as single-process transformers runs them (its gated delta net does not see the documents: nor does ours)
    "qwen3_next_gdn_sp2_ep2": (QWEN3_NEXT, {"sp": 2, "ep": 2}, False),
    "qwen3_next_gdn_cp2": (QWEN3_NEXT, {"cp": 2}, False),
    "qwen3_next_gdn_sp2_cp2": (QWEN3_NEXT, {"sp": 2, "cp": 2}, False),
    "packed_qwen3_next_gdn_sp2_cp2": (QWEN3_NEXT, {"sp": 2, "cp": 2}, True),
    "padded_qwen3_next_gdn_sp2_cp2": (QWEN3_NEXT, {"sp": 2, "cp": 2}, "padded"),
    "padded_qwen3_next_gdn_cp2_ep2": (QWEN3_NEXT, {"cp": 2, "ep": 2}, "padded"),
    "padded_minimax_lightning_sp2_cp2": (("minimax", {}), {"sp": 2, "cp": 2}, "padded"),
    # the other kinds of mixer on right-padded rows (the whole rows' padding mask reaches each): mamba (jamba,
    # granitemoehybrid), a short convolution (lfm2_moe), delta attention (kimi_linear)
    "padded_jamba_mamba_sp2_cp2": (("jamba", {}), {"sp": 2, "cp": 2}, "padded"),
    "padded_granitemoehybrid_mamba_cp2_ep2": (("granitemoehybrid", {}), {"cp": 2, "ep": 2}, "padded"),
    "padded_lfm2_moe_conv_sp2_cp2": (("lfm2_moe", {}), {"sp": 2, "cp": 2}, "padded"),
    "padded_kimi_linear_delta_sp2_cp2": (("kimi_linear", {}), {"sp": 2, "cp": 2}, "padded"),
    # indexed sparse attention: the indexer scores this rank's queries against the whole row's keys, the attention
    # masks every key a query did not select (xpar_zoo.styles.sequence_indexed)
    "dsa_deepseek_v32_sp2_ep2": (DSA_V32, {"sp": 2, "ep": 2}, False),
    "packed_dsa_deepseek_v32_sp2_ep2": (DSA_V32, {"sp": 2, "ep": 2}, True),
    "dsa_deepseek_v32_cp2": (DSA_V32, {"cp": 2}, False),
    "packed_dsa_deepseek_v32_cp2": (DSA_V32, {"cp": 2}, True),
    "dsa_deepseek_v32_cp2_ep2": (DSA_V32, {"cp": 2, "ep": 2}, False),
    "packed_dsa_deepseek_v32_cp2_ep2": (DSA_V32, {"cp": 2, "ep": 2}, True),
    "dsa_deepseek_v32_sp2_cp2": (DSA_V32, {"sp": 2, "cp": 2}, False),
    "packed_dsa_deepseek_v32_sp2_cp2": (DSA_V32, {"sp": 2, "cp": 2}, True),
    "dsa_glm_moe_dsa_sp2_ep2": (DSA_GLM, {"sp": 2, "ep": 2}, False),
    "packed_dsa_glm_moe_dsa_sp2_ep2": (DSA_GLM, {"sp": 2, "ep": 2}, True),
    "dsa_glm_moe_dsa_cp2": (DSA_GLM, {"cp": 2}, False),
    "packed_dsa_glm_moe_dsa_cp2": (DSA_GLM, {"cp": 2}, True),
    "dsa_glm_moe_dsa_cp2_ep2": (DSA_GLM, {"cp": 2, "ep": 2}, False),
    "packed_dsa_glm_moe_dsa_cp2_ep2": (DSA_GLM, {"cp": 2, "ep": 2}, True),
    "dsa_glm_moe_dsa_sp2_cp2": (DSA_GLM, {"sp": 2, "cp": 2}, False),
    "packed_dsa_glm_moe_dsa_sp2_cp2": (DSA_GLM, {"sp": 2, "cp": 2}, True),
    # zaya's CCA projection (causal convolutions over q/k, a value half from the previous token): each run of a
    # rank's tokens with a halo of the tokens before it (xpar_zoo.styles.sequence_halo); cp=4's chunks of 2 tokens
    # are shorter than the halo of 3
    "zaya_cca_sp2_ep2": (("zaya", {}), {"sp": 2, "ep": 2}, False),
    "packed_zaya_cca_cp4": (("zaya", {}), {"cp": 4}, True),
    "padded_zaya_cca_sp2_cp2": (("zaya", {}), {"sp": 2, "cp": 2}, "padded"),
    # compressed attention: the compressor pools the whole row's windows (its projections gathered), this rank's
    # queries see the entries its bias allows (xpar_zoo.styles.sequence_compressed); packed rows as one process
    # runs them (the entries span the whole row)
    "v4_compressed_sp2_ep2": (V4, {"sp": 2, "ep": 2}, False),
    "v4_compressed_cp2": (V4, {"cp": 2}, False),
    "v4_compressed_cp2_ep2": (V4, {"cp": 2, "ep": 2}, False),
    "v4_compressed_sp2_cp2": (V4, {"sp": 2, "cp": 2}, False),
    "packed_v4_compressed_sp2_cp2": (V4, {"sp": 2, "cp": 2}, True),
    # positioned attention: the module's own code builds the bias of this rank's queries against the whole row's
    # keys from a row cache (xpar_zoo.styles.sequence_positioned); its short convolutions run with a halo
    "inkling_positioned_sp2_ep2": (INKLING, {"sp": 2, "ep": 2}, False),
    "packed_inkling_positioned_cp2": (INKLING, {"cp": 2}, True),
    "inkling2_positioned_sp2_ep2": (("inkling2_text", INKLING2), {"sp": 2, "ep": 2}, False),
    "packed_inkling2_loop_positioned_cp2": (("inkling2_loop_text", INKLING2), {"cp": 2}, True),
    # a selection indexer (qwen4_exp's QSA: 2 blocks of 2 keys and the tail per query, a dense mask out) on this
    # rank's queries against the whole row's keys, the selection masked on the gathered keys
    "qsa_qwen4_exp_text_sp2_ep2": (("qwen4_exp_text", {}), {"sp": 2, "ep": 2}, False),
    "packed_qsa_qwen4_exp_text_cp2": (("qwen4_exp_text", {}), {"cp": 2}, True),
    # a block indexer (minimax_m3: per key/value head 2 of a row's 4 blocks of 4 keys), on sp+cp: the per-head
    # choice gathered over sp and sliced to this rank's heads
    "blocks_minimax_m3_sp2_cp2": (("minimax_m3_vl_text", {}), {"sp": 2, "cp": 2}, False),
    "packed_blocks_minimax_m3_sp2_ep2": (("minimax_m3_vl_text", {}), {"sp": 2, "ep": 2}, True),
}
# cp on plain rows with sdpa, on the lower-right path (no dense mask: each query chunk against the key prefix that
# ends where it ends; the default on CUDA and the CPU, told here), name -> case as in CASES
SDPA = {"attn_implementation": "sdpa"}
LOWER_RIGHT = {
    "lower_right_qwen3_moe_cp2_ep2_sdpa": (("qwen3_moe", SDPA), {"cp": 2, "ep": 2}, False),
    "lower_right_qwen3_moe_sp2_cp2_sdpa": (("qwen3_moe", SDPA), {"sp": 2, "cp": 2}, False),
    "lower_right_qwen3_cp4_sdpa": (("qwen3", SDPA), {"cp": 4}, False),
}
# The blocked masked attention (a block of queries at a time, each block's mask rebuilt in backward), forced onto
# these tiny rows by a block budget of 512 bytes (1-2 queries per block) and cp_attention="dense" (cp's plain rows
# on sdpa take the mask): name -> case as in CASES
BLOCK_MIB = 0.0005
BLOCKED = {
    "blocked_qwen3_moe_cp2_ep2_sdpa": (("qwen3_moe", SDPA), {"cp": 2, "ep": 2}, False),
    "blocked_qwen3_cp4_sdpa": (("qwen3", SDPA), {"cp": 4}, False),
    "blocked_packed_qwen3_moe_sp2_cp2": (QWEN3_MOE, {"sp": 2, "cp": 2}, True),
    "blocked_padded_qwen3_moe_sp2_cp2": (QWEN3_MOE, {"sp": 2, "cp": 2}, "padded"),
    "blocked_padded_qwen3_moe_sp2_ep2_sdpa": (("qwen3_moe", SDPA), {"sp": 2, "ep": 2}, "padded"),
    "blocked_mixtral_window4_sp2_cp2": (("mixtral", {"sliding_window": 4}), {"sp": 2, "cp": 2}, True),
    "blocked_gpt_oss_sinks_cp2_sp2": (("gpt_oss", {}), {"cp": 2, "sp": 2}, False),
    # the indexer a query or two at a time too (its scores over the budget), and the selection per block
    "blocked_packed_dsa_deepseek_v32_sp2_cp2_sdpa": (("deepseek_v32", {**DSA_V32[1], **SDPA}), {"sp": 2, "cp": 2},
                                                     True),
    "blocked_packed_dsa_glm_moe_dsa_cp2_ep2": (DSA_GLM, {"cp": 2, "ep": 2}, True),
    # each block with the compressed entries after its keys
    "blocked_packed_v4_compressed_cp2_ep2": (V4, {"cp": 2, "ep": 2}, True),
}
# flash_attention_2 as the inner attention, on CPU through a reference of the flash kernels' contract
# (xpar_zoo.testing.flash_reference, pure torch: no mask, causal aligned bottom-right, window_size, softcap, sinks,
# varlen by cu_seqlens) put where transformers keeps the kernels it imports from flash_attn: transformers' own flash
# path (flash_attention_forward, _flash_attention_forward: unpadding, varlen kwargs, window and sink arguments, the MLA
# value padding) runs unchanged around it. set_inner_attention(model, "flash_attention_2") after parallelize is how a
# tiny model takes flash here (transformers would refuse to load it with flash without the package); the reference
# is single-process transformers with the config's own attention (sdpa; eager for gpt_oss, which has no sdpa).
# Training (one SGD step), so the gradients through the per-run and varlen calls are proved too.
FLASH_CASES = {
    "flash_qwen3_moe_sp2_ep2": (("qwen3_moe", SDPA), {"sp": 2, "ep": 2}, False),
    "flash_packed_qwen3_moe_cp2_ep2": (("qwen3_moe", SDPA), {"cp": 2, "ep": 2}, True),
    "flash_left_padded_qwen3_moe_sp2_cp2": (("qwen3_moe", SDPA), {"sp": 2, "cp": 2}, "left_padded"),
    "flash_mixtral_window4_sp2_cp2": (("mixtral", {**SDPA, "sliding_window": 4}), {"sp": 2, "cp": 2}, True),
    "flash_gpt_oss_sinks_cp2_sp2": (("gpt_oss", {}), {"cp": 2, "sp": 2}, False),
    "flash_deepseek_v3_mla_cp4": (("deepseek_v3", SDPA), {"cp": 4}, True),
}
# flex_attention as the inner attention against single-process transformers set to flex_attention. Forward only
# (loss, and the squared logits summed over every token): torch has no flex backward on CPU (its flex_attention
# refuses inputs that require grad there); the backward of the sp/cp collectives around it is the one the eager and
# sdpa cases prove. Each case compiles flex (transformers torch.compiles it, a mask of another form compiles again)
# on every rank: 20-50 s each on 2 cores with a cold compile cache, so two cases cover every part of the mask:
# packed documents on cp+ep, and a sliding window over left-padded rows on sp+cp. The single-process reference runs
# flex unfused (torch.compiler.set_stance("force_eager"): the same attention, without compiling transformers' mask
# as well); the sp/cp side compiles, as it runs in training.
FLEX = {"attn_implementation": "flex_attention"}
FLEX_CASES = {
    "flex_packed_qwen3_moe_cp2_ep2": (("qwen3_moe", FLEX), {"cp": 2, "ep": 2}, True),
    "flex_left_padded_mixtral_window4_sp2_cp2": (("mixtral", {**FLEX, "sliding_window": 4}), {"sp": 2, "cp": 2},
                                                 "left_padded"),
}
# Cases with more than one SGD step, or activation checkpointing: name -> (case above, train_parallel options)
VARIANTS = {
    "qwen3_moe_sp2_cp2_checkpointing": ("packed_qwen3_moe_sp2_cp2", {"checkpointing": True}),
    "blocked_qwen3_moe_sp2_cp2_checkpointing": ("packed_qwen3_moe_sp2_cp2", {"checkpointing": True,
                                                                            "attention_block_mib": BLOCK_MIB}),
    "qwen3_moe_sp2_ep2_adamw3_clipped": ("packed_qwen3_moe_sp2_ep2", {"optimizer": "adamw", "steps": 3,
                                                                     "max_norm": 0.5}),
    "qwen3_next_gdn_sp2_cp2_checkpointing": ("packed_qwen3_next_gdn_sp2_cp2", {"checkpointing": True}),
    "blocked_dsa_glm_moe_dsa_sp2_cp2_checkpointing": ("packed_dsa_glm_moe_dsa_sp2_cp2",
                                                      {"checkpointing": True, "attention_block_mib": BLOCK_MIB}),
}


def _config(model_type: str, overrides: dict):
    # eager unless asked: the reference's own sdpa differs from eager by more than the tolerance on some models;
    # use_cache=False: transformers applies the packed-documents mask only without a cache (a training forward)
    return parity.tiny_config(model_type, **{"attn_implementation": "eager", "use_cache": False, **overrides})


def packed_positions(world: int, batch: int, seq: int, seed: int = 3):
    """Per micro-batch ``{"position_ids": [batch, seq]}``: each row packs two or three documents (positions restart
    at random cuts)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world):
        pos = torch.arange(seq).repeat(batch, 1)
        for b in range(batch):
            cuts = sorted(set(torch.randint(1, seq - 1, (1 + b,), generator=g).tolist()))
            for cut in cuts:
                pos[b, cut:] = torch.arange(seq - cut)
        out.append({"position_ids": pos})
    return [out]


def padding_masks(world: int, batch: int, seq: int, left: bool = False):
    """Per micro-batch ``{"attention_mask": [batch, seq]}`` with right (or left) padding of a different length per
    row."""
    import torch

    out = []
    for r in range(world):
        mask = torch.ones(batch, seq, dtype=torch.long)
        for b in range(batch):
            mask[b, seq - 1 - 3 * ((r + b) % 4):] = 0
        out.append({"attention_mask": mask.flip(-1) if left else mask})
    return [out]


def _rows(kind, world: int, steps: int):
    if kind in ("padded", "left_padded"):
        return padding_masks(world, 2, SEQ, left=kind == "left_padded") * steps
    return packed_positions(world, 2, SEQ) * steps if kind else None


def _labels(kind, data, extra):
    """Left-padded rows ignore the padding's targets (flash and flex give a query with no key no output, sdpa and
    eager some: only the valid targets are the same); other rows keep parity.make_labels (None)."""
    import torch

    if kind != "left_padded":
        return None
    mask = torch.stack([torch.stack([e["attention_mask"] for e in step]) for step in extra])
    return parity.make_labels(data).masked_fill(mask == 0, -100)


def _cases(world: int) -> dict:
    import contextlib

    import torch.distributed as dist

    from xpar_zoo.parallel.options import ParallelOptions
    from xpar_zoo.testing import flash_reference

    rank = dist.get_rank()
    refs, results = {}, {}
    runs = {name: (case, {}) for name, case in CASES.items()}
    runs.update({name: (CASES[base], options) for name, (base, options) in VARIANTS.items()})
    runs.update({name: (case, {"cp_attention": "lower_right"}) for name, case in LOWER_RIGHT.items()})
    runs.update({name: (case, {"attention_block_mib": BLOCK_MIB, "cp_attention": "dense"})
                 for name, case in BLOCKED.items()})
    runs.update({name: (case, {"inner": "flash_attention_2"}) for name, case in FLASH_CASES.items()})
    for name, (((model_type, overrides), mesh, packed), options) in runs.items():
        options = dict(options)
        chosen = {k: options.pop(k) for k in ("cp_attention", "attention_block_mib") if k in options}
        optimizer, steps, max_norm = options.pop("optimizer", "sgd"), options.pop("steps", 1), options.pop("max_norm",
                                                                                                          None)
        config = _config(model_type, overrides)
        data = parity.make_batches(config.vocab_size, steps, world, batch=2, seq=SEQ, seed=1)
        extra = _rows(packed, world, steps)
        labels = _labels(packed, data, extra)
        key = (model_type, repr(sorted(overrides.items())), packed, optimizer, steps, max_norm)
        if rank == 0 and key not in refs:
            refs[key] = (parity.train_reference(_config(model_type, overrides), data, optimizer, max_norm,
                                                labels=labels, extra=extra), parity.build_model(config).state_dict())
        inner = options.get("inner")
        with flash_reference.installed(inner) if inner else contextlib.nullcontext():
            rec = parity.train_parallel(config, data, mesh, optimizer, max_norm, labels=labels, extra=extra,
                                        options=ParallelOptions(**chosen), **options)
        if rank == 0:
            ref, before = refs[key]
            results[name] = {"loss": (rec.losses, ref.losses), "norm": (rec.grad_norms, ref.grad_norms),
                             "errors": parity.param_errors(rec.params, ref.params, before),
                             "paths": rec.attention_paths}
    return results


def _flex_cases(world: int) -> dict:
    """FLEX_CASES: one forward without gradients, sp/cp on flex against single-process flex on the whole rows."""
    import torch
    import torch.distributed as dist

    out = {}
    for name, ((model_type, overrides), mesh, kind) in FLEX_CASES.items():
        config = _config(model_type, overrides)
        data = parity.make_batches(config.vocab_size, 1, world, batch=2, seq=SEQ, seed=1)
        extra = _rows(kind, world, 1)
        labels = _labels(kind, data, extra)
        ref = None
        if dist.get_rank() == 0:
            with torch.compiler.set_stance("force_eager"):
                ref = parity.forward_reference(config, data, labels=labels, extra=extra)
        ours = parity.forward_parallel(config, data, mesh, labels=labels, extra=extra)
        out[name] = {"loss": (ours[0], ref and ref[0]), "logits": (ours[1], ref and ref[1])}
    return out


def _semantics(world: int) -> dict:
    """shard_sequence and data_shard on one sp=2, cp=2 model, and the refusals that need ranks."""
    import torch
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.styles.sequence import set_inner_attention

    out = {}
    config = _config("qwen3_moe", {})
    model = xpar_zoo.parallelize(parity.build_model(config), xpar_zoo.Mesh(sp=2, cp=2))
    shards: list = [None] * world
    dist.all_gather_object(shards, xpar_zoo.data_shard(model))
    out["data_shard"] = shards
    plain = xpar_zoo.parallelize(parity.build_model(config), xpar_zoo.Mesh(ep=2))
    out["data_shard_without_sp"] = xpar_zoo.data_shard(plain)
    ids = parity.make_batches(config.vocab_size, 1, 1, batch=2, seq=SEQ, seed=5)[0, 0]
    labels = ids.clone()
    labels[:, :3] = -100
    pos = packed_positions(1, 2, SEQ)[0][0]["position_ids"]
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    with torch.no_grad():
        whole = model(**batch).loss
        part = xpar_zoo.shard_sequence(batch, model)
        given_part = model(**part).loss
    model.set_attn_implementation("sdpa")  # after parallelize (as a training script may): wrapped again
    with torch.no_grad():
        out["reset_to_sdpa"] = (model(**batch).loss.item(), whole.item(), model.config._attn_implementation)
    model.set_attn_implementation("eager")
    out["part_keys"] = sorted(k for k, v in part.items() if torch.is_tensor(v))
    out["part_len"] = part["input_ids"].shape[1]
    out["loss_whole_vs_part"] = (whole.item(), given_part.item())
    errors = {}
    for what, call in {
        "seq_not_divisible": lambda: model(input_ids=ids[:, :12], labels=ids[:, :12]),
        "rows_differ": lambda: model(input_ids=ids if dist.get_rank() != 3 else ids.flip(0), labels=ids),
        "generate": lambda: model.generate(input_ids=ids, max_new_tokens=2),
        "logits_to_keep": lambda: model(input_ids=ids, logits_to_keep=1),
        "part_twice": lambda: xpar_zoo.shard_sequence(part, model),
        "sp8_on_4_ranks": lambda: xpar_zoo.Mesh(sp=8),
        "flash_without_kernels": lambda: set_inner_attention(model, "flash_attention_2"),
        "flex_sinks_on_cpu": lambda: xpar_zoo.parallelize(parity.build_model(_config("gpt_oss", FLEX)),
                                                          xpar_zoo.Mesh(sp=2))(input_ids=ids),
        "sp_over_heads": lambda: xpar_zoo.parallelize(parity.build_model(_config("qwen3_moe", {
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16})), xpar_zoo.Mesh(sp=4)),
    }.items():
        try:
            call()
            errors[what] = None
        except xpar_zoo.XparError as e:
            errors[what] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


def _exactness(world: int, root: str) -> dict:
    """The router aux loss over the global batch, a checkpoint saved under sp/cp and loaded without, and LoRA."""
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    import xpar_zoo
    from xpar_zoo.hub.adapter_files import adapter_state
    from xpar_zoo.loss.balance import global_router_aux_loss

    rank, out = dist.get_rank(), {}
    config = _config("qwen3_moe", {})
    ids = parity.make_batches(config.vocab_size, 1, 1, batch=2, seq=SEQ, seed=6)[0, 0]
    pos = packed_positions(1, 2, SEQ, seed=4)[0][0]["position_ids"]
    reference = parity.build_model(config, experts_implementation="eager") if rank == 0 else None

    # the router aux loss of xpar_zoo.train.balance counts each token once over the sequence group
    model = xpar_zoo.parallelize(parity.build_model(config), xpar_zoo.Mesh(sp=2, cp=2))
    routed = model(input_ids=ids, position_ids=pos, output_router_logits=True)
    share, _ = global_router_aux_loss(routed.router_logits, config.num_experts, config.num_experts_per_tok)
    share = share.detach().clone()
    dist.all_reduce(share)
    if rank == 0:
        with torch.no_grad():
            ref = reference(input_ids=ids, position_ids=pos, output_router_logits=True).aux_loss
        out["aux_loss"] = (share.item() / world, ref.item())

    # sp/cp do not change the parameter layout: a checkpoint saved under sp=2, cp=2 loads on ep=2 alone
    xpar_zoo.save_checkpoint(root, model, step=1)
    saved = xpar_zoo.full_state_dict(model)
    plain = xpar_zoo.parallelize(parity.build_model(config, seed=9), xpar_zoo.Mesh(ep=2))
    xpar_zoo.load_checkpoint(root, plain)
    loaded = xpar_zoo.full_state_dict(plain)
    if rank == 0:
        out["checkpoint_equal"] = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k])
                                                                         for k in saved)

    # LoRA on the attention under sp=2, ep=2: one SGD step equals single-process PEFT on the whole rows
    lora = dict(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    labels = ids.clone()
    labels[:, :5] = -100

    def peft_step(model, batch):
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = parity.sgd(trainable)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    torch.manual_seed(11)
    tuned = xpar_zoo.parallelize(get_peft_model(parity.build_model(config), LoraConfig(**lora)),
                                 xpar_zoo.Mesh(sp=2, ep=2))
    tuned.train()
    loss = peft_step(tuned, {"input_ids": ids, "labels": labels, "position_ids": pos}).detach().clone()
    dist.all_reduce(loss)
    adapter = adapter_state(tuned)
    if rank == 0:
        torch.manual_seed(11)
        single = get_peft_model(parity.build_model(config, experts_implementation="eager"), LoraConfig(**lora))
        init = {k: v.detach().clone() for k, v in adapter_state(single).items()}
        ref_loss = peft_step(single, {"input_ids": ids, "labels": labels, "position_ids": pos})
        out["lora_loss"] = (loss.item() / world, ref_loss.item())
        out["lora_errors"] = parity.param_errors(adapter, adapter_state(single), init)
        out["lora_moved"] = sum((adapter[k] - init[k]).norm().item() for k in init)
    return out


def _job(world: int, root: str) -> dict:
    return {"cases": _cases(world), "flex": _flex_cases(world), "semantics": _semantics(world),
            "exactness": _exactness(world, root)}


def zoo_job(tmp_path_factory):
    from xpar_zoo.testing.proofs import PROOF_WORLD

    return _job, (PROOF_WORLD, str(tmp_path_factory.mktemp("long_context") / "ckpt"))


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


@pytest.mark.parametrize("case", [*CASES, *VARIANTS, *LOWER_RIGHT, *BLOCKED, *FLASH_CASES])
def test_training_matches_single_process_on_the_whole_rows(results, case):
    row = results["cases"][case]
    parity.assert_losses_match(*row["loss"], what=case)
    parity.assert_norms_match(*row["norm"], what=case)
    parity.assert_params_match(row["errors"], what=f"{case}, one SGD step:")


@pytest.mark.parametrize("case", [*FLEX_CASES])
def test_flex_attention_inner_matches_single_process_flex_on_the_whole_rows(results, case):
    """A forward under sp/cp with flex_attention inside (its BlockMask built from the global indices) equals
    single-process transformers on flex: the global-batch loss, and the squared logits of every token."""
    row = results["flex"][case]
    parity.assert_losses_match([row["loss"][0]], [row["loss"][1]], what=case)
    ours, reference = row["logits"]
    assert abs(ours - reference) <= 1e-6 * abs(reference), (case, ours, reference)


@pytest.mark.parametrize("case", [*LOWER_RIGHT])
def test_cp_on_plain_rows_runs_sdpa_without_a_mask_on_the_lower_right_path(results, case):
    """The lower-right cases above ran every attention layer through it, and the others (eager; packed or padded
    rows; sdpa told ``cp_attention="dense"``) never did: the paths the wrapper chose."""
    assert set(results["cases"][case]["paths"]) == {"lower_right"}, results["cases"][case]["paths"]
    assert not any("lower_right" in row["paths"] for name, row in results["cases"].items() if name not in LOWER_RIGHT)


BLOCKED_VARIANTS = ("blocked_qwen3_moe_sp2_cp2_checkpointing", "blocked_dsa_glm_moe_dsa_sp2_cp2_checkpointing")


@pytest.mark.parametrize("case", [*BLOCKED, *BLOCKED_VARIANTS])
def test_a_mask_over_the_block_budget_runs_a_block_of_queries_at_a_time(results, case):
    """The cases under a tiny block budget ran their masked attention blocked (the values above: exact), and the
    others (a whole mask of a few KiB, within the default 16 MiB) built the whole mask once per forward."""
    assert results["cases"][case]["paths"].get("blocked", 0) > 0, results["cases"][case]["paths"]
    blocked = {*BLOCKED, *BLOCKED_VARIANTS}
    assert not any("blocked" in row["paths"] for name, row in results["cases"].items() if name not in blocked)
    indexed = "_dsa_" in case
    assert ("indexer_blocked" in results["cases"][case]["paths"]) == indexed, case  # its indexer in blocks too
    assert not any("indexer_blocked" in row["paths"] for name, row in results["cases"].items() if name not in blocked)


def test_data_shard_gives_the_ranks_of_a_sequence_group_one_index(results):
    sem = results["semantics"]
    assert sem["data_shard"] == [(0, 1)] * 4  # sp=2 x cp=2 on 4 ranks: one group reads the whole batch
    assert sem["data_shard_without_sp"] == (0, 4)  # rank 0 of 4 without sp/cp


def test_shard_sequence_hands_the_model_its_part_with_the_same_loss(results):
    sem = results["semantics"]
    assert sem["part_len"] == SEQ // 4
    assert sem["part_keys"] == ["input_ids", "labels", "position_ids", "shift_labels"]
    whole, part = sem["loss_whole_vs_part"]
    assert abs(whole - part) < 1e-6


def test_an_attention_implementation_set_after_parallelize_is_wrapped_again(results):
    loss, before, implementation = results["semantics"]["reset_to_sdpa"]
    assert implementation == "xpar_seq_sdpa"
    assert abs(loss - before) < 1e-5


def test_router_aux_loss_over_the_global_batch_counts_each_token_once(results):
    ours, reference = results["exactness"]["aux_loss"]
    assert abs(ours - reference) < 1e-6


def test_a_checkpoint_saved_with_sp_and_cp_loads_on_a_mesh_without_them(results):
    assert results["exactness"]["checkpoint_equal"]


def test_lora_under_sp_matches_single_process_peft(results):
    parity.assert_losses_match([results["exactness"]["lora_loss"][0]], [results["exactness"]["lora_loss"][1]], "lora")
    parity.assert_params_match(results["exactness"]["lora_errors"], "lora sp2 ep2, one SGD step:")
    assert results["exactness"]["lora_moved"] > 1e-2  # the adapters trained


@pytest.mark.parametrize("what, expected", [
    ("seq_not_divisible", "BatchError: sequence length 12 does not divide by 2·cp·sp = 2·2·2 = 8"),
    ("rows_differ", "BatchError: sp/cp: the ranks of a sequence group (sp=2 x cp=2) were given different rows"),
    ("generate", "ModelStateError: generate is not supported on an sp/cp mesh (sp=2, cp=2)"),
    ("logits_to_keep", "BatchError: sp/cp: logits_to_keep=1 would keep the last tokens of this rank's part"),
    ("part_twice", "BatchError: shard_sequence: the batch is already this rank's part"),
    ("sp8_on_4_ranks", "MeshError: sp=8 does not divide the ranks of a replica (4: world 4 / replicate 1)"),
    ("flash_without_kernels", "PlanError: sp=2, cp=2: flash_attention_2 is not available here (no flash_attn kernels"),
    ("flex_sinks_on_cpu", "PlanError: sp/cp: GptOssAttention has attention sinks (s_aux), which flex_attention serves "
                          "only on CUDA"),
    ("sp_over_heads", "PlanError: sp=4 does not divide the 2 query heads of Qwen3MoeForCausalLM; use sp=2, cp=2 "
                      "instead (cp is not limited by heads)"),
])
def test_bad_sizes_and_calls_get_one_clear_line(results, what, expected):
    message = results["semantics"]["errors"][what]
    assert message is not None and message.startswith(expected), message
    assert "\n" not in message
