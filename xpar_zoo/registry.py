"""The zoo's registry: every module in ``xpar_zoo.plans`` that defines ``PLAN`` registers one architecture.

Adding an architecture = adding one file to ``plans/``. The CLI's ``list``, MODEL_CARDS.md and the README table
are generated from here, so documentation cannot drift from code.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from .errors import UnknownArchitectureError
from .plan import Plan


@lru_cache(maxsize=1)
def _curated() -> dict[str, Plan]:
    from . import plans

    found: dict[str, Plan] = {}
    for info in sorted(pkgutil.iter_modules(plans.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        plan = getattr(importlib.import_module(f"{plans.__name__}.{info.name}"), "PLAN", None)
        if isinstance(plan, Plan):
            if plan.model_type in found:
                raise RuntimeError(f"two plan files declare model_type {plan.model_type!r}")
            found[plan.model_type] = plan
    return found


def supported_architectures() -> list[str]:
    """The ``model_type`` names that have a curated plan, sorted."""
    return sorted(_curated())


def get_plan(model_type: str) -> Plan:
    """The :class:`Plan` for ``model_type``; raises an error listing the supported types when there is none."""
    plans = _curated()
    if model_type not in plans:
        raise UnknownArchitectureError(
            f"no xpar_zoo plan for model_type {model_type!r}; supported: {', '.join(sorted(plans))}"
        )
    return plans[model_type]
