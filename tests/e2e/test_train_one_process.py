"""`xpar-zoo train` in one process as a newcomer runs it (issue 31, items 2, 4, 6, 7): errors found before the model
loads are one line with status 2 (a mesh naming no plan of the model, a mesh needing more ranks, bad data, a garbled
metrics.jsonl before --resume), the README's one-process line with a YAML mesh works with `--mesh none`, warmup's
first step trains at lr/warmup, a resumed run applies a changed --lr from the next step and says so, and
--export-hf replaces an existing export with --force only once the new one is complete."""

import json

import pytest
import torch

from xpar_zoo.commands import cli
from xpar_zoo.testing import parity
from xpar_zoo.train.metrics import read_metrics

SEQ = 16
CHARS = "abcdefghijklmnopqrstuvwxyz .,"


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("train1")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    model.save_pretrained(base / "model")
    _tokenizer().save_pretrained(base / "model")
    with open(base / "data.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"the cat sat on the mat {i % 7}. a dog ran."}) + "\n")
    return base


def _common(files, out, *extra):
    return ["train", "--model", str(files / "model"), "--data", str(files / "data.jsonl"), "--output", str(out),
            "--seq-len", str(SEQ), "--lr", "1e-2", "--no-progress", "--no-tensorboard", *extra]


def _one_line(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.startswith("xpar-zoo: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_mesh_naming_no_plan_of_the_model_names_the_plan(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("xpar_zoo.from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(_common(files, tmp_path / "o", "--steps", "2", "--mesh", "foo=2")) == 2
    _one_line(capsys, "mesh uses plan(s) ['foo'] that the 'qwen3_moe' plan does not define; its plans: ep, emb, head")
    assert not (tmp_path / "o").exists()


def test_mesh_needing_more_ranks_on_one_process_says_how_to_start_them(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("xpar_zoo.from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(_common(files, tmp_path / "o", "--steps", "2", "--mesh", "ep=2")) == 2
    _one_line(capsys, "--mesh ep=2 needs several ranks, and this is one process",
              "start 2 or more with --nproc-per-node (or torchrun), or pass --mesh none")


def test_bad_data_is_one_line_before_the_model_loads(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("xpar_zoo.from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    (tmp_path / "runs").mkdir()
    argv = _common(files, tmp_path / "runs" / "new" / "o", "--steps", "2", "--export-hf", str(tmp_path / "out" / "hf"))
    argv[argv.index("--data") + 1] = str(bad)
    assert cli.main(argv) == 2
    _one_line(capsys, f"{bad}:2: invalid UTF-8 at byte offset 25")
    # the directories it made for --output and the export are gone again; what was there before stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "runs"] and not any((tmp_path / "runs").iterdir())


def test_readme_one_process_line_with_a_yaml_mesh(files, tmp_path, capsys):
    """README: `xpar-zoo train --config run.yaml --steps 10 --mesh none` with the run's YAML mesh (ep=8)."""
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {files / 'model'}\ndata: {files / 'data.jsonl'}\noutput: {tmp_path / 'o'}\n"
                   f"mesh: {{ep: 8}}\nseq-len: {SEQ}\nsteps: 100\nprogress: false\ntensorboard: false\n")
    assert cli.main(["train", "--config", str(run), "--steps", "2", "--mesh", "none"]) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "o")] == [1, 2]


def test_warmup_step_one_trains_at_lr_over_warmup(files, tmp_path):
    assert cli.main(_common(files, tmp_path / "o", "--steps", "3", "--warmup", "2", "--schedule", "constant")) == 0
    assert [m["lr"] for m in read_metrics(tmp_path / "o")] == [pytest.approx(5e-3), pytest.approx(1e-2),
                                                               pytest.approx(1e-2)]


def test_resume_with_a_changed_lr_applies_it_and_says_so(files, tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(_common(files, out, "--steps", "4", "--stop-after", "2", "--schedule", "constant")) == 0
    capsys.readouterr()
    argv = _common(files, out, "--steps", "4", "--schedule", "constant", "--resume")
    argv[argv.index("--lr") + 1] = "5e-2"
    assert cli.main(argv) == 0
    assert "changed on resume: lr 0.01 → 0.05 from step 3" in capsys.readouterr().out
    assert [m["lr"] for m in read_metrics(out)] == [pytest.approx(1e-2)] * 2 + [pytest.approx(5e-2)] * 2


def test_resume_with_another_seed_is_refused_with_the_reason(files, tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(_common(files, out, "--steps", "2", "--stop-after", "1")) == 0
    capsys.readouterr()
    assert cli.main(_common(files, out, "--steps", "2", "--resume", "--seed", "7")) == 2
    _one_line(capsys, "--resume: seed was 0 at step 1, now 7: cannot change on resume (the data order")


def test_garbled_metrics_before_resume_is_one_line(files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    assert cli.main(_common(files, out, "--steps", "2", "--stop-after", "1")) == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write("\x00\x01garbage\n")
    capsys.readouterr()
    monkeypatch.setattr("xpar_zoo.from_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    assert cli.main(_common(files, out, "--steps", "2", "--resume")) == 2
    _one_line(capsys, "metrics.jsonl:3: not a metrics record (garbled)")


def test_export_hf_with_force_replaces_the_old_export_once_complete(files, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model-00001-of-00009.safetensors").write_bytes(b"old shard")
    assert cli.main(_common(files, tmp_path / "o", "--steps", "1", "--export-hf", str(hf))) == 2
    _one_line(capsys, f"--export-hf {hf} already exists and is not empty; pass --force")
    assert (hf / "model-00001-of-00009.safetensors").read_bytes() == b"old shard"
    assert cli.main(_common(files, tmp_path / "o", "--steps", "1", "--export-hf", str(hf), "--force")) == 0  # as is
    assert not (hf / "model-00001-of-00009.safetensors").exists()
    assert (hf / "tokenizer.json").is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe"


def test_console_shows_each_step_once_without_control_codes(files, tmp_path, capsys):
    """Progress on (the default) with stdout and stderr not terminals: one plain line per step (--log-every 1), none
    twice."""
    argv = [a for a in _common(files, tmp_path / "o", "--steps", "3", "--log-every", "1") if a != "--no-progress"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "\r" not in out and "\x1b" not in out
    steps = [line.split()[1] for line in captured.out.splitlines() if line.startswith("step ") and "/" in line.split()[1]]
    assert steps == ["1/3", "2/3", "3/3"], captured.out


def test_no_progress_shows_every_nth_step_once(files, tmp_path, capsys):
    assert cli.main(_common(files, tmp_path / "o", "--steps", "5", "--log-every", "2")) == 0
    out = capsys.readouterr().out
    steps = [line.split()[1] for line in out.splitlines() if line.startswith("step ") and "/" in line.split()[1]]
    assert steps == ["2/5", "4/5", "5/5"], out
