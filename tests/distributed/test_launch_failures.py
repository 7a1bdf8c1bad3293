"""xpar_zoo.testing.launch when a rank dies: after the job finished the result stands; during it, the job fails."""

import os

import pytest

from xpar_zoo.testing import launch

# ---- a rank that dies or hangs during a load -------------------------------------------------------------------------
RANK_TIMEOUT_S = 15



def _abort_at_exit_on_rank_1() -> str:
    import atexit

    import torch.distributed as dist

    if dist.get_rank() == 1:
        atexit.register(os.abort)  # after the job, the barrier and the teardown: as the interpreter shuts down
    return "result"


def _abort_during_the_job_on_rank_1() -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.abort()
    dist.barrier()
    return "result"


def test_a_rank_dying_after_the_job_finished_keeps_the_result_but_one_dying_during_it_fails_the_job():
    # Spawned: interpreter shutdown (atexit) is where such a death happens; a rank forked from the fork server ends
    # with os._exit and has none.
    with pytest.warns(RuntimeWarning, match="died after the job had finished on every rank"):
        assert launch.run(_abort_at_exit_on_rank_1, 2, timeout_s=RANK_TIMEOUT_S, start_method="spawn") == "result"
    with pytest.raises(RuntimeError, match="distributed run failed"):
        launch.run(_abort_during_the_job_on_rank_1, 2, timeout_s=RANK_TIMEOUT_S)
