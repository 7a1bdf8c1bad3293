"""Conversation data for `xpar-zoo train` (no process group): assistant targets from the template's generation
markers equal those from rendering turn prefixes and transformers' own mask; `--loss-on`; prompt/completion
records; bad records and over-long conversations named in one line; `--truncate` counted; best-fit packing keeps
conversations whole; `--epochs`; the new settings refused at parse time (exit 2); `--dry-run`; the console line."""

from pathlib import Path

import numpy as np
import pytest
import torch

from xpar_zoo.commands import cli
from xpar_zoo.errors import DataError, TrainConfigError
from xpar_zoo.loss.global_batch import IGNORE_INDEX
from xpar_zoo.train.chat import (
    Example,
    load_examples,
    read_examples,
    render,
    render_all,
    to_example,
)
from xpar_zoo.train.packing import (
    ConversationCorpus,
    EpochLimit,
    best_fit,
    steps_for_epochs,
)
from xpar_zoo.train.reporting import step_line
from xpar_zoo.train.tiny import tiny_tokenizer

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_chat.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def shipped():
    kind, examples = load_examples(SHIPPED)
    assert kind == "messages" and len(examples) == 160
    return examples


def _visible(tokenizer, ids, mask):
    return "".join(tokenizer.decode([int(t)]) if m else "_" for t, m in zip(ids, mask))


