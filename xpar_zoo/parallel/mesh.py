"""The device mesh of a run: FSDP2 over all ranks for dense parameters, and one 2-D ``[p_fsdp, p]`` mesh per
named extra plan ``p`` (``ep``, ``emb``, ``head``, or any user name).

A plan of size ``s`` groups ``s`` ranks that split planned tensors on dim 0; the ``p_fsdp = world / (replicate·s)``
ranks that hold the same slice shard it with FSDP2 (on dim 0 where it divides, else on dim 1). ``innermost=True``
puts the ``s`` ranks of a group on consecutive global ranks (the all-to-all stays inside a node); ``False`` strides
them by ``p_fsdp``.
With ``replicate > 1`` (HSDP) every mesh gets an outermost ``replicate`` dimension.

Long context (``sp``, ``cp``; docs/long_context.md): ``sp`` (Ulysses) and ``cp`` (context parallelism) are not
plans (they split no parameter): the ``sp·cp`` ranks of one *sequence group* share one micro-batch and split its
tokens. Within a replica the ranks are laid out ``[strided sequence dims…, dp, innermost sequence dims…]`` (slowest
to fastest; among each kind ``cp`` outside ``sp``): by default both are innermost and ``sp`` is fastest, so an sp
group is consecutive ranks (its all-to-all, the heaviest, stays inside a node); ``innermost={"sp": False}`` strides
it. Plans (``ep`` …) keep their own layout over the same ranks, so EP may draw from the ranks of a sequence group.

There is no global state: build a :class:`Mesh` after ``torch.distributed.init_process_group`` and pass it (in a
plain single process, ``Mesh()`` initialises a process group of one rank itself: :func:`init_single_process`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:  # imported where used: PlanShard (the fused loss) must import on an older torch (the GPU bench)
    from torch.distributed.fsdp import DataParallelMeshDims

from ..environment import launcher_world_size
from ..errors import MeshError, counted
from .distributed import all_gather

RESERVED_NAMES = frozenset({"replicate", "fsdp", "extra", "innermost", "device_type"})
# The sequence dimensions: not plans (no parameter is split over them), see the module docstring.
SEQUENCE_DIMS = ("cp", "sp")


def _device_type() -> str:
    backend = dist.get_backend()
    return "cuda" if "nccl" in backend or backend.startswith("cuda") else "cpu"


def _refuse_launched_without_group() -> None:
    launched = launcher_world_size()
    if launched > 1:
        raise MeshError(f"WORLD_SIZE={launched} (a launcher started {launched} processes) but "
                        "torch.distributed.init_process_group was not called; call it before building a Mesh")


def init_single_process() -> None:
    """Initialise a process group of one rank (this process) when none exists, so that the library runs in a
    plain ``python`` process as world 1: gloo (and NCCL for CUDA tensors where CUDA is available) over an in-memory
    store. Refused with :class:`MeshError` when a launcher started several processes (``WORLD_SIZE > 1``) and
    ``init_process_group`` was not called: silently training each rank alone would be wrong."""
    if dist.is_initialized():
        return
    _refuse_launched_without_group()
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# DeviceMeshes are canonical per process group: torch caches DTensor specs by mesh *equality* and fully_shard
# demands mesh *identity*, so two equal meshes built by two Mesh objects would break the second parallelize.
# Reusing them also avoids creating new process groups for every Mesh. Keyed weakly by the default group: a new
# init_process_group starts afresh, and destroy_process_group is not kept from releasing the group.
_DEVICE_MESHES: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, DeviceMesh]] = weakref.WeakKeyDictionary()


def _device_mesh(device_type: str, layout: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    world = dist.group.WORLD
    if world is None:
        raise MeshError("torch.distributed.init_process_group was not called; call it before building a Mesh")
    cache = _DEVICE_MESHES.setdefault(world, {})
    key = (device_type, tuple(layout.shape), tuple(layout.flatten().tolist()), names)
    if key not in cache:
        cache[key] = DeviceMesh(device_type, layout, mesh_dim_names=names)
    return cache[key]


def check_same_on_all_ranks(value: object, what: str, error: type[Exception] = MeshError) -> None:
    """Raise ``error`` on every rank (instead of a later deadlock) when ranks were given different ``value``s."""
    values = all_gather(value)
    if any(v != values[0] for v in values):
        differ = {r: v for r, v in enumerate(values) if v != values[0]}
        if isinstance(value, dict):  # name the arguments that differ, not every argument
            keys = [k for k in value if any(v.get(k) != values[0].get(k) for v in differ.values())]
            what = f"{what}: {', '.join(keys)}"
            values[0] = {k: values[0].get(k) for k in keys}
            differ = {r: {k: v.get(k) for k in keys} for r, v in differ.items()}
        raise error(f"ranks were given different {what}: rank 0 has {values[0]!r}, "
                    + ", ".join(f"rank {r} has {v!r}" for r, v in differ.items()))


def plan_rank_layout(world: int, replicate: int, size: int, innermost: bool) -> torch.Tensor:
    """Global ranks arranged as ``[replicate, p_fsdp, p]`` for a plan of ``size`` (no process groups built)."""
    fsdp = world // (replicate * size)
    ranks = torch.arange(world)
    if innermost:
        return ranks.view(replicate, fsdp, size)
    return ranks.view(replicate, size, fsdp).transpose(1, 2).contiguous()


def sequence_rank_layout(world: int, replicate: int, sp: int, cp: int,
                         innermost: Mapping[str, bool] | None = None) -> torch.Tensor:
    """Global ranks arranged as ``[replicate, dp, cp, sp]`` (``dp = world / (replicate·sp·cp)``): the ranks of one
    sequence group are ``layout[r, d]``. Physically (slowest to fastest) ``[replicate, strided sequence dims, dp,
    innermost sequence dims]``, ``cp`` outside ``sp`` among each kind; both innermost by default."""
    innermost = dict(innermost or {})
    dp = world // (replicate * sp * cp)
    sizes = {"cp": cp, "sp": sp}
    strided = [d for d in SEQUENCE_DIMS if not innermost.get(d, True)]
    inner = [d for d in SEQUENCE_DIMS if innermost.get(d, True)]
    order = ["replicate", *strided, "dp", *inner]
    full = {"replicate": replicate, "dp": dp, **sizes}
    ranks = torch.arange(world).view(*[full[d] for d in order])
    return ranks.permute(*[order.index(d) for d in ("replicate", "dp", "cp", "sp")]).contiguous()


def validate_sequence_sizes(world: int, replicate: int, sp: int, cp: int) -> None:
    """Check that ``sp`` and ``cp`` fit a world of ``world`` ranks (with ``replicate``); raise :class:`MeshError`."""
    for name, size in (("sp", sp), ("cp", cp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshError(f"{name} must be a positive integer, got {size!r}")
    shard = world // replicate  # replicate is checked first (validate_sizes)
    if shard % (sp * cp):
        what = f"sp={sp}" if cp == 1 else f"cp={cp}" if sp == 1 else f"sp·cp={sp}·{cp}={sp * cp}"
        raise MeshError(f"{what} does not divide the ranks of a replica ({shard}: world {world} / replicate "
                        f"{replicate}); the ranks of one sequence group must all be in one replica")


def validate_sizes(world: int, sizes: Mapping[str, int], replicate: int) -> None:
    """Check that the plan sizes and ``replicate`` fit a world of ``world`` ranks; raise :class:`MeshError`."""
    if not isinstance(replicate, int) or replicate < 1:
        raise MeshError(f"replicate must be a positive integer, got {replicate!r}")
    if world % replicate:
        raise MeshError(f"replicate={replicate} does not divide the world size {world}")
    shard = world // replicate
    for name, size in sizes.items():
        if name in RESERVED_NAMES or not name.isidentifier():
            raise MeshError(f"{name!r} cannot name a plan (reserved or not an identifier)")
        if not isinstance(size, int) or size < 1:
            raise MeshError(f"plan {name!r}: size must be a positive integer, got {size!r}")
        if size > world:
            raise MeshError(f"plan {name!r} of size {size} is larger than the world ({counted(world, 'rank')})")
        if shard % size:
            raise MeshError(
                f"plan {name!r} of size {size} does not divide the dense shard size {shard} "
                f"(world {world} / replicate {replicate})"
            )


@dataclass(frozen=True)
class PlanShard:
    """This rank's place in a plan group: ``size`` ranks (``group``), each owning ``rows`` consecutive dim-0 rows
    (experts or vocab rows) of the planned tensors; this rank is ``rank`` in the group and owns rows
    ``offset … offset + rows - 1``. A group of one (``group=None``) holds every row; nothing is communicated."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    rows: int

    @property
    def offset(self) -> int:
        return self.rank * self.rows


