"""`XparTrainer(...).train(resume_from_checkpoint=checkpoint-N)` refuses, in one line naming both steps, a
`checkpoint-N` whose Trainer state (`trainer_state.json`) and xpar_zoo checkpoint record different steps: resuming
would pair one step's weights and optimizer with another's schedule and data position. The check runs where the
Trainer first looks at the checkpoint, before the optimizer exists."""

import json
import shutil

import pytest

import xpar_zoo
from xpar_zoo.errors import IntegrationError
from xpar_zoo.integrations.trainer import XPAR_CHECKPOINT_DIR, XparTrainer
from xpar_zoo.testing import parity


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``checkpoint-3/`` as XparTrainer writes it: the xpar_zoo checkpoint of step 3 and the Trainer's state."""
    directory = tmp_path_factory.mktemp("trainer") / "checkpoint-3"
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    xpar_zoo.save_checkpoint(directory / XPAR_CHECKPOINT_DIR, model, step=3)
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": []}))
    return directory


@pytest.fixture
def checkpoint(saved, tmp_path):
    out = tmp_path / saved.name
    shutil.copytree(saved, out)
    return out


def _check(checkpoint):
    trainer = XparTrainer.__new__(XparTrainer)  # no model needed: the check reads the checkpoint's files only
    trainer._load_from_checkpoint(str(checkpoint))  # the Trainer's first look at the checkpoint


def test_a_checkpoint_whose_steps_agree_resumes(checkpoint):
    _check(checkpoint)


@pytest.mark.parametrize("step", [5, 0, "3", None])
def test_trainer_state_step_that_disagrees_with_the_xpar_checkpoint_is_refused(checkpoint, step):
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    with pytest.raises(IntegrationError) as e:
        _check(checkpoint)
    message = str(e.value)
    assert f"the Trainer state is at step {step}" in message and "xpar_zoo checkpoint at step 3" in message
    assert "\n" not in message


def test_an_xpar_checkpoint_copied_from_another_step_is_refused(checkpoint, saved):
    other = saved.parent / "other"
    xpar_zoo.save_checkpoint(other, parity.build_model(parity.tiny_config("qwen3_moe")), step=7)
    shutil.rmtree(checkpoint / XPAR_CHECKPOINT_DIR)
    shutil.copytree(other, checkpoint / XPAR_CHECKPOINT_DIR)
    with pytest.raises(IntegrationError, match="Trainer state is at step 3 .* xpar_zoo checkpoint at step 7"):
        _check(checkpoint)


def test_an_unreadable_trainer_state_is_named(checkpoint):
    (checkpoint / "trainer_state.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(IntegrationError, match="trainer_state.json: unreadable Trainer state"):
        _check(checkpoint)
