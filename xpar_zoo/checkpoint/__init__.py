"""Checkpoints: torch DCP at global shapes (every expert, every vocab row), reshardable onto any mesh or world size,
with the optimizer state, each rank's RNG state and the user's JSON state, written atomically and checked on load.

- :mod:`.layout`     the directory protocol of a root (``step-N``, ``.tmp-…``, the COMPLETE marker), scanning, commit
                     and pruning;
- :mod:`.save`       :func:`save_checkpoint` (synchronous or async) and :class:`CheckpointFuture`;
- :mod:`.load`       :func:`load_checkpoint` and :func:`verify_checkpoint`;
- :mod:`.state`      model / optimizer state dicts, the metadata record, the fit checks;
- :mod:`.dcp_io`     safe DCP reading (no code from ``.metadata``), checksummed writing, streaming full tensors;
- :mod:`.json_state` and :mod:`.rng`: the non-tensor state.

Every rank calls both (:mod:`xpar_zoo.parallel.rendezvous`); the root must be one filesystem that every rank sees. The
protocol, the checksums and the safe unpickler: ``docs/design.md``, "Checkpoints".
"""

from ..errors import CheckpointWarning
from .dcp_io import (
                     MODEL_KEY,
                     OPTIM_KEY,
                     SafeReader,
                     iter_model_tensors,
                     model_tensor_specs,
                     read_dcp_metadata,
)
from .layout import (
                     COMPLETE_FILE,
                     DCP_METADATA,
                     EXTRA_FILE,
                     FORMAT,
                     META_FILE,
                     STEP_PREFIX,
                     TMP_PREFIX,
                     checkpoint_name,
                     complete_record,
                     incomplete_reason,
                     latest_checkpoint,
                     read_checkpoint_metadata,
                     resolve_checkpoint,
                     scan_root,
                     step_of,
                     write_complete_marker,
)
from .load import load_checkpoint, verify_checkpoint
from .save import CheckpointFuture, save_checkpoint

__all__ = [
    "COMPLETE_FILE", "CheckpointFuture", "CheckpointWarning", "DCP_METADATA", "EXTRA_FILE", "FORMAT", "META_FILE",
    "MODEL_KEY", "OPTIM_KEY", "STEP_PREFIX", "SafeReader", "TMP_PREFIX", "checkpoint_name", "complete_record",
    "incomplete_reason", "iter_model_tensors", "latest_checkpoint", "load_checkpoint", "model_tensor_specs",
    "read_checkpoint_metadata", "read_dcp_metadata", "resolve_checkpoint", "save_checkpoint", "scan_root", "step_of",
    "verify_checkpoint", "write_complete_marker",
]
