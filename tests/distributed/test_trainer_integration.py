"""transformers' Trainer, TRL's SFTTrainer and accelerate on xpar_zoo models (issue 21): on 4 ranks with ep=2 and
gradient accumulation 2, per-step losses, gradient norms and the trained weights equal single-process
transformers' (the router auxiliary loss training too); a run resumed from its step-2 checkpoint ends bit-identical
to the straight run; ``save_model()`` writes what plain transformers loads; ``accelerator.prepare`` hands the model
back unwrapped and a plain accelerate loop trains exactly; ``accelerate launch`` runs the example script.

One spawned single-process job holds the references, one 4-rank job every parallel run (module fixtures), one
``accelerate launch`` the example."""

from pathlib import Path

import pytest
import torch

from xpar_zoo.errors import IntegrationError
from xpar_zoo.integrations.accelerate import check_accelerator
from xpar_zoo.testing import launch, parity

WORLD = 4
MESH = {"ep": 2}
ROWS, SEQ, ACCUM = 32, 16, 2
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # the router auxiliary loss trains too
CHARS = "abcdefghijklmnopqrstuvwxyz .,"
TEXT = "the cat sat on the mat, a dog ran to the park. "



def _config(**overrides):
    return parity.tiny_config("qwen3_moe", **{**AUX, **overrides})


def _rows(vocab_size: int) -> list[dict]:
    """Token rows whose labels ignore a random prefix: every rank's micro-batch has its own number of targets."""
    ids = parity.make_batches(vocab_size, 1, ROWS, batch=1, seq=SEQ, seed=3).reshape(ROWS, SEQ)
    labels = parity.make_labels(ids.reshape(1, ROWS, 1, SEQ), seed=5).reshape(ROWS, SEQ)
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]


