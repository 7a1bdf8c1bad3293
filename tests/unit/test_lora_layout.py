"""PEFT LoRA in one process: the expert adapters' layout round-trips and equals PEFT folding them into the weights;
unsupported adapters, other tuners and adapter files that do not fit are refused before any work; the sizer's LoRA
figures."""

import json

import pytest
import torch

import xpar_zoo
from xpar_zoo import sizing
from xpar_zoo.errors import AdapterError, KernelError
from xpar_zoo.testing import parity

peft = pytest.importorskip("peft")  # an optional extra: requirements-test.txt installs it
from peft import get_peft_model

from support.lora_setup import ATTENTION, EXPERTS, _config, lora_config  # noqa: E402
from xpar_zoo.hub.adapter_files import attach_adapter
from xpar_zoo.styles.lora import prepare, to_expert_major, to_peft_layout  # noqa: E402


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



def test_expert_layout_round_trips():
    a, b = torch.randn(8 * 4, 16), torch.randn(32, 4 * 8)
    a3, b3 = to_expert_major(a, b, 8)
    assert a3.shape == (8, 16, 4) and b3.shape == (8, 32, 4)
    # expert e's update is B_e @ A_e, as PEFT's einsum "o r e, e r i -> e o i" computes it
    delta = torch.einsum("ore,eri->eoi", b.reshape(32, 4, 8), a.reshape(8, 4, 16))
    assert torch.allclose(b3 @ a3.transpose(1, 2), delta, atol=1e-6)
    back_a, back_b = to_peft_layout(a3, b3)
    assert torch.equal(back_a, a) and torch.equal(back_b, b)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "granitemoe"])
def test_expert_adapters_in_the_experts_path_equal_peft_folding_them_into_the_weights(arch):
    """One process: xpar_zoo's experts path with the adapters as grouped GEMMs gives PEFT's loss and gradients
    (PEFT folds ``W + s·BA`` into the weights and runs transformers' eager experts): gate/up concatenated or
    transposed with biases (gpt_oss), shared experts (deepseek_v3), other module names (granitemoe)."""
    import copy

    from xpar_zoo.styles.experts import EXPERTS_IMPLEMENTATION

    cfg, plan = parity.tiny_config(arch), xpar_zoo.get_plan(arch)
    targets = sorted({p.rpartition("*.")[2] for e in plan.extra.values() if e.style == "experts" for p in e.params
                      if p.endswith("_proj")})
    config = lora_config(target_modules=["q_proj", "v_proj"], target_parameters=targets)
    ref = get_peft_model(parity.build_model(cfg, experts_implementation="eager"), config)
    ours = get_peft_model(parity.build_model(cfg, experts_implementation="eager"), copy.deepcopy(config))
    ours.load_state_dict(ref.state_dict())
    hf, _ = prepare(ours, plan)
    hf.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    want, got = ref(input_ids=ids, labels=ids).loss, ours(input_ids=ids, labels=ids).loss
    want.backward()
    got.backward()
    assert abs(got.item() - want.item()) < parity.LOSS_TOL
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    for name, p in ref.named_parameters():
        if not p.requires_grad:
            continue
        g = grads[name]
        if g.dim() == 3:  # an expert factor, stored per expert: compare in PEFT's layout
            a, b = (name, name.replace(".lora_A.", ".lora_B.")) if ".lora_A." in name else (
                name.replace(".lora_B.", ".lora_A."), name)
            g = to_peft_layout(grads[a], grads[b])[0 if name == a else 1]
        assert (g - p.grad).norm() <= 1e-5 * p.grad.norm(), name



# ---- what is refused ----------------------------------------------------------------------------------------------
def _meta():
    from xpar_zoo.zoo.registry import build_meta

    return build_meta(_config(), torch.float32)


@pytest.mark.parametrize("overrides,message", [
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj", "lm_head"]), "output head"),
    (dict(use_dora=True, target_parameters=[]), "DoRA"),
    (dict(init_lora_weights="pissa", target_parameters=[]), "reads the base weights"),
    (dict(target_modules=[], target_parameters=["self_attn.q_proj.weight"]), "fused expert weights"),
])
def test_unsupported_adapters_are_refused_before_any_work(overrides, message):
    with pytest.raises(AdapterError, match=message):
        attach_adapter(_meta(), peft_config=lora_config(**overrides))


def test_other_tuners_are_refused():
    with pytest.raises(AdapterError, match="LoraConfig"):
        attach_adapter(_meta(), peft_config=peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]))


