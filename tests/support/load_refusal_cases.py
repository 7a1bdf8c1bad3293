"""Damaged hub checkpoints and the load cases that refuse them, shared by the from_pretrained refusals (distributed)
and the convert refusals (e2e)."""

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"



# ---- checkpoints (files only, built once) ---------------------------------------------------------------------------
def _index(directory: Path) -> dict:
    return json.loads((directory / INDEX).read_text())["weight_map"]


def _edit_file(directory: Path, key: str, edit) -> str:
    """Rewrite the shard holding ``key`` with ``edit(tensors)`` applied; keep the index in step. Returns the file."""
    file = _index(directory)[key]
    tensors = load_file(directory / file)
    edit(tensors)
    save_file(tensors, directory / file, metadata={"format": "pt"})
    index = json.loads((directory / INDEX).read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != file} | {k: file for k in tensors}
    (directory / INDEX).write_text(json.dumps(index))
    return file


def _rewrite_header(path: Path, edit) -> None:
    """Rewrite the JSON header of a safetensors file with ``edit(header)``, keeping its data bytes."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


def _two_of_a_size(path: Path) -> tuple[str, str]:
    """Two tensors of one file with the same byte size (in file order)."""
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + size])
    header.pop("__metadata__", None)
    by_size: dict = {}
    for key in sorted(header, key=lambda k: header[k]["data_offsets"]):
        start, end = header[key]["data_offsets"]
        by_size.setdefault(end - start, []).append(key)
    return next(tuple(keys[:2]) for keys in by_size.values() if len(keys) > 1)


# ---- ways to break a hub checkpoint: one small function a case ----------------------------------------------------
def _config_absent(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / "config.json").unlink()


def _config_invalid_json(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / "config.json").write_text('{"model_type": "qwen3_moe",')


def _config_no_model_type(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))


def _config_unknown_model_type(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / "config.json").write_text(json.dumps(config | {"model_type": "nope_moe"}))


def _config_no_plan(out: Path, config: dict, files: list[str], facts: dict) -> None:
    """transformers knows gpt2, xpar_zoo has no plan for it"""
    (out / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4,
                                                 "vocab_size": 128}))


def _other_architecture(out: Path, config: dict, files: list[str], facts: dict) -> None:
    """dense qwen3 weights under a qwen3_moe config"""
    (out / "config.json").write_text(json.dumps(config))


def _shard_absent(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / files[1]).unlink()
    facts["file"] = files[1]


def _header_truncated(out: Path, config: dict, files: list[str], facts: dict) -> None:
    os.truncate(out / files[0], 40)
    facts["file"] = files[0]


def _data_truncated(out: Path, config: dict, files: list[str], facts: dict) -> None:
    os.truncate(out / files[0], (out / files[0]).stat().st_size - 100)
    facts["file"] = files[0]


def _header_corrupt(out: Path, config: dict, files: list[str], facts: dict) -> None:
    with open(out / files[0], "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        f.write(b"\x00{]" + b"x" * (size - 3))
    facts["file"] = files[0]


def _quantization_config(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "mxfp4"}}))


def _mxfp4_blocks(out: Path, config: dict, files: list[str], facts: dict) -> None:
    key = "model.layers.0.mlp.experts.0.down_proj.weight"
    facts["file"] = _edit_file(out, key, lambda t: t.update({
        "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(8, 32, 2, 16, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(8, 32, 2, dtype=torch.uint8)}))


def _int8_weights(out: Path, config: dict, files: list[str], facts: dict) -> None:
    key = "model.layers.1.self_attn.q_proj.weight"
    facts["file"] = _edit_file(out, key, lambda t: t.update({key: t[key].to(torch.int8)}))


def _index_not_json(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / INDEX).write_text('{"weight_map": {')


def _index_no_weight_map(out: Path, config: dict, files: list[str], facts: dict) -> None:
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}}))


def _unknown_dtype(out: Path, config: dict, files: list[str], facts: dict) -> None:
    facts["file"], facts["key"] = files[0], _two_of_a_size(out / files[0])[0]
    _rewrite_header(out / files[0], lambda h: h[facts["key"]].update(dtype="F12"))


def _offsets_overlap(out: Path, config: dict, files: list[str], facts: dict) -> None:
    """a tensor pointing at another's bytes: to-dcp once copied them silently"""
    facts["file"] = files[0]
    facts["first"], facts["key"] = _two_of_a_size(out / files[0])
    _rewrite_header(out / files[0], lambda h: h[facts["key"]].update(
        data_offsets=h[facts["first"]]["data_offsets"]))


def _offsets_wrong_size(out: Path, config: dict, files: list[str], facts: dict) -> None:
    facts["file"], facts["key"] = files[0], _two_of_a_size(out / files[0])[0]
    _rewrite_header(out / files[0], lambda h: h[facts["key"]]["data_offsets"].__setitem__(
        1, h[facts["key"]]["data_offsets"][1] - 4))


def _pickle_only(out: Path, config: dict, files: list[str], facts: dict) -> None:
    for f in files:
        (out / f).unlink()
    (out / INDEX).unlink()
    torch.save({"x": torch.zeros(2)}, out / "pytorch_model.bin")


