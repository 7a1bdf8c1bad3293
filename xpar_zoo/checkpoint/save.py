"""``save_checkpoint``: every rank writes its shards of the model and optimizer state (DCP, global shapes) and its
RNG state under ``.tmp-…``, checksums what it wrote, and rank 0 commits the directory (rename to ``step-N``, then the
COMPLETE marker) once every rank has finished — synchronously or in the background (``async_save``)."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError
from ..io.atomic_dir import durable_write
from ..io.integrity import checksum_files, disk_full
from ..parallel import distributed
from ..parallel.rendezvous import meet
from .dcp_io import RecordingFileSystem, dcp_writer, quiet_single_process
from .json_state import to_json
from .layout import (
    DCP_METADATA,
    EXTRA_FILE,
    META_FILE,
    TMP_PREFIX,
    checkpoint_name,
    choose_step,
    clear_leftovers,
    commit,
    incomplete_reason,
    remove,
)
from .rng import rng_file, save_rng
from .state import (
    dcp_state,
    metadata_record,
    nonfinite_message,
    split_optimizer,
    state_dicts,
)

DEFAULT_RENDEZVOUS_TIMEOUT = 600.0


def _own_files(tmp: Path, rank: int) -> list[str]:
    """The files of the save in ``tmp`` that ``rank`` wrote: its DCP data files (DCP names them ``__<rank>_…``) and
    RNG file; rank 0 also the metadata files."""
    names = [p.name for p in tmp.glob(f"__{rank}_*.distcp")]
    if rng_file(tmp, rank).is_file():
        names.append(str(rng_file(tmp, rank).relative_to(tmp)))
    if rank == 0:
        names += [n for n in (DCP_METADATA, META_FILE, EXTRA_FILE) if (tmp / n).is_file()]
    return names


def finish_save(tmp: Path, final: Path, keep_last: int | None, error: str | None,
                 group: dist.ProcessGroup | None, written: Mapping[str, str]) -> str | None:
    """Every rank, once the DCP data is written (or failed with ``error``): the checksums of the files this rank
    wrote (``written``: taken while DCP wrote them; the others read back, in parallel with the other ranks); then
    rank 0 commits (rename, COMPLETE with every checksum, pruning), or removes ``tmp`` when any rank failed.
    Returns the error, the same text on every rank, or None."""
    rank = distributed.rank()
    sums: dict[str, str] = {}
    if error is None:
        try:
            taken = {str(Path(p).relative_to(tmp)): c for p, c in written.items()}
            sums = {**taken, **checksum_files(tmp, [n for n in _own_files(tmp, rank) if n not in taken])}
        except Exception as e:
            error = _write_error(e, final.parent)
    gathered = distributed.all_gather((error, sums), group)
    outcome = None
    if rank == 0:
        outcome = distributed.join_errors([e for e, _ in gathered])
        if outcome:
            remove(tmp)
        else:
            try:
                commit(tmp, final, keep_last, {n: c for _, part in gathered for n, c in part.items()})
            except Exception as e:
                outcome = f"committing {final} failed: {_write_error(e, final.parent)}"
    return distributed.broadcast(outcome, group)


def _write_error(e: BaseException, directory: Path, seen: list[OSError] | None = None) -> str:
    """A failed write into ``directory`` as one line: a full disk (or quota) as such, naming the file, else the
    error. ``seen``: OSErrors the writer recorded."""
    full = disk_full(e, directory, seen or ())
    if full:
        return f"{full}; make room (space, quota or file size limit) and save again"
    return distributed.describe_error(e)


class _Control:
    """Per-model checkpoint bookkeeping: the side process group of async saves and the save in flight."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.pending: CheckpointFuture | None = None


def control(model: nn.Module) -> _Control:
    ctl = model.__dict__.get("_xpar_checkpoint")
    if ctl is None:
        ctl = _Control()
        model.__dict__["_xpar_checkpoint"] = ctl
    return ctl


def wait_pending(ctl: _Control) -> None:
    """Wait for the model's async save in flight, if any (raising its error)."""
    if ctl.pending is not None:
        pending, ctl.pending = ctl.pending, None
        pending.result()


