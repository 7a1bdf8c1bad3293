"""Hybrid models under sp/cp: sequence mixers outside attention (linear attention, gated delta nets, SSM and
short-convolution mixers) run on the *whole rows* of their sequence group, exactly, with the real transformers modules.

**What is wrapped.** A *sequence mixer* is a direct child of a decoder layer (transformers' ``_no_split_modules``
classes) whose ``forward`` takes the layer's ``hidden_states`` ``[b, s, H]`` and the 2-D padding ``attention_mask``
(what transformers hands its mamba / linear-attention layers: ``create_recurrent_attention_mask``) and that does not
dispatch attention through the ``AttentionInterface``: ``linear_attn`` (qwen3_next, qwen3_5_moe, lara_mini gated
delta nets), ``self_attn`` on linear layers (minimax lightning attention, kimi_linear / bailing_hybrid delta
attention), ``mamba`` / ``mixer`` (jamba, granitemoehybrid, nemotron_h) and ``conv`` (lfm2_moe short convolution).

**How it runs.** Its forward is wrapped (:func:`install_sequence_mixers`): the hidden states of the ``sp·cp`` ranks
of the group are all-gathered along the sequence (over sp, then over cp: the cp chunks in cp rank order, as the
attention's gathered keys) and put in row order; the original forward runs on the whole rows with the whole rows'
padding mask (kept by the sp/cp forward; transformers' own would be of the local shard) and the whole rows'
``position_ids`` / ``position_embeddings`` (gathered too); the rank keeps its own tokens of the output. The
all-gather's backward is a reduce-scatter (the sum over the group of the gradients for this rank's chunk), and each
rank's parameter gradients come from its own output tokens only, so their sum over the group (what FSDP reduces, as
for every per-token parameter) is the single-process gradient. Packing kwargs (``cu_seq_lens_*``, ``seq_idx``) are
dropped, as the sp/cp attention drops them: the mixer sees what single-process transformers gives it on rows packed
by ``position_ids`` alone.

**The cost, plainly.** The compute of those layers is repeated on every rank of the group, and while a mixer runs
the rank holds its whole ``[b, S, ·]`` activations. What is kept for backward is this rank's input only: the
whole-row forward runs under non-reentrant activation checkpointing (``ParallelOptions.mixer_recompute``, the
default; not inside a decoder layer that is checkpointed already), so one mixer's whole rows are live at a time, for
one more forward of those layers. A true Ulysses (each rank the whole sequence for ``1/sp`` of the heads) would need
head-sliced projection weights and convolutions inside the modules, i.e. copied modeling code; we do not copy
modeling code, so the mixers run whole.

**Refused** (:func:`unserved_mixers` names them, with the reason): sequence mixing that is not such a module,
e.g. a short convolution inside the attention module on the key projections (inkling), or an indexer other than
DSA's (:mod:`xpar_zoo.styles.sequence_indexed`) or a compressor other than deepseek_v4's
(:mod:`xpar_zoo.styles.sequence_compressed`) inside the attention module, or a layer type whose layers hold no such
module.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..compat import no_split_modules
from ..errors import ModelStateError
from ..parallel.collectives import GatherRows
from ..parallel.mesh import PlanShard
from ..zoo.forward_source import forward_source
from .calls import call_arguments
from .sequence_masks import current_forward

# Layer types (config.layer_types) that attention through the AttentionInterface serves.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
# Layer types that mix no tokens (their sequence mixer slot holds an MLP / MoE block: nemotron_h).
CHANNEL_LAYER_TYPES = frozenset({"moe", "mlp"})
# Module class-name fragments of sequence mixers outside the AttentionInterface.
RECURRENT_MIXERS = ("GatedDeltaNet", "LightningAttention", "LinearAttention", "Mamba", "ShortConv", "Rwkv")
# Keyword arguments holding per-token values of the local shard that the mixer gets for the whole rows.
SEQUENCE_KWARGS = ("position_ids", "position_embeddings")
# Packing kwargs of flash-attention collators: dropped (the documents come from position_ids, as for attention).
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Why a kind of layer type cannot run on gathered rows, by a fragment of its name.
LAYER_TYPE_REASONS = {
    "index": "sparse attention whose indexer picks keys over the whole sequence inside the attention module",
    "compress": "compressed attention whose compressor runs over the whole sequence inside the attention module",
}


@functools.cache
def dispatches_attention(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' ``ALL_ATTENTION_FUNCTIONS`` (its attention is the
    ``AttentionInterface``'s, which the sp/cp attention wraps)."""
    return "ALL_ATTENTION_FUNCTIONS" in forward_source(cls.forward)


