"""The README's first command: `xpar-zoo demo` prints a PASS verdict, started by itself and under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


@pytest.mark.parametrize("launcher", ["itself", "torchrun"])
def test_the_demo_passes(launcher, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # as a user runs it: no launcher's variables, and the demo's ranks spawned (not the test suite's fork server)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "XPAR_ZOO_START_METHOD"):
        env.pop(key, None)
    if launcher == "itself":
        cmd = [sys.executable, "-m", "xpar_zoo", "demo", "--world", "4", "--steps", "2"]
    else:
        cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node", "4", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "--log-dir", str(tmp_path), "-m", "xpar_zoo", "demo", "--steps", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.count("PASS: 2 steps on 4 ranks") == 1, done.stdout[-2000:]
