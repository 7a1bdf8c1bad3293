"""The tiny hub checkpoints the loader tests read, shared by the in-process and the launched loader tests."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from xpar_zoo.testing import parity

REPO = "org/tiny-qwen3-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
EXPERT = "model.layers.0.mlp.experts"

ARCHS = {"mixtral": ("mixtral", {"vocab_size": 122}), "deepseek_v3": ("deepseek_v3", {}),
         "tied": ("qwen3_moe", {"tie_word_embeddings": True})}
BAD = ["missing_expert", "unexpected_key", "wrong_shape", "wrong_expert_shape", "offline_unknown_repo"]


# ---- checkpoints ----------------------------------------------------------------------------------------------------
def _rewrite(directory: Path, edit) -> None:
    """Apply ``edit(key -> tensor dict of one file, file name)`` to each shard and rewrite the index to match."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(directory / name)
        edit(tensors, name)
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))


def _bad_checkpoint(root: Path, hub: Path, kind: str) -> Path:
    out = root / kind
    shutil.copytree(hub, out)

    def edit(tensors, name):
        if kind == "missing_expert":
            tensors.pop("model.layers.1.mlp.experts.3.up_proj.weight", None)
        elif kind == "unexpected_key" and "model.norm.weight" in tensors:
            tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)
        elif kind == "wrong_shape" and "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = torch.ones(31)
        elif kind == "wrong_expert_shape" and f"{EXPERT}.2.down_proj.weight" in tensors:
            tensors[f"{EXPERT}.2.down_proj.weight"] = torch.zeros(32, 15)

    _rewrite(out, edit)
    return out


def _file_of(directory: Path, key: str) -> str:
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][key]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny qwen3_moe as transformers saves it (hub layout, ≥ 5 files), fused, in an HF cache, and broken."""
    root = tmp_path_factory.mktemp("loader")
    cfg = parity.tiny_config("qwen3_moe")
    model = parity.build_model(cfg).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    hub = root / "hub"
    model.save_pretrained(hub, max_shard_size=total // 6)
    fused = root / "fused"
    fused.mkdir()
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    cfg.save_pretrained(fused)
    cache = root / "hf_cache"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(hub, repo / "snapshots" / COMMIT)
    paths = {"root": root, "hub": hub, "fused": fused, "cache": cache, "state": state, "total": total}
    for arch, (model_type, overrides) in ARCHS.items():
        other = parity.build_model(parity.tiny_config(model_type, **overrides))
        with torch.no_grad():  # non-trivial persistent buffers (DeepSeek's router correction bias)
            for name, buf in other.named_buffers():
                if "correction_bias" in name:
                    buf.uniform_(-0.5, 0.5)
        other.save_pretrained(root / arch, max_shard_size=total // 6)
        paths[arch] = root / arch
    paths.update({kind: _bad_checkpoint(root, hub, kind) for kind in BAD if kind != "offline_unknown_repo"})
    return paths
