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
