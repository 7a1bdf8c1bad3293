"""`xpar-zoo train` chat SFT with LoRA on 2 gloo ranks (ep=2), one launched job whose runs the tests check:

- exact resume: 3 steps straight (evaluating after every step) and 1 step + `--resume` (no evaluation) give
  bit-identical losses and gradient norms, so evaluation leaves training as it was and a LoRA checkpoint (adapters
  and optimizer state only) resumes exactly;
- `--adapter DIR` continues a saved adapter: its first loss is single-process PEFT's with that adapter;
- bad input — a tokenizer without a chat template, a record without an assistant turn, a conversation longer than
  --seq-len — is one line `xpar-zoo: error: …` and exit status 2 on every rank, before the model is loaded.
"""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from xpar_zoo.testing import launch
from xpar_zoo.train.metrics import read_metrics

pytest.importorskip("peft")  # an optional extra: requirements-test.txt installs it

WORLD = 2
SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_chat.jsonl"
BAD = {
    "no_chat_template": ("has none; pass --tokenizer with one", {}),
    "no_assistant_turn": ("the conversation has no assistant turn (roles: system, user)", {}),
    "too_long": ("longer than seq_len 32 (first: ", {"--seq-len": "32"}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from xpar_zoo.train.tiny import save_tiny_model, tiny_tokenizer

    base = tmp_path_factory.mktemp("sft_runs")
    lines = SHIPPED.read_text().splitlines()
    (base / "train.jsonl").write_text("\n".join(lines[:24]) + "\n")
    (base / "eval.jsonl").write_text("\n".join(lines[24:30]) + "\n")
    (base / "no_assistant.jsonl").write_text("\n".join(lines[:3] + [json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]})]) + "\n")
    plain = tiny_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(base / "no_template")
    return {"base": base, "model": save_tiny_model(base / "model"), "data": base / "train.jsonl",
            "eval": base / "eval.jsonl", "no_assistant": base / "no_assistant.jsonl",
            "no_template": base / "no_template"}


def _job(files, out):
    import torch.distributed as dist

    from xpar_zoo.commands import cli
    from xpar_zoo.train import load

    common = ["--model", str(files["model"]), "--data", str(files["data"]), "--seq-len", "256", "--lr", "1e-2",
              "--mesh", "ep=2", "--steps", "3", "--no-progress", "--report-to", "none"]

    def train(name, *args, lora=("--lora-rank", "4"), **flags):
        argv = ["train", *common, *lora, "--output", str(out / name), *args]
        for flag, value in flags.items():
            argv[argv.index(flag) + 1] = value
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(argv)
        return code, err.getvalue()

    results = {"straight": train("straight", "--eval-data", str(files["eval"]), "--eval-every", "1",
                                 "--export-adapter", str(out / "straight" / "adapter"))}
    results["resumed"] = [train("resumed", "--stop-after", "1"), train("resumed", "--resume")]
    results["continued"] = train("continued", lora=("--adapter", str(out / "straight" / "adapter")),
                                 **{"--lr": "0", "--steps": "1"})
    loaded = []
    load_model = load.load_model
    load.load_model = lambda *a, **k: loaded.append(True) or load_model(*a, **k)
    try:
        bad = {"no_chat_template": train("bad1", "--tokenizer", str(files["no_template"])),
               "no_assistant_turn": train("bad2", "--data", str(files["no_assistant"])),
               "too_long": train("bad3", **{"--seq-len": "32"})}
    finally:
        load.load_model = load_model
    every = [None] * WORLD
    dist.all_gather_object(every, {"bad": bad, "loaded": loaded})
    return {"codes": results, "ranks": every}


@pytest.fixture(scope="module")
def job(files):
    out = files["base"] / "runs"
    result = launch.run(_job, WORLD, files, out, timeout_s=600)
    return {**result, "out": out, "metrics": {p.name: read_metrics(p) for p in out.iterdir()}}


def test_lora_sft_resumes_exactly_and_evaluation_leaves_training_unchanged(job):
    codes = job["codes"]
    assert [c[0] for c in (codes["straight"], *codes["resumed"])] == [0, 0, 0], codes
    straight, resumed = job["metrics"]["straight"], job["metrics"]["resumed"]
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]  # bit-identical
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in straight]
    assert all("eval_loss" in m for m in straight) and not any("eval_loss" in m for m in resumed)
    assert straight[-1]["loss"] < straight[0]["loss"]


def test_adapter_flag_continues_the_saved_adapter(job, files):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from xpar_zoo.train.config import TrainConfig
    from xpar_zoo.train.inputs import load_corpus

    assert job["codes"]["continued"][0] == 0, job["codes"]["continued"]
    (first,) = job["metrics"]["continued"]
    cfg = TrainConfig(model=str(files["model"]), data=str(files["data"]), output="unused", steps=1, seq_len=256)
    corpus, _ = load_corpus(cfg, 259)
    base = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32, experts_implementation="eager")
    model = PeftModel.from_pretrained(base, str(job["out"] / "straight" / "adapter"))
    with torch.no_grad():
        want = model(**corpus.rows(0, WORLD), use_cache=False).loss.item()
    assert abs(first["loss"] - want) < 1e-5, (first["loss"], want)
    assert abs(first["loss"] - job["metrics"]["straight"][0]["loss"]) > 1e-3  # not the fresh adapter's loss


@pytest.mark.parametrize("case", list(BAD))
def test_bad_conversation_data_is_one_line_and_exit_2_on_every_rank_before_the_model_loads(job, case):
    message, _ = BAD[case]
    for rank, row in enumerate(job["ranks"]):
        code, err = row["bad"][case]
        assert code == 2, (rank, err)
        assert not row["loaded"], f"rank {rank} loaded the model"
        if rank == 0:  # rank 0 says it, once
            assert err.startswith("xpar-zoo: error: ") and err.count("\n") == 1 and message in err, err
        else:
            assert err == ""
