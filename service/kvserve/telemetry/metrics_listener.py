"""Prometheus ``/metrics`` on a listener of its own (docs/security.md, "Who may read
``/metrics``").

With ``kvserve serve --metrics-port`` or the gateway's ``listen.metrics_port``, the
metrics leave the API's port: a firewall or NetworkPolicy can then let Prometheus reach
them without letting it reach the API, and clients of the API cannot read them.

The listener is a second uvicorn server on the app's own event loop, started and stopped
by the app's lifespan. Not prometheus_client's ``start_http_server``: that serves from a
daemon thread that nothing stops, with none of the API port's HTTP limits, and reads
the metrics from that thread while the event loop writes them (the gateway refreshes its
gauges from its replica table on each scrape, which only the event loop may touch). On
the loop, a scrape is one more request between the app's others. And since a lifespan
ends only after its server has stopped serving requests, which for the engine server is
after the drain (``kvserve.server.shutdown``), Prometheus can watch a drain to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.openai.http_limits import HttpLimits, protocol_with

# The exposition text and its HTTP content type.
Scrape = Callable[[], tuple[bytes, str]]

# How long a stopping listener lets an open scrape finish: scrapes take milliseconds, and
# Prometheus tries again at its next interval.
STOP_GRACE_SECONDS = 1

log = logging.getLogger("kvserve.metrics")


class _QuietSignalsServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone.

    They belong to the API's server: uvicorn would otherwise take SIGTERM over while this
    one runs, and the API server would never drain. The lifespan stops this one.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def metrics_app(scrape: Scrape) -> Starlette:
    """``GET /metrics`` (and ``HEAD``); any other path is a plain 404."""

    async def metrics(request: Request) -> Response:
        body, content_type = scrape()
        return Response(body, media_type=content_type)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host has a colon, as uvicorn
    decides); an address in use is an ``OSError`` that names the listener."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise OSError(exc.errno, f"metrics listener on {host}:{port}: {exc.strerror}") from exc


class MetricsListener:
    """Serves ``scrape()`` at ``GET /metrics`` on ``host:port`` while started.

    ``start`` and ``stop`` run on the event loop that writes the metrics (the app's
    lifespan). ``port`` 0 takes a free port; ``port`` is the bound one once started.
    """

    def __init__(
        self, scrape: Scrape, host: str, port: int, http_limits: HttpLimits | None = None
    ) -> None:
        self.host = host
        self.port = port
        self._config = uvicorn.Config(
            metrics_app(scrape),
            lifespan="off",
            ws="none",
            http=protocol_with(http_limits or HttpLimits()),
            timeout_graceful_shutdown=STOP_GRACE_SECONDS,
            # None: uvicorn's loggers stay as the API's server configured them.
            log_config=None,
            log_level=None,
        )
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind (now, so that a port in use fails the app's startup) and serve; the port."""
        sock = bind(self.host, self.port)
        self.port = int(sock.getsockname()[1])
        self._server = _QuietSignalsServer(self._config)
        # Connections that arrive before the server's first turn wait in the backlog.
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Close the port once open scrapes end (at most ``STOP_GRACE_SECONDS``)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._server = self._task = None
