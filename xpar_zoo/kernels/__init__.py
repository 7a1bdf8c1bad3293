"""Triton kernels (GPU; on CPU only under ``TRITON_INTERPRET=1``): the fused experts and the vocab-parallel
cross-entropy."""

import torch

from ..environment import triton_interpreter


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels run on ``tensor``'s device: CUDA, or the CPU under Triton's interpreter
    (``TRITON_INTERPRET=1``, how the tests check the kernels' arithmetic). The one place outside the kernels
    themselves that knows about the interpreter; importing this does not import Triton."""
    return tensor.is_cuda or triton_interpreter()
