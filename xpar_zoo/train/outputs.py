"""Where a training run writes, checked before any expensive work (rank 0, before the model loads):

- ``--output`` (the run directory), ``--export-hf`` and ``--export-adapter`` are never an input (the model
  directory, the data file or directory, the tokenizer, …), never inside one and never contain one; the exports
  are not the run directory, not one of its own entries, and not each other;
- an ``--output`` holding a run is refused without ``--resume`` or ``--force`` in one line naming the command
  (:func:`plan_outputs`); ``--force`` replaces that run as a whole (:class:`OutputPlan`); what a start that never
  trained leaves blocks nothing; another non-empty ``--output`` needs ``--force`` (its ``metrics.jsonl`` is
  appended to, never truncated); an existing non-empty export directory needs ``--force`` (or is the resumed
  run's own), and is replaced only once the new export is complete (:class:`ExportTarget`, the converters'
  :class:`~xpar_zoo.atomic_dir.StagingDir` protocol);
- every output is written to once at start (a read-only directory is refused before step 1);
- ``OUTPUT/metrics.jsonl`` parses (a garbled line is named before a resume; a last line cut short by a killed
  writer is dropped, and said).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ..checkpoint.layout import EXTRA_FILE, scan_root
from ..checkpoint.layout import RUN_CHECKPOINTS as CHECKPOINTS
from ..errors import TrainConfigError
from ..io.atomic_dir import StagingDir, clear_leftovers, remove_aside
from ..parallel.distributed import broadcast, rank
from .config import TrainConfig
from .metrics import METRICS_FILE
from .tiny_vl import TINY_MODELS

BEST = "best"  # --save-best: the checkpoint with the lowest eval_loss
RUN_ENTRIES = (CHECKPOINTS, METRICS_FILE, "tensorboard")
MOVED_METRICS = re.compile(r"metrics\.before-\d{8}T\d{6}\.jsonl")  # moved aside by --force over a finished run


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


def _non_empty(path: Path, limit: int | None = 3) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())[:limit] if path.is_dir() else []
    except OSError as e:
        raise TrainConfigError(f"{path}: cannot list it ({e.strerror or e})") from None


def exports(cfg: TrainConfig) -> list[tuple[str, Path]]:
    """``(flag, path)`` of the export directories the run writes at its end."""
    named = [("--export-hf", cfg.export_hf), ("--export-adapter", getattr(cfg, "export_adapter", None))]
    return [(flag, Path(p)) for flag, p in named if p]


@dataclass
class OutputPlan:
    """What ``--output`` holds and what this run does with it, decided on rank 0 before anything loads:
    ``resume_from`` (the newest complete checkpoint to continue, with ``--resume``), ``skipped`` (newer checkpoint
    directories that are damaged or incomplete, with why), ``saved`` (that run's settings), and, for ``--force``
    over a run, what it removes and moves aside (:meth:`apply`, once every input is checked)."""

    output: Path
    newest: Path | None = None  # the newest complete checkpoint, resumed or not
    step: int | None = None
    saved: dict = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    resume_from: Path | None = None
    remove: list[Path] = field(default_factory=list)
    moves: list[tuple[Path, Path]] = field(default_factory=list)

    def finished(self) -> bool:
        steps = self.saved.get("steps")
        return self.step is not None and isinstance(steps, int) and self.step >= steps

    def describe(self) -> list[str]:
        """One line for each thing the run does to what ``--output`` holds (for the log and ``--dry-run``)."""
        lines = [f"{self.output / CHECKPOINTS / name} skipped: {why}" for name, why in self.skipped]
        if self.resume_from is not None:
            lines.append(f"--resume continues {self.resume_from} (step {self.step})")
        if self.remove or self.moves:
            what = [f"removes {_names(self.output, self.remove)}"] if self.remove else []
            what += [f"moves {_names(self.output, [a])} to {b.name}" for a, b in self.moves]
            lines.append(f"--force replaces the run in {self.output}: {'; '.join(what)}")
        return lines

    def apply(self) -> None:
        """Rank 0, every input checked: remove and move aside what :attr:`remove` and :attr:`moves` name."""
        try:
            for path in self.remove:
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.is_dir():
                    remove_aside(path, f".{path.name}.deleting-{os.getpid()}")
            for a, b in self.moves:
                os.replace(a, b)
        except OSError as e:
            raise TrainConfigError(f"--force: cannot replace the run in {self.output} ({e.strerror or e}: "
                                   f"{e.filename})") from None


def _names(output: Path, paths: list[Path]) -> str:
    return ", ".join(str(p.relative_to(output)) + ("/" if p.is_dir() else "") if output in p.parents else str(p)
                     for p in paths)


def _saved(ckpt: Path) -> tuple[int, dict]:
    """The step and settings a checkpoint was saved with (:class:`TrainConfigError` when unreadable)."""
    try:
        extra = json.loads((ckpt / EXTRA_FILE).read_text())
        return int(extra["step"]), dict(extra.get("config") or {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrainConfigError(f"{ckpt / EXTRA_FILE}: unreadable ({type(e).__name__}); resume from an earlier "
                               "step (move this one aside)") from None


def _step_of(name: str) -> int:
    """The step a checkpoint directory's name says (``step-N``, an unfinished save's ``.tmp-step-N-…``), else -1."""
    m = re.search(r"step-(\d+)", name)
    return int(m[1]) if m else -1


def survey_run(output: Path) -> OutputPlan:
    """What ``--output`` holds: its newest complete checkpoint (step, settings) and the newer damaged or
    incomplete ones. Reads only."""
    plan = OutputPlan(output)
    complete, broken = scan_root(output / CHECKPOINTS) if (output / CHECKPOINTS).is_dir() else ([], [])
    if complete:
        plan.newest = complete[-1][1]
        plan.step, plan.saved = _saved(plan.newest)
    newest = complete[-1][0] if complete else -1
    plan.skipped = [(p.name, why) for p, why in broken if _step_of(p.name) > newest and not p.is_symlink()]
    return plan


def _own_leftover(output: Path, name: str) -> bool:
    """Whether ``OUTPUT/name`` is what a start that never trained leaves (the tiny model it saved, empty event
    logs, metrics without a step, checkpoint roots without a complete checkpoint, metrics moved aside by
    ``--force``): nothing of the user's, so it does not block the next start."""
    path = output / name
    if name in (*TINY_MODELS, "tensorboard") or MOVED_METRICS.fullmatch(name):
        return True
    if name in (CHECKPOINTS, BEST):
        return path.is_dir() and not scan_root(path)[0]
    if name == METRICS_FILE:
        return path.is_file() and not any(r.get("step") for r in _records(path))
    return False


