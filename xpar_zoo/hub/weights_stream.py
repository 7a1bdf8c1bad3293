"""``xpar_zoo.iter_hub_weights``: a parallelized model's weights in the hub's own key layout, gathered one bucket at
a time, for an inference engine (vLLM's ``load_weights``, a weight-sync server) without ever holding the model.

The hub tensors are the ones ``save_pretrained`` and ``xpar-zoo convert to-hf`` write (the same revert groups,
tied duplicates left out, transformers' own ``revert_weight_conversion``); a fused experts tensor whose hub keys are
per expert is gathered by rows of dim 0 (experts) and reverted rows at a time, so no rank ever holds it whole. A
bucket is one flat byte buffer: every rank copies in the parts of its local shards it owns (the first of their
replicas), and one byte-wise all-reduce completes it on every rank (a sum with zeros: the bytes exactly).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..errors import ModelStateError
from ..io.batching import byte_batches
from ..parallel.distributed import broadcast, rank
from ..parallel.materialize import check_materialized
from ..parallel.state import consecutive_runs, held_indices
from .layout import revert_groups
from .writer import (
    parse_dtype,
    parse_size,
    revert_rows_to_hub,
    revert_to_hub,
    rows_revert,
    tied_duplicates,
)

ALIGN = 64  # bytes: each tensor of a bucket starts at a multiple, so any dtype's view of the buffer is aligned
HubBucket = list[tuple[str, torch.Tensor]]
Rows = tuple[int, int] | None  # [start, stop) of dim 0, or the whole tensor


@dataclass(frozen=True)
class _Unit:
    """Model tensors reverted together (``names``), the live tensors gathered for them (``reads``: the names, or with
    a merged adapter also its factors), their rows of dim 0 (``None``: whole), and the bytes gathered."""

    names: tuple[str, ...]
    reads: tuple[str, ...]
    rows: Rows
    nbytes: int


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _units(meta_model: nn.Module, config, outputs: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor],
           reads_of: Callable[[str], list[str]]) -> list[_Unit]:
    """What to gather, in order: one unit per revert group, or per row of a fused tensor that reverts row by row
    (with every tensor it is read from stacked on the same rows)."""
    skip = tied_duplicates(meta_model, config)
    units = []
    for group in revert_groups(meta_model, [n for n in outputs if n not in skip]):
        reads = tuple(r for n in group for r in reads_of(n))
        nbytes = sum(_nbytes(live[r].shape, live[r].dtype) for r in reads)
        shape = tuple(outputs[group[0]].shape)
        by_rows = (len(group) == 1 and all(live[r].dim() >= 2 and live[r].shape[0] == shape[0] for r in reads)
                   and rows_revert(meta_model, group[0], shape, outputs[group[0]].dtype))
        if by_rows:
            units += [_Unit(group, reads, (j, j + 1), nbytes // shape[0]) for j in range(shape[0])]
        else:
            units.append(_Unit(group, reads, None, nbytes))
    return units


def _buckets(units: list[_Unit], bucket_bytes: int) -> list[list[_Unit]]:
    """``units`` in buckets of at most ``bucket_bytes`` (a larger unit alone), adjacent rows of a tensor joined."""
    out = []
    for batch in byte_batches(((u, u.nbytes) for u in units), bucket_bytes):
        joined: list[_Unit] = []
        for u in batch:
            last = joined[-1] if joined else None
            if last is not None and u.rows and last.rows and last.names == u.names and last.rows[1] == u.rows[0]:
                joined[-1] = _Unit(u.names, u.reads, (last.rows[0], u.rows[1]), last.nbytes + u.nbytes)
            else:
                joined.append(u)
        out.append(joined)
    return out


def _owned(tensor: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """This rank's local tensor and held indices when it is the first replica of its part, else ``None``."""
    if not isinstance(tensor, DTensor):
        return (tensor, {}) if rank() == 0 else None
    if any(p.is_partial() for p in tensor.placements):
        raise ModelStateError(f"a tensor placed {tensor.placements} holds partial sums, not weights")
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None or any(isinstance(p, Replicate) and c != 0 for p, c in zip(tensor.placements, coordinate)):
        return None
    return tensor.to_local(), held_indices(tensor)[1]


