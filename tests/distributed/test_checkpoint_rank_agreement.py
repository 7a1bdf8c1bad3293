"""Checkpoints against attackers and careless users (issue 18; issue 17's save on rank 0 only): no code runs from a
crafted .metadata; a flipped byte is never loaded; side files are read before the model is touched; optimizer
groups must match; links and renamed steps are never checkpoints; NaN / inf are refused or named; user dicts that
look like the JSON codec's tags come back as themselves; a full disk is said as such and leaves nothing; the next
save removes what interrupted ones left; ranks that call alone or disagree get the same clear error, within a
bounded time, and the job can go on."""

import os
import time
from pathlib import Path

import pytest
import torch

import xpar_zoo
from support.integrity_checkpoints import _model, _train_step
from xpar_zoo.checkpoint import write_complete_marker
from xpar_zoo.testing import launch

EXPERTS = "model.layers.0.mlp.experts"



def _recommit(ckpt: Path) -> None:
    """Rewrite the COMPLETE marker so that sizes and checksums agree with the (damaged) files: damage that happened
    before the commit, or a crafted checkpoint."""
    (ckpt / "COMPLETE").unlink()
    write_complete_marker(ckpt, int(ckpt.name.removeprefix("step-")))



# ---- 4. integrity: checksums ------------------------------------------------------------------------------------
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))



# ---- ranks that call alone or disagree (2 ranks, Mesh(ep=2)) -----------------------------------------------------
RENDEZVOUS_S = 3


def _outcome(fn) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - the test inspects the type
        return (type(e).__name__, str(e), time.monotonic() - start)


