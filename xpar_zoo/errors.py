"""Error types. Every error names the problem (the plan, the tensor, the numbers) and is raised before
expensive work. They subclass the builtin a caller would naturally catch (``ValueError``, ``KeyError``…)."""



def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 rank"``, ``"4 ranks"``: a count and its noun in the right number, for messages."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"

class XparError(Exception):
    """Base class of every error xpar_zoo raises on bad input."""


class MeshError(XparError, ValueError):
    """A mesh that cannot be built over this world, or that does not fit the model's tensors."""


class PlanError(XparError, ValueError):
    """An unknown architecture or plan name, or a plan that does not match the model."""


class UnknownArchitectureError(PlanError, KeyError):
    """A ``model_type`` with no plan in the registry."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RefusedArchitectureError(UnknownArchitectureError):
    """A ``model_type`` that xpar_zoo refuses to train, with the reason (MODEL_CARDS.md lists them)."""


class CheckpointError(XparError, ValueError):
    """A checkpoint that is incomplete, unreadable, or does not fit the model (names the tensors and shapes)."""


class LoadError(XparError, RuntimeError):
    """A checkpoint that cannot be loaded into the model as asked (dtype, quantization, a tensor left unfilled)."""


class ModelStateError(XparError, RuntimeError):
    """A parallelized model that cannot run or be saved as it is: a trainable parameter ``parallelize`` does not
    manage (added or swapped in afterwards), tensors still on the meta device, buffers never initialised."""


class KernelError(XparError, ValueError):
    """A kernel choice that cannot run here: Triton missing, experts in a layout or dtype the kernels do not
    take, tensors on a device they do not run on."""


class BatchError(XparError, ValueError, IndexError):
    """A batch the model cannot take: token ids outside the vocabulary, labels whose shape does not fit the
    hidden states."""


class TrainConfigError(XparError, ValueError):
    """A training configuration that cannot work: an unknown key, a bad value, a resume that does not fit."""


class DataError(XparError, ValueError):
    """Training data that cannot be read, tokenized or packed as asked (names the file, field or numbers)."""


class IntegrationError(XparError, ValueError):
    """A transformers ``Trainer`` or accelerate setup that would not train an xpar_zoo model exactly (a second
    wrap or sharding of the model, autocast, a process count that disagrees with torch.distributed), or a
    checkpoint it cannot resume from (names the setting or the directory)."""


class NonFiniteError(XparError, RuntimeError):
    """NaN or inf where training needs finite numbers (gradients to clip); names the tensors and ranks."""


class AdapterError(XparError, ValueError):
    """A PEFT adapter xpar_zoo cannot train or save as asked: a tuner or option it does not run exactly, an adapter
    file that does not fit the model (names the keys and shapes), PEFT missing."""


class ConvertError(XparError, ValueError):
    """A conversion or export that cannot be done as asked (``xpar-zoo convert``, ``save_pretrained``): an argument
    that does not parse, an output that exists, contains its input or cannot be written, a checkpoint whose pieces
    disagree or that the format cannot hold."""


class RemoteCodeError(XparError, ValueError):
    """A model directory whose config asks for custom code (``auto_map``) that transformers' own classes cannot
    stand in for: xpar_zoo never runs code from a model directory."""


class HubResolutionError(XparError, FileNotFoundError):
    """A name that is neither a usable local directory nor a hub repository reachable (or cached) now."""


class CheckpointMismatchError(XparError, ValueError):
    """A hub checkpoint that does not fit the model: missing, unexpected or wrong-shape keys (each named with its
    file), bad safetensors headers, or a layout xpar_zoo cannot read slice-wise. Raised before any tensor data is
    read."""


class PublishError(XparError, ValueError):
    """A folder that cannot be published as it is (not the hub's format, or naming the local file system), or an
    upload the hub refused."""


class CheckpointWarning(UserWarning):
    """An incomplete or broken checkpoint directory was found and skipped (or, left by an interrupted save, removed)."""


class LeftoverWarning(UserWarning):
    """Staging directories of earlier, interrupted conversions sit beside the output."""