def test_adapter_files_that_do_not_fit_are_named(tmp_path, base):
    plain = get_peft_model(_plain(base), lora_config(r=2, target_parameters=[]))
    plain.save_pretrained(tmp_path / "r2")
    with pytest.raises(AdapterError, match=r"wrong shapes.*lora_A.weight \[2, 32\] vs \[4, 32\]"):
        cfg = json.loads((tmp_path / "r2" / "adapter_config.json").read_text())
        cfg["r"] = 4
        (tmp_path / "r2" / "adapter_config.json").write_text(json.dumps(cfg))
        attach_adapter(_meta(), adapter=tmp_path / "r2")
    other = get_peft_model(_plain(base), lora_config(target_modules=["q_proj"], target_parameters=[]))
    other.save_pretrained(tmp_path / "q_only")
    cfg = json.loads((tmp_path / "q_only" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj"]
    (tmp_path / "q_only" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"missing \(4\): .*v_proj\.lora_A\.weight"):
        attach_adapter(_meta(), adapter=tmp_path / "q_only")
    (tmp_path / "q_only" / "adapter_model.safetensors").rename(tmp_path / "q_only" / "adapter_model.bin")
    with pytest.raises(AdapterError, match="never unpickles"):
        attach_adapter(_meta(), adapter=tmp_path / "q_only")
    with pytest.raises(AdapterError, match="not a PEFT adapter directory"):
        attach_adapter(_meta(), adapter=tmp_path)


def test_triton_experts_kernels_refuse_expert_adapters():
    from xpar_zoo.styles.experts import set_experts_kernels

    model, _ = attach_adapter(_meta(), peft_config=lora_config())
    hf, _ = prepare(model, xpar_zoo.get_plan("qwen3_moe"))
    with pytest.raises(KernelError, match="expert adapters"):
        set_experts_kernels(hf, "triton")



def test_sizer_lora_holds_the_base_in_its_dtype_and_trains_the_adapters_in_fp32():
    cfg = _config()
    lora = sizing.estimate(cfg, 4, {"ep": 2}, param_dtype="bf16", lora_rank=4, lora_modules=ATTENTION,
                            lora_parameters=EXPERTS)
    base_numel = sum(p.numel() for p in sizing.meta_model(cfg).parameters())
    ref = get_peft_model(parity.build_model(cfg), lora_config())
    adapter_numel = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert lora.lora == {"rank": 4, "adapter parameters": adapter_numel}
    assert lora.memory["frozen base (bf16 shards)"] == pytest.approx(base_numel * 2 / 4, rel=0.05)
    assert lora.memory["adapters (fp32 shards)"] == pytest.approx(adapter_numel * 4 / 4, rel=0.05)
    assert lora.memory["gradients (fp32 shards)"] == lora.memory["adapters (fp32 shards)"]
    assert lora.memory["optimizer states (adamw, adapters)"] == 2 * lora.memory["adapters (fp32 shards)"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sizer_activation_estimate_with_lora_is_an_upper_bound(dtype):
    """With LoRA the activation term is a full fine-tune's plus the adapters' own values: an upper bound of what
    autograd keeps (a frozen weight's input is not kept), within 2× of it."""
    import xpar_zoo.styles.experts  # noqa: F401  (the experts implementation the parallel model uses)
    from xpar_zoo.styles.vocab import install_fused_loss

    cfg = parity.tiny_config("qwen3_moe", hidden_size=256, moe_intermediate_size=128, vocab_size=2048)
    model = get_peft_model(parity.build_model(cfg, experts_implementation="xpar_zoo").to(dtype),
                           lora_config(r=16, init_lora_weights=True))
    hf, _ = prepare(model, xpar_zoo.get_plan("qwen3_moe"))
    install_fused_loss(hf)
    ids = torch.randint(0, cfg.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    got = parity.saved_for_backward_bytes(lambda: model(input_ids=ids, labels=ids).loss.backward(),
                                          exclude=model.parameters())
    nbytes = dtype.itemsize
    want = (sizing.activation_bytes(cfg, ids.numel(), nbytes, fused_head=1, qk_norm=True)
            + sizing.lora_activation_bytes(hf, cfg, ids.numel(), nbytes))
    assert got <= want <= 2 * got, f"estimate {want / 2**20:.1f} MiB, autograd keeps {got / 2**20:.1f} MiB"
