"""The FSDP layout of a model on a mesh, as data: which modules become FSDP units, over which mesh, sharding which
parameters on which dim, which stay gathered after forward and what each prefetches. One pure function
(:func:`fsdp_layout`) decides it; ``parallelize`` applies it and the sizer sizes it, so the two cannot drift.
No process group is needed (the sizer runs it on a meta model)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..zoo.forward_source import embedding_weight_read
from ..zoo.plan import Plan


def planned_shard_dim(rows: int, fsdp: int) -> int:
    """The dim on which FSDP2 shards a planned tensor's local slice of ``rows`` rows (its plan already split dim 0)
    over the plan's ``fsdp`` ranks: dim 0 where ``rows`` divides by ``fsdp``, else dim 1. FSDP2 gathers and
    reduce-scatters flat dim-0 chunks, so dim 0 needs no copy; dim 1 costs a chunk-cat copy through a temporary of
    the unsharded size after each all-gather and before each reduce-scatter, but lets any mesh shape compose."""
    return 0 if rows % fsdp == 0 else 1


@dataclass(frozen=True)
class PlannedModule:
    """A module whose parameters one extra plan splits on dim 0."""

    fqn: str
    plan_name: str
    style: str
    params: tuple[str, ...]  # local names on the module


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` call: the module at ``fqn`` (``""``: the root) over the dense mesh, or over the plan
    ``plan_name``'s ``[<plan>_fsdp, <plan>]`` mesh; ``params``: the parameter FQNs it manages (not those of units
    inside it); ``shard_dims``: per parameter, the dim FSDP2 shards it on (of the local slice, for planned units:
    :func:`planned_shard_dim`); empty: FSDP2's default, dim 0."""

    fqn: str
    kind: str  # "planned" | "inner" (dense weights inside a planned module) | "layer" | "edge" | "root"
    params: tuple[str, ...]
    plan_name: str | None = None
    shard_dims: tuple[int, ...] = ()
    reshard_after_forward: bool = True
    forward_prefetch: tuple[str, ...] = ()
    backward_prefetch: tuple[str, ...] = ()

    def shard_dim(self, param: str) -> int:
        """The dim FSDP2 shards parameter ``param`` (one of ``params``) on."""
        return self.shard_dims[self.params.index(param)] if self.shard_dims else 0


def _qualified(module_fqn: str, name: str) -> str:
    return f"{module_fqn}.{name}" if module_fqn else name


