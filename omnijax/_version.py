"""The version of omnijax (the one pyproject.toml gives the installed distribution; tests check they agree)."""

__version__ = "0.1.0"
