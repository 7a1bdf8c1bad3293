"""XparTrainer on image–text records (xpar_zoo.train.multimodal.MediaCollator: the model's processor renders each
record, images relative to the data folder): on 4 ranks with ep=2, a global batch whose records hold one image, two
or none (two ranks without an image), the step's loss equals single-process transformers' on the same collated
global batch (AdamW, clipped at 1), and so does every updated weight."""

import json
from pathlib import Path

import pytest
import torch

from xpar_zoo.testing import launch, parity

pytest.importorskip("accelerate")

WORLD = 4
DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
LR = 1e-2


def _records() -> list[dict]:
    """4 records, one per rank: two images on rank 0, one on rank 2, none on ranks 1 and 3."""
    records = [json.loads(line) for line in (DATA / "tiny_vl.jsonl").read_text().splitlines()]
    count = [sum(isinstance(m["content"], list) and sum(p["type"] == "image" for p in m["content"])
                 for m in r["messages"]) for r in records]
    one, two, none = ([r for r, c in zip(records, count) if c == k] for k in (1, 2, 0))
    return [two[0], none[0], one[0], none[1]]


def _collator(model_dir):
    from transformers import AutoConfig

    from xpar_zoo.train.multimodal import MediaCollator, load_processor

    return MediaCollator(load_processor(str(model_dir), AutoConfig.from_pretrained(model_dir)), DATA)


def _reference(model_dir) -> tuple[list[float], dict]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, experts_implementation="eager").train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    collate, records, losses = _collator(model_dir), _records(), []
    loss = model(**collate(records)).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parallel(model_dir, out):
    import torch.distributed as dist
    from transformers import TrainingArguments

    import xpar_zoo
    from xpar_zoo.integrations.trainer import XparTrainer

    model = xpar_zoo.from_pretrained(str(model_dir), mesh=xpar_zoo.Mesh(ep=2), progress=False)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=1, max_steps=1, learning_rate=LR,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                             disable_tqdm=True, use_cpu=True, seed=0, remove_unused_columns=False,
                             train_sampling_strategy="sequential")
    trainer = XparTrainer(model=model, args=args, train_dataset=_records(), data_collator=_collator(model_dir))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    state = xpar_zoo.full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    ref_losses, ref_state = _reference(model_dir)
    before = xpar_zoo_before(model_dir)
    return {"losses": (losses, ref_losses), "errors": parity.param_errors(state, ref_state, before)}


def xpar_zoo_before(model_dir) -> dict:
    from transformers import AutoModelForImageTextToText

    return dict(AutoModelForImageTextToText.from_pretrained(model_dir).state_dict())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from xpar_zoo.train.tiny_vl import save_tiny_vl_model

    base = tmp_path_factory.mktemp("vl_trainer")
    model_dir = save_tiny_vl_model(base / "model")
    return launch.run(_parallel, WORLD, model_dir, base / "out", timeout_s=600)


def test_xpar_trainer_on_image_text_records_equals_single_process(run):
    parity.assert_losses_match(*run["losses"], what="XparTrainer, tiny-qwen3-vl-moe on ep=2")
    parity.assert_params_match(run["errors"], what="XparTrainer, tiny-qwen3-vl-moe on ep=2:")


def test_the_records_leave_ranks_without_an_image():
    records = _records()
    has = [any(isinstance(m["content"], list) for m in r["messages"]) for r in records]
    assert has == [True, False, True, False]
