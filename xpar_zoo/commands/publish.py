"""``xpar-zoo publish``: a hub-format folder (e.g. written by ``xpar-zoo convert to-hf``) → a hub repository with a
model card.

The folder is validated first (``config.json``, safetensors shards whose headers parse and whose data is all there,
an index that lists only existing files and the keys they hold, no JSON file naming a local path); then a
``README.md`` model card is generated (YAML front matter: ``library_name: xpar_zoo``, ``base_model``, tags, and the
export's layout / mesh facts), and only then is the repository created and the folder uploaded. Nothing is uploaded
from a folder that fails validation.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import PublishError, XparError

CARD_FILE = "README.md"
CONFIG_FILE = "config.json"
EXPORT_INFO_FILE = "xpar_export.json"  # written by converters/export.py
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def validate_folder(directory: str | os.PathLike) -> dict[str, Any]:
    """Check that ``directory`` is a hub-format checkpoint: a parseable ``config.json`` with a ``model_type``,
    safetensors files whose headers parse and whose data sections are complete, and (when present) an index whose
    every file exists and holds the keys it lists. Returns ``{"config", "files", "tensors", "bytes"}``; raises
    :class:`PublishError` naming the file or key."""
    from xpar_zoo.hub.safetensors_files import INDEX_FILE, SINGLE_FILE

    directory = Path(directory)
    if not directory.is_dir():
        raise PublishError(f"{directory}: not a directory")
    config = _read_config(directory)
    index_path = directory / INDEX_FILE
    weight_map = None
    if index_path.is_file():
        weight_map, files = _read_index(directory, index_path)
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise PublishError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}")
    unindexed = sorted(p.name for p in directory.glob("*.safetensors") if p.name not in files)
    if unindexed:
        raise PublishError(f"{directory}: {', '.join(unindexed)} not listed in {INDEX_FILE}")
    keys: dict[str, str] = {}
    total = 0
    for name in files:
        total += _check_weight_file(directory / name, keys)
    if weight_map is not None:
        wrong = [f"{k} (index: {f}, file holds it: {keys.get(k, 'no file')})" for k, f in weight_map.items()
                 if keys.get(k) != f]
        unlisted = [k for k in keys if k not in weight_map]
        if wrong or unlisted:
            raise PublishError(f"{index_path} does not match the files: "
                               + "; ".join(wrong[:8] + [f"{k} ({keys[k]}) not in the index" for k in unlisted[:8]]))
    return {"config": config, "files": files, "tensors": len(keys), "bytes": total}


def _read_config(directory: Path) -> dict[str, Any]:
    """The folder's ``config.json``, which must parse and name a ``model_type``."""
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise PublishError(f"{directory}: no {CONFIG_FILE}; not a hub-format checkpoint")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise PublishError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise PublishError(f"{config_path}: no model_type")
    return config


def _read_index(directory: Path, index_path: Path) -> tuple[dict[str, str], list[str]]:
    """The index's weight map and the files it names, each of which must exist."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise PublishError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise PublishError(f"{index_path} lists {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
                           f" not in {directory}")
    return weight_map, files


def _check_weight_file(path: Path, keys: dict[str, str]) -> int:
    """Check one safetensors file (its header parses, its data section is complete, no key of another file) and
    record its keys in ``keys``; returns its size."""
    from xpar_zoo.hub.safetensors_files import read_header

    try:
        header = read_header(path)
    except XparError as e:
        raise PublishError(f"{path}: truncated or corrupt safetensors header ({e})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise PublishError(f"{path}: malformed safetensors header ({type(e).__name__}: {e})") from None
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    data_end = max((t.offsets[1] for t in header.values()), default=0)
    size = path.stat().st_size
    if size < 8 + header_len + data_end:
        raise PublishError(f"{path}: truncated ({size} bytes, its header needs {8 + header_len + data_end})")
    for key in header:
        if key in keys:
            raise PublishError(f"{key} is in two files: {keys[key]} and {path.name}")
        keys[key] = path.name
    return size


def _export_info(directory: Path) -> dict[str, Any]:
    path = directory / EXPORT_INFO_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise PublishError(f"{path}: not valid JSON ({e})") from None


def _is_local_path(value: Any) -> bool:
    return isinstance(value, str) and (os.path.isabs(value) or value.startswith(("~", "./", "../")))


def _local_paths(value: Any, where: str = "") -> list[str]:
    """``"key: value"`` for every string in a JSON value that names the local file system."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _local_paths(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _local_paths(v, f"{where}[{i}]")]
    return [f"{where}: {value}"] if _is_local_path(value) else []


