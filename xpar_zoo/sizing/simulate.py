"""``xpar-zoo size … --simulate``: the real code on one rank of a simulated world of N ranks, in one process.

torch's fake process group stands in for the N-rank world (every collective returns at once, with the right
shapes), the model is built on the meta device from the real config, ``parallelize`` runs with the requested mesh,
the model is materialised as fake tensors (``FakeTensorMode``: shapes, dtypes and storages, no data) and one
training step (forward and backward on ``micro_batch × seq`` tokens, :func:`~xpar_zoo.clip_grad_norm_`, AdamW)
runs twice under torch's FSDP memory tracker; the second step's peak is the simulated per-rank peak (the first
makes the optimizer's states).

What a world of fake tensors cannot run, and how it is handled (docs/design.md, "Sizing"): the router's choices
and the token ids have no values, so the EP and ``emb`` all-to-alls take fixed routes
(:class:`~xpar_zoo.styles.routes.Routes`: balanced, or the busiest rank receiving ``route_imbalance`` times the mean);
the tensors live on the CPU device (torch's CPU build aborts on fake CUDA tensors inside sdpa), and the choices
that depend on the device are set to a GPU's: the fused loss's chunk, the sp/cp attention's block budget,
FSDP2's own collectives in place of the CPU's in-place gloo ones, and sdpa's kernel where the value heads are
narrower than the query/key heads (MLA: :func:`gpu_sdpa_forward`, the memory-efficient kernel, where the CPU would
keep the whole scores); torch's fake ``grouped_mm`` takes bf16 only, so routed experts simulate in bf16 or fp16
compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..compat import efficient_attention, fake_process_group_store, fake_tensor_mode, fsdp_memory_tracker
from ..errors import PlanError
from ..loss.fused import CE_CHUNK_ELEMENTS
from ..parallel.options import ATTENTION_BLOCK_MIB_ACCELERATOR, ParallelOptions
from ..styles.experts import experts_modules
from ..styles.routes import Routes, install_routes
from ..styles.vocab import fused_heads, vocab_parallel_embeddings
from . import estimator as sizing


def gpu_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa as a GPU runs it: where the value heads are narrower than the query/key heads (MLA) and
    there is no mask, the memory-efficient kernel (the one a GPU's sdpa dispatches to there: flash needs equal
    widths), which keeps no scores; the CPU's sdpa has no fused kernel for unequal widths and would take its math
    path, keeping ``[heads, seq, seq]`` per layer. Elsewhere transformers' own sdpa (its CPU flash kernel keeps
    what a GPU's does: the output and the log-sum-exp)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if query.shape[-1] == value.shape[-1] or attention_mask is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = efficient_attention(query, key, value, bool(causal) and query.shape[2] > 1, scaling)
    return out.transpose(1, 2).contiguous(), None


class KernelFootprint(torch.autograd.Function):
    """A fused attention kernel's memory without its arithmetic (fake tensors have no values to compute): forward
    makes the output ``[b, heads, q, d_v]`` and the fp32 log-sum-exp and keeps q, k, v, the output and the
    log-sum-exp for backward, which makes their gradients: what flex attention's kernels keep and make (the output
    laid out as the query is, as flex lays it out: transformers' ``[b, q, heads, d]`` view of it is free)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        b, heads, q, _ = query.shape
        if query.stride(1) < query.stride(2):  # heads inside the sequence, as transformers' transposed query
            out = query.new_empty((b, q, heads, value.shape[-1])).transpose(1, 2)
        else:
            out = query.new_empty((b, heads, q, value.shape[-1]))
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def gpu_flex_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, s_aux: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' flex attention as a GPU runs it, by its footprint (:class:`KernelFootprint`: the key/value
    heads as they are), with transformers' own steps around the kernel: the attention sinks' renormalisation by the
    log-sum-exp (gpt-oss) and the ``[b, q, heads, d]`` layout for the output projection. The real kernel cannot run
    here: its block mask is built by a compiled function, which crashes on fake tensors, and on CPU transformers
    refuses sinks."""
    out, lse = KernelFootprint.apply(query, key, value)
    if s_aux is not None:
        lse = lse.to(value.dtype)[..., None]
        sinks = s_aux.view(1, -1, 1, 1).expand(*lse.shape)
        out = (out * torch.exp(lse - torch.logsumexp(torch.cat([lse, sinks], dim=-1), dim=-1, keepdim=True)))
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


# sdpa on plain rows, as a real run has it: transformers cannot tell from fake position ids that the rows are not
# packed and would build a block-causal mask (and repeat the key/value heads for it); under a name of its own that
# has no mask function, it builds none and sdpa runs causal, as on real plain rows, by a GPU's kernels
PLAIN_ROWS_SDPA = "xpar_zoo_simulated_sdpa"
AttentionInterface.register(PLAIN_ROWS_SDPA, gpu_sdpa_forward)
# flex attention, by the same token without a mask function (the kernel's footprint takes none)
SIMULATED_FLEX = "xpar_zoo_simulated_flex"
AttentionInterface.register(SIMULATED_FLEX, gpu_flex_forward)
SIMULATED_ATTENTION = {"sdpa": PLAIN_ROWS_SDPA, "flex_attention": SIMULATED_FLEX}

KINDS = ("parameters", "gradients", "optimizer states", "activations", "temporaries")
# torch's tracker categories (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType values) by our kind
TRACKER_KINDS = {
    "Sharded Param": "parameters", "Unsharded Param": "parameters", "Buffer": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "OptState": "optimizer states",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "All Gather": "temporaries", "Reduce Scatter": "temporaries",
}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEVICE_NOTE = ("fake tensors on the CPU device (torch's CPU build cannot run sdpa on fake CUDA tensors), with a "
               "GPU's choices: FSDP2's own collectives, the fused loss's chunk, the sp/cp attention's block budget, "
               "lower-right cp and the memory-efficient sdpa kernel for unequal query/value head widths")


def gpu_path_options(options: ParallelOptions | None = None) -> ParallelOptions:
    """``options`` with a GPU's defaults where they leave the choice to the device (the block budget, cp's
    lower-right sdpa) and FSDP2's own collectives: what the simulation runs and the estimate beside it sizes."""
    options = options or ParallelOptions()
    return options.replace(cpu_collectives="gloo", cp_attention=options.cp_attention or "lower_right",
                           attention_block_mib=options.attention_block_mib or ATTENTION_BLOCK_MIB_ACCELERATOR)


