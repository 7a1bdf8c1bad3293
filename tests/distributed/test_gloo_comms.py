"""FSDP2's collectives on gloo, in place (:mod:`xpar_zoo.parallel.gloo_comms`): the same bits as gloo's own
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, without the staging copy of the whole unsharded buffer that
gloo makes, and installed on every FSDP unit of a CPU model by ``parallelize``."""

import torch
import torch.distributed as dist

import xpar_zoo
from xpar_zoo.parallel.gloo_comms import (
    InPlaceAllGather,
    InPlaceReduceScatter,
    runs_on_gloo,
)
from xpar_zoo.testing import launch, parity

DTYPES = (torch.float32, torch.bfloat16, torch.uint8)  # FSDP2 gathers mixed-dtype units as uint8


def _inputs(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)
    return torch.randn(numel, generator=g).to(dtype)


def _compare_with_gloo() -> list[str]:
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    wrong = []
    for dtype in DTYPES:
        for numel in (1, 7, 1000):
            shard = _inputs(dtype, numel, seed=rank)
            want = torch.empty(numel * size, dtype=dtype)
            dist.all_gather_into_tensor(want, shard, group=group)
            for async_op in (False, True):
                # FSDP2's input is this rank's chunk of the output, already filled; a separate input is copied in
                for separate in (False, True):
                    got = torch.full((numel * size,), 7, dtype=dtype)
                    chunk = got.view(size, -1)[rank]
                    if separate:
                        inp = shard
                    else:
                        chunk.copy_(shard)
                        inp = chunk
                    work = InPlaceAllGather()(got, inp, group, async_op=async_op)
                    if async_op:
                        assert isinstance(work, dist.Work), type(work)
                        work.wait()
                    else:
                        assert work is None
                    if not torch.equal(got, want):
                        wrong.append(f"all-gather {dtype} {numel} async={async_op} separate={separate}")
            if dtype == torch.uint8:
                continue  # gradients are floating point
            full = _inputs(dtype, numel * size, seed=10 + rank)
            want = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(want, full.clone(), op=dist.ReduceOp.SUM, group=group)
            got = torch.empty(numel, dtype=dtype)
            InPlaceReduceScatter()(got, full.clone(), group, dist.ReduceOp.SUM)
            if not torch.equal(got, want):
                wrong.append(f"reduce-scatter {dtype} {numel}")
    return wrong


def test_in_place_collectives_give_the_bits_of_gloos_own():
    """Every dtype FSDP2 sends, sizes from 1 element per rank, the all-gather synchronous and asynchronous (a work to
    wait on), with the input inside the output (FSDP2's) or apart: equal to gloo's own collectives to the bit."""
    assert launch.run(_compare_with_gloo, 4) == []


def _staging_bytes() -> dict[str, int]:
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    numel = 1 << 20  # 4 MiB unsharded
    out = torch.zeros(numel)
    shard = out.view(size, -1)[rank]
    full = torch.randn(numel)
    result = torch.empty(numel // size)
    peaks = {
        "gloo all-gather": lambda: dist.all_gather_into_tensor(out, shard.clone(), group=group),
        "in-place all-gather": lambda: InPlaceAllGather()(out, shard, group),
        "gloo reduce-scatter": lambda: dist.reduce_scatter_tensor(result, full, group=group),
        "in-place reduce-scatter": lambda: InPlaceReduceScatter()(result, full, group, dist.ReduceOp.SUM),
    }
    return {name: parity.live_peak_bytes(fn, f"/tmp/xpar-staging-{rank}-{i}.json")
            for i, (name, fn) in enumerate(peaks.items())}


def test_in_place_collectives_stage_no_copy_of_the_unsharded_buffer():
    """gloo's own collectives allocate a whole unsharded-size buffer on every call; these allocate nothing (the
    profiler's allocator accounting: what the code asks for)."""
    numel_bytes = 4 << 20
    peaks = launch.run(_staging_bytes, 4)
    assert peaks["gloo all-gather"] >= numel_bytes and peaks["gloo reduce-scatter"] >= numel_bytes, peaks
    assert peaks["in-place all-gather"] < numel_bytes // 4 and peaks["in-place reduce-scatter"] < numel_bytes // 4, \
        peaks


def _units_collectives() -> list[tuple[str, str, str, bool]]:
    from torch.distributed.fsdp import FSDPModule

    model = xpar_zoo.parallelize(parity.build_model(parity.tiny_config("qwen3_moe")), xpar_zoo.Mesh(ep=2))
    rows = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            rows.append((name, type(group._all_gather_comm).__name__, type(group._reduce_scatter_comm).__name__,
                         runs_on_gloo(group.mesh_info.shard_process_group, torch.empty(0))))
    return rows


def test_parallelize_gives_every_cpu_unit_the_in_place_collectives():
    rows = launch.run(_units_collectives, 4)
    assert len(rows) > 3
    assert all(r[1:] == ("InPlaceAllGather", "InPlaceReduceScatter", True) for r in rows), rows


def _async_unshard() -> list[str]:
    cfg = parity.tiny_config("qwen3_moe")
    want = dict(parity.build_model(cfg).model.layers[0].self_attn.named_parameters())
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2))
    layer = model.model.layers[0]
    handle = layer.unshard(async_op=True)  # FSDP2 then waits on the work the all-gather returns
    handle.wait()
    wrong = [n for n, p in layer.self_attn.named_parameters() if not torch.equal(p.detach(), want[n].detach())]
    layer.reshard()
    return wrong + ([] if wrong or want else ["nothing compared"])


def test_an_asynchronous_unshard_gathers_the_full_weights():
    assert launch.run(_async_unshard, 4) == []