def _tokenizer():
    """A character-level fast tokenizer with EOS and padding (built here: nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")


def _texts() -> list[str]:
    """16 documents of 5 to 35 characters: padded in a batch, a different number of targets on every rank."""
    return [(TEXT * 2)[i:i + 5 + (7 * i) % 31] for i in range(16)]


def _args(out, world, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), per_device_train_batch_size=WORLD // world, gradient_accumulation_steps=ACCUM,
                per_device_eval_batch_size=2 * WORLD // world,
                max_steps=4, learning_rate=1e-2, weight_decay=0.1, logging_steps=1, save_steps=2,
                report_to="none", disable_tqdm=True, use_cpu=True, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def _sft_args(out, world):
    from trl import SFTConfig

    return SFTConfig(output_dir=str(out), per_device_train_batch_size=WORLD // world,
                     gradient_accumulation_steps=ACCUM, max_steps=2, learning_rate=1e-2, logging_steps=1,
                     save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0, max_length=64,
                     bf16=False)


def _lora_model(build):
    """A PEFT LoRA model on attention and the fused experts around ``build()`` (the adapters drawn from seed 7)."""
    from peft import LoraConfig, get_peft_model

    model = build()
    torch.manual_seed(7)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj"],
                                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))


def _log(trainer) -> list[dict]:
    return [{k: h[k] for k in ("step", "loss", "grad_norm", "aux_loss", "mean_token_accuracy") if k in h}
            for h in trainer.state.log_history if "loss" in h]


def _loop(model, batches, clip) -> list[float]:
    """A plain training loop with the global-token loss: per step, the valid targets of all its micro-batches (and
    ranks) are counted first; returns the step losses (mean over ranks)."""
    import torch.distributed as dist

    from xpar_zoo.loss.global_batch import count_targets, global_count

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in batches:
        n = global_count(sum(count_targets(b["labels"]) for b in step))
        total = torch.zeros(())
        for b in step:
            loss = model(**b, num_items_in_batch=n).loss
            loss.backward()
            total += loss.detach()
        clip(model, 1.0)
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses


def _references(out) -> dict:
    """One process: transformers' Trainer, TRL's SFTTrainer and a plain loop on the whole batch."""
    from datasets import Dataset
    from transformers import Trainer
    from trl import SFTTrainer

    config = _config()
    trainer = Trainer(model=parity.build_model(config, experts_implementation="eager"),
                      args=_args(out / "trainer", 1, save_strategy="no"), train_dataset=_rows(config.vocab_size))
    trainer.train()
    eval_loss = trainer.evaluate(eval_dataset=_rows(config.vocab_size)[:2 * WORLD])["eval_loss"]
    bf16 = Trainer(model=parity.build_model(config, experts_implementation="eager"),
                   args=_args(out / "bf16", 1, save_strategy="no", max_steps=1, bf16=True),
                   train_dataset=_rows(config.vocab_size))
    bf16.train()
    sft = SFTTrainer(model=parity.build_model(_config(), experts_implementation="eager"), args=_sft_args(out / "sft", 1),
                     train_dataset=Dataset.from_dict({"text": _texts()}), processing_class=_tokenizer())
    sft.train()
    plain = _config(output_router_logits=False)
    model = parity.build_model(plain, experts_implementation="eager")
    rows = _rows(plain.vocab_size)[:2 * ACCUM * WORLD]
    batches = [[{k: torch.stack([r[k] for r in rows[(s * ACCUM + m) * WORLD:(s * ACCUM + m + 1) * WORLD]])
                 for k in rows[0]} for m in range(ACCUM)] for s in range(2)]
    loop = _loop(model, batches, lambda m, c: torch.nn.utils.clip_grad_norm_(m.parameters(), c))
    from peft.utils import get_peft_model_state_dict

    lora = _lora_model(lambda: parity.build_model(plain, experts_implementation="eager"))
    lora_init = {k: v.clone() for k, v in get_peft_model_state_dict(lora).items()}
    lora_trainer = Trainer(model=lora, args=_args(out / "lora", 1, save_strategy="no", max_steps=2),
                           train_dataset=_rows(plain.vocab_size))
    lora_trainer.train()
    return {"trainer": _log(trainer), "trainer_state": dict(trainer.model.state_dict()), "eval_loss": eval_loss,
            "lora": _log(lora_trainer), "lora_init": lora_init,
            "lora_adapter": {k: v.clone() for k, v in get_peft_model_state_dict(lora).items()},
            "bf16": _log(bf16),
            "sft": _log(sft), "sft_state": dict(sft.model.state_dict()),
            "loop": loop, "loop_state": dict(model.state_dict())}


def _parallel(out) -> dict:
    """Every rank: a plain accelerate loop, XparTrainer straight and resumed, SFTTrainer through the mixin, and the
    errors; rank 0 returns what the tests check."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import default_data_collator
    from trl import SFTTrainer

    import xpar_zoo
    from xpar_zoo.integrations.trainer import XparTrainer, XparTrainerMixin

    result = {}

    def parallel_model(config):
        return xpar_zoo.parallelize(parity.build_model(config), xpar_zoo.Mesh(**MESH))

    # accelerate: prepare hands the model back unwrapped; the optimizer and the data loader as usual
    accelerator = Accelerator(cpu=True)
    plain = _config(output_router_logits=False)
    model = parallel_model(plain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_rows(plain.vocab_size), batch_size=1, collate_fn=default_data_collator)
    prepared, _, loader = accelerator.prepare(model, opt, loader)
    check_accelerator(accelerator)
    batches = iter(loader)
    steps = [[next(batches) for _ in range(ACCUM)] for _ in range(2)]
    result["loop"] = {"unwrapped": prepared is model, "losses": _loop(prepared, steps, xpar_zoo.clip_grad_norm_),
                      "state": xpar_zoo.full_state_dict(model)}

    config = _config()
    trainer = XparTrainer(model=parallel_model(config), args=_args(out, WORLD),
                          train_dataset=_rows(config.vocab_size))
    trainer.train()
    result["trainer"] = {"log": _log(trainer), "state": xpar_zoo.full_state_dict(trainer.model),
                         "checkpoint": sorted(p.name for p in (out / "checkpoint-2").iterdir()),
                         "eval_loss": trainer.evaluate(eval_dataset=_rows(config.vocab_size)[:2 * WORLD])["eval_loss"]}
    trainer.save_model(str(out / "saved"))

    resumed = XparTrainer(model=parallel_model(config), args=_args(out, WORLD),
                          train_dataset=_rows(config.vocab_size))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    result["resumed"] = {"log": _log(resumed), "state": xpar_zoo.full_state_dict(resumed.model)}

    # load_best_model_at_end: "best" is the highest eval loss here, so an earlier checkpoint than the last is loaded
    best = XparTrainer(model=parallel_model(config), train_dataset=_rows(config.vocab_size),
                       eval_dataset=_rows(config.vocab_size)[:2 * WORLD],
                       args=_args(out / "best", WORLD, max_steps=2, save_steps=1, eval_strategy="steps", eval_steps=1,
                                  load_best_model_at_end=True, metric_for_best_model="eval_loss",
                                  greater_is_better=True))
    best.train()
    result["best"] = {"checkpoint": Path(best.state.best_model_checkpoint).name, "metric": best.state.best_metric,
                      "eval_loss": best.evaluate()["eval_loss"]}

    bf16 = XparTrainer(model=parallel_model(config), args=_args(out / "bf16", WORLD, save_strategy="no", max_steps=1,
                                                                bf16=True), train_dataset=_rows(config.vocab_size))
    bf16.train()
    result["bf16"] = _log(bf16)

    # a PEFT model: only the adapters train; save_model() writes PEFT's adapter files
    lora_model = xpar_zoo.parallelize(_lora_model(lambda: parity.build_model(plain)), xpar_zoo.Mesh(**MESH))
    lora = XparTrainer(model=lora_model, args=_args(out / "lora", WORLD, save_strategy="no", max_steps=2),
                       train_dataset=_rows(plain.vocab_size))
    lora.train()
    lora.save_model(str(out / "lora_saved"))
    result["lora"] = _log(lora)

    class XparSFTTrainer(XparTrainerMixin, SFTTrainer):
        pass

    sft = XparSFTTrainer(model=parallel_model(_config()), args=_sft_args(out / "sft", WORLD),
                         train_dataset=Dataset.from_dict({"text": _texts()}), processing_class=_tokenizer())
    sft.train()
    result["sft"] = {"log": _log(sft), "state": xpar_zoo.full_state_dict(sft.model)}

    errors = {}
    try:  # a directory without xpar_zoo's checkpoint (the hub-format save) cannot resume
        XparTrainer(model=parallel_model(config), args=_args(out / "again", WORLD),
                    train_dataset=_rows(config.vocab_size)).train(resume_from_checkpoint=str(out / "saved"))
    except IntegrationError as e:
        errors["resume"] = str(e)
    try:  # on CPU without use_cpu, accelerate would train every rank alone
        XparTrainer(model=parallel_model(config), args=_args(out / "alone", WORLD, use_cpu=False))
    except IntegrationError as e:
        errors["alone"] = str(e)
    result["errors"] = errors
    return result if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("trainer")
    return {"ref": launch.run(_references, 1, base / "ref"), "par": launch.run(_parallel, WORLD, base / "par"),
            "out": base / "par"}