BREAKERS = {
    "config_absent": _config_absent, "config_invalid_json": _config_invalid_json,
    "config_no_model_type": _config_no_model_type, "config_unknown_model_type": _config_unknown_model_type,
    "config_no_plan": _config_no_plan, "other_architecture": _other_architecture, "shard_absent": _shard_absent,
    "header_truncated": _header_truncated, "data_truncated": _data_truncated, "header_corrupt": _header_corrupt,
    "quantization_config": _quantization_config, "mxfp4_blocks": _mxfp4_blocks, "int8_weights": _int8_weights,
    "index_not_json": _index_not_json, "index_no_weight_map": _index_no_weight_map, "unknown_dtype": _unknown_dtype,
    "offsets_overlap": _offsets_overlap, "offsets_wrong_size": _offsets_wrong_size, "pickle_only": _pickle_only
}


def _make_bad(root: Path, hub: Path, dense: Path, kind: str) -> tuple[Path, dict]:
    """A copy of the tiny hub checkpoint broken as ``kind`` (:data:`BREAKERS`); returns it and facts the messages
    must name."""
    out = root / kind
    shutil.copytree(dense if kind == "other_architecture" else hub, out)
    facts: dict = {}
    BREAKERS[kind](out, json.loads((hub / "config.json").read_text()), sorted(set(_index(hub).values())), facts)
    return out, facts


# (case, what from_pretrained gets, mesh, dtype) -> (error class, parts of the message); {file} = the broken file
LOAD_CASES = {
    "config_absent": ("HubResolutionError", ["config_absent is a directory without config.json"]),
    "config_invalid_json": ("LoadError", ["config_invalid_json/config.json", "not a valid JSON"]),
    "config_no_model_type": ("LoadError", ["config_no_model_type/config.json", "model_type"]),
    "config_unknown_model_type": ("LoadError", ["config_unknown_model_type/config.json", "nope_moe"]),
    "config_no_plan": ("UnknownArchitectureError", ["no xpar_zoo plan for model_type 'gpt2'", "qwen3_moe"]),
    "other_architecture": ("CheckpointMismatchError", ["missing", "model.layers.0.mlp.experts.gate_up_proj [8, 32, 32]",
                                                       "unexpected", "model.layers.0.mlp.gate_proj.weight"]),
    "shard_absent": ("CheckpointMismatchError", ["lists {file}, which is not in"]),
    "header_truncated": ("CheckpointMismatchError", ["{file}: truncated safetensors file (header of"]),
    "data_truncated": ("CheckpointMismatchError", ["{file}: truncated safetensors file: its header needs",
                                                   "the file has"]),
    "header_corrupt": ("CheckpointMismatchError", ["{file}: unreadable safetensors header"]),
    "quantization_config": ("LoadError", ["quantized checkpoints", "mxfp4", "not supported"]),
    "mxfp4_blocks": ("CheckpointMismatchError", ["quantized weights", "gate_up_proj_blocks ({file}, U8)",
                                                 "gate_up_proj_scales"]),
    "int8_weights": ("CheckpointMismatchError", ["quantized weights",
                                                 "model.layers.1.self_attn.q_proj.weight ({file}, I8)"]),
    "pickle_only": ("CheckpointMismatchError", ["pytorch_model.bin", "never unpickles", "safetensors"]),
    "index_not_json": ("CheckpointMismatchError", ["index_not_json/model.safetensors.index.json: not a valid JSON "
                                                   "index"]),
    "index_no_weight_map": ("CheckpointMismatchError", ['index_no_weight_map/model.safetensors.index.json: no '
                                                        '"weight_map"']),
    "unknown_dtype": ("CheckpointMismatchError", ["{file}: tensor {key} has dtype 'F12', which safetensors does "
                                                  "not define"]),
    "offsets_overlap": ("CheckpointMismatchError", ["{file}: tensor {key}: data_offsets", "overlaps the data of "
                                                    "{first}", "a corrupt or crafted file"]),
    "offsets_wrong_size": ("CheckpointMismatchError", ["{file}: tensor {key}: data_offsets", "bytes, its shape",
                                                       "needs"]),
    # a path that is no directory: said at once, not after retries on the hub ("hub" is a directory of the cwd)
    "path_does_not_exist": ("HubResolutionError", ["hub/no_such_model does not exist (no such local directory"]),
    # arguments
    "dtype_int3": ("LoadError", ["dtype must be a floating-point dtype, got torch.int3"]),  # torch has int3
    "dtype_unknown": ("LoadError", ["unknown dtype 'float33'"]),
    "dtype_int8": ("LoadError", ["floating-point dtype, got torch.int8"]),
    "ranks_disagree_on_name": ("LoadError", ["ranks were given different from_pretrained arguments",
                                             "rank 1 has ("]),
    "ranks_disagree_on_dtype": ("LoadError", ["ranks were given different from_pretrained arguments",
                                              "'torch.bfloat16')"]),
    "plan_larger_than_world": ("MeshError", ["plan 'ep' of size 4 is larger than the world (2 ranks)"]),
    "unknown_plan_name": ("PlanError", ["mesh uses plan(s) ['foo']", "its plans: ep, emb, head"]),
    "vocab_not_divisible_by_emb": ("PlanError", ["model.embed_tokens.weight has 127", "not divisible by emb=2"]),
}
FILE_CASES = [k for k in LOAD_CASES if not k.startswith(("dtype_", "ranks_", "plan_", "unknown_plan", "vocab_",
                                                          "path_"))]
