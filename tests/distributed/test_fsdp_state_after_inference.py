"""After a forward no backward follows — `torch.no_grad()` in eval mode, and `generate` — every FSDP unit is
sharded again: `model.parameters()` yields the managed DTensor shards, so an optimizer built afterwards holds only
them, every parameter it holds trains, and the step's loss is the one without the evaluation first. Proved under EP
(ep=2), LoRA on attention and experts (ep=2) and the vocab plans (emb=2, head=2), on 2 ranks, in one launched run."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import xpar_zoo
from xpar_zoo.parallelize import unmanaged_parameters
from xpar_zoo.testing import launch, parity

WORLD = 2
CASES = {"ep": ({"ep": 2}, False), "lora": ({"ep": 2}, True), "vocab": ({"emb": 2, "head": 2}, False)}


def _model(config, mesh_kwargs, lora):
    model = parity.build_model(config, seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=["q_proj", "v_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj"]))
    return xpar_zoo.parallelize(model, xpar_zoo.Mesh(**mesh_kwargs))


def _full(p) -> torch.Tensor:
    return p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def _global_mean(loss) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _job() -> dict:
    rank = dist.get_rank()
    config = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(config.vocab_size, 2, WORLD, seed=3)
    labels = parity.make_labels(data)
    results = {}
    for name, (mesh_kwargs, lora) in CASES.items():
        for evaluated in (False, True):
            model = _model(config, mesh_kwargs, lora)
            row = {}
            if evaluated:
                model.eval()
                with torch.no_grad():
                    model(input_ids=data[1, rank])
                row["after_no_grad"] = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
                out = model.generate(input_ids=data[1, rank][:, :4], max_new_tokens=3, do_sample=False)
                row["generated"] = tuple(out.shape)
                row["after_generate"] = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
                model.train()
            params = dict(model.named_parameters())
            trainable = [n for n, p in params.items() if p.requires_grad]
            row["plain"] = [n for n in trainable if not isinstance(params[n], DTensor)]
            row["unmanaged"] = unmanaged_parameters(model)
            opt = torch.optim.SGD([params[n] for n in trainable], lr=0.5)
            before = {n: _full(params[n]) for n in trainable}
            loss = model(input_ids=data[0, rank], labels=labels[0, rank]).loss
            loss.backward()
            opt.step()
            row["loss"] = _global_mean(loss)
            row["trained"] = len(trainable)
            row["unchanged"] = [n for n in trainable if torch.equal(before[n], _full(params[n]))]
            results[(name, evaluated)] = row
    return results


@pytest.fixture(scope="module")
def runs():
    return launch.run(_job, WORLD, timeout_s=900)


@pytest.mark.parametrize("case", list(CASES))
def test_no_grad_eval_forward_leaves_every_parameter_a_managed_shard(runs, case):
    row = runs[(case, True)]
    assert row["after_no_grad"] == [], row["after_no_grad"]


@pytest.mark.parametrize("case", list(CASES))
def test_generate_leaves_every_parameter_a_managed_shard(runs, case):
    row = runs[(case, True)]
    assert row["generated"][1] == 7 and row["after_generate"] == [], row["after_generate"]


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_built_after_an_evaluation_holds_only_managed_shards(runs, case):
    row = runs[(case, True)]
    assert row["plain"] == [] and row["unmanaged"] == []


@pytest.mark.parametrize("case", list(CASES))
def test_every_parameter_trains_after_an_evaluation(runs, case):
    row = runs[(case, True)]
    assert row["trained"] > 0 and row["unchanged"] == [], row["unchanged"]
    assert row["trained"] == runs[(case, False)]["trained"]


@pytest.mark.parametrize("case", list(CASES))
def test_loss_after_an_evaluation_equals_the_loss_without(runs, case):
    assert runs[(case, True)]["loss"] == runs[(case, False)]["loss"]
