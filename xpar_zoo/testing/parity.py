"""Parity against single-process transformers: tiny models, data, the reference run and the parallel run.

Shared by the demo, the tests and the benchmarks so that the claim ("the parallel model equals the single-process
model") and its tolerances have one source of truth; so are the two memory measures the tests and the CPU suite
use (:func:`saved_for_backward_bytes`, :func:`live_peak_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .proofs import build_model, tiny_config  # noqa: F401  (the harness's tiny models, kept by their names here)

# fp32 tolerances: loss |Δ| and each parameter's |Δ| relative to the norm of its own update.
LOSS_TOL = 1e-5
PARAM_REL_TOL = 1e-4
# An update below this norm is rounding noise, not training: an attention key bias, whose true gradient is zero
# (softmax ignores a shift of every key), moves ~1e-13 on both sides. Errors are measured against at least this.
UPDATE_FLOOR = 1e-7


def make_batches(vocab_size: int, steps: int, world: int, batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """Token ids ``[steps, world, batch, seq]``: rank ``r`` trains on ``[step, r]``; the reference on all of a step."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (steps, world, batch, seq), generator=g)


def make_labels(data: torch.Tensor, seed: int = 7, ignore_index: int = -100) -> torch.Tensor:
    """Labels for token ids ``data [steps, world, batch, seq]`` with ``ignore_index`` masks that give the ranks
    unequal numbers of valid targets, as padding and prompt masks do in SFT: each row ignores a prefix of random
    length, and the last rank of the first step has no valid target at all. Deterministic in ``data``'s shape."""
    labels = data.clone()
    steps, world, batch, seq = data.shape
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, seq, (steps, world, batch), generator=g)
    labels[torch.arange(seq) < prefix[..., None]] = ignore_index
    if world > 1:
        labels[0, world - 1] = ignore_index
    return labels


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


OPTIMIZERS: dict[str, OptimizerFactory] = {"sgd": sgd, "adamw": adamw}


@dataclass
class RunRecord:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]  # full parameters after the last step
    local_shapes: dict[str, tuple[int, ...]]  # this rank's local shard shapes (parallel run only)
    attention_paths: dict[str, int] = field(default_factory=dict)  # sp/cp: attention calls per inner path


# The batch dimension of model inputs not batched on dim 0: position_ids, [batch, seq] or multimodal RoPE's
# [4, batch, seq] (text positions over the 3-D ones).
BATCH_DIM = {"position_ids": -2}


def step_inputs(extra: list[list[dict]] | None, step: int, rank: int | range | None = None) -> dict:
    """The extra model inputs (e.g. images: :func:`xpar_zoo.testing.modality.batches`) of ``step``:
    ``extra[step]`` holds one dict per rank; ``rank=None`` concatenates them on their batch dim for the single-process
    reference (each input over the ranks that have it), a ``range`` those of its micro-batches (a data shard of several, see :func:`train_parallel`)."""
    if not extra:
        return {}
    if isinstance(rank, int):
        return dict(extra[step][rank])
    parts = extra[step] if rank is None else [extra[step][r] for r in rank]
    keys = dict.fromkeys(k for e in parts for k in e)  # a rank without images has no pixel inputs
    return {k: torch.cat([e[k] for e in parts if k in e], dim=BATCH_DIM.get(k, 0)) for k in keys}


def train_reference(config, data: torch.Tensor, optimizer: str, max_norm: float | None, seed: int = 0,
                    labels: torch.Tensor | None = None, extra: list[list[dict]] | None = None) -> RunRecord:
    """Single-process transformers (HF's own eager experts) on every rank's data at once: the loss is the mean over
    all valid targets of the step's global batch. ``labels`` default to :func:`make_labels` of ``data``;
    ``extra``: more inputs per step and rank (:func:`step_inputs`)."""
    model = build_model(config, seed, experts_implementation="eager")
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    labels = make_labels(data) if labels is None else labels
    losses, norms = [], []
    for step in range(data.shape[0]):
        ids = data[step].reshape(-1, data.shape[-1])
        step_labels = labels[step].reshape(-1, data.shape[-1])
        loss = model(input_ids=ids, labels=step_labels, **step_inputs(extra, step)).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return RunRecord(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, {})


