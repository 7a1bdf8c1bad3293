"""``examples/dpo_trainer.py`` as a user runs it under torchrun (tiny-qwen3-moe built in code, the shipped
preference pairs, ep=2): the reference precomputed before training, 2 logged DPO steps, and the trained model in
the hub's format that plain transformers loads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")  # an optional extra: requirements-test.txt installs it

ROOT = Path(__file__).resolve().parents[2]


def test_dpo_example_trains_with_a_precomputed_reference_and_saves_the_hub_format(tmp_path):
    from transformers import AutoModelForCausalLM

    from xpar_zoo.testing import launch

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(launch.free_port()), str(ROOT / "examples" / "dpo_trainer.py"), "--output", str(out), "--steps", "2",
           "--reference", "precompute"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert len(report["steps"]) == 2
    assert all(k in s for s in report["steps"] for k in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected"))
    assert report["steps"][0]["rewards/chosen"] == 0.0  # the reference is the policy before its first update
    model = AutoModelForCausalLM.from_pretrained(report["output"])
    assert model.config.model_type == "qwen3_moe"
