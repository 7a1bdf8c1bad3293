"""Every private name of torch, transformers, safetensors, huggingface_hub and peft that xpar_zoo uses, in one place,
each with the reason no public API serves. ``tests/unit/test_compat.py`` touches every one, so a pinned version that
moves or renames one fails there, by name, instead of somewhere deep in a training run.

The rest of the package reaches these names only through this module. Names needed only on one path (the CPU's
in-place gloo collectives) are imported when that path asks for them, so that ``import xpar_zoo`` does not depend
on them.

Where we change an upstream object without a public extension point, it is said here, not hidden at the call site:

- ``parallelize`` sets ``model.save_pretrained`` on the instance (:func:`xpar_zoo.hub.save_pretrained
  .install_save_pretrained`, and a ``PeftModel``'s in :func:`xpar_zoo.hub.adapter_files.finish`):
  transformers' ``save_pretrained`` cannot write sharded DTensors and offers no hook to gather and write them.
- ``parallelize`` sets two flags that transformers and accelerate read (:func:`mark_fsdp_managed`): no public switch
  says "this model is sharded by FSDP2 already".
- ``XparTrainer`` overrides private ``Trainer`` methods (:data:`TRAINER_PRIVATE_OVERRIDES`): transformers' public
  overrides (``compute_loss``, ``create_optimizer``, callbacks) cannot change how the model is moved to a device,
  clipped, saved or resumed.
- ``XparGRPOTrainer`` points TRL's vLLM weight sync at ``xpar_zoo.iter_hub_weights`` (:func:`stream_vllm_weights`).
- huggingface_hub: no private name is used.
- Python's own ``atexit._run_exitfuncs`` (:func:`run_exit_handlers`): a rank that ends with ``os._exit`` runs the exit
  handlers first, and the standard library has no public call that runs them without ending the interpreter.
- The vocab styles read transformers' forward *source* (:mod:`xpar_zoo.zoo.forward_source`, ``check_head``): no
  public API says whether a forward reads the embedding weight directly or changes the logits after the head.
- A multimodal processor is built without its video processor (:func:`processor_without_video`) where torchvision
  does not load: transformers checks every part's class on construction and has no switch to leave one out.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from safetensors.torch import (
    _TYPES as _SAFETENSORS_TYPES,  # the dtype table of safetensors' own torch reader
)
from torch import nn
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import _StridedShard
from transformers.integrations.moe import _default_apply_gate

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# ---- torch ---------------------------------------------------------------------------------------------------

# FSDP2's dim-0 shard of a tensor already split on dim 0 by a plan is this placement; there is no public type.
StridedShard = _StridedShard

# torch's own per-placement local size and global indices (``_StridedShard`` included); the public
# ``compute_local_shape_and_global_offset`` keeps only each dim's first offset.
shard_size_and_offsets = _get_shard_size_and_offsets

# The logger of DTensor's redistribution warnings (filtered for exact all-gathers): a private module's name.
DTENSOR_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now (what an ordinary exit runs before the interpreter's teardown)."""
    import atexit

    atexit._run_exitfuncs()


def redistribute_logger() -> logging.Logger:
    return logging.getLogger(DTENSOR_REDISTRIBUTE_LOGGER)


def default_store() -> dist.Store:
    """The default process group's store: the checkpoint rendezvous meets there (torch has no public getter)."""
    return dist.distributed_c10d._get_default_store()


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``FakeTensor`` (shapes without data, as in the simulated world of
    :mod:`xpar_zoo.sizing.simulate`): checks that read a tensor's values skip it; torch exposes the type only under
    ``torch._subclasses``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fake_process_group_store() -> dist.Store:
    """The store of torch's fake process group (``init_process_group("fake", store=…)``: one process plays a rank of
    a world of any size, every collective answering at once): registered and provided only by a testing module."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode():
    """A ``FakeTensorMode`` (tensors with shapes, dtypes and storages but no data) that also accepts the real tensors
    a model was given before it (plan tables, integer constants): torch exposes it only under ``torch._subclasses``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def real_tensors():
    """A context in which new tensors are real even inside a ``FakeTensorMode`` (index tables that are a pure
    function of sizes, such as a sequence layout, which code then reads on the host with ``tolist``): torch's
    ``unset_fake_temporarily``, exposed only under ``torch._subclasses``; outside a fake mode it changes nothing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fsdp_memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer):
    """torch's memory tracker of FSDP2 models (``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``): live
    tensor bytes by kind (sharded and unsharded parameters, gradients, optimizer states, activations, temporaries,
    collective buffers) with their peak; torch has no public memory accounting that works on fake tensors."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return FSDPMemTracker(model, optimizer)


def efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                        scale: float | None) -> torch.Tensor:
    """Causal attention by the memory-efficient kernel a GPU's sdpa runs where the value heads are narrower than the
    query/key heads (MLA): it keeps the output and the log-sum-exp, no scores. ``[b, heads, q, d_v]``. The kernel is
    CUDA-only and reachable only as ``aten._scaled_dot_product_efficient_attention``; its fake implementation runs
    on fake tensors of any device, which is what the simulation (``xpar_zoo.sizing.simulate``) needs where the CPU's
    sdpa would take its math path and keep the whole scores."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, 0.0, is_causal,
                                                                   scale=scale)[0]


def assert_async(condition: torch.Tensor, message: str) -> None:
    """A check on the device without a host sync (``torch._assert_async``; no public equivalent)."""
    torch._assert_async(condition, message)


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """Scale every tensor in place by ``scalar`` in one batched kernel (``torch._foreach_mul_``, what torch's own
    ``clip_grads_with_norm_`` calls): the public ``clip_grads_with_norm_`` takes parameters, and clipping scales the
    local pieces of DTensor gradients that live on several meshes."""
    torch._foreach_mul_(tensors, scalar)


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | torch.Tensor | None]:
    """``module._parameters``: the gathered style swaps a plain tensor in for the forward and the parameter back
    after it, which ``setattr`` (it accepts only parameters there) and ``register_parameter`` refuse."""
    return module._parameters


def fsdp_managed_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters the FSDP2 unit ``module`` manages, sharded and (while gathered) unsharded: FSDP2's param group
    is private state and ``FSDPModule`` has no public accessor for it."""
    group = module._get_fsdp_state()._fsdp_param_group
    out = []
    for fsdp_param in group.fsdp_params if group is not None else ():
        out.append(fsdp_param.sharded_param)
        unsharded = getattr(fsdp_param, "_unsharded_param", None)  # set only while the unit is gathered
        if unsharded is not None:
            out.append(unsharded)
    return out


def fsdp_collective_bases() -> tuple[type, type, type]:
    """``(AllGather, ReduceScatter, DefaultAllocMixin)``: ``FSDPModule.set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` are public, the base classes they take and the default buffer allocation live in
    private modules. Imported on demand: only the CPU's in-place gloo collectives use them."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

    return AllGather, ReduceScatter, DefaultAllocMixin


def create_work_from_future():
    """c10d's ``_create_work_from_future`` (one ``Work`` over several futures), or ``None`` where this torch lacks
    it: FSDP2 waits on one work per collective, and torch makes no public ``Work`` from futures."""
    return getattr(torch._C._distributed_c10d, "_create_work_from_future", None)


def dcp_metadata_path(reader, rank: int | None) -> str:
    """The path of a DCP checkpoint's metadata file, as ``FileSystemReader`` computes it (our reader reads it
    without unpickling code, and the name is only known through the reader's private method)."""
    return reader._get_metadata_path(rank)


# ---- transformers ----------------------------------------------------------------------------------------------

# transformers' default gate of fused experts: a model whose experts class overrides ``_apply_gate`` is not SwiGLU.
DEFAULT_APPLY_GATE = _default_apply_gate


def applies_default_gate(experts_class: type) -> bool:
    return getattr(experts_class, "_apply_gate", _default_apply_gate) is _default_apply_gate


