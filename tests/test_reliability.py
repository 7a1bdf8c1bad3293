"""Reliability: every bad input gets a clear :class:`~xpar_zoo.XparError` naming the problem (the file, the key, the
numbers), before any tensor data is read, the same on every rank, and leaves nothing half-written; a rank that dies
or hangs during a load ends the job with a clear error within a bounded time; nothing untrusted is unpickled.

Cases proved elsewhere (not repeated here):

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
convert to-hf into an existing output / int3       ExportError (exit 2)       test_export (…refuses_an_existing…)
SIGKILL at every phase of a save / of one rank     last checkpoint intact     test_checkpoint (test_sigkill_*,
                                                                              test_a_rank_killed_mid_save_*)
SIGKILL during convert to-hf                       earlier output intact      test_export (test_a_killed_export_*)
SIGKILL during convert to-dcp                      earlier output intact      test_to_dcp_inspect_publish
                                                                              (test_sigkill_during_to_dcp_*)
=================================================  =========================  ======================================
"""

import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import xpar_zoo
from xpar_zoo.testing import launch, parity
from xpar_zoo.errors import XparError

WORLD = 2
INDEX = "model.safetensors.index.json"
REPO_ROOT = Path(__file__).resolve().parents[1]


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


def _make_bad(root: Path, hub: Path, dense: Path, kind: str) -> tuple[Path, dict]:
    """A copy of the tiny hub checkpoint broken as ``kind``; returns it and facts the messages must name."""
    out = root / kind
    shutil.copytree(dense if kind == "other_architecture" else hub, out)
    config = json.loads((hub / "config.json").read_text())
    files = sorted(set(_index(hub).values()))
    facts: dict = {}
    if kind == "config_absent":
        (out / "config.json").unlink()
    elif kind == "config_invalid_json":
        (out / "config.json").write_text('{"model_type": "qwen3_moe",')
    elif kind == "config_no_model_type":
        (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "model_type"}))
    elif kind == "config_unknown_model_type":
        (out / "config.json").write_text(json.dumps(config | {"model_type": "nope_moe"}))
    elif kind == "config_no_plan":  # transformers knows gpt2, xpar_zoo has no plan for it
        (out / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4,
                                                     "vocab_size": 128}))
    elif kind == "other_architecture":  # dense qwen3 weights under a qwen3_moe config
        (out / "config.json").write_text(json.dumps(config))
    elif kind == "shard_absent":
        (out / files[1]).unlink()
        facts["file"] = files[1]
    elif kind == "header_truncated":
        os.truncate(out / files[0], 40)
        facts["file"] = files[0]
    elif kind == "data_truncated":
        os.truncate(out / files[0], (out / files[0]).stat().st_size - 100)
        facts["file"] = files[0]
    elif kind == "header_corrupt":
        with open(out / files[0], "r+b") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            f.write(b"\x00{]" + b"x" * (size - 3))
        facts["file"] = files[0]
    elif kind == "quantization_config":
        (out / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "mxfp4"}}))
    elif kind == "mxfp4_blocks":
        key = "model.layers.0.mlp.experts.0.down_proj.weight"
        facts["file"] = _edit_file(out, key, lambda t: t.update({
            "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(8, 32, 2, 16, dtype=torch.uint8),
            "model.layers.0.mlp.experts.gate_up_proj_scales": torch.zeros(8, 32, 2, dtype=torch.uint8)}))
    elif kind == "int8_weights":
        key = "model.layers.1.self_attn.q_proj.weight"
        facts["file"] = _edit_file(out, key, lambda t: t.update({key: t[key].to(torch.int8)}))
    elif kind == "pickle_only":
        for f in files:
            (out / f).unlink()
        (out / INDEX).unlink()
        torch.save({"x": torch.zeros(2)}, out / "pytorch_model.bin")
    else:
        raise AssertionError(kind)
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
FILE_CASES = [k for k in LOAD_CASES if not k.startswith(("dtype_", "ranks_", "plan_", "unknown_plan", "vocab_"))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    model.save_pretrained(root / "hub", max_shard_size=total // 3)
    parity.build_model(parity.tiny_config("qwen3")).save_pretrained(root / "dense", max_shard_size=total // 3)
    parity.build_model(parity.tiny_config("qwen3_moe", vocab_size=127)).save_pretrained(root / "vocab127")
    dirs = {"hub": str(root / "hub"), "vocab127": str(root / "vocab127")}
    facts = {}
    for kind in FILE_CASES:
        path, facts[kind] = _make_bad(root, root / "hub", root / "dense", kind)
        dirs[kind] = str(path)
    return root, dirs, facts


class _Watch:
    """Counts tensor reads (``safe_open`` handles the loader opens) and unpickling calls on one rank."""

    opens = 0
    unpickles: list = []


def _counting_safe_open(*args, **kwargs):
    from safetensors import safe_open

    _Watch.opens += 1
    return safe_open(*args, **kwargs)


def _watch_unpickling() -> None:
    import pickle

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=f"{module.__name__}.{name}", **kwargs):
            _Watch.unpickles.append(_name)
            return _real(*args, **kwargs)

        setattr(module, name, spy)


def _load_job(dirs: dict, cases: list) -> dict:
    import torch.distributed as dist

    import xpar_zoo.loader

    rank = dist.get_rank()
    xpar_zoo.loader.safe_open = _counting_safe_open
    _watch_unpickling()
    out = {}
    for kind in cases:
        name, mesh, dtype = dirs.get(kind, dirs["hub"]), {"ep": 2}, None
        if kind == "dtype_int3":
            dtype = "int3"
        elif kind == "dtype_unknown":
            dtype = "float33"
        elif kind == "dtype_int8":
            dtype = torch.int8
        elif kind == "ranks_disagree_on_name":
            name = dirs["hub"] if rank == 0 else dirs["vocab127"]
        elif kind == "ranks_disagree_on_dtype":
            dtype = torch.bfloat16 if rank == 1 else None
        elif kind == "plan_larger_than_world":
            mesh = {"ep": 4}
        elif kind == "unknown_plan_name":
            mesh = {"foo": 2}
        elif kind == "vocab_not_divisible_by_emb":
            name, mesh = dirs["vocab127"], {"emb": 2}
        _Watch.opens, _Watch.unpickles = 0, []
        start = time.perf_counter()
        try:
            xpar_zoo.from_pretrained(name, mesh=xpar_zoo.Mesh(**mesh), dtype=dtype, progress=False)
            outcome = ("no error", "", False)
        except Exception as e:  # noqa: BLE001 - the test inspects the type
            outcome = (type(e).__name__, str(e), isinstance(e, XparError))
        seconds = time.perf_counter() - start
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (outcome, _Watch.opens, list(_Watch.unpickles), seconds))
        out[kind] = every
    return out


@pytest.fixture(scope="module")
def load_errors(checkpoints):
    _, dirs, _ = checkpoints
    return launch.run(_load_job, WORLD, dirs, list(LOAD_CASES), timeout_s=120)


@pytest.mark.parametrize("kind", list(LOAD_CASES))
def test_bad_load_input_is_a_clear_error_on_every_rank_before_reading_tensors(load_errors, checkpoints, kind):
    _, _, facts = checkpoints
    every = load_errors[kind]
    outcomes = [e[0] for e in every]
    (name, message, is_xpar) = outcomes[0]
    assert is_xpar, f"{kind}: {name}: {message}"
    if not kind.startswith("ranks_"):  # those name each rank's own value, so the text differs per rank
        assert all(o == outcomes[0] for o in outcomes), f"{kind}: ranks disagree: {outcomes}"
    want_class, parts = LOAD_CASES[kind]
    assert name == want_class, f"{kind}: {name}: {message}"
    for part in parts:
        part = part.format(**facts.get(kind, {}))
        assert part in message, f"{kind}: {part!r} not in {message!r}"
    assert [e[1] for e in every] == [0] * WORLD, f"{kind}: a checkpoint file was opened for tensor data"
    assert [e[2] for e in every] == [[]] * WORLD, f"{kind}: something was unpickled: {every}"


# ---- outputs: never overwritten, never half-written ------------------------------------------------------------------
def _tiny_checkpoint(root: Path) -> Path:
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    return xpar_zoo.save_checkpoint(root, model, step=1)


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory.mktemp("dcp") / "ckpt")


