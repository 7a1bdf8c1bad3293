"""The models and meshes the sizer is measured against, shared by the unit and the launched sizing tests."""

import pytest
import torch
import torch.distributed as dist

import xpar_zoo
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
