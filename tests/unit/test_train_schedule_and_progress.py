"""The newcomer's path, the parts without a process group (issue 31, items 4 and 7): warmup starts at lr/warmup in
step 1, a resumed run's changed settings are logged or refused with the reason, ranks' differing settings are named
with their ranks, the progress bar shows the step just finished, no terminal control codes when stderr is not a
terminal, a plain line every --log-every steps, and docs/training.md lists every flag of `xpar-zoo train`."""

import argparse
import re
from pathlib import Path

import pytest
import torch

from xpar_zoo.errors import TrainConfigError
from xpar_zoo.train import TrainConfig
from xpar_zoo.train.agreement import differences, resume_changes
from xpar_zoo.train.config import add_arguments
from xpar_zoo.train.metrics import MetricsLog
from xpar_zoo.train.optim import build_scheduler, lr_factor

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _cfg(**kw):
    return TrainConfig(**{"model": "m", "data": "d", "output": "o", "steps": 10, "lr": 1e-2, **kw})


def test_warmup_starts_at_lr_over_warmup_in_step_one():
    cfg = _cfg(warmup=4, schedule="constant")
    assert [lr_factor(cfg, done) for done in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_scheduler_gives_step_one_its_warmup_lr():
    cfg = _cfg(warmup=4)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(cfg.steps):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(1e-2 / 4) and seen[3] == pytest.approx(1e-2) and seen[-1] < seen[4]


def test_cosine_after_warmup_is_transformers_own():
    from transformers import get_scheduler

    cfg = _cfg(warmup=3, min_lr_ratio=0.1)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=3, num_training_steps=10,
                           scheduler_specific_kwargs={"min_lr_rate": 0.1})
    for done in range(3, 10):
        assert lr_factor(cfg, done) == pytest.approx(theirs.lr_lambdas[0](done))


def test_resumed_scheduler_uses_this_runs_lr_from_the_checkpoint_step():
    cfg = _cfg(lr=5e-2, schedule="constant")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)  # as loaded from the checkpoint
    sched = build_scheduler(opt, cfg, done=5)
    assert sched.get_last_lr() == [5e-2] and opt.param_groups[0]["lr"] == 5e-2


def test_resume_change_of_lr_is_logged():
    saved = _cfg(lr=3e-3).to_json()
    assert resume_changes(saved, _cfg(lr=5e-2), step=4) == ["lr 0.003 → 0.05 from step 5"]


def test_resume_changes_of_schedule_and_batch_are_logged():
    saved = _cfg(lr=3e-3).to_json()
    lines = resume_changes(saved, _cfg(lr=3e-3, warmup=2, grad_accum=2, mesh={"ep": 2}), step=4)
    assert lines == ["mesh none → ep=2 from step 5", "grad_accum 1 → 2 from step 5", "warmup 0 → 2 from step 5"]


def test_resume_per_job_settings_apply_without_a_line():
    saved = _cfg().to_json()
    assert resume_changes(saved, _cfg(stop_after=8, save_every=2, progress=False, output="elsewhere"), 4) == []


@pytest.mark.parametrize("name, value", [("seq_len", 64), ("seed", 3), ("data", "other.jsonl"),
                                         ("tokenizer", "tok"), ("text_field", "body")])
def test_resume_change_of_the_data_layout_is_refused_with_the_reason(name, value):
    with pytest.raises(TrainConfigError, match=rf"--resume: {name} was .* at step 4, now .*: cannot change on "
                                               r"resume \("):
        resume_changes(_cfg().to_json(), _cfg(**{name: value}), step=4)


@pytest.mark.parametrize("name, value", [("lora_rank", 16), ("lora_targets", "q_proj"), ("loss_on", "all")])
def test_resume_change_of_what_trains_is_refused_with_the_reason(name, value):
    saved = _cfg(lora_rank=8, loss_on="assistant").to_json()
    now = {"lora_rank": 8, "loss_on": "assistant", name: value}
    with pytest.raises(TrainConfigError, match=rf"--resume: {name} was .*: cannot change on resume \(the checkpoint"):
        resume_changes(saved, _cfg(**now), step=4)


def test_resume_with_epochs_compares_steps_once_known():
    """--epochs: the steps come from the data later; the settings compare without them."""
    assert resume_changes(_cfg().to_json(), _cfg(steps=None, epochs=2), step=4) == []


def test_resume_past_steps_is_refused():
    with pytest.raises(TrainConfigError, match="the checkpoint is at step 6, past --steps 5"):
        resume_changes(_cfg().to_json(), _cfg(steps=5), step=6)


def test_rank_differences_name_the_setting_and_the_ranks():
    assert differences([4, 5, 4, 4], "steps") == "steps: 4 on ranks 0, 2, 3; 5 on rank 1"
    assert differences([0.1, 0.1], "lr") is None


def _record(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "step_time_s": 0.1}


def test_console_line_shows_the_step_just_finished():
    """The command's line per step (xpar_zoo.train.reporting) names the step whose numbers it shows, counted out of
    the global --steps, with no terminal control codes."""
    from types import SimpleNamespace

    from xpar_zoo.train.reporting import Reporter

    report = Reporter(SimpleNamespace(progress=True, log_every=1), Path("."), active=True, start_step=0, total_steps=4, wandb=False)
    lines = [report.line(_record(s, 1.0 / s)) for s in (1, 2)]
    assert lines[0].startswith("step 1/4 [#####---------------]  25% loss 1.0000")
    assert lines[1].startswith("step 2/4 [##########----------]  50% loss 0.5000")
    assert not any("\r" in line or "\x1b" in line for line in lines)


def test_no_progress_prints_a_line_every_n_steps_and_the_last(tmp_path, capsys):
    log = MetricsLog(tmp_path, active=True, start_step=0, total_steps=7, tensorboard=False, log_every=3)
    for s in range(1, 8):
        log.write(_record(s, 1.0))
    log.close()
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == ["3/7", "6/7", "7/7"]


def test_docs_list_every_train_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    text = DOCS.read_text()
    section = text[text.index("| flag | meaning"):]
    section = section[:section.index("\n\n")]
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", section))
    assert flags - documented == set(), f"flags missing from docs/training.md's table: {sorted(flags - documented)}"
    assert documented - flags == set(), f"docs/training.md lists flags that do not exist: {sorted(documented - flags)}"