@dataclass
class Simulation:
    """The simulated per-rank peak of one training step (bytes), by kind (:data:`KINDS`), and how it was made."""

    peak_bytes: int
    by_kind: dict[str, int]
    routing: str
    device: str = DEVICE_NOTE
    seconds: float = 0.0
    tracker: dict[str, int] = field(default_factory=dict)  # the peak by torch's tracker categories

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "by_kind": self.by_kind, "routing": self.routing,
                "device": self.device, "seconds": round(self.seconds, 1), "tracker": self.tracker}


def routing_description(imbalance: float) -> str:
    if imbalance == 1.0:
        return "routing simulated as balanced (every rank receives the tokens it sends, spread evenly over experts)"
    return f"routing simulated as imbalanced: this rank is the busiest, receiving {imbalance:g}x the mean tokens"


def fake_world(world: int) -> None:
    """Make this process rank 0 of a fake process group of ``world`` ranks, reusing one of that size (torch caches
    DTensor layouts by mesh equality while ``fully_shard`` wants the very mesh objects: a second group of the same
    size would meet the first one's meshes); a fake group of another size is replaced."""
    if dist.is_initialized():
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=world)


def check_simulation(config, param_dtype: str, route_imbalance: float) -> None:
    """One line before any work for what the simulation cannot run."""
    if route_imbalance < 1.0:
        raise PlanError(f"--route-imbalance {route_imbalance:g}: the busiest rank receives at least the mean (>= 1)")
    experts = getattr(config, "num_experts_per_tok", 0)
    if experts and param_dtype == "fp32":
        raise PlanError("--simulate with --dtype fp32: torch's fake grouped_mm (the routed experts' GEMM) takes bf16 "
                        "only; simulate with --dtype bf16 (the estimate alone sizes fp32)")
    if dist.is_initialized() and dist.get_backend() != "fake":
        raise PlanError("--simulate runs its own fake world of ranks: call it in a process without a process group")


