"""Losses: the global-batch token-mean loss (:mod:`.global_batch`, re-exported here: ``xpar_zoo.loss.global_count``,
``xpar_zoo.loss.count_targets``), the fused vocab-parallel head and cross-entropy (:mod:`.fused`), and the router
auxiliary loss and expert-load balancing (:mod:`.balance`)."""

from .global_batch import *  # noqa: F401,F403  (the documented ``xpar_zoo.loss.*`` names)
