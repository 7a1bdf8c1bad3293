"""The public API is type-checked: every module that defines a name of ``xpar_zoo.__all__`` (or is published as
``xpar_zoo.moe`` / ``xpar_zoo.registry`` / ``xpar_zoo.vocab``) is in pyproject's ``[tool.mypy] files``, except those
listed in ``UNCHECKED`` below, which shrinks as they are made clean (and must leave it once they are checked)."""

from __future__ import annotations

import inspect
from pathlib import Path

import tomllib

import xpar_zoo

ROOT = Path(__file__).resolve().parents[2]

# Modules of the public API that mypy does not check yet (not yet clean; pyproject's [tool.mypy] comment says the
# same). Remove a module from here when it joins the files list.
UNCHECKED = {
    "xpar_zoo/hub/adapter_files.py",  # save_adapter
    "xpar_zoo/styles/experts.py",  # xpar_zoo.moe
    "xpar_zoo/styles/sequence.py",  # data_shard, shard_sequence
    "xpar_zoo/styles/vocab.py",  # full_logits, xpar_zoo.vocab
}


def public_modules() -> set[str]:
    """The files, relative to the tree, of the modules that define the public API's names."""
    objects = [getattr(xpar_zoo, name) for name in xpar_zoo.__all__]
    objects += [xpar_zoo.moe, xpar_zoo.registry, xpar_zoo.vocab]
    files = set()
    for obj in objects:
        module = obj if inspect.ismodule(obj) else inspect.getmodule(obj)
        assert module is not None and module.__name__.startswith("xpar_zoo"), obj
        files.add(Path(inspect.getfile(module)).resolve().relative_to(ROOT).as_posix())
    return files


def mypy_files() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"])


def test_every_public_module_is_type_checked():
    missing = public_modules() - mypy_files() - UNCHECKED
    assert not missing, f"add to [tool.mypy] files in pyproject.toml (and make clean): {sorted(missing)}"


def test_unchecked_list_holds_only_unchecked_public_modules():
    assert not UNCHECKED & mypy_files(), f"checked now, remove from UNCHECKED: {sorted(UNCHECKED & mypy_files())}"
    assert UNCHECKED <= public_modules(), f"not public API modules: {sorted(UNCHECKED - public_modules())}"


def test_the_check_catches_a_missing_module():
    """Without ``parallelize.py`` in the files list, the first check fails."""
    files = mypy_files() - {"xpar_zoo/parallelize.py"}
    assert "xpar_zoo/parallelize.py" in public_modules() - files - UNCHECKED
