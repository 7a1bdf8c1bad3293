"""The sizer against what launched ranks measure: collective bytes, and parameter, gradient and optimizer memory, within
5%."""

import pytest

from support.sizing_models import BATCH, MESHES, SEQ, WORLD, _config
from xpar_zoo import sizing


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sizer_predicts_collective_bytes_within_5_percent(measured, mesh):
    sizes, replicate = MESHES[mesh]
    est = sizing.estimate(_config(mesh), WORLD, sizes, replicate, micro_batch=BATCH, seq=SEQ, param_dtype="fp32",
                           reduce_dtype="fp32")
    c = est.comm
    predicted = {"all_gather": c["all_gather (FSDP params)"] + c["all_gather (head loss statistics)"],
                 "reduce_scatter": c["reduce_scatter (FSDP grads)"],
                 "all_reduce": c["all_reduce (HSDP grads)"] + c["all_reduce (loss target count)"],
                 "all_to_all": c["all_to_all (EP tokens)"] + c["all_to_all (emb ids + vectors)"]
                 + c["all_to_all (head hidden states)"]}
    ranks = [comm for comm, _ in measured[mesh]]
    for kind, want in predicted.items():
        got = sum(r.get(kind, 0.0) for r in ranks) / WORLD  # the sizer predicts the per-rank average
        if want == 0:
            assert got == 0, f"{kind}: measured {got} bytes, predicted none"
        else:
            assert abs(got - want) <= 0.05 * want, f"{kind}: measured {got:.0f} B/rank, predicted {want:.0f}"
    total = sum(sum(r.values()) for r in ranks) / WORLD
    assert abs(total - est.comm_total) <= 0.05 * est.comm_total


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sizer_predicts_parameter_gradient_and_optimizer_memory_within_5_percent(measured, mesh):
    """The exact memory terms against the bytes each rank really holds after one AdamW step (averaged over ranks;
    the sizer counts FSDP's padding, the local shards do not)."""
    sizes, replicate = MESHES[mesh]
    est = sizing.estimate(_config(mesh), WORLD, sizes, replicate, optimizer="adamw")
    predicted = {"params": est.memory["parameters (fp32 shards)"], "grads": est.memory["gradients (fp32 shards)"],
                 "optimizer": est.memory["optimizer states (adamw)"]}
    for kind, want in predicted.items():
        got = sum(memory[kind] for _, memory in measured[mesh]) / WORLD
        assert abs(got - want) <= 0.05 * want, f"{kind}: measured {got:.0f} B/rank, predicted {want:.0f}"
