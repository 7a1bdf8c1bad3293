"""A model directory's ``config.json`` read without running anything from it.

xpar_zoo trains transformers' own classes. A config whose ``auto_map`` points at Python files of the model
directory (custom code, which transformers runs with ``trust_remote_code=True``, or asks about at a prompt) is read
here first: when its ``model_type`` is one of transformers' own, the custom code is ignored with one line saying so
and the config is transformers' class; otherwise it is refused with one line (:class:`RemoteCodeError`). Every
config, tokenizer and model load in the package passes ``trust_remote_code=False``; every command and
``xpar_zoo.from_pretrained`` reads configs through :func:`load_config`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..environment import launcher_rank
from ..errors import LoadError, RemoteCodeError

CONFIG_FILE = "config.json"
REMOTE_CODE_KEY = "auto_map"
MAX_CONFIG_BYTES = 16 << 20  # a config is metadata: a bigger file is not one
SIZE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size",
             "num_attention_heads", "vocab_size")

logger = logging.getLogger(__name__)


def _custom_code(auto_map: Any) -> str:
    """``AutoConfig → configuration_x.Foo, …`` (at most three entries) of an ``auto_map`` value."""
    if isinstance(auto_map, dict):
        items = [f"{k} → {v}" for k, v in list(auto_map.items())[:3]]
        return ", ".join(items) + (", …" if len(auto_map) > 3 else "")
    return repr(auto_map)[:120]


def transformers_class_of(model_type: Any) -> str | None:
    """The name of transformers' own config class for ``model_type``, or None when transformers has none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type].__name__
    return None


def check_remote_code(data: Any, where: str | os.PathLike) -> bool:
    """Refuse, with one :class:`RemoteCodeError` line, a config (JSON data) that asks for code from the model
    directory (``auto_map``) and whose ``model_type`` transformers does not know; for one it knows, say once (rank
    0, once per read) that the custom code is not run and return True. False when there is no custom code."""
    if not isinstance(data, dict) or REMOTE_CODE_KEY not in data:
        return False
    model_type = data.get("model_type")
    code = _custom_code(data[REMOTE_CODE_KEY])
    if transformers_class_of(model_type) is None:
        raise RemoteCodeError(
            f"{where}: the config asks to run custom code from the model directory ({REMOTE_CODE_KEY}: {code}) and "
            f"its model_type {model_type!r} is not one of transformers' own; xpar_zoo never runs code from a model "
            "directory (it could do anything on this machine) and trains transformers' own classes only")
    if launcher_rank() == 0:
        logger.warning("xpar-zoo: note: %s names custom code (%s: %s); it is not run: xpar_zoo trains transformers' "
                       "own %r class", where, REMOTE_CODE_KEY, code, model_type)
    return True


def read_config_json(directory: str | os.PathLike, error: type[Exception] = LoadError) -> dict:
    """The JSON data of ``directory/config.json``, custom code checked (:func:`check_remote_code`); a missing,
    oversized or malformed file raises ``error`` naming it."""
    path = Path(directory) / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise error(f"{path}: {path.stat().st_size} bytes, not a model config (at most {MAX_CONFIG_BYTES})")
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise error(f"{path} does not exist") from None
    except (OSError, ValueError, RecursionError) as e:  # unreadable, invalid UTF-8 / JSON, nested too deeply
        first = (str(e).splitlines() or [""])[0][:200]
        what = "not a valid JSON file: " if isinstance(e, json.JSONDecodeError) else ""
        raise error(f"{path}: cannot read the model config ({what}{type(e).__name__}: {first})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a model config is a JSON object, got {type(data).__name__}")
    check_remote_code(data, path)
    check_sizes(data, path, error)
    return data


def _is_size(value) -> bool:
    """A whole number of at least 1, or a non-empty flat list (one per modality) or dict (lxmert) of them."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    parts = list(value.values()) if isinstance(value, dict) else value
    return whole(value) or (isinstance(parts, list) and bool(parts) and all(whole(v) for v in parts))


def check_sizes(data: dict, where: str | os.PathLike, error: type[Exception] = LoadError) -> None:
    """Raise ``error`` naming the key when one of the model's sizes in config ``data`` (or its ``text_config``) is
    not a whole number of at least 1 (or a non-empty list or dict of them: ernie4_5_vl_moe gives one expert width
    per modality): a zero or negative layer count or width only gives wrong shapes later."""
    for part in (data, data.get("text_config")):
        if not isinstance(part, dict):
            continue
        for key in SIZE_KEYS:
            value = part.get(key)
            if value is not None and not _is_size(value):
                prefix = "text_config." if part is not data else ""
                raise error(f"{where}: {prefix}{key} is {json.dumps(value)}: a model size must be a whole number of "
                            "at least 1")


def load_config(directory: str | os.PathLike, error: type[Exception] = LoadError):
    """The transformers config in ``directory``, never running code from it (:func:`check_remote_code`,
    ``trust_remote_code=False``); a missing, malformed or unrecognised ``config.json`` raises ``error`` naming the
    file. An ignored ``auto_map`` is dropped from the config, so nothing saved from it points at code."""
    from transformers import AutoConfig

    path = Path(directory) / CONFIG_FILE
    data = read_config_json(directory, error)
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).splitlines() or [""])[0][:300]
        raise error(f"{path}: cannot read the model config ({type(e).__name__}: {first})") from None
    if REMOTE_CODE_KEY in data and hasattr(config, REMOTE_CODE_KEY):
        delattr(config, REMOTE_CODE_KEY)
    return config


def config_from_dict(data: dict, where: str, error: type[Exception] = LoadError):
    """The transformers config of JSON ``data`` (e.g. recorded in a checkpoint), custom code checked as
    :func:`load_config` does."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    check_remote_code(data, where)
    model_type = data.get("model_type")
    if transformers_class_of(model_type) is None:
        raise error(f"{where}: model_type {model_type!r} is unknown to this transformers")
    data = {k: v for k, v in data.items() if k != REMOTE_CODE_KEY}
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except (ValueError, KeyError, TypeError) as e:
        raise error(f"{where}: not a valid {model_type} config ({type(e).__name__}: {str(e)[:200]})") from None
