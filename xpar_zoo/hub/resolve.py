"""Resolve a model name to a local directory holding what loading needs — and nothing more.

``name`` is a local directory, or a hub id (``org/name``, at ``revision``) fetched with huggingface_hub into its
cache, or found there when ``HF_HUB_OFFLINE=1``. Only the config, the safetensors index and the shards it lists,
and generation / tokenizer files are fetched: never ``*.bin`` / ``*.pt`` (pickle), never a second copy of the
weights in another format (e.g. ``consolidated.safetensors``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..environment import proxy_configured
from ..errors import HubResolutionError
from .safetensors_files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE

# Small files beside the weights that a model needs to generate or tokenize.
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
)


@dataclass(frozen=True)
class ResolvedModel:
    """A local directory with a model's config and safetensors weights; ``origin`` is ``"local"`` or the hub id
    (with ``revision``, and ``commit`` when the cache says which)."""

    directory: Path
    origin: str
    revision: str | None = None
    commit: str | None = None


def is_offline() -> bool:
    """Whether huggingface_hub is in offline mode (``HF_HUB_OFFLINE``)."""
    import huggingface_hub

    return huggingface_hub.is_offline_mode()


PROBE_TIMEOUT_S = 5.0  # how long a hub that does not answer is waited for, instead of minutes of retries


def hub_unreachable() -> str | None:
    """Why the hub endpoint (``HF_ENDPOINT``) cannot be reached now (one TCP connection, at most
    :data:`PROBE_TIMEOUT_S`), or None when it can, or when a proxy is configured (the proxy decides)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if proxy_configured():
        return None
    url = urlsplit(constants.ENDPOINT)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        with socket.create_connection((url.hostname or "", port), timeout=PROBE_TIMEOUT_S):
            return None
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        return f"the hub at {constants.ENDPOINT} is unreachable ({why})"


