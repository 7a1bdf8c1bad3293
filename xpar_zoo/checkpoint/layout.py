"""The directory protocol of a checkpoint root: names, the COMPLETE marker, which directories are complete
checkpoints, committing a save and removing old or interrupted ones.

    root/
      step-00000010/                 a complete checkpoint
        .metadata, __0_0.distcp, …   DCP, tensors only, at global shapes: "model.<fqn>", "optim.state.<fqn>.<name>"
        xpar_checkpoint.json         format, step, model_type, config, mesh, plans, versions, optimizer hyper-params
        extra_state.json             the user's ``extra_state`` (JSON)
        rng/rank-00000.safetensors   each saving rank's RNG state
        COMPLETE                     the commit marker (JSON: step, size and CRC-32 of every file), written last
      .tmp-step-00000012-<id>/       a save in progress, or one that was interrupted: never loaded
      .deleting-step-00000004-<id>/  a checkpoint being pruned (``keep_last``)

Every rank writes under ``.tmp-…``; rank 0 renames it to ``step-N`` once every rank has finished, then writes
``COMPLETE``. Directories are never followed through symbolic links, and a ``step-N`` whose COMPLETE records another
step is not a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

from ..errors import CheckpointError, CheckpointWarning
from ..io.atomic_dir import durable_write, fsync_dir, remove_aside
from ..io.integrity import CHECKSUM, file_checksum

FORMAT = "xpar_zoo.checkpoint/1"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
META_FILE = "xpar_checkpoint.json"
EXTRA_FILE = "extra_state.json"
COMPLETE_FILE = "COMPLETE"
RNG_DIR = "rng"
DCP_METADATA = ".metadata"
_STEP_RE = re.compile(r"^step-(\d+)$")
RUN_CHECKPOINTS = "checkpoints"  # the checkpoint root inside a training run directory (xpar-zoo train --output)


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (``step-00000010``)."""
    return f"{STEP_PREFIX}{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a ``step-N`` directory's name says, else None."""
    m = _STEP_RE.match(path.name)
    return int(m[1]) if m else None


def complete_record(ckpt: Path) -> dict:
    """The JSON of ``ckpt``'s COMPLETE marker (``{"format", "step", "files": {name: size}, "checksum",
    "checksums": {name: hex}}``); raises OSError / ValueError when it cannot be read."""
    record = json.loads((ckpt / COMPLETE_FILE).read_text())
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise ValueError("no files listed")
    return record


def incomplete_reason(ckpt: Path, step: int | None = None) -> str | None:
    """Why ``ckpt`` is not a complete checkpoint (of ``step``, when given: the step its name says), or None when
    it is. Sizes only: checksums are verified by :func:`verify_checkpoint` and at load."""
    marker = ckpt / COMPLETE_FILE
    if not marker.is_file():
        return "no COMPLETE marker (the save never committed)"
    try:
        record = complete_record(ckpt)
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable COMPLETE marker"
    if step is not None and record.get("step") != step:
        return f"{_RENAMED} {record.get('step')!r}, its name says {step} (renamed or copied)"
    for rel, size in files.items():
        f = ckpt / rel
        if not f.is_file():
            return f"file {rel} listed in COMPLETE is missing"
        if f.stat().st_size != size:
            return f"file {rel} has {f.stat().st_size} bytes, COMPLETE says {size}"
    for required in (DCP_METADATA, META_FILE):
        if required not in files:
            return f"COMPLETE does not list {required}"
    return None


_LINK_REASON = "a symbolic link: checkpoints are never read, pruned or cleaned up through links"
_RENAMED = "COMPLETE records step"


def foreign(path: Path, why: str) -> bool:
    """Whether a directory skipped by :func:`scan_root` is not ours to remove: a link, or a complete checkpoint under
    another step's name (a user's copy)."""
    return path.is_symlink() or why.startswith(_RENAMED)


