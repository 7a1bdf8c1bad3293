"""Every private upstream name that :mod:`xpar_zoo.compat` relies on still exists under the pinned torch,
transformers, safetensors and peft, each checked by its own test id: a version bump that moves one fails here, by
name. And no module of the package but compat reaches a private upstream name."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from xpar_zoo import compat

ROOT = Path(__file__).resolve().parents[2]


def _source_mentions(module: str, name: str) -> bool:
    return name in inspect.getsource(importlib.import_module(module))


def _fsdp_param_group_state() -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_param,
        _fsdp_param_group,
        _fsdp_state,
    )

    return (hasattr(FSDPModule, "_get_fsdp_state") and "_fsdp_param_group" in inspect.getsource(_fsdp_state.FSDPState)
            and "fsdp_params" in inspect.getsource(_fsdp_param_group.FSDPParamGroup)
            and {"sharded_param", "_unsharded_param"} <= set(re.findall(r"\w+", inspect.getsource(_fsdp_param.FSDPParam))))


def _generate_sees_fsdp2() -> bool:
    """transformers' own test for an FSDP-managed model (``generate`` then syncs the ranks) reads the flag that
    :func:`compat.mark_fsdp_managed` sets."""
    from transformers.distributed.fsdp import is_fsdp_managed_module

    module = torch.nn.Linear(2, 2)
    before = is_fsdp_managed_module(module)
    compat.mark_fsdp_managed(module)
    return not before and is_fsdp_managed_module(module)


def _scaled_by_foreach_mul() -> bool:
    pieces = [torch.ones(3), torch.ones(2, 2)]
    compat.foreach_mul_(pieces, torch.tensor(0.5))
    return all(torch.equal(p, torch.full_like(p, 0.5)) for p in pieces)


def _flash_slots_load() -> bool:
    """transformers' flash path returns the kernels :func:`compat.load_flash_kernels` put in its slots."""
    from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

    def flash(q, k, v, softmax_scale=None, causal=False):
        return q

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False):
        return q

    compat.load_flash_kernels("flash_attention_2", flash, varlen)
    try:
        (got_flash, got_varlen, *_), _ = lazy_import_flash_attention("flash_attention_2")
        return got_flash is flash and got_varlen is varlen and compat.flash_kernels_loaded("flash_attention_2")
    finally:
        compat.unload_flash_kernels()


def _fake_tensors_are_told_apart() -> bool:
    real = torch.empty(2)
    with compat.fake_tensor_mode():
        fake = torch.empty(2) + real  # real inputs accepted, fake results
    return compat.is_fake(fake) and not compat.is_fake(real)


def _fsdp_memory_tracker_api() -> bool:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return all(callable(getattr(FSDPMemTracker, n, None)) for n in ("track_inputs", "reset_mod_stats",
                                                                      "get_tracker_snapshot"))


def _efficient_attention_on_fake_tensors() -> bool:
    """MLA's shapes (value heads narrower than the query/key heads): the output is the value's width, and backward
    runs, on fake CPU tensors."""
    with compat.fake_tensor_mode():
        q, k = (torch.zeros(1, 2, 16, 24, requires_grad=True) for _ in range(2))
        v = torch.zeros(1, 2, 16, 16, requires_grad=True)
        out = compat.efficient_attention(q, k, v, True, 0.2)
        out.sum().backward()
    return out.shape == (1, 2, 16, 16) and q.grad.shape == q.shape and v.grad.shape == v.shape


def _real_tensors_inside_a_fake_mode() -> bool:
    with compat.fake_tensor_mode():
        with compat.real_tensors():
            real = torch.arange(3)
        fake = torch.arange(3)
    return not compat.is_fake(real) and real.tolist() == [0, 1, 2] and compat.is_fake(fake)


def _tiny_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe")