def _assert_same_training(par_log, ref_log, par_state, ref_state, before, what):
    assert [h["step"] for h in par_log] == [h["step"] for h in ref_log], what
    parity.assert_losses_match([h["loss"] for h in par_log], [h["loss"] for h in ref_log], what)
    for p, r in zip(par_log, ref_log):
        assert p["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), what
    errors = parity.param_errors(par_state, ref_state, before)
    worst = max(errors, key=errors.get)
    assert errors[worst] < parity.PARAM_REL_TOL, (what, worst, errors[worst])


def test_trainer_on_ep2_with_accumulation_equals_single_process_trainer(runs):
    """XparTrainer, 4 ranks, ep=2, accumulation 2, AdamW, clipping, router aux loss: the logged loss and gradient
    norm of every step and the trained weights are single-process Trainer's on the whole batch."""
    par, ref = runs["par"]["trainer"], runs["ref"]
    assert len(par["log"]) == 4
    _assert_same_training(par["log"], ref["trainer"], par["state"], ref["trainer_state"],
                          parity.build_model(_config()).state_dict(), "XparTrainer vs Trainer")


def test_evaluate_gives_the_global_mean_loss(runs):
    """evaluate() on 4 ranks: the mean over every rank's valid targets, as single-process Trainer computes it."""
    assert runs["par"]["trainer"]["eval_loss"] == pytest.approx(runs["ref"]["eval_loss"], abs=parity.LOSS_TOL)


def test_load_best_model_at_end_loads_that_checkpoint(runs):
    """load_best_model_at_end: the model is loaded from the best checkpoint's xpar_zoo checkpoint (an earlier one
    than the last), so evaluating it again gives exactly the best metric."""
    best = runs["par"]["best"]
    assert best["checkpoint"] == "checkpoint-1"
    assert best["eval_loss"] == best["metric"]


def test_bf16_autocasts_as_the_trainer_does(runs):
    """TrainingArguments(bf16=True): accelerate's autocast around the forward (prepare leaves an xpar_zoo model's
    forward alone, so the mixin enters it); one step's loss and gradient norm are single-process bf16 Trainer's to
    bf16 precision, and differ from the fp32 step's."""
    par, ref, fp32 = runs["par"]["bf16"][0], runs["ref"]["bf16"][0], runs["par"]["trainer"]["log"][0]
    assert par["loss"] == pytest.approx(ref["loss"], abs=1e-3)
    assert par["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2)
    assert par["loss"] != fp32["loss"]


def test_resume_from_a_checkpoint_is_bit_identical(runs):
    """Resumed from checkpoint-2 (its xpar_zoo DCP checkpoint beside the Trainer's files), steps 3 and 4 log the
    straight run's exact losses and the weights end bit-identical."""
    straight, resumed = runs["par"]["trainer"], runs["par"]["resumed"]
    assert {"xpar_checkpoint", "trainer_state.json", "scheduler.pt", "model.safetensors",  # one shard: no index
            "config.json"} <= set(straight["checkpoint"])
    assert [(h["step"], h["loss"], h["grad_norm"]) for h in resumed["log"][2:]] == \
        [(h["step"], h["loss"], h["grad_norm"]) for h in straight["log"][2:]]
    assert straight["state"].keys() == resumed["state"].keys()
    for name, value in straight["state"].items():
        assert torch.equal(value, resumed["state"][name]), name


def test_save_model_loads_in_plain_transformers(runs):
    """save_model() (every rank) writes the hub's format: plain transformers loads the trained weights exactly."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(runs["out"] / "saved", dtype=torch.float32).state_dict()
    trained = runs["par"]["trainer"]["state"]
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    assert (runs["out"] / "saved" / "training_args.bin").is_file()


def test_trainer_on_a_peft_model_trains_the_adapters_and_saves_them_for_peft(runs):
    """XparTrainer on a LoRA model (attention and fused experts, ep=2, accumulation 2): the logged losses and norms
    are single-process PEFT Trainer's, and save_model() writes PEFT's adapter files holding its trained adapters."""
    from peft import PeftModel
    from safetensors.torch import load_file

    par, ref = runs["par"]["lora"], runs["ref"]
    assert [h["step"] for h in par] == [h["step"] for h in ref["lora"]] == [1, 2]
    parity.assert_losses_match([h["loss"] for h in par], [h["loss"] for h in ref["lora"]], "LoRA Trainer")
    for p, r in zip(par, ref["lora"]):
        assert p["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    saved = runs["out"] / "lora_saved"
    assert (saved / "adapter_config.json").is_file() and not list(saved.glob("model*.safetensors"))
    adapter = load_file(saved / "adapter_model.safetensors")
    assert adapter.keys() == ref["lora_adapter"].keys()
    errors = parity.param_errors(adapter, ref["lora_adapter"], ref["lora_init"])
    worst = max(errors, key=errors.get)
    assert errors[worst] < parity.PARAM_REL_TOL, (worst, errors[worst])
    plain = PeftModel.from_pretrained(parity.build_model(_config(output_router_logits=False)), saved)
    assert any("lora_A" in n for n, _ in plain.named_parameters())


def test_trl_sft_trainer_through_the_mixin_equals_single_process(runs):
    """class SFT(XparTrainerMixin, SFTTrainer): TRL's loss from per-token log-probabilities (its fused head answered
    through the model's own head), token accuracy and the router auxiliary loss TRL turns on for MoE models equal
    single-process SFTTrainer's, and so do the weights after two steps."""
    par, ref = runs["par"]["sft"], runs["ref"]
    assert len(par["log"]) == 2 and all("aux_loss" in h and "mean_token_accuracy" in h for h in par["log"])
    _assert_same_training(par["log"], ref["sft"], par["state"], ref["sft_state"],
                          parity.build_model(_config()).state_dict(), "SFT mixin vs SFTTrainer")
    for p, r in zip(par["log"], ref["sft"]):
        assert p["aux_loss"] == pytest.approx(r["aux_loss"], rel=1e-5)
        assert p["mean_token_accuracy"] == pytest.approx(r["mean_token_accuracy"], abs=1e-6)


def test_accelerate_prepare_returns_the_model_and_a_plain_loop_trains_exactly(runs):
    """accelerator.prepare(model, optimizer, dataloader): no DDP wrap; each rank its own micro-batch; two steps with
    the global-token loss, accumulation 2 and xpar_zoo's clip equal single-process training on the whole batch."""
    par, ref = runs["par"]["loop"], runs["ref"]
    assert par["unwrapped"]
    parity.assert_losses_match(par["losses"], ref["loop"], "accelerate loop")
    errors = parity.param_errors(par["state"], ref["loop_state"],
                                 parity.build_model(_config(output_router_logits=False)).state_dict())
    assert max(errors.values()) < parity.PARAM_REL_TOL


def test_errors_name_what_to_do(runs):
    errors = runs["par"]["errors"]
    assert "holds no complete xpar_zoo checkpoint" in errors["resume"] and "saved" in errors["resume"]
    assert "accelerate sees 1 process(es) but torch.distributed has 4" in errors["alone"]
    assert "use_cpu=True" in errors["alone"]
