"""`omnijax serve --demo-model` in a subprocess for tests that kill it: the package's launcher,
`omnijax.testing.served.Served` (the hostile-input probe in bench/ uses the same one), and `ServedCheckpoint`, the
same for a converted checkpoint already on disk."""

from __future__ import annotations

import sys
from pathlib import Path

from omnijax.testing.served import Served

__all__ = ["Served", "ServedCheckpoint"]


class ServedCheckpoint(Served):
    """`python -m omnijax.cli serve CHECKPOINT --port 0 <args>` in a subprocess: `Served` for a checkpoint written
    once by the test (`tests._support.demo_server.demo_checkpoint`), so that a test starting several servers builds
    the demo model once rather than at every start (~7 s each), and a SIGKILLed server leaves no temporary copy.

    Args:
        checkpoint: the converted checkpoint's directory (with its tokenizer).
        *args: the other command-line arguments.
        start_timeout_s, new_session: as for `Served`.
    """

    def __init__(self, checkpoint: str | Path, *args: str, start_timeout_s: float | None = 300.0,
                 new_session: bool = False):
        self.checkpoint = str(checkpoint)  # before Served.__init__, which may start the process
        super().__init__(*args, start_timeout_s=start_timeout_s, new_session=new_session)

    @property
    def command(self) -> list[str]:
        """The command line it runs."""
        return [sys.executable, "-m", "omnijax.cli", "serve", self.checkpoint, "--port", "0", *self.args]
