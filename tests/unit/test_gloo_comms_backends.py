"""The in-place gloo collectives are for CPU meshes only: other backends keep torch's own."""

import torch
import torch.distributed as dist

from xpar_zoo.parallel.gloo_comms import runs_on_gloo


def test_other_backends_keep_torchs_collectives():
    """A tensor off the CPU (NCCL's, in a mixed ``"cpu:gloo,cuda:nccl"`` group) goes to torch's own collectives."""
    assert not runs_on_gloo(dist.group.WORLD, torch.empty(0, device="meta"))
