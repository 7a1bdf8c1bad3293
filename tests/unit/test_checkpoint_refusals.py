"""Checkpoint outputs and inputs refused in one process: a checkpoint under a regular file, a bad export dtype or shard
size before any work, an incomplete DCP directory by load and export."""

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import xpar_zoo
from xpar_zoo.checkpoint import write_complete_marker
from xpar_zoo.testing import parity


# ---- outputs: never overwritten, never half-written ------------------------------------------------------------------
def _tiny_checkpoint(root: Path) -> Path:
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    return xpar_zoo.save_checkpoint(root, model, step=1)


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory.mktemp("dcp") / "ckpt")



def test_save_checkpoint_under_a_regular_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    with pytest.raises(xpar_zoo.CheckpointError, match=re.escape(str(blocker))):
        xpar_zoo.save_checkpoint(blocker / "ckpt", model)
    assert os.listdir(tmp_path) == ["a_file"]


def test_export_dtype_int3_and_bad_shard_size_are_refused_before_work(dcp_checkpoint, tmp_path):
    from xpar_zoo.converters.export import export_to_hf

    from xpar_zoo import ConvertError

    with pytest.raises(ConvertError, match="unknown dtype 'int3'; use one of bf16, "):
        export_to_hf(dcp_checkpoint, tmp_path / "out", dtype="int3")
    with pytest.raises(ConvertError, match="cannot parse shard size '5 parsecs'"):
        export_to_hf(dcp_checkpoint, tmp_path / "out", max_shard_size="5 parsecs")
    assert os.listdir(tmp_path) == []



# ---- incomplete or damaged DCP checkpoints ---------------------------------------------------------------------------
def _damage(ckpt: Path, kind: str) -> str:
    """Damage the checkpoint directory ``ckpt`` as ``kind``; returns what the error must name."""
    data = sorted(ckpt.glob("*.distcp"))[0]
    if kind == "no_complete_marker":
        (ckpt / "COMPLETE").unlink()
        return "no COMPLETE marker"
    if kind == "data_file_missing":
        data.unlink()
        return f"file {data.name} listed in COMPLETE is missing"
    if kind == "data_file_truncated":
        os.truncate(data, data.stat().st_size // 2)
        return f"file {data.name} has {data.stat().st_size} bytes, COMPLETE says"
    if kind == "metadata_corrupt":
        size = (ckpt / ".metadata").stat().st_size
        (ckpt / ".metadata").write_bytes(b"\xff" * size)  # same size: the checksum notices
        return ".metadata: crc32"
    if kind == "metadata_corrupt_recorded":  # garbled before COMPLETE was written: only the unpickling can notice
        size = (ckpt / ".metadata").stat().st_size
        (ckpt / ".metadata").write_bytes(b"\xff" * size)
        (ckpt / "COMPLETE").unlink()
        write_complete_marker(ckpt, int(ckpt.name.removeprefix("step-")))
        return "unreadable DCP metadata"
    if kind == "plain_dcp":
        for f in ("COMPLETE", "xpar_checkpoint.json", "extra_state.json"):
            (ckpt / f).unlink()
        return "is a DCP directory but not an xpar_zoo checkpoint (no xpar_checkpoint.json)"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["no_complete_marker", "data_file_missing", "data_file_truncated",
                                  "metadata_corrupt", "metadata_corrupt_recorded", "plain_dcp"])
def test_incomplete_dcp_directory_is_refused_by_load_and_export(kind, dcp_checkpoint, tmp_path):
    from xpar_zoo.converters.export import export_to_hf

    ckpt = tmp_path / "ckpt" / dcp_checkpoint.name
    shutil.copytree(dcp_checkpoint, ckpt)
    want = _damage(ckpt, kind)
    model = parity.build_model(parity.tiny_config("qwen3_moe"), seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(xpar_zoo.CheckpointError, match=re.escape(want)):
        xpar_zoo.load_checkpoint(ckpt, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "nothing may be loaded"
    with pytest.raises(xpar_zoo.CheckpointError, match=re.escape(want)):
        export_to_hf(ckpt, tmp_path / "out", progress=False)
    assert not any(n.startswith((".out", "out")) for n in os.listdir(tmp_path))
