"""Where `xpar-zoo train` writes is checked before any expensive work (issue 31, item 2): never an input or inside
one, never each other; a non-empty output needs --resume or --force; an existing export needs --force and is
replaced only once the new one is complete; metrics.jsonl is appended to, never truncated, and a garbled one is
named before a resume. (A read-only output: tests/e2e/test_train_cli_guards.py.)"""

import json

import pytest

from xpar_zoo.errors import TrainConfigError
from xpar_zoo.train import TrainConfig
from xpar_zoo.train.metrics import METRICS_FILE, MetricsLog, read_metrics
from xpar_zoo.train.outputs import ExportTarget, check_metrics, check_outputs


@pytest.fixture
def inputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"text": "a"}\n')
    return {"model": model, "data": data, "base": tmp_path}


def _cfg(inputs, **kw):
    settings = dict(model=str(inputs["model"]), data=str(inputs["data"]), output=str(inputs["base"] / "run"),
                    steps=1)
    settings.update(kw)
    return TrainConfig(**settings)


def test_export_onto_the_model_directory_is_refused(inputs):
    with pytest.raises(TrainConfigError, match=r"--export-hf .*model is --model .*: choose an output outside"):
        check_outputs(_cfg(inputs, export_hf=str(inputs["model"]), force=True))
    assert (inputs["model"] / "model.safetensors").read_bytes() == b"weights"


def test_export_onto_the_data_file_is_refused(inputs):
    with pytest.raises(TrainConfigError, match=r"--export-hf .*train.jsonl is --data"):
        check_outputs(_cfg(inputs, export_hf=str(inputs["data"]), force=True))


def test_export_inside_the_model_directory_is_refused(inputs):
    with pytest.raises(TrainConfigError, match=r"--export-hf .*model/hf lies inside --model"):
        check_outputs(_cfg(inputs, export_hf=str(inputs["model"] / "hf")))


def test_export_containing_the_data_is_refused(inputs):
    with pytest.raises(TrainConfigError, match=r"--export-hf .*base.* contains --data|contains --data"):
        check_outputs(_cfg(inputs, export_hf=str(inputs["data"].parent)))


def test_output_inside_the_model_directory_is_refused(inputs):
    with pytest.raises(TrainConfigError, match=r"--output .*model/run lies inside --model"):
        check_outputs(_cfg(inputs, output=str(inputs["model"] / "run")))


def test_output_on_the_data_file_is_refused(inputs):
    with pytest.raises(TrainConfigError, match=r"--output .*train.jsonl is --data"):
        check_outputs(_cfg(inputs, output=str(inputs["data"])))


def test_output_through_a_symlink_to_the_model_is_refused(inputs):
    link = inputs["base"] / "link"
    link.symlink_to(inputs["model"])
    with pytest.raises(TrainConfigError, match="is --model"):
        check_outputs(_cfg(inputs, export_hf=str(link), force=True))


def test_export_is_not_the_run_directory_nor_its_checkpoints(inputs):
    run = inputs["base"] / "run"
    with pytest.raises(TrainConfigError, match="export outside the run directory"):
        check_outputs(_cfg(inputs, export_hf=str(run)))
    with pytest.raises(TrainConfigError, match="lies inside the run's own checkpoints"):
        check_outputs(_cfg(inputs, export_hf=str(run / "checkpoints" / "hf")))
    check_outputs(_cfg(inputs, export_hf=str(run / "hf")))  # beside them: fine


def test_existing_non_empty_export_needs_force(inputs):
    hf = inputs["base"] / "hf"
    hf.mkdir()
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"old")
    with pytest.raises(TrainConfigError, match=r"--export-hf .*hf already exists and is not empty; pass --force"):
        check_outputs(_cfg(inputs, export_hf=str(hf)))
    check_outputs(_cfg(inputs, export_hf=str(hf), force=True))
    assert (hf / "model-00001-of-00002.safetensors").read_bytes() == b"old"  # the check changes nothing


def test_empty_export_directory_is_accepted(inputs):
    (inputs["base"] / "hf").mkdir()
    check_outputs(_cfg(inputs, export_hf=str(inputs["base"] / "hf")))


def test_force_replaces_the_export_only_once_complete(inputs):
    hf = inputs["base"] / "hf"
    hf.mkdir()
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"old")
    target = ExportTarget(hf)
    (target.path / "model.safetensors").write_bytes(b"new")
    assert (hf / "model-00001-of-00002.safetensors").read_bytes() == b"old"  # still the old one while writing
    target.commit()
    assert sorted(p.name for p in hf.iterdir()) == ["model.safetensors"]
    assert not [p for p in inputs["base"].iterdir() if p.name.startswith(".hf.")]  # no staging left


def test_failed_export_leaves_the_old_one(inputs):
    hf = inputs["base"] / "hf"
    hf.mkdir()
    (hf / "old.safetensors").write_bytes(b"old")
    target = ExportTarget(hf)
    (target.path / "half").write_bytes(b"x")
    target.discard()
    assert [p.name for p in hf.iterdir()] == ["old.safetensors"]
    assert not [p for p in inputs["base"].iterdir() if p.name.startswith(".hf.")]


def test_non_empty_output_without_checkpoints_needs_force_or_resume(inputs):
    run = inputs["base"] / "run"
    run.mkdir()
    (run / METRICS_FILE).write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    with pytest.raises(TrainConfigError, match=r"--output .*run is not empty \(metrics.jsonl\) and holds no "
                                               r"checkpoint.*--force"):
        check_outputs(_cfg(inputs))
    check_outputs(_cfg(inputs, force=True))
    check_outputs(_cfg(inputs, resume=True))


def test_output_that_is_a_file_is_refused(inputs):
    (inputs["base"] / "run").write_text("x")
    with pytest.raises(TrainConfigError, match="--output .*run exists and is not a directory"):
        check_outputs(_cfg(inputs))


def test_metrics_are_appended_never_truncated_when_checkpoints_were_removed(tmp_path):
    """A forced run into an --output whose checkpoints were removed: the old lines stay in the file, byte for byte;
    read_metrics gives the new run's lines."""
    old = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3))
    (tmp_path / METRICS_FILE).write_text(old)
    log = MetricsLog(tmp_path, active=True, start_step=0, total_steps=2, tensorboard=False)
    for s in (1, 2):
        log.write({"step": s, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0})
    log.close()
    text = (tmp_path / METRICS_FILE).read_text()
    assert text.startswith(old)
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [(1, 1.0), (2, 1.0)]


def test_resumed_metrics_supersede_the_lines_after_the_checkpoint(tmp_path):
    lines = [{"event": "start", "step": 0}] + [{"step": s, "loss": float(s)} for s in (1, 2, 3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = MetricsLog(tmp_path, active=True, start_step=2, total_steps=4, tensorboard=False)
    log.write({"step": 3, "loss": 30.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0})
    log.close()
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert '"step": 3, "loss": 3.0' in (tmp_path / METRICS_FILE).read_text()  # kept in the file


def test_garbled_metrics_are_named_before_a_resume(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nGARBAGE\x00\n{"step": 2}\n')
    with pytest.raises(TrainConfigError, match=rf"{tmp_path / METRICS_FILE}:2: not a metrics record \(garbled\)"):
        check_metrics(tmp_path)


def test_torn_last_metrics_line_is_dropped_and_said(tmp_path, capsys):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n{"step": 2, "lo')
    check_metrics(tmp_path)
    assert (tmp_path / METRICS_FILE).read_text() == '{"step": 1}\n'
    assert "dropped an incomplete last line (15 bytes" in capsys.readouterr().out
