"""The call of a wrapped forward by argument name: what the styles that wrap a transformers forward (the sp/cp model
forward, the hybrid mixers, the multimodal encoders) read from it, however it was passed."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any


def call_arguments(signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: value}`` of a call ``(*args, **kwargs)`` to a function of ``signature``: the arguments given, those
    its ``**kwargs`` collected by their own names (not under the catch-all's)."""
    named = dict(signature.bind_partial(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, None) or {})
    return named