CHECKS = {
    # torch
    "torch._StridedShard": lambda: isinstance(compat.StridedShard, type) and compat.StridedShard.__name__ == "_StridedShard",
    "torch._get_shard_size_and_offsets": lambda: callable(compat.shard_size_and_offsets),
    "torch.distributed.tensor._redistribute logger": lambda: importlib.import_module(
        compat.DTENSOR_REDISTRIBUTE_LOGGER).__name__ == compat.redistribute_logger().name,
    "torch c10d _get_default_store": lambda: callable(torch.distributed.distributed_c10d._get_default_store),
    "torch._assert_async": lambda: compat.assert_async(torch.tensor(True), "holds") is None,
    "torch._foreach_mul_": lambda: _scaled_by_foreach_mul(),
    "torch nn.Module._parameters": lambda: "weight" in compat.parameter_slots(torch.nn.Linear(2, 2)),
    "torch FSDP2 param group state": _fsdp_param_group_state,
    "torch FSDP2 AllGather / ReduceScatter / DefaultAllocMixin": lambda: [c.__name__ for c in compat.fsdp_collective_bases()]
    == ["AllGather", "ReduceScatter", "DefaultAllocMixin"],
    "torch c10d _create_work_from_future": lambda: callable(compat.create_work_from_future()),
    "torch FileSystemReader._get_metadata_path": lambda: callable(
        importlib.import_module("torch.distributed.checkpoint").FileSystemReader._get_metadata_path),
    "torch FakeTensor / FakeTensorMode (torch._subclasses)": _fake_tensors_are_told_apart,
    "torch fake process group store (torch.testing._internal.distributed.fake_pg)": lambda: isinstance(
        compat.fake_process_group_store(), torch.distributed.Store),
    "torch FSDPMemTracker (torch.distributed._tools)": _fsdp_memory_tracker_api,
    "torch aten._scaled_dot_product_efficient_attention (fake)": _efficient_attention_on_fake_tensors,
    "torch unset_fake_temporarily (torch._subclasses)": _real_tensors_inside_a_fake_mode,
    # transformers
    "transformers _default_apply_gate": lambda: callable(compat.DEFAULT_APPLY_GATE) and compat.applies_default_gate(object),
    "transformers PreTrainedModel._can_set_experts_implementation": lambda: callable(
        importlib.import_module("transformers").PreTrainedModel._can_set_experts_implementation),
    "transformers config._experts_implementation": lambda: hasattr(_tiny_config(), "_experts_implementation"),
    "transformers config._attn_implementation": lambda: hasattr(_tiny_config(), "_attn_implementation"),
    "transformers PreTrainedModel._from_config": lambda: callable(
        importlib.import_module("transformers").PreTrainedModel._from_config),
    "transformers PreTrainedModel._init_weights": lambda: callable(
        importlib.import_module("transformers").PreTrainedModel._init_weights),
    "transformers _is_hf_initialized": lambda: _source_mentions("transformers.modeling_utils", "_is_hf_initialized"),
    "transformers _no_split_modules / _tied_weights_keys": lambda: all(
        hasattr(importlib.import_module("transformers").PreTrainedModel, n)
        for n in ("_no_split_modules", "_tied_weights_keys")),
    "transformers _keys_to_ignore_on_load_missing / _unexpected": lambda: all(
        hasattr(importlib.import_module("transformers").PreTrainedModel, f"_keys_to_ignore_on_load_{k}")
        for k in ("missing", "unexpected")),
    "transformers _is_fsdp_managed_module": _generate_sees_fsdp2,
    "transformers flash kernel slots (_loaded_implementation, _flash_fn, ...)": lambda: _flash_slots_load(),
    "transformers _supports_flash_attn / _supports_flex_attn": lambda: all(
        hasattr(importlib.import_module("transformers").PreTrainedModel, n)
        for n in ("_supports_flash_attn", "_supports_flex_attn")),
    "transformers config view of _attn_implementation": lambda: compat.attn_implementation(
        compat.config_with_attn_implementation(_tiny_config(), "flash_attention_2")) == "flash_attention_2",
    "transformers ProcessorMixin.check_argument_for_proper_class (a processor without its video processor)":
        lambda: _processor_without_video(),
    "accelerate _is_accelerate_prepared": lambda: _source_mentions("accelerate.accelerator", "_is_accelerate_prepared"),
    # Python
    # (only looked up: running it here would run the test session's own exit handlers)
    "atexit._run_exitfuncs (exit handlers before os._exit)": lambda: callable(
        getattr(importlib.import_module("atexit"), "_run_exitfuncs", None)),
    # safetensors
    "safetensors.torch._TYPES": lambda: compat.SAFETENSORS_TYPES["BF16"] is torch.bfloat16,
    # peft
    "peft _did_swap_in_out_features": lambda: _source_mentions("peft.tuners.lora.layer", "_did_swap_in_out_features"),
    # trl
    "trl VLLMGeneration._iter_named_params (its weight sync's walk)": lambda: _source_mentions(
        "trl.generation.vllm_generation", "self._iter_named_params()"),
}


