"""Checkpoints in one process: pruning and the latest step, defaults and JSON-only extra state, RNG state, streaming
full tensors in bounded batches, what a checkpoint of another shape, architecture or without optimizer state is refused
with, and DCP metadata unpickled only into DCP's own classes."""

import os
import re
import shutil
import warnings

import pytest
import torch

import xpar_zoo
from xpar_zoo import checkpoint
from xpar_zoo.testing import parity

EXPERTS = "model.layers.0.mlp.experts"



def _adamw(params, **kwargs):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)



# ---- single process: layout, errors, RNG --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    cfg = parity.tiny_config("qwen3_moe")
    return cfg, parity.build_model(cfg)


def _one_step(model, seed=0):
    opt = _adamw(model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


def test_keep_last_prunes_older_and_latest_skips_incomplete(tmp_path, tiny):
    _, model = tiny
    for step in range(1, 5):
        xpar_zoo.save_checkpoint(tmp_path, model, extra_state={"step": step}, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    broken = tmp_path / "step-00000009"
    shutil.copytree(tmp_path / "step-00000004", broken)
    (broken / "COMPLETE").unlink()
    with pytest.warns(checkpoint.CheckpointWarning, match="step-00000009"):
        assert xpar_zoo.latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    with pytest.warns(checkpoint.CheckpointWarning, match="step-00000009"):
        assert xpar_zoo.load_checkpoint(tmp_path, model) == {"step": 4}
    with pytest.raises(xpar_zoo.CheckpointError, match="no COMPLETE marker"):
        xpar_zoo.load_checkpoint(broken, model)
    truncated = tmp_path / "step-00000004" / "__0_0.distcp"
    with open(truncated, "r+b") as f:
        f.truncate(100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert xpar_zoo.latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
    assert any(re.search(r"step-00000004.*__0_0\.distcp", str(w.message)) for w in caught)
    xpar_zoo.save_checkpoint(tmp_path, model, keep_last=1)  # step 4 = one past the newest complete (3)
    assert sorted(os.listdir(tmp_path)) == ["step-00000004"]


def test_step_defaults_and_json_only_extra_state(tmp_path, tiny):
    _, model = tiny
    assert xpar_zoo.save_checkpoint(tmp_path, model).name == "step-00000000"
    assert xpar_zoo.save_checkpoint(tmp_path, model).name == "step-00000001"
    assert xpar_zoo.save_checkpoint(tmp_path, model, step=10).name == "step-00000010"
    with pytest.raises(xpar_zoo.CheckpointError, match="not JSON"):
        xpar_zoo.save_checkpoint(tmp_path, model, extra_state={"sampler": object()})
    assert xpar_zoo.latest_checkpoint(tmp_path).name == "step-00000010"


def test_rng_state_is_restored(tmp_path, tiny):
    import random

    _, model = tiny
    torch.manual_seed(123)
    random.seed(5)
    xpar_zoo.save_checkpoint(tmp_path, model)
    want = (torch.rand(4), random.random())
    torch.manual_seed(999)
    random.seed(6)
    xpar_zoo.load_checkpoint(tmp_path, model)
    got = (torch.rand(4), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, tiny):
    _, model = tiny
    root = tmp_path_factory.mktemp("moe")
    return xpar_zoo.save_checkpoint(root, model, _one_step(model))


def test_iter_model_tensors_streams_full_tensors_in_bounded_batches(moe_checkpoint, tiny):
    _, model = tiny
    want = model.state_dict()
    got = dict(checkpoint.iter_model_tensors(moe_checkpoint, max_bytes=4096))
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    names = [f"{EXPERTS}.down_proj", "lm_head.weight"]
    assert [n for n, _ in checkpoint.iter_model_tensors(moe_checkpoint, names)] == names
    with pytest.raises(xpar_zoo.CheckpointError, match="no model tensor"):
        list(checkpoint.iter_model_tensors(moe_checkpoint, ["model.nope.weight"]))


def test_other_shapes_are_refused_naming_the_tensors(moe_checkpoint):
    other = parity.build_model(parity.tiny_config("qwen3_moe", num_experts=4))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(xpar_zoo.CheckpointError) as e:
        xpar_zoo.load_checkpoint(moe_checkpoint, other)
    msg = str(e.value)
    assert "shape mismatch" in msg and f"{EXPERTS}.gate_up_proj [8, 32, 32] vs [4, 32, 32]" in msg
    assert "model.layers.0.mlp.gate.weight [8, 32] vs [4, 32]" in msg
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items()), "nothing may be loaded"


def test_other_architecture_is_refused_naming_the_tensors(moe_checkpoint):
    dense = parity.build_model(parity.tiny_config("qwen3"))
    with pytest.raises(xpar_zoo.CheckpointError) as e:
        xpar_zoo.load_checkpoint(moe_checkpoint, dense, _adamw(dense.parameters()))
    msg = str(e.value)
    assert "'qwen3_moe' model, this model is 'qwen3'" in msg
    assert "missing from the checkpoint" in msg and "model.layers.0.mlp.up_proj.weight" in msg
    assert "not in the model" in msg and f"{EXPERTS}.down_proj" in msg


def test_missing_optimizer_state_is_refused(tmp_path, tiny):
    _, model = tiny
    xpar_zoo.save_checkpoint(tmp_path, model)
    with pytest.raises(xpar_zoo.CheckpointError, match="no optimizer state"):
        xpar_zoo.load_checkpoint(tmp_path, model, _adamw(model.parameters()))


def test_dcp_metadata_is_never_unpickled_beyond_dcp_classes(tmp_path, tiny):
    import pickle

    _, model = tiny
    path = xpar_zoo.save_checkpoint(tmp_path, model)

    class Evil:
        def __reduce__(self):
            return os.system, ("echo pwned",)

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(xpar_zoo.CheckpointError, match="refusing to unpickle"):
        checkpoint.SafeReader(str(path)).read_metadata()
