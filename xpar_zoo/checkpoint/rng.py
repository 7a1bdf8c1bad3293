"""RNG state per rank (torch CPU, CUDA when initialised, Python's ``random``) as safetensors: saved by every
rank, restored on the rank with the same id (a rank the saving job did not have keeps its own)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..io.atomic_dir import durable_write
from .layout import RNG_DIR


def rng_file(ckpt: Path, rank: int) -> Path:
    """Where ``rank``'s RNG state lives in checkpoint directory ``ckpt``."""
    return ckpt / RNG_DIR / f"rank-{rank:05d}.safetensors"


def save_rng(ckpt: Path, rank: int) -> None:
    """Write this process's RNG states as ``rank``'s file of ``ckpt``."""
    from safetensors.torch import save

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    version, internal, gauss = random.getstate()
    tensors["python"] = torch.tensor(internal, dtype=torch.int64)
    meta = {"python_version": str(version), "python_gauss_next": json.dumps(gauss)}
    (ckpt / RNG_DIR).mkdir(exist_ok=True)
    durable_write(rng_file(ckpt, rank), save(tensors, metadata=meta))


def read_rng(ckpt: Path, rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG state, read and checked (None when the saving job had no such rank); raises
    :class:`CheckpointError` naming the file when it is not a valid RNG state."""
    from safetensors import SafetensorError, safe_open

    path = rng_file(ckpt, rank)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        cpu = tensors["torch_cpu"]
        if cpu.dtype != torch.uint8 or cpu.shape != torch.get_rng_state().shape:
            raise ValueError(f"torch_cpu is {cpu.dtype} {list(cpu.shape)}, not the {list(torch.get_rng_state().shape)}"
                             " bytes of a CPU generator state")
        state: dict[str, Any] = {"torch_cpu": cpu, "cuda": [tensors[k] for k in sorted(tensors)
                                                            if k.startswith("cuda_")], "python": None}
        if "python" in tensors and "python_version" in meta:
            internal = tuple(int(x) for x in tensors["python"].tolist())
            gauss = json.loads(meta.get("python_gauss_next", "null"))
            state["python"] = (int(meta["python_version"]), internal, gauss)
            random.Random().setstate(state["python"])  # checks it without touching the global generator
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise CheckpointError(f"{path}: not a valid RNG state ({type(e).__name__}: {e})") from None
    return state


def apply_rng(state: dict[str, Any]) -> None:
    """Restore the RNG states :func:`read_rng` returned."""
    torch.set_rng_state(state["torch_cpu"])
    cuda = state["cuda"]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if state["python"] is not None:
        random.setstate(state["python"])
