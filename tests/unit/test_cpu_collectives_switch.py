"""The CPU-only in-place gloo collectives stay off the common path: ``import xpar_zoo`` does not import them, and
``parallelize``'s switch (``options.cpu_collectives``, the older ``cpu_collectives`` keyword, or without options the
default ``XPAR_ZOO_GLOO_IN_PLACE=0``) is read and checked before any work."""

from __future__ import annotations

import pytest

from xpar_zoo.errors import PlanError
from xpar_zoo.parallel.options import ENV, ParallelOptions
from xpar_zoo.parallelize import resolve_options

GLOO_IN_PLACE_ENV = ENV["cpu_collectives"]


def test_in_place_is_the_default_and_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv(GLOO_IN_PLACE_ENV, raising=False)
    assert resolve_options(None).cpu_collectives == "in_place"
    for off in ("0", "false", "No", " off "):
        monkeypatch.setenv(GLOO_IN_PLACE_ENV, off)
        assert resolve_options(None).cpu_collectives == "gloo"
    monkeypatch.setenv(GLOO_IN_PLACE_ENV, "1")
    assert resolve_options(None).cpu_collectives == "in_place"


def test_the_keyword_and_the_options_win_over_the_environment(monkeypatch):
    monkeypatch.setenv(GLOO_IN_PLACE_ENV, "0")
    assert resolve_options(None, "in_place").cpu_collectives == "in_place"
    assert resolve_options(ParallelOptions()).cpu_collectives == "in_place"
    monkeypatch.setenv(GLOO_IN_PLACE_ENV, "1")
    assert resolve_options(None, "gloo").cpu_collectives == "gloo"
    assert resolve_options(ParallelOptions(cpu_collectives="gloo"), "gloo").cpu_collectives == "gloo"


def test_an_unknown_choice_or_two_that_disagree_are_refused_by_name():
    with pytest.raises(PlanError, match="cpu_collectives must be one of in_place, gloo, got 'nccl'"):
        resolve_options(None, "nccl")
    with pytest.raises(PlanError, match="cpu_collectives='gloo' and options.cpu_collectives='in_place' disagree"):
        resolve_options(ParallelOptions(), "gloo")


def test_only_the_environment_module_reads_the_triton_interpreter_switch():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "xpar_zoo"
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if any(isinstance(n, ast.Constant) and n.value == "TRITON_INTERPRET"
                            for n in ast.walk(ast.parse(p.read_text()))))
    assert readers == ["environment.py"], readers
