"""Interrupts at any moment end with one line saying what is saved and what to type next (issue 37, item 2): while
the package imports (the command only; a library import changes no handler), while starting or loading, in the
loop (a second signal stops at once, with its line), while exporting (a resume then writes the missing export);
under torchrun rank 0 points to `xpar-zoo train --nproc-per-node` before torchrun's own report."""

import json
import os
import signal
import types

import pytest

from xpar_zoo import interrupts
from xpar_zoo.checkpoint.layout import write_complete_marker
from xpar_zoo.train.stop import StopAtOnce, StopOnSignal, Stopped, saved_hint


def _signal_self(signum):
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # the handler runs between bytecodes
        pass


def _checkpoint(output, step):
    ckpt = output / "checkpoints" / f"step-{step:08d}"
    ckpt.mkdir(parents=True)
    for name, text in ((".metadata", "x"), ("xpar_checkpoint.json", "{}"), ("extra_state.json", json.dumps(
            {"step": step, "config": {"steps": step}}))):
        (ckpt / name).write_text(text)
    write_complete_marker(ckpt, step)


def test_the_line_says_what_is_saved_and_what_to_type(tmp_path):
    assert saved_hint(None) == "rerun the command to start again"
    assert saved_hint(tmp_path) == "no checkpoint was saved yet: rerun the same command to start again"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")  # trained, saved none
    assert saved_hint(tmp_path) == "no checkpoint was saved: rerun with --force to start again"
    _checkpoint(tmp_path, 3)
    assert saved_hint(tmp_path) == "the run is saved at step-00000003: rerun with --resume to continue"


def test_a_signal_while_loading_names_the_phase_and_the_checkpoint_once(tmp_path, capsys):
    _checkpoint(tmp_path, 3)
    with pytest.raises(Stopped) as e:
        with StopAtOnce(0, "before step 1 (loading)", tmp_path):
            _signal_self(signal.SIGINT)
    assert e.value.code == 130
    assert capsys.readouterr().out == ("SIGINT: stopped before step 1 (loading); the run is saved at step-00000003: "
                                       "rerun with --resume to continue\n")
    with pytest.raises(Stopped):
        with StopAtOnce(1, "while exporting", tmp_path):  # other ranks stop silently
            _signal_self(signal.SIGTERM)
    assert capsys.readouterr().out == ""


def test_a_second_signal_in_the_loop_stops_at_once_with_a_closing_line(tmp_path):
    said = []
    _checkpoint(tmp_path, 2)
    with pytest.raises(Stopped) as e:
        with StopOnSignal(announce=said.append, output=tmp_path, repeat_window_s=0) as stop:
            _signal_self(signal.SIGINT)
            assert stop.signum == signal.SIGINT  # the first: finish the step, then save
            _signal_self(signal.SIGINT)
    assert e.value.code == 130 and len(said) == 2
    assert said[1] == ("SIGINT again: stopped at once without saving this step; the run is saved at step-00000002: "
                       "rerun with --resume to continue")


@pytest.mark.parametrize("orig, argv0, command", [
    (["python", "-m", "xpar_zoo.train", "--steps", "2"], "-m", True),
    (["python", "-m", "xpar_zoo", "train"], "-m", True),
    (["/venv/bin/python", "/venv/bin/xpar-zoo", "train"], "/venv/bin/xpar-zoo", True),
    (["python", "-m", "pytest", "-q"], "/x/pytest/__main__.py", False),
    (["python", "train.py"], "train.py", False),
])
def test_only_the_command_quiets_the_import(orig, argv0, command):
    assert interrupts.is_command(orig, argv0) is command


def test_importing_the_library_changes_no_signal_handler():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # pytest imported xpar_zoo above


def test_resume_of_a_finished_run_writes_an_export_an_interrupt_left_missing(tmp_path):
    from xpar_zoo.train import TrainConfig
    from xpar_zoo.train.outputs import check_finished_resume, plan_outputs

    _checkpoint(tmp_path / "run", 4)
    (tmp_path / "hf").mkdir()  # left empty: the export was interrupted (its staging removed)
    cfg = TrainConfig(model="m", data="d", output=str(tmp_path / "run"), steps=4, resume=True,
                      export_hf=str(tmp_path / "hf"))
    plan = plan_outputs(cfg)
    check_finished_resume(plan, 4, cfg)  # goes on: only the export is written
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(Exception, match="adds no step"):
        check_finished_resume(plan, 4, cfg)


def test_under_torchrun_rank_0_points_to_the_launcher_before_torchruns_report(monkeypatch, capsys):
    from xpar_zoo.commands import cli

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["train", "--model", "m", "--data", "d", "--output", "o", "--steps", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("xpar-zoo: error: ") and len(err) == 2
    assert err[1].startswith("xpar-zoo: torchrun's report of the ranks' exit statuses follows; `xpar-zoo train "
                             "--nproc-per-node N` starts the ranks itself")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["train", "--model", "m", "--data", "d", "--output", "o", "--steps", "0"]) == 2
    assert capsys.readouterr().err == ""  # the other ranks stay silent


def test_under_torchrun_an_interrupted_rank_0_points_to_the_launcher_before_it_exits(monkeypatch, capsys):
    import xpar_zoo.train
    from xpar_zoo.commands import cli
    from xpar_zoo.parallel import teardown
    from xpar_zoo.train.stop import Stopped

    def stopped(cfg):
        raise Stopped(signal.SIGINT, "stopped")

    def exit_rank(code):
        raise SystemExit(code)

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(xpar_zoo.train, "run", stopped)
    monkeypatch.setattr(teardown, "exit_rank", exit_rank)
    monkeypatch.setattr(xpar_zoo.train, "config_from_args", lambda args: types.SimpleNamespace(output="o"))
    with pytest.raises(SystemExit) as ended:
        cli.main(["train", "--model", "m", "--data", "d", "--output", "o", "--steps", "1"])
    assert ended.value.code == 130
    assert capsys.readouterr().err.startswith("xpar-zoo: torchrun's report of the ranks' exit statuses follows")


def test_the_same_ctrl_c_passed_on_by_torchrun_is_not_a_second_one():
    said = []
    with StopOnSignal(announce=said.append) as stop:  # the terminal's SIGINT, then torchrun's copy of it
        _signal_self(signal.SIGINT)
        _signal_self(signal.SIGINT)
    assert stop.signum == signal.SIGINT and len(said) == 1  # the step finishes and saves
