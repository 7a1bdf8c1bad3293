"""Checkpoints against attackers and careless users (issue 18; issue 17's save on rank 0 only): no code runs from a
crafted .metadata; a flipped byte is never loaded; side files are read before the model is touched; optimizer
groups must match; links and renamed steps are never checkpoints; NaN / inf are refused or named; user dicts that
look like the JSON codec's tags come back as themselves; a full disk is said as such and leaves nothing; the next
save removes what interrupted ones left; ranks that call alone or disagree get the same clear error, within a
bounded time, and the job can go on."""

import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import xpar_zoo
from xpar_zoo.commands import cli
from xpar_zoo.checkpoint import CheckpointWarning, write_complete_marker
from xpar_zoo.errors import CheckpointError, NonFiniteError
from xpar_zoo.testing import launch, parity

EXPERTS = "model.layers.0.mlp.experts"


def _model(seed: int = 0):
    return parity.build_model(parity.tiny_config("qwen3_moe"), seed=seed)


def _train_step(model, opt) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before: dict) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _recommit(ckpt: Path) -> None:
    """Rewrite the COMPLETE marker so that sizes and checksums agree with the (damaged) files: damage that happened
    before the commit, or a crafted checkpoint."""
    (ckpt / "COMPLETE").unlink()
    write_complete_marker(ckpt, int(ckpt.name.removeprefix("step-")))


@pytest.fixture
def saved(tmp_path):
    """A checkpoint (model, AdamW state, RNG, extra_state) under ``tmp_path/root``."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    return xpar_zoo.save_checkpoint(tmp_path / "root", model, opt, {"step": 1})


# ---- 1. no code from a crafted .metadata -------------------------------------------------------------------------
def _payload(command: str) -> bytes:
    """Pickle protocol 4: STACK_GLOBAL ("torch.distributed.checkpoint.metadata", "os.system"), called with
    ``command`` — a dotted name under a module DCP's unpickler once admitted whole."""
    def text(s: str) -> bytes:  # BINUNICODE
        return b"X" + struct.pack("<I", len(s.encode())) + s.encode()

    return (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("os.system") + b"\x93"
            + text(command) + b"\x85R.")


def test_the_payload_is_real(tmp_path):
    """Unpickled without restriction, the payload creates its file (so the next test proves something)."""
    probe = tmp_path / "probe"
    pickle.loads(_payload(f"touch {probe}"))
    assert probe.exists()


@pytest.mark.parametrize("via", ["load_checkpoint", "convert inspect", "convert to-hf"])
def test_a_crafted_metadata_runs_no_code(via, saved, tmp_path, capsys):
    marker = tmp_path / "pwned"
    (saved / ".metadata").write_bytes(_payload(f"touch {marker}"))
    _recommit(saved)
    want = "refers to torch.distributed.checkpoint.metadata.os.system, which a checkpoint never needs"
    if via == "load_checkpoint":
        model = _model(seed=3)
        before = _snapshot(model)
        with pytest.raises(CheckpointError, match=re.escape(want)):
            xpar_zoo.load_checkpoint(saved, model)
        assert _unchanged(model, before)
    else:
        args = ["inspect", str(saved)] if via == "convert inspect" else ["to-hf", str(saved), str(tmp_path / "out")]
        assert cli.main(["convert", *args]) == 2
        assert want in capsys.readouterr().err
    assert not marker.exists(), "the payload ran"


# ---- 4. integrity: checksums ------------------------------------------------------------------------------------
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_file_has_a_checksum_and_inspect_verify_passes_an_intact_checkpoint(saved, capsys):
    record = json.loads((saved / "COMPLETE").read_text())
    assert record["checksum"] == "crc32" and set(record["checksums"]) == set(record["files"])
    assert {".metadata", "xpar_checkpoint.json", "extra_state.json", "rng/rank-00000.safetensors"} <= set(
        record["files"]) and any(f.endswith(".distcp") for f in record["files"])
    assert cli.main(["convert", "inspect", "--verify", str(saved.parent)]) == 0
    assert re.search(rf"step-00000001 checksums: {len(record['files'])} files intact \(crc32\)",
                     capsys.readouterr().out)