def _misuse_job(root: str) -> list[dict]:
    import torch.distributed as dist

    rank = dist.get_rank()
    root = Path(root)
    model = xpar_zoo.parallelize(_model(), xpar_zoo.Mesh(ep=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    kw = {"rendezvous_timeout": RENDEZVOUS_S}
    out: dict = {}
    if rank == 0:  # the DDP habit: `if rank == 0: save(...)`; rank 1 waits at a barrier meanwhile
        out["rank0_only"] = _outcome(lambda: xpar_zoo.save_checkpoint(root, model, opt, step=1, **kw))
    dist.barrier()
    out["left_by_rank0_only"] = sorted(os.listdir(root)) if root.exists() else []
    out["every_rank"] = _outcome(lambda: xpar_zoo.save_checkpoint(root, model, opt, step=1, **kw))
    out["async_save_differs"] = _outcome(
        lambda: xpar_zoo.save_checkpoint(root, model, opt, step=2, async_save=rank == 0, **kw))
    out["optimizer_on_rank0_only"] = _outcome(
        lambda: xpar_zoo.save_checkpoint(root, model, opt if rank == 0 else None, step=2, **kw))
    out["load_optimizer_on_rank1_only"] = _outcome(
        lambda: xpar_zoo.load_checkpoint(root, model, opt if rank == 1 else None, **kw))
    out["save_while_the_other_loads"] = _outcome(
        lambda: xpar_zoo.save_checkpoint(root, model, opt, step=2, **kw) if rank == 0
        else xpar_zoo.load_checkpoint(root, model, opt, **kw))
    out["after_all_that"] = _outcome(lambda: xpar_zoo.load_checkpoint(
        xpar_zoo.save_checkpoint(root, model, opt, step=2, **kw), model, opt, **kw))

    # 7: rank 1's RNG file garbled when written: found before any rank touches the model
    if rank == 0:
        rng = root / "step-00000001" / "rng" / "rank-00001.safetensors"
        rng.write_bytes(rng.read_bytes()[:100])
        _recommit(root / "step-00000001")
    dist.barrier()
    before = xpar_zoo.full_state_dict(model)
    out["garbled_rng_of_rank1"] = _outcome(lambda: xpar_zoo.load_checkpoint(root / "step-00000001", model, opt, **kw))
    after = xpar_zoo.full_state_dict(model)
    out["untouched"] = rank != 0 or all(torch.equal(before[k], v) for k, v in after.items())

    # 4: a flipped byte in rank 1's data file: found by whichever rank checks it, raised on both
    xpar_zoo.save_checkpoint(root, model, opt, step=3, **kw)
    if rank == 0:
        _flip_byte(root / "step-00000003" / "__1_0.distcp")
    dist.barrier()
    out["flipped_byte"] = _outcome(lambda: xpar_zoo.load_checkpoint(root / "step-00000003", model, opt, **kw))

    # 9: a NaN gradient only rank 1 holds, then a NaN in an expert slice only rank 1 holds
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    experts = model.get_parameter(f"{EXPERTS}.gate_up_proj")
    if rank == 1:
        experts.grad.to_local()[0, 0, 0] = float("nan")
    out["clip_nan_on_rank1"] = _outcome(lambda: xpar_zoo.clip_grad_norm_(model, 1.0, error_if_nonfinite=True))
    opt.zero_grad()
    if rank == 1:
        with torch.no_grad():
            experts.to_local()[0, 0, 0] = float("nan")
    out["nan_on_rank1"] = _outcome(lambda: xpar_zoo.save_checkpoint(root, model, opt, step=4, **kw))
    out["listing"] = sorted(os.listdir(root))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return every


@pytest.fixture(scope="module")
def misuse(tmp_path_factory):
    root = tmp_path_factory.mktemp("misuse") / "root"
    start = time.monotonic()
    every = launch.run(_misuse_job, 2, str(root), timeout_s=120)
    return every, time.monotonic() - start


def test_save_on_rank_0_only_raises_within_the_timeout_and_leaves_nothing(misuse):
    every, _ = misuse
    kind, message, seconds = every[0]["rank0_only"]
    assert kind == "CheckpointError", message
    assert message.startswith(f"every rank must call save_checkpoint (1 of 2 arrived within {RENDEZVOUS_S} s)")
    assert RENDEZVOUS_S <= seconds < RENDEZVOUS_S + 10
    assert every[0]["left_by_rank0_only"] == []
    assert [e["every_rank"][0] for e in every] == ["ok", "ok"], "the ranks meet again at their next call"


@pytest.mark.parametrize("case, differs", [
    ("async_save_differs", ["async_save: rank 0 has {'async_save': True}, rank 1 has {'async_save': False}"]),
    ("optimizer_on_rank0_only", ["optimizer: rank 0 has {'optimizer': 'AdamW'}, rank 1 has {'optimizer': None}"]),
    ("load_optimizer_on_rank1_only", ["optimizer: rank 0 has {'optimizer': None}, rank 1 has {'optimizer': 'AdamW'}"]),
    ("save_while_the_other_loads", ["different calls (every rank must make the same call): rank 0 has "
                                    "'save_checkpoint', rank 1 has 'load_checkpoint'"]),
])
def test_ranks_that_disagree_all_get_the_same_clear_error(misuse, case, differs):
    every, _ = misuse
    outcomes = [e[case] for e in every]
    assert [o[0] for o in outcomes] == ["CheckpointError"] * 2, outcomes
    assert outcomes[0][1] == outcomes[1][1], "the same message on every rank"
    assert outcomes[0][1].startswith("ranks were given different ")
    for part in differs:
        assert part in outcomes[0][1], outcomes[0][1]
    assert all(o[2] < RENDEZVOUS_S for o in outcomes), "no rank waits for the timeout"


def test_after_the_errors_every_rank_saves_and_loads(misuse):
    every, seconds = misuse
    assert [e["after_all_that"][0] for e in every] == ["ok", "ok"]
    assert seconds < 90


@pytest.mark.parametrize("case, parts", [
    ("garbled_rng_of_rank1", ["rank 1: ", "rng/rank-00001.safetensors: not a valid RNG state", "nothing was loaded"]),
    ("flipped_byte", ["__1_0.distcp: crc32", "recorded (the file is corrupt)"]),
    ("clip_nan_on_rank1", [f"non-finite gradients in {EXPERTS}.gate_up_proj (rank 1)"]),
    ("nan_on_rank1", [f"rank 1: non-finite values (NaN or inf) in {EXPERTS}.gate_up_proj", "allow_nonfinite=True"]),
])
def test_one_ranks_problem_is_the_same_error_on_every_rank(misuse, case, parts):
    every, _ = misuse
    outcomes = [e[case] for e in every]
    assert outcomes[0][0] in ("CheckpointError", "NonFiniteError") and outcomes[0][:2] == outcomes[1][:2], outcomes
    for part in parts:
        assert part in outcomes[0][1], outcomes[0][1]
    assert all(e["untouched"] for e in every), "a side-file error must leave the model untouched"
    assert "step-00000004" not in every[0]["listing"] and not [n for n in every[0]["listing"] if n.startswith(".")]
