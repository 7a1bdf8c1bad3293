"""`examples/sft_qwen3_moe_lora.yaml` as a new user runs it: `torchrun --nproc-per-node 4 -m xpar_zoo.train --config
…` (tiny-qwen3-moe built in code, the shipped conversations, LoRA on attention and fused experts, ep=2, 3 epochs,
held-out evaluation, --save-best, merged and adapter exports) — one run whose outputs every test here checks:

- it finishes in under two minutes on 4 CPU ranks and prints one line per step with a progress bar and an ETA;
- SFT parity: every step's loss and gradient norm, every eval_loss, and the LoRA weights at the end equal
  single-process transformers + PEFT trained on the same rows with the same assistant-only labels;
- the rows hold every conversation whole, with exactly transformers' assistant tokens as targets, and the sum of
  `target_tokens` over the run is epochs x the count from `apply_chat_template(..., return_assistant_tokens_mask=True)`;
- the adapter loads in plain `PeftModel.from_pretrained`, the merged export in plain transformers with the same
  logits; checkpoints hold the adapters and their optimizer state only; the best checkpoint is the lowest eval_loss;
  eval_loss is in metrics.jsonl and TensorBoard.
"""

import collections
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from xpar_zoo.testing import parity
from xpar_zoo.train.config import TrainConfig, read_config_file
from xpar_zoo.train.metrics import read_metrics

peft = pytest.importorskip("peft")  # an optional extra: requirements-test.txt installs it
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft_qwen3_moe_lora.yaml"
WORLD = 4
EXPERT_PARAMETERS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]  # the plan's, as the CLI lists them


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_example") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "-m", "xpar_zoo.train",
           "--config", str(EXAMPLE), "--output", str(out), "--export-hf", str(out / "merged"), "--export-adapter",
           str(out / "adapter")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"out": out, "seconds": seconds, "cpu_seconds": cpu_seconds, "stdout": proc.stdout, "metrics": read_metrics(out),
            "cfg": TrainConfig(**{**read_config_file(EXAMPLE), "output": str(out)})}


def _corpora(run):
    """The run's rows as the trainer builds them (training for its epochs, held-out) and its tokenizer."""
    import dataclasses

    from xpar_zoo.train.inputs import load_corpus, resolve_epochs

    cfg = dataclasses.replace(run["cfg"], model=str(run["out"] / "tiny-qwen3-moe"))
    os.chdir(ROOT)  # the example's data paths are relative to the repository
    corpus, tokenizer = load_corpus(cfg, len(tokenizer_of(run)))
    cfg, limited = resolve_epochs(cfg, corpus, tokenizer, WORLD)
    held = load_corpus(cfg, len(tokenizer), cfg.eval_data)[0]
    return cfg, corpus, limited, held, tokenizer


def tokenizer_of(run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(run["out"] / "tiny-qwen3-moe")


def _hf_conversations(path, tokenizer):
    """Per conversation of a JSONL file: (token ids, labels) from transformers' own assistant mask."""
    out = []
    for line in Path(path).read_text().splitlines():
        enc = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(enc["input_ids"])
        out.append((tuple(ids), tuple(t if m else -100 for t, m in zip(ids, enc["assistant_masks"]))))
    return out


@pytest.fixture(scope="module")
def reference(run):
    """Single-process transformers + PEFT on every step's rows (all ranks' at once), the same LoRA config, AdamW,
    clipping and schedule (the run's :func:`~xpar_zoo.train.optim.lr_factor`: warmup, then transformers' cosine);
    evaluated on all held-out rows at the run's evaluation steps."""
    import functools

    from transformers import AutoModelForCausalLM

    from xpar_zoo.train.optim import lr_factor

    cfg, _, limited, held, _ = _corpora(run)
    model = AutoModelForCausalLM.from_pretrained(run["out"] / "tiny-qwen3-moe", dtype=torch.float32,
                                                 experts_implementation="eager")
    torch.manual_seed(cfg.seed)
    model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                             target_modules=cfg.lora_targets.split(","),
                                             target_parameters=EXPERT_PARAMETERS)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, cfg))
    init = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    per_step = WORLD * cfg.micro_batch * cfg.grad_accum
    eval_rows = held.rows(0, held.rows_per_epoch)
    losses, norms, evals = [], [], {}
    for step in range(cfg.steps):
        loss = model(**limited.rows(step * per_step, per_step), use_cache=False).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            model.eval()
            with torch.no_grad():
                evals[step + 1] = model(**eval_rows, use_cache=False).loss.item()
            model.train()
    return {"losses": losses, "norms": norms, "evals": evals, "init": init, "model": model,
            "adapter": {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}}


