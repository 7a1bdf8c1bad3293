"""xpar_zoo: train Hugging Face transformers models with extra parallelism (EP, vocab, any named plan) + FSDP2."""

from .checkpoint import (CheckpointFuture, latest_checkpoint, load_checkpoint, read_checkpoint_metadata,
                         save_checkpoint, verify_checkpoint)
from .clip import clip_grad_norm_
from .errors import (AdapterError, BatchError, CheckpointError, CheckpointMismatchError, CheckpointWarning,
                     ConvertError, DataError, HubResolutionError, IntegrationError, KernelError, LeftoverWarning,
                     LoadError, MeshError, ModelStateError, NonFiniteError, PlanError, PublishError,
                     RefusedArchitectureError, TrainConfigError, UnknownArchitectureError, XparError)
from .integrations.peft_files import save_adapter
from .loader import from_pretrained
from .materialize import materialize
from .mesh import Mesh
from .parallelize import parallelize
from .plan import ExtraPlan, Plan
from .registry import get_plan, supported_architectures
from .state import full_state_dict
from .styles.sequence import data_shard, shard_sequence
from .vocab import full_logits

__version__ = "0.1.0"

__all__ = [
    # errors and warnings
    "AdapterError", "BatchError", "CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "ConvertError",
    "DataError", "HubResolutionError", "IntegrationError", "KernelError", "LeftoverWarning", "LoadError", "MeshError",
    "ModelStateError", "NonFiniteError", "PlanError", "PublishError", "RefusedArchitectureError", "TrainConfigError",
    "UnknownArchitectureError", "XparError",
    # the API
    "CheckpointFuture", "ExtraPlan", "Mesh", "Plan", "clip_grad_norm_", "data_shard", "from_pretrained",
    "full_logits",
    "full_state_dict", "get_plan", "latest_checkpoint", "load_checkpoint", "materialize", "parallelize",
    "read_checkpoint_metadata", "save_adapter", "save_checkpoint", "shard_sequence", "supported_architectures",
    "verify_checkpoint",
]
