"""Where every in-memory tensor of a transformers model lives in a hub checkpoint, derived from transformers' own
conversion rules (``conversion_mapping.get_model_conversion_mapping``) and the safetensors headers — no tensor data.

:func:`map_hub_layout` gives each model tensor its *pieces* (one checkpoint tensor each, placed in a box of the
model tensor's global index space) and checks, before a byte of data is read, that every checkpoint key lands in
the model, every parameter / persistent buffer is covered exactly and every shape fits, or raises
:class:`CheckpointMismatchError` naming the keys, their files and the shapes. :meth:`HubLayout.reads` says which
slice of which checkpoint tensor fills which part of a region (a rank's local shard). Design:
``docs/design.md``, "Loading: shard-on-read".
"""

from __future__ import annotations

import copy
import functools
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..compat import keys_to_ignore_on_load
from ..errors import CheckpointMismatchError
from ..parallel.state import Box
from ..styles.lora import unwrapped_name
from .safetensors_files import (
    DTYPE_SIZES,
    LIST_LIMIT,
    SAFETENSORS_DTYPES,
    TensorInfo,
    listing,
)

# ---- layout -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor placed in a model tensor: it fills ``box`` (global coordinates of the model tensor);
    ``stack_dim`` is the model dim the checkpoint tensor lacks (one expert of a ``MergeModulelist``)."""

    source: TensorInfo
    box: Box
    stack_dim: int | None = None


@dataclass(frozen=True)
class Read:
    """Fill ``dest`` (slices of a local shard) with ``source[slices]`` (unsqueezed at ``stack_dim``)."""

    source: TensorInfo
    slices: tuple[slice, ...]
    dest: tuple[slice, ...]
    stack_dim: int | None

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES.get(self.source.dtype, 1)
        for s in self.slices:
            n *= s.stop - s.start
        return n


@dataclass(frozen=True)
class Conversion:
    """How transformers' own loader assembles a model tensor whose rule has no slice-wise reading (Interleave,
    Transpose, Split/Chunk, PermuteForRope, model-specific ops): the converter, the model tensor name it converts
    under, and its checkpoint keys in load order. Read whole, converted, then cut to the region wanted."""

    converter: object  # a transformers WeightConverter (copied for each conversion)
    first: str
    sources: tuple[tuple[str, str], ...]  # (source pattern, checkpoint key)


@dataclass(frozen=True)
class Target:
    """A model tensor (parameter or persistent buffer) and the checkpoint pieces that cover it (with
    ``conversion``: the checkpoint tensors it is converted from)."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    rule: str  # how the pieces were derived, for messages: "key", "MergeModulelist(dim=0) + Concatenate(dim=1)", …
    conversion: Conversion | None = None


@dataclass
class HubLayout:
    """Every model tensor's pieces, plus the checkpoint keys deliberately not read (ignored by the model's rules
    or aliases of tied weights)."""

    targets: dict[str, Target]
    tensors: dict[str, TensorInfo]
    ignored: tuple[str, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name whose target fills it
    init_buffers: tuple[str, ...] = ()  # persistent buffers the model allows to be absent: initialised, not read
    model: nn.Module | None = None  # the (meta) model the layout was planned for: transformers' ops may ask it

    def reads(self, name: str, region: Box) -> list[Read]:
        """What to read for the ``region`` (global ``[start, stop)`` per dim) of model tensor ``name`` (none for a
        converted tensor: see :meth:`convert`)."""
        if self.targets[name].conversion is not None:
            return []
        out = []
        for piece in self.targets[name].pieces:
            inter = tuple((max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(piece.box, region))
            if any(a >= b for a, b in inter):
                continue
            src = tuple(slice(a - pa, b - pa) for d, ((a, b), (pa, _)) in enumerate(zip(inter, piece.box))
                        if d != piece.stack_dim)
            dest = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, region))
            out.append(Read(piece.source, src, dest, piece.stack_dim))
        return out

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def converted(self) -> list[str]:
        """The model tensors that :meth:`convert` assembles (their rule has no slice-wise reading)."""
        return [n for n, t in self.targets.items() if t.conversion is not None]

    def convert(self, name: str, directory: str | Path, region: Box | None = None) -> torch.Tensor:
        """The ``region`` (default: all) of converted model tensor ``name``: its checkpoint tensors read whole from
        ``directory`` and converted by transformers' own rule, as its loader does."""
        conversion = self.targets[name].conversion
        converter = copy.deepcopy(conversion.converter)
        for pattern, key in conversion.sources:
            info = self.tensors[key]
            converter.add_tensor(conversion.first, key, pattern, functools.partial(_read_whole, directory, info))
        out = _converted(converter, conversion.first, self.model)[name]
        if region is not None:
            out = out[tuple(slice(a, b) for a, b in region)]
        return out