def tower_models(model: nn.Module) -> list[nn.Module]:
    """The submodels of a multimodal ``model`` built from a sub-config other than its text config (vision and audio
    towers): they run on whole images before the sp/cp split, outside the rows' layers."""
    config = model.config
    towers = tuple(type(getattr(config, k)) for k in getattr(config, "sub_configs", {})
                   if k != "text_config" and getattr(config, k, None) is not None)
    return [m for m in model.modules() if m is not model and isinstance(getattr(m, "config", None), towers)]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model``'s rows in order: modules of its ``_no_split_modules`` classes (FSDP2's
    subclasses of them too) outside its :func:`tower_models` (one per text ``layer_types`` entry)."""
    names = set(no_split_modules(model))
    towers = {id(m) for t in tower_models(model) for m in t.modules()}
    return [m for m in model.modules()
            if id(m) not in towers and any(c.__name__ in names for c in type(m).__mro__)]


def _is_mixer(module: nn.Module) -> bool:
    params = list(inspect.signature(module.forward).parameters)
    return (bool(params) and params[0] == "hidden_states" and "attention_mask" in params
            and not dispatches_attention(type(module)) and any(True for _ in module.parameters()))


def sequence_mixers(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: module}`` of the sequence mixers of ``model`` that run on gathered whole rows under sp/cp
    (see the module docstring), in layer order."""
    layers = {id(m) for m in decoder_layers(model)}
    found = {}
    for name, module in model.named_modules():
        if id(module) in layers:
            for child, sub in module.named_children():
                if _is_mixer(sub):
                    found[f"{name}.{child}" if name else child] = sub
    return found


# Why a module inside attention keeps its layer type from splitting, by a fragment of the module's class name
# (checked before LAYER_TYPE_REASONS: the precise reason of the layers that hold such a module).
MODULE_REASONS = {
    "RelativeLogits": "a dense relative-position bias [b, heads, q, k] over the distances between the tokens the "
                      "attention is given (an arange of its own length, not position_ids; InklingAttention also "
                      "scales its queries by those local positions), passed to the attention function whole: under "
                      "sp/cp it would cover this rank's tokens only, and widening it to the row means recomputing "
                      "it outside the module",
    "RelativePositionBias": "a dense relative-position bias [b, heads, q, k] over the relative_distance the model "
                            "computes for the tokens it is given (not position_ids), passed to the attention "
                            "function whole, and no get_relative_distance(inputs_embeds, cache, is_sliding) in its "
                            "modeling module to compute it for this rank's queries against the whole row: under "
                            "sp/cp it would cover this rank's tokens only",
    "Compressor": "compressed attention: the compressor's entries (windows of the row, picked per query by an "
                  "indexer in CSA layers) are appended to this rank's keys inside the attention module, their causal "
                  "bias dropped when the model passes no 4-D mask (as under sp/cp); the sp/cp attention cannot tell "
                  "them from tokens, and their windows and bias are of the tokens the module is given",
    "M3VLIndexer": "a block-sparse indexer whose key blocks are slots of the tokens the attention is given and "
                   "whose choice becomes a [b, heads, s, s] mask inside the attention module for eager and sdpa "
                   "by name (block indices the sp/cp attention does not apply otherwise)",
    "QSAIndexer": "the indexer returns a dense [b, 1, s, S] selection mask built a query at a time from the "
                  "attention mask and keys it is given (not DSA's top-k positions), folded into the attention mask "
                  "the sp/cp attention replaces",
}


