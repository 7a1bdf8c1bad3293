"""Where a training run writes, checked before any expensive work (rank 0, before the model loads):

- ``--output`` (the run directory), ``--export-hf`` and ``--export-adapter`` are never an input (the model
  directory, the data file or directory, the tokenizer, …), never inside one and never contain one; the exports
  are not the run directory, not one of its own entries, and not each other;
- an existing non-empty ``--output`` without checkpoints is refused without ``--resume`` or ``--force`` (its
  ``metrics.jsonl`` is appended to, never truncated); an existing non-empty export directory is refused without
  ``--force``, and ``--force`` replaces it only once the new export is complete (:class:`ExportTarget`, the
  converters' :class:`~xpar_zoo.atomic_dir.StagingDir` protocol);
- every output is written to once at start (a read-only directory is refused before step 1);
- ``OUTPUT/metrics.jsonl`` parses (a garbled line is named before a resume; a last line cut short by a killed
  writer is dropped, and said).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch.distributed as dist

from ..errors import TrainConfigError
from ..io.atomic_dir import StagingDir, clear_leftovers
from ..parallel.distributed import broadcast, rank
from .config import TrainConfig
from .metrics import METRICS_FILE

CHECKPOINTS = "checkpoints"
RUN_ENTRIES = (CHECKPOINTS, METRICS_FILE, "tensorboard")


def _inputs(cfg: TrainConfig) -> list[tuple[str, str]]:
    """``(flag, path)`` of every input of the run that is a local path (a hub id names no local file)."""
    named = [("--model", cfg.model), ("--tokenizer", cfg.tokenizer), ("--data", cfg.data)]
    for name in ("eval_data", "adapter"):  # settings of other parts of the command, when present
        named.append((f"--{name.replace('_', '-')}", getattr(cfg, name, None)))
    return [(flag, str(p)) for flag, p in named if p and Path(p).exists()]


def _relation(a: Path, b: Path) -> str | None:
    """How path ``a`` relates to ``b`` ("is", "contains", "lies inside"), links resolved; ``None``: apart."""
    a, b = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    if a == b:
        return "is"
    if a in b.parents:
        return "contains"
    if b in a.parents:
        return "lies inside"
    return None


def _writable(directory: Path, flag: str) -> None:
    """Create and remove a file in ``directory``: the only test of writability that holds for every user and
    filesystem (``os.access`` says yes to root on a read-only directory)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".xpar-write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TrainConfigError(f"{flag} {directory}: cannot write there ({e.strerror or e})") from None


def _make_dir(path: Path, flag: str) -> None:
    if path.exists() and not path.is_dir():
        raise TrainConfigError(f"{flag} {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainConfigError(f"{flag} {path}: cannot create it ({e.strerror or e})") from None


def _non_empty(path: Path) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())[:3] if path.is_dir() else []
    except OSError as e:
        raise TrainConfigError(f"{path}: cannot list it ({e.strerror or e})") from None


def exports(cfg: TrainConfig) -> list[tuple[str, Path]]:
    """``(flag, path)`` of the export directories the run writes at its end."""
    named = [("--export-hf", cfg.export_hf), ("--export-adapter", getattr(cfg, "export_adapter", None))]
    return [(flag, Path(p)) for flag, p in named if p]


def check_outputs(cfg: TrainConfig, has_checkpoint: bool) -> None:
    """Rank 0, before any model or data is loaded: raise :class:`TrainConfigError` on an output that would
    overwrite or delete an input or another output, an existing non-empty output the settings do not allow, or a
    directory that cannot be written (see the module docstring). Creates ``--output``."""
    output = Path(cfg.output)
    inputs = _inputs(cfg)
    outputs = [("--output", output), *exports(cfg)]
    for flag, path in outputs:
        for in_flag, given in inputs:
            how = _relation(path, Path(given))
            if how:
                raise TrainConfigError(f"{flag} {path} {how} {in_flag} {given}: choose an output outside every input "
                                       "(writing there would change or delete the input)")
    for i, (flag, path) in enumerate(outputs[1:], 1):
        how = _relation(path, output)
        if how in ("is", "contains"):
            raise TrainConfigError(f"{flag} {path} {how} --output {output}: export outside the run directory")
        if how == "lies inside" and any(_relation(path, output / e) in ("is", "lies inside") for e in RUN_ENTRIES):
            raise TrainConfigError(f"{flag} {path} lies inside the run's own {', '.join(RUN_ENTRIES)}: choose "
                                   "another directory")
        for other_flag, other in outputs[i + 1:]:
            how = _relation(path, other)
            if how:
                raise TrainConfigError(f"{flag} {path} {how} {other_flag} {other}: give each export its own "
                                       "directory")
    _make_dir(output, "--output")
    found = [n for n in _non_empty(output) if not n.startswith(".")]
    if found and not has_checkpoint and not cfg.resume and not cfg.force:
        raise TrainConfigError(f"--output {output} is not empty ({', '.join(found)}) and holds no checkpoint: "
                               "choose another --output, or pass --force to train into it (metrics.jsonl is "
                               "appended to)")
    _writable(output, "--output")
    for flag, path in exports(cfg):
        if path.exists() and not path.is_dir():
            raise TrainConfigError(f"{flag} {path} exists and is not a directory")
        if _non_empty(path) and not cfg.force:
            raise TrainConfigError(f"{flag} {path} already exists and is not empty; pass --force to replace it "
                                   "(only once the new export is complete), or choose another directory")
        _make_dir(path.parent, flag)
        _writable(path.parent, flag)
    check_metrics(output)


def check_metrics(output: Path) -> None:
    """``OUTPUT/metrics.jsonl`` is a file of JSON records, one per line; a last line without its newline that does
    not parse (the writer was killed mid-line) is dropped; any other bad line is refused, named."""
    path = output / METRICS_FILE
    if not path.exists():
        return
    if not path.is_file():
        raise TrainConfigError(f"{path} is not a file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TrainConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    lines = data.split(b"\n")
    if lines and lines[-1] and not _record(lines[-1]):
        torn = len(lines[-1])
        with open(path, "r+b") as f:
            f.truncate(len(data) - torn)
        print(f"{path}: dropped an incomplete last line ({torn} bytes, an interrupted write)", flush=True)
        lines = lines[:-1]
    for n, line in enumerate(lines, 1):
        if line.strip() and not _record(line):
            raise TrainConfigError(f"{path}:{n}: not a metrics record (garbled); move the file aside or delete the "
                                   "line, then run again")


def _record(line: bytes) -> bool:
    try:
        value = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(value, dict) and (type(value.get("step")) is int or "event" in value)


class ExportTarget:
    """An export directory written by every rank (``model.save_pretrained``) and moved into place by rank 0 once
    complete: :attr:`path` is a staging directory beside the target (the same on every rank). A collective."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self._staging = None
        error = None
        if rank() == 0:
            try:
                clear_leftovers(target)
                self._staging = StagingDir(target, TrainConfigError)
            except OSError as e:
                error = f"{target}: cannot write there ({e.strerror or e})"
        path, error = broadcast((str(self._staging.path) if self._staging else None, error))
        if error:
            raise TrainConfigError(error)
        self.path = Path(path)

    def commit(self) -> None:
        """Every rank: the staged export replaces the target (rank 0 moves it)."""
        if dist.is_initialized():
            dist.barrier()
        if self._staging is not None:
            self._staging.commit()
        if dist.is_initialized():
            dist.barrier()

    def discard(self) -> None:
        if self._staging is not None:
            self._staging.discard()
