"""Hub → from_pretrained on 4 ranks (Mesh(ep=2, emb=2)) → save_checkpoint → `xpar-zoo convert to-hf` gives back the
hub's own files: same keys, every tensor bit-identical, an index; transformers loads it with identical logits."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors import safe_open

from xpar_zoo.commands import cli
from xpar_zoo.testing import launch, parity

WORLD = 4


def _hub_tensors(directory) -> dict:
    """Every tensor of a hub-format directory: its index's files, or the single ``model.safetensors``."""
    index_file = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index_file.read_text())["weight_map"].values())) if index_file.is_file()
             else ["model.safetensors"])
    out = {}
    for f in files:
        with safe_open(str(directory / f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def _train_and_save(hub_dir: str, root: str) -> None:
    import xpar_zoo

    model = xpar_zoo.from_pretrained(hub_dir, mesh=xpar_zoo.Mesh(ep=2, emb=2), dtype=torch.float32, progress=False)
    xpar_zoo.save_checkpoint(root, model, step=1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    hub = base / "hub"
    parity.build_model(parity.tiny_config("qwen3_moe")).save_pretrained(hub, max_shard_size="40KB")
    (hub / "tokenizer_config.json").write_text("{}")
    launch.run(_train_and_save, WORLD, str(hub), str(base / "ckpt"))
    out = base / "out"
    assert cli.main(["convert", "to-hf", str(base / "ckpt"), str(out), "--model", str(hub),
                     "--max-shard-size", "30KB"]) == 0
    return hub, base / "ckpt", out


def test_export_writes_the_hub_keys_bit_identically_with_an_index(exported):
    hub, _, out = exported
    original, written = _hub_tensors(hub), _hub_tensors(out)
    assert any(".experts.0.gate_proj.weight" in k for k in original)  # the hub format is per expert
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert all((out / f).is_file() for f in index["weight_map"].values())
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()


def test_transformers_loads_the_export_with_identical_logits(exported):
    from transformers import AutoModelForCausalLM

    hub, _, out = exported
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    a = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_export_casts_dtype_and_refuses_an_existing_output(exported, capsys):
    _, ckpt, out = exported
    assert cli.main(["convert", "to-hf", str(ckpt), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    bf16 = out.parent / "bf16"
    assert cli.main(["convert", "to-hf", str(ckpt), str(bf16), "--dtype", "bf16"]) == 0
    assert all(t.dtype == torch.bfloat16 for t in _hub_tensors(bf16).values())
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert cli.main(["convert", "to-hf", str(ckpt), str(out.parent / "x"), "--dtype", "int3"]) == 2
    assert "unknown dtype 'int3'" in capsys.readouterr().err
    assert not (out.parent / "x").exists()


def test_a_killed_export_leaves_no_output_and_the_earlier_one_intact(exported):
    _, ckpt, out = exported
    before = _hub_tensors(out)
    script = textwrap.dedent(f"""
        import time
        from xpar_zoo.commands import cli
        from xpar_zoo.hub.writer import HubWriter
        real = HubWriter.add
        def slow(*a, **k):
            time.sleep(0.05); return real(*a, **k)
        HubWriter.add = slow
        cli.main(["convert", "to-hf", {str(ckpt)!r}, {str(out)!r}, "--force", "--max-shard-size", "10KB"])
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(".out.tmp-") and any(p.glob("*.safetensors"))
                                             for p in out.parent.iterdir() if p.is_dir()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    after = _hub_tensors(out)
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(".out.")]
    assert leftovers, "the kill should have interrupted a write in a temporary directory"
    from xpar_zoo import LeftoverWarning

    with pytest.warns(LeftoverWarning, match=f"removed .*{leftovers[0]}.*process is gone"):
        assert cli.main(["convert", "to-hf", str(ckpt), str(out), "--force"]) == 0
    # the killed process is gone, so the next conversion removed what it left
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".out.")]
