"""The test suite's tiers (tests/conftest.py): every test has exactly one tier, its folder's; a unit test launches no
ranks; the zoo's shared run reports a failed job only to the tests that read that job's results."""

import pytest

from xpar_zoo.testing import launch

TIERS = ("unit", "distributed", "e2e", "kernels")


def test_every_collected_test_has_its_folders_tier_and_only_that(request):
    for item in request.session.items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        assert tiers == [item.path.parent.name], (item.nodeid, tiers)


def test_a_unit_test_cannot_launch_ranks():
    for name in ("run", "run_together", "run_each", "start"):
        with pytest.raises(AssertionError, match="a unit test launches no ranks: move it to tests/distributed/"):
            getattr(launch, name)(print, 2)


def test_a_failed_job_fails_only_the_keys_of_that_job():
    failed = launch.JobFailed("job 'mixtral' failed in its launched run: boom")
    results = launch.JobResults({"qwen3_moe": {("qwen3_moe", "ep2"): 1, ("qwen3_moe", "fsdp"): 2},
                                 "mixtral": failed, "dbrx": {"dbrx": 3}})
    assert results["qwen3_moe", "ep2"] == 1 and results["qwen3_moe", "fsdp"] == 2 and results["dbrx"] == 3
    with pytest.raises(launch.JobFailed, match="boom"):
        results["mixtral", "ep2"]
    with pytest.raises(KeyError):
        results["qwen3_moe", "ep4"]
    assert sorted(results, key=str) == sorted([("qwen3_moe", "ep2"), ("qwen3_moe", "fsdp"), "dbrx"], key=str)


def test_one_job_for_all_keys():
    results = launch.JobResults({"": launch.JobFailed("boom")}, job_of=lambda key: "")
    with pytest.raises(launch.JobFailed):
        results["anything"]
