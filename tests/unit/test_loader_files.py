"""The loader's files, in one process: the hub layout of per-expert and fused checkpoints, transformers' fusing rules
(mixtral w1/w3 into gate_up), layout errors listed all at once, buffers no file holds, and what a hub download asks
for."""

import json

import pytest
import torch
from safetensors import safe_open

import xpar_zoo
from support.loader_checkpoints import EXPERT, REPO, _file_of
from xpar_zoo.errors import CheckpointMismatchError
from xpar_zoo.hub.layout import map_hub_layout
from xpar_zoo.hub.safetensors_files import read_checkpoint_headers
from xpar_zoo.testing import parity
from xpar_zoo.zoo.registry import build_meta


# ---- the checkpoints are what they claim ------------------------------------------------------------------------------
def test_save_pretrained_writes_per_expert_keys_in_at_least_5_files(checkpoints):
    hub = checkpoints["hub"]
    index = json.loads((hub / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 5
    keys = set(index["weight_map"])
    assert f"{EXPERT}.7.gate_proj.weight" in keys and f"{EXPERT}.0.down_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") or k.endswith("experts.down_proj") for k in keys)
    with safe_open(hub / _file_of(hub, f"{EXPERT}.3.up_proj.weight"), "pt") as f:
        assert f.get_slice(f"{EXPERT}.3.up_proj.weight").get_shape() == [16, 32]  # [I, H]


def test_fused_checkpoint_has_in_memory_names(checkpoints):
    with safe_open(checkpoints["fused"] / "model.safetensors", "pt") as f:
        assert f.get_slice(f"{EXPERT}.gate_up_proj").get_shape() == [8, 32, 32]  # [E, 2I, H]



# ---- the layout is derived from transformers' own rules (single process, no tensor data) -----------------------------
def test_mixtral_w1_w3_fuse_into_gate_up_by_transformers_rules(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                               num_experts_per_tok=2, tie_word_embeddings=False)
    model = parity.build_model(cfg)
    model.save_pretrained(tmp_path)
    layout = map_hub_layout(build_meta(cfg, torch.float32), read_checkpoint_headers(tmp_path))
    target = layout.targets["model.layers.0.mlp.experts.gate_up_proj"]
    assert [p.source.key for p in target.pieces[:1]] == ["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    assert target.pieces[4].source.key == "model.layers.0.block_sparse_moe.experts.0.w3.weight"
    # assembling every read over the whole tensor reproduces the in-memory fused tensor
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        for name, tensor in model.state_dict().items():
            rebuilt = torch.empty_like(tensor)
            for read in layout.reads(name, tuple((0, n) for n in tensor.shape)):
                data = f.get_slice(read.source.key)[read.slices] if read.slices else f.get_tensor(read.source.key)
                rebuilt[read.dest] = data.unsqueeze(read.stack_dim) if read.stack_dim is not None else data
            assert torch.equal(rebuilt, tensor), name


def test_layout_errors_list_every_problem_at_once(checkpoints):
    tensors = read_checkpoint_headers(checkpoints["missing_expert"])
    tensors.update(read_checkpoint_headers(checkpoints["unexpected_key"]))
    tensors.pop("model.norm.weight")
    with pytest.raises(CheckpointMismatchError) as err:
        map_hub_layout(build_meta(parity.tiny_config("qwen3_moe"), torch.float32), tensors)
    message = str(err.value)
    assert "model.norm.weight [32]" in message and "extra_proj" in message
    assert isinstance(err.value, xpar_zoo.XparError)


def test_unread_buffers_come_from_the_models_own_init_or_fail_loudly():
    from xpar_zoo.errors import LoadError
    from xpar_zoo.parallel.materialize import initialise_buffers

    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    expected = model.model.rotary_emb.inv_freq.clone()
    model.model.rotary_emb.inv_freq.fill_(0)
    initialise_buffers(model, {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"})
    assert torch.equal(model.model.rotary_emb.inv_freq, expected)
    model.model.norm.register_buffer("scale_cache", torch.ones(4), persistent=False)
    with pytest.raises(LoadError, match=r"model\.norm\.scale_cache"):
        initialise_buffers(model, {"model.norm.scale_cache"})


def test_hub_download_asks_only_for_config_index_listed_shards_and_side_files(checkpoints, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import RemoteEntryNotFoundError

    from xpar_zoo.hub import resolve as hub

    calls = []

    def fake_file(repo_id, filename, **kwargs):
        calls.append(("file", filename, kwargs.get("revision")))
        path = checkpoints["hub"] / filename
        if not path.is_file():
            raise RemoteEntryNotFoundError(f"{filename} not in {repo_id}", response=None)
        return str(path)

    def fake_snapshot(repo_id, **kwargs):
        calls.append(("snapshot", tuple(kwargs["allow_patterns"]), kwargs.get("revision")))
        return str(checkpoints["hub"])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_file)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    resolved = hub.resolve(REPO, revision="v1")
    assert resolved.directory == checkpoints["hub"] and resolved.origin == REPO
    shards = sorted(set(json.loads((checkpoints["hub"] / hub.INDEX_FILE).read_text())["weight_map"].values()))
    (_, patterns, revision), = [c for c in calls if c[0] == "snapshot"]
    assert revision == "v1"
    assert list(patterns) == ["config.json", hub.INDEX_FILE, *shards, *hub.SIDE_FILES]
    assert not any(p.endswith((".bin", ".pt", ".pth")) or "consolidated" in p for p in patterns)
