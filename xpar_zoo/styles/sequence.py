"""Long context: Ulysses sequence parallelism (``sp``) and context parallelism (``cp``) on the real transformers
classes, through transformers' ``AttentionInterface`` and a wrapper around the model's forward (no modeling code).

**Tokens.** The ``sp·cp`` ranks of a *sequence group* (:class:`~xpar_zoo.mesh.Mesh`) share one micro-batch of
``b`` rows of ``S`` tokens, dealt head-tail (zig-zag) over cp and in consecutive parts over sp, ``S/(sp·cp)`` tokens
a rank outside attention (:mod:`xpar_zoo.styles.sequence_layout`: the layout and the collectives).

**Data.** Every rank of a group passes the same full-length rows to ``model(...)``; :func:`install_sequence_parallel`
wraps the model's forward to keep this rank's tokens: ``input_ids`` / ``inputs_embeds`` and ``position_ids``
(computed on the whole row, ``arange(S)``, when not given) are indexed by the rank's positions; labels are shifted
on the whole row *before* the split (a target at a chunk boundary is predicted from the previous chunk's last token,
as in one process) and handed to transformers' loss as ``shift_labels``. The global-batch loss
(:mod:`xpar_zoo.loss`) then counts each target once over the world, so the mean of ``out.loss`` over all ranks is
the global-batch mean and the gradients are its gradients; the fused (vocab-parallel) head takes the same
``shift_labels``. A 2-D ``attention_mask`` (padding) is kept whole for the attention mask below and not passed on.
:func:`shard_sequence` does the same split ahead of time for loaders that hand the model only its part; the part
carries :data:`PART_KEY` (a :class:`SequencePart`), so the model never guesses from shapes which it was given.
:func:`data_shard` says which of ``world/(sp·cp)`` parts of the global batch a rank's loader reads.

**Attention.** ``parallelize`` registers ``xpar_seq_<inner>`` in transformers' ``AttentionInterface`` around the
model's implementation ``<inner>`` (``eager``: the modeling module's own ``eager_attention_forward``, so sinks and
MLA head dims keep their code; ``sdpa``; ``flex_attention``; ``flash_attention_2/3`` as ``xpar_seq_fa2/3``) and sets
the model to it. Around the inner call: ``sp`` exchanges sequence for heads with an all-to-all
(``[b, H, S/(sp·cp), d] → [b, H/sp, S/cp, d]``; key/value heads repeated first where fewer than ``sp`` or not dividing
by it; a per-head sink ``s_aux`` / ``module.sinks`` sliced to the local heads); ``cp`` all-gathers keys and values
over the cp group (backward: reduce-scatter) so each rank's ``S/cp`` queries see the whole row. The mask is built
from the *global* token indices (:mod:`xpar_zoo.styles.sequence_masks`: the per-forward state, its masks and the
block budget); the inner call runs on one of the paths of :mod:`xpar_zoo.styles.sequence_inner` (lower-right,
blocked, flex, flash). The model applies RoPE before attention with the local ``position_ids``, which hold global
positions.

**Hybrid models** (linear attention, SSM and short-convolution layers: qwen3_next's gated delta net, minimax's
lightning attention, mamba mixers) run those layers on the whole rows of the sequence group
(:mod:`xpar_zoo.styles.sequence_mixers`: the hidden states are all-gathered around the real module, which runs
unchanged; the rank keeps its tokens of the output). Exact, but their compute is repeated over the group and their
activation memory is not divided. **Indexed sparse attention** (DSA indexers: deepseek_v32, glm_moe_dsa, …) scores
this rank's queries against the whole row's indexer keys and masks the keys a query did not select
(:mod:`xpar_zoo.styles.sequence_indexed`); convolutional projections inside attention (zaya) run on this rank's
tokens with a halo of the tokens before them (:mod:`xpar_zoo.styles.sequence_halo`); compressed attention
(deepseek_v4) pools the whole row's windows and masks the compressed entries per query
(:mod:`xpar_zoo.styles.sequence_compressed`). Sequence mixing that is none of these (a relative-position bias
computed inside the attention, another kind of indexer) is refused, naming the layer type, the module and why.

``generate`` (a KV cache) is refused on an sp/cp mesh with one line: decoding one token at a time has nothing to
split. Parameters are placed exactly as without sp/cp, so checkpoints are unchanged.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..compat import (
    AttributeView,
    attn_implementation,
    config_with_attn_implementation,
    flash_attention_available,
    is_fake,
    supports_attn_implementation,
)
from ..errors import BatchError, ModelStateError, PlanError
from ..parallel.mesh import Mesh, PlanShard
from ..parallel.options import ParallelOptions
from ..parallel.state import ParallelState, parallel_state, parallelized_module
from .calls import call_arguments
from .sequence_compressed import (
    install_compressors,
    served_compressed_layer_types,
    split_compressed,
    with_entries,
)
from .sequence_halo import halo_projections, install_halo_projections, served_halo_layer_types
from .sequence_indexed import (
    block_forward,
    check_indexed_inner,
    chosen_forward,
    install_indexers,
    selected_forward,
    selection_mask,
    served_indexed_layer_types,
)
from .sequence_inner import (
    OWN_MASK_INNER,
    blocked_attention,
    global_kwargs,
    lower_right_attention,
)
from .sequence_layout import (
    TokenLayout,
    check_heads,
    document_ids,
    gather_sequence,
    heads_to_sequence,
    kv_repeat,
    sequence_to_heads,
    token_layout,
)
from .sequence_masks import SequenceForward, current_forward
from .sequence_media import bidirectional_images, split_media, split_positions, vision_blocks
from .sequence_media import refusal as media_refusal
from .sequence_mixers import (
    decoder_layers,
    dispatches_attention,
    install_sequence_mixers,
    sequence_mixers,
    tower_models,
    unserved_mixers,
)
from .sequence_paths import (
    FLASH_IMPLEMENTATIONS,
    AttentionSizes,
    InnerPath,
    block_rows,
    choose_inner_attention,
)
from .sequence_positioned import (
    install_positioned_attention,
    is_depth_attention,
    row_attention,
    served_bias_modules,
    takes_row_keys,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_PREFIX = "xpar_seq_"
INNER_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", *FLASH_IMPLEMENTATIONS)
# The wrapper's name of each flash implementation: none with "flash" in it, or transformers would treat the wrapper
# as flash itself (load kernels by its name, take flash-only paths computed from the local tokens).
WRAPPER_NAMES = {"flash_attention_2": "fa2", "flash_attention_3": "fa3"}
# The key of a batch that :func:`shard_sequence` made: its value is a SequencePart.
PART_KEY = "xpar_sequence_part"
IGNORE_INDEX = -100
# The attribute of every module of an sp/cp model that holds its SequenceParallel (read by sequence_state only).
STATE_ATTRIBUTE = "_xpar_seq"


def wrapper_name(inner: str) -> str:
    """The ``AttentionInterface`` name of the sp/cp attention around ``inner`` (``xpar_seq_sdpa``,
    ``xpar_seq_fa2`` for ``flash_attention_2``)."""
    return ATTENTION_PREFIX + WRAPPER_NAMES.get(inner, inner)


@dataclass(frozen=True)
class SequencePart:
    """The mark :func:`shard_sequence` puts under :data:`PART_KEY`: the batch holds this rank's part of rows of
    ``seq_len`` tokens; ``docs`` and ``key_valid`` are the whole rows' packed documents and padding (or ``None``)."""

    seq_len: int
    docs: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    vision_blocks: torch.Tensor | None = None


