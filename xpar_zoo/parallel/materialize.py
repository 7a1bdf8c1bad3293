"""Models built on the meta device: allocate their local shards and give the buffers no checkpoint holds their
values, as transformers' ``from_pretrained`` does.

The recipe for a model built on meta, parallelized, then loaded from a DCP checkpoint::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    xpar_zoo.parallelize(model, mesh)
    xpar_zoo.materialize(model)                 # local shards allocated, rotary inv_freq & co. computed
    xpar_zoo.load_checkpoint(ckpt_dir, model)   # every parameter and persistent buffer filled

A parallelized model that still has meta tensors, or whose non-persistent buffers were never initialised (a plain
``model.to_empty()``), raises :class:`~xpar_zoo.errors.ModelStateError` at its next forward and in
``load_checkpoint``, naming this recipe.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ..compat import init_module_weights, is_fake
from ..errors import LoadError, ModelStateError, counted
from .state import parallel_state


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters and buffers on the meta device."""
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


def unread_buffers(model: nn.Module) -> set[str]:
    """Buffers no checkpoint holds: the non-persistent ones (rotary ``inv_freq`` & co.)."""
    return {n for n, _ in model.named_buffers()} - set(model.state_dict(keep_vars=True))


def initialise_buffers(model: nn.Module, names: set[str]) -> None:
    """Give buffers that no checkpoint holds (non-persistent ``inv_freq`` & co.) their values through the model's
    own ``_init_weights``, as transformers' ``from_pretrained`` does; parameters are left alone. Raises
    :class:`LoadError` for a buffer the model's init does not set."""
    from transformers import PreTrainedModel
    from transformers import initialization as init

    owners: dict[str, PreTrainedModel] = {}

    def walk(module: nn.Module, prefix: str, owner) -> None:
        if isinstance(module, PreTrainedModel):
            owner = module
        owners[prefix] = owner
        for child_name, child in module.named_children():
            walk(child, f"{prefix}.{child_name}" if prefix else child_name, owner)

    walk(model, "", None)
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in names:
        mod, _, attr = name.rpartition(".")
        by_module[mod].append(attr)
    with torch.no_grad():
        for mod_name, attrs in by_module.items():
            module = model.get_submodule(mod_name)
            for attr in attrs:  # a sentinel, so that a buffer the init skips is caught below
                buf = getattr(module, attr)
                buf.fill_(float("nan") if buf.is_floating_point() else torch.iinfo(buf.dtype).min
                          if buf.dtype != torch.bool else False)
            with init.guard_torch_init_functions():
                init_module_weights(owners[mod_name], module)
            for attr in attrs:
                buf = getattr(module, attr)
                if is_fake(buf):  # a simulated run (xpar_zoo.sizing.simulate): no values to check
                    continue
                left = (buf.isnan().any() if buf.is_floating_point()
                        else (buf == torch.iinfo(buf.dtype).min).any() if buf.dtype != torch.bool else False)
                if left:
                    raise LoadError(f"buffer {mod_name}.{attr} is in no checkpoint and {type(owners[mod_name]).__name__}"
                                    "._init_weights does not set it")


def materialize(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Make a model built on the meta device and parallelized ready to load: allocate its local shards on
    ``device`` (default: the mesh's device: this CUDA device, or the CPU) with ``to_empty`` and compute the buffers
    no checkpoint holds with the model's own ``_init_weights``. Parameters and persistent buffers stay
    uninitialised until :func:`~xpar_zoo.load_checkpoint` fills them. Safe to call on a model that
    ``to_empty`` already moved off meta (its data is kept); returns ``model``."""
    state = parallel_state(model)
    if state is None:
        raise ModelStateError("materialize applies to a model that xpar_zoo.parallelize has parallelized")
    if meta_tensors(model):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if state.mesh.device_type == "cuda" else "cpu"
        model.to_empty(device=device)
    base = getattr(model, "get_base_model", None)
    owner = base() if base is not None else model  # a PeftModel: its base's names
    initialise_buffers(owner, set(state.unset_buffers))
    state.unset_buffers = ()
    return model


def check_materialized(model: nn.Module, error: type[Exception] = ModelStateError) -> None:
    """Raise ``error`` naming the recipe when a parallelized model still has meta tensors or buffers that were never
    initialised (built on meta, then ``to_empty`` without :func:`materialize`)."""
    on_meta = meta_tensors(model)
    if on_meta:
        raise error(f"the model has {counted(len(on_meta), 'tensor')} on the meta device ({', '.join(on_meta[:4])}"
                    f"{', …' if len(on_meta) > 4 else ''}): call xpar_zoo.materialize(model) after parallelize, then "
                    "xpar_zoo.load_checkpoint (or load with xpar_zoo.from_pretrained)")
    state = parallel_state(model)
    unset = state.unset_buffers if state is not None else ()
    if unset:
        raise error(f"buffers {', '.join(sorted(unset)[:4])}{', …' if len(unset) > 4 else ''} were never initialised "
                    "(the model was built on meta and moved with to_empty): call xpar_zoo.materialize(model), which "
                    "computes them as transformers' init does")
