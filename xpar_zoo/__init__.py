"""xpar_zoo: train Hugging Face transformers models with extra parallelism (EP, vocab, any named plan) + FSDP2."""

# The documented module paths ``xpar_zoo.moe``, ``xpar_zoo.registry`` and ``xpar_zoo.vocab`` (e.g.
# ``xpar_zoo.moe.set_experts_kernels``) name the modules where the code lives, the same module objects, so that
# ``import xpar_zoo.moe`` works and patching one reaches the code.
import sys as _sys  # noqa: E402

from . import interrupts as _interrupts

_interrupts.quiet_while_importing()  # the command's first seconds: a Ctrl-C is one line, not a traceback
from .checkpoint import (
    CheckpointFuture,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_metadata,
    save_checkpoint,
    verify_checkpoint,
)
from .errors import (
    AdapterError,
    BatchError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    ConvertError,
    DataError,
    HubResolutionError,
    IntegrationError,
    KernelError,
    LeftoverWarning,
    LoadError,
    MeshError,
    ModelStateError,
    NonFiniteError,
    PlanError,
    PublishError,
    RefusedArchitectureError,
    TrainConfigError,
    UnknownArchitectureError,
    XparError,
)
from .hub.adapter_files import save_adapter
from .hub.weights_stream import iter_hub_weights
from .loader import from_pretrained
from .parallel.clip import clip_grad_norm_
from .parallel.materialize import materialize
from .parallel.mesh import Mesh
from .parallel.options import ParallelOptions
from .parallel.state import full_state_dict
from .parallelize import parallelize
from .styles import experts as moe  # noqa: E402
from .styles import vocab
from .styles.sequence import data_shard, shard_sequence
from .styles.vocab import full_logits
from .version import __version__ as __version__
from .zoo import registry  # noqa: E402
from .zoo.plan import ExtraPlan, Plan
from .zoo.registry import get_plan, supported_architectures

for _name, _module in {"moe": moe, "registry": registry, "vocab": vocab}.items():
    _sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module
_interrupts.end_quiet_import()

__all__ = [
    # errors and warnings
    "AdapterError", "BatchError", "CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "ConvertError",
    "DataError", "HubResolutionError", "IntegrationError", "KernelError", "LeftoverWarning", "LoadError", "MeshError",
    "ModelStateError", "NonFiniteError", "PlanError", "PublishError", "RefusedArchitectureError", "TrainConfigError",
    "UnknownArchitectureError", "XparError",
    # the API
    "CheckpointFuture", "ExtraPlan", "Mesh", "ParallelOptions", "Plan", "clip_grad_norm_", "data_shard",
    "from_pretrained", "full_logits", "full_state_dict", "get_plan", "iter_hub_weights", "latest_checkpoint",
    "load_checkpoint", "materialize", "parallelize", "read_checkpoint_metadata", "save_adapter", "save_checkpoint",
    "shard_sequence", "supported_architectures", "verify_checkpoint",
]
