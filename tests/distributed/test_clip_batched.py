"""Clipping measures and scales each rank's gradient pieces in batched groups (xpar_zoo.parallel.clip): the same
numbers as the per-tensor computation it replaced (:func:`xpar_zoo.testing.parity.clip_grad_norm_per_tensor`), on a
2-rank EP model (expert pieces on the ep mesh, dense FSDP pieces), for the 2-, 1- and inf-norms and bf16 gradients."""

import pytest
import torch

from xpar_zoo.testing import launch, parity

CASES = {"fp32, norm 2": (torch.float32, 2.0), "fp32, norm 1": (torch.float32, 1.0),
         "fp32, norm inf": (torch.float32, float("inf")), "bf16, norm 2": (torch.bfloat16, 2.0)}


def _job(cases: dict) -> dict:
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.parallel.collectives import to_local

    cfg = parity.tiny_config("qwen3_moe")
    ids = parity.make_batches(cfg.vocab_size, 1, dist.get_world_size(), seed=3)[0, dist.get_rank()]
    out = {}
    for name, (dtype, norm_type) in cases.items():
        runs = []
        for clip in (xpar_zoo.clip_grad_norm_, parity.clip_grad_norm_per_tensor):
            model = xpar_zoo.parallelize(parity.build_model(cfg).to(dtype), xpar_zoo.Mesh(ep=2))
            model.lm_head.weight.requires_grad_(False)  # a parameter without gradient is left out by both
            model(input_ids=ids, labels=ids).loss.backward()
            total = clip(model, 1e-3, norm_type)
            runs.append((total, {n: to_local(p.grad).float().clone() for n, p in model.named_parameters()
                                 if p.grad is not None}))
        (batched, grads), (per_tensor, ref) = runs
        kinds = {type(p.grad).__name__ for p in model.parameters() if p.grad is not None}
        scaled = max(((grads[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item() for n in ref)
        errors = torch.tensor([abs(batched.item() - per_tensor.item()) / per_tensor.item(), scaled])
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        out[name] = {"total": (batched.item(), per_tensor.item()), "norm error": errors[0].item(),
                     "grad error": errors[1].item(), "same names": sorted(grads) == sorted(ref), "kinds": kinds}
    return out


@pytest.fixture(scope="module")
def results():
    return launch.run(_job, 2, CASES, timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_batched_clipping_gives_the_per_tensor_numbers(results, case):
    row = results[case]
    assert row["same names"] and "DTensor" in row["kinds"], row
    assert row["total"][0] > 1e-3, "the norm exceeds max_norm: the gradients are scaled"
    assert row["norm error"] <= 1e-6, row
    assert row["grad error"] <= (1e-6 if "fp32" in case else 1e-2), row
