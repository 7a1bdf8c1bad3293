"""Bad input to the core gets a clear error, the same on every rank, before any weight is touched."""

import pytest
import torch

import xpar_zoo
from xpar_zoo.testing import launch, parity


def _other_model_on_rank_1(model):
    import torch.distributed as dist

    return parity.build_model(parity.tiny_config(num_hidden_layers=3)) if dist.get_rank() == 1 else model


def _ep_of_rank(rank: int) -> int:
    return 2 if rank != 2 else 4


def _options_of_rank(model):
    """Rank 1 keeps the hybrid mixers' whole rows, the others recompute them: different collectives in backward."""
    options = xpar_zoo.ParallelOptions(mixer_recompute=torch.distributed.get_rank() != 1)
    return xpar_zoo.parallelize(model, xpar_zoo.Mesh(ep=2), options=options)


def _rank_1_environment(value: str):
    """A setup in which parallelize reads the environment's defaults (no options) and rank 1's
    XPAR_ZOO_MIXER_RECOMPUTE is ``value``."""
    def attempt(model):
        import os

        if torch.distributed.get_rank() == 1:
            os.environ["XPAR_ZOO_MIXER_RECOMPUTE"] = value
        try:
            return xpar_zoo.parallelize(model, xpar_zoo.Mesh(ep=2))
        finally:
            os.environ.pop("XPAR_ZOO_MIXER_RECOMPUTE", None)
    return attempt


def _options_on_ranks_but_1(model):
    """set_parallel_options on another model, given options on every rank but rank 1 (the trainer's path)."""
    from xpar_zoo.parallelize import set_parallel_options

    other = xpar_zoo.parallelize(parity.build_model(parity.tiny_config()), xpar_zoo.Mesh(ep=2))
    options = None if torch.distributed.get_rank() == 1 else xpar_zoo.ParallelOptions(mixer_recompute=False)
    set_parallel_options(other, options)


# Each case: the bad setup, given the (tiny, real) model; it must raise before the model is touched.
ATTEMPTS = {
    "ep3_world4": lambda model: xpar_zoo.Mesh(ep=3),
    "ep8_world4": lambda model: xpar_zoo.Mesh(ep=8),
    "unknown_plan": lambda model: xpar_zoo.parallelize(model, xpar_zoo.Mesh(foo=2)),
    "experts_6_ep4": lambda model: xpar_zoo.parallelize(model, xpar_zoo.Mesh(ep=4)),
    "replicate3": lambda model: xpar_zoo.Mesh(replicate=3),
    "ep4_replicate2": lambda model: xpar_zoo.Mesh(ep=4, replicate=2),
    "ranks_disagree_on_mesh": lambda model: xpar_zoo.Mesh(ep=_ep_of_rank(torch.distributed.get_rank())),
    "ranks_disagree_on_model": lambda model: xpar_zoo.parallelize(_other_model_on_rank_1(model), xpar_zoo.Mesh(ep=2)),
    "from_lists_mismatch": lambda model: xpar_zoo.Mesh.from_lists(sizes=[2, 2], names=["ep"]),
    "ranks_disagree_on_options": _options_of_rank,
    "ranks_disagree_on_the_environment": _rank_1_environment("0"),  # another default than the other ranks'
    "bad_environment_on_one_rank": _rank_1_environment("maybe"),  # no option parses it: every rank raises it
    "options_on_some_ranks_only": _options_on_ranks_but_1,
}


def _attempt(kind: str) -> str:
    """Run one bad setup on this rank; return the error text (or "no error")."""
    cfg = parity.tiny_config("qwen3_moe", num_experts=6) if kind == "experts_6_ep4" else parity.tiny_config()
    model = parity.build_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        ATTEMPTS[kind](model)
        return "no error"
    except xpar_zoo.XparError as e:
        untouched = all(not isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()) and all(
            torch.equal(v, before[k]) for k, v in model.state_dict().items())
        return f"{type(e).__name__}: {e}" + ("" if untouched else " [MODEL WAS MODIFIED]")


def _job(kinds):
    import torch.distributed as dist

    out = {}
    for kind in kinds:
        msg = _attempt(kind)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, msg)
        out[kind] = gathered
    return out


CASES = {
    "ep3_world4": ["MeshError", "plan 'ep' of size 3 does not divide the dense shard size 4"],
    "ep8_world4": ["MeshError", "plan 'ep' of size 8 is larger than the world (4 ranks)"],
    "unknown_plan": ["PlanError", "['foo']", "qwen3_moe", "its plans: ep"],
    "experts_6_ep4": ["PlanError", "model.layers.0.mlp.experts.gate_up_proj has 6 experts", "ep=4"],
    "replicate3": ["MeshError", "replicate=3 does not divide the world size 4"],
    "ep4_replicate2": ["MeshError", "plan 'ep' of size 4 does not divide the dense shard size 2"],
    "from_lists_mismatch": ["MeshError", "same length"],
    "ranks_disagree_on_mesh": ["MeshError", "ranks were given different mesh arguments", "rank 2 has ({'ep': 4}"],
    "ranks_disagree_on_model": ["PlanError", "ranks were given different parallelize arguments: model and plan",
                                "rank 1 has"],
    "ranks_disagree_on_options": ["PlanError", "ranks were given different parallelize arguments: mixer_recompute: "
                                  "rank 0 has {'mixer_recompute': True}, rank 1 has {'mixer_recompute': False}"],
    "ranks_disagree_on_the_environment": ["PlanError", "different parallelize arguments: mixer_recompute: rank 0 has "
                                          "{'mixer_recompute': True}, rank 1 has {'mixer_recompute': False}"],
    "bad_environment_on_one_rank": ["PlanError", "XPAR_ZOO_MIXER_RECOMPUTE", "maybe"],
    "options_on_some_ranks_only": ["PlanError", "ranks were given different options: rank 0 has ParallelOptions(",
                                   "rank 1 has None"],
}


@pytest.fixture(scope="module")
def errors():
    return launch.run(_job, 4, list(CASES))


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_input_gets_a_clear_error_on_every_rank_before_weights_change(errors, kind):
    messages = errors[kind]
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    msg = messages[0]
    assert "MODEL WAS MODIFIED" not in msg
    for part in CASES[kind]:
        assert part in msg, f"{part!r} not in {msg!r}"



def test_mesh_needs_an_initialised_process_group():
    with pytest.raises(xpar_zoo.MeshError, match="init_process_group"):
        xpar_zoo.Mesh(ep=2)
