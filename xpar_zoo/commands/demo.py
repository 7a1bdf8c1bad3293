"""``xpar-zoo demo``: a tiny qwen3_moe (fixed seed) trained a few AdamW steps on N CPU ranks under an EP mesh,
each step's loss printed beside single-process transformers', ending with a verdict line."""

from __future__ import annotations

import time

from ..environment import launched_world
from ..testing import launch, parity


def _demo_job(world: int, mesh_kwargs: dict, steps: int) -> dict:
    import torch.distributed as dist

    cfg = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(cfg.vocab_size, steps, world, seed=3)
    start = time.perf_counter()
    par = parity.train_parallel(cfg, data, mesh_kwargs, "adamw", 1.0)
    seconds = time.perf_counter() - start
    ref = parity.train_reference(cfg, data, "adamw", 1.0) if dist.get_rank() == 0 else None
    return {"par": par.losses, "ref": ref.losses if ref else None, "seconds": seconds,
            "local": par.local_shapes.get("model.layers.0.mlp.experts.gate_up_proj")}


def check_sizes(world: int, ep: int) -> None:
    """The demo's mesh, checked before any process starts or connects (a rank's error would be a traceback)."""
    from ..errors import MeshError, PlanError
    from ..parallel.mesh import validate_sizes

    if world < 1:
        raise MeshError(f"--world must be at least 1, got {world}")
    if ep < 1:
        raise MeshError(f"--ep must be at least 1, got {ep}")
    validate_sizes(world, {"ep": ep}, 1)
    experts = parity.tiny_config("qwen3_moe").num_experts
    if experts % ep:
        raise PlanError(f"--ep {ep} does not divide the demo model's {experts} experts")


def run_demo(world: int = 4, ep: int = 2, steps: int = 5) -> bool:
    """Run the demo; print the comparison and return whether every loss matched within ``parity.LOSS_TOL``. Started
    by torchrun (``torchrun --nproc-per-node 4 -m xpar_zoo demo``), every process runs its rank of the job and
    ``world`` is torchrun's; otherwise the demo starts ``world`` local processes itself."""
    mesh_kwargs = {"ep": ep} if ep > 1 else {}
    cfg = parity.tiny_config("qwen3_moe")
    launched = launched_world()
    check_sizes(launched or world, ep)
    if launched is not None:
        import torch.distributed as dist

        world = launched
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        result = _demo_job(world, mesh_kwargs, steps)
        dist.barrier()  # no rank tears its connections down while another still communicates
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return True
    header = (f"xpar_zoo demo: tiny qwen3_moe ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts, "
              f"top-{cfg.num_experts_per_tok}, fp32) on {world} CPU ranks (gloo), Mesh(ep={ep}), AdamW + clipping; "
              "labels masked unequally per rank (one rank has no target in step 1), loss = the global-batch mean")
    print(header, flush=True)
    if launched is None:
        result = launch.run(_demo_job, world, world, mesh_kwargs, steps)
    if result["local"]:
        print(f"rank 0 holds gate_up_proj shard {list(result['local'])} of global "
              f"[{cfg.num_experts}, {2 * cfg.moe_intermediate_size}, {cfg.hidden_size}]")
    print(f"{'step':>4}  {'xpar_zoo loss':>14}  {'transformers loss':>17}  {'|diff|':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(result["par"], result["ref"]), 1):
        worst = max(worst, abs(a - b))
        print(f"{step:>4}  {a:>14.7f}  {b:>17.7f}  {abs(a - b):>9.2e}")
    ok = worst < parity.LOSS_TOL
    verdict = "PASS" if ok else "FAIL"
    print(f"{verdict}: {steps} steps on {world} ranks, largest loss difference {worst:.2e} "
          f"({'within' if ok else 'above'} {parity.LOSS_TOL:g}); parallel run took {result['seconds']:.1f}s")
    return ok
