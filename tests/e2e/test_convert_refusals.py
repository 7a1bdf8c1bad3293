"""Reliability: every bad input gets a clear :class:`~xpar_zoo.XparError` naming the problem (the file, the key, the
numbers), before any tensor data is read, the same on every rank, and leaves nothing half-written; a rank that dies
or hangs during a load ends the job with a clear error within a bounded time; nothing untrusted is unpickled.

Adversarial cases: 58 in this file, tests/distributed/test_load_refusals.py, tests/distributed/test_launch_failures.py,
tests/unit/test_checkpoint_refusals.py and tests/unit/test_no_unsafe_unpickling.py (pytest items: the load cases by
from_pretrained, outputs never overwritten nor written into their input, damaged DCP directories, local paths never
published, dying ranks, the pickle grep) and 31 in tests/unit/test_checkpoint_integrity.py,
tests/e2e/test_checkpoint_integrity_cli.py and tests/distributed/test_checkpoint_rank_agreement.py (checkpoints under
attack or misuse): 89 in all (39 before issue 18),
plus those proved elsewhere:

=================================================  =========================  ======================================
case                                               error                      test
=================================================  =========================  ======================================
experts not divisible by ep (6 experts, ep=4)      PlanError                  test_core_errors (experts_6_ep4)
plan size not dividing the world / replicate       MeshError                  test_core_errors (ep3_world4, …)
ranks given different meshes / models              MeshError / PlanError      test_core_errors (ranks_disagree_*)
unknown model_type in get_plan                     UnknownArchitectureError   test_core_errors
missing / unexpected / wrong-shape hub tensors     CheckpointMismatchError    test_loader (missing_expert, …)
hub id not in the offline cache                    HubResolutionError         test_loader (offline_unknown_repo)
DCP checkpoint of other shapes / architecture      CheckpointError            test_checkpoint (test_other_*)
DCP .metadata with a foreign pickle global         CheckpointError            test_checkpoint (…never_unpickled…)
convert to-hf into an existing output / int3       ConvertError (exit 2)      test_export (…refuses_an_existing…)
SIGKILL at every phase of a save / of one rank     last checkpoint intact     test_checkpoint (test_sigkill_*,
                                                                              test_a_rank_killed_mid_save_*)
SIGKILL during convert to-hf                       earlier output intact      test_export (test_a_killed_export_*)
SIGKILL during convert to-dcp                      earlier output intact      test_to_dcp_inspect_publish
                                                                              (test_sigkill_during_to_dcp_*)
.metadata whose STACK_GLOBAL reaches os.system     CheckpointError, no code   test_checkpoint_reliability
(load, convert inspect, convert to-hf)             ran                        (test_a_crafted_metadata_runs_no_code)
a flipped byte in a data / side file               CheckpointError (crc32),   test_checkpoint_reliability
                                                   inspect --verify exit 2    (test_a_flipped_byte_*)
optimizer with other parameter groups              CheckpointError            (test_optimizer_parameter_groups_*)
garbled extra_state / RNG / metadata JSON          CheckpointError, model     (test_a_garbled_side_file_*)
                                                   untouched
step-* link to another root, renamed step          skipped, never pruned      (test_links_and_renamed_steps_*)
NaN / inf parameters at save, at load              CheckpointError            (test_non_finite_parameters_*)
NaN / inf gradients, error_if_nonfinite=True       NonFiniteError (torch's)   (test_clip_grad_norm_*)
user dict {"__tuple__": …} in extra_state          comes back as itself       (test_user_dicts_that_look_like_tags_*)
.tmp- / .deleting- left by interrupted saves       removed by the next save   (test_the_next_save_removes_*)
full disk / file size limit (save, convert to-hf)  "No space left on device"  (test_a_full_disk_*,
                                                   / "File too large", no     test_a_write_past_the_file_size_*)
                                                   .tmp- left
save_checkpoint on rank 0 only                     CheckpointError within     (test_save_on_rank_0_only_*)
                                                   the rendezvous timeout
ranks disagree: async_save, optimizer, save/load   the same CheckpointError   (test_ranks_that_disagree_*)
one rank's bad RNG file / byte / NaN grad / shard  the same error everywhere  (test_one_ranks_problem_*)
=================================================  =========================  ======================================
"""

import json
import os

import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import xpar_zoo

from xpar_zoo.testing import parity

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

