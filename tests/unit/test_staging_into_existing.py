"""An adapter is saved through the same staging directory as every other output (xpar_zoo.io.atomic_dir.StagingDir,
with its lock against abandoned writes): into an existing directory it moves file by file, the file that readers
look for first (the adapter config) last, and leaves the directory's other files alone."""

from __future__ import annotations

import os

from xpar_zoo.io import atomic_dir
from xpar_zoo.io.atomic_dir import LOCK_FILE, StagingDir


def test_a_merge_moves_the_named_file_last_and_keeps_the_others(tmp_path, monkeypatch):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "README.md").write_text("mine")
    (out / "adapter_model.safetensors").write_text("old weights")
    moved = []
    real = os.replace
    monkeypatch.setattr(atomic_dir.os, "replace", lambda a, b: moved.append(os.path.basename(b)) or real(a, b))
    staging = StagingDir(out, merge=lambda name: False, last=lambda name: name == "adapter_config.json")
    assert (staging.path / LOCK_FILE).exists()  # locked while written: not taken for an abandoned write
    for name in ("adapter_config.json", "adapter_model.safetensors", "z_extra.txt"):
        (staging.path / name).write_text(f"new {name}")
    staging.commit()
    assert moved[-1] == "adapter_config.json" and sorted(moved) == ["adapter_config.json",
                                                                   "adapter_model.safetensors", "z_extra.txt"]
    assert (out / "README.md").read_text() == "mine"
    assert (out / "adapter_model.safetensors").read_text() == "new adapter_model.safetensors"
    assert not staging.path.exists() and not any(p.name.startswith(".adapter.tmp") for p in tmp_path.iterdir())


def test_by_default_index_files_go_last(tmp_path, monkeypatch):
    out = tmp_path / "hub"
    out.mkdir()
    moved = []
    real = os.replace
    monkeypatch.setattr(atomic_dir.os, "replace", lambda a, b: moved.append(os.path.basename(b)) or real(a, b))
    staging = StagingDir(out, merge=lambda name: name.endswith(".safetensors"))
    for name in ("model.safetensors.index.json", "model-00001-of-00001.safetensors", "config.json"):
        (staging.path / name).write_text(name)
    staging.commit()
    assert moved[-1] == "model.safetensors.index.json"
