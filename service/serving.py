"""Run an ASGI app in the foreground the way an operator expects from Ctrl-C and SIGTERM.

The first signal drains: the server stops accepting, says so on stderr with the number of open connections,
and lets running requests (streams included) finish. A second signal exits at once, with one line and no
tracebacks: the process ends right there (``os._exit``), after ``on_force_exit`` (e.g. stopping a child
worker) has run, so nothing is left half torn down and printing cancelled tasks. No torch here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

FORCED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for an interrupted program


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain message on the first signal and an immediate exit on the second."""

    def __init__(
        self, config: uvicorn.Config, name: str, on_force_exit: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config)
        self._name = name
        self._on_force_exit = on_force_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            sys.stderr.write(f"{self._name}: second interrupt, exiting now\n")
            sys.stderr.flush()
            if self._on_force_exit is not None:
                self._on_force_exit()
            os._exit(FORCED_EXIT_CODE)
        open_connections = len(self.server_state.connections)
        sys.stderr.write(
            f"{self._name} draining: {open_connections} open connection(s) finish first, new ones are "
            "refused (Ctrl-C again to exit now)\n"
        )
        sys.stderr.flush()
        super().handle_exit(sig, frame)


def serve(
    app: Any,
    name: str,
    host: str,
    port: int,
    on_force_exit: Callable[[], None] | None = None,
    **config: Any,
) -> None:
    """Serve ``app`` (called ``name`` in messages) until a signal; ``config`` goes to ``uvicorn.Config``."""
    DrainingServer(uvicorn.Config(app, host=host, port=port, **config), name, on_force_exit).run()
