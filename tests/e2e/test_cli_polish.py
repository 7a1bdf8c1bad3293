"""The command line as a new user meets it: every error is one line `xpar-zoo: error: …` with exit status 2 (bad
flags, a demo mesh that cannot work, an unknown model type, a hub that cannot be reached), no BrokenPipeError when
piped into `head`, `plan` names the model it sized, `publish --dry-run` writes and sends nothing, a failed upload
leaves the folder as it was, and `convert inspect` takes a hub id."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from xpar_zoo.commands import cli
from xpar_zoo.testing import parity


def _one_error_line(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.startswith("xpar-zoo: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("argv, fragments", [
    (["demo", "--world", "3"], ["plan 'ep' of size 2 does not divide the dense shard size 3"]),
    (["demo", "--world", "3", "--ep", "3"], ["--ep 3 does not divide the demo model's 8 experts"]),
    (["demo", "--world", "0"], ["--world must be at least 1"]),
    (["size", "qwen3_mo", "--world", "8"], ["unknown model type 'qwen3_mo' (did you mean qwen3_moe", "xpar-zoo list"]),
    (["plan", "qwen3_moe"], ["the following arguments are required: --world", "xpar-zoo size --help"]),
    (["nonsense"], ["invalid choice: 'nonsense'"]),
])
def test_errors_are_one_line_with_status_2(argv, fragments, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors exit from parse_args
        rc = e.code
    assert rc == 2
    _one_error_line(capsys, *fragments)


def test_plan_names_the_model_it_sized(capsys):
    from xpar_zoo import sizing

    assert cli.main(["size", "qwen3_moe", "--world", "8", "--ep", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    config = cli.load_model_config("qwen3_moe")
    params = sum(p.numel() for p in sizing.meta_model(config).parameters())
    assert first == (f"model: qwen3_moe (transformers' default qwen3_moe config): {config.num_hidden_layers} layers, "
                     f"{params / 1e9:.1f}B parameters, {config.num_experts} experts, top-{config.num_experts_per_tok}")


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "export"
    parity.build_model(parity.tiny_config("qwen3_moe")).save_pretrained(path)
    return path


@pytest.fixture
def hub(monkeypatch):
    """HfApi's network calls: recorded, and made to fail where a test says so."""
    from huggingface_hub import HfApi

    calls, failing = [], set()
    for method in ("create_repo", "create_branch", "upload_folder"):
        def call(self, *args, _m=method, **kwargs):
            calls.append(_m)
            if _m in failing:
                raise ConnectionError("[Errno -2] Name or service not known\nsecond line of a long story")
            return "https://huggingface.co/me/x/commit/0"
        monkeypatch.setattr(HfApi, method, call)
    return calls, failing


def test_publish_dry_run_writes_and_sends_nothing(folder, hub, capsys):
    before = sorted(p.name for p in folder.iterdir())
    assert cli.main(["publish", str(folder), "me/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dry run: would create me/tiny and upload") and "  model.safetensors" in out
    assert "library_name: xpar_zoo" in out  # the card it would write
    assert sorted(p.name for p in folder.iterdir()) == before and hub[0] == []


@pytest.mark.parametrize("failing", ["create_repo", "upload_folder"])
def test_publish_that_cannot_reach_the_hub_is_one_line_and_leaves_the_folder(folder, hub, capsys, failing):
    hub[1].add(failing)
    assert cli.main(["publish", str(folder), "me/tiny"]) == 2
    step = "creating" if failing == "create_repo" else "uploading to"
    _one_error_line(capsys, f"{step} me/tiny on the hub failed (ConnectionError: [Errno -2] Name or service not known)")
    assert not (folder / "README.md").exists()
    (folder / "README.md").write_text("my card\n")  # an existing card is restored as it was
    assert cli.main(["publish", str(folder), "me/tiny", "--overwrite-card"]) == 2
    assert (folder / "README.md").read_text() == "my card\n"


_PIPE = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-m", "xpar_zoo", "list", "--markdown"], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
p.stdout.close()  # the reader goes away before the writer writes, as `| head` does
print(p.wait(), repr(p.stderr.read().decode()))
"""


def test_no_broken_pipe_traceback_when_the_reader_goes_away():
    out = subprocess.run([sys.executable, "-c", _PIPE], capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == "141 ''", out


def test_convert_inspect_takes_a_hub_id(folder, tmp_path):
    repo, commit = "org/tiny-moe", "0123456789abcdef0123456789abcdef01234567"
    entry = tmp_path / "hf_cache" / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    shutil.copytree(folder, entry / "snapshots" / commit)
    proc = subprocess.run([sys.executable, "-m", "xpar_zoo", "convert", "inspect", repo, "--json"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["format"] == "hub per-expert" and info["model_type"] == "qwen3_moe"
