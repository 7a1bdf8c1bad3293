"""Short 4-rank training runs, repeated beside CPU-burning processes, end with exit status 0 on every rank: each rank
ends its process group (a barrier, then destroy_process_group) and its process (threads joined, exit handlers run,
no interpreter teardown for the process group's threads to race) as ``xpar-zoo train`` and the launched helpers'
ranks do (xpar_zoo.parallel.teardown)."""

import json

from xpar_zoo.testing import launch

MESHES = [{}, {"ep": 2}, {"cp": 4}]  # the meshes of the runs that aborted in issue 36, one run each


def _runs(out: str) -> None:
    from xpar_zoo.testing.exits import repeat_runs, tiny_training

    statuses = [status for mesh in MESHES for status in repeat_runs(tiny_training, 4, 1, mesh, 1, burners=1)]
    with open(out, "w") as f:
        json.dump(statuses, f)


def test_short_4_rank_runs_under_load_end_with_status_0_on_every_rank(tmp_path):
    out = tmp_path / "statuses.json"
    proc = launch.start(_runs, str(out))  # a fresh process without threads: it forks the ranks
    proc.join(timeout=600)
    assert proc.exitcode == 0
    assert json.loads(out.read_text()) == [[0, 0, 0, 0]] * len(MESHES)
