"""CI runs exactly the README's test command, and that command lints the tree and type-checks the public API with the
pinned checkers before the tests."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_test_command() -> str:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return block.strip().splitlines()[1]


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == _readme_test_command()


def test_the_test_command_lints_with_the_pinned_checkers_before_the_tests():
    command = _readme_test_command()
    pins = dict(line.split("==") for line in (ROOT / "requirements-test.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for checker in ("ruff", "mypy"):
        assert checker in pins, f"{checker} is not pinned in requirements-test.txt"
        assert command.index(f".venv/bin/{checker} ") < command.index("pytest")