def test_example_runs_on_4_cpu_ranks_in_under_two_minutes_with_a_step_line(run):
    """The whole run (launcher and 4 ranks) needs under two minutes of CPU time: under two minutes of wall time on
    any machine with a free core (measured: ~45 s wall, ~41 s CPU on 2 idle cores). Wall time on a shared test
    machine says more about the other jobs than about this one, so the test bounds the CPU time."""
    assert run["cpu_seconds"] < 120, f"{run['cpu_seconds']:.0f} s of CPU ({run['seconds']:.0f} s wall)"
    steps = [m["step"] for m in run["metrics"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == run["cfg"].epochs * 29 // 8 + 1  # 29 rows/epoch
    lines = [line for line in run["stdout"].splitlines() if line.startswith("step ") and "ETA" in line]
    assert len(lines) == len(steps), run["stdout"][-2000:]
    assert lines[0].startswith(f"step  1/{len(steps)} [#") and "% loss " in lines[0] and "tok/s" in lines[0]
    assert "truncated" not in run["stdout"] and "packed whole into 29 rows of 512" in run["stdout"]


def test_sft_lora_on_attention_and_experts_matches_single_process_peft(run, reference):
    metrics = run["metrics"]
    parity.assert_losses_match([m["loss"] for m in metrics], reference["losses"], "sft ep2")
    parity.assert_norms_match([m["grad_norm"] for m in metrics], reference["norms"], "sft ep2")
    from safetensors.torch import load_file

    saved = load_file(run["out"] / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == reference["adapter"].keys()
    parity.assert_params_match(parity.param_errors(saved, reference["adapter"], reference["init"]), "sft adapter")
    assert any("experts" in k for k in saved) and any("q_proj" in k for k in saved)


def test_eval_loss_equals_single_process_evaluation_of_the_held_out_file(run, reference):
    evals = {m["step"]: m["eval_loss"] for m in run["metrics"] if "eval_loss" in m}
    assert sorted(evals) == sorted(reference["evals"]) == [4, 8, 11]  # every 4 steps and after the last
    for step, loss in evals.items():
        assert abs(loss - reference["evals"][step]) < parity.LOSS_TOL, (step, loss, reference["evals"][step])
    held = _hf_conversations(ROOT / "examples" / "data" / "tiny_chat_eval.jsonl", tokenizer_of(run))
    count = sum(sum(t != -100 for t in labels) for _, labels in held)
    assert all(m["eval_targets"] == count for m in run["metrics"] if "eval_loss" in m)


def test_rows_hold_whole_conversations_with_transformers_assistant_tokens_as_targets(run):
    _, corpus, limited, _, tokenizer = _corpora(run)
    want = collections.Counter(_hf_conversations(ROOT / "examples" / "data" / "tiny_chat.jsonl", tokenizer))
    rows = corpus.rows(0, corpus.rows_per_epoch)
    got = collections.Counter()
    for ids, pos, labels in zip(rows["input_ids"].tolist(), rows["position_ids"].tolist(), rows["labels"].tolist()):
        starts = [j for j, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            if all(t == tokenizer.pad_token_id for t in ids[a:b]):  # the row's padding: no target
                assert all(t == -100 for t in labels[a:b])
                continue
            got[(tuple(ids[a:b]), tuple(labels[a:b]))] += 1
    assert got == want
    total = sum(sum(t != -100 for t in labels) for _, labels in want.elements())
    assert sum(m["target_tokens"] for m in run["metrics"]) == run["cfg"].epochs * total
    assert all("target_tokens" in m and "targets" not in m for m in run["metrics"])  # one name per metric


def test_adapter_loads_in_plain_peft_and_merged_export_gives_the_same_logits(run, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def base():
        return AutoModelForCausalLM.from_pretrained(run["out"] / "tiny-qwen3-moe", dtype=torch.float32,
                                                    experts_implementation="eager").eval()

    plain = PeftModel.from_pretrained(base(), str(run["out"] / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(run["out"] / "merged", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        trained = reference["model"].eval()(input_ids=ids).logits
        untrained = base()(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    assert (want - trained).abs().max() < 1e-4
    assert (want - untrained).abs().max() > 1e-3  # the adapter changed the model
    for export in ("merged", "adapter"):  # the tokenizer, chat template included, beside each export
        assert AutoTokenizer.from_pretrained(run["out"] / export).chat_template == tokenizer_of(run).chat_template


def test_checkpoints_hold_adapters_only_and_best_is_the_lowest_eval_loss(run):
    from xpar_zoo.checkpoint import model_tensor_specs, read_checkpoint_metadata

    last = run["out"] / "checkpoints"
    specs = model_tensor_specs(last)
    assert specs and all(".lora_A." in k or ".lora_B." in k for k in specs), sorted(specs)[:5]
    assert read_checkpoint_metadata(last)["trainable_only"] is True
    evals = {m["step"]: m["eval_loss"] for m in run["metrics"] if "eval_loss" in m}
    best = [p.name for p in (run["out"] / "best").iterdir() if p.name.startswith("step-")]
    assert best == [f"step-{min(evals, key=evals.get):08d}"]


def test_eval_loss_is_in_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["out"] / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "eval/loss" in scalars and "train/target_tokens" in scalars
    evals = {m["step"]: m["eval_loss"] for m in run["metrics"] if "eval_loss" in m}
    assert {e.step: pytest.approx(e.value) for e in events.Scalars("eval/loss")} == evals
