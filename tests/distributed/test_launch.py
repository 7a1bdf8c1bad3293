"""xpar_zoo.testing.launch under the test suite's fork server (tests/conftest.py): a forked rank writes to the
caller's stdout and stderr and sees the caller's environment, as a spawned one does."""

import os
import sys

from xpar_zoo.testing import launch


def _report(tag: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    print(f"{tag}: rank {rank} on stdout", flush=True)
    print(f"{tag}: rank {rank} on stderr", file=sys.stderr, flush=True)
    return {k: os.environ.get(k) for k in ("PYTEST_CURRENT_TEST", "XPAR_ZOO_TEST_MARK")}


def test_forked_ranks_write_to_the_callers_stdout_and_stderr(capfd):
    with capfd.disabled():  # a server started here holds pytest's own stdout, not this test's captured one
        launch.run(_report, 2, "warm-up")
    env = launch.run(_report, 2, "run")
    out, err = capfd.readouterr()
    assert "run: rank 0 on stdout" in out and "run: rank 1 on stdout" in out, out
    assert "run: rank 0 on stderr" in err and "run: rank 1 on stderr" in err, err
    assert env["PYTEST_CURRENT_TEST"] == os.environ["PYTEST_CURRENT_TEST"]


def test_a_run_sees_an_environment_changed_after_the_server_started(monkeypatch):
    launch.run(_report, 2, "before")
    monkeypatch.setenv("XPAR_ZOO_TEST_MARK", "set by the caller")
    assert launch.run(_report, 2, "after")["XPAR_ZOO_TEST_MARK"] == "set by the caller"


def _all_reduce_ones(tag: str) -> dict:
    import torch
    import torch.distributed as dist

    ones = torch.ones(1)
    dist.all_reduce(ones)
    return {tag: int(ones.item())}


def _rank_1_fails(tag: str) -> dict:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"{tag}: rank 1 fails its job")
    return _all_reduce_ones(tag)  # rank 0 waits in a collective rank 1 never joins


def test_a_failing_job_fails_only_itself_and_the_jobs_after_it_still_run():
    jobs = {"a": (_all_reduce_ones, ("a",)), "b": (_rank_1_fails, ("b",)), "c": (_all_reduce_ones, ("c",))}
    outcomes = launch.run_each(jobs, 2, timeout_s=60)
    assert outcomes["a"] == {"a": 2} and outcomes["c"] == {"c": 2}
    assert isinstance(outcomes["b"], launch.JobFailed) and "b: rank 1 fails its job" in str(outcomes["b"])
    assert "'b'" in str(outcomes["b"])