def _to_dcp():
    """``convert_to_dcp`` and whether ``xpar-zoo convert to-dcp`` exists; skip (naming why) when it has not landed."""
    from xpar_zoo import cli

    try:
        from xpar_zoo.converters.to_dcp import convert_to_dcp
    except ImportError as e:
        pytest.skip(f"convert to-dcp has not landed yet ({e})")
    actions = cli.build_parser()._subparsers._group_actions[0].choices["convert"]._subparsers._group_actions[0]
    if "to-dcp" not in actions.choices:
        pytest.skip("`xpar-zoo convert to-dcp` is not in the CLI yet")
    return convert_to_dcp


def _siblings(path: Path) -> set[str]:
    return set(os.listdir(path.parent))


@pytest.mark.parametrize("command", ["to-hf", "to-dcp"])
def test_convert_refuses_an_existing_output_without_force(command, dcp_checkpoint, checkpoints, tmp_path, capsys):
    from xpar_zoo import cli

    if command == "to-dcp":
        _to_dcp()
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
    from xpar_zoo import cli

    if command == "to-dcp":
        _to_dcp()
    source = str(dcp_checkpoint) if command == "to-hf" else checkpoints[1]["hub"]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert cli.main(["convert", command, source, str(blocker / "out")]) == 2
    assert f"cannot write {blocker / 'out'}: {blocker}" in capsys.readouterr().err
    assert _siblings(blocker) == {"a_file"}


