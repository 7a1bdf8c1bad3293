"""The second attempt has one clear path (issue 37, items 1 and 4): what a start that never trained leaves in
--output does not block the corrected command; an output holding a run names the one command that continues or
replaces it; --force replaces a run as a whole (its checkpoints, best, events, the exports it named inside the run
directory; its metrics moved aside; never an input, never anything else); --resume of a finished run that adds no
step is refused; a damaged or incomplete newer checkpoint is named and skipped (refused with --resume=strict); a
damaged data fingerprint is reported as damage, a real data change names only what differs."""

import json

import pytest

from xpar_zoo.checkpoint.layout import EXTRA_FILE, write_complete_marker
from xpar_zoo.errors import TrainConfigError
from xpar_zoo.train import TrainConfig
from xpar_zoo.train.metrics import METRICS_FILE
from xpar_zoo.train.outputs import check_finished_resume, check_outputs, plan_outputs
from xpar_zoo.train.tiny import TINY_MODEL


@pytest.fixture
def inputs(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a"}\n')
    return {"data": data, "run": tmp_path / "runs" / "m", "base": tmp_path}


def _cfg(inputs, **kw):
    return TrainConfig(**{"model": TINY_MODEL, "data": str(inputs["data"]), "output": str(inputs["run"]),
                          "steps": 4, **kw})


def _checkpoint(run, step, steps=4, **config):
    ckpt = run / "checkpoints" / f"step-{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"dcp")
    (ckpt / "xpar_checkpoint.json").write_text("{}")
    (ckpt / EXTRA_FILE).write_text(json.dumps({"step": step, "config": {"steps": steps, **config},
                                               "data": {"fingerprint": "abc"}}))
    write_complete_marker(ckpt, step)
    return ckpt


def _finished_run(inputs, **config):
    run = inputs["run"]
    _checkpoint(run, 4, **config)
    (run / TINY_MODEL).mkdir()
    (run / TINY_MODEL / "config.json").write_text("{}")
    (run / METRICS_FILE).write_text(json.dumps({"event": "start", "step": 0}) + "\n"
                                    + json.dumps({"step": 4, "loss": 1.0}) + "\n")
    return run


def test_what_a_failed_start_leaves_does_not_block_the_corrected_command(inputs):
    run = inputs["run"]
    (run / TINY_MODEL).mkdir(parents=True)  # saved before the data file was found missing
    (run / TINY_MODEL / "config.json").write_text("{}")
    (run / METRICS_FILE).write_text(json.dumps({"event": "start", "step": 0}) + "\n")  # stopped in step 1
    (run / "tensorboard").mkdir()
    (run / "checkpoints" / ".tmp-step-00000001-abc").mkdir(parents=True)  # an interrupted first save
    plan = check_outputs(_cfg(inputs))
    assert plan.resume_from is None and not plan.remove and not plan.moves


def test_a_users_file_in_the_output_still_needs_force(inputs):
    inputs["run"].mkdir(parents=True)
    (inputs["run"] / "notes.txt").write_text("mine")
    with pytest.raises(TrainConfigError, match=r"is not empty \(notes.txt\) and holds no checkpoint"):
        check_outputs(_cfg(inputs))


def test_a_finished_run_names_the_one_command_that_replaces_it(inputs):
    _finished_run(inputs)
    with pytest.raises(TrainConfigError) as e:
        check_outputs(_cfg(inputs))
    assert str(e.value) == (f"--output {inputs['run']} holds a finished run (step-00000004, the last of its 4 steps):"
                            " rerun with --force to replace it (its checkpoints, exports and metrics), or choose "
                            "another --output")


def test_a_stopped_run_names_resume_and_force(inputs):
    _checkpoint(inputs["run"], 2)
    with pytest.raises(TrainConfigError, match=r"holds a run stopped at step-00000002 \(of 4 steps\): rerun with "
                                               r"--resume to continue it, or with --force to replace it"):
        check_outputs(_cfg(inputs))


def test_resume_of_a_finished_run_that_adds_no_step_is_refused(inputs):
    _finished_run(inputs)
    plan = check_outputs(_cfg(inputs, resume=True))
    assert plan.resume_from.name == "step-00000004"
    with pytest.raises(TrainConfigError, match=r"--resume: the run in .* is at step-00000004 and --steps 4 adds "
                                               r"no step: pass --steps above 4 .* --force to replace it"):
        check_finished_resume(plan, 4)  # (with --epochs: once the data gives the steps)
    check_finished_resume(plan, 6)


def test_force_replaces_a_finished_run_as_a_whole_and_nothing_else(inputs):
    run = _finished_run(inputs, export_hf=str(inputs["run"] / "merged"), export_adapter=str(inputs["base"] / "ad"))
    for name in ("merged", "best", "tensorboard"):
        (run / name).mkdir()
        (run / name / "x").write_text("old")
    (inputs["base"] / "ad").mkdir()
    (inputs["base"] / "ad" / "x").write_text("outside the run directory: not removed")
    (run / "notes.txt").write_text("the user's")
    cfg = _cfg(inputs, force=True, export_hf=str(run / "hf"))
    plan = check_outputs(cfg)
    assert not (run / "checkpoints").stat() is None  # the check itself removes nothing
    assert sorted(p.name for p in plan.remove) == ["best", "checkpoints", "merged", "tensorboard"]
    assert "--force replaces the run in" in plan.describe()[-1]
    plan.apply()
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith("metrics.before-")) == [
        "notes.txt", TINY_MODEL]
    (moved,) = [p for p in run.iterdir() if p.name.startswith("metrics.before-")]
    assert '"step": 4' in moved.read_text()
    assert (inputs["base"] / "ad" / "x").exists()
    (run / "notes.txt").unlink()
    check_outputs(_cfg(inputs))  # and the run after it starts like a first one: nothing of its own blocks


