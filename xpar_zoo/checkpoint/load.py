"""``load_checkpoint`` and ``verify_checkpoint``: every file checked against its checksum and every side file read
and checked before the model is touched; then the model (and optimizer) loaded on any mesh or world size."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

from ..errors import CheckpointError
from ..io.integrity import CHECKSUM, verify_files
from ..parallel import distributed
from ..parallel.materialize import check_materialized
from ..parallel.rendezvous import meet
from .dcp_io import SafeLoadPlanner, SafeReader, quiet_single_process, read_dcp_metadata
from .json_state import from_json
from .layout import EXTRA_FILE, FORMAT, META_FILE, complete_record, resolve_checkpoint
from .rng import apply_rng, read_rng
from .save import DEFAULT_RENDEZVOUS_TIMEOUT, control, wait_pending
from .state import (
    check_compatible,
    dcp_state,
    expected_shapes,
    nonfinite_message,
    state_dicts,
    state_options,
)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check every file of a checkpoint directory (or of the newest complete one under a root) against the
    checksums its COMPLETE marker records: ``{"path", "checksum": "crc32" (None when the checkpoint records
    none: saved before checksums were recorded), "files": how many were checked, "problems": one line per damaged
    file}``. Reads every byte."""
    ckpt = resolve_checkpoint(path)
    record = complete_record(ckpt)
    sums = record.get("checksums")
    if not isinstance(sums, dict):
        return {"path": str(ckpt), "checksum": None, "files": 0, "problems": []}
    return {"path": str(ckpt), "checksum": record.get("checksum", CHECKSUM), "files": len(sums),
            "problems": verify_files(ckpt, sums, record["files"])}


def _verify_share(ckpt: Path, rank: int, world: int) -> None:
    """Verify this rank's share (every ``world``-th file) of the checkpoint's checksums; raise naming the damage."""
    record = complete_record(ckpt)
    sums = record.get("checksums")
    if not isinstance(sums, dict):
        return  # saved before checksums were recorded
    names = sorted(sums)[rank::world]
    problems = verify_files(ckpt, {n: sums[n] for n in names}, record["files"])
    if problems:
        raise CheckpointError(f"damaged files: {'; '.join(problems)}; load an earlier checkpoint (`xpar-zoo convert "
                              "inspect --verify ROOT` checks them all)")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _read_side_files(ckpt: Path, rank: int, restore_rng: bool) -> tuple[dict, dict, dict | None, Metadata]:
    """Everything a load needs besides the tensor data, read and checked before the model is touched:
    ``(xpar_checkpoint.json, extra_state, this rank's RNG state or None, DCP metadata)``."""
    meta = _read_json(ckpt / META_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{ckpt / META_FILE}: unknown checkpoint format {found!r} (expected {FORMAT!r})")
    opt = meta.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and isinstance(opt.get("param_groups", []), list)
                                and isinstance(opt.get("non_tensor_state", {}), dict)):
        raise CheckpointError(f"{ckpt / META_FILE}: its optimizer record is malformed")
    extra = from_json(_read_json(ckpt / EXTRA_FILE))
    if not isinstance(extra, dict):
        raise CheckpointError(f"{ckpt / EXTRA_FILE}: not a JSON object (got {type(extra).__name__})")
    rng = read_rng(ckpt, rank) if restore_rng else None
    return meta, extra, rng, read_dcp_metadata(SafeReader(str(ckpt)), ckpt)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    verify: bool = True,
    check_finite: bool = False,
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) on any mesh or world size, or into a plain
    single-process model (no process group needed), and return its ``extra_state``. ``path`` is a checkpoint
    directory or a root, of which the newest complete checkpoint is taken (incomplete ones are reported and
    skipped). Before the model is touched: every file is checked against its recorded checksum (``verify``; the
    ranks share the reading), the side files (metadata, ``extra_state``, RNG) are read and checked, and every
    tensor's name and global shape and the optimizer's parameter groups are checked against the checkpoint — a
    damaged checkpoint, or one of another architecture, shapes or groups, raises :class:`CheckpointError` naming
    them. ``check_finite=True`` then raises naming every loaded tensor that holds NaN or inf. A collective when
    distributed, guarded as :func:`save_checkpoint` is (``rendezvous_timeout``; the ranks must agree on the
    optimizer class, ``restore_rng``, ``verify`` and ``check_finite``). ``trainable_only=True`` loads a checkpoint
    saved so: the trainable parameters and buffers, the frozen parameters keep the model's own weights."""
    check_materialized(model, CheckpointError)  # built on meta: xpar_zoo.materialize(model) first
    meet("load_checkpoint", {"optimizer": None if optimizer is None else type(optimizer).__name__,
                             "restore_rng": bool(restore_rng), "verify": bool(verify),
                             "check_finite": bool(check_finite), "trainable_only": bool(trainable_only)},
         CheckpointError, rendezvous_timeout)
    wait_pending(control(model))
    rank = distributed.rank()
    ckpt = distributed.run_everywhere(lambda: resolve_checkpoint(path), rank0_only=True)

    error, side = None, None
    try:
        if verify:
            _verify_share(ckpt, rank, distributed.world_size())
        side = _read_side_files(ckpt, rank, restore_rng)
    except Exception as e:
        error = distributed.describe_error(e)
    error = distributed.every_error(error)
    if error or side is None:
        raise CheckpointError(f"{ckpt} cannot be loaded (nothing was loaded):\n{error}")
    meta, extra, rng, dcp_meta = side
    saved = {k: tuple(v.size) for k, v in dcp_meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    if bool(meta.get("trainable_only")) != bool(trainable_only):
        raise CheckpointError(f"{ckpt} holds {'only the trainable' if meta.get('trainable_only') else 'all'} "
                              f"parameters: load it with trainable_only={bool(meta.get('trainable_only'))}")
    msd, osd = state_dicts(model, optimizer, trainable_only)  # collective; initialises an optimizer without state
    check_compatible(ckpt, saved, meta, model, expected_shapes(msd, osd), optimizer is not None,
                      None if osd is None else osd["param_groups"])

    with quiet_single_process():
        dcp.load(dcp_state(msd, osd), storage_reader=SafeReader(str(ckpt)), planner=SafeLoadPlanner(),
                 no_dist=not distributed.is_distributed())
    if optimizer is None or osd is None:
        set_model_state_dict(model, msd, options=state_options(trainable_only))
    else:
        saved_opt = meta.get("optimizer") or {}
        osd = {"state": {fqn: dict(state) for fqn, state in osd["state"].items()},
               "param_groups": from_json(saved_opt.get("param_groups", osd["param_groups"]))}
        for fqn, values in from_json(saved_opt.get("non_tensor_state", {})).items():
            osd["state"].setdefault(fqn, {}).update(values)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                       options=state_options(trainable_only))
    if check_finite:
        bad = distributed.every_error(nonfinite_message(msd, osd))
        if bad:
            raise CheckpointError(f"{ckpt} holds non-finite values (the model now holds them too):\n{bad}")
    if rng is not None:
        apply_rng(rng)
    return extra
