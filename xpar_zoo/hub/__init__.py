"""Hugging Face hub checkpoints: resolving a repo or folder, safetensors files, the hub-to-memory key layout, the
sharded writer, ``from_pretrained`` and ``save_pretrained``."""