def test_force_leaves_this_runs_exports_to_be_replaced_once_complete(inputs):
    run = _finished_run(inputs, export_hf=str(inputs["run"] / "merged"))
    (run / "merged").mkdir()
    (run / "merged" / "config.json").write_text("{}")
    plan = check_outputs(_cfg(inputs, force=True, export_hf=str(run / "merged")))  # replaced once complete
    assert sorted(p.name for p in plan.remove) == ["checkpoints"]
    plan = check_outputs(_cfg(inputs, force=True))
    assert sorted(p.name for p in plan.remove) == ["checkpoints", "merged"]


def test_resume_replaces_the_exports_the_run_itself_named_without_force(inputs):
    run = inputs["run"]
    _checkpoint(run, 2, export_hf=str(run / "merged"))
    (run / "merged").mkdir()
    (run / "merged" / "config.json").write_text("{}")
    check_outputs(_cfg(inputs, resume=True, export_hf=str(run / "merged")))
    (inputs["base"] / "other").mkdir()
    (inputs["base"] / "other" / "x").write_text("not the run's")
    with pytest.raises(TrainConfigError, match="--export-hf .*other already exists and is not empty"):
        check_outputs(_cfg(inputs, resume=True, export_hf=str(inputs["base"] / "other")))


@pytest.mark.parametrize("damage, why", [("marker", "no COMPLETE marker"),
                                         ("size", "file xpar_checkpoint.json has 3 bytes, COMPLETE says 2")])
def test_a_damaged_newer_checkpoint_is_named_and_skipped_or_refused_with_strict(inputs, damage, why):
    run = inputs["run"]
    _checkpoint(run, 2)
    newer = _checkpoint(run, 3)
    if damage == "marker":
        (newer / "COMPLETE").unlink()
    else:
        (newer / "xpar_checkpoint.json").write_text("{1}")
    plan = plan_outputs(_cfg(inputs, resume=True))
    assert plan.resume_from.name == "step-00000002"
    assert plan.describe()[0].startswith(f"{run / 'checkpoints' / 'step-00000003'} skipped: ")
    assert why in plan.describe()[0]
    with pytest.raises(TrainConfigError, match=r"--resume=strict: .*step-00000003 is newer than step-00000002 and "
                                               rf"cannot be resumed \({why}"):
        plan_outputs(_cfg(inputs, resume="strict"))


