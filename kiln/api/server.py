"""Runs the app on Hypercorn until SIGTERM or SIGINT, then drains and returns the exit status."""

from __future__ import annotations

import asyncio
import logging
import signal

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from kiln.api.app import App
from kiln.config import ServeConfig

log = logging.getLogger(__name__)

# Once drained, how long Hypercorn may take to flush the last bytes and close idle keep-alive connections.
_CLOSE_GRACE_S = 5.0


async def serve(config: ServeConfig, started: float | None = None) -> int:
    app = App(config, started)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app.begin_drain)
    hc = HypercornConfig()
    hc.bind = [f"{config.server.host}:{config.server.port}"]
    hc.graceful_timeout = _CLOSE_GRACE_S
    hc.accesslog = logging.getLogger("kiln.access")
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'
    await hypercorn_serve(app.starlette, hc, shutdown_trigger=app.stopped.wait)  # type: ignore[arg-type]
    log.info("kiln stopped")
    return app.exit_code


def run(config: ServeConfig, started: float | None = None) -> int:
    return asyncio.run(serve(config, started))