def test_generation_markers_and_prefix_renders_give_transformers_assistant_tokens(tokenizer, shipped):
    """On the shipped conversations (system prompts, two turns, tool calls and tool results): the marker path,
    the prefix path and the same template without markers all mark exactly transformers' assistant tokens."""
    import copy

    stripped = copy.copy(tokenizer)
    stripped.chat_template = tokenizer.chat_template.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", "")
    kinds = set()
    for ex in shipped:
        hf = tokenizer.apply_chat_template(ex.messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        want = np.asarray(hf["assistant_masks"], dtype=bool)
        for tok, markers in ((tokenizer, True), (tokenizer, False), (stripped, None)):
            ids, mask = render(tok, ex, "assistant", markers=markers)
            assert ids.tolist() == list(hf["input_ids"])
            assert np.array_equal(mask, want), (markers, _visible(tokenizer, ids, mask), _visible(tokenizer, ids, want))
        kinds.add(tuple(m["role"] for m in ex.messages))
    assert ("user", "assistant", "tool", "assistant") in kinds and ("system", "user", "assistant") in kinds


def test_loss_on_completion_and_all(tokenizer, shipped):
    ex = next(e for e in shipped if len(e.messages) == 4 and e.messages[2]["role"] == "user")  # two turns
    ids, every = render(tokenizer, ex, "assistant")
    _, last = render(tokenizer, ex, "completion")
    _, everything = render(tokenizer, ex, "all")
    text = _visible(tokenizer, ids, last)
    assert text.strip("_") == ex.messages[3]["content"] + "<|im_end|>"
    assert last.sum() < every.sum() and (last <= every).all()
    assert not everything[0] and everything[1:].all()


def test_prompt_completion_records(tokenizer):
    text = to_example("f:1", {"prompt": "2+2=", "completion": "4"})
    ids, mask = render(tokenizer, text, "completion")
    assert _visible(tokenizer, ids, mask) == "____4<|im_end|>"  # EOS closes the completion
    chat = to_example("f:2", {"prompt": [{"role": "user", "content": "Hi"}],
                              "completion": [{"role": "assistant", "content": "Hello"}]})
    ids, mask = render(tokenizer, chat, "completion")
    assert _visible(tokenizer, ids, mask).strip("_") == "Hello<|im_end|>"
    kind, examples = read_examples([("f:1", {"prompt": "a", "completion": "b"})])
    assert kind == "prompt_completion" and examples[0].completion == "b"


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "f:7: the conversation has no assistant turn (roles: user)"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "f:7: messages[0] has role 'bot'; roles: system, user"),
    ({"messages": []}, "f:7: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": ["part"]}, {"role": "assistant", "content": "x"}]},
     "f:7: messages[0].content[0] is not a part of type text, image, video"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "f:7: messages[0] (user) has content of type int"),
    ({"prompt": "a", "completion": ""}, "f:7: the completion is empty"),
    ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "must both be text or both be lists"),
])
def test_bad_records_are_named(record, message):
    with pytest.raises(DataError) as e:
        read_examples([("f:7", record)])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mixed_formats_are_refused():
    with pytest.raises(DataError, match="f:2: a prompt_completion record among messages records"):
        read_examples([("f:1", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
                       ("f:2", {"prompt": "q", "completion": "a"})])


def test_a_template_that_rewrites_past_turns_needs_markers(tokenizer):
    import copy

    drops = copy.copy(tokenizer)  # renders a past assistant turn without its content (as reasoning templates do)
    drops.chat_template = ("{%- for m in messages -%}{{- '<|im_start|>' ~ m.role ~ '\\n' -}}"
                           "{%- if m.role != 'assistant' or loop.last -%}{{- m.content -}}{%- endif -%}"
                           "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
                           "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    ex = Example("f:3", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                  {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
                 completion_from=3)
    with pytest.raises(DataError, match="f:3: the chat template renders turn 1 differently once later turns follow"):
        render(drops, ex, "assistant")
    ids, mask = render(drops, ex, "completion", markers=False)  # the last turn alone renders turn by turn
    assert _visible(tokenizer, ids, mask).strip("_") == "d<|im_end|>"


def test_over_long_conversations_are_refused_or_truncated_and_counted(tokenizer, shipped):
    examples = shipped[:20]
    lengths = [len(render(tokenizer, ex, "assistant")[0]) for ex in examples]
    seq = sorted(lengths)[10]
    long = sum(n > seq for n in lengths)
    with pytest.raises(DataError, match=rf"data: {long} conversations? longer than seq_len {seq} \(first: "
                                        r".*tiny_chat.jsonl:\d+ \(\d+ tokens\)"):
        render_all(tokenizer, examples, "messages", "assistant", seq, None, "data")
    for how in ("left", "right", "drop"):
        ids, masks, stats = render_all(tokenizer, examples, "messages", "assistant", seq, how, "data")
        assert stats.too_long == long and all(len(x) <= seq for x in ids)
        assert stats.targets == sum(int(m.sum()) for m in masks)
        assert len(ids) == 20 - (long if how == "drop" else stats.dropped)
        assert f"{long} longer than seq_len {seq}" in stats.describe(seq, how)
        if how == "left":  # the end of each conversation kept: its last assistant turn is a target
            assert all(m[-2] for m, n in zip(masks, [n for n in lengths]) if n > seq)
        if how != "drop":
            assert stats.targets_cut > 0 and stats.truncated == long


def test_best_fit_keeps_conversations_whole_and_fills_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 60, size=200)
    bins = best_fit(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))  # every conversation exactly once
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= int(np.ceil(lengths.sum() / 64)) * 1.1  # within 10% of the lower bound
    assert best_fit(lengths, 64) == bins
    with pytest.raises(DataError, match="does not fit a row of 64"):
        best_fit([65], 64)


