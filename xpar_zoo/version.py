"""The package version (its own module, so that anything may read it without importing the package's API)."""

__version__ = "0.1.0"
