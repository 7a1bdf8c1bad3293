"""``from_pretrained``: a hub checkpoint straight into a parallelized model, each rank reading only its own slices.

1. ``resolve``            the name → a local directory (hub id, HF cache, or a directory), once per node;
2. ``build_meta``         the transformers model from its config, on the meta device (no memory, no init);
3. ``map_hub_layout``    checkpoint headers × transformers' conversion rules → every tensor's pieces, checked
                          strictly (missing / unexpected / wrong shape) before any tensor data is read;
4. ``parallelize``        extra plans on dim 0 and FSDP2 (planned slices on dim 0 where it divides, else dim 1),
                          still on meta;
5. ``materialize``        allocate only the local shards; non-persistent buffers (rotary ``inv_freq``) initialised
                          by the model's own ``_init_weights``, as transformers does;
6. ``fill_local_shards``  per file, per local shard: read exactly the slice this rank keeps (``safe_open(…)
                          .get_slice``), fusing per-expert keys on the fly, casting to the model dtype.
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from .environment import launcher_local_rank
from .errors import LoadError
from .hub.layout import HubLayout, Read, map_hub_layout
from .hub.resolve import ResolvedModel, resolve
from .hub.safetensors_files import read_checkpoint_headers
from .hub.writer import dtype_named
from .parallel import distributed
from .parallel.materialize import materialize
from .parallel.mesh import Mesh, check_same_on_all_ranks
from .parallel.state import local_region, parallel_state
from .parallelize import parallelize
from .zoo.plan import Plan
from .zoo.registry import build_meta, check_supported, plan_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class LoadStats:
    """What one rank read: ``bytes_read`` of the checkpoint's ``checkpoint_bytes``, in ``reads`` slice reads from
    ``files`` files, in ``seconds``. Kept on the model as ``model._xpar_load``."""

    bytes_read: int
    checkpoint_bytes: int
    reads: int
    files: int
    seconds: float
    directory: str


def resolve_on_each_node(name: str | os.PathLike, revision: str | None = None, **kwargs) -> ResolvedModel:
    """:func:`xpar_zoo.hub.resolve.resolve` on every rank, local rank 0 first (it downloads; the others then find the files
    in the cache). A failure on any rank raises on every rank, so no rank is left waiting in a collective."""
    if distributed.world_size() == 1 or Path(name).is_dir():
        return resolve(name, revision, **kwargs)  # nothing to download: every rank on its own
    if launcher_local_rank(distributed.rank()) == 0:
        result = distributed.run_everywhere(lambda: resolve(name, revision, **kwargs), active=True)
        distributed.run_everywhere(lambda: resolve(name, revision, **kwargs), active=False)
        return result
    distributed.run_everywhere(lambda: resolve(name, revision, **kwargs), active=False)
    return distributed.run_everywhere(lambda: resolve(name, revision, **kwargs), active=True)


def _torch_dtype(dtype, config) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        value = dtype_named(dtype)
        if value is None:
            raise LoadError(f"unknown dtype {dtype!r}")
        dtype = value
    if not dtype.is_floating_point:
        raise LoadError(f"dtype must be a floating-point dtype, got {dtype}")
    return dtype


def _dtype_argument(dtype, torch_dtype):
    """``dtype``, or transformers' deprecated ``torch_dtype`` (with transformers' own deprecation warning)."""
    if torch_dtype is None:
        return dtype
    if dtype is not None:
        raise LoadError(f"both dtype={dtype!r} and torch_dtype={torch_dtype!r} were given; pass dtype only")
    warnings.warn("`torch_dtype` is deprecated! Use `dtype` instead!", FutureWarning, stacklevel=3)
    return torch_dtype


def _check_parallelize_kwargs(kwargs: dict) -> None:
    accepted = [n for n, p in inspect.signature(parallelize).parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(accepted) - {"plan"})
    if unknown:
        raise TypeError(f"from_pretrained() got unexpected keyword argument(s) {unknown}; besides its own (name, mesh, "
                        f"dtype, revision, plan, device, cache_dir, token, progress, peft_config, adapter) it takes "
                        f"parallelize's {accepted}")


def load_config(directory: str | Path):
    """The transformers config in ``directory``, never running code from it
    (:func:`xpar_zoo.zoo.configs.load_config`); a missing, malformed or unrecognised ``config.json`` raises
    :class:`LoadError` naming the file."""
    from .zoo.configs import load_config as safe_load_config

    return safe_load_config(directory, LoadError)


@dataclass(frozen=True)
class HubCheckpoint:
    """A hub checkpoint opened for reading: where its files are, its config, the model on the meta device and where
    every model tensor lives in the files (no tensor data read yet)."""

    resolved: ResolvedModel
    config: object
    model: PreTrainedModel
    layout: HubLayout
    plan: Plan | None = None  # with ``for_training``: the plan the model trains under

    @property
    def directory(self) -> Path:
        return self.resolved.directory


def open_hub_checkpoint(name: str | os.PathLike, revision: str | None = None, dtype: torch.dtype | str | None = None,
                        *, cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
                        on_each_node: bool = False, for_training: bool = False, plan: Plan | None = None
                        ) -> HubCheckpoint:
    """Resolve ``name`` (hub id or directory; on every rank, local rank 0 first, with ``on_each_node``), read its
    config, build the model on meta in ``dtype`` (default: the config's) and map every model tensor to its
    checkpoint pieces, strictly: every error (quantized weights; with ``for_training`` a refused architecture or one
    without a plan, unless ``plan`` is given; missing / unexpected / wrong-shape keys, bad headers) is raised here,
    before any tensor data is read. The first step of ``from_pretrained`` and ``xpar-zoo convert to-dcp``."""
    resolved = (resolve_on_each_node if on_each_node else resolve)(name, revision, cache_dir=cache_dir, token=token)
    config = load_config(resolved.directory)
    if getattr(config, "quantization_config", None):
        raise LoadError(f"{name}: quantized checkpoints ({config.quantization_config}) are not supported")
    if for_training:
        check_supported(config.model_type)  # a refused architecture: refused before any work
    model = build_meta(config, _torch_dtype(dtype, config))
    if for_training:
        plan = plan or plan_for(model)  # curated, or derived from transformers' declarations on the model
    layout = map_hub_layout(model, read_checkpoint_headers(resolved.directory))
    return HubCheckpoint(resolved, config, model, layout, plan)


def _live_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_buffers(remove_duplicate=False)),
            **dict(model.named_parameters(remove_duplicate=False))}


def fill_local_shards(model: nn.Module, layout: HubLayout, directory: str | Path, *, progress: bool = True,
                      names: dict[str, str] | None = None) -> LoadStats:
    """Read into every local shard of ``model`` (parallelized, allocated) the slices of the checkpoint in
    ``directory`` that ``layout`` assigns to it, one file at a time; return what was read. ``names`` maps the
    layout's names to the model's where they differ (``{transformers name: name in model}``, e.g. under PEFT)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    live = _live_tensors(model)
    if names:
        live = {n: live[names.get(n, n)] for n in layout.targets if names.get(n, n) in live}
    work: dict[str, list[tuple[Read, torch.Tensor]]] = defaultdict(list)
    for name, target in layout.targets.items():
        if name not in live:
            raise LoadError(f"{name} is in the checkpoint layout but not in the parallelized model")
        local, region = local_region(live[name])
        if tuple(live[name].shape) != target.shape:
            raise LoadError(f"{name}: model tensor {tuple(live[name].shape)}, layout {target.shape}")
        for read in layout.reads(name, region):
            work[read.source.file].append((read, local))
    total = sum(r.nbytes for reads in work.values() for r, _ in reads)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="Loading rank 0's shards", disable=not progress or distributed.rank() != 0)
    nbytes = nreads = 0
    directory = Path(directory)
    with torch.no_grad(), bar:
        for file in sorted(work):
            reads = sorted(work[file], key=lambda rl: (rl[0].source.offsets[0], [s.start for s in rl[0].slices]))
            nbytes += _read_file(directory / file, reads, bar)
            nreads += len(reads)
        for name in layout.converted():  # rules without a slice-wise reading: read whole, converted by transformers
            local, region = local_region(live[name])
            local.copy_(layout.convert(name, directory, region))
            nbytes += sum(p.source.nbytes for p in layout.targets[name].pieces)
            nreads += len(layout.targets[name].pieces)
    return LoadStats(nbytes, layout.total_bytes(), nreads, len(work), time.perf_counter() - start, str(directory))


