"""Durable files: atomic output directories (staging, lock, fsync), checksums and integrity, byte batching."""