class Mesh:
    """Named extra-parallel plan sizes over the current process group, plus FSDP2 (or HSDP) for the rest.

    ``Mesh(ep=4, emb=2)`` or ``Mesh(extra={"ep": 4}, innermost={"ep": False}, replicate=2)``. A plan of size 1 is
    the same as no plan. Raises :class:`MeshError` when the sizes do not fit the world.
    """

    def __init__(
        self,
        extra: Mapping[str, int] | None = None,
        innermost: Mapping[str, bool] | None = None,
        replicate: int = 1,
        *,
        device_type: str | None = None,
        **sizes: int,
    ) -> None:
        if not dist.is_available():
            raise MeshError("xpar_zoo.Mesh needs torch.distributed, which this torch build lacks")
        both = set(extra or {}) & set(sizes)
        if both:
            raise MeshError(f"plan size given twice (extra= and keyword): {sorted(both)}")
        all_sizes = {**dict(extra or {}), **sizes}
        sequence = {d: all_sizes.pop(d, 1) for d in SEQUENCE_DIMS}
        innermost = dict(innermost or {})
        unknown = set(innermost) - set(all_sizes) - set(SEQUENCE_DIMS)
        if unknown:
            raise MeshError(f"innermost names plans without a size: {sorted(unknown)}")
        if not dist.is_initialized():  # a plain single process: world 1, checked before a group is created
            _refuse_launched_without_group()
            try:
                validate_sizes(1, all_sizes, replicate)
                validate_sequence_sizes(1, replicate, sequence["sp"], sequence["cp"])
            except MeshError as e:
                raise MeshError(f"{e} (no process group: this process runs alone as world 1; launch several "
                                "processes, e.g. with torchrun, and call torch.distributed.init_process_group "
                                "for more ranks)") from None
            init_single_process()
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        check_same_on_all_ranks((all_sizes, sequence, innermost, replicate),
                                "mesh arguments (sizes, sequence sizes, innermost, replicate)")
        validate_sizes(self.world_size, all_sizes, replicate)
        validate_sequence_sizes(self.world_size, replicate, sequence["sp"], sequence["cp"])
        self.sp, self.cp = sequence["sp"], sequence["cp"]
        self.sequence_innermost: dict[str, bool] = {d: bool(innermost.pop(d, True)) for d in SEQUENCE_DIMS}
        self.replicate = replicate
        self.sizes: dict[str, int] = all_sizes
        self.innermost: dict[str, bool] = {n: bool(innermost.get(n, True)) for n in all_sizes}
        self.device_type = device_type or _device_type()
        self.shard_size = self.world_size // replicate
        self.dense = self._build_dense()
        self._plan_meshes: dict[str, DeviceMesh] = {
            name: self._build_plan_mesh(name) for name, size in all_sizes.items() if size > 1
        }
        self.sequence_mesh: DeviceMesh | None = self._build_sequence_mesh() if self.sp * self.cp > 1 else None

    @classmethod
    def from_lists(
        cls,
        sizes: Sequence[int],
        names: Sequence[str],
        innermost: Sequence[bool] | None = None,
        replicate: int = 1,
        **kwargs,
    ) -> Mesh:
        """Build from VeOmni-style ``extra_parallel_sizes / _names / _placement_innermost`` lists."""
        if len(sizes) != len(names) or (innermost is not None and len(innermost) != len(names)):
            raise MeshError(
                f"sizes ({len(sizes)}), names ({len(names)}) and innermost "
                f"({'-' if innermost is None else len(innermost)}) must have the same length"
            )
        if len(set(names)) != len(names):
            raise MeshError(f"plan names repeat: {list(names)}")
        inner = dict(zip(names, innermost)) if innermost is not None else None
        return cls(extra=dict(zip(names, sizes)), innermost=inner, replicate=replicate, **kwargs)

    # ---- building -------------------------------------------------------------------------------------------
    def _build_dense(self) -> DeviceMesh:
        ranks = torch.arange(self.world_size)
        if self.replicate > 1:
            return _device_mesh(self.device_type, ranks.view(self.replicate, self.shard_size), ("replicate", "fsdp"))
        return _device_mesh(self.device_type, ranks, ("fsdp",))

    def _build_plan_mesh(self, name: str) -> DeviceMesh:
        layout = plan_rank_layout(self.world_size, self.replicate, self.sizes[name], self.innermost[name])
        if self.replicate > 1:
            return _device_mesh(self.device_type, layout, ("replicate", f"{name}_fsdp", name))
        return _device_mesh(self.device_type, layout[0], (f"{name}_fsdp", name))

    def _layout(self) -> torch.Tensor:
        return sequence_rank_layout(self.world_size, self.replicate, self.sp, self.cp, self.sequence_innermost)

    def _build_sequence_mesh(self) -> DeviceMesh:
        layout = self._layout()
        return _device_mesh(self.device_type, layout.view(-1, self.cp, self.sp), ("seq_dp", "cp", "sp"))

    # ---- queries ----------------------------------------------------------------------------------------------
    @property
    def active(self) -> dict[str, int]:
        """The plans that really split tensors (size > 1), in declaration order."""
        return {n: s for n, s in self.sizes.items() if s > 1}

    def size(self, name: str) -> int:
        """The size of plan ``name`` (1 when the mesh does not use it)."""
        return self.sizes.get(name, 1)

    def plan_mesh(self, name: str) -> DeviceMesh:
        """The ``([replicate,] {name}_fsdp, {name})`` DeviceMesh of an active plan."""
        if name not in self._plan_meshes:
            raise MeshError(f"plan {name!r} is not active in {self}")
        return self._plan_meshes[name]

    def plan_group(self, name: str) -> dist.ProcessGroup:
        """The process group of the ranks that split plan ``name``'s tensors on dim 0."""
        return self.plan_mesh(name).get_group(name)

    def plan_rank(self, name: str) -> int:
        """This rank's coordinate (0 … size-1) within its ``name`` group."""
        return self.plan_mesh(name).get_local_rank(name)

    def plan_shard(self, name: str, dim0: int) -> PlanShard:
        """This rank's :class:`PlanShard` of plan ``name`` for planned tensors with ``dim0`` rows."""
        return PlanShard(self.plan_group(name), self.size(name), self.plan_rank(name), dim0 // self.size(name))

    def fsdp_dims(self, name: str) -> DataParallelMeshDims:
        """The data-parallel dims of plan ``name``'s mesh, for ``fully_shard(..., dp_mesh_dims=...)``."""
        from torch.distributed.fsdp import DataParallelMeshDims

        return DataParallelMeshDims(shard=f"{name}_fsdp", replicate="replicate" if self.replicate > 1 else None)

    @property
    def sequence_size(self) -> int:
        """``sp·cp``: the ranks that share one micro-batch (1 without long context)."""
        return self.sp * self.cp

    def sequence_group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of this rank's ``sp`` or ``cp`` group (``None`` when that size is 1)."""
        if name not in SEQUENCE_DIMS:
            raise MeshError(f"{name!r} is not a sequence dimension ({', '.join(SEQUENCE_DIMS)})")
        if getattr(self, name) == 1 or self.sequence_mesh is None:
            return None
        return self.sequence_mesh.get_group(name)

    def sequence_rank(self, name: str) -> int:
        """This rank's coordinate (0 … size-1) in its ``sp`` or ``cp`` group (0 when that size is 1)."""
        if self.sequence_group(name) is None or self.sequence_mesh is None:
            return 0
        return self.sequence_mesh.get_local_rank(name)

    def data_shard(self) -> tuple[int, int]:
        """``(index, count)``: this rank's data loader reads part ``index`` of ``count`` equal parts of the global
        batch; the ranks of one sequence group get the same index (``count = world / (sp·cp)``)."""
        layout = self._layout().view(-1, self.sp * self.cp)
        index = int((layout == self.rank).any(dim=1).nonzero()[0, 0])
        return index, layout.shape[0]

    def describe(self) -> dict:
        """A JSON-able description (saved beside checkpoints, printed by the CLI)."""
        out = {"world_size": self.world_size, "replicate": self.replicate, "extra": dict(self.sizes),
               "innermost": dict(self.innermost)}
        if self.sequence_size > 1:
            out["sequence"] = {"sp": self.sp, "cp": self.cp, "innermost": dict(self.sequence_innermost)}
        return out

    def __repr__(self) -> str:
        parts = [f"{n}={s}" + ("" if self.innermost[n] else "(strided)") for n, s in self.sizes.items()]
        parts += [f"{d}={getattr(self, d)}" + ("" if self.sequence_innermost[d] else "(strided)")
                  for d in ("sp", "cp") if getattr(self, d) > 1]
        if self.replicate > 1:
            parts.append(f"replicate={self.replicate}")
        return f"Mesh({', '.join(parts)}; world={self.world_size})"
