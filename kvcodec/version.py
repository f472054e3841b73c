"""The package version: a leaf, so the writer can name itself in every header without importing the package root."""

__version__ = "0.1.0"
