"""``accelerate launch`` runs the example script."""

import json
import os
import subprocess
import sys
from pathlib import Path

from xpar_zoo.testing import launch, parity

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # the router auxiliary loss trains too
CHARS = "abcdefghijklmnopqrstuvwxyz .,"
TEXT = "the cat sat on the mat, a dog ran to the park. "
REPO = Path(__file__).resolve().parents[2]


def _config(**overrides):
    return parity.tiny_config("qwen3_moe", **{**AUX, **overrides})



def _tokenizer():
    """A character-level fast tokenizer with EOS and padding (built here: nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")


def _texts() -> list[str]:
    """16 documents of 5 to 35 characters: padded in a batch, a different number of targets on every rank."""
    return [(TEXT * 2)[i:i + 5 + (7 * i) % 31] for i in range(16)]



def test_accelerate_launch_runs_the_example_script(tmp_path):
    """ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/cpu.yaml (2 processes, ep=2):
    examples/finetune_trainer.py --sft trains TRL's SFTTrainer through the mixin and saves a model plain
    transformers loads."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    parity.build_model(_config()).save_pretrained(model_dir)
    _tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts()))
    out = tmp_path / "out"
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "examples" / "accelerate" / "cpu.yaml"), "--num_processes", "2",
           "--main_process_port", str(launch.free_port()), str(REPO / "examples" / "finetune_trainer.py"),
           "--model", str(model_dir), "--data", str(data), "--mesh", "ep=2", "--output", str(out), "--steps", "2",
           "--grad-accum", "2", "--seq-len", "32", "--save-steps", "2", "--lr", "1e-3", "--sft"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert report["steps"] == 2 and len(report["losses"]) == 2
    assert (out / "checkpoint-2" / "xpar_checkpoint").is_dir()
    AutoModelForCausalLM.from_pretrained(out)
