"""Functions read as named steps: in the package (with ``plans/`` and ``converters/``) no function body is longer
than 60 lines (its docstring not counted) or nests its blocks more than 4 deep (an ``elif`` is not a level). The
Triton kernels (``@triton.jit``), whose bodies are one program each, are the exception."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60
MAX_DEPTH = 4
# Long functions that arrived with merges after the split (owned by work still in flight): listed so that no other
# joins them; the test also fails when one of them is split and still listed, so the list only shrinks.
KNOWN_LONG: set[tuple[str, str]] = set()  # functions allowed over the limit until split: none
_BLOCKS = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try, ast.Match)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def depth(node: ast.AST, level: int = 0) -> int:
    """How deep the blocks of ``node`` nest (nested functions and classes are measured on their own)."""
    elif_ = node.orelse[0] if isinstance(node, ast.If) and len(node.orelse) == 1 and isinstance(
        node.orelse[0], ast.If) else None
    deepest = level
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _SCOPES):
            continue
        inner = level + 1 if isinstance(child, _BLOCKS) and child is not elif_ else level
        deepest = max(deepest, depth(child, inner))
    return deepest


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The function's lines, its ``def`` included and its docstring not."""
    lines = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).startswith(("triton.jit", "tl.jit")) for d in fn.decorator_list)


def too_long_or_deep(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
            lines, nest = body_lines(node), depth(node)
            if lines > MAX_LINES or nest > MAX_DEPTH:
                out.append(f"{where}:{node.lineno} {node.name}: {lines} lines, nesting {nest}")
    return out


def test_no_function_is_longer_than_60_lines_or_nests_deeper_than_4():
    found, known = [], set()
    for folder in ("xpar_zoo", "plans", "converters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for line in too_long_or_deep(path.read_text(), where):
                name = line.split(" ")[1].rstrip(":")
                (known.add((where, name)) if (where, name) in KNOWN_LONG else found.append(line))
    assert not found, "split into named steps:\n" + "\n".join(found)
    assert known == KNOWN_LONG, f"split already, remove from KNOWN_LONG: {sorted(KNOWN_LONG - known)}"


def test_the_measure_counts_what_it_says():
    deep = "def f(x):\n" + "".join("    " * i + f"    for a{i} in x:\n" for i in range(5)) + "    " * 6 + "pass\n"
    assert too_long_or_deep(deep, "m") == ["m:1 f: 7 lines, nesting 5"]
    chain = "def f(x):\n    if x:\n        pass\n" + "    elif x:\n        pass\n" * 6
    assert depth(ast.parse(chain).body[0]) == 1
    long = 'def f():\n    """Doc\n    string."""\n' + "    x = 1\n" * 60
    assert too_long_or_deep(long, "m") == ["m:1 f: 61 lines, nesting 0"]
    assert too_long_or_deep(long.replace("    x = 1\n", "", 1), "m") == []
    kernel = "@triton.jit\n" + deep
    assert too_long_or_deep(kernel, "m") == []
