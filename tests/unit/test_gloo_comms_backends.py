"""The in-place gloo collectives are for CPU meshes only: other backends keep torch's own."""

import pytest
import torch
import torch.distributed as dist

from xpar_zoo.parallel.gloo_comms import (
    InPlaceAllGather,
    InPlaceReduceScatter,
    runs_on_gloo,
)


def test_other_backends_keep_torchs_collectives(monkeypatch):
    """On a group whose collectives do not run on gloo — an NCCL group, or a tensor off the CPU in a mixed
    ``"cpu:gloo,cuda:nccl"`` group — the in-place collectives hand the call to torch's own all-gather and
    reduce-scatter, untouched; the mixed group's CPU tensors do run on gloo."""
    group = object()  # stands for the process group: get_backend below answers for it
    calls = []
    monkeypatch.setattr(dist, "all_gather_single", lambda out, inp, **k: calls.append(("all_gather_single", k)))
    monkeypatch.setattr(dist, "reduce_scatter_single", lambda out, inp, **k: calls.append(("reduce_scatter_single", k)))
    for gloo_path in ("broadcast", "all_reduce"):
        monkeypatch.setattr(dist, gloo_path, lambda *a, _n=gloo_path, **k: pytest.fail(f"took the gloo path ({_n})"))
    for backend, device in (("nccl", "cpu"), ("cpu:gloo,cuda:nccl", "meta")):
        monkeypatch.setattr(dist, "get_backend", lambda g, _b=backend: _b)
        out, inp = torch.zeros(4, device=device), torch.zeros(2, device=device)
        assert not runs_on_gloo(group, inp), backend
        InPlaceAllGather()(out, inp, group, async_op=True)
        InPlaceReduceScatter()(inp, out, group, dist.ReduceOp.SUM)
    assert calls == [("all_gather_single", {"group": group, "async_op": True}),
                     ("reduce_scatter_single", {"op": dist.ReduceOp.SUM, "group": group, "async_op": False})] * 2
    monkeypatch.setattr(dist, "get_backend", lambda g: "cpu:gloo,cuda:nccl")
    assert runs_on_gloo(group, torch.zeros(2))