@pytest.mark.parametrize("file", ["__0_0.distcp", "extra_state.json"])
def test_a_flipped_byte_is_never_loaded_nor_exported(file, saved, tmp_path, capsys):
    from xpar_zoo.converters.export import export_to_hf

    _flip_byte(saved / file)
    model = _model(seed=3)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=rf"{re.escape(file)}: crc32 [0-9a-f]{{8}}, [0-9a-f]{{8}} recorded"):
        xpar_zoo.load_checkpoint(saved.parent, model)
    assert _unchanged(model, before)
    assert cli.main(["convert", "inspect", "--verify", str(saved)]) == 2
    captured = capsys.readouterr()
    assert "checksums: DAMAGED" in captured.out and f"damaged checkpoint files: {file}: crc32" in captured.err
    with pytest.raises(CheckpointError, match=f"damaged files: {re.escape(file)}"):
        export_to_hf(saved, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---- 5. optimizer parameter groups ------------------------------------------------------------------------------
def _groups(model, how: str):
    if how == "one":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    matrices = [p for p in model.parameters() if p.ndim > 1]
    others = [p for p in model.parameters() if p.ndim <= 1]
    if how == "two":
        return torch.optim.AdamW([{"params": matrices}, {"params": others, "weight_decay": 0.0}], lr=1e-2)
    first = [p for n, p in model.named_parameters() if "experts" in n]  # "regrouped": same count, other members
    return torch.optim.AdamW([{"params": first}, {"params": [p for n, p in model.named_parameters()
                                                             if "experts" not in n], "lr": 1e-3}], lr=1e-2)


@pytest.mark.parametrize("saved_as, loaded_as, message", [
    ("one", "two", "the checkpoint's optimizer has 1 parameter group(s), this optimizer has 2"),
    ("two", "one", "the checkpoint's optimizer has 2 parameter group(s), this optimizer has 1"),
    ("two", "regrouped", "parameter group 0 holds"),
])
def test_optimizer_parameter_groups_must_match(saved_as, loaded_as, message, tmp_path):
    model = _model()
    opt = _groups(model, saved_as)
    _train_step(model, opt)
    path = xpar_zoo.save_checkpoint(tmp_path, model, opt)
    fresh = _model(seed=3)
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        xpar_zoo.load_checkpoint(path, fresh, _groups(fresh, loaded_as))
    assert _unchanged(fresh, before)
    same = _groups(fresh, saved_as)
    xpar_zoo.load_checkpoint(path, fresh, same)  # the same grouping loads
    assert [len(g["params"]) for g in same.param_groups] == [len(g["params"]) for g in opt.param_groups]


# ---- 7. side files before the model -----------------------------------------------------------------------------
@pytest.mark.parametrize("file", ["extra_state.json", "rng/rank-00000.safetensors", "xpar_checkpoint.json"])
def test_a_garbled_side_file_is_found_before_the_model_is_touched(file, saved):
    path = saved / file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _recommit(saved)  # garbled when written: checksums agree, the content is wrong
    model = _model(seed=3)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape(file)):
        xpar_zoo.load_checkpoint(saved, model)
    assert _unchanged(model, before)


# ---- 8. links and renamed steps ---------------------------------------------------------------------------------
def test_links_and_renamed_steps_are_never_checkpoints(tmp_path):
    model = _model()
    other = xpar_zoo.save_checkpoint(tmp_path / "other", model, step=30)
    root = tmp_path / "root"
    xpar_zoo.save_checkpoint(root, model, extra_state={"step": 1})
    (root / "step-00000090").symlink_to(other, target_is_directory=True)  # another root's checkpoint
    shutil.copytree(root / "step-00000001", root / "step-00000070")  # a copy under another step's name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert xpar_zoo.latest_checkpoint(root) == root / "step-00000001"
    said = " ".join(str(w.message) for w in caught)
    assert "step-00000090: a symbolic link" in said and "step-00000070: COMPLETE records step 1" in said
    with pytest.warns(CheckpointWarning):
        assert xpar_zoo.load_checkpoint(root, _model(seed=3)) == {"step": 1}
    xpar_zoo.save_checkpoint(root, model, extra_state={"step": 2}, keep_last=1)
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000070", "step-00000090"]  # neither is pruned
    assert (root / "step-00000090").is_symlink() and xpar_zoo.latest_checkpoint(tmp_path / "other") == other