def _module_reason(layer: nn.Module) -> str | None:
    for name, module in layer.named_modules():
        cls = type(module).__name__
        why = next((r for f, r in MODULE_REASONS.items() if f in cls), None)
        if why:
            return f"{cls} ({name}): {why}"
    return None


def _layer_type_reason(kind: str, layer: nn.Module | None = None) -> str:
    module = _module_reason(layer) if layer is not None else None
    why = module or next((r for f, r in LAYER_TYPE_REASONS.items() if f in kind),
                         "its layers hold no sequence mixer module that takes the layer's hidden states")
    return f"layer type {kind!r}: {why}"


def unserved_mixers(model: nn.Module, config, attention_types: frozenset[str] = frozenset(),
                    served_modules: frozenset[int] = frozenset()) -> list[str]:
    """Sequence mixing of ``model`` that neither the sp/cp attention nor :func:`sequence_mixers` serves, one
    ``"what: why"`` each (empty: sp/cp can run the model). ``attention_types``: further layer types the sp/cp
    attention serves (indexed attention); ``served_modules``: ids of modules another sp/cp style serves (short
    convolutions run with a halo)."""
    mixers = sequence_mixers(model)
    owners = {id(m) for name, m in model.named_modules() if any(k.startswith(name + ".") for k in mixers)}
    types = list(getattr(config, "layer_types", None) or ())
    layers = decoder_layers(model)
    served: dict[str, bool] = {}
    first: dict[str, nn.Module] = {}
    aligned = len(layers) == len(types)
    for i, kind in enumerate(types):
        if kind not in ATTENTION_LAYER_TYPES and kind not in CHANNEL_LAYER_TYPES and kind not in attention_types:
            served[kind] = served.get(kind, True) and aligned and id(layers[i]) in owners
            first.setdefault(kind, layers[i] if aligned else None)
    found = [_layer_type_reason(kind, first[kind]) for kind, ok in served.items() if not ok]
    explained = {id(m) for kind, ok in served.items() if not ok and first[kind] is not None
                 and _module_reason(first[kind]) for layer in layers for m in layer.modules()}
    seen = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        if (cls in seen or not any(f in cls for f in RECURRENT_MIXERS) or isinstance(module, nn.Linear)
                or dispatches_attention(type(module)) or name in mixers or id(module) in owners
                or id(module) in served_modules
                or id(module) in explained or any(name.startswith(k + ".") for k in mixers)):
            continue
        seen.add(cls)
        found.append(f"{cls} ({name}): not a module that takes the layer's hidden states [b, s, H] (e.g. a "
                     "convolution inside the attention on its projections)")
    return found


# ---- the wrapper ------------------------------------------------------------------------------------------------

def gather_rows_in_order(x: torch.Tensor, state, batch=None) -> torch.Tensor:
    """``[b, s, …]`` (this rank's tokens) → ``[b, S, …]`` (the group's whole rows in row order): all-gathered over
    sp, then over cp, then reordered. Differentiable (backward: the group's sum for this rank's tokens)."""
    rows = x.transpose(0, 1).contiguous()
    for group, size, rank in ((state.sp_group, state.sp, state.sp_rank), (state.cp_group, state.cp, state.cp_rank)):
        if size > 1:
            rows = GatherRows.apply(rows, [rows.shape[0]] * size, PlanShard(group, size, rank, 0))
    if state.cp > 1:  # the cp chunks in cp rank order, as the attention's gathered keys: put in row order
        rows = rows[(batch or state.current).key_order()]
    return rows.transpose(0, 1)


