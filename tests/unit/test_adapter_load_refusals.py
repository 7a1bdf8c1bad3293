"""`adapter=PATH` (and `from_pretrained(adapter=…)`) refuses, in one line and before the model loads, a PEFT adapter
whose record disagrees with its tensors (a rank other than the tensors', dense or expert factors), whose
lora_alpha is not a finite positive number, whose tensors hold NaN or infinity (named), or whose record is hostile.
The adapters are written by plain PEFT in one process; the model is built on meta (no process group)."""

import json
import re

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from xpar_zoo.errors import AdapterError  # noqa: E402
from xpar_zoo.hub.adapter_files import attach_adapter  # noqa: E402
from xpar_zoo.testing import parity  # noqa: E402
from xpar_zoo.zoo.registry import build_meta  # noqa: E402


def _meta():
    return build_meta(parity.tiny_config("qwen3_moe"), torch.float32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A PEFT adapter (rank 4, alpha 8) on attention and on the fused experts, saved by PEFT itself."""
    directory = tmp_path_factory.mktemp("adapter") / "lora"
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj"],
                        target_parameters=["mlp.experts.gate_up_proj"])
    get_peft_model(model, config).save_pretrained(directory)
    return directory


@pytest.fixture
def adapter(saved, tmp_path):
    import shutil

    out = tmp_path / "lora"
    shutil.copytree(saved, out)
    return out


def _edit_record(directory, **changes):
    record = json.loads((directory / "adapter_config.json").read_text())
    record.update(changes)
    (directory / "adapter_config.json").write_text(json.dumps(record))


def test_the_saved_adapter_loads(adapter):
    _, state = attach_adapter(_meta(), adapter=adapter)
    assert state and all(torch.isfinite(t).all() for t in state.values())


@pytest.mark.parametrize("changes", [{"r": 8}, {"r": 2}, {"rank_pattern": {"gate_up_proj": 8}}])
def test_load_refuses_a_rank_that_disagrees_with_the_tensors(adapter, changes):
    _edit_record(adapter, **changes)
    with pytest.raises(AdapterError, match=r"wrong shapes \(file vs model\)"):
        attach_adapter(_meta(), adapter=adapter)


@pytest.mark.parametrize("alpha, shown", [(float("nan"), "NaN"), (float("inf"), "Infinity"), (-8, "-8"), (0, "0"),
                                          ("8", '"8"'), (1e300, "1e+300")])
def test_load_refuses_a_lora_alpha_that_is_not_finite_and_positive(adapter, alpha, shown):
    _edit_record(adapter, lora_alpha=alpha)
    with pytest.raises(AdapterError, match=re.escape(f"adapter_config.json: lora_alpha = {shown}; it scales the")):
        attach_adapter(_meta(), adapter=adapter)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_load_refuses_nan_or_inf_in_an_adapter_tensor_naming_it(adapter, value):
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    name = sorted(k for k in tensors if "experts" in k and "lora_B" in k)[0]
    tensors[name][0, 0] = value
    save_file(tensors, path)
    with pytest.raises(AdapterError, match=rf"NaN or infinity in {name}; the adapter cannot train"):
        attach_adapter(_meta(), adapter=adapter)


@pytest.mark.parametrize("changes, said", [
    ({"peft_type": "IA3"}, 'peft_type "IA3"'),
    ({"r": "4"}, 'r = "4"'),
    ({"r": 2 ** 70}, "r = 1180591620717411303424"),
    ({"target_parameters": {"x": 1}}, "target_parameters = "),
    ({"auto_mapping": {"base_model_class": "X", "parent_library": "os"}}, "auto_mapping names custom model classes"),
    ({"base_model_name_or_path": ["a"]}, "base_model_name_or_path = "),
])
def test_load_refuses_a_hostile_record_in_one_line(adapter, changes, said):
    _edit_record(adapter, **changes)
    with pytest.raises(AdapterError, match=said) as e:
        attach_adapter(_meta(), adapter=adapter)
    assert "\n" not in str(e.value)


def test_load_refuses_an_adapter_config_that_is_not_json(adapter):
    (adapter / "adapter_config.json").write_text("[" * 100000)
    with pytest.raises(AdapterError, match="not a readable JSON file"):
        attach_adapter(_meta(), adapter=adapter)