# ---- 9. non-finite values ---------------------------------------------------------------------------------------
def test_non_finite_parameters_are_refused_at_save_and_named_at_load(tmp_path):
    model = _model()
    with torch.no_grad():
        model.get_parameter(f"{EXPERTS}.gate_up_proj")[1, 0, 0] = float("nan")
        model.get_parameter("lm_head.weight")[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"non-finite values \(NaN or inf\) in "
                                              rf"{re.escape(EXPERTS)}\.gate_up_proj, lm_head\.weight; pass "
                                              r"allow_nonfinite=True"):
        xpar_zoo.save_checkpoint(tmp_path / "root", model)
    assert not (tmp_path / "root").exists(), "nothing may be written"
    path = xpar_zoo.save_checkpoint(tmp_path / "root", model, allow_nonfinite=True)
    assert xpar_zoo.load_checkpoint(path, _model(seed=3)) == {}
    with pytest.raises(CheckpointError, match=rf"non-finite values \(NaN or inf\) in {re.escape(EXPERTS)}"
                                              r"\.gate_up_proj, lm_head\.weight"):
        xpar_zoo.load_checkpoint(path, _model(seed=3), check_finite=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_clip_grad_norm_error_if_nonfinite_follows_torch_and_names_the_parameters(bad):
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    model.get_parameter(f"{EXPERTS}.down_proj").grad[2, 0, 0] = bad
    params = [p for p in model.parameters() if p.grad is not None]
    reference = []  # the same gradients on plain tensors, for torch's own clip_grad_norm_
    for p in params:
        reference.append(torch.nn.Parameter(torch.zeros_like(p)))
        reference[-1].grad = p.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):  # torch's flag and exception type
        torch.nn.utils.clip_grad_norm_(reference, 1.0, error_if_nonfinite=True)
    with pytest.raises(NonFiniteError, match=rf"non-finite gradients in {re.escape(EXPERTS)}\.down_proj; set "
                                             "error_if_nonfinite=False") as e:
        xpar_zoo.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    assert isinstance(e.value, RuntimeError)
    for p, r in zip(params, reference):  # no gradient changed before the error
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0, equal_nan=True)
    want = torch.nn.utils.clip_grad_norm_(reference, 1.0)  # without the flag: scaled by the non-finite norm
    got = xpar_zoo.clip_grad_norm_(model, 1.0)
    assert not torch.isfinite(want) and bool(got.isnan()) == bool(want.isnan())
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad, equal_nan=True)


# ---- 10. the JSON codec's tags ----------------------------------------------------------------------------------
def test_user_dicts_that_look_like_tags_come_back_as_themselves(tmp_path):
    extra = {"step": 3, "a": {"__tuple__": [1, 2]}, "b": {"__dict__": {"x": (1, 2)}}, "c": (1, (2, {"__tuple__": []})),
             "d": [{"__dict__": 0}], "e": {"__tuple__": [1], "other": 2}}
    model = _model()
    xpar_zoo.save_checkpoint(tmp_path, model, extra_state=extra)
    assert xpar_zoo.load_checkpoint(tmp_path, model) == extra