def test_a_damaged_fingerprint_is_damage_and_a_data_change_names_what_differs(inputs, tmp_path):
    from types import SimpleNamespace

    from xpar_zoo.train.checkpointer import check_resumable

    ckpt = _checkpoint(inputs["run"], 2)
    extra = json.loads((ckpt / EXTRA_FILE).read_text())
    extra["data"] = {"fingerprint": "f00d", "source": "d.jsonl", "seq_len": 64, "seed": 0, "rows_per_epoch": 9}
    (ckpt / EXTRA_FILE).write_text(json.dumps(extra))
    write_complete_marker(ckpt, 2)
    corpus = SimpleNamespace(source="d.jsonl", seq_len=64, seed=0, rows_per_epoch=9, fingerprint=lambda: "f00d")
    check_resumable(ckpt, corpus)
    corpus.fingerprint = lambda: "beef"
    with pytest.raises(TrainConfigError, match=r"trained on other data \(the tokens of d.jsonl changed since\)"):
        check_resumable(ckpt, corpus)
    corpus.seq_len = 128
    with pytest.raises(TrainConfigError, match=r"other data \(seq_len 64 then, 128 now\): its data position"):
        check_resumable(ckpt, corpus)
    (ckpt / EXTRA_FILE).write_text(json.dumps(extra).replace("f00d", "f10d"))  # a bit flip, same size
    with pytest.raises(TrainConfigError, match=rf"{ckpt} is damaged \(extra_state.json: crc32 .* recorded \(the file "
                                               r"is corrupt\)\): move it aside"):
        check_resumable(ckpt, corpus)


def test_the_shipped_sft_example_reruns_with_one_clear_path_and_dry_run_says_it(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from xpar_zoo.commands import cli

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    run = tmp_path / "sft_tiny"
    _checkpoint(run, 1000, steps=1000, export_hf=str(run / "merged"), export_adapter=str(run / "adapter"))
    for name in ("merged", "adapter"):
        (run / name).mkdir()
        (run / name / "config.json").write_text("{}")
    argv = ["train", "--config", "examples/sft_qwen3_moe_lora.yaml", "--output", str(run), "--export-hf",
            str(run / "merged"), "--export-adapter", str(run / "adapter"), "--nproc-per-node", "4", "--dry-run"]
    assert cli.main(argv) == 2  # a plain rerun: the one line saying --force
    assert capsys.readouterr().err.strip().endswith("rerun with --force to replace it (its checkpoints, exports and "
                                                     "metrics), or choose another --output")
    assert cli.main([*argv, "--force"]) == 0
    out = capsys.readouterr().out
    assert f"output: --force replaces the run in {run}: removes checkpoints/" in out
    assert (run / "checkpoints").is_dir() and (run / "merged" / "config.json").exists()  # a dry run changes nothing


def test_force_into_a_folder_without_a_run_appends_metrics_and_clears_only_best(inputs):
    run = inputs["run"]
    (run / "best" / "step-00000002").mkdir(parents=True)  # a --save-best of a run whose checkpoints were removed
    (run / METRICS_FILE).write_text(json.dumps({"step": 2, "loss": 1.0}) + "\n")
    plan = check_outputs(_cfg(inputs, force=True, save_best=True, eval_data=str(inputs["data"])))
    assert [p.name for p in plan.remove] == ["best"] and not plan.moves  # metrics.jsonl: appended to


def test_strict_resume_refuses_an_unfinished_save_with_no_complete_checkpoint_before_it(inputs):
    (inputs["run"] / "checkpoints" / ".tmp-step-00000001-abc").mkdir(parents=True)
    with pytest.raises(TrainConfigError, match=r"--resume=strict: .*\.tmp-step-00000001-abc is newer than any complete "
                                               r"checkpoint and cannot be resumed \(an unfinished save"):
        plan_outputs(_cfg(inputs, resume="strict"))
    assert plan_outputs(_cfg(inputs, resume=True)).resume_from is None  # --resume: starts at step 0, said