def refuse_local_paths(directory: str | os.PathLike) -> None:
    """Raise :class:`PublishError` when a JSON file of the folder (``config.json``, ``xpar_export.json``,
    ``generation_config.json``…) records a local path (absolute, ``~``, ``./``): publishing it would put the user's
    directory layout on the hub."""
    found = []
    for path in sorted(Path(directory).glob("*.json")):
        if path.stat().st_size > (16 << 20):  # a tokenizer's vocabulary, not metadata
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found += [f"{path.name} {p}" for p in _local_paths(data)]
    if found:
        raise PublishError(f"{directory} records local paths, which publish would upload: {'; '.join(found[:8])}; "
                           "remove them (or re-export with `xpar-zoo convert to-hf`, which records none)")


def _hub_id(value: Any) -> str | None:
    """``value`` when it looks like a hub repo id (``org/name``) rather than a local path."""
    if isinstance(value, str) and _REPO_ID.match(value) and not Path(value).exists():
        return value
    return None


def build_model_card(directory: str | os.PathLike, repo_id: str, *, base_model: str | None = None,
                     summary: dict[str, Any] | None = None):
    """A huggingface_hub ``ModelCard`` for the folder: YAML front matter with ``library_name: xpar_zoo``,
    ``base_model`` (the argument, else the export's ``base_model`` when it is a hub id), tags (``xpar_zoo``,
    ``moe`` for expert models, the model_type) and an ``xpar_zoo`` block with the layout, mesh and plans from
    ``xpar_export.json`` (else from ``config.json``)."""
    from huggingface_hub import ModelCard, ModelCardData

    from xpar_zoo.converters.inspect_checkpoint import inspect_checkpoint

    from ..zoo.registry import supported_architectures

    directory = Path(directory)
    summary = summary or validate_folder(directory)
    config = summary["config"]
    info = _export_info(directory)
    model_type = config["model_type"]
    base = base_model or _hub_id(info.get("base_model"))
    if base_model is not None and not _hub_id(base_model):
        raise PublishError(f"--base-model {base_model!r} is not a hub repo id (org/name)")
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)),
                   None)
    tags = ["xpar_zoo", *(["moe"] if experts else []), model_type]
    xpar: dict[str, Any] = {
        "layout": inspect_checkpoint(directory)["format"],  # hub per-expert / hub fused
        "model_type": model_type,
        "architectures": config.get("architectures"),
        "num_experts": experts,
        "xpar_zoo_plan": model_type in supported_architectures(),
        "shards": len(summary["files"]),
        "tensors": summary["tensors"],
    }
    for key in ("mesh", "plans", "step", "dtype", "xpar_zoo_version", "source_checkpoint"):
        if info.get(key) is not None and not _local_paths(info[key]):
            xpar[key] = info[key]
    if not info:
        xpar["dtype"] = config.get("dtype") or config.get("torch_dtype")
    data = ModelCardData(library_name="xpar_zoo", base_model=base, tags=tags, pipeline_tag="text-generation",
                         xpar_zoo=xpar)
    mesh = f"`{json.dumps(info['mesh'])}`" if info.get("mesh") else "not recorded"
    lines = [
        f"# {repo_id.split('/')[-1]}", "",
        f"A `{model_type}` model ({', '.join(config.get('architectures') or [model_type])}) in the Hugging Face "
        "hub's own format, loadable with plain transformers or, parallelized (EP / vocab plans + FSDP2), with "
        "xpar_zoo:", "",
        "```python", "import xpar_zoo",
        f"model = xpar_zoo.from_pretrained({repo_id!r}, mesh=xpar_zoo.Mesh({'ep=2' if experts else ''}))", "```",
        "",
        "## Provenance", "",
        f"- base model: {base or 'not recorded'}",
        f"- trained / saved with mesh: {mesh}",
        f"- training step: {info.get('step', 'not recorded')}",
        f"- {summary['tensors']} tensors in {len(summary['files'])} safetensors file(s), "
        f"{summary['bytes'] / 2**20:.1f} MiB", "",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _hub_call(what: str, repo: str, fn, /, *args, **kwargs):
    """A huggingface_hub call whose failure (no network, offline mode, authentication, a refused upload) becomes
    one :class:`PublishError` line naming the repo instead of a client traceback."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # httpx / huggingface_hub errors of every kind: one line naming the step and the repo
        first = (str(e).splitlines() or [""])[0]
        raise PublishError(f"{what} {repo} on the hub failed ({type(e).__name__}: {first[:300]})") from None


def dry_run_report(directory: Path, repo_id: str, summary: dict[str, Any], card, keep_card: bool) -> str:
    """What ``publish`` would upload: the files, their size, and the model card."""
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    if CARD_FILE not in files:
        files.append(CARD_FILE)
    lines = [f"dry run: would create {repo_id} and upload {len(files)} file(s) from {directory} "
             f"({summary['bytes'] / 2**20:.1f} MiB of safetensors, {summary['tensors']} tensors):",
             *(f"  {f}" for f in files),
             f"model card ({'the existing ' + CARD_FILE if keep_card else 'generated'}):"]
    text = (directory / CARD_FILE).read_text() if keep_card else str(card)
    return "\n".join(lines + ["  " + line for line in text.splitlines()])


def publish(
    directory: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    base_model: str | None = None,
    overwrite_card: bool = False,
    commit_message: str | None = None,
    dry_run: bool = False,
) -> str:
    """Validate ``directory``, create ``repo_id`` (``exist_ok``; the branch ``revision`` too when given), write its
    model card (``README.md``; an existing one is kept unless ``overwrite_card``) and upload the folder. Returns the
    URL of the upload commit (or whatever ``upload_folder`` returns, as a string). A failed hub call raises
    :class:`PublishError` and leaves the folder as it was (a card written for the upload is removed again).
    ``dry_run``: validate and return what would be uploaded, card included; nothing is written or sent."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    if not _REPO_ID.match(repo_id):
        raise PublishError(f"{repo_id!r} is not a hub repo id (org/name)")
    summary = validate_folder(directory)
    refuse_local_paths(directory)
    card_path = directory / CARD_FILE
    write_card = overwrite_card or not card_path.exists()
    card = build_model_card(directory, repo_id, base_model=base_model, summary=summary) if write_card else None
    if dry_run:
        return dry_run_report(directory, repo_id, summary, card, keep_card=not write_card)
    api = HfApi(token=token)
    _hub_call("creating", repo_id, api.create_repo, repo_id, private=private, repo_type="model", exist_ok=True)
    if revision is not None:
        _hub_call(f"creating branch {revision!r} of", repo_id, api.create_branch, repo_id, branch=revision,
                  repo_type="model", exist_ok=True)
    previous = card_path.read_bytes() if card_path.exists() else None
    if write_card:
        try:
            card.save(card_path)
        except OSError as e:
            raise PublishError(f"cannot write {card_path}: {e}") from None
    try:
        result = _hub_call("uploading to", repo_id, api.upload_folder, repo_id=repo_id, folder_path=str(directory),
                           repo_type="model", revision=revision,
                           commit_message=commit_message or f"Upload {summary['config']['model_type']} with "
                                                             "xpar-zoo publish")
    except PublishError:
        if write_card:  # the folder as it was
            if previous is None:
                card_path.unlink(missing_ok=True)
            else:
                card_path.write_bytes(previous)
        raise
    return str(result)