def _fusable(converter) -> bool:
    """Whether a converter is ``MergeModulelist`` then ``Concatenate`` into one target (read slice-wise)."""
    try:
        _fusion(converter)
    except CheckpointMismatchError:
        return False
    return True


def _read_whole(directory: str | Path, info: TensorInfo) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(Path(directory) / info.file), framework="pt", device="cpu") as f:
        return f.get_tensor(info.key)


class _ByTransformersName:
    """``model`` as transformers' conversion ops ask it for a tensor (``get_parameter``, e.g. ``Transpose``'s shape
    check), by the name transformers gives it: an adapter wrapper (PEFT's LoRA on fused experts) moves the wrapped
    tensor's module path under its ``base_layer``."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.config = model, getattr(model, "config", None)

    def get_parameter(self, name: str) -> nn.Parameter:
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            found = {unwrapped_name(n): p for n, p in self.model.named_parameters()}.get(name)
            if found is None:
                raise
            return found


def _converted(converter, first: str, model: nn.Module | None) -> dict[str, torch.Tensor]:
    """``{model tensor name: tensor}`` from a converter holding its checkpoint tensors (transformers' own call)."""
    seen = _ByTransformersName(model) if model is not None else None
    out = converter.convert(first, model=seen, config=getattr(model, "config", None))
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def _fusion(converter) -> tuple[int | None, int | None]:
    """``(stack_dim, concat_dim)`` of a converter made of ``MergeModulelist`` then ``Concatenate``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    stack = concat = None
    for i, op in enumerate(converter.operations):
        if isinstance(op, MergeModulelist) and i == 0:
            stack = op.dim
        elif isinstance(op, Concatenate) and concat is None:
            concat = op.dim
        else:
            raise CheckpointMismatchError(
                f"{converter!r} uses {type(op).__name__}, which xpar_zoo cannot read slice-wise yet "
                "(supported: MergeModulelist, then Concatenate)")
    if len(converter.target_patterns) != 1:
        raise CheckpointMismatchError(f"{converter!r} has several targets; xpar_zoo reads many-to-one rules only")
    if stack is not None and concat == stack:
        raise CheckpointMismatchError(f"{converter!r} concatenates on its stacking dim {stack}")
    return stack, concat


def _index_regex(pattern: str) -> re.Pattern | None:
    """A regex capturing the ``*`` of a converter source pattern as an integer (expert index)."""
    if pattern.count("*") != 1:
        return None
    before, after = pattern.split("*")
    return re.compile(re.escape(before) + r"(\d+)" + re.escape(after) + r"(?!\w)")


@dataclass
class _Group:
    """Checkpoint keys collected for one model tensor under one converter: ``{source pattern: [(index, key)]}``."""

    converter: object
    by_pattern: dict[str, list[tuple[int | None, str]]] = field(default_factory=lambda: defaultdict(list))


def _conversion_rules(model: nn.Module):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model) if hasattr(model, "base_model_prefix") else []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters


def revert_groups(model: nn.Module, names: Iterable[str]) -> list[tuple[str, ...]]:
    """``names`` (model tensors) in groups that transformers' ``revert_weight_conversion`` must see together: the
    targets of one converter that splits a checkpoint tensor (a fused ``qkv_proj``, ``in_proj``, text and vision
    experts) revert into that one tensor only jointly. Every other name is a group of one; order is kept."""
    _, converters = _conversion_rules(model)
    splits = [c.target_patterns for c in converters if len(c.target_patterns) > 1]
    present = set(names)
    done: set[str] = set()
    groups = []
    for name in names:
        if name in done:
            continue
        group: tuple[str, ...] = (name,)
        for patterns in splits:
            hit = next((p for p in patterns if p in name), None)
            siblings = tuple(name.replace(hit, p, 1) for p in patterns) if hit else ()
            if siblings and all(s in present and s not in done for s in siblings):
                group = siblings
                break
        done.update(group)
        groups.append(group)
    return groups


def renumbered(model: nn.Module, key: str, offset: int) -> str:
    """Hub ``key`` with its stacking index (the ``*`` of a converter's source pattern, e.g. the expert of
    ``mlp.experts.*.gate_proj.weight``) moved by ``offset``; other keys unchanged: the hub keys of rows
    ``[offset, …)`` of a fused tensor, from those that reverting the rows alone numbers from 0."""
    _, converters = _conversion_rules(model)
    for converter in converters:
        for pattern in converter.source_patterns:
            regex = _index_regex(pattern)
            match = regex.search(key) if regex is not None else None
            if match:
                return f"{key[:match.start(1)]}{int(match[1]) + offset}{key[match.end(1):]}"
    return key


def _ignore_regex(model: nn.Module, kind: str, extra: Iterable[str] = ()) -> re.Pattern | None:
    patterns = [*keys_to_ignore_on_load(model, kind), *extra]
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for parameters shared under several names (tied weights), in ``named_parameters``
    order: the canonical name is the first one."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


QUANTIZED_DTYPES = frozenset({"I8", "U8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"})
QUANTIZED_SUFFIXES = ("_blocks", "_scales", ".weight_scale", ".weight_scale_inv", ".input_scale", ".qweight",
                      ".qzeros", ".scales")


def refuse_quantized(tensors: Mapping[str, TensorInfo]) -> None:
    """Raise :class:`CheckpointMismatchError` naming the keys of a quantized checkpoint (int8 / fp8 / fp4 tensors,
    MXFP4 ``_blocks``/``_scales``, fp8 ``weight_scale_inv``, GPTQ ``qweight``…): xpar_zoo reads float weights only."""
    bad = [f"{i.key} ({i.file}, {i.dtype})" for i in tensors.values()
           if i.dtype in QUANTIZED_DTYPES or i.key.endswith(QUANTIZED_SUFFIXES)]
    if bad:
        raise CheckpointMismatchError(f"quantized weights, which xpar_zoo cannot load (it reads F32/BF16/F16 "
                                      f"tensors only; use a dequantized checkpoint): {listing(bad)}")


def map_hub_layout(model: nn.Module, tensors: Mapping[str, TensorInfo]) -> HubLayout:
    """Map checkpoint ``tensors`` (from :func:`read_checkpoint_headers`) onto ``model``'s parameters and persistent
    buffers (a meta-device model is enough) with transformers' conversion rules; raise
    :class:`CheckpointMismatchError` listing every missing, unexpected and wrong-shape key."""
    refuse_quantized(tensors)
    state = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    aliases = tied_aliases(model)
    direct, groups, unexpected, ignored = _sort_keys(model, tensors, state)
    targets, reported, problems = _direct_targets(direct, groups, state)
    missing_parts: list[str] = []
    for name, group in groups.items():
        if name in direct:
            continue
        reported.add(name)
        if not _fusable(group.converter):
            converted, errs = _convert_group(name, group, tensors, state, model)
            reported.update(converted)
            problems += errs
            targets.update(converted)
            continue
        target, errs, miss = _assemble(name, state[name], group, tensors)
        problems += errs
        missing_parts += miss
        if target is not None:
            targets[name] = target
    # Tied weights: an alias is filled through its canonical parameter; either may carry the checkpoint data.
    for alias, canonical in aliases.items():
        if alias not in targets:
            continue
        if canonical in targets:  # both saved: the alias's copy is not read
            ignored.extend(p.source.key for p in targets.pop(alias).pieces)
        else:
            targets[canonical] = targets.pop(alias)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    _check_complete(model, state, params, targets, aliases, reported, unexpected, problems, missing_parts)
    init_buffers = tuple(n for n in state if n not in targets and n not in aliases and n not in params)
    return HubLayout(targets, dict(tensors), tuple(ignored), dict(aliases), init_buffers, model)


def _sort_keys(model: nn.Module, tensors: Mapping[str, TensorInfo], state: Mapping[str, tuple]
               ) -> tuple[dict[str, list[TensorInfo]], dict[str, _Group], list[str], list[str]]:
    """Each checkpoint key renamed by transformers' rules: ``(direct, groups, unexpected, ignored)`` — the keys that
    are a model tensor as they are, those a converter combines (by model tensor), and those with no place in the
    model (reported, or ignored as the model's own ``_keys_to_ignore_on_load_unexpected`` says)."""
    from transformers.core_model_loading import (
        apply_renamings,
        dot_natural_key,
        rename_source_key,
    )

    renamings, converters = _conversion_rules(model)
    pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    has_rotary = any(n.endswith("rotary_emb.inv_freq") for n, _ in model.named_buffers())
    ignore_unexpected = _ignore_regex(model, "unexpected",
                                      [r"rotary_emb\.inv_freq"] if has_rotary else [])
    direct: dict[str, list[TensorInfo]] = defaultdict(list)
    groups: dict[str, _Group] = {}
    unexpected, ignored = [], []
    for key in sorted(tensors, key=dot_natural_key):
        info = tensors[key]
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if renamed not in state and key in state:
            renamed, pattern = key, None
        if renamed not in state:
            if ignore_unexpected is not None and ignore_unexpected.search(key):
                ignored.append(key)
            else:
                unexpected.append(f"{key} ({info.file})")
            continue
        if pattern is None:
            direct[renamed].append(info)
            continue
        group = groups.setdefault(renamed, _Group(pattern_to_converter[pattern]))
        regex = _index_regex(pattern)
        match = regex.search(apply_renamings(key, renamings)) if regex else None
        group.by_pattern[pattern].append((int(match.group(1)) if match else None, key))
    return direct, groups, unexpected, ignored


def _direct_targets(direct: Mapping[str, list[TensorInfo]], groups: Mapping[str, _Group],
                    state: Mapping[str, tuple]) -> tuple[dict[str, Target], set[str], list[str]]:
    """The model tensors one checkpoint key fills as it is: ``(targets, the tensors seen, problems)``."""
    targets: dict[str, Target] = {}
    reported: set[str] = set()  # model tensors already named in a problem
    problems = []
    for name, infos in direct.items():
        reported.add(name)
        if name in groups:
            keys = [f"{i.key} ({i.file})" for i in infos]
            problems.append(f"{name}: given both as {', '.join(keys)} and by the rule {groups[name].converter!r}")
            continue
        info = infos[0]
        if len(infos) > 1:
            problems.append(f"{name}: given by several keys {[f'{i.key} ({i.file})' for i in infos]}")
        elif info.shape != state[name]:
            problems.append(f"{info.key} ({info.file}): shape {list(info.shape)}, the model's {name} is "
                            f"{list(state[name])}")
        else:
            targets[name] = Target(name, state[name], (Piece(info, tuple((0, n) for n in info.shape)),), "key")
    return targets, reported, problems


def _check_complete(model: nn.Module, state: Mapping[str, tuple], params: set[str], targets: Mapping[str, Target],
                    aliases: Mapping[str, str], reported: set[str], unexpected: list[str], problems: list[str],
                    missing_parts: list[str]) -> None:
    """Raise :class:`CheckpointMismatchError` listing every missing, unexpected and mismatched key, if any."""
    ignore_missing = _ignore_regex(model, "missing")
    missing = [f"{n} {list(state[n])}" for n in state
               if n not in targets and n not in aliases
               and not (n not in params and ignore_missing is not None and ignore_missing.search(n))
               and not (n in reported and n not in targets)]
    if not (unexpected or problems or missing or missing_parts):
        return
    parts = []
    if missing or missing_parts:
        parts.append(f"missing (no checkpoint key fills them):{listing(missing + missing_parts)}")
    if unexpected:
        parts.append(f"unexpected (the model has no place for them):{listing(unexpected)}")
    if problems:
        parts.append(f"mismatched:{listing(problems)}")
    raise CheckpointMismatchError(f"checkpoint does not fit {type(model).__name__}:\n" + "\n".join(parts))


def _convert_group(first: str, group: _Group, tensors: Mapping[str, TensorInfo], state: Mapping[str, tuple],
                   model: nn.Module) -> tuple[dict[str, Target], list[str]]:
    """The model tensors one converter without a slice-wise reading produces from its checkpoint keys, each checked
    by converting meta tensors of the keys' shapes (transformers' own ops, no data). Returns ``(targets,
    problems)``."""
    from transformers.core_model_loading import dot_natural_key

    sources = tuple(sorted(((p, k) for p, entries in group.by_pattern.items() for _, k in entries),
                           key=lambda pk: (group.converter.source_patterns.index(pk[0]), dot_natural_key(pk[1]))))
    rule = " + ".join(repr(op) for op in group.converter.operations) + " (converted by transformers)"
    dry = copy.deepcopy(group.converter)
    for pattern, key in sources:
        info = tensors[key]
        dry.add_tensor(first, key, pattern, functools.partial(
            torch.empty, info.shape, dtype=SAFETENSORS_DTYPES.get(info.dtype, torch.float32), device="meta"))
    keys = ", ".join(f"{k} ({tensors[k].file})" for _, k in sources[:4]) + (" …" if len(sources) > 4 else "")
    try:
        shapes = {n: tuple(t.shape) for n, t in _converted(dry, first, model).items()}
    except Exception as e:  # an op that does not fit these keys (or cannot run on meta tensors)
        return {}, [f"{keys}: {rule} fails on their shapes ({type(e).__name__}: {e})"]
    problems = [f"{keys}: {rule} gives {n} {list(shape)}, which the model "
                + (f"has as {list(state[n])}" if n in state else "does not have")
                for n, shape in shapes.items() if state.get(n) != shape]
    if problems:
        return {}, problems
    pieces = tuple(Piece(tensors[k], tuple((0, n) for n in tensors[k].shape)) for _, k in sources)
    conversion = Conversion(group.converter, first, sources)
    return {n: Target(n, shape, pieces, rule, conversion) for n, shape in shapes.items()}, []


def _assemble(name: str, shape: tuple[int, ...], group: _Group, tensors: Mapping[str, TensorInfo]
              ) -> tuple[Target | None, list[str], list[str]]:
    """The pieces of ``name`` under one converter: expert ``j`` of source pattern ``p`` fills
    ``[j, offset_p : offset_p + size_p, …]``. Returns ``(target or None, problems, missing)``."""
    converter = group.converter
    stack, concat = _fusion(converter)
    rule = " + ".join(repr(op) for op in converter.operations)
    problems, missing, pieces = [], [], []
    offset = 0
    for pattern in converter.source_patterns:
        entries = group.by_pattern.get(pattern, [])
        if not entries:
            missing.append(f"{name}: no key matches {pattern!r} ({rule})")
            continue
        indices, errs, miss = _pattern_indices(name, shape, stack, pattern, entries, tensors, rule)
        problems += errs
        missing += miss
        if indices is None:
            continue
        size, advance, errs = _pattern_fit(name, shape, stack, concat, offset, pattern, entries, tensors, rule)
        problems += errs
        if size is not None:
            for j, (_, key) in zip(indices, entries):
                box = [(0, n) for n in shape]
                if stack is not None:
                    box[stack] = (j, j + 1)
                if concat is not None:
                    box[concat] = (offset, offset + size)
                pieces.append(Piece(tensors[key], tuple(box), stack))
        offset += advance
    if concat is not None and not problems and not missing and offset != shape[concat]:
        problems.append(f"{name}: the keys of {converter.source_patterns} cover {offset} of {shape[concat]} on dim "
                        f"{concat} ({rule})")
    if problems or missing:
        return None, problems, missing
    return Target(name, shape, tuple(pieces), rule), [], []


def _pattern_indices(name: str, shape: tuple[int, ...], stack: int | None, pattern: str, entries: list,
                     tensors: Mapping[str, TensorInfo], rule: str) -> tuple[list | None, list[str], list[str]]:
    """The stacking index of each key of ``pattern`` (``[None]``: a single unstacked key): ``(indices or None,
    problems, missing)`` — ``None`` when the keys do not give every index of dim ``stack`` exactly once."""
    if stack is None:
        if len(entries) != 1:
            return None, [f"{name}: several keys for {pattern!r}: {[k for _, k in entries]}"], []
        return [None], [], []
    indices = [j for j, _ in entries]
    if None in indices or len(set(indices)) != len(indices):
        indices = list(range(len(entries)))  # transformers' own rule: natural key order
    expected = set(range(shape[stack]))
    if set(indices) == expected:
        return indices, [], []
    j0, k0 = entries[0]
    absent = sorted(expected - set(indices))
    names = [_with_index(k0, pattern, j0, j) for j in absent[:LIST_LIMIT]] if j0 is not None else [f"#{j}" for j in absent]
    missing = [f"{name}: {n} ({rule})" for n in names]
    extra = sorted(set(indices) - expected)
    problems = [f"{key} ({tensors[key].file}): index {j} is beyond dim {stack} of {name} {list(shape)}"
                for j, key in entries if j in extra]
    return None, problems, missing


def _pattern_fit(name: str, shape: tuple[int, ...], stack: int | None, concat: int | None, offset: int, pattern: str,
                 entries: list, tensors: Mapping[str, TensorInfo], rule: str) -> tuple[int | None, int, list[str]]:
    """Whether the keys of ``pattern`` fit ``name`` at ``offset`` on dim ``concat``: ``(their size on that dim, or
    None when they do not fit; how far the offset moves; problems)``."""
    shapes = Counter(tensors[k].shape for _, k in entries)
    src_shape = shapes.most_common(1)[0][0]
    if len(shapes) != 1:
        return None, 0, [f"{k} ({tensors[k].file}): shape {list(tensors[k].shape)}, its siblings under "
                         f"{pattern!r} (→ {name}) are {list(src_shape)}"
                         for _, k in entries if tensors[k].shape != src_shape]
    k = entries[0][1]
    if len(src_shape) + (stack is not None) != len(shape):
        return None, 0, [f"{k} ({tensors[k].file}): shape {list(src_shape)} cannot be part of {name} "
                         f"{list(shape)} ({rule})"]
    full = list(src_shape)
    if stack is not None:
        full.insert(stack, shape[stack])
    size = full[concat] if concat is not None else 0
    bad = [d for d in range(len(shape)) if d != concat and full[d] != shape[d]]
    if bad or (concat is not None and offset + size > shape[concat]):
        return None, size, [f"{k} ({tensors[k].file}): shape {list(src_shape)} does not fit {name} {list(shape)} "
                            f"({rule})"]
    return size, size, []


def _with_index(key: str, pattern: str, have: int, want: int) -> str:
    """``key`` (which matched ``pattern`` with index ``have``) with the index ``want`` instead."""
    before, after = pattern.split("*")
    return key.replace(f"{before}{have}{after}", f"{before}{want}{after}", 1)