class SequenceParallel:
    """The long-context state of one parallelized model: its sp and cp groups, the inner attention, the model's
    parallel state (whose :class:`~xpar_zoo.parallel.options.ParallelOptions` it reads), the current forward's
    :class:`~xpar_zoo.styles.sequence_masks.SequenceForward` (kept until the next forward: activation checkpointing
    recomputes the attention during backward), and how many calls took each inner path (:attr:`paths`: by
    :class:`~xpar_zoo.styles.sequence_paths.InnerPath` value, and the DSA indexers' ``indexer_whole`` /
    ``indexer_blocked``)."""

    def __init__(self, mesh: Mesh, inner: str, parallel: ParallelState) -> None:
        self.parallel = parallel
        self.placeholder_ids: dict[str, int | None] = {}  # each modality's placeholder token (multimodal rows)
        self.bidirectional_images = False  # an image's tokens see each other both ways on sliding layers (Gemma 4)
        self.sp, self.cp = mesh.sp, mesh.cp
        self.sp_group, self.cp_group = mesh.sequence_group("sp"), mesh.sequence_group("cp")
        self.sp_rank, self.cp_rank = mesh.sequence_rank("sp"), mesh.sequence_rank("cp")
        self.inner = inner
        self.current: SequenceForward | None = None
        self.paths: collections.Counter[str] = collections.Counter()

    @property
    def options(self) -> ParallelOptions:
        return self.parallel.options

    def layout(self, seq_len: int) -> TokenLayout:
        return token_layout(seq_len, self.sp, self.cp, self.sp_rank, self.cp_rank)

    def cp_shard(self) -> PlanShard:
        return PlanShard(self.cp_group, self.cp, self.cp_rank, 0)

    # ---- the batch --------------------------------------------------------------------------------------------
    def split(self, named: dict) -> tuple[dict, SequencePart]:
        """This rank's part of the full-length batch ``named`` (model keyword arguments), and its mark."""
        ids, embeds = named.get("input_ids"), named.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            raise BatchError("sp/cp: the batch has neither input_ids nor inputs_embeds")
        b, seq_len = ref.shape[:2]
        local = self.layout(seq_len).local.to(ref.device)
        self.check_same_rows(ref)
        out = dict(named)
        given = named.get("position_ids")
        rows = split_positions(torch.arange(seq_len, device=ref.device)[None] if given is None else given, seq_len, b)
        if rows is None:
            raise BatchError(f"sp/cp: position_ids of shape {tuple(given.shape)}; expected [batch, {seq_len}] (or "
                             f"[4, batch, {seq_len}]: text positions over a multimodal model's 3-D ones)")
        positions = rows[0]
        mask = named.get("attention_mask")
        key_valid = None
        if mask is not None:
            if mask.dim() != 2 or tuple(mask.shape) != (b, seq_len):
                raise BatchError(f"sp/cp: attention_mask of shape {tuple(mask.shape)}; only a 2-D [batch, seq] "
                                 f"padding mask ({b}, {seq_len}) is supported (the attention builds its own mask)")
            key_valid = None if bool(mask.bool().all()) else mask.bool()
        out["attention_mask"] = None
        shift = named.get("shift_labels")
        labels = named.get("labels")
        if shift is None and labels is not None:
            ignore = named.get("ignore_index", IGNORE_INDEX)
            shift = nn.functional.pad(labels[..., 1:], (0, 1), value=ignore)
        if shift is not None:
            out["labels"] = out["shift_labels"] = shift[:, local.to(shift.device)]
        if ids is not None:
            out["input_ids"] = ids[:, local]
        if embeds is not None:
            out["inputs_embeds"] = embeds[:, local]
        out["position_ids"] = rows[..., local] if rows.shape[0] > 1 else positions[:, local]
        split_media(named, out, local, self.placeholder_ids)
        blocks = vision_blocks(named.get("mm_token_type_ids")) if self.bidirectional_images else None
        return out, SequencePart(seq_len, document_ids(positions), key_valid, blocks)

    def check_same_rows(self, rows: torch.Tensor) -> None:
        """Raise :class:`~xpar_zoo.errors.BatchError` on every rank of the sequence group when its ranks were given
        different rows (e.g. a loader sharded by rank instead of :func:`data_shard`): each would train on tokens
        of rows it does not hold. A fingerprint of the rows (shape and a position-weighted sum), reduced by max and
        by min over the sp and cp groups: two small all-reduces and one host sync per forward."""
        if is_fake(rows):  # a simulated world's rows have no values to compare (xpar_zoo.sizing.simulate)
            return
        weights = torch.arange(1, rows.shape[0] * rows.shape[1] + 1, device=rows.device,
                               dtype=torch.float64).view(rows.shape[:2])
        values = rows.to(torch.float64)
        values = values.sum(-1) if values.dim() == 3 else values  # inputs_embeds: [b, s, h]
        fingerprint = (values * weights).sum() + rows.shape[0] * 1e9 + rows.shape[1] * 1e6
        both = torch.stack([fingerprint, -fingerprint])
        for group, size in ((self.sp_group, self.sp), (self.cp_group, self.cp)):
            if size > 1:
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if bool(both[0] != -both[1]):
            raise BatchError(f"sp/cp: the ranks of a sequence group (sp={self.sp} x cp={self.cp}) were given "
                             "different rows; every rank of a group must pass the same full-length rows (read the "
                             "loader's part with xpar_zoo.data_shard(model), or hand each rank its part with "
                             "xpar_zoo.shard_sequence)")

    def begin(self, part: SequencePart, device: torch.device) -> None:
        layout = self.layout(part.seq_len)
        blocks = None if part.vision_blocks is None else part.vision_blocks.to(device)
        self.current = SequenceForward(layout.queries.to(device), layout.keys.to(device), part.docs, part.key_valid,
                                       layout.local.to(device), vision_blocks=blocks)

    # ---- attention: to heads, gather keys and values, run the inner path, back to sequence ---------------------
    def attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  **kwargs):
        """The sp/cp attention of ``module`` (transformers' ``AttentionInterface`` signature; ``attention_mask``,
        made from this rank's tokens, is not used): ``[b, S/(sp·cp), h, dv]`` and no weights."""
        current_forward(self, "sp/cp attention")
        if is_depth_attention(module):  # each token's own layer states: this rank's tokens are all it needs
            return self.inner_function(module)(module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
        if takes_row_keys(self, module):  # a positioned attention given the whole row's keys (its bias: its queries')
            return row_attention(self, module, query, key, value, dropout, scaling, sliding_window, kwargs), None
        selected = kwargs.pop("indices", None)  # a DSA indexer's top-k (global row positions of the keys)
        chosen = selection_mask(module, attention_mask)  # a selection indexer's dense mask (this rank's queries)
        blocks = kwargs.pop("block_indices", None)  # a block indexer's blocks of keys per index head
        if selected is not None or chosen is not None or blocks is not None:
            check_indexed_inner(module, self.inner)
        heads = query.shape[1]
        key, value, entries = split_compressed(self, module, key, value)  # a compressor's entries after the tokens
        query, key, value, overrides = self.to_heads(module, query, key, value, kwargs)
        key, value = self.gather_keys_values(key, value)
        batch = None if selected is None else cast(SequenceForward, selected_forward(self, selected))
        if chosen is not None:
            batch = cast(SequenceForward, chosen_forward(self, chosen))
        if blocks is not None:
            batch = cast(SequenceForward, block_forward(self, module, blocks, heads))
        if entries is not None:
            key, value, batch = with_entries(self, batch or current_forward(self, "sp/cp attention"), entries, heads,
                                             key, value)
        out = self.run(module, overrides, query, key, value, dropout, scaling, sliding_window, kwargs, batch)
        return self.to_sequence(out), None

    def to_heads(self, module, query, key, value, kwargs: dict):
        """Ulysses' all-to-all over sp: ``[b, H, s, d]`` of this rank's tokens → ``[b, H/sp, S/cp, d]``, key/value
        heads repeated first where they do not divide by sp, and how ``module`` must look to the inner attention
        (its local key/value groups and per-head sinks; ``kwargs``' ``s_aux`` is sliced in place)."""
        if self.sp == 1:
            return query, key, value, {}
        heads, kv_heads = query.shape[1], key.shape[1]
        check_heads(heads, self.sp, type(module).__name__)
        repeat = kv_repeat(heads, kv_heads, self.sp)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        query, key, value = (heads_to_sequence(t, self.sp_group, self.sp) for t in (query, key, value))
        overrides = {"num_key_value_groups": query.shape[1] // key.shape[1]}
        lo, n = self.sp_rank * (heads // self.sp), heads // self.sp
        if kwargs.get("s_aux") is not None:
            kwargs["s_aux"] = kwargs["s_aux"][lo:lo + n]
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.shape[0] == heads:
            overrides["sinks"] = sinks[lo:lo + n]
        return query, key, value, overrides

    def gather_keys_values(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cp's all-gather of the keys and values: ``[b, kv, S/cp, d]`` → ``[b, kv, S, d]`` in cp rank order
        (backward: reduce-scatter)."""
        if self.cp == 1:
            return key, value
        shard = self.cp_shard()
        return gather_sequence(key, shard), gather_sequence(value, shard)

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """The inverse all-to-all for the output: ``[b, S/cp, H/sp, dv]`` → ``[b, S/(sp·cp), H, dv]``."""
        return sequence_to_heads(out, self.sp_group, self.sp) if self.sp > 1 else out

    def choose(self, module, query, key, causal: bool, window: int | None, kwargs: dict, selected: bool
               ) -> InnerPath:
        """This call's inner path (:func:`~xpar_zoo.styles.sequence_paths.choose_inner_attention`), counted in
        :attr:`paths`."""
        sinks = kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None
        mask = current_forward(self, "sp/cp attention").mask_kind(causal, window, key.shape[2])
        path = choose_inner_attention(self.inner, query.device.type, mask, self.sizes(query, key), self.options,
                                      sinks=sinks, selected=selected)
        self.paths[path.value] += 1
        return path

    @staticmethod
    def sizes(query: torch.Tensor, key: torch.Tensor) -> AttentionSizes:
        return AttentionSizes(query.shape[0], query.shape[1], query.shape[2], key.shape[2], query.element_size())

    def run(self, module, overrides: dict, query, key, value, dropout: float, scaling, window, kwargs: dict,
            masked: SequenceForward | None = None) -> torch.Tensor:
        """The inner attention of the local heads' queries (``[b, h, S/cp, d]``) against the whole rows' keys and
        values on the path :meth:`choose` takes (``masked``: the forward seen with more masked keys, a DSA top-k's
        or a compressor's entries, which always take the mask): ``[b, S/cp, h, dv]``."""
        selected = masked is not None
        batch = masked if masked is not None else current_forward(self, "sp/cp attention")
        causal = bool(getattr(module, "is_causal", True))
        path = self.choose(module, query, key, causal, window, kwargs, selected)
        if path in (InnerPath.FLEX, InnerPath.FLASH):  # their own masks from the global indices
            return OWN_MASK_INNER[self.inner](batch, self.inner_view(module, overrides), query, key, value, causal,
                                              dropout, scaling, window, global_kwargs(kwargs))
        if path is InnerPath.LOWER_RIGHT:
            return lower_right_attention(query, key, value, batch, dropout, scaling)
        call = self.inner_call(module, overrides, dropout, scaling, window, kwargs)
        if path is InnerPath.SDPA_CAUSAL:  # sdpa's own is_causal over the whole row (flash kernels on GPU)
            return call(query, key, value, None)
        if path is InnerPath.WHOLE_MASK:  # additive, once per forward, shared by the layers (a selection: per layer)
            return call(query, key, value, batch.mask(causal, window, query.dtype))
        rows = block_rows(self.inner, query.device.type, self.sizes(query, key), self.options, selected)
        assert rows is not None  # the blocked path: the whole mask does not fit the block budget
        return blocked_attention(call, query, key, value, batch, causal, window, rows)

    def inner_function(self, module: nn.Module):
        if self.inner == "eager":
            fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
            if fn is None:
                raise PlanError(f"{type(module).__name__}'s module has no eager_attention_forward to wrap under sp/cp")
            return fn
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.inner]

    def inner_call(self, module, overrides: dict, dropout: float, scaling, sliding_window, kwargs: dict):
        """``call(q, k, v, mask) -> [b, q, h, dv]``: the inner attention of ``module`` (seen with the local head
        counts and sinks of ``overrides``) with the layer's other arguments."""
        kwargs = global_kwargs(kwargs)
        view = AttributeView(module, overrides) if overrides else module
        inner = self.inner_function(module)

        def call(q, k, v, mask):
            return inner(view, q, k, v, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
                         **kwargs)[0]
        return call

    def inner_view(self, module: nn.Module, overrides: dict):
        """The module as flex / flash see it: the sp overrides, and for flash a config that names the inner
        implementation (transformers' flash forward loads its kernels by that name)."""
        if self.inner in FLASH_IMPLEMENTATIONS:
            overrides = {**overrides, "config": config_with_attn_implementation(module.config, self.inner)}
        return AttributeView(module, overrides) if overrides else module


def sequence_state(model: nn.Module) -> SequenceParallel | None:
    """The :class:`SequenceParallel` of an sp/cp model (``model`` or any of its modules), or ``None``."""
    return next((m.__dict__[STATE_ATTRIBUTE] for m in (model, *model.modules()) if STATE_ATTRIBUTE in m.__dict__),
                None)


def _sequence_attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The function registered as ``xpar_seq_<inner>``: the attention of the model ``module`` belongs to."""
    state: SequenceParallel | None = module.__dict__.get(STATE_ATTRIBUTE)
    if state is None:
        raise ModelStateError(f"{type(module).__name__} is set to an xpar_zoo sp/cp attention but belongs to no "
                              "model parallelized with sp/cp")
    return state.attention(module, *args, **kwargs)


# ---- checks and installation ------------------------------------------------------------------------------------

def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def recurrent_layers(model: nn.Module) -> list[str]:
    """Sequence mixing of ``model`` outside the ``AttentionInterface`` that sp/cp cannot run on whole rows (the
    mixers :func:`~xpar_zoo.styles.sequence_mixers.sequence_mixers` finds run gathered), one ``"what: why"`` each."""
    return unserved_mixers(model, _text_config(model.config), attention_layer_types(model), served_modules(model))


def served_modules(model: nn.Module) -> frozenset[int]:
    """Ids of the modules of ``model`` that sp/cp styles other than the mixers serve inside attention (the halo
    projections, the relative-position biases of positioned attention)."""
    return frozenset(id(m) for m in halo_projections(model).values()) | served_bias_modules(model)


def attention_layer_types(model: nn.Module) -> frozenset[str]:
    """The layer types of ``model`` beyond plain attention that the sp/cp attention serves: indexed attention
    (:mod:`~xpar_zoo.styles.sequence_indexed`) and attention after a halo projection
    (:mod:`~xpar_zoo.styles.sequence_halo`)."""
    config = _text_config(model.config)
    return (served_indexed_layer_types(model, config) | served_compressed_layer_types(model, config)
            | served_halo_layer_types(model, config, served_bias_modules(model)))


def attention_outside_interface(model: nn.Module) -> str | None:
    """The first attention module class of ``model`` whose forward does not call transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (it computes attention itself: sp/cp cannot wrap it), or ``None``. Sequence mixers
    that run on gathered whole rows (linear attention) are not attention here."""
    mixers, layers = tuple(sequence_mixers(model)), {id(m) for m in decoder_layers(model)}
    for name, module in model.named_modules():
        cls: type = type(module)  # a class is hashable: mypy's check of a class against Hashable is wrong (mypy#20409)
        if (name in mixers or name.startswith(tuple(m + "." for m in mixers)) or id(module) in layers
                or "Attention" not in cls.__name__):
            continue
        if not dispatches_attention(cls) and any(True for _ in module.parameters()):
            return f"{cls.__name__} ({name})"
    return None


def check_sequence_parallel(model: nn.Module, mesh: Mesh) -> str:
    """Raise :class:`~xpar_zoo.errors.PlanError` (one line, naming the numbers) when ``model`` cannot run on
    ``mesh``'s sp/cp; return the inner attention implementation. Before any tensor is touched."""
    sizes = ", ".join(f"{d}={n}" for d, n in (("sp", mesh.sp), ("cp", mesh.cp)) if n > 1)
    config = model.config
    media = media_refusal(model)
    if media:
        raise PlanError(f"{sizes}: {media}")
    recurrent = recurrent_layers(model)
    if recurrent:
        raise PlanError(f"{sizes}: {type(model).__name__} has sequence mixing that sp/cp cannot run on whole rows "
                        f"({'; '.join(recurrent)}); sp and cp are refused for it")
    inner = attn_implementation(config) or "eager"
    if inner.startswith(ATTENTION_PREFIX):
        raise PlanError(f"{type(model).__name__} is already set to sp/cp attention ({inner})")
    if inner not in INNER_IMPLEMENTATIONS:
        raise PlanError(f"{sizes}: attention implementation {inner!r} is not supported under sp/cp; load the model "
                        f"with attn_implementation in {INNER_IMPLEMENTATIONS}")
    direct = attention_outside_interface(model)
    if direct:
        raise PlanError(f"{sizes}: {direct} does not dispatch attention through transformers' AttentionInterface, "
                        "which sp/cp wraps")
    text = _text_config(config)
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if mesh.sp > 1:
        if not heads:
            raise PlanError(f"sp={mesh.sp}: {type(model).__name__}'s config has no num_attention_heads")
        check_heads(heads, mesh.sp, type(model).__name__)
        kv_repeat(heads, kv_heads or heads, mesh.sp)
    forward = inspect.signature(model.forward).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in forward):
        raise PlanError(f"{sizes}: {type(model).__name__}.forward takes no **kwargs, so the shifted labels of the "
                        "split rows cannot reach its loss")
    return inner


def _own_config(model: nn.Module) -> None:
    """Give ``model`` its own copy of its config before its attention implementation changes: a config object
    shared with another model (built from the same config) must keep its implementation."""
    import copy

    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _keep_wrapped(model: nn.Module, state: SequenceParallel) -> None:
    """Wrap again an attention implementation set on ``model`` after ``parallelize`` (``set_attn_implementation
    ("eager")`` would otherwise run attention on this rank's tokens alone, silently wrong); refuse one the wrapper
    cannot serve."""
    current = attn_implementation(model.config)
    if current == wrapper_name(state.inner):
        return
    if current not in INNER_IMPLEMENTATIONS:
        raise PlanError(f"sp/cp: the model's attention implementation was set to {current!r} after parallelize; "
                        f"under sp/cp it must be one of {INNER_IMPLEMENTATIONS}")
    from transformers import AttentionInterface

    AttentionInterface.register(wrapper_name(current), _sequence_attention)
    state.inner = current
    _set_attn_implementation(model, wrapper_name(current))


def _towers_attend_whole(model: nn.Module, inner: str) -> None:
    """A vision tower attends over its own patches, whole on every rank (the rows are split after it): its
    submodels keep the inner attention."""
    for module in tower_models(model):
        if hasattr(module, "set_attn_implementation"):
            _set_attn_implementation(module, inner)


def install_sequence_parallel(model: nn.Module, mesh: Mesh, inner: str, parallel: ParallelState) -> SequenceParallel:
    """Set ``model`` to ``xpar_seq_<inner>`` attention and wrap its forward to keep this rank's part of full-length
    rows (see the module docstring); ``parallel`` is the model's parallel state, whose options the attention and the
    mixers read. Call after every other forward wrapper (the global-batch loss must count the split targets)."""
    from transformers import AttentionInterface

    name = wrapper_name(inner)
    AttentionInterface.register(name, _sequence_attention)
    state = SequenceParallel(mesh, inner, parallel)
    state.placeholder_ids = {m: getattr(model.config, f"{m}_token_id", None) for m in ("image", "video")}
    state.bidirectional_images = bidirectional_images(model)
    _own_config(model)
    _set_attn_implementation(model, name)
    if attn_implementation(model.config) != name:
        raise PlanError(f"{type(model).__name__} did not take the sp/cp attention implementation {name!r}")
    _towers_attend_whole(model, inner)
    for module in model.modules():
        module.__dict__[STATE_ATTRIBUTE] = state
    install_sequence_mixers(model, state, attention_layer_types(model), served_modules(model))
    install_indexers(model, state)  # DSA indexers: this rank's queries against the whole row's keys
    install_halo_projections(model, state)  # convolutional projections: this rank's runs and their halos
    install_compressors(model, state)  # compressed attention: the whole row's windows, this rank's queries
    install_positioned_attention(model, state)  # position biases: this rank's queries against the whole row's keys
    original = model.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        named = call_arguments(signature, args, kwargs)
        if named.get("past_key_values") is not None or named.get("cache") is not None:
            raise ModelStateError(f"a KV cache (generate) is not supported on an sp/cp mesh (sp={state.sp}, "
                                  f"cp={state.cp}); generate on a mesh without sp/cp")
        keep = named.get("logits_to_keep")
        if keep is not None and not (isinstance(keep, int) and keep == 0):
            raise BatchError(f"sp/cp: logits_to_keep={keep!r} would keep the last tokens of this rank's part, not "
                             "of the rows; leave it 0 under sp/cp")
        part = named.pop(PART_KEY, None)
        if part is None:
            named, part = state.split(named)
        else:
            ref = named.get("input_ids") if named.get("input_ids") is not None else named.get("inputs_embeds")
            local = state.layout(part.seq_len).local.numel()
            if ref is None or ref.shape[1] != local:
                raise BatchError(f"sp/cp: a shard_sequence part of rows of {part.seq_len} tokens holds {local} "
                                 f"tokens per row here, the batch has {None if ref is None else ref.shape[1]}")
            if named.get("attention_mask") is not None:
                raise BatchError("sp/cp: pass no attention_mask with a shard_sequence part (it carries the padding)")
        # no KV / recurrent cache: a cache the model would make from config.use_cache (through **kwargs to its
        # inner model) holds this rank's part, and a hybrid mixer's recompute in backward would find it filled
        named["use_cache"] = False
        _keep_wrapped(model, state)
        ref = named.get("input_ids") if named.get("input_ids") is not None else named.get("inputs_embeds")
        state.begin(part, ref.device)
        return original(**named)

    model.forward = forward

    def generate(*args, **kwargs):
        raise ModelStateError(f"generate is not supported on an sp/cp mesh (sp={state.sp}, cp={state.cp}); "
                              "generate on a mesh without sp/cp (checkpoints load on any mesh)")

    setattr(model, "generate", generate)  # noqa: B010 (nn.Module types attributes set with `.` as tensors or modules)
    return state


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    """``model.set_attn_implementation(name)`` of a transformers model (or one of its towers)."""
    cast("PreTrainedModel", model).set_attn_implementation(name)


def check_inner_available(model: nn.Module, inner: str, sizes: str) -> None:
    """Raise :class:`~xpar_zoo.errors.PlanError` when ``inner`` cannot run for ``model`` here: a class that does
    not support it (as transformers refuses it), or flash without its kernels (the ``flash_attn`` /
    ``flash_attn_interface`` package on a GPU, transformers' hub kernels, or kernels transformers has loaded)."""
    if not supports_attn_implementation(model, inner):
        raise PlanError(f"{sizes}: {type(model).__name__} does not support attention implementation {inner!r}")
    if inner in FLASH_IMPLEMENTATIONS and not flash_attention_available(inner):
        raise PlanError(f"{sizes}: {inner} is not available here (no flash_attn kernels for this device); use "
                        "sdpa, or install flash-attn on a GPU")


def set_inner_attention(model: nn.Module, inner: str) -> None:
    """Make ``inner`` (one of :data:`INNER_IMPLEMENTATIONS`) the attention that the sp/cp attention of ``model``
    wraps: what ``model.set_attn_implementation(inner)`` is without sp/cp. (That call on an sp/cp model would replace
    the sp/cp attention itself, and each rank would attend to its own tokens only.) A :class:`PlanError` on another
    name, on one the model's class does not support, and on flash without its kernels."""
    from transformers import AttentionInterface

    state = sequence_state(model)
    if state is None:
        raise PlanError(f"{type(model).__name__} is not parallelized with sp/cp; call set_attn_implementation")
    if inner not in INNER_IMPLEMENTATIONS:
        raise PlanError(f"sp={state.sp}, cp={state.cp}: attention implementation {inner!r} is not supported under "
                        f"sp/cp; use one of {', '.join(INNER_IMPLEMENTATIONS)}")
    check_inner_available(model, inner, f"sp={state.sp}, cp={state.cp}")
    name = wrapper_name(inner)
    AttentionInterface.register(name, _sequence_attention)
    state.inner = inner
    _set_attn_implementation(model, name)


# ---- the public helpers -----------------------------------------------------------------------------------------

def data_shard(model: nn.Module) -> tuple[int, int]:
    """``(index, count)``: this rank's data loader reads part ``index`` of ``count`` equal parts of the global batch.
    The ranks of one sp·cp sequence group get the same index and pass the same rows; ``count = world / (sp·cp)``
    (``(rank, world)`` without sp/cp; ``(0, 1)`` for a model that is not parallelized)."""
    state = parallel_state(parallelized_module(model))
    if state is None:
        return 0, 1
    return state.mesh.data_shard()


def shard_sequence(batch: Mapping[str, torch.Tensor], model: nn.Module) -> dict:
    """This rank's part of a full-length ``batch`` (``input_ids`` or ``inputs_embeds``, ``labels`` /
    ``shift_labels``, ``position_ids``, a 2-D ``attention_mask``): tokens, global ``position_ids`` and labels already
    shifted (as ``labels`` and ``shift_labels``), marked with :data:`PART_KEY` so that ``model(**part)`` knows it
    was given its part. Without sp/cp the batch is returned as a new dict, unchanged."""
    state = sequence_state(model)
    if state is None:
        return dict(batch)
    if PART_KEY in batch:
        raise BatchError("shard_sequence: the batch is already this rank's part")
    named, part = state.split(dict(batch))
    named = {k: v for k, v in named.items() if v is not None or k in batch}
    named.pop("attention_mask", None)
    named[PART_KEY] = part
    return named
