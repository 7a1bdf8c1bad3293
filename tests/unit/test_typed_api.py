"""The public API is type-checked: every module that defines a name of ``xpar_zoo.__all__`` (or is published as
``xpar_zoo.moe`` / ``xpar_zoo.registry`` / ``xpar_zoo.vocab``) is in pyproject's ``[tool.mypy] files``."""

from __future__ import annotations

import inspect
from pathlib import Path

import tomllib

import xpar_zoo

ROOT = Path(__file__).resolve().parents[2]

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
    missing = public_modules() - mypy_files()
    assert not missing, f"add to [tool.mypy] files in pyproject.toml (and make clean): {sorted(missing)}"


def test_the_check_catches_a_missing_module():
    """Without ``parallelize.py`` in the files list, the first check fails."""
    files = mypy_files() - {"xpar_zoo/parallelize.py"}
    assert "xpar_zoo/parallelize.py" in public_modules() - files