def blocks_a_new_run(output: Path) -> bool:
    """Whether ``output`` holds anything that is not a leftover of a start that never trained (a new run there
    would need ``--force``)."""
    return bool(_blocking(output))


def _blocking(output: Path) -> list[str]:
    """The names in ``output`` that are not hidden and not a leftover of a start that never trained."""
    return [n for n in _non_empty(output, limit=None) if not n.startswith(".") and not _own_leftover(output, n)]


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_bytes().split(b"\n"):
        try:
            value = json.loads(line.decode("utf-8")) if line.strip() else None
        except (UnicodeDecodeError, ValueError, RecursionError):
            return [{"step": "?"}]  # not ours to judge: check_metrics names it
        if isinstance(value, dict):
            out.append(value)
    return out


def _refuse_run(cfg: TrainConfig, plan: OutputPlan) -> None:
    """An output holding a run (a complete checkpoint): one line naming the one command that continues or
    replaces it, unless the settings say which."""
    if plan.newest is None or cfg.resume or cfg.force:
        return
    steps = plan.saved.get("steps")
    if plan.finished():
        raise TrainConfigError(f"--output {plan.output} holds a finished run ({plan.newest.name}, the last of its "
                               f"{steps} steps): rerun with --force to replace it (its checkpoints, exports and "
                               "metrics), or choose another --output")
    raise TrainConfigError(f"--output {plan.output} holds a run stopped at {plan.newest.name} (of {steps} steps): "
                           "rerun with --resume to continue it, or with --force to replace it")


def _replacement(cfg: TrainConfig, plan: OutputPlan, inputs: list[tuple[str, str]]) -> None:
    """``--force`` without ``--resume``: what is removed or moved aside so that this run replaces the one in
    ``--output`` as a whole: its checkpoints (and best), events, the exports it named inside the run directory, its
    metrics moved aside; never an input, never this run's own exports (replaced once complete), nothing else."""
    output = plan.output
    if not cfg.force or cfg.resume:
        return
    keep = [Path(p) for _, p in inputs] + [p for _, p in exports(cfg)]
    named = [Path(plan.saved[k]) for k in ("export_hf", "export_adapter") if plan.saved.get(k)]
    candidates = [output / CHECKPOINTS, output / BEST, output / "tensorboard", *named]
    if plan.newest is None:  # no run to replace (train into the folder, metrics appended): only a best checkpoint
        candidates = [output / BEST]  # that this run's --save-best would otherwise collide with
    for path in candidates:
        if not (path.exists() or path.is_symlink()) or path in plan.remove:
            continue
        if _relation(path, output) != "lies inside":
            continue
        if any(_relation(path, k) for k in keep):
            continue
        plan.remove.append(path)
    metrics = output / METRICS_FILE
    if plan.newest is not None and metrics.is_file() and any(r.get("step") for r in _records(metrics)):
        stamp = time.strftime("%Y%m%dT%H%M%S")
        plan.moves.append((metrics, output / f"metrics.before-{stamp}.jsonl"))


