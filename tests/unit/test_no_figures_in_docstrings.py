"""Benchmark figures live in bench/RESULTS.md and docs/, not in the package's docstrings, where they would go stale
unseen: no docstring of xpar_zoo, converters or plans states a ratio (``0.90×``), a time in ms or a throughput."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURE = re.compile(r"\d(\.\d+)?\s?×|\b\d+(\.\d+)?\s?(ms|µs)\b|\b(MiB|MB|GiB|GB)/s\b")


def _docstrings(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield getattr(node, "name", "module"), doc


def test_no_benchmark_figures_in_docstrings():
    found = [f"{path.relative_to(ROOT)}:{name}: {m.group(0)!r}"
             for folder in ("xpar_zoo", "converters", "plans") for path in sorted((ROOT / folder).rglob("*.py"))
             for name, doc in _docstrings(path) for m in FIGURE.finditer(doc)]
    assert not found, "figures in docstrings (move them to bench/RESULTS.md or docs/):\n" + "\n".join(found)


def test_the_scan_sees_a_figure(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Faster: 0.65× the step, 12 ms, 294 MiB/s."""\n')
    assert [m.group(0) for _, doc in _docstrings(sample) for m in FIGURE.finditer(doc)] == ["0.65×", "12 ms", "MiB/s"]
