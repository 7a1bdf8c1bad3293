"""The settings that change what a parallelized model computes or which collectives it runs, as one value:
:class:`ParallelOptions`, given to ``parallelize(model, mesh, options=...)`` (and ``from_pretrained``, ``xpar-zoo
train``, ``XparTrainer``), checked equal on every rank there, and read by the styles from the model's parallel state.

Environment variables are defaults only, read by :meth:`ParallelOptions.from_env` where a user's call enters the
library (``parallelize`` without ``options``, the ``train`` and ``size`` commands), never inside a forward. Every
on/off variable goes through one parser (:func:`parse_switch`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError

CP_ATTENTION = ("lower_right", "dense")
# Where cp's plain causal rows on sdpa run lower-right unless the options say otherwise: the devices whose sdpa keeps
# no dense mask on that path (CUDA's flash kernels; the CPU's flash kernel with a strided mask).
LOWER_RIGHT_DEVICES = ("cuda", "cpu")
CPU_COLLECTIVES = ("in_place", "gloo")
# The environment variable that gives each field its default (read by ParallelOptions.from_env only).
ENV = {
    "attention_block_mib": "XPAR_ZOO_ATTENTION_BLOCK_MIB",
    "cp_attention": "XPAR_ZOO_CP_ATTENTION",
    "mixer_recompute": "XPAR_ZOO_MIXER_RECOMPUTE",
    "cpu_collectives": "XPAR_ZOO_GLOO_IN_PLACE",
}
SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("0", "false", "no", "off")
# The blocked sp/cp attention's budget for one block of queries (MiB) where the options set none: on a GPU every
# block is a kernel launch and a host step (twice with the recompute), which cost more there than a few hundred MiB
# of its memory; on the CPU memory is what binds.
ATTENTION_BLOCK_MIB = 16.0
ATTENTION_BLOCK_MIB_ACCELERATOR = 256.0


def parse_switch(raw: str, what: str) -> bool:
    """An on/off value (``1/true/yes/on``, ``0/false/no/off``, any case) as a bool; :class:`PlanError` naming
    ``what`` for anything else."""
    value = raw.strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    raise PlanError(f"{what}={raw!r}: expected an on/off value ({'/'.join(SWITCH_ON)} or {'/'.join(SWITCH_OFF)})")


def _parse(name: str, raw: str, variable: str) -> object:
    """Field ``name``'s value from the text ``raw`` of its variable (checked by :class:`ParallelOptions`)."""
    if name == "attention_block_mib":
        try:
            return float(raw)
        except ValueError:
            return raw  # not a number: refused by ParallelOptions, naming the value
    if name == "cp_attention":
        return raw.lower()
    on = parse_switch(raw, variable)
    return on if name == "mixer_recompute" else ("in_place" if on else "gloo")


@dataclass(frozen=True)
class ParallelOptions:
    """How a parallelized model runs, beyond its mesh and plan. Every field is checked when the object is made
    (one :class:`PlanError` line).

    - ``attention_block_mib``: the bytes (MiB) one block of queries of the sp/cp masked attention may hold for its
      mask and eager's scores; where the whole mask fits, it is built once per forward and shared by the layers.
      ``None``: 256 MiB on an accelerator, 16 MiB on the CPU.
    - ``cp_attention``: cp's plain causal rows on sdpa: ``"lower_right"`` (no dense mask: each query chunk against
      the key prefix that ends where it ends) or ``"dense"`` (the masked attention). ``None``: lower-right on CUDA
      and the CPU, dense elsewhere.
    - ``mixer_recompute``: a hybrid model's sequence mixers (run on the group's whole rows under sp/cp) recompute
      their whole-row forward in backward, keeping only this rank's input; ``False`` keeps their whole rows.
    - ``cpu_collectives``: on a CPU mesh, ``"in_place"`` gives every FSDP unit the in-place gloo collectives of
      :mod:`xpar_zoo.parallel.gloo_comms`, ``"gloo"`` keeps FSDP2's own.
    """

    attention_block_mib: float | None = None
    cp_attention: str | None = None
    mixer_recompute: bool = True
    cpu_collectives: str = "in_place"

    def __post_init__(self) -> None:
        mib = self.attention_block_mib
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, (int, float)) or not math.isfinite(mib)
                                or mib <= 0):
            raise PlanError(f"attention_block_mib must be a positive number of MiB, got {mib!r}")
        if self.cp_attention is not None and self.cp_attention not in CP_ATTENTION:
            raise PlanError(f"cp_attention must be one of {', '.join(CP_ATTENTION)}, got {self.cp_attention!r}")
        if not isinstance(self.mixer_recompute, bool):
            raise PlanError(f"mixer_recompute must be True or False, got {self.mixer_recompute!r}")
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise PlanError(f"cpu_collectives must be one of {', '.join(CPU_COLLECTIVES)}, got "
                            f"{self.cpu_collectives!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given) -> ParallelOptions:
        """The options with the environment's defaults (``os.environ``, or ``environ``) for the fields not
        ``given``: ``XPAR_ZOO_ATTENTION_BLOCK_MIB`` (MiB), ``XPAR_ZOO_CP_ATTENTION`` (``lower_right`` / ``dense``),
        ``XPAR_ZOO_MIXER_RECOMPUTE`` and ``XPAR_ZOO_GLOO_IN_PLACE`` (on/off, :func:`parse_switch`; off:
        ``cpu_collectives="gloo"``). A bad value is one :class:`PlanError` line naming the variable. Called where a
        user's call enters the library, once."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, variable in ENV.items():
            raw = environ.get(variable, "").strip()
            if name in given or not raw:
                continue
            values[name] = _parse(name, raw, variable)
            try:  # checked alone, so that the error names the variable
                cls(**{name: values[name]})
            except PlanError as e:
                raise PlanError(f"{variable}={raw!r}: {e}") from None
        return cls(**values, **given)

    def replace(self, **changes) -> ParallelOptions:
        """A copy with ``changes`` (checked as a new object is)."""
        return dataclasses.replace(self, **changes)

    def block_budget(self, device_type: str | None) -> float:
        """The bytes of one block of the blocked sp/cp attention on a device of ``device_type`` (``None``: the CPU's
        default)."""
        if self.attention_block_mib is not None:
            return self.attention_block_mib * 2 ** 20
        accelerator = device_type is not None and device_type not in ("cpu", "meta")
        return (ATTENTION_BLOCK_MIB_ACCELERATOR if accelerator else ATTENTION_BLOCK_MIB) * 2 ** 20

    def cp_lower_right(self, device_type: str) -> bool:
        """Whether cp's plain causal rows on sdpa run without a mask on ``device_type``."""
        return self.cp_attention == "lower_right" if self.cp_attention else device_type in LOWER_RIGHT_DEVICES

    def agreement(self) -> dict[str, object]:
        """The fields by name, for the check that every rank was given the same."""
        return dataclasses.asdict(self)
