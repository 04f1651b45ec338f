"""Running the gateway with uvicorn (``stageferry gateway``)."""

from __future__ import annotations

import uvicorn

from stageferry.gateway.app import GatewayConfig, create_app


def serve(config: GatewayConfig, *, host: str = "127.0.0.1", port: int = 8091, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM (uvicorn drains in-flight requests, then the lifespan closes Redis).

    uvicorn's own access log is off (the metrics middleware counts every request).  After draining,
    uvicorn re-raises the signal it caught, so the exit status is that of SIGTERM/SIGINT.
    """
    uvicorn.run(
        create_app(config),
        host=host,
        port=port,
        log_level="warning" if log_level == "info" else log_level,
        access_log=False,
        lifespan="on",
    )