def train_parallel(config, data: torch.Tensor, mesh_kwargs: dict, optimizer: str, max_norm: float | None,
                   seed: int = 0, plan=None, kernels: str = "torch", checkpointing: bool = False,
                   labels: torch.Tensor | None = None, extra: list[list[dict]] | None = None,
                   inner: str | None = None, options=None) -> RunRecord:
    """The same training under xpar_zoo on ``mesh_kwargs`` (and ``plan``, default the registry's; ``inner``: the
    attention the sp/cp attention wraps, set after parallelize by :func:`xpar_zoo.set_inner_attention`; ``kernels`` for
    :func:`xpar_zoo.styles.experts.set_experts_kernels`; ``checkpointing``: transformers' activation checkpointing of every
    decoder layer; ``options``: ``parallelize``'s :class:`~xpar_zoo.ParallelOptions`): rank ``r`` trains on its own micro-batch ``data[step, r]`` (``labels`` and ``extra`` as in
    :func:`train_reference`). The recorded loss is the mean of ``out.loss`` over the ranks, which is the global
    batch's. Every rank calls it; rank 0's record is complete. With sp/cp a rank reads its data shard
    (:func:`xpar_zoo.data_shard`: ``world/count`` consecutive micro-batches of ``data[step]`` at once, the same on
    every rank of a sequence group, passed whole)."""
    from ..parallel.clip import clip_grad_norm_
    from ..parallel.mesh import Mesh
    from ..parallelize import parallelize
    from ..styles.experts import set_experts_kernels
    from ..styles.sequence import data_shard, sequence_state, set_inner_attention

    mesh = Mesh(**mesh_kwargs)
    model = build_model(config, seed)
    if checkpointing:
        model.activation_checkpointing_enable()
    model = parallelize(model, mesh, plan=plan, options=options)
    set_experts_kernels(model, kernels)
    if inner:
        set_inner_attention(model, inner)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    labels = make_labels(data) if labels is None else labels
    index, count = data_shard(model)
    per = data.shape[1] // count
    mine = range(index * per, (index + 1) * per)
    losses, norms = [], []
    for step in range(data.shape[0]):
        ids = data[step, mine.start:mine.stop].reshape(-1, data.shape[-1])
        step_labels = labels[step, mine.start:mine.stop].reshape(-1, data.shape[-1])
        loss = model(input_ids=ids, labels=step_labels, **step_inputs(extra, step, mine)).loss
        loss.backward()
        norm = clip_grad_norm_(model, max_norm if max_norm else float("inf"))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        norms.append(norm.item())
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if hasattr(p, "to_local")}
    sequence = sequence_state(model)
    paths = dict(sequence.paths) if sequence is not None else {}
    return RunRecord(losses, norms, gathered_state(model), local, paths)


def gathered_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: ``{name: full CPU tensor}`` of ``model``'s state, the names and values
    :func:`xpar_zoo.full_state_dict` gives, gathered in one collective (every rank's local shards with the global
    indices they hold, :func:`~xpar_zoo.parallel.state.held_indices`) instead of one per tensor: what the parity
    proofs compare, for hundreds of tiny models. Other ranks: ``{}``. A position no rank holds raises."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from ..parallel.state import held_indices

    rank = dist.get_rank()
    mine = {}
    for name, value in get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)).items():
        if isinstance(value, DTensor):
            mine[name] = (value.to_local().detach().cpu(), held_indices(value)[1], tuple(value.shape))
        elif rank == 0:
            mine[name] = (value.detach().cpu(), {}, tuple(value.shape))
    parts: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return {}
    full: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for part in parts:
        for name, (local, held, shape) in part.items():
            if name not in full:
                full[name] = (local.new_empty(shape), torch.zeros(shape, dtype=torch.bool))
            flat = _global_flat_index(local.shape, held, shape)
            full[name][0].view(-1)[flat] = local.reshape(-1)
            full[name][1].view(-1)[flat] = True
    for name, (_, seen) in full.items():
        if not seen.all():
            raise AssertionError(f"{name}: {int((~seen).sum())} positions held by no rank")
    return {name: tensor for name, (tensor, _) in full.items()}


def _global_flat_index(local_shape, held: dict[int, torch.Tensor], shape) -> torch.Tensor:
    """The flat index into a tensor of ``shape`` of each element of a local shard of ``local_shape`` that holds the
    global indices ``held[d]`` of each sharded dim ``d`` (all of an unsharded one), flattened in the shard's order."""
    flat = torch.zeros((), dtype=torch.long)
    stride = 1
    for d in reversed(range(len(shape))):
        index = held[d] if d in held else torch.arange(local_shape[d])
        view = [1] * len(shape)
        view[d] = -1
        flat = flat + index.reshape(view).long() * stride
        stride *= shape[d]
    return flat.expand(tuple(local_shape)).reshape(-1)


