"""`examples/sft_qwen3_vl_moe.yaml` as a new user runs it: `xpar-zoo train --config … --nproc-per-node 4`
(tiny-qwen3-vl-moe built in code with its processor files, the shipped image–text conversations, half of them text
only, ep=2) — one 4-rank run and the same command on one process (the same rows per step: 4 micro-batches of one):

- every step's loss equals the one-process run's, with micro-batches that hold no image on some ranks;
- the export loads in plain transformers with the processor files beside it (the processor loads from it).
"""

import contextlib
import io
import os
from pathlib import Path

import pytest

from xpar_zoo.commands import cli
from xpar_zoo.testing import launch, parity
from xpar_zoo.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft_qwen3_vl_moe.yaml"
WORLD = 4


def _train(out: Path, *extra: str) -> tuple[int, str]:
    err = io.StringIO()
    os.chdir(ROOT)  # the example's data path is relative to the repository
    with contextlib.redirect_stderr(err):
        code = cli.main(["train", "--config", str(EXAMPLE), "--output", str(out), "--export-hf", str(out / "merged"),
                         "--no-progress", "--report-to", "none", *extra])
    return code, err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vl_example")
    parallel = launch.run(_train, WORLD, base / "ep2", timeout_s=600)
    alone = _train(base / "one", "--mesh", "none", "--grad-accum", str(WORLD))
    return {"ep2": (parallel, read_metrics(base / "ep2")), "one": (alone, read_metrics(base / "one")), "base": base}


def test_losses_on_ep2_equal_the_same_command_on_one_process(runs):
    (code, err), ep2 = runs["ep2"]
    assert code == 0, err[-3000:]
    (code, err), one = runs["one"]
    assert code == 0, err[-3000:]
    losses = [m["loss"] for m in ep2 if "loss" in m]
    assert len(losses) >= 6
    parity.assert_losses_match(losses, [m["loss"] for m in one if "loss" in m], what="tiny-qwen3-vl-moe ep=2")


def test_some_ranks_hold_no_image_in_some_steps(runs):
    import dataclasses

    from xpar_zoo.train.config import TrainConfig, read_config_file
    from xpar_zoo.train.data import micro_batches
    from xpar_zoo.train.inputs import load_corpus, read_model_config, text_vocab_size

    cfg = TrainConfig(**{**read_config_file(EXAMPLE), "output": str(runs["base"] / "ep2")})
    cfg = dataclasses.replace(cfg, model=str(runs["base"] / "ep2" / "tiny-qwen3-vl-moe"))
    config = read_model_config(cfg.model)
    corpus, _ = load_corpus(cfg, text_vocab_size(config), model_config=config)
    held = [["pixel_values" in micro_batches(corpus, s * WORLD, r, WORLD, 1, 1)[0] for r in range(WORLD)]
            for s in range(len([m for m in runs["ep2"][1] if "loss" in m]))]
    assert any(not all(step) and any(step) for step in held), held


def test_the_export_loads_in_transformers_with_the_processor_files(runs):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from xpar_zoo.train.multimodal import load_processor

    merged = runs["base"] / "ep2" / "merged"
    model = AutoModelForImageTextToText.from_pretrained(merged)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                 "chat_template.jinja", "tokenizer.json"):
        assert (merged / name).is_file(), name
    processor = load_processor(str(merged), AutoConfig.from_pretrained(merged))
    assert "<|image_pad|>" in processor.chat_template
