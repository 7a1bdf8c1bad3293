"""`xpar-zoo train --nproc-per-node N` starts its ranks itself (issue 31, item 7): it trains on N ranks; SIGTERM
(SLURM's preemption) finishes the step on every rank, saves, prints "saved step-N; rerun with --resume" and exits
143; a resumed run stopped by SIGINT (Ctrl-C) does the same with 130; a bad input is one line and status 2, no
traceback, no torchrun ChildFailedError; a read-only --output is refused before step 1.

Three launched runs of 2 ranks (module fixture) and one single process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from xpar_zoo.checkpoint import latest_checkpoint
from xpar_zoo.testing import parity
from xpar_zoo.train.metrics import read_metrics

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
XPAR_ZOO = os.path.join(os.path.dirname(sys.executable), "xpar-zoo")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XPAR_ZOO_START_METHOD"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _argv(base, out, *extra):
    return [XPAR_ZOO, "train", "--nproc-per-node", "2", "--model", str(base / "model"), "--data",
            str(base / "data.jsonl"), "--output", str(out), "--seq-len", "16", "--mesh", "ep=2", "--no-tensorboard",
            "--log-every", "1", *extra]


def _stop_after_step(proc, out, step, signum, timeout=300) -> str:
    """Send ``signum`` to the launcher once ``step`` is in metrics.jsonl; its output once it ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(m["step"] >= step for m in read_metrics(out)):
            proc.send_signal(signum)
            break
        time.sleep(0.2)
    return proc.communicate(timeout=timeout)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    model.save_pretrained(base / "model")
    _tokenizer().save_pretrained(base / "model")
    with open(base / "data.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"the cat sat on the mat {i % 7}. a dog ran."}) + "\n")
    out = base / "run"
    popen = dict(env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    term = subprocess.Popen(_argv(base, out, "--steps", "1000"), **popen)
    term_log = _stop_after_step(term, out, 2, signal.SIGTERM)
    term_step = latest_checkpoint(out / "checkpoints")
    term_metrics = read_metrics(out)
    intr = subprocess.Popen(_argv(base, out, "--steps", "1000", "--resume"), **popen)
    intr_log = _stop_after_step(intr, out, int(term_step.name.split("-")[1]) + 1, signal.SIGINT)
    bad = subprocess.run(_argv(base, base / "bad", "--steps", "2", "--mesh", "ep=4"), timeout=300, **popen)
    return {"base": base, "out": out, "term": (term.returncode, term_log, term_step),
            "term_metrics": term_metrics, "intr": (intr.returncode, intr_log),
            "bad": (bad.returncode, bad.stdout)}


def test_nproc_per_node_starts_the_ranks_itself(runs):
    code, log, step = runs["term"]
    meta = json.loads((step / "extra_state.json").read_text())
    assert meta["world_size"] == 2 and meta["config"]["mesh"] == {"ep": 2}, log
    assert "on Mesh(ep=2; world=2), 2 ranks" in log


def test_sigterm_finishes_the_step_saves_and_exits_143(runs):
    code, log, step = runs["term"]
    n = int(step.name.split("-")[1])
    assert code == 143, log
    assert f"SIGTERM: saved step-{n}; rerun with --resume to continue" in log
    assert max(m["step"] for m in runs["term_metrics"]) == n  # every rank stopped after the same step
    assert "Traceback" not in log and "ChildFailedError" not in log


def test_sigint_after_resume_saves_and_exits_130(runs):
    code, log = runs["intr"]
    _, _, term_step = runs["term"]
    assert code == 130, log
    assert f"resumed from {term_step} at step {int(term_step.name.split('-')[1])}" in log
    saved = latest_checkpoint(runs["out"] / "checkpoints")
    assert saved != term_step and f"SIGINT: saved step-{int(saved.name.split('-')[1])}; rerun with --resume" in log
    steps = [m["step"] for m in read_metrics(runs["out"])]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == int(saved.name.split("-")[1])


def test_bad_input_under_the_launcher_is_one_line_and_status_2(runs):
    code, log = runs["bad"]
    assert code == 2, log
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert errors == ["xpar-zoo: error: plan 'ep' of size 4 is larger than the world (2 ranks)"], log
    assert "Traceback" not in log and "ChildFailedError" not in log


def _without_root_override():
    """In the child before exec: drop the capabilities that let root write into a read-only directory
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) from the bounding set, so the exec'd process has them no more."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def test_read_only_output_is_refused_before_step_1(tmp_path):
    """A directory without write permission (root's override dropped for the run, as any other user has none)."""
    ro = tmp_path / "run"
    ro.mkdir()
    ro.chmod(0o555)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    try:
        res = subprocess.run([XPAR_ZOO, "train", "--model", "nowhere/model", "--data", str(data), "--output", str(ro),
                              "--steps", "1"], env=_env(), capture_output=True, text=True, timeout=300,
                             preexec_fn=_without_root_override if os.geteuid() == 0 else None)
    finally:
        ro.chmod(0o755)
    assert res.returncode == 2, res.stderr
    assert res.stderr == f"xpar-zoo: error: --output {ro}: cannot write there (Permission denied)\n"