# ---- leftovers, a full disk ----------------------------------------------------------------------------------------
def test_the_next_save_removes_what_interrupted_saves_left(tmp_path):
    model = _model()
    xpar_zoo.save_checkpoint(tmp_path, model, step=1)
    (tmp_path / ".tmp-step-00000002-0123456789ab").mkdir()
    (tmp_path / ".tmp-step-00000002-0123456789ab" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".deleting-step-00000000-01234567").mkdir()
    with pytest.warns(CheckpointWarning, match=r"removed \.deleting-step-00000000-01234567, "
                                               r"\.tmp-step-00000002-0123456789ab from .*interrupted saves"):
        xpar_zoo.save_checkpoint(tmp_path, model, step=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002"]


_FILL_UP = textwrap.dedent("""
    import json, os, resource, signal, sys
    from xpar_zoo import cli
    from xpar_zoo.testing import parity
    import xpar_zoo
    root, ckpt, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    if limit:  # the file size limit: EFBIG, as a real write would fail
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out = {}
    try:
        xpar_zoo.save_checkpoint(os.path.join(root, "ckpt"), model)
        out["save"] = ("ok", "")
    except BaseException as e:
        out["save"] = (type(e).__name__, str(e), isinstance(e, xpar_zoo.XparError))
    out["save_left"] = sorted(os.listdir(os.path.join(root, "ckpt")))
    out["to_hf"] = cli.main(["convert", "to-hf", ckpt, os.path.join(root, "out")])
    out["to_hf_left"] = sorted(os.listdir(root))
    print(json.dumps(out))
""")


def _run_filled(tmp_path: Path, prefix: list[str], root: Path, limit: int) -> tuple[dict, str]:
    source = xpar_zoo.save_checkpoint(tmp_path / "source", _model())
    proc = subprocess.run([*prefix, sys.executable, "-c", _FILL_UP, str(root), str(source), str(limit)],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _assert_clear_write_failure(out: dict, stderr: str, root: Path, reason: str) -> None:
    kind, message, is_xpar = out["save"]
    assert (kind, is_xpar) == ("CheckpointError", True), message
    assert f"saving {root / 'ckpt' / 'step-00000000'} failed (nothing was kept)" in message
    assert re.search(rf"{reason} \(writing {re.escape(str(root / 'ckpt'))}/\.tmp-step-00000000-[0-9a-f]+/", message)
    assert out["save_left"] == [], "the failed save must remove its .tmp-"
    assert out["to_hf"] == 2 and out["to_hf_left"] == ["ckpt"]
    error_lines = [line[line.index("xpar-zoo: error:"):] for line in stderr.splitlines() if "xpar-zoo: error:" in line]
    assert error_lines == [f"xpar-zoo: error: writing {root / 'out'} failed: {reason}; nothing was written"]
    assert "Traceback" not in stderr


def test_a_write_past_the_file_size_limit_is_a_clear_error_and_leaves_nothing(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 60 kB (EFBIG), with no special filesystem: the same path
    through DCP's and torch's writers as a full disk."""
    root = tmp_path / "limited"
    root.mkdir()
    out, stderr = _run_filled(tmp_path, [], root, 60_000)
    _assert_clear_write_failure(out, stderr, root, "File too large")


def _mount_namespace() -> list[str] | None:
    """A command prefix that runs in a private mount namespace where ``mount -t tmpfs`` is allowed, or None."""
    if not shutil.which("unshare"):
        return None
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=64k tmpfs \"$TMPDIR\""], capture_output=True,
                           env={**os.environ, "TMPDIR": "/tmp"})
    return prefix if probe.returncode == 0 else None


def test_a_full_disk_is_said_as_such_and_leaves_nothing(tmp_path):
    """A real 120 kB tmpfs (in a private mount namespace) fills up during the save and during the export."""
    prefix = _mount_namespace()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare/tmpfs refused); the file-size-limit test covers the "
                    "same path")
    root = tmp_path / "small"
    root.mkdir()
    out, stderr = _run_filled(tmp_path, [*prefix, "sh", "-c", f'mount -t tmpfs -o size=120k tmpfs "{root}" && '
                                         'exec "$@"', "sh"], root, 0)
    _assert_clear_write_failure(out, stderr, root, "No space left on device")


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
