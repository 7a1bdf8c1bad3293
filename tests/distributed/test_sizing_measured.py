"""The sizer against what launched ranks measure: collective bytes, and parameter, gradient and optimizer memory, within
5%."""

import pytest
import torch
import torch.distributed as dist

import xpar_zoo
from xpar_zoo.commands import sizing
from xpar_zoo.testing import launch, parity
from xpar_zoo.testing.comm_bytes import count_sent_bytes

WORLD, BATCH, SEQ = 4, 4, 64
VOCAB = 1024
MESHES = {"fsdp": ({}, 1), "ep2": ({"ep": 2}, 1), "ep4": ({"ep": 4}, 1), "ep2_replicate2": ({"ep": 2}, 2),
          "emb2": ({"emb": 2}, 1), "head2": ({"head": 2}, 1), "ep2_emb2_head2": ({"ep": 2, "emb": 2, "head": 2}, 1),
          "ep2_emb2_head2_dim1": ({"ep": 2, "emb": 2, "head": 2}, 1)}
# Config overrides per mesh: 8 experts and 1024 vocab rows make every planned slice divide by its 2 FSDP ranks
# (FSDP2 shards them on dim 0); 6 experts and 1026 rows make slices of 3 and 513 (dim 1).
CONFIGS = {"ep2_emb2_head2_dim1": dict(num_experts=6, vocab_size=VOCAB + 2)}


def _config(mesh: str):
    return parity.tiny_config("qwen3_moe", **{"vocab_size": VOCAB, **CONFIGS.get(mesh, {})})


def _distinct_ids(rank: int, vocab: int) -> torch.Tensor:
    """``BATCH × SEQ`` distinct ids, half from each half of the vocab (so each emb2 owner gets half)."""
    g = torch.Generator().manual_seed(rank)
    half = BATCH * SEQ // 2
    ids = torch.cat([torch.randperm(vocab // 2, generator=g)[:half],
                     vocab // 2 + torch.randperm(vocab // 2, generator=g)[:half]])
    return ids[torch.randperm(ids.numel(), generator=g)].view(BATCH, SEQ)


def _job(meshes):
    out = {}
    for name, (sizes, replicate) in meshes.items():
        cfg = _config(name)
        model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(**sizes, replicate=replicate))
        ids = _distinct_ids(dist.get_rank(), cfg.vocab_size)
        totals = {}
        with count_sent_bytes(totals):
            model(input_ids=ids, labels=ids).loss.backward()
        opt = torch.optim.AdamW(model.parameters())
        opt.step()
        local = [p.to_local() for p in model.parameters()]
        memory = {"params": sum(t.numel() * t.element_size() for t in local),
                  "grads": sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters()),
                  "optimizer": sum(v.to_local().numel() * v.element_size() for state in opt.state.values()
                                   for v in state.values() if v.dim())}
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, (totals, memory))
        out[name] = gathered
    return out


@pytest.fixture(scope="module")
def measured():
    return launch.run(_job, WORLD, MESHES)


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
