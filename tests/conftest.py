import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton experts kernels run under Triton's interpreter on the CPU. Triton reads this when its language module is
# first imported (transformers imports it early), so it is set for the whole session; nothing else here uses Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The test suite's launched runs fork their ranks from one server that imported torch, transformers and xpar_zoo
# once (xpar_zoo.testing.launch), instead of spawning interpreters that import them again on every rank.
os.environ.setdefault("XPAR_ZOO_START_METHOD", "forkserver")


@pytest.fixture(scope="session")
def zoo_proofs(request, tmp_path_factory) -> dict:
    """The zoo's 4-rank job: every collected test module that uses this fixture contributes its
    ``zoo_job(tmp_path_factory) -> (fn, args)`` (tests/test_zoo.py, tests/test_zoo_placement.py), and all of them run
    in one launched run (one start, one import of every architecture per rank). ``{module name: rank 0's result}``."""
    from xpar_zoo.testing import launch
    from xpar_zoo.zoo.proofs import PROOF_WORLD

    modules = {item.module for item in request.session.items if "zoo_proofs" in getattr(item, "fixturenames", ())}
    jobs = {m.__name__: m.zoo_job(tmp_path_factory) for m in sorted(modules, key=lambda m: m.__name__)}
    return launch.run_together(jobs, PROOF_WORLD, timeout_s=1800)