def _processor_without_video() -> bool:
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from xpar_zoo.train.tiny_vl import tiny_vl_tokenizer

    processor = compat.processor_without_video(
        Qwen3VLProcessor, {"image_processor": Qwen2VLImageProcessorPil(), "tokenizer": tiny_vl_tokenizer()})
    return isinstance(processor, Qwen3VLProcessor) and processor.video_processor is None


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_private_upstream_name_still_exists(name):
    assert CHECKS[name](), f"{name} moved or changed in this version: update xpar_zoo/compat.py"


@pytest.mark.parametrize("method", sorted(compat.TRAINER_PRIVATE_OVERRIDES))
def test_the_trainer_still_has_the_private_method_xpar_trainer_overrides(method):
    from transformers import Trainer

    assert callable(getattr(Trainer, method, None)), f"transformers.Trainer.{method} is gone: update XparTrainer"


def test_xpar_trainer_overrides_exactly_the_listed_private_methods():
    from xpar_zoo.integrations.trainer import XparTrainerMixin

    overridden = {n for n in vars(XparTrainerMixin) if n.startswith("_") and not n.startswith("__")
                  and not n.startswith("_xpar") and hasattr(importlib.import_module("transformers").Trainer, n)}
    assert overridden == set(compat.TRAINER_PRIVATE_OVERRIDES)


_UPSTREAM = ("torch", "transformers", "safetensors", "huggingface_hub", "peft", "accelerate", "trl")
_PRIVATE_ATTRS = {
    "_apply_gate", "_assert_async", "_foreach_mul_", "_attn_implementation", "_can_set_experts_implementation",
    "_create_work_from_future", "_did_swap_in_out_features", "_experts_implementation", "_from_config",
    "_fsdp_param_group", "_get_default_group", "_get_default_store", "_get_fsdp_state", "_get_metadata_path",
    "_init_weights", "_is_accelerate_prepared", "_iter_named_params", "_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected", "_is_fsdp_managed_module", "_is_hf_initialized", "_model_mapping",
    "_no_split_modules", "_parameters", "_scaled_dot_product_efficient_attention", "_tied_weights_keys",
    "_unsharded_param",
}


def _private_uses(path: Path) -> list[str]:
    """Private upstream imports (``from torch.x._y import``, ``import ... _name``) and the known private attributes
    (as ``obj._name`` or a ``getattr`` string) in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            top = node.module.split(".")[0]
            if top in _UPSTREAM and (any(p.startswith("_") for p in node.module.split("."))
                                     or any(a.name.startswith("_") for a in node.names)):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in _PRIVATE_ATTRS:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_only_compat_reaches_private_upstream_names():
    offenders = {}
    for folder in ("xpar_zoo", "plans", "converters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "xpar_zoo" / "compat.py":
                continue
            if uses := _private_uses(path):
                offenders[str(path.relative_to(ROOT))] = uses
    assert not offenders, "private upstream names outside xpar_zoo/compat.py: " + repr(offenders)


def test_the_private_name_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather\n"
                      "from safetensors.torch import _TYPES\n"
                      "def f(m):\n    return m._get_fsdp_state(), getattr(m, '_unsharded_param', None)\n")
    assert _private_uses(sample) == ["line 1: from torch.distributed.fsdp._fully_shard._fsdp_api import ...",
                                     "line 2: from safetensors.torch import ...", "line 4: ._get_fsdp_state",
                                     "line 4: '_unsharded_param'"]
