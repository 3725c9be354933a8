"""uvicorn's server with the engine drained first on SIGTERM / SIGINT.

uvicorn alone stops listening, waits for open connections up to its graceful timeout,
then cancels their tasks: a stream still running is cut mid-response, without a finish
or `[DONE]`. Here shutdown first drains the engine (`AsyncEngine.drain`): nothing more is
admitted, live requests run up to the drain timeout, the rest are aborted through the
engine thread so that each stream ends with finish_reason "abort" and `[DONE]`; only
then does uvicorn close the connections, whose last bytes are sent by then.
"""

from __future__ import annotations

from typing import Any

import uvicorn

from deepinfer.entrypoints.openai.async_engine import AsyncEngine

# Seconds uvicorn waits, once the engine has drained, for the last responses to be sent.
FLUSH_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:  # no new connection while the engine drains
            server.close()
        await self.engine.drain(self.drain_timeout)
        await super().shutdown(sockets)