def _fill(view: torch.Tensor, tensor: torch.Tensor, rows: Rows) -> None:
    """Copy into ``view`` (the global rows ``rows`` of ``tensor``) the part this rank owns."""
    owned = _owned(tensor)
    if owned is None:
        return
    local, held = owned
    runs = [consecutive_runs(held[d].tolist()) if d in held else [(0, 0, n)] for d, n in enumerate(local.shape)]
    if rows is not None:
        a, b = rows
        runs[0] = [(lo + max(g, a) - g, max(g, a) - a, min(g + k, b) - max(g, a)) for lo, g, k in runs[0]
                   if max(g, a) < min(g + k, b)]
    for combo in itertools.product(*runs):
        view[tuple(slice(g, g + k) for _, g, k in combo)] = local[tuple(slice(lo, lo + k) for lo, _, k in combo)]


def _places(bucket: list[_Unit], live: Mapping[str, torch.Tensor]) -> dict[tuple[str, Rows], tuple]:
    """``{(live name, rows): (byte offset, shape, dtype)}`` of a bucket's tensors in its buffer."""
    places, total = {}, 0
    for unit in bucket:
        for r in unit.reads:
            t = live[r]
            shape = (unit.rows[1] - unit.rows[0], *t.shape[1:]) if unit.rows else tuple(t.shape)
            places[r, unit.rows] = (total, shape, t.dtype)
            total += -(-_nbytes(shape, t.dtype) // ALIGN) * ALIGN
    return places


def _bucket_bytes(bucket: list[_Unit], live: Mapping[str, torch.Tensor]) -> int:
    places = _places(bucket, live)
    return max((offset + _nbytes(shape, dtype) for offset, shape, dtype in places.values()), default=0)


def _gather(bucket: list[_Unit], live: Mapping[str, torch.Tensor], buffer: torch.Tensor
            ) -> dict[tuple[str, Rows], torch.Tensor]:
    """``{(live name, rows): full tensor}`` of a bucket, views of ``buffer``: zeroed, every rank's owned parts
    copied in, one all-reduce."""
    places = _places(bucket, live)
    used = buffer[:_bucket_bytes(bucket, live)]
    used.zero_()
    views = {}
    with torch.no_grad():
        for (r, rows), (offset, shape, dtype) in places.items():
            view = buffer[offset:offset + _nbytes(shape, dtype)].view(dtype).view(shape)
            _fill(view, live[r], rows)
            views[r, rows] = view
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(used)
    return views


def _to_hub(meta_model: nn.Module, unit: _Unit, tensors: dict[str, torch.Tensor], cast: torch.dtype | None
            ) -> HubBucket:
    """The hub tensors of a unit, views of its tensors: rows are reverted one at a time (transformers' reverse of a
    ``Concatenate`` makes its chunks contiguous, a copy for several rows, a view for one)."""
    if unit.rows is not None:
        name, hub = unit.names[0], {}
        for j in range(unit.rows[1] - unit.rows[0]):
            hub.update(revert_rows_to_hub(meta_model, name, tensors[name][j:j + 1], unit.rows[0] + j))
    else:
        hub = revert_to_hub(meta_model, tensors)
    return [(k, v.to(cast) if cast is not None and v.is_floating_point() else v) for k, v in hub.items()]


def _merged(unit: _Unit, gathered: dict, merge) -> dict[str, torch.Tensor]:
    """A unit's tensors with the adapter merged; a single tensor's merge is written back into its own view of the
    bucket's buffer, so that the merged bucket takes no second buffer."""
    views = [gathered.pop((r, unit.rows)) for r in unit.reads]
    merged = dict(merge.merged(zip(unit.reads, views)))
    if len(unit.names) == 1 and views[-1].shape == merged[unit.names[0]].shape:
        views[-1].copy_(merged[unit.names[0]])
        merged[unit.names[0]] = views[-1]
    return merged


def _bucket(meta_model: nn.Module, bucket: list[_Unit], live: Mapping[str, torch.Tensor], merge,
            cast: torch.dtype | None, buffer: torch.Tensor) -> HubBucket:
    """One bucket gathered and reverted to hub tensors (views of ``buffer``, unless cast)."""
    gathered = _gather(bucket, live, buffer)
    out: HubBucket = []
    for unit in bucket:
        tensors = (_merged(unit, gathered, merge) if merge is not None
                   else {r: gathered.pop((r, unit.rows)) for r in unit.reads})
        out += _to_hub(meta_model, unit, tensors, cast)
    return out


def _stream(meta_model: nn.Module, buckets: list[list[_Unit]], live: Mapping[str, torch.Tensor],
            merge, cast: torch.dtype | None, device: torch.device) -> Iterator[HubBucket]:
    # One buffer for every bucket: the previous bucket is overwritten (and freed at once, which a collective's
    # lingering reference to a fresh buffer per bucket would not allow).
    buffer = torch.empty(max((_bucket_bytes(b, live) for b in buckets), default=0), dtype=torch.uint8, device=device)
    for bucket in buckets:
        out = _bucket(meta_model, bucket, live, merge, cast, buffer)
        yield out
        out.clear()


def _adapter_stream(model: nn.Module, bucket_bytes: int) -> Iterator[HubBucket]:
    """The adapter alone, in PEFT's file keys and layouts (every rank: rank 0's gather, broadcast)."""
    from .adapter_files import adapter_state

    state = broadcast(adapter_state(model))
    for names in byte_batches(((k, _nbytes(v.shape, v.dtype)) for k, v in state.items()), bucket_bytes):
        out = [(k, state.pop(k)) for k in names]
        yield out
        out.clear()


def iter_hub_weights(model: nn.Module, bucket_bytes: int | str = 512 << 20, *, dtype: str | torch.dtype | None = None,
                     adapter_only: bool = False) -> Iterator[HubBucket]:
    """Buckets of ``(hub name, full tensor)`` of a parallelized ``model``: the names and bytes that
    ``save_pretrained`` / ``xpar-zoo convert to-hf`` write (per-expert keys where the hub has them), every tensor on
    every rank. A collective: every rank iterates to the end. One bucket (about ``bucket_bytes``, or one larger
    tensor) is gathered at a time, into one buffer that the next bucket overwrites: copy what you keep. The tensors
    are views of that buffer; ``dtype`` casts floating tensors (copies, of one bucket at a time). A PEFT model
    streams its merged weights, or with ``adapter_only=True`` its adapter in PEFT's own file keys and layouts."""
    from ..zoo.registry import build_meta
    from .adapter_files import AdapterMerge, adapter_metadata

    cast = parse_dtype(dtype)
    limit = parse_size(bucket_bytes, "bucket_bytes")
    check_materialized(model)
    meta_data = adapter_metadata(model)
    if adapter_only:
        if meta_data is None:
            raise ModelStateError("iter_hub_weights(adapter_only=True): the model has no PEFT adapter")
        return _adapter_stream(model, limit)
    config = getattr(model, "config", None)
    live = model.state_dict()  # sharded DTensors at global shapes
    merge, reads_of, outputs = None, (lambda n: [n]), live
    if meta_data is not None:
        merge = AdapterMerge(config, meta_data, {n: (tuple(t.shape), t.dtype) for n, t in live.items()}, "the model")
        outputs = {n: torch.empty(shape, dtype=dt, device="meta") for n, shape, dt in merge.outputs}
        reads_of = lambda n: merge.reads([n])  # noqa: E731
    meta_model = build_meta(config, torch.float32)
    buckets = _buckets(_units(meta_model, config, outputs, live, reads_of), limit)
    device = next((t.to_local().device for t in live.values() if isinstance(t, DTensor)), torch.device("cpu"))
    return _stream(meta_model, buckets, live, merge, cast, device)