def apply_gate(experts: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The experts module's own gate (``_apply_gate``, what transformers' experts forward calls; not public)."""
    return experts._apply_gate(h)


def can_set_experts_implementation(model: nn.Module) -> TypeGuard[PreTrainedModel]:
    """Whether the model's class takes ``set_experts_implementation`` and its config names one (transformers asks
    the same through a private class method and config attribute)."""
    return type(model)._can_set_experts_implementation() and bool(
        getattr(model.config, "_experts_implementation", None))


def attn_implementation(config) -> str | None:
    """The attention implementation a config resolved (``config._attn_implementation``, ``None`` where it has none;
    no public getter)."""
    return getattr(config, "_attn_implementation", None)


def from_config(model_class: type[PreTrainedModel], config, **kwargs) -> PreTrainedModel:
    """``model_class._from_config``: builds the model from ``config`` with the dtype and implementations resolved as
    ``from_pretrained`` does; the public ``from_config`` is on the auto classes only, and we choose the class."""
    return model_class._from_config(config, **kwargs)


def init_module_weights(owner: nn.Module, module: nn.Module) -> None:
    """Run the model ``owner``'s own ``_init_weights`` on ``module`` alone, its parameters marked initialised (the
    flag transformers' ``from_pretrained`` uses) so that only its buffers are computed: transformers has no public
    per-module init."""
    for p in module.parameters(recurse=False):
        p._is_hf_initialized = True
    owner._init_weights(module)


def tied_weights_keys(model: nn.Module) -> dict:
    """The model's tied weights (``all_tied_weights_keys``, else the class's ``_tied_weights_keys``)."""
    return getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}


def no_split_modules(model: nn.Module) -> tuple[str, ...]:
    """The model's decoder-layer classes (``_no_split_modules``): transformers names its FSDP units nowhere else."""
    return tuple(getattr(model, "_no_split_modules", None) or ())


def keys_to_ignore_on_load(model: nn.Module, kind: str) -> tuple[str, ...]:
    """The model's regexes of checkpoint keys to ignore when they are ``"missing"`` or ``"unexpected"``
    (``_keys_to_ignore_on_load_missing`` / ``_unexpected``), as transformers' loader honours them; no public getter."""
    return tuple(getattr(model, f"_keys_to_ignore_on_load_{kind}", None) or ())


def mark_fsdp_managed(model: nn.Module) -> None:
    """No public extension point: transformers' ``generate`` keeps the ranks in step (``synced_gpus``) only for a
    module flagged ``_is_fsdp_managed_module``, and accelerate's ``prepare`` hands back a model flagged
    ``_is_accelerate_prepared`` as is (no DDP wrapper over FSDP2)."""
    model._is_fsdp_managed_module = True
    model._is_accelerate_prepared = True


# Private ``Trainer`` methods that ``XparTrainer`` overrides, each with its reason (no public override serves).
TRAINER_PRIVATE_OVERRIDES = {
    "_move_model_to_device": "the model is already placed by parallelize (its shards on the mesh's device)",
    "_clip_grad_norm": "clipping goes through xpar_zoo.clip_grad_norm_ (every mesh, one norm)",
    "_get_grad_norm": "the norm clip_grad_norm_ returned, not accelerate's",
    "_save": "save_pretrained of a parallelized model (a collective on every rank)",
    "_save_optimizer_and_scheduler": "the optimizer goes into an xpar_zoo checkpoint (DCP at global shapes)",
    "_load_from_checkpoint": "resume from an xpar_zoo checkpoint",
    "_load_optimizer_and_scheduler": "resume from an xpar_zoo checkpoint",
    "_load_best_model": "the best model is an xpar_zoo checkpoint",
    "_track_num_input_tokens": "the sp·cp ranks of a sequence group pass the same rows: each token counted once",
}

# ---- safetensors -----------------------------------------------------------------------------------------------

# safetensors' dtype names → torch dtypes, as its own torch reader maps them (no public table).
SAFETENSORS_TYPES: dict[str, torch.dtype] = dict(_SAFETENSORS_TYPES)

# ---- peft ------------------------------------------------------------------------------------------------------


def lora_swapped_in_out(layer: nn.Module) -> bool:
    """Whether PEFT's LoRA wrapper of a fused experts tensor stores it transposed (``_did_swap_in_out_features``):
    PEFT records it nowhere public."""
    return layer._did_swap_in_out_features


# ---- trl ----------------------------------------------------------------------------------------------------------


def stream_vllm_weights(generation, named_params) -> None:
    """Make TRL's vLLM weight sync of ``generation`` (a ``VLLMGeneration``) read ``named_params()`` (an iterator of
    ``(hub name, full tensor)``): both its colocate ``load_weights`` and its server ``update_named_params`` walk the
    private ``_iter_named_params``, and nothing public lets a trainer say where the weights come from."""
    generation._iter_named_params = named_params


# ---- transformers' attention ------------------------------------------------------------------------------------

class AttributeView:
    """``target`` as code that reads its attributes sees it, with ``overrides`` in place of some: transformers'
    attention functions read the module's head counts and sinks and the config's implementation name, which the
    sp/cp attention shows them as this rank's. Nothing is written to ``target``."""

    def __init__(self, target, overrides) -> None:
        object.__setattr__(self, "_view_target", target)
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._view_target, name)