def forward_reference(config, data: torch.Tensor, seed: int = 0, labels: torch.Tensor | None = None,
                      extra: list[list[dict]] | None = None) -> tuple[float, float]:
    """One forward without gradients of single-process transformers on step 0's global batch (for an attention
    that has no backward here, e.g. flex on CPU): ``(loss, sum of the squared logits over every token)``."""
    model = build_model(config, seed, experts_implementation="eager")
    labels = make_labels(data) if labels is None else labels
    with torch.no_grad():
        out = model(input_ids=data[0].reshape(-1, data.shape[-1]), labels=labels[0].reshape(-1, data.shape[-1]),
                    **step_inputs(extra, 0))
    return out.loss.item(), out.logits.double().square().sum().item()


def forward_parallel(config, data: torch.Tensor, mesh_kwargs: dict, seed: int = 0,
                     labels: torch.Tensor | None = None, extra: list[list[dict]] | None = None) -> tuple[float, float]:
    """:func:`forward_reference` under xpar_zoo on ``mesh_kwargs`` (each rank its data shard, as in
    :func:`train_parallel`): the loss is the mean of ``out.loss`` over the ranks (the global batch's), the squared
    logits are summed over the ranks' own tokens (every token of the global batch once)."""
    from ..parallel.mesh import Mesh
    from ..parallelize import parallelize
    from ..styles.sequence import data_shard
    from ..styles.vocab import full_logits

    model = parallelize(build_model(config, seed), Mesh(**mesh_kwargs))
    labels = make_labels(data) if labels is None else labels
    index, count = data_shard(model)
    per = data.shape[1] // count
    mine = range(index * per, (index + 1) * per)
    with torch.no_grad(), full_logits(model):
        out = model(input_ids=data[0, mine.start:mine.stop].reshape(-1, data.shape[-1]),
                    labels=labels[0, mine.start:mine.stop].reshape(-1, data.shape[-1]), **step_inputs(extra, 0, mine))
    # the ranks of a sequence group hold disjoint tokens of the same rows, the groups disjoint rows
    sums = torch.stack([out.loss.double(), out.logits.double().square().sum()])
    dist.all_reduce(sums)
    return sums[0].item() / dist.get_world_size(), sums[1].item()


def compare_meshes(config, world: int, meshes: dict[str, dict], adamw_meshes=(), plans: dict | None = None
                   ) -> dict[str, dict]:
    """Every rank: one SGD(lr=1) step on each mesh (and 3 AdamW steps clipped at 0.5 on ``adamw_meshes``), the
    same data as single-process transformers. Per mesh: this rank's local shard shapes (``local``) and, on rank 0,
    ``loss`` / ``norm`` pairs (parallel, reference) and per-parameter ``errors`` (``adamw_*`` likewise)."""
    rank = dist.get_rank()
    plans = plans or {}
    before = build_model(config).state_dict()
    runs = {"": (make_batches(config.vocab_size, 1, world, seed=1), "sgd", None),
            "adamw_": (make_batches(config.vocab_size, 3, world, seed=2), "adamw", 0.5)}
    refs = {key: train_reference(config, data, opt, clip) if rank == 0 else None
            for key, (data, opt, clip) in runs.items() if key == "" or adamw_meshes}
    results = {}
    for name, mesh_kwargs in meshes.items():
        row = {}
        for key, (data, opt, clip) in runs.items():
            if key and name not in adamw_meshes:
                continue
            rec = train_parallel(config, data, mesh_kwargs, opt, clip, plan=plans.get(name))
            if not key:
                row["local"] = rec.local_shapes
            if rank == 0:
                ref = refs[key]
                row.update({f"{key}loss": (rec.losses, ref.losses), f"{key}norm": (rec.grad_norms, ref.grad_norms),
                            f"{key}errors": param_errors(rec.params, ref.params, before)})
        results[name] = row
    return results


