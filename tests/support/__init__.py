"""Helpers and fixtures that several test files of different tiers share (importable as ``support.*``: tests/ is on
sys.path through tests/conftest.py)."""
