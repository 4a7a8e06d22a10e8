"""The version of vartrace, readable without importing the package (the writer stores it)."""

__version__ = "0.1.0"
