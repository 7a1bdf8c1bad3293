"""What a transformers model's forward code does, read from its source: no public transformers API says whether a
model reads its input embedding's weight outside the embedding's own forward (e.g. Gemma4Model's pad embedding), and
both the FSDP layout (which keeps such a weight with the root) and the vocab styles (which cannot split it) need to
know."""

from __future__ import annotations

import functools
import inspect
import re

from torch import nn


@functools.cache
def forward_source(fn) -> str:
    """The source text of ``fn`` (``""`` where there is none, e.g. a builtin)."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def embedding_weight_read(model: nn.Module, module: nn.Module) -> str | None:
    """The first line of a forward of ``model`` (or of a transformers model inside it) that reads the input
    embedding ``module``'s weight directly instead of calling the module (e.g. Gemma4Model's pad embedding), or
    ``None``. Such a model needs the whole weight outside the embedding's own forward: the ``emb`` plan cannot
    split it, and FSDP keeps it with the root's parameters."""
    from transformers import PreTrainedModel

    attr = next((n.rpartition(".")[2] for n, m in model.named_modules() if m is module), None)
    if not attr:
        return None
    classes = {type(m) for m in model.modules() if isinstance(m, PreTrainedModel)}
    return next((line for cls in sorted(classes, key=lambda c: c.__name__)
                 if (line := _forward_weight_read(cls, attr)) is not None), None)


@functools.cache
def _forward_weight_read(cls: type, attr: str) -> str | None:
    source = forward_source(cls.forward)
    pattern = re.compile(rf"\b{re.escape(attr)}\.weight\b(?!\.(dtype|device|shape))")
    return next((line.strip() for line in source.splitlines() if pattern.search(line)), None)
