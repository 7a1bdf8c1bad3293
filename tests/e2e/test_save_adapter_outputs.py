"""`xpar_zoo.save_adapter` checks its output before gathering anything: never the base model's directory (or inside
it); an existing non-empty directory only with force=True, whose adapter files are replaced once the new ones are
complete (its other files stay, and a failed save leaves the old adapter as it was). A world-1 LoRA model."""

import hashlib

import pytest

pytest.importorskip("peft")
from peft import LoraConfig  # noqa: E402

import xpar_zoo  # noqa: E402
from xpar_zoo.errors import AdapterError  # noqa: E402
from xpar_zoo.testing import parity  # noqa: E402


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    base = tmp_path_factory.mktemp("save_adapter") / "hub"
    parity.build_model(parity.tiny_config("qwen3_moe")).save_pretrained(base)
    model = xpar_zoo.from_pretrained(str(base), progress=False, peft_config=LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj"]))
    return model, base


def _tree(path):
    return {p.relative_to(path).as_posix(): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_save_adapter_writes_a_new_directory(lora, tmp_path):
    model, _ = lora
    out = xpar_zoo.save_adapter(model, tmp_path / "a" / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(_tree(out))


@pytest.mark.parametrize("where, how", [("base", "is the input"), ("inside", "lies inside the input")])
def test_save_adapter_refuses_the_base_model_directory(lora, where, how):
    model, base = lora
    before = _tree(base)
    with pytest.raises(AdapterError, match=how):
        xpar_zoo.save_adapter(model, base if where == "base" else base / "adapter", force=True)
    assert _tree(base) == before


def test_save_adapter_refuses_an_existing_non_empty_directory_without_force(lora, tmp_path):
    model, _ = lora
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(AdapterError, match="already exists and is not empty; pass force=True"):
        xpar_zoo.save_adapter(model, tmp_path / "out")
    assert _tree(tmp_path / "out") == {"notes.txt": hashlib.sha1(b"mine").hexdigest()}


def test_save_adapter_refuses_a_file(lora, tmp_path):
    model, _ = lora
    (tmp_path / "out").write_text("x")
    with pytest.raises(AdapterError, match="exists and is not a directory"):
        xpar_zoo.save_adapter(model, tmp_path / "out", force=True)


def test_save_adapter_force_replaces_the_adapter_files_and_keeps_the_others(lora, tmp_path):
    model, _ = lora
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "adapter_model.safetensors").write_bytes(b"old")
    xpar_zoo.save_adapter(model, out, force=True)
    tree = _tree(out)
    assert tree["notes.txt"] == hashlib.sha1(b"mine").hexdigest()
    assert tree["adapter_model.safetensors"] != hashlib.sha1(b"old").hexdigest() and "adapter_config.json" in tree
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left beside it


def test_save_adapter_force_that_fails_leaves_the_old_adapter(lora, tmp_path, monkeypatch):
    import safetensors.torch

    model, _ = lora
    out = tmp_path / "out"
    xpar_zoo.save_adapter(model, out)
    before = _tree(out)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(AdapterError, match="nothing was replaced"):
        xpar_zoo.save_adapter(model, out, force=True)
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
