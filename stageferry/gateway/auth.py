"""The gateway's optional bearer token: when one is configured, every API call must carry it.

``STAGEFERRY_GATEWAY_TOKEN`` (an environment variable, so that it never shows in a process list) turns
it on; the API and the console's JSON endpoints then answer 401 ``unauthorized`` without
``Authorization: Bearer <token>``.  What stays open: the console page and its static files (the page
asks for the token and sends it), ``/console/api/info`` (which tells the page to ask), ``/health`` for
load balancers, ``/metrics`` for scrapers, and the OpenAPI document.  Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError

#: Paths served without the token: probes, scrapers, the API description and the page's bootstrap.
OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/openapi.json", "/docs", "/redoc", "/console/api/info"})


async def require_token(request: Request) -> None:
    """A route dependency: 401 unless the configured token (if any) is presented as a bearer token."""
    token: str | None = getattr(request.app.state, "api_token", None)
    if not token or request.url.path in OPEN_PATHS:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise _unauthorized("this gateway needs a bearer token (Authorization: Bearer <token>)", "")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise _unauthorized("the bearer token is not this gateway's", ' error="invalid_token"')


def _unauthorized(message: str, error: str) -> ApiError:
    """401, with the challenge RFC 6750 gives: a wrong token also says ``invalid_token``."""
    return ApiError.of(GatewayCode.UNAUTHORIZED, message, headers={"WWW-Authenticate": f"Bearer{error}"})
