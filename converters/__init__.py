"""Checkpoint layout conversion between hub formats and the fused in-memory layouts."""
