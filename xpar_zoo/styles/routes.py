"""Fixed routes for a run whose tensors have shapes but no values (a simulated world, :mod:`xpar_zoo.sizing.simulate`):
how many rows each all-to-all of the ``experts`` and ``embedding`` styles sends and receives, where a real run
counts them from the router's choices or the token ids, and the vocab-parallel head's row count on every group rank
(the same as this rank's), where a real run exchanges them (host syncs that fake tensors cannot answer).

Given to a model's modules by :func:`install_routes` and read back by the styles with :func:`fixed_routes`; without
them (every real run) the styles count as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

# The attribute that holds a module's fixed routes, named once here: set and read by the functions below.
_ROUTES = "_xpar_routes"


def even_split(total: int, parts: int) -> list[int]:
    """``total`` rows in ``parts`` parts that differ by at most one row, the larger first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclass(frozen=True)
class Routes:
    """Balanced routes seen from the busiest rank of a group: every rank spreads its rows evenly over the group's
    ranks (and a rank's experts evenly over its rows); this rank receives ``imbalance`` times the rows it sends
    (1.0: perfectly balanced routing, every rank receives what it sends)."""

    imbalance: float = 1.0

    def received(self, sent: int) -> int:
        """The rows this rank receives when each rank sends ``sent``."""
        return round(sent * self.imbalance)

    def splits(self, sent: int, size: int) -> tuple[list[int], list[int]]:
        """``(send_splits, recv_splits)`` over a group of ``size`` ranks for ``sent`` rows of this rank."""
        return even_split(sent, size), even_split(self.received(sent), size)

    def expert_counts(self, rows: int, size: int, local: int) -> tuple[list[int], list[list[int]]]:
        """Rows per global expert this rank sends (``size·local`` experts, ``local`` per rank) and the
        ``[source rank][local expert]`` rows it receives, for ``rows`` (token, k) pairs of this rank."""
        send, recv = self.splits(rows, size)
        counts = [n for part in send for n in even_split(part, local)]
        return counts, [even_split(part, local) for part in recv]


def install_routes(modules: Iterable[nn.Module], routes: Routes) -> int:
    """Give each of ``modules`` (the experts modules, EP or not: their counts are data too, and the vocab-parallel
    embeddings and heads of a model) the fixed ``routes``; returns how many modules took them."""
    count = 0
    for module in modules:
        setattr(module, _ROUTES, routes)
        count += 1
    return count


def fixed_routes(module: nn.Module) -> Routes | None:
    """The fixed routes :func:`install_routes` gave ``module``, else ``None`` (a real run: count the rows)."""
    return getattr(module, _ROUTES, None)
