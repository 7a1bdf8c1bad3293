"""The zoo's hub round trip: for every proved architecture (curated, and the MoE types proved through the automatic
plan), a tiny model saved in the hub's own format → `xpar-zoo convert to-dcp` → `xpar-zoo convert to-hf` gives back
the same keys and bit-identical tensors, and the DCP holds the model's in-memory (fused) tensors."""

import json

import pytest
import torch
from safetensors import safe_open

from xpar_zoo.checkpoint import iter_model_tensors
from xpar_zoo.commands import cli
from xpar_zoo.testing import parity
from xpar_zoo.testing.proofs import proved_architectures

ARCHS = proved_architectures()


def _hub_tensors(directory) -> dict:
    files = sorted(directory.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_hub_to_dcp_to_hub_is_bit_exact(arch, tmp_path):
    model = parity.build_model(parity.tiny_config(arch))
    with torch.no_grad():  # biases and correction buffers are zero at init: make every tensor distinctive
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and not t.any():
                t.normal_(0, 0.02)
    hub = tmp_path / "hub"
    model.save_pretrained(hub, max_shard_size="60KB")
    assert cli.main(["convert", "to-dcp", str(hub), str(tmp_path / "dcp")]) == 0
    in_memory = {k: v for k, v in model.state_dict().items()}
    stored = dict(iter_model_tensors(tmp_path / "dcp"))
    for name, tensor in stored.items():
        assert torch.equal(tensor, in_memory[name]), f"{arch}: DCP tensor {name} differs from the model's"
    assert cli.main(["convert", "to-hf", str(tmp_path / "dcp"), str(tmp_path / "out"), "--max-shard-size", "50KB"]) == 0
    original, written = _hub_tensors(hub), _hub_tensors(tmp_path / "out")
    assert sorted(written) == sorted(original), f"{arch}: hub keys differ"
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), f"{arch}: {key} differs"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
