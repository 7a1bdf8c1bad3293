"""Bad load input on launched ranks: every kind of broken hub folder is one clear error on every rank before any tensor
is read, and a rank failing during a load ends the job with a clear error."""

import os
import re
import time

import pytest
import torch

from support.load_refusal_cases import FILE_CASES, LOAD_CASES, _make_bad
from xpar_zoo.errors import XparError
from xpar_zoo.testing import launch, parity

WORLD = 2

BEFORE_PARALLELIZE = [*FILE_CASES, "path_does_not_exist"]  # found from the files alone: parallelize never runs
PATH_BOUND_S = 10  # hub retries took 27 s


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    model.save_pretrained(root / "hub", max_shard_size=total // 3)
    parity.build_model(parity.tiny_config("qwen3")).save_pretrained(root / "dense", max_shard_size=total // 3)
    parity.build_model(parity.tiny_config("qwen3_moe", vocab_size=127)).save_pretrained(root / "vocab127")
    dirs = {"root": str(root), "hub": str(root / "hub"), "vocab127": str(root / "vocab127"),
            "path_does_not_exist": "hub/no_such_model"}
    facts = {}
    for kind in FILE_CASES:
        path, facts[kind] = _make_bad(root, root / "hub", root / "dense", kind)
        dirs[kind] = str(path)
    return root, dirs, facts


class _Watch:
    """Counts tensor reads (``safe_open`` handles the loader opens), ``parallelize`` calls and unpickling calls on
    one rank."""

    opens = 0
    parallelized = 0
    unpickles: list = []


def _counting_safe_open(*args, **kwargs):
    from safetensors import safe_open

    _Watch.opens += 1
    return safe_open(*args, **kwargs)


def _watch_unpickling() -> None:
    import pickle

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=f"{module.__name__}.{name}", **kwargs):
            _Watch.unpickles.append(_name)
            return _real(*args, **kwargs)

        setattr(module, name, spy)


def _load_job(dirs: dict, cases: list) -> dict:
    import torch.distributed as dist

    import xpar_zoo.loader

    rank = dist.get_rank()
    os.chdir(dirs["root"])  # relative names resolve there
    xpar_zoo.loader.safe_open = _counting_safe_open
    real_parallelize = xpar_zoo.loader.parallelize

    def counting_parallelize(*args, **kwargs):
        _Watch.parallelized += 1
        return real_parallelize(*args, **kwargs)

    xpar_zoo.loader.parallelize = counting_parallelize
    _watch_unpickling()
    out = {}
    for kind in cases:
        name, mesh, dtype = dirs.get(kind, dirs["hub"]), {"ep": 2}, None
        if kind == "dtype_int3":
            dtype = "int3"
        elif kind == "dtype_unknown":
            dtype = "float33"
        elif kind == "dtype_int8":
            dtype = torch.int8
        elif kind == "ranks_disagree_on_name":
            name = dirs["hub"] if rank == 0 else dirs["vocab127"]
        elif kind == "ranks_disagree_on_dtype":
            dtype = torch.bfloat16 if rank == 1 else None
        elif kind == "plan_larger_than_world":
            mesh = {"ep": 4}
        elif kind == "unknown_plan_name":
            mesh = {"foo": 2}
        elif kind == "vocab_not_divisible_by_emb":
            name, mesh = dirs["vocab127"], {"emb": 2}
        _Watch.opens, _Watch.parallelized, _Watch.unpickles = 0, 0, []
        start = time.perf_counter()
        try:
            xpar_zoo.from_pretrained(name, mesh=xpar_zoo.Mesh(**mesh), dtype=dtype, progress=False)
            outcome = ("no error", "", False)
        except Exception as e:  # noqa: BLE001 - the test inspects the type
            outcome = (type(e).__name__, str(e), isinstance(e, XparError))
        seconds = time.perf_counter() - start
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (outcome, _Watch.opens, list(_Watch.unpickles), seconds, _Watch.parallelized))
        out[kind] = every
    return out


@pytest.fixture(scope="module")
def load_errors(checkpoints):
    _, dirs, _ = checkpoints
    return launch.run(_load_job, WORLD, dirs, list(LOAD_CASES), timeout_s=120)


@pytest.mark.parametrize("kind", list(LOAD_CASES))
def test_bad_load_input_is_a_clear_error_on_every_rank_before_reading_tensors(load_errors, checkpoints, kind):
    _, _, facts = checkpoints
    every = load_errors[kind]
    outcomes = [e[0] for e in every]
    (name, message, is_xpar) = outcomes[0]
    assert is_xpar, f"{kind}: {name}: {message}"
    if not kind.startswith("ranks_"):  # those name each rank's own value, so the text differs per rank
        assert all(o == outcomes[0] for o in outcomes), f"{kind}: ranks disagree: {outcomes}"
    want_class, parts = LOAD_CASES[kind]
    assert name == want_class, f"{kind}: {name}: {message}"
    for part in parts:
        part = part.format(**facts.get(kind, {}))
        assert part in message, f"{kind}: {part!r} not in {message!r}"
    assert [e[1] for e in every] == [0] * WORLD, f"{kind}: a checkpoint file was opened for tensor data"
    assert [e[2] for e in every] == [[]] * WORLD, f"{kind}: something was unpickled: {every}"
    if kind in BEFORE_PARALLELIZE:
        assert [e[4] for e in every] == [0] * WORLD, f"{kind}: parallelize ran before the error"
    if kind == "path_does_not_exist":
        assert max(e[3] for e in every) < PATH_BOUND_S, f"{kind}: {[e[3] for e in every]} s"



# ---- a rank that dies or hangs during a load -------------------------------------------------------------------------
RANK_TIMEOUT_S = 15
JOB_BOUND_S = 90


def _one_rank_fails_in_load(hub: str, how: str) -> None:
    import torch.distributed as dist

    import xpar_zoo.loader

    if dist.get_rank() == 1:
        def fail(*args, **kwargs):
            if how == "dies":
                os._exit(1)
            time.sleep(10 * RANK_TIMEOUT_S)  # hangs: never reaches the next collective

        xpar_zoo.loader.build_meta = fail
    xpar_zoo.from_pretrained(hub, mesh=xpar_zoo.Mesh(ep=2), progress=False)


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_rank_failing_during_a_load_ends_the_job_with_a_clear_error(how, checkpoints):
    """Rank 1 exits (``os._exit(1)``) or hangs inside ``from_pretrained`` before the collective of ``parallelize``:
    the job ends with a RuntimeError well before the bound, not a hang. A dead rank is seen at once (its sockets
    close); a hung rank by the process group timeout, on which rank 0 raises by itself."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        launch.run(_one_rank_fails_in_load, WORLD, checkpoints[1]["hub"], how, timeout_s=RANK_TIMEOUT_S)
    elapsed = time.monotonic() - start
    message = str(e.value)
    assert elapsed < JOB_BOUND_S, f"{how}: took {elapsed:.0f} s"
    assert message.startswith("distributed run failed")
    if how == "dies":
        assert "process 1 terminated with exit code 1" in message or "rank 0" in message, message
    else:  # rank 0 itself raised: gloo honours the process group timeout
        assert "rank 0:" in message and "parallelize" in message, message
        assert re.search(r"[Tt]imed? ?out", message), message
