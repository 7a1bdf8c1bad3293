"""Checkpoints: DCP at global shapes saved on 4 ranks (EP=4) loads on 2 ranks (EP=2, EP=2 + vocab), in one process
without plans, and resumes training exactly; saves are atomic under SIGKILL; wrong models are refused by name."""

import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import xpar_zoo
from xpar_zoo import checkpoint
from xpar_zoo.checkpoint.dcp_io import quiet_single_process
from xpar_zoo.testing import launch, parity

SAVE_WORLD, LOAD_WORLD = 4, 2
STEPS, SAVE_AT = 4, 2
MAX_NORM = 0.5
RESUME_TOL = 1e-6
EXPERTS = "model.layers.0.mlp.experts"
HAS_EMB = "emb" in xpar_zoo.get_plan("qwen3_moe").extra
LOAD_MESHES = {
    "ep2": {"ep": 2},
    # Mesh(ep=2, emb=2) once the vocab-parallel plan exists; until then a strided EP mesh stands in.
    "ep2_emb2" if HAS_EMB else "ep2_strided": {"ep": 2, "emb": 2} if HAS_EMB else {"ep": 2, "innermost": {"ep": False}},
}


def _adamw(params, **kwargs):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)


def _global_loss(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    mean = loss.detach().double()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def _train(model, opt, data: torch.Tensor, steps: range) -> list[float]:
    """Clipped AdamW steps; rank r of a world of W trains on its W-th of each step's global batch."""
    import torch.distributed as dist

    distributed = dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    per = data.shape[1] // world
    losses = []
    for s in steps:
        ids = data[s, rank * per:(rank + 1) * per].reshape(-1, data.shape[-1])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if distributed:
            xpar_zoo.clip_grad_norm_(model, MAX_NORM)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss) if distributed else loss.item())
    return losses


def _pack(obj, path: str) -> str:
    """Results travel as a file: tensors sent through the launch queue need their sender alive, and big bytes
    would fill the pipe that the launcher only reads after joining."""
    torch.save(obj, path)
    return path


def _unpack(path: str):
    return torch.load(path, weights_only=True)


def _full_optim(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in osd.get("state", {}).items()},
            "param_groups": osd.get("param_groups")}


def _save_job(root: str, result: str) -> str | None:
    """4 ranks, Mesh(ep=4): 4 clipped AdamW steps, a sync save at step 2, an async save at step 4 (then a 5th step
    while it writes); AdamW foreach/fused on the same meshes; a second save of a step is refused."""
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(cfg.vocab_size, STEPS + 1, SAVE_WORLD, seed=3)
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=4))
    opt = _adamw(model.parameters())
    out = {"local": {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if n.startswith(EXPERTS)}}
    losses = _train(model, opt, data, range(SAVE_AT))
    out["at_save"] = {"params": xpar_zoo.full_state_dict(model), "optim": _full_optim(model, opt)}
    out["path"] = str(xpar_zoo.save_checkpoint(root, model, opt, {"step": SAVE_AT, "samples": SAVE_AT * 8}))
    try:
        xpar_zoo.save_checkpoint(root, model, opt, {"step": SAVE_AT})
        out["resave"] = None
    except xpar_zoo.CheckpointError as e:
        out["resave"] = str(e)
    losses += _train(model, opt, data, range(SAVE_AT, STEPS))
    out["losses"] = losses
    out["at_async"] = {"params": xpar_zoo.full_state_dict(model), "optim": _full_optim(model, opt)}
    handle = xpar_zoo.save_checkpoint(root, model, opt, {"step": STEPS}, async_save=True)
    _train(model, opt, data, range(STEPS, STEPS + 1))  # changes every parameter while the save may be writing
    out["async_path"] = str(handle.result())
    # the step-2 checkpoint on 4 ranks with HSDP: Mesh(ep=2, replicate=2)
    m = xpar_zoo.parallelize(parity.build_model(cfg, seed=7), xpar_zoo.Mesh(ep=2, replicate=2))
    o = torch.optim.AdamW(m.parameters(), lr=0.5)
    extra = xpar_zoo.load_checkpoint(out["path"], m, o)
    loaded = {"params": xpar_zoo.full_state_dict(m), "optim": _full_optim(m, o)}
    out["ep2_replicate2"] = {"extra": extra, "loaded": loaded, "losses": _train(m, o, data, range(SAVE_AT, STEPS))}
    # foreach / fused AdamW over parameters on different meshes (dense fsdp + [ep_fsdp, ep]) vs the default path
    for kind in ("foreach", "fused"):
        m = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=4))
        o = _adamw(m.parameters(), **{kind: True})
        out[kind] = {"losses": _train(m, o, data, range(SAVE_AT)), "params": xpar_zoo.full_state_dict(m)}
    return _pack(out, result) if rank == 0 else None


