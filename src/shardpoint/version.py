"""The library version (recorded in every index it writes)."""

__version__ = "0.1.0"