PATH_BOUND_S = 10  # hub retries took 27 s


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    model.save_pretrained(root / "hub", max_shard_size=total // 3)
    parity.build_model(parity.tiny_config("qwen3")).save_pretrained(root / "dense", max_shard_size=total // 3)
    parity.build_model(parity.tiny_config("qwen3_moe", vocab_size=127)).save_pretrained(root / "vocab127")
    dirs = {"root": str(root), "hub": str(root / "hub"), "vocab127": str(root / "vocab127"),
            "path_does_not_exist": "hub/no_such_model"}
    facts = {}
    for kind in FILE_CASES:
        path, facts[kind] = _make_bad(root, root / "hub", root / "dense", kind)
        dirs[kind] = str(path)
    return root, dirs, facts



# ---- outputs: never overwritten, never half-written ------------------------------------------------------------------
def _tiny_checkpoint(root: Path) -> Path:
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    return xpar_zoo.save_checkpoint(root, model, step=1)


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory.mktemp("dcp") / "ckpt")


def _siblings(path: Path) -> set[str]:
    return set(os.listdir(path.parent))


@pytest.mark.parametrize("command", ["to-hf", "to-dcp"])
def test_convert_refuses_an_existing_output_without_force(command, dcp_checkpoint, checkpoints, tmp_path, capsys):
    from xpar_zoo.commands import cli

    source = str(dcp_checkpoint) if command == "to-hf" else checkpoints[1]["hub"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["convert", command, source, str(out)]) == 2
    assert f"{out} already exists; pass --force" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"] and _siblings(out) == {"out"}


@pytest.mark.parametrize("command", ["to-hf", "to-dcp"])
def test_convert_refuses_an_unwritable_output_before_work(command, dcp_checkpoint, checkpoints, tmp_path, capsys):
    """A path under a regular file can be written by nobody, root included (permission bits do not stop root)."""
    from xpar_zoo.commands import cli

    source = str(dcp_checkpoint) if command == "to-hf" else checkpoints[1]["hub"]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert cli.main(["convert", command, source, str(blocker / "out")]) == 2
    assert f"cannot write {blocker / 'out'}: {blocker}" in capsys.readouterr().err
    assert _siblings(blocker) == {"a_file"}


def test_convert_refuses_a_read_only_parent(dcp_checkpoint, tmp_path, capsys):
    from xpar_zoo.commands import cli

    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("running as root: permission bits do not stop writes (the regular-file case covers it)")
        assert cli.main(["convert", "to-hf", str(dcp_checkpoint), str(parent / "out")]) == 2
        assert f"{parent} is not writable" in capsys.readouterr().err
        assert os.listdir(parent) == []
    finally:
        parent.chmod(0o755)



def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command, source, out, how", [
    ("to-hf", "root", "root", "is"),
    ("to-hf", "root/step-00000001", "root", "contains"),
    ("to-hf", "root", "root/export", "lies inside"),
    ("to-dcp", "hub", "hub", "is"),
    ("to-dcp", "hub", ".", "contains"),
    ("to-dcp", "hub", "hub/dcp", "lies inside"),
])
def test_force_never_deletes_nor_writes_into_the_input(command, source, out, how, dcp_checkpoint, checkpoints,
                                                        tmp_path, capsys):
    """`--force` replaces the output: an output that is, contains or lies inside the input is refused before
    anything is written (once `to-hf ROOT ROOT --force` exited 0 with the checkpoints gone)."""
    from xpar_zoo.commands import cli

    shutil.copytree(dcp_checkpoint.parent, tmp_path / "root")
    shutil.copytree(checkpoints[1]["hub"], tmp_path / "hub")
    before = _tree(tmp_path)
    source, out = tmp_path / source, tmp_path / out
    assert cli.main(["convert", command, str(source), str(out), "--force"]) == 2
    assert f"the output {out} {how} the input " in capsys.readouterr().err
    assert _tree(tmp_path) == before, "the input (or anything beside it) changed"


def test_to_dcp_inspect_and_publish_refuse_overlapping_offsets(checkpoints, tmp_path, capsys, monkeypatch):
    """One tensor pointing at another's bytes: to-dcp's fast reader once copied them into the wrong tensor."""
    from huggingface_hub import HfApi

    from xpar_zoo.commands import cli

    _, dirs, facts = checkpoints
    bad, want = dirs["offsets_overlap"], f"tensor {facts['offsets_overlap']['key']}: data_offsets"
    assert cli.main(["convert", "to-dcp", bad, str(tmp_path / "out")]) == 2
    assert want in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert cli.main(["convert", "inspect", bad]) == 2
    assert want in capsys.readouterr().err
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("nothing may be uploaded"))
    folder = tmp_path / "folder"
    shutil.copytree(bad, folder)
    assert cli.main(["publish", str(folder), "me/tiny"]) == 2
    assert want in capsys.readouterr().err


