"""The HTTP server around the app: uvicorn, told when a shutdown begins.

uvicorn lets open responses finish (up to its graceful timeout) before the app hears of the
shutdown through its lifespan, so a stream would go on generating until it was cut. This server
tells the app first: the running request ends at its next token, its client gets a
``shutting_down`` error event and ``[DONE]``, waiting requests get a 503, and the connections close.
"""

from __future__ import annotations

import socket

import uvicorn

from strata.serve.state import ServeState

GRACEFUL_SHUTDOWN_S = 5  # a backstop: responses end within a token of the shutdown


class ServeServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServeState):
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.begin_shutdown()
        await super().shutdown(sockets)
