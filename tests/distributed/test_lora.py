"""PEFT LoRA under xpar_zoo (issue 21): ``from_pretrained(peft_config=…)`` on 4 gloo ranks trains LoRA on attention
and on the fused experts exactly like single-process PEFT (loss, clipped norm and every adapter after 3 AdamW steps)
on FSDP, ep2 and ep2+emb2+head2; expert adapters live with their experts (a rank holds its own experts' adapters),
the frozen base gets no gradient and is never reduce-scattered; ``save_adapter`` writes PEFT's own files that plain
PEFT loads in one process (and ``adapter=PATH`` loads back, trainable); a DCP checkpoint of a LoRA run reshards
(ep4 → ep2, optimizer state included) and exports merged hub weights; a bf16 base with fp32 adapters trains."""

import json

import pytest
import torch
import torch.distributed as dist

import xpar_zoo
from xpar_zoo import sizing
from xpar_zoo.testing import launch, parity
from xpar_zoo.testing.comm_bytes import count_sent_bytes

peft = pytest.importorskip("peft")  # an optional extra: requirements-test.txt installs it
from peft import PeftModel, get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

from xpar_zoo.hub.adapter_files import adapter_state

WORLD, STEPS, SEED, MAX_NORM = 4, 3, 123, 0.5
MESHES = {"fsdp": {}, "ep2": {"ep": 2}, "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2}}
from support.lora_setup import ATTENTION, EXPERTS, _config, lora_config  # noqa: E402


def _data():
    data = parity.make_batches(_config().vocab_size, STEPS + 1, WORLD, seed=2)  # the last step: evaluation only
    return data, parity.make_labels(data)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _global_mean(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A tiny qwen3_moe saved in the hub's own (per-expert) format."""
    directory = tmp_path_factory.mktemp("lora") / "base"
    parity.build_model(_config()).save_pretrained(directory)
    return str(directory)


# ---- single-process PEFT ------------------------------------------------------------------------------------------
def _plain(base: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=dtype, experts_implementation="eager")


def _batch(data, labels, step):
    return data[step].reshape(-1, data.shape[-1]), labels[step].reshape(-1, data.shape[-1])


@pytest.fixture(scope="module")
def reference(base):
    """Single-process PEFT on every rank's data at once: initial adapter, per-step losses and clipped norms, the
    adapter after each step, and the evaluation loss of the trained and of the base model."""
    torch.manual_seed(SEED)
    model = get_peft_model(_plain(base), lora_config()).train()
    data, labels = _data()
    opt = parity.adamw(_trainable(model))
    record = {"init": {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}, "losses": [], "norms": [],
              "adapters": []}
    for step in range(STEPS):
        ids, lab = _batch(data, labels, step)
        loss = model(input_ids=ids, labels=lab).loss
        loss.backward()
        record["norms"].append(torch.nn.utils.clip_grad_norm_(_trainable(model), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        record["losses"].append(loss.item())
        record["adapters"].append({k: v.clone() for k, v in get_peft_model_state_dict(model).items()})
    ids, lab = _batch(data, labels, STEPS)
    with torch.no_grad():
        record["eval"] = model(input_ids=ids, labels=lab).loss.item()
        with model.disable_adapter():
            record["eval_base"] = model(input_ids=ids, labels=lab).loss.item()
    return record


# ---- the 4-rank jobs -----------------------------------------------------------------------------------------------
def _expert_regions(model) -> dict[str, tuple[int, int]]:
    """``{expert adapter: [first, last+1) experts this rank holds}``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, p in model.named_parameters():
        if "experts" in name and "lora_" in name:
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out[name] = (offset[0], offset[0] + shape[0])
    return out


def _train(model, data, labels, steps, rank, measure=None):
    opt = parity.adamw(_trainable(model))
    losses, norms, frozen_grads = [], [], []
    for step in steps:
        with (count_sent_bytes({"all_gather": 0.0, "reduce_scatter": 0.0}) if step == steps[0] and measure is not None
              else _nothing()) as sent:
            loss = model(input_ids=data[step, rank], labels=labels[step, rank]).loss
            loss.backward()
        if sent is not None:
            measure.update(sent)
        frozen_grads += [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        norms.append(xpar_zoo.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(loss))
    return opt, losses, norms, frozen_grads


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _memory(model, opt) -> dict[str, int]:
    local = {n: p.to_local() for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {"frozen": sum(t.numel() * t.element_size() for n, t in local.items() if n in frozen),
            "adapters": sum(t.numel() * t.element_size() for n, t in local.items() if n not in frozen),
            "optimizer": sum(v.to_local().numel() * v.element_size() for s in opt.state.values() for v in s.values()
                             if v.dim())}


def _parity_job(base: str, out: str) -> dict:
    rank = dist.get_rank()
    data, labels = _data()
    result = {}
    for name, sizes in MESHES.items():
        torch.manual_seed(SEED + rank)  # the adapter is drawn from rank 0's RNG whatever the others hold
        model = xpar_zoo.from_pretrained(base, xpar_zoo.Mesh(**sizes), peft_config=lora_config(), progress=False)
        model.train()
        row = {"type": type(model).__name__, "init": adapter_state(model), "regions": _expert_regions(model),
               "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}
        sent: dict = {}
        opt, row["losses"], row["norms"], row["frozen_grads"] = _train(model, data, labels, range(STEPS), rank, sent)
        row["sent"], row["memory"] = sent, _memory(model, opt)
        row["adapter"] = adapter_state(model)
        if name == "ep2_emb2_head2":
            with torch.no_grad():
                row["eval"] = _global_mean(model(input_ids=data[STEPS, rank], labels=labels[STEPS, rank]).loss)
                with model.disable_adapter():
                    row["eval_base"] = _global_mean(
                        model(input_ids=data[STEPS, rank], labels=labels[STEPS, rank]).loss)
            xpar_zoo.save_adapter(model, f"{out}/adapter")
            model.save_pretrained(f"{out}/adapter_via_save_pretrained")  # PeftModel.save_pretrained: the same
            reloaded = xpar_zoo.from_pretrained(base, xpar_zoo.Mesh(ep=4), adapter=f"{out}/adapter", progress=False)
            with torch.no_grad():
                row["reloaded_eval"] = _global_mean(
                    reloaded(input_ids=data[STEPS, rank], labels=labels[STEPS, rank]).loss)
            row["reloaded_trainable"] = sorted(n for n, p in reloaded.named_parameters() if p.requires_grad)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, {k: row.pop(k) for k in ("regions", "sent", "memory", "frozen_grads")})
        row["ranks"] = gathered
        result[name] = row
    return result


@pytest.fixture(scope="module")
def parity_runs(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_out")
    return launch.run(_parity_job, WORLD, base, str(out)), out


def _reshard_job(base: str, root: str) -> dict:
    """ep4: 2 steps, checkpoint (model + AdamW) and the adapter; ep2: load, the 3rd step. A bf16 base with fp32
    adapters on ep2."""
    rank = dist.get_rank()
    data, labels = _data()
    torch.manual_seed(SEED)
    model = xpar_zoo.from_pretrained(base, xpar_zoo.Mesh(ep=4), peft_config=lora_config(), progress=False).train()
    opt, losses, _, _ = _train(model, data, labels, range(2), rank)
    xpar_zoo.save_checkpoint(root, model, optimizer=opt, step=2)
    xpar_zoo.save_adapter(model, f"{root}/adapter-step2")
    del model, opt
    # ep2, built as the README's recipe for models built on meta: PEFT applied before parallelize, then materialize
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(_config()), lora_config())
    xpar_zoo.parallelize(model, xpar_zoo.Mesh(ep=2))
    xpar_zoo.materialize(model).train()
    opt = parity.adamw(_trainable(model))
    xpar_zoo.load_checkpoint(root, model, optimizer=opt)
    loss = model(input_ids=data[2, rank], labels=labels[2, rank]).loss
    loss.backward()
    xpar_zoo.clip_grad_norm_(model, MAX_NORM)
    opt.step()
    losses.append(_global_mean(loss))
    result = {"losses": losses, "adapter": adapter_state(model)}

    torch.manual_seed(SEED)  # transformers' activation checkpointing of every layer, adapters trained the same
    model = xpar_zoo.from_pretrained(base, xpar_zoo.Mesh(ep=2), peft_config=lora_config(), progress=False).train()
    model.activation_checkpointing_enable()
    _, result["recompute_losses"], _, _ = _train(model, data, labels, range(STEPS), rank)
    result["recompute_adapter"] = adapter_state(model)

    try:  # ranks that disagree on the adapter: one clear error on every rank, before any work
        xpar_zoo.from_pretrained(base, xpar_zoo.Mesh(ep=2), peft_config=lora_config(r=4 + 4 * (rank == 1)),
                                 progress=False)
    except xpar_zoo.LoadError as e:
        result["disagree"] = str(e)

    torch.manual_seed(SEED)
    model = xpar_zoo.from_pretrained(base, xpar_zoo.Mesh(ep=2), dtype=torch.bfloat16, peft_config=lora_config(),
                                     progress=False).train()
    result["bf16_dtypes"] = sorted({(p.requires_grad, str(p.dtype)) for p in model.parameters()})
    _, result["bf16_losses"], _, frozen = _train(model, data, labels, range(STEPS), rank)
    result["bf16_frozen_grads"] = frozen
    return result


@pytest.fixture(scope="module")
def reshard_run(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ckpt")
    return launch.run(_reshard_job, WORLD, base, str(root)), root


# ---- parity -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", list(MESHES))
def test_lora_on_attention_and_experts_matches_single_process_peft(parity_runs, reference, mesh):
    run = parity_runs[0][mesh]
    assert run["type"] == "PeftModel"
    # the adapter is PEFT's own draw from the same seed (rank 0's RNG; the other ranks held other states)
    assert run["init"].keys() == reference["init"].keys()
    assert all(torch.equal(run["init"][k], reference["init"][k]) for k in reference["init"])
    parity.assert_losses_match(run["losses"], reference["losses"], f"lora {mesh}")
    parity.assert_norms_match(run["norms"], reference["norms"], f"lora {mesh}")
    parity.assert_params_match(parity.param_errors(run["adapter"], reference["adapters"][-1], reference["init"]),
                               f"lora {mesh}")
    assert all(n.split(".")[-3] in ("lora_A", "lora_B") for n in run["trainable"])
    assert len(run["trainable"]) == len(reference["init"])


@pytest.mark.parametrize("mesh", ["ep2", "ep2_emb2_head2"])
def test_expert_adapters_are_split_with_their_experts(parity_runs, mesh):
    """A rank holds the adapters of its own experts only (8 experts, ep=2: 4 each, the ep rank's own)."""
    experts = _config().num_experts
    for rank, row in enumerate(parity_runs[0][mesh]["ranks"]):
        assert row["regions"], "no expert adapter found"
        ep_rank = rank % 2  # innermost: consecutive ranks form an ep group
        for name, (first, stop) in row["regions"].items():
            lo, hi = ep_rank * experts // 2, (ep_rank + 1) * experts // 2
            assert lo <= first <= stop <= hi, f"rank {rank} {name}: experts [{first}, {stop}) outside [{lo}, {hi})"


@pytest.mark.parametrize("mesh", list(MESHES))
def test_frozen_base_gets_no_gradient_and_no_reduce_scatter(parity_runs, mesh):
    """Frozen parameters have no gradient; the bytes reduce-scattered are the sizer's for the adapters alone,
    far below a full fine-tune's (and the optimizer holds state for the adapters only)."""
    run = parity_runs[0][mesh]
    cfg, sizes = _config(), MESHES[mesh]
    common = dict(param_dtype="fp32", reduce_dtype="fp32", micro_batch=2, seq=8)  # parity.make_batches' rows
    lora = sizing.estimate(cfg, WORLD, sizes, lora_rank=4, lora_modules=ATTENTION, lora_parameters=EXPERTS, **common)
    full = sizing.estimate(cfg, WORLD, sizes, **common)
    got = sum(r["sent"]["reduce_scatter"] for r in run["ranks"]) / WORLD
    want = lora.comm["reduce_scatter (FSDP grads)"]
    assert all(not r["frozen_grads"] for r in run["ranks"])
    assert abs(got - want) <= 0.01 * want, f"reduce-scatter {got:.0f} B/rank, sizer (adapters only) {want:.0f}"
    assert want < 0.5 * full.comm["reduce_scatter (FSDP grads)"]
    gathered = sum(r["sent"]["all_gather"] for r in run["ranks"]) / WORLD
    want_gather = lora.comm["all_gather (FSDP params)"] + lora.comm["all_gather (head loss statistics)"]
    assert abs(gathered - want_gather) <= 0.05 * want_gather, f"all-gather {gathered:.0f}, sizer {want_gather:.0f}"


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sizer_counts_adapters_optimizer_states_and_the_frozen_base(parity_runs, mesh):
    run = parity_runs[0][mesh]
    est = sizing.estimate(_config(), WORLD, MESHES[mesh], param_dtype="fp32", optimizer="adamw", lora_rank=4,
                           lora_modules=ATTENTION, lora_parameters=EXPERTS)
    predicted = {"frozen": est.memory["frozen base (fp32 shards)"], "adapters": est.memory["adapters (fp32 shards)"],
                 "optimizer": est.memory["optimizer states (adamw, adapters)"]}
    assert est.memory["gradients (fp32 shards)"] == predicted["adapters"]
    for kind, want in predicted.items():
        got = sum(r["memory"][kind] for r in run["ranks"]) / WORLD
        assert abs(got - want) <= 0.05 * want, f"{kind}: measured {got:.0f} B/rank, predicted {want:.0f}"


# ---- adapter files ----------------------------------------------------------------------------------------------
def test_saved_adapter_is_peft_format_and_loads_into_plain_peft(parity_runs, base, reference):
    """save_adapter on ep2+emb2+head2 → PEFT's files (its key names, expert adapters at their global shape);
    ``PeftModel.from_pretrained`` in one process gives the parallel model's loss; the PeftModel's own
    ``save_pretrained`` writes the same."""
    from safetensors.torch import load_file

    runs, out = parity_runs
    run = runs["ep2_emb2_head2"]
    directory = out / "adapter"
    assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = load_file(directory / "adapter_model.safetensors")
    assert saved.keys() == reference["init"].keys()
    assert all(saved[k].shape == reference["init"][k].shape and torch.equal(saved[k], run["adapter"][k])
               for k in saved)
    config = json.loads((directory / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(EXPERTS) and config["r"] == 4
    assert config["base_model_name_or_path"] == base and config["inference_mode"]
    again = load_file(out / "adapter_via_save_pretrained" / "adapter_model.safetensors")
    assert all(torch.equal(again[k], saved[k]) for k in saved)

    plain = PeftModel.from_pretrained(_plain(base), str(directory))
    data, labels = _data()
    ids, lab = _batch(data, labels, STEPS)
    with torch.no_grad():
        loss = plain(input_ids=ids, labels=lab).loss.item()
    assert abs(loss - run["eval"]) < parity.LOSS_TOL
    assert abs(run["eval"] - reference["eval"]) < parity.LOSS_TOL
    assert abs(run["eval_base"] - reference["eval_base"]) < parity.LOSS_TOL  # disable_adapter() turns experts' off too


def test_adapter_path_loads_the_saved_adapter_trainable(parity_runs):
    run = parity_runs[0]["ep2_emb2_head2"]
    assert abs(run["reloaded_eval"] - run["eval"]) < parity.LOSS_TOL
    assert run["reloaded_trainable"] == run["trainable"]



# ---- checkpoints, export, bf16 ------------------------------------------------------------------------------------
def test_lora_checkpoint_reshards_ep4_to_ep2_with_optimizer_state(reshard_run, reference):
    run, root = reshard_run
    parity.assert_losses_match(run["losses"], reference["losses"], "ep4 → checkpoint → ep2")
    parity.assert_params_match(parity.param_errors(run["adapter"], reference["adapters"][-1], reference["init"]),
                               "ep4 → checkpoint → ep2")
    from xpar_zoo.checkpoint import model_tensor_specs, read_checkpoint_metadata

    specs = model_tensor_specs(root)
    experts = _config().num_experts
    adapter = "base_model.model.model.layers.0.mlp.experts.lora_A.default.weight"
    assert specs[adapter][0] == (experts, _config().moe_intermediate_size, 4)  # global: every expert
    assert sorted(read_checkpoint_metadata(root)["peft"]["default"]["target_parameters"]) == sorted(EXPERTS)


def test_merged_export_equals_peft_merge_and_unload(reshard_run, base, tmp_path):
    """``xpar-zoo convert to-hf CKPT OUT --model BASE --merge-adapter`` writes the hub format whose tensors are
    PEFT's own ``merge_and_unload`` of the same adapter; without the flag the export says what to do."""
    from transformers import AutoModelForCausalLM

    from xpar_zoo.commands import cli

    run, root = reshard_run
    assert cli.main(["convert", "to-hf", str(root), str(tmp_path / "merged"), "--model", base, "--merge-adapter"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", experts_implementation="eager")
    peft_merged = PeftModel.from_pretrained(_plain(base), str(root / "adapter-step2")).merge_and_unload()
    want = peft_merged.state_dict()
    got = merged.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=1e-6), k
    changed = [k for k in want if not torch.equal(want[k], _plain(base).state_dict()[k])]
    assert any("experts" in k for k in changed) and any("q_proj" in k for k in changed)
    with pytest.raises(xpar_zoo.XparError, match="holds a PEFT adapter.*--merge-adapter"):
        from xpar_zoo.converters.export import export_to_hf
        export_to_hf(root, tmp_path / "unmerged", model=base)
    assert not (tmp_path / "unmerged").exists()


def test_lora_with_activation_checkpointing_matches_single_process_peft(reshard_run, reference):
    run, _ = reshard_run
    parity.assert_losses_match(run["recompute_losses"], reference["losses"], "lora ep2 recompute")
    parity.assert_params_match(parity.param_errors(run["recompute_adapter"], reference["adapters"][-1],
                                                   reference["init"]), "lora ep2 recompute")


def test_ranks_that_disagree_on_the_adapter_are_refused(reshard_run):
    assert "ranks were given different from_pretrained arguments: peft_config" in reshard_run[0]["disagree"]


def test_bf16_base_with_fp32_adapters_trains(reshard_run, reference):
    run, _ = reshard_run
    assert run["bf16_dtypes"] == [(False, "torch.bfloat16"), (True, "torch.float32")]
    assert not run["bf16_frozen_grads"]
    for got, want in zip(run["bf16_losses"], reference["losses"], strict=True):
        assert abs(got - want) < 0.03 * want, (run["bf16_losses"], reference["losses"])