def _read_file(path: Path, reads: list[tuple[Read, torch.Tensor]], bar) -> int:
    """Copy each read of one safetensors file into its local tensor (in the file's order); returns the bytes read."""
    nbytes = 0
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        for read, local in reads:
            data = handle.get_slice(read.source.key)[read.slices] if read.slices else handle.get_tensor(read.source.key)
            if read.stack_dim is not None:
                data = data.unsqueeze(read.stack_dim)
            local[read.dest].copy_(data)
            nbytes += read.nbytes
            bar.update(read.nbytes)
            del data
    return nbytes


def from_pretrained(
    name: str | os.PathLike,
    mesh: Mesh | None = None,
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    *,
    plan: Plan | None = None,
    device: torch.device | str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    progress: bool = True,
    torch_dtype: torch.dtype | str | None = None,
    peft_config=None,
    adapter: str | os.PathLike | None = None,
    **parallelize_kwargs,
) -> nn.Module:
    """Load hub id / cached repo / local directory ``name`` (safetensors) as the real transformers class,
    parallelized over ``mesh`` (default: FSDP2 over all ranks) in ``dtype`` (default: the config's). Each rank
    reads only the slices it keeps, fusing per-expert hub keys on the fly with transformers' own conversion rules.
    Strict: a checkpoint that does not fill every parameter and persistent buffer exactly, or holds keys the model
    has no place for, raises a :class:`~xpar_zoo.XparError` naming the keys and files before tensor data is read.
    A collective: every rank calls it. Returns the model in eval mode, like transformers. Other keyword arguments
    go to :func:`~xpar_zoo.parallelize`; ``torch_dtype`` is accepted as transformers accepts it (deprecated, use
    ``dtype``). Without a process group it runs as a single process (world 1).

    Fine-tuning with PEFT LoRA: ``peft_config=LoraConfig(...)`` (a new adapter) or ``adapter=PATH`` (a saved PEFT
    adapter, loaded trainable) returns a ``peft.PeftModel`` whose frozen base is loaded shard-on-read as above and
    whose adapters (on dense linears, and on fused experts via ``target_parameters``, split by ``ep`` with their
    experts) are the only trainable parameters; see :mod:`xpar_zoo.styles.lora`."""
    from transformers import GenerationConfig

    dtype = _dtype_argument(dtype, torch_dtype)
    _check_parallelize_kwargs(parallelize_kwargs)
    mesh = mesh or Mesh()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        lora = None
        if peft_config is not None:
            from .hub.adapter_files import config_fingerprint

            lora = config_fingerprint(peft_config)
        check_same_on_all_ranks((str(name), revision, str(dtype)), "from_pretrained arguments (name, revision, dtype)",
                                LoadError)
        check_same_on_all_ranks({"peft_config": lora, "adapter": None if adapter is None else str(adapter)},
                                "from_pretrained arguments", LoadError)
    hub = open_hub_checkpoint(name, revision, dtype, cache_dir=cache_dir, token=token, on_each_node=True,
                              for_training=True, plan=plan)
    model, layout = hub.model, hub.layout
    outer: nn.Module = model
    initial: dict[str, torch.Tensor] | None = None
    if peft_config is not None or adapter is not None:
        from .hub.adapter_files import attach_adapter
        from .styles.lora import unwrapped_name

        outer, initial = attach_adapter(model, peft_config=peft_config, adapter=adapter, name_or_path=str(name))
    parallelize(outer, mesh, plan=hub.plan, **parallelize_kwargs)
    state = parallel_state(model)
    assert state is not None  # parallelize set it
    state.unset_buffers = tuple(sorted(set(state.unset_buffers) | set(layout.init_buffers)))
    materialize(model, device)
    names = {unwrapped_name(n): n for n in _live_tensors(model)} if initial is not None else None
    stats = fill_local_shards(model, layout, hub.directory, progress=progress, names=names)
    if initial is not None:
        from .hub.adapter_files import fill_adapter

        fill_adapter(outer, initial)
    if (hub.directory / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(hub.directory, trust_remote_code=False)
    model.config.name_or_path = str(name)
    setattr(model, "_xpar_load", stats)  # noqa: B010 (nn.Module types attributes set with `.` as tensors or modules)
    return outer.eval()