def _load_job(root: str, meshes: dict, result: str) -> str | None:
    """2 ranks: on each mesh, a differently initialised model and optimizer load step 2 and train steps 3-4."""
    import torch.distributed as dist

    cfg = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(cfg.vocab_size, STEPS + 1, SAVE_WORLD, seed=3)
    out = {}
    for name, mesh_kwargs in meshes.items():
        model = xpar_zoo.parallelize(parity.build_model(cfg, seed=7), xpar_zoo.Mesh(**mesh_kwargs))
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # hyper-parameters come from the checkpoint
        extra = xpar_zoo.load_checkpoint(Path(root) / checkpoint.checkpoint_name(SAVE_AT), model, opt)
        row = {"extra": extra, "loaded": {"params": xpar_zoo.full_state_dict(model), "optim": _full_optim(model, opt)},
               "losses": _train(model, opt, data, range(SAVE_AT, STEPS))}
        if name == "ep2":  # the latest (the async save of step 4), by root
            xpar_zoo.load_checkpoint(root, model, opt)
            row["latest"] = {"params": xpar_zoo.full_state_dict(model), "optim": _full_optim(model, opt)}
        out[name] = row
    return _pack(out, result) if dist.get_rank() == 0 else None


def _single_process(root: Path) -> dict:
    """One process, no process group, plain transformers model: load step 2 and train steps 3-4."""
    cfg = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(cfg.vocab_size, STEPS + 1, SAVE_WORLD, seed=3)
    model = parity.build_model(cfg, seed=7, experts_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra = xpar_zoo.load_checkpoint(root / checkpoint.checkpoint_name(SAVE_AT), model, opt)
    loaded = {"params": {k: v.clone() for k, v in model.state_dict().items()}, "optim": _full_optim(model, opt)}
    return {"extra": extra, "loaded": loaded, "losses": _train(model, opt, data, range(SAVE_AT, STEPS))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = tmp_path_factory.mktemp("results")
    saved = _unpack(launch.run(_save_job, SAVE_WORLD, str(root), str(results / "saved.pt")))
    loaded = _unpack(launch.run(_load_job, LOAD_WORLD, str(root), LOAD_MESHES, str(results / "loaded.pt")))
    loaded["single"] = _single_process(root)
    loaded["ep2_replicate2"] = saved.pop("ep2_replicate2")
    return {"root": root, "saved": saved, "loaded": loaded}


def _assert_same_state(got: dict, want: dict) -> None:
    assert set(got["params"]) == set(want["params"])
    for name, t in want["params"].items():
        assert got["params"][name].shape == t.shape, name
        assert torch.equal(got["params"][name], t), f"{name}: max |Δ| {(got['params'][name] - t).abs().max()}"
    assert set(got["optim"]["state"]) == set(want["optim"]["state"])
    for name, state in want["optim"]["state"].items():
        for key, t in state.items():
            assert torch.equal(got["optim"]["state"][name][key], t), f"optimizer {name}.{key}"
    for g, w in zip(got["optim"]["param_groups"], want["optim"]["param_groups"]):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in w.items() if k != "params"}


# ---- global shapes and ids, metadata ----------------------------------------------------------------------------
def test_ep4_checkpoint_stores_experts_at_global_shape(runs):
    cfg = parity.tiny_config("qwen3_moe")
    assert runs["saved"]["local"][f"{EXPERTS}.gate_up_proj"] == (2, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    md = checkpoint.SafeReader(runs["saved"]["path"]).read_metadata().state_dict_metadata
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert tuple(md[f"model.{EXPERTS}.gate_up_proj"].size) == (E, 2 * I, H)
    assert tuple(md[f"model.{EXPERTS}.down_proj"].size) == (E, H, I)
    assert tuple(md[f"optim.state.{EXPERTS}.gate_up_proj.exp_avg_sq"].size) == (E, 2 * I, H)
    assert tuple(md["model.lm_head.weight"].size) == (cfg.vocab_size, H)
    # global expert ids: row j of the stored tensor is expert j of the single-process layout
    full = {f"model.{EXPERTS}.down_proj": torch.empty(E, H, I)}
    with quiet_single_process():
        dcp.load(full, checkpoint_id=runs["saved"]["path"], no_dist=True)
    assert torch.equal(full[f"model.{EXPERTS}.down_proj"], runs["saved"]["at_save"]["params"][f"{EXPERTS}.down_proj"])


def test_checkpoint_metadata_names_model_mesh_plans_and_version(runs):
    path = Path(runs["saved"]["path"])
    assert path.name == "step-00000002" and (path / "COMPLETE").is_file()
    meta = xpar_zoo.read_checkpoint_metadata(path)
    assert meta["model_type"] == "qwen3_moe" and meta["config"]["num_local_experts"] == 8
    assert meta["mesh"] == {"world_size": 4, "replicate": 1, "extra": {"ep": 4}, "innermost": {"ep": True}}
    assert sorted(meta["plans"]) == ["ep"] and f"{EXPERTS}.gate_up_proj" in meta["plans"]["ep"]
    assert meta["xpar_zoo_version"] == xpar_zoo.__version__ and meta["step"] == SAVE_AT
    assert meta["optimizer"]["class"] == "AdamW"
    assert sorted(os.listdir(path / "rng")) == [f"rank-{r:05d}.safetensors" for r in range(SAVE_WORLD)]
    assert json.loads((path / "extra_state.json").read_text()) == {"step": SAVE_AT, "samples": SAVE_AT * 8}


# ---- resharding ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [*LOAD_MESHES, "ep2_replicate2", "single"])
def test_ep4_checkpoint_loads_identically(runs, target):
    """Saved on 4 ranks with EP=4; loaded on 2 ranks (EP=2; EP=2 with vocab-parallel or strided), on 4 ranks with
    HSDP (EP=2, replicate=2) and in one process without plans: identical full parameters, optimizer states and
    hyper-parameters."""
    row = runs["loaded"][target]
    assert row["extra"] == {"step": SAVE_AT, "samples": SAVE_AT * 8}
    _assert_same_state(row["loaded"], runs["saved"]["at_save"])


@pytest.mark.parametrize("target", [*LOAD_MESHES, "ep2_replicate2", "single"])
def test_resume_on_other_mesh_reproduces_training(runs, target):
    """4 steps straight on EP=4 x 4 ranks == 2 steps, save, load on another mesh / world size, 2 more steps."""
    straight = runs["saved"]["losses"][SAVE_AT:]
    resumed = runs["loaded"][target]["losses"]
    for got, want in zip(resumed, straight, strict=True):
        assert abs(got - want) < RESUME_TOL, f"resumed losses {resumed} vs straight {straight}"


def test_async_save_snapshots_state_at_call_and_commits(runs):
    path = Path(runs["saved"]["async_path"])
    assert path.name == "step-00000004" and checkpoint.incomplete_reason(path) is None
    assert xpar_zoo.latest_checkpoint(runs["root"]) == path
    _assert_same_state(runs["loaded"]["ep2"]["latest"], runs["saved"]["at_async"])


def test_saving_an_existing_step_is_refused(runs):
    assert "already exists" in runs["saved"]["resave"]


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_adamw_foreach_and_fused_across_meshes_match_default(runs, kind):
    """Plain torch.optim.AdamW(model.parameters(), foreach/fused=True) steps DTensors on the dense and the
    [ep_fsdp, ep] meshes like the default path: the same losses, and every parameter within the parity tolerance
    of its own update. Not bit for bit: the fused CPU kernel rounds differently from the default one by CPU (seen:
    equal on an Intel Xeon, a few fp32 ulps apart on an AVX-512 AMD EPYC, which Adam's 1/sqrt(v) amplifies to
    1.4e-6 on one near-zero-gradient element); a parameter that skipped its step would read 1.0."""
    got = runs["saved"][kind]
    assert got["losses"] == pytest.approx(runs["saved"]["losses"][:SAVE_AT], abs=1e-6)
    before = parity.build_model(parity.tiny_config("qwen3_moe")).state_dict()
    parity.assert_params_match(parity.param_errors(got["params"], runs["saved"]["at_save"]["params"], before),
                               f"AdamW {kind}")


# ---- single process: layout, errors, RNG --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    cfg = parity.tiny_config("qwen3_moe")
    return cfg, parity.build_model(cfg)



# ---- SIGKILL during a save ---------------------------------------------------------------------------------------
KILL_PHASES = ["begin", "rng_written", "mid_write", "dcp_written", "before_rename", "before_marker", "pruning"]


def _killed_save(root: str, phase: str) -> None:
    """One process (launch.start, no process group): a save of step 2 into ``root`` that dies by SIGKILL at
    ``phase``."""
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if phase == "mid_write":  # after the first tensors of the DCP data file are written
        import torch.distributed.checkpoint.filesystem as fs
        write, count = fs._write_item, [0]

        def _write_item(*args, **kwargs):
            count[0] += 1
            if count[0] == 5:
                kill()
            return write(*args, **kwargs)
        fs._write_item = _write_item
    else:  # each phase: the process dies when the save reaches the step that follows it
        from xpar_zoo.checkpoint import layout, save
        dying = lambda *args, **kwargs: kill()  # noqa: E731
        if phase == "begin":
            save.save_rng = dying  # the first write into the new .tmp- directory
        elif phase == "rng_written":
            save.metadata_record = dying  # rank 0 writes the metadata files after the RNG
        elif phase == "dcp_written":
            save.finish_save = dying  # checksums and commit, once every tensor is written
        elif phase == "before_rename":
            save.commit = dying
        elif phase == "before_marker":
            layout.write_complete_marker = dying
        elif phase == "pruning":
            layout.remove_aside = lambda path, name: (path.rename(path.with_name(name)), kill())
    model = parity.build_model(parity.tiny_config("qwen3_moe"), seed=1)
    checkpoint.save_checkpoint(root, model, extra_state={"step": 2}, keep_last=1)


def test_sigkill_at_any_point_of_a_save_keeps_the_last_checkpoint(tmp_path, tiny):
    """A save killed (SIGKILL) at each phase: the previous checkpoint stays intact and loadable; the broken one is
    reported by a warning naming it and never loaded."""
    _, model = tiny
    good = xpar_zoo.save_checkpoint(tmp_path / "good", model, extra_state={"step": 1})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    roots = {}
    for phase in KILL_PHASES:
        roots[phase] = tmp_path / phase
        shutil.copytree(tmp_path / "good", roots[phase])
    procs = {p: launch.start(_killed_save, str(r), p) for p, r in roots.items()}  # its stderr is this test's
    for phase, proc in procs.items():
        proc.join(timeout=120)
        if proc.is_alive():  # our own SIGKILL would read as the save's: fail here instead
            proc.kill()
            pytest.fail(f"{phase}: the save neither finished nor died within 120 s")
        assert proc.exitcode == -signal.SIGKILL, f"{phase}: exit {proc.exitcode} (see the captured stderr)"
    for phase, root in roots.items():
        newest = "step-00000002" if phase == "pruning" else good.name
        leftovers = sorted(set(os.listdir(root)) - {newest, good.name})
        assert leftovers, f"{phase}: the killed save left nothing behind"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert xpar_zoo.latest_checkpoint(root) == root / newest
        named = " ".join(str(w.message) for w in caught)
        assert all(name in named for name in leftovers), f"{phase}: {leftovers} not reported: {named}"
        if phase != "pruning":
            fresh = parity.build_model(parity.tiny_config("qwen3_moe"), seed=3)
            with pytest.warns(checkpoint.CheckpointWarning):
                assert xpar_zoo.load_checkpoint(root, fresh) == {"step": 1}
            assert all(torch.equal(want[k], v) for k, v in fresh.state_dict().items()), phase
        for name in leftovers:
            with pytest.raises(xpar_zoo.CheckpointError, match="never loaded"):
                xpar_zoo.load_checkpoint(root / name, model)


def _rank1_killed_mid_write(root: str) -> None:
    """2 ranks, Mesh(ep=2): a good save of step 1, then rank 1 dies (SIGKILL) writing its first tensor of step 2."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    model = xpar_zoo.parallelize(parity.build_model(parity.tiny_config("qwen3_moe")), xpar_zoo.Mesh(ep=2))
    xpar_zoo.save_checkpoint(root, model, extra_state={"step": 1})
    if dist.get_rank() == 1:
        fs._write_item = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    xpar_zoo.save_checkpoint(root, model, extra_state={"step": 2})


def test_a_rank_killed_mid_save_never_lets_rank_0_commit(tmp_path):
    with pytest.raises(RuntimeError, match="distributed run failed"):
        launch.run(_rank1_killed_mid_write, 2, str(tmp_path), timeout_s=60)
    leftovers = [n for n in os.listdir(tmp_path) if n != "step-00000001"]
    assert leftovers and all(n.startswith(".tmp-step-00000002-") for n in leftovers), leftovers
    with pytest.warns(checkpoint.CheckpointWarning, match=leftovers[0]):
        assert xpar_zoo.latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    model = parity.build_model(parity.tiny_config("qwen3_moe"), seed=3)
    with pytest.warns(checkpoint.CheckpointWarning):
        assert xpar_zoo.load_checkpoint(tmp_path, model) == {"step": 1}
    want = parity.build_model(parity.tiny_config("qwen3_moe")).state_dict()
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