class CheckpointFuture:
    """An asynchronous save in flight. Once every rank's data is written, every rank checksums its own files and
    rank 0 commits (rename, then COMPLETE), whether or not anyone waits. ``result()`` waits for the commit and
    returns the checkpoint directory, raising :class:`CheckpointError` (the same on every rank) if any rank
    failed; ``save_checkpoint``/``load_checkpoint`` call it on the previous save of the same model."""

    def __init__(self, tmp: Path, final: Path, keep_last: int | None, group: dist.ProcessGroup | None,
                 written: RecordingFileSystem) -> None:
        self.path = final
        self._tmp, self._keep_last, self._group, self._written = tmp, keep_last, group, written
        self._finished = threading.Event()
        self._error: str | None = None

    def _on_saved(self, fut) -> None:  # the saving thread, once the DCP save of every rank is done
        error = None
        try:
            fut.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = _write_error(e, self.path.parent, self._written.errors)
        try:
            self._error = finish_save(self._tmp, self.path, self._keep_last, error, self._group,
                                       self._written.checksums)
        except BaseException as e:
            self._error = distributed.describe_error(e)
        finally:
            self._finished.set()

    def done(self) -> bool:
        """Whether this rank's part has finished (rank 0: written and committed)."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Path:
        """Wait until the checkpoint is committed; return its directory."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} not written within {timeout} s")
        if self._error:
            raise CheckpointError(f"saving {self.path} failed:\n{self._error}")
        return self.path


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
    allow_nonfinite: bool = False,
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
    trainable_only: bool = False,
) -> Path | CheckpointFuture:
    """Save ``model`` (and ``optimizer``, the RNG state and the JSON-able ``extra_state``) as the checkpoint
    ``path/step-N`` — DCP at global shapes, loadable on any mesh or world size — atomically: written under a
    temporary name and committed (renamed, then marked COMPLETE with every file's size and CRC-32) only when every
    rank has finished. ``step`` defaults to ``extra_state["step"]``, else one past the newest checkpoint under
    ``path``. ``keep_last=N`` then removes all but the N newest complete checkpoints; every save removes what
    interrupted saves left under ``path`` (``.tmp-…``). Parameters or optimizer states holding NaN or inf are
    refused unless ``allow_nonfinite=True``. With ``async_save=True`` the state is copied and written in the
    background: returns a :class:`CheckpointFuture` (else the checkpoint directory).

    A collective, guarded: before the first collective, each rank waits at most ``rendezvous_timeout`` seconds
    (default 600, below the process group's own timeout; set it above the longest time your ranks can drift
    apart) for the others to call too, then all ranks check that they were given the same optimizer (class or
    none), ``step``, ``async_save``, ``keep_last`` and ``allow_nonfinite`` — a rank that calls alone, or ranks that
    disagree, get a :class:`CheckpointError` instead of a hang (:mod:`xpar_zoo.parallel.rendezvous`). ``path`` and
    ``extra_state`` are rank 0's. ``trainable_only=True`` leaves the frozen parameters out (a LoRA run: the adapters,
    the buffers and the optimizer; load it with ``load_checkpoint(..., trainable_only=True)`` into the same base)."""
    root = Path(path)
    extra = dict(extra_state or {})
    meet("save_checkpoint", {"optimizer": None if optimizer is None else type(optimizer).__name__,
                             "step": step if step is not None else extra.get("step"), "async_save": bool(async_save),
                             "keep_last": keep_last, "allow_nonfinite": bool(allow_nonfinite),
                             "trainable_only": bool(trainable_only)},
         CheckpointError, rendezvous_timeout)
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive integer or None, got {keep_last!r}")
    ctl = control(model)
    wait_pending(ctl)
    msd, osd = state_dicts(model, optimizer, trainable_only)  # collective
    extra_json = _checked_values(root, extra, msd, osd, allow_nonfinite)
    n, tmp_name = distributed.run_everywhere(lambda: _new_step_dir(root, step, extra), rank0_only=True)
    tmp, final = Path(tmp_name), root / checkpoint_name(n)
    _write_side_files(tmp, final, root, model, n, optimizer, osd, extra_json, trainable_only)
    writer, written = dcp_writer(tmp)
    state = dcp_state(msd, osd)
    if async_save:
        return _save_in_background(ctl, state, writer, written, tmp, final, keep_last)
    error = None
    try:
        with quiet_single_process():  # returns on every rank once every rank's files are written
            dcp.save(state, storage_writer=writer, no_dist=not distributed.is_distributed())
    except (Exception, CheckpointException) as e:  # DCP raises the same failure on every rank
        error = _write_error(e, root, written.errors)
    error = finish_save(tmp, final, keep_last, error, None, written.checksums)
    if error:
        raise CheckpointError(f"saving {final} failed (nothing was kept):\n{error}")
    return final