def test_convert_refuses_a_read_only_parent(dcp_checkpoint, tmp_path, capsys):
    from xpar_zoo import cli

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


def test_save_checkpoint_under_a_regular_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    with pytest.raises(xpar_zoo.CheckpointError, match=re.escape(str(blocker))):
        xpar_zoo.save_checkpoint(blocker / "ckpt", model)
    assert os.listdir(tmp_path) == ["a_file"]


def test_export_dtype_int3_and_bad_shard_size_are_refused_before_work(dcp_checkpoint, tmp_path):
    from xpar_zoo.converters.export import ExportError, export_to_hf

    with pytest.raises(ExportError, match="unknown dtype 'int3'; use one of bf16, "):
        export_to_hf(dcp_checkpoint, tmp_path / "out", dtype="int3")
    with pytest.raises(ExportError, match="cannot parse shard size '5 parsecs'"):
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
        (ckpt / ".metadata").write_bytes(b"\xff" * size)  # same size: only the unpickling can notice
        return "unreadable DCP metadata"
    if kind == "plain_dcp":
        for f in ("COMPLETE", "xpar_checkpoint.json", "extra_state.json"):
            (ckpt / f).unlink()
        return "is a DCP directory but not an xpar_zoo checkpoint (no xpar_checkpoint.json)"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["no_complete_marker", "data_file_missing", "data_file_truncated",
                                  "metadata_corrupt", "plain_dcp"])
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


# ---- a rank that dies or hangs during a load -------------------------------------------------------------------------
RANK_TIMEOUT_S = 15
JOB_BOUND_S = 90


