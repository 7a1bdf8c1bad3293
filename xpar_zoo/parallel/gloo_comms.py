"""FSDP2's all-gather and reduce-scatter on gloo without gloo's flat copies (CPU training).

gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` each stage the whole unsharded buffer in a temporary
of their own: the all-gather receives into a new flat tensor and copies it into the output, the reduce-scatter
copies its input, all-reduces the copy and copies one chunk out. For FSDP2 that is one extra unsharded-size buffer
per unit and collective (a MoE layer's expert weights), allocated and written every time.

FSDP2 lets a unit choose its collectives (``set_custom_all_gather`` / ``set_custom_reduce_scatter``); these two do
the same communication in place:

- :class:`InPlaceAllGather`: one broadcast per rank, each rank's chunk from its owner straight into the output
  (FSDP2 already copied this rank's shard into its chunk of the output);
- :class:`InPlaceReduceScatter`: an in-place all-reduce of FSDP2's reduce-scatter input (its own buffer, dropped
  after the call), then this rank's chunk copied out — what gloo does, without the copy of the input.

The reduce-scatter runs the same all-reduce as gloo's, so its sums are equal to the bit and it moves the same bytes;
the all-gather delivers each chunk once to every other rank, as gloo's does (its broadcasts are issued together and
joined into one work). What they save, in memory and time: ``bench/RESULTS.md``, "gloo collectives in place".
:func:`use_in_place_collectives` gives them to an FSDP unit (``parallelize`` does, on every unit of a CPU model: there
unless told not to); on a group that is not gloo, or tensors off the CPU (NCCL), they call torch's own collectives.

CPU-only: this module is imported only where ``parallelize`` shards a model on a CPU mesh, never by ``import
xpar_zoo``. The switch: ``parallelize(..., cpu_collectives="gloo")`` (or the environment variable
``XPAR_ZOO_GLOO_IN_PLACE=0``) keeps FSDP2's own collectives on every unit; ``"in_place"`` is the default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..compat import create_work_from_future, fsdp_collective_bases

AllGather, ReduceScatter, DefaultAllocMixin = fsdp_collective_bases()
_create_work_from_future = create_work_from_future()


def _joined(works: list[dist.Work], async_op: bool) -> dist.Work | None:
    """One work for several: waited here unless ``async_op`` (then a work over all their futures)."""
    if async_op and _create_work_from_future is not None:
        return _create_work_from_future(torch.futures.collect_all([w.get_future() for w in works]))
    for work in works:
        work.wait()
    return None


class InPlaceAllGather(DefaultAllocMixin, AllGather):
    """All-gather as one broadcast per rank into the output's chunks: no staging buffer."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        if not runs_on_gloo(group, output_tensor):
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        size, rank = group.size(), group.rank()
        chunks = output_tensor.view(size, -1)
        if input_tensor.data_ptr() != chunks[rank].data_ptr():
            chunks[rank].copy_(input_tensor)
        works = [dist.broadcast(chunks[src], group=group, group_src=src, async_op=True) for src in range(size)]
        return _joined(works, async_op)


class InPlaceReduceScatter(DefaultAllocMixin, ReduceScatter):
    """Reduce-scatter as an in-place all-reduce of the input and a copy of this rank's chunk. The input is left
    holding the full sums: FSDP2 hands in a buffer of its own and drops it after the call."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        if not runs_on_gloo(group, input_tensor):
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


def runs_on_gloo(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether ``group``'s collectives on ``tensor`` run on gloo (a CPU tensor, and gloo as the group's backend or
    its CPU backend, as in ``"cpu:gloo,cuda:nccl"``)."""
    if tensor.device.type != "cpu":
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend.split(",")


def use_in_place_collectives(module: FSDPModule) -> None:
    """Give the FSDP unit ``module`` the in-place collectives (they fall back to torch's own where its process group
    is not gloo)."""
    module.set_custom_all_gather(InPlaceAllGather())
    module.set_custom_reduce_scatter(InPlaceReduceScatter())