def test_index_without_weight_map_is_named_by_inspect(checkpoints, capsys):
    from xpar_zoo.commands import cli

    for kind in ("index_not_json", "index_no_weight_map"):
        assert cli.main(["convert", "inspect", checkpoints[1][kind]]) == 2
        assert f"{kind}/model.safetensors.index.json: " in capsys.readouterr().err


def test_nothing_published_names_the_local_file_system(checkpoints, tmp_path, monkeypatch):
    """A checkpoint saved under a user's directory, exported with --model from a local folder and published: no
    uploaded file (the card included) holds the local paths."""
    from huggingface_hub import HfApi

    from xpar_zoo.commands import cli

    private = tmp_path / "home" / "alice" / "secret-project"
    hub = private / "base-model"
    shutil.copytree(checkpoints[1]["hub"], hub)
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    model.config.name_or_path = str(hub)  # as from_pretrained(local_dir) leaves it
    ckpt = xpar_zoo.save_checkpoint(private / "checkpoints", model, step=7)
    export = tmp_path / "export"
    assert cli.main(["convert", "to-hf", str(ckpt.parent), str(export), "--model", str(hub)]) == 0
    uploaded = []
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: None)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **k: uploaded.append(k["folder_path"]) or "url")
    assert cli.main(["publish", str(export), "me/tiny"]) == 0
    assert uploaded == [str(export)]
    leaks = {f: secret for f, data in _tree(export).items() for secret in (str(private), str(tmp_path))
             if secret.encode() in data}
    assert not leaks, leaks
    assert json.loads((export / "xpar_export.json").read_text())["source_checkpoint"] == "step-00000007"


def test_publish_refuses_an_export_that_records_a_local_path(checkpoints, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi

    from xpar_zoo.commands import cli

    folder = tmp_path / "old-export"
    shutil.copytree(checkpoints[1]["hub"], folder)
    (folder / "xpar_export.json").write_text(json.dumps({"source_checkpoint": "/home/alice/ckpt/step-00000007",
                                                         "step": 7}))
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("nothing may be uploaded"))
    assert cli.main(["publish", str(folder), "me/tiny"]) == 2
    assert ("records local paths, which publish would upload: xpar_export.json source_checkpoint: "
            "/home/alice/ckpt/step-00000007") in capsys.readouterr().err


def test_a_hub_id_whose_org_is_a_local_directory_resolves_from_the_cache(checkpoints, tmp_path):
    """`org/name` with a local `org/` directory: taken for the hub id when the cache has it, else refused at once as
    a missing local path (no hub request, no retries)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = tmp_path / "cache" / "models--org--tiny"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoints[1]["hub"], entry / "snapshots" / commit)
    (tmp_path / "work" / "org").mkdir(parents=True)
    script = ("import time\nfrom xpar_zoo.hub.resolve import resolve\nstart = time.monotonic()\n"
              "print(resolve('org/tiny').origin)\ntry:\n    resolve('org/other')\n"
              "except Exception as e:\n    print(type(e).__name__, e)\nprint(time.monotonic() - start)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "work", capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"),
                                            "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    *lines, seconds = proc.stdout.splitlines()
    assert lines == ["org/tiny", "HubResolutionError org/other does not exist (no such local "
                     "directory; org/ is a local directory, so the name is not looked up on the "
                     "hub; for the hub repo of that name, run from another directory)"]
    assert float(seconds) < PATH_BOUND_S  # the two lookups, the interpreter's start and imports excluded


def test_cli_number_options_name_themselves(checkpoints, tmp_path, capsys):
    from xpar_zoo.commands import cli

    assert cli.main(["convert", "to-dcp", checkpoints[1]["hub"], str(tmp_path / "o"), "--batch-size", "lots"]) == 2
    assert "cannot parse --batch-size 'lots'" in capsys.readouterr().err
    for option, value, said in (("--world", "0", "must be at least 1, got 0"), ("--world", "two", "'two' is not a "
                                "whole number"), ("--micro-batch", "-1", "must be at least 1, got -1")):
        args = ["plan", "qwen3_moe", "--world", "4", option, value] if option != "--world" else [
            "plan", "qwen3_moe", "--world", value]
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2
        assert f"argument {option}: {said}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
