"""The mesh sizer behind ``xpar-zoo size``: per-rank memory and per-step communication of a model on a mesh,
computed from the real model built on the meta device (exact parameter counts per FSDP unit and per plan, from the
same :mod:`~xpar_zoo.parallel.fsdp_layout` that ``parallelize`` applies), and a ranking of the meshes that fit a world size.

Communication is the bytes each rank sends per training step, per collective (FSDP all-gather and reduce-scatter,
HSDP all-reduce, EP all-to-all, ``emb`` and ``head`` exchanges). Memory is the sharded parameters, gradients and
optimizer states, the gathered units, FSDP2's chunk-cat temporary for dim-1 tensors and an activation estimate
(:func:`activation_bytes`); each estimate names the dim FSDP2 shards each plan's tensors on
(:func:`~xpar_zoo.parallel.fsdp_layout.planned_shard_dim`). The model term by term, and its measured accuracy:
``docs/design.md``, "Sizing".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import BatchError, PlanError
from ..loss.fused import CE_CHUNK_ELEMENTS
from ..parallel.fsdp_layout import fsdp_layout
from ..parallel.mesh import validate_sequence_sizes, validate_sizes
from ..parallel.options import ATTENTION_BLOCK_MIB, ParallelOptions
from ..styles.planned import check_plan_names, match_plan, whole_vocab_head_fusable
from ..styles.sequence import INNER_IMPLEMENTATIONS, recurrent_layers
from ..styles.sequence_indexed import (
    INDEXED_LAYER_TYPES,
    indexed_attention_bytes,
    indexed_layer_count,
)
from ..styles.sequence_layout import check_heads, check_sequence_length, kv_repeat
from ..styles.sequence_mixers import ATTENTION_LAYER_TYPES, CHANNEL_LAYER_TYPES
from ..styles.sequence_paths import (
    AttentionSizes,
    InnerPath,
    MaskKind,
    attention_query_bytes,
    block_rows,
    choose_inner_attention,
)
from ..zoo.plan import Plan, match_parameters
from ..zoo.registry import get_plan

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


GRADIENTS = "gradients (fp32 shards)"
# the memory terms the optimizer step holds: the weights (or the frozen base and the adapters), gradients, states
WEIGHT_TERMS = ("parameters", "frozen base", "adapters", "gradients", "optimizer states")


@dataclass
class Unit:
    """One FSDP communication group: ``numel_padded`` elements all-gathered over ``group`` ranks."""

    name: str
    numel: int
    numel_padded: int
    group: int
    replicate: int
    root: bool = False
    gathers: int = 2  # per step: forward and backward; 1 where parameters stay unsharded after forward
    trainable_padded: int | None = None  # of numel_padded, what requires grad (None: all of it)
    dim1_numel: int = 0  # elements of its tensors FSDP2 shards on dim 1 (a chunk-cat copy per gather / reduce)
    plan_name: str | None = None
    shard_dims: dict[str, int] = field(default_factory=dict)  # planned units: {parameter FQN: FSDP shard dim}

    @property
    def trainable(self) -> int:
        return self.numel_padded if self.trainable_padded is None else self.trainable_padded


@dataclass
class Estimate:
    """Per-rank memory (bytes) and per-step communication (bytes sent per rank, by collective)."""

    mesh: dict
    memory: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    lora: dict | None = None  # with LoRA: its rank and the adapter's parameter count
    placement: dict[str, dict[str, int]] = field(default_factory=dict)  # plan -> {"dim 0": tensors, "dim 1": …}
    tokens_per_rank: int = 0  # of a micro-batch, outside attention (seq·micro_batch / (sp·cp))

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def peak_bytes(self) -> float:
        """The per-rank peak of a training step: the larger of forward/backward's (every term but the gradients,
        which ``zero_grad`` frees and backward makes only as it frees the activations) and the optimizer step's
        (weights, gradients and optimizer states)."""
        grads = self.memory.get(GRADIENTS, 0.0)
        weights = sum(v for k, v in self.memory.items() if k.startswith(WEIGHT_TERMS))
        return max(self.memory_total - grads, weights)

    @property
    def comm_total(self) -> float:
        return sum(self.comm.values())


def meta_model(config) -> nn.Module:
    """The transformers causal-LM of ``config`` on the meta device (no memory, exact shapes)."""
    from ..zoo.registry import build_meta

    return build_meta(config, torch.float32)


def _padded(shape: torch.Size, ranks: int) -> int:
    if not shape:
        return ranks
    return math.ceil(shape[0] / ranks) * ranks * math.prod(shape[1:])


def fsdp_units(model: nn.Module, plan: Plan, world: int, sizes: dict[str, int], replicate: int) -> list[Unit]:
    """The FSDP units ``parallelize`` builds for this mesh (the same :func:`~xpar_zoo.parallel.fsdp_layout.fsdp_layout`),
    with their sizes (no process group needed)."""
    shard = world // replicate
    active = {n: s for n, s in sizes.items() if s > 1}
    params = dict(model.named_parameters())
    units = []
    for u in fsdp_layout(model, plan, match_plan(model, plan, active, shard), sizes=active, shard_size=shard):
        if u.kind == "planned":
            s = active[u.plan_name]
            local = {f: torch.Size([params[f].shape[0] // s, *params[f].shape[1:]]) for f in u.params}

            def padded(names, u=u, local=local, s=s):  # dim-1 shards are even (checked); dim 0 pads the local slice
                return sum(local[f].numel() if u.shard_dim(f) else _padded(local[f], shard // s) for f in names)
            units.append(Unit(u.fqn, sum(n.numel() for n in local.values()), padded(u.params), shard // s, replicate,
                              gathers=1 + u.reshard_after_forward, plan_name=u.plan_name,
                              dim1_numel=sum(n.numel() for f, n in local.items() if u.shard_dim(f)),
                              shard_dims={f: u.shard_dim(f) for f in u.params},
                              trainable_padded=padded([f for f in u.params if params[f].requires_grad])))
        else:
            units.append(Unit(u.fqn or "<root>", sum(params[f].numel() for f in u.params),
                              sum(_padded(params[f].shape, shard) for f in u.params), shard, replicate,
                              root=u.kind == "root", gathers=1 + u.reshard_after_forward,
                              trainable_padded=sum(_padded(params[f].shape, shard) for f in u.params
                                                   if params[f].requires_grad)))
    return units


# The attention implementations the sizer models (transformers' names): sdpa, flex and the flash kernels keep no
# score matrix (flex and flash: the key/value heads grouped, no mask; flex's BlockMask holds block indices only);
# eager keeps its softmax (fp32) and, in a lower compute dtype, the copy its second matmul reads.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
# What the sp/cp attention wraps (xpar_zoo.styles.sequence): the sized ones and flex_attention.
SEQUENCE_ATTENTION = INNER_IMPLEMENTATIONS


def sequence_parts(seq: int, sp: int = 1, cp: int = 1) -> int:
    """The equal parts a row of ``seq`` tokens is cut into for ``sp`` Ulysses and ``cp`` context ranks: ``2·cp·sp``
    with cp (each cp rank keeps a head and a tail chunk, cut again over sp), ``sp`` without; raise
    :class:`~xpar_zoo.errors.BatchError` naming the numbers when ``seq`` does not divide by it (the rule of
    :func:`xpar_zoo.styles.sequence.check_sequence_length`)."""
    check_sequence_length(seq, sp, cp)
    return 2 * cp * sp if cp > 1 else sp


def attention_heads(config, sp: int = 1) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of one rank inside attention under Ulysses ``sp``: ``heads/sp`` query
    heads, and the key/value heads repeated (:func:`kv_repeat`) then split by ``sp``. Raises
    :class:`~xpar_zoo.errors.PlanError` when ``sp`` does not divide the query heads (cp is not limited by heads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    check_heads(heads, sp, config.model_type)
    return heads // sp, kv_heads * kv_repeat(heads, kv_heads, sp) // sp


def sequence_refusal(config, attention: str = "sdpa", model: nn.Module | None = None) -> str | None:
    """Why ``config``'s model cannot split its sequence with sp or cp at all (``None``: it can): sequence mixing that
    sp/cp cannot run on whole rows (``parallelize``'s own check on ``model``, default the meta model of
    ``config``), or an attention that sp/cp does not wrap. Hybrid linear-attention / SSM layers run gathered."""
    unserved = recurrent_layers(model if model is not None else meta_model(config))
    if unserved:
        return (f"{config.model_type} has sequence mixing that sp/cp cannot run on whole rows "
                f"({'; '.join(unserved)}); sp and cp are refused for it")
    if attention not in SEQUENCE_ATTENTION:
        return f"attention {attention!r} is not supported under sp/cp; use one of {', '.join(SEQUENCE_ATTENTION)}"
    return None


def whole_row_layers(config) -> int:
    """How many layers of ``config`` are sequence mixers that run on the whole rows of the group under sp/cp
    (:mod:`xpar_zoo.styles.sequence_mixers`): their ``config.layer_types`` other than attention (indexed attention
    too) or MLP/MoE."""
    kinds = getattr(config, "layer_types", None) or ()
    attention = ATTENTION_LAYER_TYPES | CHANNEL_LAYER_TYPES | INDEXED_LAYER_TYPES
    return sum(1 for k in kinds if k not in attention)


def check_long_context(config, world: int, replicate: int, seq: int, sp: int = 1, cp: int = 1,
                       attention: str = "sdpa", model: nn.Module | None = None) -> None:
    """Raise one clear error (:class:`~xpar_zoo.errors.MeshError`, :class:`~xpar_zoo.errors.PlanError` or
    :class:`~xpar_zoo.errors.BatchError`, naming the numbers) when ``sp`` / ``cp`` cannot split rows of ``seq``
    tokens of ``config``'s model on ``world`` ranks: the same rules as ``xpar_zoo.Mesh`` and ``parallelize``."""
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise PlanError(f"attention {attention!r} is not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    validate_sequence_sizes(world, replicate, sp, cp)
    if sp * cp == 1:
        return
    refusal = sequence_refusal(config, attention, model)
    if refusal:
        raise PlanError(f"sp={sp}, cp={cp}: {refusal}")
    attention_heads(config.get_text_config(), sp)
    sequence_parts(seq, sp, cp)


def _attention_bytes(config, rows: int, seq: int, dtype_bytes: int, sp: int, cp: int, attention: str,
                     options: ParallelOptions) -> tuple[float, float, float]:
    """One decoder layer's attention on one rank: ``(values, scores, mask)`` bytes that autograd keeps, and the
    bytes of the masks held once per forward. See :func:`activation_terms`."""
    heads, kv_heads = attention_heads(config, sp)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    queries, keys = rows * seq // cp, rows * seq  # inside attention: the rank's cp chunk, against the whole row
    # the sp/cp attention's path (the wrapper's own choice, on plain rows): eager gets a mask built from global
    # positions; sdpa gets none (sp alone: its own causal kernel; cp on a GPU: each query chunk against its key
    # prefix, aligned lower-right, with the key/value heads repeated to the queries'), nor do flash and flex
    path = _inner_path(config, rows, seq, dtype_bytes, sp, cp, attention, options)
    # blocked (the sp/cp mask over its budget): the blocks' checkpoints keep the key/value heads as gathered
    native_gqa = (attention.startswith("flash") or attention == "flex_attention" or (attention == "sdpa" and cp == 1)
                  or path is InnerPath.BLOCKED)
    kv_kernel = kv_heads if native_gqa else heads  # otherwise transformers repeats the key/value heads to the queries'
    values = 2 * queries * heads * d + 2 * keys * kv_kernel * d  # q and the output, k and v
    d_out = d
    mla = mla_head_widths(config)
    if mla:  # q and k as wide as nope + rope, the output as v; v is a view of kv_b_proj's [nope; v] output
        qk, d_out = mla
        values = queries * heads * (qk + d_out) + keys * kv_kernel * (qk + config.qk_nope_head_dim + d_out)
    if attention != "eager" and sp > 1:  # Ulysses' output all-to-all: a new o_proj input beside the kernel's output
        values += queries * heads * d_out  # [tokens/(sp·cp), q]: the same count as sdpa's output
    scores = 0.0
    if attention == "eager" and path is not InnerPath.BLOCKED:  # the softmax, fp32, and its copy in the compute dtype
        scores = rows * heads * (seq // cp) * seq * (4 + (dtype_bytes if dtype_bytes != 4 else 0))
    mask_once = 0.0
    if path is InnerPath.WHOLE_MASK:  # an additive mask in the compute dtype, held for the forward and shared
        mask_once = rows * (seq // cp) * seq * dtype_bytes
    return values * dtype_bytes, scores, mask_once


def mla_head_widths(config) -> tuple[int, int] | None:
    """Multi-head latent attention (DeepSeek's MLA: a ``kv_lora_rank``): the ``(query/key, value)`` head widths,
    ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``; ``None`` for other attention."""
    if not getattr(config, "kv_lora_rank", None) or not getattr(config, "v_head_dim", None):
        return None
    return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim


def mla_latent_bytes(config, dtype_bytes: int) -> int:
    """Per token and MLA layer, what its low-rank latents keep: each latent's RMSNorm (``q_lora_rank`` and
    ``kv_lora_rank`` wide) keeps an fp32 copy of its input, its normalised value and its output (the up
    projection's input)."""
    if not mla_head_widths(config):
        return 0
    ranks = (getattr(config, "q_lora_rank", None) or 0) + config.kv_lora_rank
    return ranks * (2 * dtype_bytes + 4)


# The device whose paths the sizer sizes: a GPU's (sdpa without a mask under cp, lower-right).
SIZED_DEVICE = "cuda"


def _inner_path(config, rows: int, seq: int, dtype_bytes: int, sp: int, cp: int, attention: str,
                options: ParallelOptions) -> InnerPath | None:
    """The sp/cp attention's inner path for ``rows`` plain rows of ``seq`` tokens, as the wrapper chooses it
    (:func:`~xpar_zoo.styles.sequence_paths.choose_inner_attention`) on a GPU, within the CPU's block budget
    (16 MiB, the smaller default) unless ``options`` set one; ``None`` without sp/cp."""
    if sp * cp == 1:
        return None
    mask = MaskKind.CAUSAL_IN_ORDER if cp == 1 else MaskKind.CAUSAL
    return choose_inner_attention(attention, SIZED_DEVICE, mask, _sizes(config, rows, seq, dtype_bytes, sp, cp),
                                  _sized_options(options))


def _sizes(config, rows: int, seq: int, dtype_bytes: int, sp: int, cp: int) -> AttentionSizes:
    return AttentionSizes(rows, attention_heads(config, sp)[0], seq // cp, seq, dtype_bytes)


def _sized_options(options: ParallelOptions) -> ParallelOptions:
    if options.attention_block_mib is not None:
        return options
    return options.replace(attention_block_mib=ATTENTION_BLOCK_MIB)


def _attention_block(config, rows: int, seq: int, dtype_bytes: int, sp: int, cp: int, attention: str,
                     options: ParallelOptions) -> float | None:
    """The bytes of one block of queries where the sp/cp attention runs blocked (:func:`_inner_path`: its whole
    mask, and eager's scores, over the block budget): its mask (and scores), transient, none kept for backward;
    ``None`` where it is not blocked."""
    if _inner_path(config, rows, seq, dtype_bytes, sp, cp, attention, options) is not InnerPath.BLOCKED:
        return None
    sizes, eager = _sizes(config, rows, seq, dtype_bytes, sp, cp), attention == "eager"
    block = block_rows(attention, SIZED_DEVICE, sizes, _sized_options(options))
    return block * attention_query_bytes(rows, sizes.heads, seq, dtype_bytes, eager)


def moe_layer_count(model: nn.Module) -> int:
    """How many decoder layers of ``model`` have routed experts: its fused ``[E, …]`` ``down_proj`` tensors (one
    per experts module, an adapter's wrapping included)."""
    return sum(1 for name, p in model.named_parameters() if name.endswith("down_proj") and p.dim() == 3)


def experts_gate_width(model: nn.Module, dtype_bytes: int) -> float:
    """Per routed row, what the experts' activation keeps, in units of the intermediate width ``I``: ``2`` (the
    ``[gate; up]`` projection; the activation is recomputed in backward) for transformers' default SwiGLU; for
    another gate (gpt-oss's clamped GLU with its ``+1``) what autograd saves running it on one row in the compute
    dtype (measured on a tiny row: the gate is elementwise), plus its output, the down projection's input."""
    from ..compat import apply_gate
    from ..styles.experts import recomputes_activation

    module = next((m for m in model.modules() if isinstance(getattr(m, "down_proj", None), torch.Tensor)
                   and m.down_proj.dim() == 3), None)
    if module is None or recomputes_activation(module) or not getattr(module, "has_gate", True):
        return 2.0
    width, dtype = 8, torch.bfloat16 if dtype_bytes == 2 else torch.float32
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    h = torch.zeros(1, 2 * width, dtype=dtype, requires_grad=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = apply_gate(module, h)
    except (RuntimeError, NotImplementedError, AttributeError):  # a gate reading its module's (meta) weights
        return 2.0
    return sum(kept.values()) / (dtype_bytes * width) + out.shape[-1] / width


def _mlp_widths(config, moe_layers: int | None, gate_width: float = 2.0) -> tuple[float, float]:
    """Per token, the values one decoder layer's MLP keeps (elements), as the mean over the layers and the widest:
    a SwiGLU MLP ``H + 4I``; a MoE layer ``H + 2E + k·(2H + g·I)`` (``g = gate_width``,
    :func:`experts_gate_width`) plus its shared experts' MLP. ``moe_layers``: how many layers are MoE (``None``:
    all of them, for an MoE config), the others dense with ``intermediate_size``."""
    h, layers = config.hidden_size, config.num_hidden_layers
    dense = h + 4 * (getattr(config, "intermediate_size", None) or 0)
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    if not top_k:
        return dense, dense
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = next((getattr(config, k) for k in ("num_experts", "n_routed_experts", "num_local_experts",
                                                 "moe_num_experts") if getattr(config, k, None)), 0)
    shared = (getattr(config, "shared_expert_intermediate_size", None)
              or (getattr(config, "n_shared_experts", None) or 0) * inter)
    moe = h + 2 * experts + top_k * (2 * h + gate_width * inter) + (h + 4 * shared if shared else 0)
    n = layers if moe_layers is None or not layers else min(moe_layers, layers)
    if n == layers:
        return moe, moe
    return (n * moe + (layers - n) * dense) / layers, max(moe if n else dense, dense)


def activation_terms(config, tokens: int, dtype_bytes: int, fused_head: int = 1, qk_norm: bool = False,
                     recompute: bool = False, *, seq: int | None = None, sp: int = 1, cp: int = 1,
                     attention: str = "sdpa", options: ParallelOptions | None = None,
                     moe_layers: int | None = None, gate_width: float = 2.0) -> dict[str, float]:
    """The activation estimate of one rank (see :func:`activation_bytes`) by kind: ``"activations"`` (linear in
    the tokens), ``"attention scores"`` (eager's ``seq²`` softmax), ``"attention mask"`` (the sp/cp mask) and
    ``"attention block"`` (eager's blocked sp/cp attention: what one block of queries' mask and scores add to the
    peak, a transient in a layer's backward beyond the values that layer's MLP has freed by then). ``moe_layers``:
    how many decoder layers are MoE (``None``: every layer of an MoE config; :func:`moe_layer_count`);
    ``gate_width``: :func:`experts_gate_width`."""
    seq, options = seq or tokens, options or ParallelOptions()
    rows = tokens // seq
    local = tokens // (sp * cp)  # this rank's tokens outside attention
    h = config.hidden_size
    q_width = config.num_attention_heads * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    kv_width = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * (
        getattr(config, "head_dim", None) or h // config.num_attention_heads)
    outside = h + (2 * q_width + 2 * kv_width if qk_norm else 0)  # the q/k/v projections' input; q/k norms
    mlp, mlp_most = _mlp_widths(config, moe_layers, gate_width)
    attn, scores, mask = _attention_bytes(config, rows, seq, dtype_bytes, sp, cp, attention, options)
    # RMSNorm computes in fp32: below fp32 it keeps an fp32 copy of its input beside its normalised output
    upcast = 4 - dtype_bytes if dtype_bytes < 4 else 0
    norms = upcast * (2 * h + (q_width + kv_width if qk_norm else 0)) + mla_latent_bytes(config, dtype_bytes)
    layer = local * ((4 * h + outside + mlp) * dtype_bytes + norms) + attn  # bytes one layer keeps (scores apart)
    largest = layer + local * (mlp_most - mlp) * dtype_bytes  # the layer of the widest MLP, its own
    # a sequence mixer on the group's whole rows (sp/cp): its gathered input, its input and projections as wide as
    # the attention's (a proxy) for every token of the rows; recomputed in backward by default (mixer_recompute),
    # so a mixer layer keeps its local values and one mixer's whole rows are a transient
    mixers = whole_row_layers(config) if sp * cp > 1 else 0
    whole = tokens * (2 * h + 2 * q_width + 2 * kv_width) * dtype_bytes
    mixer = local * (4 * h + mlp) * dtype_bytes + whole
    layers = config.num_hidden_layers
    if recompute:  # the other layers' inputs, and one layer's values (its input among them) while it is recomputed
        values = max(layers - 1, 0) * local * h * dtype_bytes + (max(largest, mixer if mixers else 0) if layers else 0)
        scores_kept = scores if layers > mixers else 0
    else:
        kept = mixer - whole if options.mixer_recompute else mixer
        values = (layers - mixers) * layer + mixers * kept + (whole if mixers and options.mixer_recompute else 0)
        scores_kept = (layers - mixers) * scores
    values += local * h * (2 * dtype_bytes + upcast)  # the final norm
    s = fused_head
    if s == 0:
        loss = local * config.vocab_size * 4
    else:
        loss = (s * local * h * (1 if s == 1 else 2) + config.vocab_size // s * h) * dtype_bytes
    # a block runs in a layer's backward, after that layer's MLP and second norm have freed their values
    block = max(0.0, (_attention_block(config, rows, seq, dtype_bytes, sp, cp, attention, options) or 0.0)
                - local * (mlp + 2 * h) * dtype_bytes)
    return {"activations": values + loss, "attention scores": scores_kept, "attention mask": mask,
            "attention block": block}


def activation_bytes(config, tokens: int, dtype_bytes: int, fused_head: int = 1,
                     qk_norm: bool = False, recompute: bool = False, *, seq: int | None = None, sp: int = 1,
                     cp: int = 1, attention: str = "sdpa", options: ParallelOptions | None = None) -> float:
    """An activation estimate per rank: the values autograd keeps, counted per module of a standard decoder layer,
    times ``dtype_bytes``, for a micro-batch of ``tokens`` tokens in rows of ``seq`` (default: one row) that the
    ``sp·cp`` ranks of a sequence group share.

    Outside attention a rank holds ``tokens/(sp·cp)`` tokens, and per token: two RMSNorms ``4H``; the q/k/v
    projections' input ``H`` (``+ 2q + 2kv`` with ``qk_norm``); a SwiGLU MLP ``H + 4I``; a MoE layer instead
    ``H + 2E + k·(2H + 2I)`` (the router's input and scores; per routed row its input, ``[gate; up]`` — the
    activation is recomputed in backward, on the torch path and in the Triton kernels alike — and the output the
    combine weighs) plus its shared experts' MLP (dense layers of an MoE model, as DeepSeek's first ones: the
    SwiGLU's); the final norm ``2H``. Inside attention (``q`` / ``kv`` widths)
    Ulysses gives a rank whole rows of ``heads/sp`` query heads (key/value heads repeated where fewer than ``sp``,
    :func:`attention_heads`), cp gives it its ``tokens/cp`` queries against the keys and values of whole rows:
    the queries and the output ``2·(tokens/cp)·q/sp``, the keys and values ``2·tokens·kv/sp`` (with a mask, as
    under sp/cp, and for eager, transformers repeats the key/value heads to the query heads first; sdpa and flash
    without a mask keep them as they are), and under sp the output's all-to-all makes a second copy for the output
    projection. MLA (DeepSeek's latent attention) keeps queries and keys ``nope + rope`` wide, the key/value
    projection's ``[nope; v]`` output (the values are a view of it), a ``v``-wide output, and its latents' norms
    (:func:`mla_latent_bytes`). ``attention="eager"`` keeps the ``rows·heads/sp·(seq/cp)·seq`` softmax too (fp32, and its copy in
    a lower compute dtype); sdpa and flash keep no score matrix. Under sp/cp eager gets an additive mask of
    ``rows·(seq/cp)·seq`` shared by the layers where that mask and one layer's scores fit the block budget
    (:func:`~xpar_zoo.styles.sequence_paths.attention_block_rows`, the CPU's 16 MiB unless ``options`` set one);
    beyond it eager runs a block of queries at a time, checkpointed: no mask or scores kept, the key/value heads
    kept as gathered, and one block's mask and scores (``"attention block"``) while it runs. sdpa gets none
    (plain rows assumed, no packing, padding or short window): its own causal kernel under sp alone, and under cp
    on a GPU each query chunk against the key prefix that ends where it ends, aligned lower-right (key/value heads
    repeated to the query heads); on CPU it runs blocked, at most one block's mask at a time.
    With ``recompute`` (activation checkpointing of every decoder layer, e.g.
    ``model.activation_checkpointing_enable()``) each layer keeps only its input ``H`` until backward, and one
    layer at a time holds all of its values again while it is recomputed: the peak.

    The loss: with a fused head over a group of ``fused_head`` ranks (1: the whole vocab, ``parallelize``'s
    default), the head's gradients made in forward — ``[s·T, H]`` hidden states' and ``[V/s, H]`` weight's — and,
    for ``s > 1``, the group's gathered hidden states; ``fused_head=0`` (transformers' loss): ``T·V`` fp32 logits."""
    return sum(activation_terms(config, tokens, dtype_bytes, fused_head, qk_norm, recompute, seq=seq, sp=sp,
                                cp=cp, attention=attention, options=options).values())


def lora_activation_bytes(model: nn.Module, config, tokens: int, dtype_bytes: int, recompute: bool = False
                          ) -> float:
    """What LoRA adds to :func:`activation_bytes` for a model with PEFT layers: per token and adapted dense linear,
    its ``r`` fp32 low-rank values and, where the base computes in another dtype, the fp32 copy of its input that
    PEFT makes; per routed row and adapted experts tensor, its ``r`` low-rank values, and the activation
    ``act(gate)·up`` (``I``) that the down projection's adapter needs (without one it is recomputed). With
    ``recompute``: one layer's worth. The sum with :func:`activation_bytes` (a full fine-tune's) is an upper bound:
    a frozen weight's input is not kept for its gradient (how far above: docs/design.md, "Sizing")."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    values = 0.0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        rank = sum(module.r.values())
        if isinstance(module, ParamWrapper):
            down = module.parameter_name == "down_proj"
            values += top_k * (rank + (module.in_features if down else 0)) * dtype_bytes
        else:
            values += (rank + (module.in_features if dtype_bytes != 4 else 0)) * 4
    return tokens * values / (config.num_hidden_layers if recompute else 1)


def attention_temporaries(config, tokens: int, dtype_bytes: int, *, seq: int | None = None, sp: int = 1,
                          cp: int = 1, attention: str = "sdpa", options: ParallelOptions | None = None) -> float:
    """What eager attention holds only while one layer's backward runs (at the activation peak, on top of what
    autograd keeps): the gradients of its softmax output and of its scores, one ``rows·heads/sp·(seq/cp)·seq``
    matrix each in fp32 (in a lower compute dtype: one in that dtype and one in fp32). None for sdpa and flash."""
    seq = seq or tokens
    blocked = _attention_block(config, tokens // seq, seq, dtype_bytes, sp, cp, attention,
                               options or ParallelOptions())
    if attention != "eager" or blocked is not None:
        return 0.0  # blocked: the block's own (attention_terms' "attention block")
    heads, _ = attention_heads(config, sp)
    return tokens // seq * heads * (seq // cp) * seq * (4 + (dtype_bytes if dtype_bytes != 4 else 4))


def fused_loss_temporaries(config, tokens: int, group: int, dtype_bytes: int) -> float:
    """What the fused head holds only while it runs (at the activation peak, on top of what autograd keeps): the
    fp32 ``[V/s, H]`` weight-gradient accumulator, each chunk's ``[V/s, H]`` partial product (not in fp32, where it
    accumulates inside the GEMM), and one chunk of logits (CUDA's chunk size) as fp32, its softmax gradient made in
    place, plus the chunk in the compute dtype where that is not fp32."""
    rows = config.vocab_size // group
    weight = rows * config.hidden_size
    chunk = min(CE_CHUNK_ELEMENTS["cuda"], group * tokens * rows)
    dtype_copy = dtype_bytes if dtype_bytes != 4 else 0  # in fp32 the fp32 logits are the chunk itself
    return weight * (4 + dtype_copy) + chunk * (4 + dtype_copy)


def _moe_layers(model: nn.Module, plan: Plan) -> list[tuple[str, int, int]]:
    """``(experts module, E, H)`` for every experts module the ``ep`` plan covers."""
    if "ep" not in plan.extra:
        return []
    out = {}
    for fqn in match_parameters(model, plan.extra["ep"].params):
        mod = fqn.rpartition(".")[0]
        module = model.get_submodule(mod)
        down = getattr(module, "down_proj", None)
        if not isinstance(down, torch.Tensor):  # an adapter's factor (planned with its experts)
            continue
        hidden = getattr(module, "hidden_dim", None) or getattr(module, "hidden_size", None) or down.shape[1]
        out[mod] = (mod, down.shape[0], hidden)
    return list(out.values())


def estimate(
    config,
    world: int,
    sizes: dict[str, int] | None = None,
    replicate: int = 1,
    *,
    micro_batch: int = 1,
    seq: int = 4096,
    param_dtype: str = "bf16",
    reduce_dtype: str = "fp32",
    optimizer: str = "adamw",
    recompute: bool = False,
    fused_loss: bool = True,
    plan: Plan | None = None,
    model: nn.Module | None = None,
    lora_rank: int | None = None,
    lora_modules: list[str] | str | None = None,
    lora_parameters: list[str] | None = None,
    sp: int = 1,
    cp: int = 1,
    attention: str = "sdpa",
    options: ParallelOptions | None = None,
) -> Estimate:
    """Per-rank memory and per-step communication of ``config`` on a mesh of ``world`` ranks with extra-plan
    ``sizes`` and ``replicate`` (HSDP). Master weights, gradients and optimizer states are fp32; ``recompute``:
    activation checkpointing of every decoder layer (see :func:`activation_bytes`); ``fused_loss`` as
    :func:`~xpar_zoo.parallelize` takes it.

    Long context: the ``sp·cp`` ranks of a sequence group share a micro-batch of ``micro_batch`` rows of ``seq``
    tokens (each rank holds ``seq/(sp·cp)`` of every row outside attention); ``attention`` is the model's
    implementation (eager keeps a ``seq²`` score matrix). Parameters are placed as without sp/cp. ``options``: the
    :class:`~xpar_zoo.ParallelOptions` of the run (the attention's block budget, the mixers' recompute; default
    ``ParallelOptions()``).

    ``lora_rank``: PEFT LoRA of that rank on ``lora_modules`` (default: every linear but the head) and on the fused
    expert tensors ``lora_parameters`` (default: every tensor of the plan's experts plans; ``[]``: none), as
    :func:`xpar_zoo.from_pretrained` (``peft_config=``) builds it: the frozen base is held in ``param_dtype``, the
    adapters in fp32 with their gradients and optimizer states; only the adapters are reduce-scattered."""
    sizes = dict(sizes or {})
    validate_sizes(world, sizes, replicate)
    check_long_context(config, world, replicate, seq, sp, cp, attention, model)
    plan = plan or get_plan(config.model_type)
    check_plan_names([n for n, s in sizes.items() if s > 1], plan)
    if lora_rank is not None:
        from ..styles.lora import lora_meta_model

        model, plan = lora_meta_model(meta_model(config), plan, lora_rank, lora_modules, lora_parameters)
    model = model if model is not None else meta_model(config)
    pbytes, rbytes = DTYPE_BYTES[param_dtype], DTYPE_BYTES[reduce_dtype]
    units = fsdp_units(model, plan, world, sizes, replicate)
    est = Estimate(mesh={"world": world, "replicate": replicate, **sizes,
                         **{k: v for k, v in (("sp", sp), ("cp", cp)) if v > 1}})
    rows = micro_batch * seq  # the tokens of the micro-batch the sequence group shares
    tokens = rows // (sp * cp)  # this rank's, outside attention
    est.tokens_per_rank = tokens
    _weight_memory(est, model, units, lora_rank, param_dtype, optimizer)
    text = config.get_text_config()  # a multimodal model's activations: its language model's (images not counted)
    _activation_memory(est, text, model, plan, sizes, rows, tokens, pbytes, fused_loss, recompute, lora_rank,
                       seq=seq, sp=sp, cp=cp, attention=attention, options=options or ParallelOptions())
    _fsdp_comm(est, units, world, pbytes, rbytes)
    _plan_comm(est, text, model, plan, sizes, tokens, pbytes, sp=sp, cp=cp)
    return est


def _weight_memory(est: Estimate, model: nn.Module, units: list, lora_rank: int | None, param_dtype: str,
                   optimizer: str) -> None:
    """Parameters, gradients and optimizer states per rank (their shards), the unsharded units FSDP holds at once,
    its chunk-cat temporary, and how many planned tensors each plan shards on each dim."""
    pbytes = DTYPE_BYTES[param_dtype]
    shard_numel = sum(u.numel_padded / u.group for u in units)
    trainable = sum(u.trainable / u.group for u in units)
    if lora_rank:
        est.lora = {"rank": lora_rank, "adapter parameters": sum(p.numel() for p in model.parameters()
                                                                 if p.requires_grad)}
        est.memory[f"frozen base ({param_dtype} shards)"] = (shard_numel - trainable) * pbytes
        est.memory["adapters (fp32 shards)"] = trainable * 4
    else:
        est.memory["parameters (fp32 shards)"] = shard_numel * 4
    est.memory[GRADIENTS] = trainable * 4
    states = f"optimizer states ({optimizer}, adapters)" if lora_rank else f"optimizer states ({optimizer})"
    est.memory[states] = trainable * 4 * OPTIMIZER_STATES[optimizer]
    biggest = max((u.numel_padded for u in units if not u.root), default=0)
    root = next(u for u in units if u.root)
    est.memory["unsharded parameters (2 units + root)"] = (2 * biggest + root.numel_padded) * pbytes
    chunk_cat = max((u.dim1_numel for u in units), default=0)
    if chunk_cat:
        est.memory["FSDP chunk-cat temporary (dim-1 shards)"] = chunk_cat * pbytes
    for u in units:
        for dim in u.shard_dims.values():
            counts = est.placement.setdefault(u.plan_name, {})
            counts[f"dim {dim}"] = counts.get(f"dim {dim}", 0) + 1


def _activation_memory(est: Estimate, config, model: nn.Module, plan: Plan, sizes: dict[str, int], rows: int,
                       tokens: int, pbytes: int, fused_loss: bool, recompute: bool, lora_rank: int | None, *,
                       seq: int, sp: int, cp: int, attention: str, options: ParallelOptions) -> None:
    """Activations of a micro-batch (the adapters' too), attention's ``seq²`` terms, and the fused loss's
    temporaries where the head is fused."""
    head = sizes.get("head", 1)
    fused = head > 1 or (fused_loss and whole_vocab_head_fusable(model, plan))
    fused_head = head if fused else 0
    qk_norm = any(name.endswith("q_norm") for name, _ in model.named_modules())
    terms = activation_terms(config, rows, pbytes, fused_head, qk_norm, recompute, seq=seq, sp=sp, cp=cp,
                             attention=attention, options=options, moe_layers=moe_layer_count(model) or None,
                             gate_width=experts_gate_width(model, pbytes))
    est.memory["activations (estimate)"] = terms["activations"]
    if lora_rank:
        est.memory["activations (estimate)"] += lora_activation_bytes(model, config, tokens, pbytes, recompute)
    if terms["attention scores"]:
        est.memory[f"attention scores ({attention}, seq²)"] = terms["attention scores"]
    if terms["attention mask"]:
        est.memory["attention mask (sp/cp, seq²)"] = terms["attention mask"]
    loss_temporaries = fused_loss_temporaries(config, tokens, fused_head, pbytes) if fused_head else 0.0
    if fused_head:
        est.memory["fused loss temporaries"] = loss_temporaries
    block = terms["attention block"] - loss_temporaries  # the loss's temporaries are freed before the layers' backward
    if block > 0:
        est.memory["attention block (sp/cp, one block of queries, beyond the loss temporaries)"] = block
    temporaries = attention_temporaries(config, rows, pbytes, seq=seq, sp=sp, cp=cp, attention=attention,
                                        options=options)
    if temporaries:
        est.memory["eager backward temporaries (seq²)"] = temporaries
    indexed = indexed_layer_count(config)
    if indexed:  # DSA: the indexer's scores (no gradient: a transient) and each indexed layer's top-k mask
        transient, kept = indexed_attention_bytes(config, rows // seq, seq, pbytes, sp, cp, attention == "eager",
                                                  options.block_budget(None))
        est.memory["indexer scores (one layer's, transient)"] = transient
        if kept:
            est.memory["indexed attention masks (seq², kept per indexed layer)"] = kept * indexed


def _fsdp_comm(est: Estimate, units: list, world: int, pbytes: int, rbytes: int) -> None:
    """FSDP's all-gathers and reduce-scatters, HSDP's all-reduce, and the global-batch loss's target count."""
    gather = reduce = allreduce = 0.0
    for u in units:
        frac = (u.group - 1) / u.group
        gather += (1 if u.root else u.gathers) * frac * u.numel_padded * pbytes
        reduce += frac * u.trainable * rbytes
        if u.replicate > 1:
            allreduce += 2 * (u.replicate - 1) / u.replicate * (u.trainable / u.group) * rbytes
    est.comm["all_gather (FSDP params)"] = gather
    est.comm["reduce_scatter (FSDP grads)"] = reduce
    est.comm["all_reduce (HSDP grads)"] = allreduce
    # the global-batch loss: one fp32 count of valid targets summed over the world per forward (xpar_zoo.loss.global_batch)
    est.comm["all_reduce (loss target count)"] = 2 * (world - 1) / world * 4


def _plan_comm(est: Estimate, config, model: nn.Module, plan: Plan, sizes: dict[str, int], tokens: int,
               pbytes: int, *, sp: int, cp: int) -> None:
    """The extra plans' and the sequence split's collectives: EP's token all-to-alls, sp's and cp's, ``emb``'s and
    ``head``'s."""
    s = sizes.get("ep", 1)
    a2a = 0.0
    if s > 1:
        top_k = config.num_experts_per_tok
        for _, experts, hidden in _moe_layers(model, plan):
            a2a += 4 * (s - 1) / s * tokens * top_k * hidden * pbytes + (s - 1) / s * experts * 8
    est.comm["all_to_all (EP tokens)"] = a2a
    # sp: q, k, v (key/value heads repeated first) to whole rows of heads/sp heads and the output back, in forward
    # and again in backward; cp: the keys and values of the rank's chunk to the cp-1 others, their gradients back
    layers = config.num_hidden_layers
    if sp * cp > 1:
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv_local = attention_heads(config, sp)
        q_width, kv_width = config.num_attention_heads * d, kv_local * sp * d
        est.comm["all_to_all (sp: sequence <-> heads)"] = (
            layers * 2 * (sp - 1) / sp * tokens * (2 * q_width + 2 * kv_width) * pbytes if sp > 1 else 0.0)
        est.comm["all_to_all (cp: keys/values gathered)"] = (
            layers * 2 * (cp - 1) * tokens * sp * 2 * kv_local * d * pbytes if cp > 1 else 0.0)
    hidden = config.hidden_size
    e = sizes.get("emb", 1)
    # emb: int64 ids to the row owners, vectors back, their gradients to the owners; plus the per-owner counts.
    est.comm["all_to_all (emb ids + vectors)"] = (
        (e - 1) / e * tokens * (8 + 2 * hidden * pbytes) + (e - 1) * 8 if e > 1 else 0.0)
    h = sizes.get("head", 1)
    # head: every rank's hidden states (and int64 targets) sent to the h-1 others, the hidden-state gradients sent
    # back, the row counts, the fp32 loss denominator and the fp32 upstream gradient; [2, h·tokens] fp32 statistics
    # all-gathered.
    est.comm["all_to_all (head hidden states)"] = (
        (h - 1) * (tokens * (2 * hidden * pbytes + 8) + 8 + 4 + 4) if h > 1 else 0.0)
    est.comm["all_gather (head loss statistics)"] = (h - 1) * 2 * h * tokens * 4 if h > 1 else 0.0


def sequence_splits(config, shard: int, seq: int, attention: str = "sdpa", model: nn.Module | None = None
                    ) -> list[tuple[int, int]]:
    """The ``(sp, cp)`` splits worth trying for rows of ``seq`` tokens on ``shard`` ranks: one per sequence group
    size ``g`` dividing ``shard``, with ``sp`` as large as the query heads allow (Ulysses moves less than cp's
    gathered keys and values) and ``cp = g/sp`` for the rest; sizes that :func:`check_long_context` refuses left
    out (``[(1, 1)]`` for a hybrid model or an attention that sp/cp does not wrap)."""
    out = [(1, 1)]
    if sequence_refusal(config, attention, model):
        return out
    for g in (g for g in range(2, shard + 1) if shard % g == 0):
        for sp in sorted((s for s in range(1, g + 1) if g % s == 0), reverse=True):
            try:
                attention_heads(config, sp)
            except PlanError:
                continue  # sp cannot grow this far: cp takes the rest
            try:
                sequence_parts(seq, sp, g // sp)
            except BatchError:
                continue
            out.append((sp, g // sp))
            break
    return out


def candidate_meshes(config, world: int, plan: Plan | None = None, model: nn.Module | None = None,
                     seq: int | None = None, attention: str = "sdpa") -> list[dict]:
    """Every ``{ep, replicate}`` that fits ``world`` and that ``parallelize`` would accept for the model's shapes
    (dim 0 by ``ep``, dim 1 by ``ep_fsdp``: the same checks, :func:`~xpar_zoo.styles.planned.match_plan`); with a
    sequence length ``seq``, each with every ``(sp, cp)`` of :func:`sequence_splits` (EP may draw from the ranks of
    a sequence group)."""
    plan = plan or get_plan(config.model_type)
    model = model if model is not None else meta_model(config)
    out = []
    for replicate in [r for r in range(1, world + 1) if world % r == 0]:
        shard = world // replicate
        splits = sequence_splits(config, shard, seq, attention, model) if seq else [(1, 1)]
        for ep in [e for e in range(1, shard + 1) if shard % e == 0] if "ep" in plan.extra else [1]:
            try:
                match_plan(model, plan, {"ep": ep} if ep > 1 else {}, shard)
            except PlanError:
                continue
            out += [{"replicate": replicate, "ep": ep, "sp": sp, "cp": cp} for sp, cp in splits]
    return out


def suggest(config, world: int, *, memory_budget: float | None = None, top: int = 5, **kwargs) -> list[Estimate]:
    """The best meshes for ``world`` ranks, sp and cp among them for rows of ``seq`` tokens: those within
    ``memory_budget`` bytes per rank (if given) by per-step communication, then memory; when none fits, those
    that come closest (least memory) first."""
    model = meta_model(config)
    plan = kwargs.pop("plan", None) or get_plan(config.model_type)
    kwargs.pop("sp", None), kwargs.pop("cp", None)
    ests = []
    for cand in candidate_meshes(config, world, plan=plan, model=model, seq=kwargs.get("seq", 4096),
                                 attention=kwargs.get("attention", "sdpa")):
        sizes = {"ep": cand["ep"]} if cand["ep"] > 1 else {}
        ests.append(estimate(config, world, sizes, cand["replicate"], plan=plan, model=model, sp=cand["sp"],
                             cp=cand["cp"], **kwargs))
    fits = [e for e in ests if memory_budget is None or e.peak_bytes <= memory_budget]
    if not fits:
        return _with_expert_mesh(sorted(ests, key=lambda e: (e.peak_bytes, e.comm_total)), top)
    return _with_expert_mesh(sorted(fits, key=lambda e: (e.comm_total, e.peak_bytes)), top)


def suggest_order(memory_budget: float | None, fits: bool = True) -> str:
    """How :func:`suggest` ranks the meshes it shows, in words (the ``size --suggest`` header)."""
    if memory_budget is not None and not fits:
        return "no mesh fits the budget: ranked by peak memory per rank, then bytes sent per rank per step"
    within = " among those within the budget" if memory_budget is not None else ""
    return (f"ranked by bytes sent per rank per step, then peak memory per rank{within}; the best mesh with ep "
            "is always shown for an MoE model")


def _with_expert_mesh(ranked: list[Estimate], top: int) -> list[Estimate]:
    """The first ``top`` of ``ranked``, the best one with an ``ep`` plan among them (last) when none made it."""
    shown = ranked[:top]
    if not any(e.mesh.get("ep", 1) > 1 for e in shown):
        shown += next(([e] for e in ranked[top:] if e.mesh.get("ep", 1) > 1), [])
    return shown


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_count(n: float) -> str:
    """A count in human units with three significant digits or so: ``950``, ``12.3K``, ``4.5M``, ``30.5B``,
    ``1.2T`` (never ``0.00B`` for a small model)."""
    n = float(n)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale * 0.9995 or (unit == "T" and abs(n) >= scale):
            value = n / scale
            return f"{value:.0f}{unit}" if abs(value) >= 99.95 else f"{value:.1f}{unit}"
    return f"{n:.0f}"


def format_estimate(est: Estimate) -> str:
    """A human-readable table of one estimate."""
    lines = [f"mesh {est.mesh}" + (f", LoRA rank {est.lora['rank']} ({format_count(est.lora['adapter parameters'])} "
                                   "adapter parameters)" if est.lora else "")]
    if est.placement:
        shown = "; ".join(f"{name}: " + ", ".join(f"{n} tensor{'s' * (n != 1)} on {dim}"
                                                for dim, n in sorted(dims.items()))
                          for name, dims in est.placement.items())
        lines.append(f"  FSDP shards planned tensors (of their local slice): {shown}")
    lines.append("  memory per rank:")
    lines += [f"    {k:<40} {format_bytes(v):>12}" for k, v in est.memory.items()]
    lines.append(f"    {'total':<40} {format_bytes(est.memory_total):>12}")
    lines.append(f"    {'peak (gradients freed by zero_grad)':<40} {format_bytes(est.peak_bytes):>12}")
    lines.append("  communication per step (bytes sent per rank):")
    lines += [f"    {k:<40} {format_bytes(v):>12}" for k, v in est.comm.items() if v]
    lines.append(f"    {'total':<40} {format_bytes(est.comm_total):>12}")
    return "\n".join(lines)
