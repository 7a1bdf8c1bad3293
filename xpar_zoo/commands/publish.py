"""``xpar-zoo publish``: a hub-format folder (e.g. written by ``xpar-zoo convert to-hf``) → a hub repository with a
model card.

The folder is validated first (``config.json``, safetensors shards whose headers parse and whose data is all there,
an index that lists only existing files and the keys they hold); only the files a hub model or adapter needs are
uploaded (:data:`UPLOADED_FILES`, :data:`UPLOADED_PATTERNS`: everything else, ``.env``, ``training_args.bin``,
``checkpoint-N/`` included, is listed as skipped, or refused with ``strict``), and none of them may name the local
file system or hold a credential (:func:`scan_upload`, naming the file and line), leave the folder through a symlink,
or ask for custom code. Then a ``README.md`` model card is generated (YAML front matter: ``library_name: xpar_zoo``,
``base_model``, tags, and the export's layout / mesh facts; every config string escaped), and only then is the
repository created and the files uploaded. Nothing is uploaded from a folder that fails validation.
"""

from __future__ import annotations

import glob
import html
import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import PublishError, XparError, counted

CARD_FILE = "README.md"
CONFIG_FILE = "config.json"
EXPORT_INFO_FILE = "xpar_export.json"  # written by converters/export.py

# What a hub model or adapter needs; every other entry of the folder is skipped (refused with ``strict``).
UPLOADED_FILES = frozenset({
    CONFIG_FILE, "generation_config.json", "model.safetensors.index.json", CARD_FILE, EXPORT_INFO_FILE,
    "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE",
})
UPLOADED_PATTERNS = ("*.safetensors", "*.tiktoken")
# Files never uploaded whatever the options, with why (they are outside the allowlist too; this names the reason).
_NEVER = {".env": "environment secrets", "credentials.json": "credentials", ".git-credentials": "credentials",
          ".netrc": "credentials", "training_args.bin": "the Trainer's pickled arguments (local paths, tokens)"}
_CHECKPOINT_DIR = re.compile(r"checkpoint-\d+")
# Files of token data, not metadata: scanned for credentials but not for paths ("/" is a token).
_TOKEN_DATA = ("vocab.json", "vocab.txt", "merges.txt", "tokenizer.model")
_SCAN_LIMIT = 64 << 20  # a larger text file is not scanned line by line but refused
_CREDENTIALS = (
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("an AWS secret key", re.compile(r"aws_secret_access_key", re.I)),
    ("a GitHub token", re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}")),
    ("an OpenAI key", re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{32,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a credential field", re.compile(
        r"""["']?\b(?:token|hub_token|hf_token|auth_token|access_token|api_key|apikey|password|passwd|secret|"""
        r"""secret_key|private_key|client_secret)["']?\s*[:=]\s*["'][^"'\s]{4,}["']""", re.I)),
)
# A local path in free text: under a directory every machine has, a home (~/), a Windows drive, or a file:// URL.
_TEXT_PATH = re.compile(r"""(?<![\w.:/~-])(?:/(?:home|Users|root|tmp|mnt|data|scratch|var|opt|private|net|nfs|"""
                        r"""lustre|gpfs|fsx|workspace|srv|media|Volumes)/[^\s"'<>`]+|~/[^\s"'<>`]+|"""
                        r"""[A-Za-z]:\\[^\s"'<>`]+)|\bfile:/[^\s"'<>`]*""", re.I)


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
    if "auto_map" in config:
        raise PublishError(f"{config_path} names custom code (auto_map), which publish does not upload: xpar_zoo "
                           "trains and publishes transformers' own classes; remove auto_map from the config")
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


