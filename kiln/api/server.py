"""Runs the app on Hypercorn until SIGTERM or SIGINT, then drains and returns the exit status."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from kiln.api.app import App
from kiln.server_config import ServeConfig

log = logging.getLogger(__name__)

# Once drained, how long Hypercorn may take to flush the last bytes and close idle keep-alive connections.
_CLOSE_GRACE_S = 5.0


class _Unlogged(logging.Filter):
    """Drops access-log lines of the given paths (their query strings aside)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        # The line: host "METHOD /path?query PROTOCOL" status ...
        request = record.getMessage().partition('"')[2].partition('"')[0]
        path = request.split(" ")[1].partition("?")[0] if request.count(" ") >= 1 else ""
        return path not in self.paths


def address(host: str, port: int, uds: str | None) -> str:
    """Hypercorn's name for where the server listens: host:port, or unix:PATH (--uds)."""
    return f"unix:{uds}" if uds is not None else f"{host}:{port}"


def listen(where: str) -> socket.socket:
    """The server's socket, bound by Hypercorn before anything loads (as vLLM binds first): a port in use
    is an OSError here, in a second, and never a traceback after the engine has started loading. A Unix
    socket's stale file is replaced."""
    hc = HypercornConfig()
    hc.bind = [where]
    return hc.create_sockets().insecure_sockets[0]


async def serve(
    config: ServeConfig, sock: socket.socket, started: float | None = None, imports: float = 0.0
) -> int:
    app = App(config, started, imports)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app.begin_drain)
    hc = HypercornConfig()
    hc.bind = [f"fd://{sock.detach()}"]  # Hypercorn owns the socket from here
    hc.graceful_timeout = _CLOSE_GRACE_S
    s = config.server
    if s.ssl_certfile is not None:  # Hypercorn serves its `bind` (our socket) over TLS when these are set
        hc.certfile, hc.keyfile, hc.ca_certs, hc.verify_mode = (
            s.ssl_certfile, s.ssl_keyfile, s.ssl_ca_certs, ssl.VerifyMode(s.ssl_cert_reqs)
        )  # fmt: skip
    hc.accesslog = None if s.disable_uvicorn_access_log else logging.getLogger("kiln.access")
    if s.disable_access_log_for_endpoints and hc.accesslog is not None:
        hc.accesslog.addFilter(_Unlogged(s.disable_access_log_for_endpoints))
    hc.errorlog = logging.getLogger("hypercorn.error")
    if s.uvicorn_log_level is not None:  # uvicorn's trace is below DEBUG
        level = 5 if s.uvicorn_log_level == "trace" else logging.getLevelName(s.uvicorn_log_level.upper())
        for logger in (hc.errorlog, hc.accesslog):
            if isinstance(logger, logging.Logger):
                logger.setLevel(level)
    hc.root_path = s.root_path or ""  # Starlette then routes both /prefix/v1/... and /v1/...
    hc.access_log_format = '%(h)s "%(r)s" %(s)s %(b)s %(L)ss'
    await hypercorn_serve(app.starlette, hc, shutdown_trigger=app.stopped.wait)  # type: ignore[arg-type]
    log.info("kiln stopped")
    return app.exit_code


def run(config: ServeConfig, sock: socket.socket, started: float | None = None, imports: float = 0.0) -> int:
    return asyncio.run(serve(config, sock, started, imports))
