"""FSDP2 shards a planned tensor's local slice on dim 0 where it divides by ``<plan>_fsdp`` and on dim 1 where it
does not, decided per tensor (:func:`xpar_zoo.parallel.fsdp_layout.planned_shard_dim`). Training equals single-process
transformers on both placements (4 gloo ranks, fp32), and checkpoints reshard across them on different world sizes.

The meshes of tests/distributed/test_parity.py and the zoo hold 8 experts and 128 vocab rows, whose slices divide: dim
0. Here 6 experts and 126 vocab rows give ``ep=2`` / ``emb=2`` / ``head=2`` slices of 3 experts and 63 rows over 2 FSDP
ranks: dim 1; and one module holds tensors of both kinds."""

import logging
from pathlib import Path

import pytest
import torch

import xpar_zoo
from support.placement_models import DIM1, EMB, EXPERTS, HEAD, LOW_RANK_PLAN, O_PROJ, RANK, WORLD, with_low_rank
from xpar_zoo.checkpoint import checkpoint_name
from xpar_zoo.testing import launch, parity


# ---- training on dim 1 and on both (4 ranks) ---------------------------------------------------------------------
class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _gather_warnings(directory: str) -> dict:
    """full_state_dict and save_pretrained of a model whose experts FSDP2 shards on dim 0 (``_StridedShard``): torch
    logs no "may give inconsistent results" warning for those exact all-gathers, and the state is the model's.
    (Run first in the job: torch warns once per mesh and process.)"""
    import torch.distributed as dist

    logger, recorder = logging.getLogger("torch.distributed.tensor._redistribute"), _Recorder()
    logger.addHandler(recorder)
    try:
        cfg = parity.tiny_config("qwen3_moe")
        model = xpar_zoo.parallelize(parity.build_model(cfg, seed=4), xpar_zoo.Mesh(ep=2))
        dims = {type(p).__name__ for p in model.get_parameter(f"{EXPERTS}.gate_up_proj").placements}
        state = xpar_zoo.full_state_dict(model)
        model.save_pretrained(directory, progress=False)
    finally:
        logger.removeHandler(recorder)
    if dist.get_rank() != 0:
        return {}
    want = parity.build_model(cfg, seed=4).state_dict()
    return {"placements": dims, "warnings": recorder.lines,
            "differ": sorted(n for n, t in want.items() if not torch.equal(state[n], t))}