def scan_root(root: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """Complete checkpoints ``[(step, dir)]`` sorted by step, and broken directories ``[(dir, reason)]`` (links
    among them: never loaded, never removed)."""
    complete: list[tuple[int, Path]] = []
    broken: list[tuple[Path, str]] = []
    if not root.is_dir():
        return complete, broken
    for child in sorted(root.iterdir()):
        if not child.name.startswith((TMP_PREFIX, DELETING_PREFIX, STEP_PREFIX)):
            continue
        if child.is_symlink():
            broken.append((child, _LINK_REASON))
        elif not child.is_dir():
            continue
        elif child.name.startswith(TMP_PREFIX):
            broken.append((child, "an unfinished save (interrupted, or still running)"))
        elif child.name.startswith(DELETING_PREFIX):
            broken.append((child, "left over from an interrupted pruning"))
        elif m := _STEP_RE.match(child.name):
            why = incomplete_reason(child, int(m[1]))
            if why:
                broken.append((child, why))
            else:
                complete.append((int(m[1]), child))
    complete.sort()
    return complete, broken


def _warn_broken(broken: list[tuple[Path, str]]) -> None:
    for path, why in broken:
        warnings.warn(f"xpar_zoo: skipping incomplete checkpoint {path}: {why}", CheckpointWarning, stacklevel=3)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``root`` (highest step), or None. Incomplete or broken
    directories are reported with a :class:`CheckpointWarning` naming them, and skipped."""
    complete, broken = scan_root(Path(root))
    _warn_broken(broken)
    return complete[-1][1] if complete else None


def run_checkpoint_root(path: Path) -> Path:
    """``path/checkpoints`` when ``path`` is a training run directory (``xpar-zoo train --output``: no checkpoint
    directories of its own, a ``checkpoints/`` root inside), else ``path``."""
    inner = path / RUN_CHECKPOINTS
    if inner.is_dir() and not any(c.name.startswith((STEP_PREFIX, TMP_PREFIX)) for c in path.iterdir()):
        return inner
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself (complete, or an error), or the newest complete one under a
    root (or under a training run directory's ``checkpoints/``). Resolve once when reading several parts of one checkpoint, so that they all come from the same step."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path} (not a directory)")
    if path.name.startswith((TMP_PREFIX, DELETING_PREFIX)):
        raise CheckpointError(f"{path} is an unfinished save or a checkpoint being deleted; it is never loaded")
    if any((path / f).exists() for f in (COMPLETE_FILE, META_FILE, DCP_METADATA)):
        if not (path / META_FILE).exists() and (path / DCP_METADATA).exists():
            raise CheckpointError(f"{path} is a DCP directory but not an xpar_zoo checkpoint (no {META_FILE})")
        m = _STEP_RE.match(path.name)
        why = incomplete_reason(path, int(m[1]) if m else None)
        if why:
            raise CheckpointError(f"{path} is not a complete checkpoint: {why}; it is never loaded")
        return path
    path = run_checkpoint_root(path)
    complete, broken = scan_root(path)
    _warn_broken(broken)
    if not complete:
        extra = f"; incomplete ones skipped: {', '.join(p.name for p, _ in broken)}" if broken else ""
        raise CheckpointError(f"no complete checkpoint under {path}{extra}")
    return complete[-1][1]


def read_checkpoint_metadata(path: str | os.PathLike) -> dict:
    """The ``xpar_checkpoint.json`` of a checkpoint directory (or of the newest complete one under a root):
    format, step, model_type, config, mesh, plans, versions, optimizer hyper-parameters."""
    return json.loads((resolve_checkpoint(path) / META_FILE).read_text())


# ---- committing and removing -------------------------------------------------------------------------------------
def choose_step(root: Path, step: int | None, extra_state: Mapping) -> int:
    """The step of a new save: ``step``, else ``extra_state["step"]``, else one past the newest under ``root``."""
    if step is None and isinstance(extra_state.get("step"), int) and not isinstance(extra_state["step"], bool):
        step = extra_state["step"]
    if step is None:
        complete, _ = scan_root(root)
        step = complete[-1][0] + 1 if complete else 0
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    return step


def remove(path: Path) -> None:
    """Delete a checkpoint directory (a pruned one, a leftover, a failed save's) so that no half-deleted ``step-N``
    is ever visible: renamed to ``.deleting-…`` first, then deleted."""
    name = path.name if path.name.startswith(DELETING_PREFIX) else (
        f"{DELETING_PREFIX}{path.name.removeprefix(TMP_PREFIX)}-{uuid.uuid4().hex[:8]}")
    remove_aside(path, name)


def clear_leftovers(root: Path) -> None:
    """Rank 0, at the start of a save (one writer per root): remove what interrupted saves and prunings left
    (``.tmp-…``, ``.deleting-…``; never through a link), naming them in a :class:`CheckpointWarning`."""
    removed = []
    for path, why in scan_root(root)[1]:
        if path.name.startswith((TMP_PREFIX, DELETING_PREFIX)) and not foreign(path, why):
            remove(path)
            removed.append(path.name)
    if removed:
        warnings.warn(f"xpar_zoo: removed {', '.join(removed)} from {root}: left by interrupted saves",
                      CheckpointWarning, stacklevel=3)


def prune(root: Path, keep_last: int, keep: Path) -> None:
    """Keep the ``keep_last`` newest complete checkpoints (always ``keep``, the one just committed); remove older
    ones and leftovers of interrupted saves or prunings (never a link, nor a renamed copy)."""
    complete, broken = scan_root(root)
    victims = [p for _, p in complete[:-keep_last] if p != keep] + [p for p, why in broken if not foreign(p, why)]
    for path in victims:
        remove(path)


def commit(tmp: Path, final: Path, keep_last: int | None, checksums: Mapping[str, str]) -> None:
    """Rank 0, once every rank's data is on disk: rename ``tmp`` to ``final``, then write the COMPLETE marker."""
    if final.exists():  # an incomplete leftover of the same step (a complete one was refused before writing)
        remove(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    write_complete_marker(final, int(final.name[len(STEP_PREFIX):]), checksums)
    if keep_last is not None:
        prune(final.parent, keep_last, final)


def write_complete_marker(ckpt: Path, step: int, checksums: Mapping[str, str] | None = None) -> None:
    """Commit the checkpoint directory ``ckpt`` of ``step``: write its ``COMPLETE`` marker listing the size and
    the checksum of every file in it (call it last, once every file is on disk). ``checksums`` already computed
    (by the ranks that wrote the files) are recorded as given; the others are computed here."""
    names = [str(p.relative_to(ckpt)) for p in sorted(ckpt.rglob("*"))
             if p.is_file() and not p.is_symlink() and p.name != COMPLETE_FILE]
    given = dict(checksums or {})
    record = {"format": FORMAT, "step": step, "files": {n: (ckpt / n).stat().st_size for n in names},
              "checksum": CHECKSUM, "checksums": {n: given.get(n) or file_checksum(ckpt / n) for n in names}}
    durable_write(ckpt / COMPLETE_FILE, json.dumps(record, indent=1).encode())
    fsync_dir(ckpt)
