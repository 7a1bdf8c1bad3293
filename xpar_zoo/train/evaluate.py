"""Held-out evaluation during ``xpar-zoo train`` (``--eval-data``, ``--eval-every``, ``--eval-batches``,
``--save-best``).

``eval_loss`` is the token-weighted mean over the whole held-out set (or its first ``K`` batches): the sum of the
cross-entropy of every valid target over every rank, divided by their count, with the labels and packing of the
training data (conversations: the same targets). Batch ``b`` of data part ``p`` of ``P`` holds the held-out rows
``(b·P + p)·micro_batch + [0, micro_batch)``; rows past the end are padding. A part is a rank's, or with ``sp``/``cp``
a sequence group's (:func:`xpar_zoo.data_shard`: its ranks read the same rows, and their targets count once). No gradient; the model is put back
in training mode with its FSDP parameters resharded, so the next step is the step it would have been.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from ..loss.global_batch import count_targets, global_count
from .data import flatten_rows
from .packing import padding_rows


class Evaluator:
    """The held-out rows of ``corpus`` (one epoch, in the corpus's epoch-0 order) dealt to the ranks."""

    def __init__(self, corpus, *, world: int, rank: int, micro_batch: int, max_batches: int | None, flatten: bool,
                 device: torch.device, pad_id: int, part: int | None = None, parts: int | None = None,
                 every: int | None = None):
        self.corpus, self.world, self.rank, self.micro_batch, self.every = corpus, world, rank, micro_batch, every
        self.part, self.parts = (rank, world) if parts is None else (part, parts)
        self.group = world // self.parts  # ranks that read the same rows (a sequence group)
        self.flatten, self.device, self.pad_id = flatten, device, pad_id
        self.batches = math.ceil(corpus.rows_per_epoch / (self.parts * micro_batch))
        if max_batches is not None:
            self.batches = min(self.batches, max_batches)

    def due(self, step: int, last_step: int) -> bool:
        """Whether the run evaluates after ``step``: every ``every`` steps (``--eval-every``) and after its last."""
        return step == last_step or bool(self.every and step % self.every == 0)

    def _batch(self, b: int) -> dict[str, torch.Tensor]:
        first = (b * self.parts + self.part) * self.micro_batch
        real = max(0, min(self.micro_batch, self.corpus.rows_per_epoch - first))
        parts = [self.corpus.rows(first, real)] if real else []
        if real < self.micro_batch:
            parts.append(padding_rows(self.micro_batch - real, self.corpus.seq_len, self.pad_id))
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, float]:
        """``{"eval_loss", "eval_targets", "eval_time_s"}`` of the model as it is now. A collective."""
        start = time.perf_counter()
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0.0
        try:
            for b in range(self.batches):
                batch = self._batch(b)
                n = global_count(count_targets(batch["labels"]), device=self.device) / self.group  # on every rank
                if n.item() == 0:
                    continue
                if self.flatten:
                    batch = flatten_rows(batch)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                extra = {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}
                out = model(**batch, num_items_in_batch=n, use_cache=False, **extra)
                # out.loss is this rank's share world · (its targets' summed loss) / n
                total += out.loss.detach().double() * n.double() / self.world
                count += n.item()
        finally:
            model.train()
            reshard(model)
        if self.world > 1:
            dist.all_reduce(total)
        return {"eval_loss": total.item() / count if count else float("nan"), "eval_targets": int(count),
                "eval_time_s": time.perf_counter() - start}


def reshard(model: nn.Module) -> None:
    """Free the unsharded parameters FSDP2 keeps after a forward without backward (the root module's)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
