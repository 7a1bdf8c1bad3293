"""xpar_zoo: train Hugging Face transformers models with extra parallelism (EP, vocab, any named plan) + FSDP2."""

from .checkpoint import (CheckpointFuture, latest_checkpoint, load_checkpoint, read_checkpoint_metadata,
                         save_checkpoint)
from .clip import clip_grad_norm_
from .errors import (AdapterError, BatchError, CheckpointError, KernelError, LoadError, MeshError, ModelStateError,
                     PlanError, RefusedArchitectureError, UnknownArchitectureError, XparError)
from .integrations.peft import save_adapter
from .loader import from_pretrained
from .materialize import materialize
from .mesh import Mesh
from .parallelize import parallelize
from .plan import ExtraPlan, Plan
from .registry import get_plan, supported_architectures
from .state import full_state_dict
from .vocab import full_logits

__version__ = "0.1.0"

__all__ = [
    "AdapterError", "BatchError", "CheckpointError", "CheckpointFuture", "ExtraPlan", "KernelError", "LoadError", "Mesh",
    "MeshError", "ModelStateError", "Plan", "PlanError", "RefusedArchitectureError", "UnknownArchitectureError",
    "XparError", "clip_grad_norm_", "from_pretrained", "full_logits", "full_state_dict", "get_plan",
    "latest_checkpoint", "load_checkpoint", "materialize", "parallelize", "read_checkpoint_metadata", "save_adapter",
    "save_checkpoint", "supported_architectures",
]
