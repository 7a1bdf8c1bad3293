"""The LoRA setup the LoRA tests share (the layout unit tests and the launched parity runs): which modules and fused
expert tensors carry adapters, and the config that draws both factors. Import after ``pytest.importorskip("peft")``."""

from peft import LoraConfig

from xpar_zoo.testing import parity

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_config(**overrides) -> LoraConfig:
    """LoRA on attention and on both fused expert tensors; ``init_lora_weights=False`` draws ``B`` too, so that
    the adapters change the forward from the first step."""
    kwargs = dict(r=4, lora_alpha=8, init_lora_weights=False, target_modules=ATTENTION, target_parameters=EXPERTS)
    return LoraConfig(**{**kwargs, **overrides})


def _config():
    return parity.tiny_config("qwen3_moe")
