"""The small checkpoints the integrity tests damage, shared by the unit and the CLI integrity tests."""

import struct
from pathlib import Path

import pytest
import torch

import xpar_zoo
from xpar_zoo.checkpoint import write_complete_marker
from xpar_zoo.testing import parity


def _model(seed: int = 0):
    return parity.build_model(parity.tiny_config("qwen3_moe"), seed=seed)


def _train_step(model, opt) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before: dict) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _recommit(ckpt: Path) -> None:
    """Rewrite the COMPLETE marker so that sizes and checksums agree with the (damaged) files: damage that happened
    before the commit, or a crafted checkpoint."""
    (ckpt / "COMPLETE").unlink()
    write_complete_marker(ckpt, int(ckpt.name.removeprefix("step-")))


@pytest.fixture
def saved(tmp_path):
    """A checkpoint (model, AdamW state, RNG, extra_state) under ``tmp_path/root``."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    return xpar_zoo.save_checkpoint(tmp_path / "root", model, opt, {"step": 1})


# ---- 1. no code from a crafted .metadata -------------------------------------------------------------------------
def _payload(command: str) -> bytes:
    """Pickle protocol 4: STACK_GLOBAL ("torch.distributed.checkpoint.metadata", "os.system"), called with
    ``command`` — a dotted name under a module DCP's unpickler once admitted whole."""
    def text(s: str) -> bytes:  # BINUNICODE
        return b"X" + struct.pack("<I", len(s.encode())) + s.encode()

    return (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("os.system") + b"\x93"
            + text(command) + b"\x85R.")