def _train_job(hub_dir: str) -> dict:
    import torch.distributed as dist

    out = {"gathers": _gather_warnings(hub_dir + "-saved")}
    out["loaded"] = _load_hub_checkpoint(hub_dir)
    out.update({"qwen3_moe": parity.compare_meshes(
        parity.tiny_config("qwen3_moe", **DIM1), WORLD, {"ep2": {"ep": 2}, "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2}},
        adamw_meshes=("ep2_emb2_head2",))})
    # gpt-oss: transposed experts with 2-D biases, all on dim 1
    out["gpt_oss"] = parity.compare_meshes(parity.tiny_config("gpt_oss", num_local_experts=6), WORLD,
                                           {"ep2": {"ep": 2}})
    # one unit, both dims: the low-rank o_proj under a user plan, beside dim-1 experts
    build = parity.build_model
    parity.build_model = lambda *args, **kwargs: with_low_rank(build(*args, **kwargs))
    try:
        out["lowrank"] = parity.compare_meshes(
            parity.tiny_config("qwen3_moe", num_experts=6), WORLD, {"ep2_lowrank2": {"extra": {"ep": 2, "lowrank": 2}}},
            adamw_meshes=("ep2_lowrank2",), plans={"ep2_lowrank2": LOW_RANK_PLAN})
    finally:
        parity.build_model = build
    # the decision is logged (debug) by parallelize
    logger, recorder = logging.getLogger("xpar_zoo.parallelize"), _Recorder()
    logger.addHandler(recorder)
    logger.setLevel(logging.DEBUG)
    try:
        xpar_zoo.parallelize(with_low_rank(parity.build_model(parity.tiny_config("qwen3_moe", **DIM1))),
                             xpar_zoo.Mesh(extra={"ep": 2, "emb": 2, "lowrank": 2}), plan=LOW_RANK_PLAN)
    finally:
        logger.removeHandler(recorder)
    out["log"] = recorder.lines
    out["regions"] = _regions()
    return out if dist.get_rank() == 0 else None


def _load_hub_checkpoint(directory: str) -> dict:
    """``from_pretrained`` of a hub-format (per-expert) checkpoint into dim-1 shards: each rank reads its half of
    ``[gate; up]`` and of every vocab row's width. Rank 0 gets whether every tensor equals the saved one."""
    import torch.distributed as dist

    cfg = parity.tiny_config("qwen3_moe", **DIM1)
    if dist.get_rank() == 0:
        parity.build_model(cfg, seed=3).save_pretrained(directory)
    dist.barrier()
    model = xpar_zoo.from_pretrained(directory, mesh=xpar_zoo.Mesh(ep=2, emb=2, head=2), progress=False)
    local = tuple(model.get_parameter(f"{EXPERTS}.gate_up_proj").to_local().shape)
    state = xpar_zoo.full_state_dict(model)
    if dist.get_rank() != 0:
        return {}
    want = parity.build_model(cfg, seed=3).state_dict()
    return {"local": local, "differ": sorted(n for n, t in want.items() if not torch.equal(state[n], t))}


def _regions() -> list:
    """Every rank's :func:`~xpar_zoo.parallel.state.local_region` of an ``[8, 3]`` DTensor on a 2 × 2 mesh: as FSDP2 shards
    an ep slice on dim 0 (strided over the first mesh dim, then split over the second), and interleaved."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from xpar_zoo.parallel.state import local_region

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "ep"))
    out = []
    for placements in [(_StridedShard(0, split_factor=2), Shard(0)), (Shard(0), _StridedShard(0, split_factor=2))]:
        dt = DTensor.from_local(torch.zeros(2, 3), mesh, placements, run_check=False, shape=(8, 3), stride=(3, 1))
        try:
            out.append(local_region(dt)[1])
        except xpar_zoo.LoadError as e:
            out.append(str(e))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, out)
    return gathered


def zoo_job(tmp_path_factory) -> tuple:
    """This module's job in the zoo's one 4-rank run (``zoo_proofs`` in tests/conftest.py), which runs beside the
    other tests."""
    return _train_job, (str(tmp_path_factory.mktemp("hub")),)


@pytest.fixture(scope="module")
def trained(zoo_proofs):
    return zoo_proofs[__name__]


CASES = [("qwen3_moe", "ep2"), ("qwen3_moe", "ep2_emb2_head2"), ("gpt_oss", "ep2"), ("lowrank", "ep2_lowrank2")]


@pytest.mark.parametrize("model,mesh", CASES)
def test_sgd_step_on_dim1_and_mixed_units_matches_single_process(trained, model, mesh):
    row = trained[model][mesh]
    parity.assert_losses_match(*row["loss"], what=f"{model} on {mesh}")
    parity.assert_norms_match(*row["norm"], what=f"{model} on {mesh}")
    parity.assert_params_match(row["errors"], what=f"{model} on {mesh}, one SGD step:")


@pytest.mark.parametrize("model,mesh", [("qwen3_moe", "ep2_emb2_head2"), ("lowrank", "ep2_lowrank2")])
def test_three_clipped_adamw_steps_on_dim1_and_mixed_units_match_single_process(trained, model, mesh):
    row = trained[model][mesh]
    parity.assert_losses_match(*row["adamw_loss"], what=f"{model} on {mesh}")
    parity.assert_norms_match(*row["adamw_norm"], what=f"{model} on {mesh}")
    parity.assert_params_match(row["adamw_errors"], what=f"{model} on {mesh}, 3 AdamW steps:")


def test_local_shards_show_the_placement(trained):
    cfg = parity.tiny_config("qwen3_moe", **DIM1)
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    local = trained["qwen3_moe"]["ep2_emb2_head2"]["local"]
    assert local[f"{EXPERTS}.gate_up_proj"] == (3, I, H)  # 3 experts of 6, half of dim 1
    assert local[f"{EXPERTS}.down_proj"] == (3, H // 2, I)
    assert local[EMB] == local[HEAD] == (63, H // 2)
    gpt = parity.tiny_config("gpt_oss", num_local_experts=6)
    local = trained["gpt_oss"]["ep2"]["local"]
    assert local[f"{EXPERTS}.gate_up_proj"] == (3, gpt.hidden_size // 2, 2 * gpt.intermediate_size)
    assert local[f"{EXPERTS}.gate_up_proj_bias"] == (3, gpt.intermediate_size)
    local = trained["lowrank"]["ep2_lowrank2"]["local"]
    assert local[f"{O_PROJ}.weight"] == (8, H) and local[f"{O_PROJ}.up"] == (8, RANK)  # 16 rows each, dim 0
    assert local[f"{O_PROJ}.down"] == (3, H // 2)  # 3 rows, dim 1


def test_from_pretrained_fills_dim1_shards_from_per_expert_hub_files(trained):
    cfg = parity.tiny_config("qwen3_moe", **DIM1)
    assert trained["loaded"]["local"] == (3, cfg.moe_intermediate_size, cfg.hidden_size)  # half of [gate; up]
    assert trained["loaded"]["differ"] == []


def test_gathering_dim0_shards_is_exact_and_logs_no_inconsistency_warning(trained):
    """FSDP2's dim-0 shard of an ep slice is a _StridedShard: full_state_dict and save_pretrained gather it with two
    all-gathers, which torch warns "may give inconsistent results between ranks". All-gathers reduce nothing: the
    gathered state equals the model's, and xpar_zoo keeps that warning (only) out of the user's log."""
    row = trained["gathers"]
    assert "_StridedShard" in row["placements"] and row["differ"] == []
    assert not [w for w in row["warnings"] if "inconsistent results" in w], row["warnings"]


def test_parallelize_logs_each_planned_units_dims(trained):
    lines = trained["log"]
    assert f"FSDP {EXPERTS} over ep_fsdp=2: gate_up_proj on dim 1, down_proj on dim 1" in lines
    assert "FSDP model.embed_tokens over emb_fsdp=2: weight on dim 1" in lines
    assert f"FSDP {O_PROJ} over lowrank_fsdp=2: weight on dim 0, down on dim 1, up on dim 0" in lines


def test_the_loader_reads_fsdp_strided_shards_as_one_block_and_refuses_interleaved_ones(trained):
    strided = [rank[0] for rank in trained["regions"]]  # rank = 2·fsdp + ep: ep picks the half, fsdp its quarter
    assert strided == [((0, 2), (0, 3)), ((4, 6), (0, 3)), ((2, 4), (0, 3)), ((6, 8), (0, 3))]
    interleaved = [rank[1] for rank in trained["regions"]]
    assert all(isinstance(e, str) and "not one block" in e for e in interleaved), interleaved


# ---- checkpoints across the placements and world sizes ----------------------------------------------------------
RESHARD = dict(num_experts=6)  # ep=2: 3 experts per slice, dim 1 over 2 FSDP ranks (world 4), dim 0 over 3 (world 6)
ROWS, STEPS = 12, 5  # each step's global batch: 12 rows, split over 4 or 6 ranks
RESUME_TOL = 1e-6


def _train(model, opt, data: torch.Tensor, steps: range) -> list[float]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    per = ROWS // world
    losses = []
    for s in steps:
        ids = data[s, rank * per:(rank + 1) * per]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        xpar_zoo.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().double()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"params": xpar_zoo.full_state_dict(model),
            "optim": {k: {n: v.clone() for n, v in s.items()} for k, s in osd.get("state", {}).items()}}


def _reshard_job(root: str, load: int | None, save: int | None, train_to: int, result: str) -> str | None:
    """On this world's Mesh(ep=2): a fresh model (seed 7 when it loads), the checkpoint of step ``load`` loaded
    (its state recorded), training on to ``save`` and a save there (state recorded), then on to ``train_to``."""
    import torch.distributed as dist

    cfg = parity.tiny_config("qwen3_moe", **RESHARD)
    data = torch.randint(0, cfg.vocab_size, (STEPS, ROWS, 8), generator=torch.Generator().manual_seed(3))
    model = xpar_zoo.parallelize(parity.build_model(cfg, seed=0 if load is None else 7), xpar_zoo.Mesh(ep=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = {"local": tuple(model.get_parameter(f"{EXPERTS}.gate_up_proj").to_local().shape)}
    start = 0
    if load is not None:
        xpar_zoo.load_checkpoint(Path(root) / checkpoint_name(load), model, opt)
        out["loaded"], start = _state(model, opt), load
    out["losses"] = _train(model, opt, data, range(start, save or train_to))
    if save is not None:
        out["saved"] = _state(model, opt)
        xpar_zoo.save_checkpoint(root, model, opt, {"step": save})
        out["losses"] += _train(model, opt, data, range(save, train_to))
    if dist.get_rank() == 0:
        torch.save(out, result)
        return result
    return None


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root, results = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("results")

    def run(world, *args):
        path = launch.run(_reshard_job, world, str(root), *args, str(results / f"{world}-{args}.pt"), timeout_s=600)
        return torch.load(path, weights_only=True)

    return {"dim1_4_ranks": run(4, None, 2, 4),     # train 2 steps on dim 1, save, 2 more
            "dim0_6_ranks": run(6, 2, 4, 5),        # load step 2 on dim 0, train 2 steps, save, 1 more
            "dim1_again": run(4, 4, None, 5)}       # load step 4 on dim 1, train 1 step


def _assert_same_state(got: dict, want: dict) -> None:
    assert set(got["params"]) == set(want["params"]) and set(got["optim"]) == set(want["optim"])
    for name, t in want["params"].items():
        assert torch.equal(got["params"][name], t), name
    for name, state in want["optim"].items():
        for key, t in state.items():
            assert torch.equal(got["optim"][name][key], t), f"optimizer {name}.{key}"


def test_the_reshard_runs_use_both_placements(resharded):
    cfg = parity.tiny_config("qwen3_moe", **RESHARD)
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    assert resharded["dim1_4_ranks"]["local"] == resharded["dim1_again"]["local"] == (3, I, H)  # dim 1: 2I / 2
    assert resharded["dim0_6_ranks"]["local"] == (1, 2 * I, H)  # dim 0: 3 experts / 3


def test_a_dim1_checkpoint_loads_on_dim0_on_6_ranks_and_resumes_exactly(resharded):
    saved, loaded = resharded["dim1_4_ranks"], resharded["dim0_6_ranks"]
    _assert_same_state(loaded["loaded"], saved["saved"])
    straight, resumed = saved["losses"][2:4], loaded["losses"][:2]
    assert all(abs(a - b) < RESUME_TOL for a, b in zip(resumed, straight, strict=True)), (resumed, straight)


def test_a_dim0_checkpoint_loads_on_dim1_on_4_ranks_and_resumes_exactly(resharded):
    saved, loaded = resharded["dim0_6_ranks"], resharded["dim1_again"]
    _assert_same_state(loaded["loaded"], saved["saved"])
    assert abs(loaded["losses"][0] - saved["losses"][2]) < RESUME_TOL, (loaded["losses"], saved["losses"])
