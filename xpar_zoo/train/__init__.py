"""``xpar-zoo train`` (also ``python -m xpar_zoo.train``): train a model from the hub or a directory with its
xpar_zoo plan, under torchrun on one node or many. See the README's "Training".

- :mod:`~xpar_zoo.train.config`  the settings (YAML file + flags), validated before any work;
- :mod:`~xpar_zoo.train.data`    reading, tokenizing, packing documents into rows, dealing rows to the ranks;
- :mod:`~xpar_zoo.train.inputs`  what a run reads before the model loads (checkpoint to resume, config, data);
- :mod:`~xpar_zoo.train.load`    the parallelized model and the components around it;
- :mod:`~xpar_zoo.train.export`  the exports after the last step;
- :mod:`~xpar_zoo.train.loop`    the run: inputs, model, then the loop: each step, metrics; it calls the components:
- :mod:`~xpar_zoo.train.optim`   AdamW and the learning-rate schedule;
- :mod:`~xpar_zoo.train.checkpointer` the checkpoints due after a step, and resume;
- :mod:`~xpar_zoo.train.evaluate` held-out evaluation when due;
- :mod:`~xpar_zoo.train.router_loss` the router auxiliary loss over the global batch;
- :mod:`~xpar_zoo.loss.balance` expert load, the global router auxiliary loss, the bias update;
- :mod:`~xpar_zoo.train.metrics` ``metrics.jsonl``, the progress bar, TensorBoard.
"""

from __future__ import annotations

import torch.distributed as dist

from ..parallel.teardown import end_process_group
from .config import TrainConfig, add_arguments, config_from_args, read_config_file
from .loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "add_arguments", "config_from_args", "read_config_file", "run", "train"]


def run(cfg: TrainConfig) -> TrainResult:
    """:func:`train` in a process of its own (a torchrun worker or a plain process): initialises the process group
    from the launcher's environment and ends it (a barrier, then ``destroy_process_group``) at the end."""
    owned = not dist.is_initialized()
    try:
        result = train(cfg)
    except BaseException:
        if owned and dist.is_initialized():  # no barrier: another rank may have died
            dist.destroy_process_group()
        raise
    if owned:
        end_process_group()
    return result