def _gather_kwarg(value, state, local: int):
    """``value`` (a per-token tensor of this rank's tokens, or a tuple of them) for the whole rows. The model hands
    every layer the same ``position_ids`` / ``position_embeddings`` objects: each is gathered once per forward."""
    if isinstance(value, (tuple, list)):
        return type(value)(_gather_kwarg(v, state, local) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == local:
        cache = state.current.cache.mixer_kwargs
        kept = cache.get(id(value))
        if kept is None or kept[0] is not value:
            kept = cache[id(value)] = (value, gather_rows_in_order(value, state))
        return kept[1]
    return value


def _keep_local(out, index: torch.Tensor, seq_len: int):
    if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[1] == seq_len:
        return out[:, index]
    if isinstance(out, tuple) and out:  # (hidden states, the layer's final state or weights)
        return (_keep_local(out[0], index, seq_len), *out[1:])
    raise ModelStateError(f"sp/cp: a sequence mixer returned {type(out).__name__} without [b, {seq_len}, …] hidden "
                          "states first")


def _on_whole_rows(original, state, batch, hidden: torch.Tensor, seq_len: int, named: dict):
    """The mixer's own forward on the group's whole rows (of the forward ``batch``: the recompute in backward
    reads the same one), and this rank's tokens of its output."""
    out = original(gather_rows_in_order(hidden, state, batch), **named)
    return _keep_local(out, batch.local, seq_len)


def _whole_rows_forward(module: nn.Module, state, original, signature: inspect.Signature,
                        layer: nn.Module | None = None):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        batch = current_forward(state, f"{type(module).__name__} (sp/cp sequence mixer)")
        seq_len = batch.keys.numel()
        named = call_arguments(signature, args, kwargs)
        hidden = named.pop("hidden_states")
        local = hidden.shape[1]
        for name in PACKING_KWARGS:
            named.pop(name, None)
        for name in SEQUENCE_KWARGS:
            if named.get(name) is not None:
                named[name] = _gather_kwarg(named[name], state, local)
        # the whole rows' padding, as the integer 0/1 mask transformers passes its mixers (None: no padding): once per
        # forward, shared by the mixer layers
        cache = batch.cache
        if cache.mixer_mask is None and batch.key_valid is not None:
            cache.mixer_mask = batch.key_valid.long()
        named["attention_mask"] = cache.mixer_mask
        # not inside a checkpointed decoder layer: its own recompute already keeps nothing of the mixer's rows
        layer_recomputes = layer is not None and layer.training and getattr(layer, "gradient_checkpointing", False)
        if torch.is_grad_enabled() and state.options.mixer_recompute and not layer_recomputes:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(_on_whole_rows, original, state, batch, hidden, seq_len, named, use_reentrant=False)
        return _on_whole_rows(original, state, batch, hidden, seq_len, named)

    return forward


def install_sequence_mixers(model: nn.Module, state, attention_types: frozenset[str] = frozenset(),
                           served_modules: frozenset[int] = frozenset()) -> list[str]:
    """Wrap the forward of every :func:`sequence_mixers` module of ``model`` to run on the whole rows of ``state``'s
    sequence group (a :class:`~xpar_zoo.styles.sequence.SequenceParallel`); returns their names.
    ``attention_types``, ``served_modules``: as for :func:`unserved_mixers`."""
    mixers = sequence_mixers(model)
    missed = unserved_mixers(model, model.config.get_text_config(), attention_types, served_modules)
    if missed:  # checked before parallelize; found again here, or the model would run them on its shard alone
        raise ModelStateError(f"sp/cp: sequence mixing not wrapped after parallelize: {'; '.join(missed)}")
    modules = dict(model.named_modules())
    for name, module in mixers.items():
        original = module.forward
        layer = modules.get(name.rpartition(".")[0])  # the decoder layer that holds the mixer
        module.forward = _whole_rows_forward(module, state, original, inspect.signature(original), layer)
    return list(mixers)
