"""The CPU-only in-place gloo collectives stay off the common path: a fresh interpreter that imports the package, the
CLI, the training command and the Trainer integration has not imported them (a process, so in this tier)."""

from __future__ import annotations

import os
import subprocess
import sys

from xpar_zoo.parallel.options import ENV


def test_importing_the_package_does_not_import_the_gloo_collectives():
    code = ("import sys, xpar_zoo, xpar_zoo.commands.cli, xpar_zoo.train, xpar_zoo.integrations.trainer\n"
            "print(sorted(m for m in sys.modules if m.startswith('xpar_zoo.parallel.gloo')))")
    env = {k: v for k, v in os.environ.items() if k != ENV["cpu_collectives"]}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"
