"""`omnijax serve --demo-model` in a subprocess for tests that kill it: the package's launcher,
`omnijax.testing.served.Served` (the hostile-input probe in bench/ uses the same one)."""

from omnijax.testing.served import Served

__all__ = ["Served"]