def edge_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of the input embedding and the output head, which become FSDP units of their own
    (torchtitan's layout): the embedding is then gathered only around its own forward and backward and the head
    only from its forward to its backward, instead of both for the whole step as parameters of the root. None when
    they are tied (one weight, so one unit: the root's); not the embedding when the model reads its weight outside
    its forward (:func:`~xpar_zoo.zoo.forward_source.embedding_weight_read`: Gemma4's pad embedding), which the root keeps
    gathered through its forward."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter, lambda: None)()
        except (NotImplementedError, AttributeError):  # models without one (e.g. a base model's head)
            module = None
        if isinstance(module, nn.Module) and module is not model and next(module.parameters(), None) is not None:
            found.append((getter, module))
    weights = [id(p) for _, m in found for p in m.parameters()]
    if len(set(weights)) != len(weights):  # tied
        return []
    found = [m for getter, m in found if getter != "get_input_embeddings" or not embedding_weight_read(model, m)]
    fqn = {id(m): n for n, m in model.named_modules()}
    return [(fqn[id(m)], m) for m in found if id(m) in fqn]


def _inside(fqn: str, parent: str) -> bool:
    return fqn.startswith(parent + ".")


def fsdp_layout(model: nn.Module, plan: Plan, planned: list[PlannedModule], *, sizes: Mapping[str, int],
                shard_size: int, reshard_after_forward: bool = True, prefetch: bool = True) -> list[FSDPUnit]:
    """The FSDP units of ``model`` in the order ``fully_shard`` must be applied (planned modules deepest first, each
    after the dense weights inside it, e.g. a norm after every expert; the decoder layers, a unit inside another
    first, e.g. a vision block inside its encoder; the embedding and the head; the root last), with their shard dims,
    reshard and prefetch decisions. ``sizes``: the active plans' sizes, ``shard_size``: the FSDP ranks of the dense
    mesh (world ÷ replicate), so a plan of size ``s`` shards its slices over ``shard_size ÷ s`` ranks:

    - each planned tensor (at its global shape on ``model``) on :func:`planned_shard_dim` of its local slice;
    - reshard after forward everywhere (``reshard_after_forward``), except the last decoder layer with its planned
      modules and the units after it (the head): backward starts with them, so resharding would only gather them
      again at once (as torchtitan does for its last layer); the root never reshards (FSDP2's own rule);
    - forward: layer i prefetches its planned modules (overlapping attention) and layer i+1; the root prefetches the
      units before the layers (the embedding) and the first layer, the last layer those after it (the head);
    - backward: layer i prefetches its planned modules, the last of those layer i-1 (layer 0's: the embedding); the
      head prefetches the last layer."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    params = list(shapes)
    claimed: set[str] = set()
    planned_fqns = {pm.fqn for pm in planned}
    planned_units = _planned_units(model, planned, shapes, claimed, sizes, shard_size)
    classes = set(plan.unit_classes(model))
    layer_fqns = [n for n, m in model.named_modules() if type(m).__name__ in classes and n not in planned_fqns]
    layers = []
    for fqn in sorted(layer_fqns, key=lambda f: -f.count(".")):  # bottom-up: a unit inside another first
        own = tuple(p for p in params if _inside(p, fqn) and p not in claimed)
        claimed.update(own)
        layers.append(FSDPUnit(fqn, "layer", own))
    edges = []
    for fqn, module in edge_units(model):
        own = tuple(_qualified(fqn, n) for n, _ in module.named_parameters())
        if fqn not in planned_fqns and not any(p in claimed for p in own):
            claimed.update(own)
            edges.append(FSDPUnit(fqn, "edge", own))
    root = FSDPUnit("", "root", tuple(p for p in params if p not in claimed))

    # Planned modules and edge units: inside each layer, or before / after all of them.
    around = [u.fqn for u in planned_units + edges if u.kind != "inner"]
    inside = {layer: sorted((f for f in around if _inside(f, layer)), key=order.get) for layer in layer_fqns}
    in_layers = {f for fs in inside.values() for f in fs}
    outside = sorted((f for f in around if f not in in_layers), key=order.get)
    before = [f for f in outside if layer_fqns and order[f] < order[layer_fqns[0]]]
    after = [f for f in outside if layer_fqns and order[f] > order[layer_fqns[-1]]]

    keep = set()
    if reshard_after_forward and layer_fqns:
        last = layer_fqns[-1]
        keep = {last, *inside[last], *after}
    forward, backward = _prefetches(layer_fqns, inside, before, after) if prefetch else ({}, {})

    def decided(u: FSDPUnit) -> FSDPUnit:
        return FSDPUnit(u.fqn, u.kind, u.params, u.plan_name, u.shard_dims,
                        reshard_after_forward=reshard_after_forward and u.kind != "root" and u.fqn not in keep,
                        forward_prefetch=tuple(forward.get(u.fqn, ())), backward_prefetch=tuple(backward.get(u.fqn, ())))

    return [decided(u) for u in planned_units + layers + edges + [root]]


def _planned_units(model: nn.Module, planned: list[PlannedModule], shapes: Mapping[str, tuple[int, ...]],
                   claimed: set[str], sizes: Mapping[str, int], shard_size: int) -> list[FSDPUnit]:
    """The planned modules' units, deepest first, each after the dense weights inside it (claimed here)."""
    planned_fqns = {pm.fqn for pm in planned}
    units = []
    for pm in sorted(planned, key=lambda p: -p.fqn.count(".")):
        own = tuple(_qualified(pm.fqn, p) for p in pm.params)  # also inside its children (an adapter wrapper's)
        # a planned module's fully_shard takes every weight inside it on its plan's mesh: dense ones go first
        for child, _ in model.get_submodule(pm.fqn).named_children():
            inner = _qualified(pm.fqn, child)
            dense = tuple(p for p in shapes if _inside(p, inner) and p not in claimed and p not in own)
            if dense and inner not in planned_fqns:
                claimed.update(dense)
                units.append(FSDPUnit(inner, "inner", dense))
        claimed.update(own)
        size = sizes[pm.plan_name]
        dims = tuple(planned_shard_dim(shapes[f][0] // size, shard_size // size) for f in own)
        units.append(FSDPUnit(pm.fqn, "planned", own, pm.plan_name, dims))
    return units


def _prefetches(layer_fqns: list[str], inside: Mapping[str, list[str]], before: list[str], after: list[str]
                ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``(forward, backward)``: the units each unit prefetches (see :func:`fsdp_layout`)."""
    forward: dict[str, list[str]] = {}
    backward: dict[str, list[str]] = {}
    for i, layer in enumerate(layer_fqns):
        own = inside[layer]
        forward[layer] = own + (layer_fqns[i + 1:i + 2] or after)
        earlier = layer_fqns[i - 1:i] if i > 0 else before[-1:]
        if own:
            backward[layer] = own
            if earlier:
                backward[own[-1]] = earlier
        elif earlier:
            backward[layer] = earlier
    if layer_fqns:
        forward[""] = before + [layer_fqns[0]]
    if after:
        backward[after[0]] = [layer_fqns[-1]]
    return forward, backward