def check_finished_resume(plan: OutputPlan, steps: int | None, cfg: TrainConfig | None = None) -> None:
    """Refuse ``--resume`` of a run whose last step is done when ``steps`` (this run's, once known: ``--epochs``
    gives them once the data is read) adds none and every export ``cfg`` names is there (a resume that only
    writes a missing export, e.g. after an interrupted one, goes on)."""
    if plan.resume_from is None or steps is None or plan.step is None or steps > plan.step:
        return
    if cfg is not None and any(not _non_empty(path) for _, path in exports(cfg)):
        return
    raise TrainConfigError(f"--resume: the run in {plan.output} is at {plan.newest.name} and --steps {steps} adds no "
                           f"step: pass --steps above {plan.step} to train on, or rerun without --resume and with "
                           "--force to replace it")


def _check_relations(cfg: TrainConfig, output: Path, inputs: list[tuple[str, str]]) -> None:
    """No output is an input, inside one or holds one; no export is the run directory, its own entries or the
    other export."""
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


def plan_outputs(cfg: TrainConfig) -> OutputPlan:
    """Rank 0, before any model or data is loaded, reading only: raise :class:`TrainConfigError` on an output that
    would overwrite or delete an input or another output, or an existing output the settings do not allow (one line
    naming the command that continues or replaces it); else what the run does with ``--output`` (see
    :class:`OutputPlan`). ``--dry-run`` reports it."""
    output = Path(cfg.output)
    inputs = _inputs(cfg)
    _check_relations(cfg, output, inputs)
    if output.exists() and not output.is_dir():
        raise TrainConfigError(f"--output {output} exists and is not a directory")
    plan = survey_run(output)
    _refuse_run(cfg, plan)
    if plan.skipped and cfg.resume == "strict":
        name, why = plan.skipped[-1]
        older = plan.newest.name if plan.newest is not None else "step 0 (no complete checkpoint)"
        raise TrainConfigError(f"--resume=strict: {output / CHECKPOINTS / name} is newer than "
                               f"{plan.newest.name if plan.newest is not None else 'any complete checkpoint'} and "
                               f"cannot be resumed ({why}); move it aside to continue from {older}, or pass --resume "
                               "to do so")
    if not cfg.resume:
        plan.skipped = []  # what a resume would skip: nothing to say to a new run
    elif plan.newest is not None:
        plan.resume_from = plan.newest
    blocking = _blocking(output)
    if blocking and plan.newest is None and not cfg.resume and not cfg.force:
        raise TrainConfigError(f"--output {output} is not empty ({', '.join(blocking[:3])}) and holds no "
                               "checkpoint: choose another --output, or pass --force to train into it "
                               "(metrics.jsonl is appended to)")
    _replacement(cfg, plan, inputs)
    own = {k: plan.saved.get(k) for k in ("export_hf", "export_adapter")} if plan.resume_from else {}
    for flag, path in exports(cfg):
        if path.exists() and not path.is_dir():
            raise TrainConfigError(f"{flag} {path} exists and is not a directory")
        mine = own.get(flag[2:].replace("-", "_"))
        if _non_empty(path) and not cfg.force and not (mine and _relation(path, Path(mine)) == "is"):
            raise TrainConfigError(f"{flag} {path} already exists and is not empty; pass --force to replace it "
                                   "(only once the new export is complete), or choose another directory")
    return plan


def check_outputs(cfg: TrainConfig) -> OutputPlan:
    """Rank 0, before any model or data is loaded: :func:`plan_outputs`, then ``--output`` (and each export's
    parent) created and tested writable, and ``metrics.jsonl`` checked (see the module docstring)."""
    plan = plan_outputs(cfg)
    output = plan.output
    _make_dir(output, "--output")
    _writable(output, "--output")
    for flag, path in exports(cfg):
        _make_dir(path.parent, flag)
        _writable(path.parent, flag)
    check_metrics(output)
    return plan


@contextlib.contextmanager
def removed_if_refused(cfg: TrainConfig, active: bool) -> Iterator[None]:
    """Rank 0 (``active``): the directories the run is about to create for ``--output`` and the exports' parents
    (those that do not exist yet, with any missing parents), removed again if what runs inside raises while they
    are still empty: a run refused before step 1 (bad data, a mesh that does not fit, a model that does not load)
    leaves no empty output behind."""
    created = _missing(Path(cfg.output), *(path.parent for _, path in exports(cfg))) if active else []
    try:
        yield
    except BaseException:
        for directory in created:  # deepest first; a directory with anything in it stays
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def _missing(*paths: Path) -> list[Path]:
    """``paths`` and their parents that do not exist, deepest first."""
    out: set[Path] = set()
    for path in paths:
        path = path.absolute()
        while not path.exists() and path != path.parent:
            out.add(path)
            path = path.parent
    return sorted(out, key=lambda p: len(p.parts), reverse=True)


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