def _one_rank_fails_in_load(hub: str, how: str) -> None:
    import torch.distributed as dist

    import xpar_zoo.loader

    if dist.get_rank() == 1:
        def fail(*args, **kwargs):
            if how == "dies":
                os._exit(1)
            time.sleep(10 * RANK_TIMEOUT_S)  # hangs: never reaches the next collective

        xpar_zoo.loader.build_meta = fail
    xpar_zoo.from_pretrained(hub, mesh=xpar_zoo.Mesh(ep=2), progress=False)


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_rank_failing_during_a_load_ends_the_job_with_a_clear_error(how, checkpoints):
    """Rank 1 exits (``os._exit(1)``) or hangs inside ``from_pretrained`` before the collective of ``parallelize``:
    the job ends with a RuntimeError well before the bound, not a hang. A dead rank is seen at once (its sockets
    close); a hung rank by the process group timeout, on which rank 0 raises by itself."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        launch.run(_one_rank_fails_in_load, WORLD, checkpoints[1]["hub"], how, timeout_s=RANK_TIMEOUT_S)
    elapsed = time.monotonic() - start
    message = str(e.value)
    assert elapsed < JOB_BOUND_S, f"{how}: took {elapsed:.0f} s"
    assert message.startswith("distributed run failed")
    if how == "dies":
        assert "process 1 terminated with exit code 1" in message or "rank 0" in message, message
    else:  # rank 0 itself raised: gloo honours the process group timeout
        assert "rank 0:" in message and "parallelize" in message, message
        assert re.search(r"[Tt]imed? ?out", message), message


def _abort_at_exit_on_rank_1() -> str:
    import atexit

    import torch.distributed as dist

    if dist.get_rank() == 1:
        atexit.register(os.abort)  # after the job, the barrier and the teardown: as the interpreter shuts down
    return "result"


def _abort_during_the_job_on_rank_1() -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.abort()
    dist.barrier()
    return "result"


def test_a_rank_dying_after_the_job_finished_keeps_the_result_but_one_dying_during_it_fails_the_job():
    with pytest.warns(RuntimeWarning, match="died after the job had finished on every rank"):
        assert launch.run(_abort_at_exit_on_rank_1, 2, timeout_s=RANK_TIMEOUT_S) == "result"
    with pytest.raises(RuntimeError, match="distributed run failed"):
        launch.run(_abort_during_the_job_on_rank_1, 2, timeout_s=RANK_TIMEOUT_S)


# ---- nothing untrusted is unpickled ----------------------------------------------------------------------------------
ALLOWED_PICKLE = {
    # DCP .metadata through an unpickler that admits only DCP's own classes
    ("xpar_zoo/checkpoint.py", "_MetadataUnpickler"),
    # launch.run: rank 0's result, pickled by our own child process
    ("xpar_zoo/testing/launch.py", "pickle.loads(payload)"),
}


def _package_sources() -> list[Path]:
    return sorted(p for d in ("xpar_zoo", "converters", "plans") for p in (REPO_ROOT / d).rglob("*.py"))


def test_no_torch_load_without_weights_only_and_no_unrestricted_unpickling():
    bad = []
    for path in _package_sources():
        rel = str(path.relative_to(REPO_ROOT))
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in m.group(1):
                bad.append(f"{rel}: {m.group(0)}")
        for line in text.splitlines():
            if re.search(r"pickle\.(load|loads|Unpickler)\b|\bUnpickler\(", line):
                allowed = any(rel == f and token in line for f, token in ALLOWED_PICKLE)
                if not allowed and not line.lstrip().startswith(("#", "import", "from")):
                    bad.append(f"{rel}: {line.strip()}")
    assert not bad, "unpickling outside the allowed places:\n" + "\n".join(bad)


def test_the_pickle_check_sees_the_allowed_uses():
    """The grep above is not vacuous: it finds the two allowed uses where they are."""
    found = {(str(p.relative_to(REPO_ROOT)), tok) for p in _package_sources() for f, tok in ALLOWED_PICKLE
             if str(p.relative_to(REPO_ROOT)) == f and tok in p.read_text()}
    assert found == ALLOWED_PICKLE
    assert "weights_only=True" in (REPO_ROOT / "xpar_zoo/checkpoint.py").read_text()