def test_packed_rows_restart_positions_per_conversation_and_pad_without_targets():
    ids = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 27)]
    masks = [np.array([0, 1, 1, 0, 1], bool), np.array([0, 1, 1], bool), np.array([0, 0, 1, 1, 1, 1, 1], bool)]
    corpus = ConversationCorpus(ids, masks, seq_len=8, seed=0, pad_id=99)
    assert corpus.rows_per_epoch == 2 and corpus.num_targets == 10
    rows = corpus.rows(0, 2)
    for row_ids, pos, labels in zip(rows["input_ids"], rows["position_ids"], rows["labels"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [8]
        for a, b in zip(starts, starts[1:]):
            segment = row_ids[a:b].tolist()
            if segment[0] == 99:
                assert (labels[a:b] == IGNORE_INDEX).all() and set(segment) == {99}
                continue
            (k,) = [k for k, x in enumerate(ids) if x.tolist() == segment]  # a whole conversation
            assert labels[a:b].tolist() == [t if m else IGNORE_INDEX for t, m in zip(segment, masks[k])]
    assert int((corpus.rows(0, 2)["labels"] != IGNORE_INDEX).sum()) == 10
    later = corpus.rows(2, 2)["input_ids"]  # epoch 1: the same rows, reshuffled
    assert sorted(map(tuple, later.tolist())) == sorted(map(tuple, rows["input_ids"].tolist()))
    limited = EpochLimit(corpus, 1, pad_id=99)
    beyond = limited.rows(1, 3)
    assert torch.equal(beyond["input_ids"][0], rows["input_ids"][1])
    assert (beyond["labels"][1:] == IGNORE_INDEX).all() and (beyond["input_ids"][1:] == 99).all()
    assert steps_for_epochs(3, 29, 8) == 11 and steps_for_epochs(1, 8, 8) == 1


# ---- the command line ---------------------------------------------------------------------------------------------
BASE = ["train", "--model", "m", "--data", str(SHIPPED), "--output", "o"]


@pytest.mark.parametrize("argv, message", [
    (BASE + ["--steps", "3", "--epochs", "2"], "give --steps (3) or --epochs (2), not both"),
    (BASE, "missing setting(s): --steps (or --epochs)"),
    (BASE + ["--epochs", "0"], "epochs must be at least 1"),
    (BASE + ["--steps", "3", "--lora-alpha", "16"], "--lora-alpha set(s) up a new LoRA adapter: give --lora-rank"),
    (BASE + ["--steps", "3", "--lora-rank", "8", "--adapter", "a"], "give --lora-rank (a new adapter) or --adapter"),
    (BASE + ["--steps", "3", "--adapter", "nowhere"], "--adapter nowhere: no adapter_config.json there"),
    (BASE + ["--steps", "3", "--export-adapter", "x"], "--export-adapter writes a LoRA adapter"),
    (BASE + ["--steps", "3", "--lora-rank", "4", "--lora-dropout", "1.5"], "lora_dropout must be in [0, 1)"),
    (BASE + ["--steps", "3", "--lora-vision"], "--lora-vision set(s) up a new LoRA adapter: give --lora-rank"),
    (BASE + ["--steps", "3", "--lora-rank", "4", "--lora-vision", "--freeze-vision"],
     "--lora-vision adapts the vision tower, --freeze-vision keeps it frozen: give one"),
    (BASE + ["--steps", "3", "--eval-every", "5"], "--eval-every evaluate(s) held-out data: give --eval-data"),
    (BASE + ["--steps", "3", "--eval-data", "missing.jsonl"], "--eval-data missing.jsonl: no such file"),
    (BASE + ["--steps", "3", "--report-to", "mlflow"], "report_to: mlflow unknown"),
    (BASE + ["--steps", "3", "--report-to", "tensorboard", "--no-tensorboard"], "disagree"),
    (BASE + ["--steps", "3", "--loss-on", "prompt"], "argument --loss-on: invalid choice"),
])
def test_bad_fine_tuning_settings_are_one_line_errors(argv, message, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors (choices)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("xpar-zoo: error: ") and message in err and err.count("\n") in (1, 2), err


def test_report_to_wandb_without_wandb_says_how_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert cli.main(BASE + ["--steps", "3", "--report-to", "wandb"]) == 2
    assert "--report-to wandb: wandb is not installed (pip install 'xpar_zoo[wandb]')" in capsys.readouterr().err


@pytest.mark.parametrize("world", ["WORLD_SIZE", "--nproc-per-node"])
def test_dry_run_prints_settings_mesh_counts_and_memory_without_loading_weights(tmp_path, capsys, monkeypatch,
                                                                                world):
    out = tmp_path / "never"
    argv = ["train", "--model", "tiny-qwen3-moe", "--data", str(SHIPPED), "--output", str(out), "--epochs", "3",
            "--seq-len", "512", "--micro-batch", "2", "--mesh", "ep=2", "--lora-rank", "8", "--dry-run"]
    if world == "WORLD_SIZE":  # under torchrun
        monkeypatch.setenv("WORLD_SIZE", "4")
    else:  # the ranks xpar-zoo train would start itself
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        argv += ["--nproc-per-node", "4"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "mesh: ep=2 over 4 ranks" in text
    assert "13975 tokens, 5071 target tokens, 29 rows of 512 per epoch; 8 rows per step; 11 steps (3 epochs)" in text
    assert "memory per rank:" in text and "adapters (fp32 shards)" in text and '  lora_rank: 8' in text
    assert not out.exists()


def test_step_line_has_a_progress_bar_and_an_eta():
    record = {"step": 5, "loss": 2.5, "lr": 1e-4, "tokens_per_s": 5100.0, "step_time_s": 0.5, "eval_loss": 2.25}
    line = step_line(record, total=20, elapsed_s=10.0, steps_done=5)
    assert line == ("step  5/20 [#####---------------]  25% loss 2.5000 lr 1.00e-04 5.1k tok/s 0.50 s/step "
                    "eval_loss 2.2500 ETA 0:00:30")


def test_report_to_wandb_logs_train_and_eval_offline(tmp_path, monkeypatch):
    """`--report-to wandb` under WANDB_MODE=offline: the run is written locally, train/ and eval/ keys logged."""
    from xpar_zoo.train.config import TrainConfig
    from xpar_zoo.train.reporting import Reporter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrainConfig(model="m", data="d", output=str(tmp_path), steps=2)
    report = Reporter(cfg, tmp_path, active=True, start_step=0, total_steps=2, wandb=True)
    report.write({"step": 1, "loss": 2.0, "lr": 1e-3, "eval_loss": 1.5, "expert_load": [{"layer": 0}]})
    report.write({"step": 2, "loss": 1.0, "lr": 1e-3})
    report.close()
    (run,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = run.read_bytes()  # wandb's record log: the keys as text
    assert b"train/loss" in data and b"eval/loss" in data and b"expert_load" not in data


def test_eval_loss_is_the_token_weighted_mean_and_eval_batches_takes_the_first_k(tokenizer, shipped):
    """One process, a plain transformers model: eval_loss over every held-out row is the mean over all their
    targets (not the mean of per-batch means); --eval-batches K takes the first K batches of rows."""
    from transformers import AutoModelForCausalLM

    from xpar_zoo.train.evaluate import Evaluator
    from xpar_zoo.train.tiny import tiny_config

    ids, masks, _ = render_all(tokenizer, shipped[:40], "messages", "assistant", 256, None, "data")
    corpus = ConversationCorpus(ids, masks, seq_len=256, seed=0, pad_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tokenizer)), dtype=torch.float32).train()
    rows = corpus.rows(0, corpus.rows_per_epoch)
    with torch.no_grad():
        want = model(**rows, use_cache=False).loss.item()
        first = model(**corpus.rows(0, 2), use_cache=False).loss.item()
    common = dict(world=1, rank=0, micro_batch=2, flatten=False, device=torch.device("cpu"), pad_id=0)
    got = Evaluator(corpus, max_batches=None, **common)(model)
    assert corpus.rows_per_epoch % 2 == 1  # the last batch holds a padding row
    assert abs(got["eval_loss"] - want) < 1e-5 and got["eval_targets"] == corpus.num_targets
    assert abs(Evaluator(corpus, max_batches=1, **common)(model)["eval_loss"] - first) < 1e-5
    assert model.training  # back in training mode


def test_lora_vision_adds_every_linear_of_the_vision_tower_and_projector():
    from xpar_zoo.testing import parity
    from xpar_zoo.train.config import TrainConfig
    from xpar_zoo.train.lora import lora_modules

    config = parity.tiny_config("qwen3_vl_moe")
    text = TrainConfig(model="m", data="d", output="o", lora_rank=4)
    assert lora_modules(text, config) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    both = lora_modules(TrainConfig(model="m", data="d", output="o", lora_rank=4, lora_vision=True), config)
    assert both[:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert {"model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc2"} <= set(both[4:])
    assert all(".visual." in name for name in both[4:])
    with pytest.raises(TrainConfigError, match="--lora-vision: qwen3_moe has no vision tower"):
        lora_modules(TrainConfig(model="m", data="d", output="o", lora_rank=4, lora_vision=True),
                     parity.tiny_config("qwen3_moe"))
