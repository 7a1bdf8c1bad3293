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
import subprocess
import sys
from pathlib import Path

import pytest

import xpar_zoo
from support.load_refusal_cases import FILE_CASES, _make_bad
from xpar_zoo.testing import parity

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
