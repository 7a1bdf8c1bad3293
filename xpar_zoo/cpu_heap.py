"""Free heap handed back to the OS before each training forward on CPU (glibc's ``malloc_trim``).

On CPU every step allocates and frees the same large blocks: each FSDP unit's unsharded weights, their gradients,
the activations. After the first step glibc's mmap threshold has risen to the largest such block it freed (up to
32 MiB: the unsharded expert weights), so from then on they all come from the heap, and the holes they leave stay
resident: a training process's peak RSS grows step after step, by 50-100 MiB per rank and step on the CPU suite's
model, long after its live tensors stopped growing. ``malloc_trim(0)`` returns the free pages of every arena at
the one point of a step where the least is live (before forward: after the optimizer step and ``zero_grad``). It
changes no allocator setting and frees nothing in use. Measured in bench/RESULTS.md ("Peak RSS under glibc's
defaults", issue 23): about 70 MiB per rank less peak RSS at 2×128 tokens per rank.

Only on glibc (elsewhere there is no ``malloc_trim``: nothing happens), only while the model is in training mode
with gradients enabled (not in evaluation or generation, where forwards are many and small) and only for a model
whose parameters are on the CPU. ``parallelize(..., release_cpu_heap=False)`` turns it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["malloc_trim", "release_heap_before_training_forward"]


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim(pad)`` of this process, or None where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _on_cpu(module: nn.Module) -> bool:
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cpu"


def release_heap_before_training_forward(model: nn.Module,
                                         trim: Callable[[int], int] | None = None) -> RemovableHandle | None:
    """Call ``trim(0)`` (default: :func:`malloc_trim`) before every forward of ``model`` in training mode with
    gradients enabled and parameters on the CPU. Returns the hook's handle, or None where there is nothing to call."""
    trim = trim or malloc_trim()
    if trim is None:
        return None

    def release(module: nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled() and _on_cpu(module):
            trim(0)

    return model.register_forward_pre_hook(release, prepend=True)