def _checked_values(root: Path, extra: dict, msd: dict, osd: dict | None, allow_nonfinite: bool) -> Any:
    """``extra`` as JSON, after the checks of this rank's values (JSON-able, finite unless allowed), before anything
    is written; a failure on any rank raises on every rank."""
    error = extra_json = None
    try:
        extra_json = to_json(extra, "extra_state")
        if not allow_nonfinite and (bad := nonfinite_message(msd, osd)):
            raise CheckpointError(f"{bad}; pass allow_nonfinite=True to save them anyway")
    except Exception as e:
        error = distributed.describe_error(e)
    error = distributed.every_error(error)
    if error:
        raise CheckpointError(f"not saving under {root}:\n{error}")
    return extra_json


def _new_step_dir(root: Path, step: int | None, extra: dict) -> tuple[int, str]:
    """Rank 0: the step and a fresh ``.tmp-`` directory for it (leftovers of interrupted saves removed first)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        clear_leftovers(root)
        n = choose_step(root, step, extra)
        final = root / checkpoint_name(n)
        if final.exists() and incomplete_reason(final) is None:
            raise CheckpointError(f"checkpoint {final} already exists; pass another step or remove it")
        tmp = root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
    except Exception as e:
        raise CheckpointError(_write_error(e, root if root.is_dir() else root.parent)) from None
    return n, str(tmp)


def _write_side_files(tmp: Path, final: Path, root: Path, model: nn.Module, n: int,
                      optimizer: torch.optim.Optimizer | None, osd: dict | None, extra_json: Any,
                      trainable_only: bool = False) -> None:
    """Every rank's RNG state, and rank 0's metadata record and extra state, into ``tmp``; on a failure anywhere
    ``tmp`` is removed and every rank raises."""
    rank = distributed.rank()
    error = None
    try:
        save_rng(tmp, rank)
        if rank == 0:
            scalars, groups = ({}, None) if osd is None else split_optimizer(osd)[1:]
            record = metadata_record(model, n, optimizer, scalars, groups, trainable_only)
            durable_write(tmp / META_FILE, json.dumps(record, indent=1).encode())
            durable_write(tmp / EXTRA_FILE, json.dumps(extra_json, indent=1).encode())
    except Exception as e:
        error = _write_error(e, root)
    error = distributed.every_error(error)
    if error:
        if rank == 0:
            remove(tmp)
        raise CheckpointError(f"saving {final} failed before writing tensors (nothing was kept):\n{error}")


def _save_in_background(ctl, state: dict, writer, written, tmp: Path, final: Path,
                        keep_last: int | None) -> CheckpointFuture:
    """Start DCP's asynchronous save of ``state`` on a gloo group of its own; the future commits when it is done."""
    if distributed.is_distributed() and ctl.group is None:
        ctl.group = dist.new_group(backend="gloo")
    handle = CheckpointFuture(tmp, final, keep_last, ctl.group, written)
    with quiet_single_process():
        fut = dcp.async_save(state, storage_writer=writer, process_group=ctl.group,
                             no_dist=not distributed.is_distributed())
    cast(Future, fut).add_done_callback(handle._on_saved)  # a Future: no AsyncStager was given
    ctl.pending = handle
    return handle


