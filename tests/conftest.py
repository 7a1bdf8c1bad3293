import os
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton experts kernels run under Triton's interpreter on the CPU. Triton reads this when its language module is
# first imported (transformers imports it early), so it is set for the whole session; nothing else here uses Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The test suite's launched runs fork their ranks from one server that imported torch, transformers and xpar_zoo
# once (xpar_zoo.testing.launch), instead of spawning interpreters that import them again on every rank.
os.environ.setdefault("XPAR_ZOO_START_METHOD", "forkserver")

# The fixtures that test files of several tiers share (tests/support/): every test asks for them by name.
pytest_plugins = ["support.integrity_checkpoints", "support.loader_checkpoints", "support.sizing_models"]

# The tiers, one folder each; every test gets its folder's marker (`pytest -m unit`), registered in pyproject.toml.
TIERS = {
    "unit": "no launched process group, fast (`pytest -m unit`: under a minute)",
    "distributed": "launched gloo ranks (xpar_zoo.testing.launch) or processes",
    "e2e": "the xpar-zoo commands, the demo and the examples",
    "kernels": "the Triton kernels under Triton's interpreter on the CPU (slow there: each test tens of seconds)",
}
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    outside = set()
    for item in items:
        tier = Path(item.path).relative_to(TESTS).parts[0] if Path(item.path).is_relative_to(TESTS) else None
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        else:
            outside.add(str(item.path))
    if outside:
        raise pytest.UsageError(f"test files belong in a tier folder ({', '.join(f'tests/{t}/' for t in TIERS)}): "
                                + ", ".join(sorted(outside)))
    # The zoo's tests go last: they only read the results of the zoo's one launched run, which runs in the
    # background from the session's first test (_zoo_started) beside every other test.
    zoo = [item for item in items if _uses_zoo(item)]
    if zoo:
        others = [item for item in items if not _uses_zoo(item)]
        items[:] = others + zoo


def _uses_zoo(item) -> bool:
    return "zoo_proofs" in getattr(item, "fixturenames", ())


@pytest.fixture(autouse=True)
def _unit_tests_launch_nothing(request, monkeypatch):
    """The unit tier's promise, kept: a unit test that starts ranks or a process through xpar_zoo.testing.launch
    fails, naming the tier it belongs to."""
    if request.node.get_closest_marker("unit") is None:
        return
    from xpar_zoo.testing import launch

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid}: a unit test launches no ranks: move it to tests/distributed/")

    for name in ("run", "run_together", "run_each", "start"):
        monkeypatch.setattr(launch, name, _main_thread_only(getattr(launch, name), refuse))


def _main_thread_only(original, refuse):
    """``refuse`` in the main thread (the unit test's), ``original`` elsewhere (the zoo's run in the background,
    :func:`_zoo_started`)."""
    def guarded(*args, **kwargs):
        return (refuse if threading.current_thread() is threading.main_thread() else original)(*args, **kwargs)

    return guarded


def _module_jobs(module, items, tmp_path_factory) -> tuple[dict, object]:
    """A module's jobs ``{name: (fn, args)}`` and which job a key of its results belongs to (None: the default of
    :class:`~xpar_zoo.testing.launch.JobResults`); a module with one ``zoo_job`` has one job for all its keys. Of
    ``zoo_jobs``, only the jobs named by a parameter of a selected test run (``-k qwen3_moe``: that type's jobs),
    all of them when a selected test has no parameters."""
    if not hasattr(module, "zoo_jobs"):
        return {"": module.zoo_job(tmp_path_factory)}, lambda key: ""
    jobs = module.zoo_jobs(tmp_path_factory)
    if all(hasattr(item, "callspec") for item in items):
        named = {v for item in items for v in item.callspec.params.values() if isinstance(v, str)}
        jobs = {name: job for name, job in jobs.items() if name in named}
    return jobs, None


@pytest.fixture(scope="session", autouse=True)
def _zoo_started(request, tmp_path_factory):
    """The zoo's 4-rank run, started at the session's first test in a background thread, so that it shares the
    cores with every other test (a launched run alone leaves part of the cores idle: ranks waiting for rank 0's
    reference and checks); its tests run last (the collection puts them there) and
    :func:`zoo_proofs` waits for it. Every collected test module that uses ``zoo_proofs`` contributes its jobs,
    ``zoo_jobs(tmp_path_factory) -> {name: (fn, args)}`` (built here, in the main thread, before any test changes
    the environment the fork server compares against), and all of them run in one launched run (one start, one
    import of every architecture per rank). A daemon thread: an interrupted session does not wait for it."""
    from xpar_zoo.testing import launch
    from xpar_zoo.testing.proofs import PROOF_WORLD

    items = [item for item in request.session.items if _uses_zoo(item)]
    future: Future = Future()
    if not items:
        future.set_result({})
        return future
    jobs, job_of = {}, {}
    for m in sorted({item.module for item in items}, key=lambda m: m.__name__):
        module_jobs, job_of[m.__name__] = _module_jobs(m, [i for i in items if i.module is m], tmp_path_factory)
        jobs.update({(m.__name__, name): job for name, job in module_jobs.items()})
    run_each = launch.run_each  # the unguarded one, whatever a unit test patches meanwhile

    def zoo() -> None:
        try:
            outcomes = run_each(jobs, PROOF_WORLD, timeout_s=1800)
            future.set_result({m: launch.JobResults({name: o for (module, name), o in outcomes.items()
                                                     if module == m}, job_of[m]) for m in job_of})
        except BaseException as e:
            future.set_exception(e)

    thread = threading.Thread(target=zoo, name="zoo proofs", daemon=True)
    request.config.stash[_ZOO_THREAD] = thread
    thread.start()
    return future


_ZOO_THREAD = pytest.StashKey[threading.Thread]()


def pytest_sessionfinish(session):
    """A session that ends before the zoo's run did (interrupted, ``-x``) ends the run's ranks with it rather than
    leave them training to the end of their jobs."""
    thread = session.config.stash.get(_ZOO_THREAD, None)
    if thread is None or not thread.is_alive():
        return
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):  # the fork server and the zoo's ranks, forked from it
        try:
            if any("forkserver" in part for part in child.cmdline()):
                child.kill()
        except psutil.Error:
            pass


@pytest.fixture(scope="session")
def zoo_proofs(_zoo_started) -> dict:
    """The zoo's 4-rank run's results (:func:`_zoo_started`): ``{module name: JobResults}``; a job that fails fails
    only the tests that read its results (``results[arch, …]``); the run starts again after it
    (xpar_zoo.testing.launch.run_each)."""
    return _zoo_started.result()