def valid_repo_id(value: Any) -> bool:
    """Whether ``value`` is a hub model repo id the hub accepts (``org/name``; huggingface_hub's own validator:
    no ``..``, ``--``, leading or trailing ``.``/``-``, ``.git`` ending, at most 96 characters)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(value, str) or value.count("/") != 1:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _is_local_path(value: Any) -> bool:
    """Whether a JSON string value is a path of the local file system (absolute with at least two parts, ``~``,
    ``./``, ``../`` or a Windows drive) rather than a token such as ``"/"``, or holds one anywhere (``"trained from
    /home/me/run"``, a ``file://`` URL)."""
    if not isinstance(value, str) or not value:
        return False
    if _TEXT_PATH.search(value):
        return True
    if len(value) > 4096 or "\n" in value:
        return False
    if value.startswith(("~/", "./", "../")) or value == "~" or re.match(r"[A-Za-z]:[\\/]\w", value):
        return True
    return os.path.isabs(value) and bool(re.fullmatch(r"(/[^/\s]+){2,}/?|/[^/\s]*[A-Za-z][^/\s]*/", value))


def _local_paths(value: Any, where: str = "") -> list[str]:
    """``"key: value"`` for every string in a JSON value that names the local file system."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _local_paths(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _local_paths(v, f"{where}[{i}]")]
    return [f"{where}: {value}"] if _is_local_path(value) else []


def _line_of(text: str, value: str) -> int:
    """The 1-based line of ``text`` where the JSON string ``value`` first appears (1 when not found as is)."""
    at = text.find(json.dumps(value)[1:-1])
    return text.count("\n", 0, at) + 1 if at >= 0 else 1


def _json_paths(name: str, text: str) -> list[str]:
    """``"FILE KEY: VALUE (line N)"`` for every local path among the values of a JSON file (token data skipped)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return []  # not JSON: scanned as text
    if name == "tokenizer.json" and isinstance(data, dict):  # vocabulary and merges are tokens, not metadata
        data = {k: v for k, v in data.items() if k not in ("model", "added_tokens")}
    if name == "tokenizer_config.json" and isinstance(data, dict):
        data = {k: v for k, v in data.items() if k != "added_tokens_decoder"}
    return [f"{name} {p} (line {_line_of(text, p.split(': ', 1)[1])})" for p in _local_paths(data)]


def scan_upload(directory: str | os.PathLike, files: list[str], texts: dict[str, str] | None = None) -> None:
    """Raise :class:`PublishError` when a file to upload (``files``, relative to ``directory``) records a local path
    or holds a credential (a Hugging Face, AWS, GitHub or OpenAI key, a private key, a ``"token": "…"`` field),
    naming the file and line: publishing it would put the user's directory layout or secrets on the hub. Token
    data (vocabularies) is scanned for credentials only; safetensors files by their header's metadata. ``texts``:
    ``{name: text}`` to upload that is not on disk yet (the generated card), scanned in place of the file."""
    directory = Path(directory)
    paths: list[str] = []
    secrets: list[str] = []
    texts = texts or {}
    for name in sorted(set(files) | set(texts)):
        path = directory / name
        if name in texts:
            text = texts[name]
        elif name.endswith(".safetensors"):
            text = _safetensors_metadata(path)
        elif path.stat().st_size > _SCAN_LIMIT:
            raise PublishError(f"{path}: {path.stat().st_size} bytes, too large for the text files publish uploads "
                               f"beside the weights (at most {_SCAN_LIMIT >> 20} MiB)")
        else:
            text = path.read_bytes().decode("utf-8", errors="replace")
        if name not in _TOKEN_DATA:
            paths += _json_paths(name, text) if name.endswith(".json") else []
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in _CREDENTIALS:
                if pattern.search(line):
                    secrets.append(f"{name} line {number}: {what}")
            if name not in _TOKEN_DATA and not name.endswith(".json") and (m := _TEXT_PATH.search(line)):
                paths.append(f"{name} line {number}: {m.group(0)[:200]}")
    if secrets:
        raise PublishError(f"{directory} holds what looks like a credential, which publish would upload: "
                           f"{'; '.join(secrets[:8])}; remove it (and revoke the key if it is real)")
    if paths:
        raise PublishError(f"{directory} records local paths, which publish would upload: {'; '.join(paths[:8])}; "
                           "remove them (or re-export with `xpar-zoo convert to-hf`, which records none)")


def _safetensors_metadata(path: Path) -> str:
    """The ``__metadata__`` of a safetensors header as JSON text (one line), or ``""``."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(size, 100 << 20)))
    except (OSError, ValueError, RecursionError):
        return ""  # validate_folder names an unreadable header
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return json.dumps(meta) if meta else ""


def refuse_local_paths(directory: str | os.PathLike) -> None:
    """Raise :class:`PublishError` when a text file anywhere in the folder, subfolders included (``config.json``,
    ``xpar_export.json``, ``sub/README.md``…), records a local path (absolute, ``~``, ``./``, ``file://``, also
    mid-sentence) or a credential: publishing it would put the user's directory layout on the hub. Safetensors files
    are scanned by their header's metadata; binary files (a NUL byte) are skipped."""
    directory = Path(directory)
    names = [str(p.relative_to(directory)) for p in sorted(directory.rglob("*"))
             if p.is_file() and not p.is_symlink() and (p.suffix == ".safetensors" or not _binary(p))]
    scan_upload(directory, names)


def _binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def upload_plan(directory: str | os.PathLike, *, strict: bool = False) -> tuple[list[str], list[str]]:
    """``(files, skipped)``: the top-level files of ``directory`` that publish uploads (:data:`UPLOADED_FILES`,
    :data:`UPLOADED_PATTERNS`) and ``"NAME (why)"`` for every other entry. Raises :class:`PublishError` for a symlink
    that leads out of the folder, and with ``strict`` when anything would be skipped."""
    import fnmatch

    directory = Path(directory)
    root = directory.resolve()
    files, skipped, outside = [], [], []
    for entry in sorted(directory.iterdir(), key=lambda p: p.name):
        name = entry.name
        if entry.is_symlink():
            target = entry.resolve()
            if target != root and root not in target.parents:
                outside.append(f"{name} -> {os.readlink(entry)}")
                continue
        allowed = name in UPLOADED_FILES or any(fnmatch.fnmatchcase(name, p) for p in UPLOADED_PATTERNS)
        if entry.is_dir():
            why = "a training checkpoint" if _CHECKPOINT_DIR.fullmatch(name) else "a directory"
            skipped.append(f"{name}/ ({why})")
        elif name in _NEVER:
            skipped.append(f"{name} ({_NEVER[name]})")
        elif not allowed or not entry.is_file():
            skipped.append(f"{name} (not a file a hub model needs)")
        else:
            files.append(name)
    if outside:
        raise PublishError(f"{directory}: symlinks leading out of the folder, which publish would upload from "
                           f"elsewhere: {'; '.join(outside[:8])}; copy what belongs to the model into the folder")
    if strict and skipped:
        raise PublishError(f"{directory} holds files that are not part of a hub model (--strict): "
                           f"{', '.join(skipped[:12])}{', …' if len(skipped) > 12 else ''}")
    return files, skipped


def _hub_id(value: Any) -> str | None:
    """``value`` when it looks like a hub repo id (``org/name``) rather than a local path."""
    if valid_repo_id(value) and not Path(value).exists():
        return value
    return None


def _md(value: Any) -> str:
    """``value`` as inert Markdown text, one line: ``< > & " '`` as HTML entities and every other ASCII punctuation
    character backslash-escaped (CommonMark), so no tag, link, image, autolink (``https://``, ``www.``, ``a@b``),
    emphasis or heading can form."""
    text = " ".join(str(value).split())[:1000]
    return "".join(html.escape(c, quote=True) if c in "<>&\"'" else "\\" + c if c in _PUNCTUATION else c
                   for c in text)


_PUNCTUATION = frozenset("!#$%()*+,-./:;=?@[\\]^_`{|}~")


def card_fields(config: dict) -> tuple[str, list[str]]:
    """``(model_type, architectures)`` of a config for the model card, checked: a model_type is a short name of
    letters, digits, ``_ . -``; architectures a list of class names (strings). Raises :class:`PublishError`."""
    model_type, architectures = config.get("model_type"), config.get("architectures")
    if not isinstance(model_type, str) or not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,63}", model_type):
        raise PublishError(f"config.json: model_type {str(model_type)[:80]!r} is not a model type name "
                           "(letters, digits, _ . -)")
    if architectures is not None and (not isinstance(architectures, list)
                                      or not all(isinstance(a, str) and a.strip() for a in architectures)):
        raise PublishError(f"config.json: architectures must be a list of class names, got "
                           f"{json.dumps(architectures)[:120]}")
    return model_type, list(architectures or [])


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
    model_type, architectures = card_fields(config)
    base = base_model or _hub_id(info.get("base_model"))
    if base_model is not None and not _hub_id(base_model):
        raise PublishError(f"--base-model {base_model!r} is not a hub repo id (org/name)")
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(config.get(k), int) and not isinstance(config.get(k), bool) and config[k] > 0),
                   None)
    tags = ["xpar_zoo", *(["moe"] if experts else []), model_type]
    xpar: dict[str, Any] = {
        "layout": inspect_checkpoint(directory)["format"],  # hub per-expert / hub fused
        "model_type": model_type,
        "architectures": architectures or None,
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
    mesh = _md(json.dumps(info["mesh"])) if info.get("mesh") else "not recorded"
    lines = [
        f"# {_md(repo_id.split('/')[-1])}", "",
        f"A `{model_type}` model ({', '.join(_md(a) for a in architectures or [model_type])}) in the Hugging Face "
        "hub's own format, loadable with plain transformers or, parallelized (EP / vocab plans + FSDP2), with "
        "xpar_zoo:", "",
        "```python", "import xpar_zoo",
        f"model = xpar_zoo.from_pretrained({repo_id!r}, mesh=xpar_zoo.Mesh({'ep=2' if experts else ''}))", "```",
        "",
        "## Provenance", "",
        f"- base model: {_md(base) if base else 'not recorded'}",
        f"- trained / saved with mesh: {mesh}",
        f"- training step: {_md(info.get('step', 'not recorded'))}",
        f"- {counted(summary['tensors'], 'tensor')} in {counted(len(summary['files']), 'safetensors file')}, "
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


def dry_run_report(directory: Path, repo_id: str, summary: dict[str, Any], card, keep_card: bool,
                   files: list[str] | None = None, skipped: list[str] | None = None) -> str:
    """What ``publish`` would upload: the files, their size, what it skips, and the model card."""
    files = sorted(set(files if files is not None else upload_plan(directory)[0]) | {CARD_FILE})
    skipped = skipped if skipped is not None else upload_plan(directory)[1]
    lines = [f"dry run: would create {repo_id} and upload {counted(len(files), 'file')} from {directory} "
             f"({summary['bytes'] / 2**20:.1f} MiB of safetensors, {counted(summary['tensors'], 'tensor')}):",
             *(f"  {f}" for f in files),
             *([f"skipped (not part of a hub model): {', '.join(skipped)}"] if skipped else []),
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
    strict: bool = False,
) -> str:
    """Validate ``directory``, create ``repo_id`` (``exist_ok``; the branch ``revision`` too when given), write its
    model card (``README.md``; an existing one is kept unless ``overwrite_card``) and upload the files a hub model
    needs (:func:`upload_plan`: anything else is skipped, or refused with ``strict``), none of which may record a
    local path or a credential (:func:`scan_upload`). Returns the URL of the upload commit (or whatever
    ``upload_folder`` returns, as a string). A failed hub call raises :class:`PublishError` and leaves the folder as
    it was (a card written for the upload is removed again). ``dry_run``: validate and return what would be
    uploaded, card included; nothing is written or sent."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    if not valid_repo_id(repo_id):
        raise PublishError(f"{str(repo_id)[:120]!r} is not a hub repo id (org/name: letters, digits, - _ . ; no "
                           "'..' or '--', not starting or ending with - or ., at most 96 characters)")
    summary = validate_folder(directory)
    files, skipped = upload_plan(directory, strict=strict)
    card_path = directory / CARD_FILE
    write_card = overwrite_card or not card_path.exists()
    card = build_model_card(directory, repo_id, base_model=base_model, summary=summary) if write_card else None
    scan_upload(directory, [f for f in files if not (write_card and f == CARD_FILE)],
                {CARD_FILE: str(card)} if write_card else None)
    if dry_run:
        return dry_run_report(directory, repo_id, summary, card, keep_card=not write_card, files=files,
                              skipped=skipped)
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
                           allow_patterns=[glob.escape(f) for f in sorted(set(files) | {CARD_FILE})],
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
