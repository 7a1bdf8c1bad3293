"""The launcher's decisions and the quiet ranks, without a process group (issue 31, item 7): a rank that dies is
one line naming it and the others are stopped; the ranks' own statuses pass through (2 bad input, 130/143 stopped
by a signal); --nproc-per-node is refused under torchrun; ranks other than 0 keep transformers', PEFT's and
Python's warnings to themselves."""

import logging
import subprocess
import sys
import warnings

import pytest

from xpar_zoo.errors import TrainConfigError
from xpar_zoo.train import launcher
from xpar_zoo.train.loop import quiet_other_ranks


def _procs(*codes_or_sleep):
    out = []
    for c in codes_or_sleep:
        code = "import time; time.sleep(60)" if c == "sleep" else f"import sys; sys.exit({c})"
        out.append(subprocess.Popen([sys.executable, "-c", code]))
    return out


def test_a_rank_that_dies_is_one_line_and_the_others_are_stopped(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "GRACE_S", 0.5)
    procs = _procs("sleep", 3)
    assert launcher._wait(procs, first_rank=4) == 1
    assert procs[0].returncode is not None  # the sleeping rank was killed, not waited for
    assert capsys.readouterr().err == ("xpar-zoo: error: rank 5 exited with status 3 (its output is above); the "
                                       "other ranks were stopped\n")


@pytest.mark.parametrize("code", [0, 2, 130, 143])
def test_the_ranks_own_status_passes_through_without_a_line(code, capsys):
    assert launcher._wait(_procs(code, code), first_rank=0) == code
    assert capsys.readouterr().err == ""


def test_nproc_per_node_under_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.delenv(launcher.LAUNCHED, raising=False)
    with pytest.raises(TrainConfigError, match="leave it out under torchrun"):
        launcher.check_launch(2, 1, 0, None)


@pytest.mark.parametrize("args, message", [((0, 1, 0, None), "--nproc-per-node must be in"),
                                           ((2, 2, 2, None), r"--node-rank must be in 0 … 1"),
                                           ((2, 1, 0, 70000), "--master-port must be a port number")])
def test_launcher_flags_out_of_range_are_refused(args, message, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(TrainConfigError, match=message):
        launcher.check_launch(*args)


@pytest.mark.parametrize("variable, argv", [("WORLD_SIZE", ["--nproc-per-node", "2"]), ("WORLD_SIZE", ["--dry-run"]),
                                            ("RANK", [])])
def test_a_launcher_variable_that_is_not_a_number_is_one_line(variable, argv, monkeypatch, tmp_path, capsys):
    from xpar_zoo.commands import cli

    for name in ("TORCHELASTIC_RUN_ID", launcher.LAUNCHED, "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "two")
    assert cli.main(["train", "--model", "m", "--data", "d", "--output", str(tmp_path), "--steps", "1", *argv]) == 2
    assert capsys.readouterr().err == (f"xpar-zoo: error: {variable}='two': expected a whole number (the launcher "
                                       "sets it for each process)\n")


def test_ranks_other_than_0_keep_warnings_to_themselves():
    from transformers.utils import logging as hf_logging

    loggers = {n: logging.getLogger(n).level for n in ("transformers", "peft", "accelerate", "datasets")}
    verbosity = hf_logging.get_verbosity()
    try:
        with warnings.catch_warnings(record=True) as seen:
            quiet_other_ranks(0)
            warnings.warn("rank 0 says it", stacklevel=1)
            quiet_other_ranks(1)
            warnings.warn("rank 1 would repeat it", stacklevel=1)
        assert [str(w.message) for w in seen] == ["rank 0 says it"]
        assert logging.getLogger("peft").level == logging.ERROR
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    finally:
        for n, level in loggers.items():
            logging.getLogger(n).setLevel(level)
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def test_ranks_ended_by_a_forwarded_signal_are_not_reported_as_failures(capsys):
    procs = _procs("sleep", "sleep")
    for p in procs:
        p.send_signal(15)
    assert launcher._wait(procs, first_rank=0, signals=[15]) == 1  # launch() returns 128 + the signal for it
    assert capsys.readouterr().err == ""


def test_a_signal_outside_the_loop_stops_at_once_and_says_so(capsys):
    import os
    import signal

    from xpar_zoo.train.stop import StopAtOnce, Stopped

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as e:
        with StopAtOnce(rank=0):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
    assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) is before
    assert capsys.readouterr().out == "SIGTERM: stopped; rerun the command to start again\n"