def simulate(config, world: int, sizes: dict[str, int] | None = None, replicate: int = 1, *, micro_batch: int = 1,
             seq: int = 4096, param_dtype: str = "bf16", optimizer: str = "adamw", recompute: bool = False,
             attention: str = "sdpa", sp: int = 1, cp: int = 1, lora_rank: int | None = None,
             lora_modules: list[str] | str | None = None, lora_parameters: list[str] | None = None,
             options: ParallelOptions | None = None, route_imbalance: float = 1.0) -> Simulation:
    """Run one rank (rank 0) of a ``world``-rank mesh (``sizes``, ``replicate``, ``sp``/``cp``) on ``config``'s model
    for one training step under fake tensors and torch's FSDP memory tracker; the arguments are
    :func:`~xpar_zoo.sizing.estimate`'s (checked the same way first); ``options`` as
    :func:`gpu_path_options` completes them. See the module docstring."""
    sizes = {k: v for k, v in (sizes or {}).items() if v > 1}
    options = gpu_path_options(options)
    sizing.estimate(config, world, sizes, replicate, micro_batch=micro_batch, seq=seq, param_dtype=param_dtype,
                    sp=sp, cp=cp, attention=attention, options=options)  # its checks: one line before any work
    check_simulation(config, param_dtype, route_imbalance)
    if optimizer not in ("adamw", "adam", "sgd", "sgd_momentum"):
        raise PlanError(f"optimizer {optimizer!r} is not one of adamw, adam, sgd, sgd_momentum")
    start = time.perf_counter()
    fake_world(world)
    model = _parallel_model(config, sizes, replicate, sp, cp, param_dtype, attention, recompute,
                            lora_rank, lora_modules, lora_parameters, options)
    install_routes([*experts_modules(model), *vocab_parallel_embeddings(model), *fused_heads(model)],
                   Routes(route_imbalance))
    tracker = _tracked_steps(model, micro_batch, seq, optimizer)
    by_kind = dict.fromkeys(KINDS, 0)
    for category, nbytes in tracker.items():
        if category in TRACKER_KINDS:
            by_kind[TRACKER_KINDS[category]] += nbytes
    return Simulation(tracker.get("Total", sum(by_kind.values())), by_kind, routing_description(route_imbalance),
                      seconds=time.perf_counter() - start, tracker=tracker)


def _parallel_model(config, sizes, replicate, sp, cp, param_dtype, attention, recompute, lora_rank, lora_modules,
                    lora_parameters, options) -> nn.Module:
    """The model as ``xpar-zoo train`` builds it, on meta: fp32 master weights, the compute dtype by FSDP2's mixed
    precision, the attention and recompute settings, LoRA where asked."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ..parallel.mesh import Mesh
    from ..parallelize import parallelize
    from ..styles.sequence import set_inner_attention
    from ..styles.vocab import set_loss_chunk
    from ..zoo.registry import get_plan

    model = sizing.meta_model(config)
    plan = get_plan(config.model_type, config)
    if lora_rank is not None:
        from ..styles.lora import lora_meta_model

        model, plan = lora_meta_model(model, plan, lora_rank, lora_modules, lora_parameters)
    if sp * cp == 1:
        model.set_attn_implementation(attention)  # refused here as in a real run where the model lacks it
        if attention in SIMULATED_ATTENTION:
            model.set_attn_implementation(SIMULATED_ATTENTION[attention])
    compute = COMPUTE_DTYPES[param_dtype]
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute != torch.float32 else False
    mesh = Mesh(extra=sizes, replicate=replicate, sp=sp, cp=cp, device_type="cpu")
    model = parallelize(model, mesh, mixed_precision=policy, options=options)
    set_loss_chunk(model, CE_CHUNK_ELEMENTS["cuda"])
    model.train()
    model.config.use_cache = False
    if sp * cp > 1:
        set_inner_attention(model, attention)
    if recompute:
        model.activation_checkpointing_enable()
    return model


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name in ("adamw", "adam"):
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "sgd_momentum" else 0.0, foreach=False)


def _tracked_steps(model: nn.Module, micro_batch: int, seq: int, optimizer: str) -> dict[str, int]:
    """Materialise ``model`` as fake tensors and run two training steps under torch's FSDP memory tracker; the
    second step's peak (``"Total"``) and its parts by the tracker's categories."""
    from ..parallel.clip import clip_grad_norm_
    from ..parallel.materialize import materialize

    with fake_tensor_mode():
        materialize(model, device="cpu")
        opt = _optimizer(model, optimizer)
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        # untracked: it makes the optimizer's states, and DTensor's first sharding propagation of each op runs
        # that op on whole (unsharded) fake tensors in this fake mode, which a tracker would count as this
        # rank's memory (up to a whole [E, H, I] tensor); the second step finds every propagation cached
        step()
        tracker = fsdp_memory_tracker(model, opt)
        tracker.track_inputs((ids,))
        with tracker:
            step()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    return {str(getattr(category, "value", category)): int(nbytes) for category, nbytes in peak.items()}