def view_target(obj):
    """The object an :class:`AttributeView` shows (``obj`` itself when it is none)."""
    return obj._view_target if isinstance(obj, AttributeView) else obj


def config_with_attn_implementation(config, implementation: str):
    """``config`` as seen by an attention function with ``config._attn_implementation == implementation``:
    transformers' flash forward loads its kernels by the name it reads there, and under sp/cp the model's own
    config names the wrapper (``xpar_seq_flash_attention_2``)."""
    return AttributeView(config, {"_attn_implementation": implementation})


def _flash_utils():
    import transformers.modeling_flash_attention_utils as flash_utils

    return flash_utils


def flash_kernels_loaded(implementation: str) -> bool:
    """Whether transformers' flash path has kernels loaded for ``implementation`` (its lazily imported
    ``_loaded_implementation``), so that it runs without importing a package; no public getter."""
    return _flash_utils()._loaded_implementation == implementation


def flash_attention_available(implementation: str) -> bool:
    """Whether ``flash_attention_2`` / ``_3`` can run here: kernels transformers has loaded, the ``flash_attn`` /
    ``flash_attn_interface`` package on a GPU, or transformers' hub kernels."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    available = is_flash_attn_2_available if implementation == "flash_attention_2" else is_flash_attn_3_available
    return flash_kernels_loaded(implementation) or available(kernels_fallback_ok=True)


def load_flash_kernels(implementation: str, flash_fn, varlen_fn) -> None:
    """Put ``flash_fn`` / ``varlen_fn`` (``flash_attn_func`` / ``flash_attn_varlen_func`` signatures) in the slots
    where transformers keeps the flash kernels it imported lazily for ``implementation`` (``_flash_fn``,
    ``_flash_varlen_fn``, its kwargs filter built from the varlen signature as its own loader builds it): the seam
    by which a test runs transformers' whole flash path on a reference kernel where ``flash_attn`` cannot be
    installed. :func:`unload_flash_kernels` empties them."""
    utils = _flash_utils()
    utils._flash_fn, utils._flash_varlen_fn, utils._flash_with_kvcache_fn = flash_fn, varlen_fn, None
    utils._pad_fn, utils._unpad_fn = utils._pad_input, utils._unpad_input
    utils._process_flash_kwargs_fn = utils._lazy_define_process_function(varlen_fn)
    utils._process_with_kvcache_kwargs_fn = dict
    utils._loaded_implementation = implementation


def unload_flash_kernels() -> None:
    """Forget the flash kernels transformers loaded (the next flash call imports them again)."""
    utils = _flash_utils()
    utils._flash_fn = utils._flash_varlen_fn = utils._flash_with_kvcache_fn = None
    utils._process_flash_kwargs_fn = utils._process_with_kvcache_kwargs_fn = None
    utils._loaded_implementation = None


def supports_attn_implementation(model: nn.Module, implementation: str) -> bool:
    """Whether ``model``'s class declares support for ``implementation`` (``_supports_flash_attn``,
    ``_supports_flex_attn``, as transformers' ``set_attn_implementation`` checks; eager and sdpa: always here):
    a wrapper that sets the inner implementation itself must refuse what transformers would."""
    flag = {"flex_attention": "_supports_flex_attn"}.get(
        implementation, "_supports_flash_attn" if implementation.startswith("flash_attention") else None)
    return flag is None or bool(getattr(model, flag, False))


# ---- transformers processors ------------------------------------------------------------------------------------

def processor_without_video(processor_class: type, parts: dict, **kwargs):
    """An instance of a multimodal transformers processor class built from its parts (image processor, tokenizer,
    …) with no video processor. transformers' ``ProcessorMixin.__init__`` checks every part's class through
    ``check_argument_for_proper_class``, and the video processor classes need torchvision, which may not load
    (its wheels are built against one torch); no public switch builds a processor without one. The subclass accepts
    ``None`` for a video part only; everything else is the class's own (placeholder expansion, chat template)."""

    class WithoutVideo(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    WithoutVideo.__name__ = WithoutVideo.__qualname__ = processor_class.__name__
    videos = {name: None for name in processor_class.get_attributes() if "video" in name}
    return WithoutVideo(**parts, **videos, **kwargs)
