"""Hub checkpoint (per-expert or already fused) → an xpar_zoo DCP checkpoint in the global fused layout.

``xpar-zoo convert to-dcp NAME_OR_DIR OUT`` writes a checkpoint root holding one complete checkpoint,
``OUT/step-00000000/``: what :func:`xpar_zoo.save_checkpoint` writes minus optimizer and RNG state, so
:func:`xpar_zoo.load_checkpoint` loads it on any mesh and world size and a restart skips the per-expert fusion of
``from_pretrained``. Tensors are planned from the safetensors headers (:func:`map_hub_layout`), assembled and written
a batch of at most ``max_bytes`` at a time (peak memory near one and a half batches), into a staging directory
renamed into place at the end. How the streaming works: ``docs/design.md``, "Export and conversion".
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from xpar_zoo.checkpoint import (
    DCP_METADATA,
    EXTRA_FILE,
    META_FILE,
    MODEL_KEY,
    checkpoint_name,
    model_tensor_specs,
    write_complete_marker,
)
from xpar_zoo.checkpoint.dcp_io import MetadataUnpickler, quiet_single_process
from xpar_zoo.checkpoint.state import metadata_record
from xpar_zoo.errors import ConvertError
from xpar_zoo.hub.safetensors_files import SAFETENSORS_DTYPES
from xpar_zoo.io.atomic_dir import StagingDir, check_apart, check_output, durable_write
from xpar_zoo.io.batching import byte_batches
from xpar_zoo.loader import open_hub_checkpoint
from xpar_zoo.parallel.materialize import initialise_buffers

DEFAULT_BATCH_BYTES = 1 << 30
_PART_PREFIX = ".part-"


class _Files:
    """Open safetensors files of one batch, read with plain ``readinto`` straight into the destination tensor
    (no mmap: pages already copied do not stay resident), or through ``safe_open`` for a non-contiguous slice."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.handles: dict[str, tuple[object, int]] = {}
        self.st: dict[str, object] = {}

    def _open(self, file: str) -> tuple[object, int]:
        if file not in self.handles:
            f = open(self.directory / file, "rb", buffering=0)
            self.handles[file] = (f, 8 + int.from_bytes(f.read(8), "little"))
        return self.handles[file]

    def read_into(self, read, dest: torch.Tensor) -> None:
        info = read.source
        whole = all(s.start == 0 and s.stop == n for s, n in zip(read.slices, info.shape))
        if whole and dest.is_contiguous() and dest.numel() * dest.element_size() == info.nbytes:
            f, data_start = self._open(info.file)
            f.seek(data_start + info.offsets[0])
            view = memoryview(dest.view(-1).view(torch.uint8).numpy())
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ConvertError(f"{self.directory / info.file}: truncated in the data of {info.key}")
                done += n
            return
        from safetensors import safe_open

        if info.file not in self.st:
            self.st[info.file] = safe_open(str(self.directory / info.file), framework="pt", device="cpu")
        data = self.st[info.file].get_slice(info.key)[read.slices]
        dest.copy_(data.unsqueeze(read.stack_dim) if read.stack_dim is not None else data)

    def close(self) -> None:
        for f, _ in self.handles.values():
            f.close()
        self.handles.clear()
        self.st.clear()


def assemble(layout, name: str, files: _Files) -> torch.Tensor:
    """The full tensor ``name``, filled piece by piece from the hub files."""
    target = layout.targets[name]
    if target.conversion is not None:  # a rule without a slice-wise reading: transformers' own conversion
        return layout.convert(name, files.directory)
    dtypes = {p.source.dtype for p in target.pieces}
    if len(dtypes) != 1:
        raise ConvertError(f"{name}: its hub pieces have several dtypes {sorted(dtypes)} "
                           f"({', '.join(sorted({p.source.key for p in target.pieces})[:4])} …)")
    (dtype,) = dtypes
    if dtype not in SAFETENSORS_DTYPES:
        raise ConvertError(f"{name}: dtype {dtype} of {target.pieces[0].source.key} is not supported")
    out = torch.empty(target.shape, dtype=SAFETENSORS_DTYPES[dtype])
    for read in layout.reads(name, tuple((0, n) for n in target.shape)):
        files.read_into(read, out[read.dest])
    return out