def param_errors(par: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], before: dict[str, torch.Tensor]
                 ) -> dict[str, float]:
    """Per parameter: ``|p_par − p_ref| / max(|p_ref − p_before|, UPDATE_FLOOR)``.

    The difference first loses one fp32 rounding step's worth, ``eps·|p_ref|``: two runs whose gradients agree to
    1e-7 can still store ``p − lr·g`` one ulp apart, and for a norm weight near 1.0 with an update of 1e-3 that ulp
    alone would read as 1e-4. A real error (a wrong gradient scale, a missing contribution) is of the order of the
    update itself and is not hidden by it."""
    missing = set(ref) ^ set(par)
    if missing:
        raise AssertionError(f"parameter names differ from the reference: {sorted(missing)}")
    eps = torch.finfo(torch.float32).eps
    out = {}
    for name, r in ref.items():
        p = par[name]
        if p.shape != r.shape:
            raise AssertionError(f"{name}: parallel shape {tuple(p.shape)} vs reference {tuple(r.shape)}")
        if not r.is_floating_point():  # an integer buffer (e.g. a hash-routing table): equal or wrong
            out[name] = 0.0 if torch.equal(p, r) else float("inf")
            continue
        update = (r - before[name]).norm().item()
        diff = max(0.0, (p - r).norm().item() - eps * r.norm().item())
        out[name] = diff / max(update, UPDATE_FLOOR)
    return out


def assert_losses_match(par: list[float], ref: list[float], what: str = "") -> None:
    """Every step's loss within :data:`LOSS_TOL` of the single-process one."""
    for step, (a, b) in enumerate(zip(par, ref, strict=True), 1):
        if not abs(a - b) < LOSS_TOL:
            raise AssertionError(f"{what} step {step}: loss {a} vs single-process {b}")


def assert_norms_match(par: list[float], ref: list[float], what: str = "") -> None:
    """Every step's total gradient norm within 1e-5 (relative) of the single-process one."""
    for step, (a, b) in enumerate(zip(par, ref, strict=True), 1):
        if not abs(a - b) <= 1e-5 * b:
            raise AssertionError(f"{what} step {step}: grad norm {a} vs single-process {b}")


def assert_params_match(errors: dict[str, float], what: str = "") -> None:
    """Every parameter within :data:`PARAM_REL_TOL` of its update (see :func:`param_errors`)."""
    name, worst = max(errors.items(), key=lambda kv: kv[1])
    if not worst < PARAM_REL_TOL:
        raise AssertionError(f"{what} {name}: relative error {worst:.2e}")


# ---- memory measures -----------------------------------------------------------------------------------------------

def saved_for_backward_bytes(fn: Callable[[], object], exclude=()) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs, those of ``exclude``
    (e.g. the model's parameters) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def live_peak_bytes(fn: Callable[[], object], trace_path: str) -> int:
    """The peak of live CPU tensor bytes during ``fn()`` above those live when it starts, from the torch profiler's
    allocator accounting (its ``[memory]`` events' running total, read from a chrome trace written to
    ``trace_path`` and removed; the CPU analogue of ``torch.cuda.max_memory_allocated``): what the code asks for,
    whatever glibc keeps mapped afterwards."""
    import json
    import os

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    os.unlink(trace_path)
    if not events:
        return 0
    events.sort(key=lambda e: e["ts"])
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - start


def clip_grad_norm_per_tensor(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """:func:`xpar_zoo.clip_grad_norm_` as it was computed before issue 29, one tensor at a time (each local piece's
    norm to the power ``norm_type``, divided by its copies, added up in fp32; then every piece scaled alone): the
    reference its batched computation is held to (tests/distributed/test_clip_batched.py, bench/host_cost.py)."""
    import math

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    def copies(g) -> int:
        if not isinstance(g, DTensor):
            return dist.get_world_size() if dist.is_initialized() else 1
        return math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements) if isinstance(p, Replicate))

    def local(g):
        return g.to_local() if isinstance(g, DTensor) else g

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm_type = float(norm_type)
    acc = torch.zeros((), dtype=torch.float32, device=local(grads[0]).device if grads else "cpu")
    for g in grads:
        piece = local(g).detach().float()
        if piece.numel() == 0:
            continue
        if math.isinf(norm_type):
            acc = torch.maximum(acc, piece.abs().max())
        else:
            acc = acc + piece.norm(norm_type) ** norm_type / copies(g)
    if dist.is_initialized():
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total = acc if math.isinf(norm_type) else acc ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        piece = local(g)
        piece.mul_(coef.to(piece.device, piece.dtype))
    return total
