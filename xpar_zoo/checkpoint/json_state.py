"""Non-tensor checkpoint state as JSON, never pickle: the user's ``extra_state`` and the optimizer's
hyper-parameters and scalar state. Tuples come back as tuples and user dicts that look like the tags as themselves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError

_TUPLE_TAG, _DICT_TAG = "__tuple__", "__dict__"


def to_json(value: Any, what: str) -> Any:
    """``value`` as JSON data; tuples are tagged (``{"__tuple__": [...]}``) so that they come back as tuples, and a
    user dict that looks like a tag is escaped (``{"__dict__": {...}}``) so that it comes back as itself."""
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [to_json(v, what) for v in value]}
    if isinstance(value, list):
        return [to_json(v, what) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{what}: key {k!r} is not a string (JSON)")
            out[k] = to_json(v, what)
        return {_DICT_TAG: out} if set(out) in ({_TUPLE_TAG}, {_DICT_TAG}) else out
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{what}: {type(value).__name__} value {value!r:.80} is not JSON-serialisable")


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json`."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE_TAG}:
            return tuple(from_json(v) for v in value[_TUPLE_TAG])
        if set(value) == {_DICT_TAG} and isinstance(value[_DICT_TAG], dict):
            return {k: from_json(v) for k, v in value[_DICT_TAG].items()}
        return {k: from_json(v) for k, v in value.items()}
    return value