def _init_buffers(model, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Values of persistent buffers the checkpoint may lack (the model's own ``_init_weights``), one module at a
    time on CPU."""
    out = {}
    for name in names:
        module = model.get_submodule(name.rpartition(".")[0])
        module.to_empty(device="cpu", recurse=False)
        initialise_buffers(model, {name})
        out[name] = model.get_buffer(name).detach().clone()
        module.to_empty(device="meta", recurse=False)
    return out


def _merge_parts(tmp: Path, parts: list[Path]) -> None:
    """Move every part's data files into ``tmp`` (renamed ``__<part>_<i>.distcp``) and write one ``.metadata``
    that indexes them all."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={}, storage_meta=StorageMeta())
    for k, part in enumerate(parts):
        with open(part / DCP_METADATA, "rb") as f:
            meta = MetadataUnpickler(f).load()
        renames = {}
        for i, src in enumerate(sorted(p.name for p in part.iterdir() if p.name != DCP_METADATA)):
            renames[src] = f"__{k}_{i}.distcp"
            os.rename(part / src, tmp / renames[src])
        overlap = set(meta.state_dict_metadata) & set(merged.state_dict_metadata)
        if overlap:  # pragma: no cover - the batches are disjoint by construction
            raise ConvertError(f"keys written twice: {sorted(overlap)[:4]}")
        merged.state_dict_metadata.update(meta.state_dict_metadata)
        merged.planner_data.update(meta.planner_data or {})
        for index, info in meta.storage_data.items():
            info.relative_path = renames[info.relative_path]
            merged.storage_data[index] = info
        if getattr(meta, "version", None) is not None:
            merged.version = meta.version
        shutil.rmtree(part)
    durable_write(tmp / DCP_METADATA, pickle.dumps(merged))


def convert_to_dcp(
    name: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    revision: str | None = None,
    force: bool = False,
    max_bytes: int = DEFAULT_BATCH_BYTES,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    progress: bool = True,
) -> Path:
    """Convert hub id / local directory ``name`` (per-expert hub layout or already fused) into an xpar_zoo
    checkpoint root ``out_dir`` holding ``step-00000000`` in the global fused layout, reading at most
    ``max_bytes`` of tensors at a time. ``force`` replaces an existing ``out_dir``. Returns the step directory."""
    out_dir = Path(out_dir).expanduser().absolute()
    check_output(out_dir, force, ConvertError, inputs=[Path(name).expanduser()])
    hub = open_hub_checkpoint(name, revision, cache_dir=cache_dir, token=token)  # strict: raises before any data
    directory, model, layout, resolved = hub.directory, hub.model, hub.layout, hub.resolved
    check_apart(out_dir, [directory], ConvertError)  # a hub id's snapshot (or a link to a local directory)
    state_names = list(model.state_dict(keep_vars=True))  # what get_model_state_dict / load_checkpoint expect
    aliases = layout.aliases
    buffers = _init_buffers(model, layout.init_buffers) if layout.init_buffers else {}
    sizes = {n: sum(p.source.nbytes for p in layout.targets[n].pieces) for n in state_names if n in layout.targets}
    unplaced = [n for n in state_names if n not in sizes and n not in aliases and n not in buffers]
    if unplaced:  # pragma: no cover - map_hub_layout has already checked coverage
        raise ConvertError(f"no checkpoint data for {unplaced[:8]}")
    alias_of: dict[str, list[str]] = {}
    for alias, canonical in aliases.items():
        if alias in state_names:
            alias_of.setdefault(canonical, []).append(alias)

    step = 0
    with StagingDir(out_dir, ConvertError) as tmp:  # moved into place when complete, removed on any error
        ckpt = tmp / checkpoint_name(step)
        ckpt.mkdir(parents=True)
        parts = _write_parts(ckpt, layout, directory, sizes, alias_of, buffers, max_bytes, progress)
        _merge_parts(ckpt, parts)
        meta = metadata_record(model, step, None, {}, None)
        meta.update(world_size=None, converted_from={
            "source": str(name), "directory": str(directory), "origin": resolved.origin,
            "revision": resolved.revision, "commit": resolved.commit,
            "layout": "hub per-expert" if any(t.rule != "key" for t in layout.targets.values()) else "hub fused",
            "note": "converted from hub by xpar-zoo convert to-dcp: no optimizer or RNG state"})
        durable_write(ckpt / META_FILE, json.dumps(meta, indent=1).encode())
        durable_write(ckpt / EXTRA_FILE, json.dumps({}).encode())
        write_complete_marker(ckpt, step)
        _check_readable(ckpt, {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()})
    return out_dir / checkpoint_name(step)


def _write_parts(ckpt: Path, layout, directory: Path, sizes: dict[str, int], alias_of: dict[str, list[str]],
                 buffers: dict, max_bytes: int, progress: bool) -> list[Path]:
    """The model tensors assembled a batch of at most ``max_bytes`` at a time, each batch saved by DCP into a part
    directory of ``ckpt`` (the buffers no checkpoint holds go with the first); returns the parts in order."""
    import torch.distributed.checkpoint as dcp
    from tqdm.auto import tqdm

    parts = []
    with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="convert to DCP",
              disable=not progress) as bar:  # closed (a line of its own) on errors too
        for k, batch in enumerate(byte_batches(sizes.items(), max_bytes)):
            state = _batch_state(layout, directory, batch, alias_of)
            if k == 0:
                state.update(buffers)
            part = ckpt / f"{_PART_PREFIX}{k:05d}"
            with quiet_single_process():
                dcp.save({MODEL_KEY: state}, storage_writer=dcp.FileSystemWriter(str(part), sync_files=True),
                         no_dist=True)
            parts.append(part)
            bar.update(sum(sizes[n] for n in batch))
            del state
    return parts


def _batch_state(layout, directory: Path, batch: list[str], alias_of: dict[str, list[str]]) -> dict:
    """The tensors of ``batch`` assembled from the hub files (a tied alias shares its canonical tensor)."""
    files = _Files(directory)
    state = {}
    try:
        for n in batch:
            state[n] = assemble(layout, n, files)
            for alias in alias_of.get(n, ()):
                state[alias] = state[n]
    finally:
        files.close()
    return state


def _check_readable(ckpt: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The merged metadata indexes every model tensor at its shape (no data read)."""
    specs = model_tensor_specs(ckpt)
    if {n: s for n, (s, _) in specs.items()} != shapes:
        missing = sorted(set(shapes) - set(specs))
        raise ConvertError(f"{ckpt}: the written checkpoint does not index every model tensor (missing "
                           f"{missing[:8]})")