def _valid_hub_id(text: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _path_reason(name: str | os.PathLike, cache_dir: str | os.PathLike | None) -> str | None:
    """Why ``name`` can only mean a local path (absolute, ``./``, ``../``, ``~``, a trailing or a second slash, a
    backslash; a bare ``name`` without ``org/`` that the local cache does not hold; or
    ``dir/name`` where ``dir`` is a local directory and the hub id is not in the local cache), ``"invalid"`` for a
    name no hub id can have, or None when it may be a hub id."""
    from huggingface_hub import try_to_load_from_cache

    text = os.fspath(name)
    if (isinstance(name, os.PathLike) or os.path.isabs(text) or text.startswith((".", "~")) or text.endswith("/")
            or text.count("/") > 1 or "\\" in text or os.sep in text.replace("/", "")):
        return "a hub id looks like org/name"
    if not _valid_hub_id(text):
        return "invalid"
    if "/" not in text and not isinstance(try_to_load_from_cache(text, CONFIG_FILE, cache_dir=cache_dir), str):
        return "a hub id looks like org/name"
    head = text.split("/", 1)[0]
    if "/" in text and Path(head).is_dir():
        if not isinstance(try_to_load_from_cache(text, CONFIG_FILE, cache_dir=cache_dir), str):
            return (f"{head}/ is a local directory, so the name is not looked up on the hub; for the hub repo of "
                    "that name, run from another directory")
    return None


def refuse_missing_local(name: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> None:
    """Raise :class:`HubResolutionError` at once for a local path that is no directory, before any hub request."""
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        raise HubResolutionError(f"{os.fspath(name)} is a file, not a model directory (config.json and safetensors)")
    if not path.exists() and (why := _path_reason(name, cache_dir)):
        if why == "invalid":
            raise HubResolutionError(f"{os.fspath(name)!r} is neither a local directory nor a valid hub repo id (no "
                                     "such directory; a hub id is org/name: letters, digits, - _ .)")
        raise HubResolutionError(f"{os.fspath(name)} does not exist (no such local directory; {why})")


def resolve(name: str | os.PathLike, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None,
            token: str | bool | None = None, weights: bool = True) -> ResolvedModel:
    """A local directory with ``name``'s config and weights: ``name`` itself when it is a directory, else the hub
    snapshot of repo ``name`` at ``revision`` (downloaded, or from the cache offline). ``weights=False``: only the
    config and side files (tokenizer, generation config) are fetched. Raises :class:`HubResolutionError` naming
    what is missing."""
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise HubResolutionError(f"revision={revision!r} was given but {path} is a local directory")
        if not (path / CONFIG_FILE).is_file():
            raise HubResolutionError(f"{path} is a directory without {CONFIG_FILE}")
        return ResolvedModel(path.resolve(), "local")
    refuse_missing_local(name, cache_dir)
    return _resolve_hub(str(name), revision, cache_dir, token, weights)


def resolve_config(name: str | os.PathLike, revision: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                   token: str | bool | None = None) -> Path:
    """The ``config.json`` of a local directory or hub repo (fetched alone, or from the cache offline), for tools
    that need the architecture but no weights (the sizer). Raises :class:`HubResolutionError` naming the problem."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError

    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise HubResolutionError(f"{path} is a directory without {CONFIG_FILE}")
        return path / CONFIG_FILE
    refuse_missing_local(name, cache_dir)
    where = f"{str(name)!r}" + (f" at revision {revision!r}" if revision else "")
    local_only, mode = _search_mode()
    try:
        return Path(hf_hub_download(str(name), CONFIG_FILE, revision=revision, cache_dir=cache_dir, token=token,
                                    local_files_only=local_only))
    except HFValidationError:
        raise HubResolutionError(f"{str(name)!r} is neither a local directory nor a valid hub repo id") from None
    except Exception as e:  # not found, no network, not cached, gated…: one clear error naming the repo
        raise HubResolutionError(f"cannot get the {CONFIG_FILE} of {where}{mode}: {type(e).__name__}") from None


def _search_mode() -> tuple[bool, str]:
    """``(cache only, what the error adds)``: offline mode, or a hub that does not answer now (said at once, not
    after huggingface_hub's minutes of retries), search only the local cache."""
    if is_offline():
        return True, " (HF_HUB_OFFLINE=1: only the local huggingface_hub cache is searched)"
    unreachable = hub_unreachable()
    if unreachable:
        return True, f" ({unreachable}: only the local huggingface_hub cache is searched)"
    return False, ""


def _resolve_hub(repo_id: str, revision: str | None, cache_dir, token, weights: bool = True) -> ResolvedModel:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
    )

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    local_only, mode = _search_mode()

    def fetch(filename: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir, token=token,
                                        local_files_only=local_only))
        except (EntryNotFoundError, LocalEntryNotFoundError):
            return None

    try:
        config = fetch(CONFIG_FILE)
    except HFValidationError:
        raise HubResolutionError(f"{repo_id!r} is neither a local directory nor a valid hub repo id") from None
    except Exception as e:  # repo / revision not found, no network, gated…: one clear error naming the repo
        raise HubResolutionError(f"cannot resolve {where}{mode}: {type(e).__name__}: {e}") from None
    if config is None:
        raise HubResolutionError(f"{where}: no {CONFIG_FILE} (not in the repo, or neither reachable nor cached){mode}")
    index = fetch(INDEX_FILE) if weights else None
    if not weights:
        needed = [CONFIG_FILE]
    elif index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HubResolutionError(f"{where}: {INDEX_FILE} is not a valid index ({type(e).__name__}: {e})") from None
        needed = [CONFIG_FILE, INDEX_FILE, *shards]
    elif fetch(SINGLE_FILE) is not None:
        needed = [CONFIG_FILE, SINGLE_FILE]
    else:
        raise HubResolutionError(f"{where} has neither {INDEX_FILE} nor {SINGLE_FILE}{mode}; xpar_zoo loads "
                                 "safetensors weights only")
    directory = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                       allow_patterns=[*needed, *SIDE_FILES], local_files_only=local_only))
    absent = [f for f in needed if not (directory / f).is_file()]
    if absent:
        raise HubResolutionError(f"{where}: {absent} missing from {directory}{mode}")
    commit = directory.name if directory.parent.name == "snapshots" else None
    return ResolvedModel(directory, repo_id, revision, commit)
