"""How the gateway process ends: on SIGTERM (or Ctrl-C) uvicorn stops accepting
connections and exits once its open requests have finished (README, "Gateway")."""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn


class GatewayServer(uvicorn.Server):
    """uvicorn's server, except that the signal that stopped it is not raised again once
    it has shut down: uvicorn does so, and the process then dies by the signal (status
    143 for SIGTERM) after a clean drain; the gateway exits 0, as ``kvserve serve`` does."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own, less recording the signal for raising it again at the end.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open requests
        else:
            self.should_exit = True
