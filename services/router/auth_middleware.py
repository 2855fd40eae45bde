"""Bearer-token authentication for the gateway (pure ASGI middleware).

With API keys configured, every HTTP request must carry `Authorization: Bearer <key>`;
otherwise it is answered 401 with an OpenAI-style error body and `WWW-Authenticate: Bearer`,
before any body is read or any work is queued. Paths in `open_paths` (default `/health`
only, which load balancers poll without credentials) pass through; `/metrics`, the status
page and the admin endpoints need a key like the API (Prometheus sends one with its
`authorization` scrape setting). Matching is on the exact path. Without keys the gateway is open: `install_bearer_auth` is
then simply not called (the router's main decides, from the deployment's `[security]`).

Usage, before the app starts serving:

    install_bearer_auth(app, GatewayAuthConfig(api_keys=load_api_keys(security.api_keys, security.api_key_file)))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from moemesh.common.security.api_keys import ApiKeys, bearer_token

log = structlog.get_logger("router")

DEFAULT_OPEN_PATHS = ("/health",)


@dataclass(frozen=True)
class GatewayAuthConfig:
    api_keys: ApiKeys
    open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS


def unauthorized_body(message: str) -> dict[str, Any]:
    """The body OpenAI's API returns for a bad key (clients map it to AuthenticationError)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, config: GatewayAuthConfig) -> None:
        self.app = app
        self.config = config
        self.open_paths = frozenset(config.open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = _header(scope, b"authorization")
        token = bearer_token(authorization)
        if self.config.api_keys.matches(token):
            await self.app(scope, receive, send)
            return
        reason = "missing" if token is None else "invalid"
        client = scope.get("client")
        log.info("router.auth_rejected", reason=reason, path=scope["path"], client=client[0] if client else None)
        message = ("Missing API key: send the header 'Authorization: Bearer <API key>'." if token is None
                   else "Incorrect API key provided.")
        response = JSONResponse(unauthorized_body(message), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def install_bearer_auth(app: Starlette, config: GatewayAuthConfig) -> None:
    """Wrap `app` in BearerAuthMiddleware; call before the app starts serving. It goes just inside
    the X-Request-Id middleware (request_id.py), so a refused request still has and logs its id."""
    from moemesh.services.router.request_id import RequestIdMiddleware

    outer = [index for index, middleware in enumerate(app.user_middleware) if middleware.cls is RequestIdMiddleware]
    app.user_middleware.insert(outer[0] + 1 if outer else 0, Middleware(BearerAuthMiddleware, config=config))
    log.info("router.auth_enabled", num_keys=config.api_keys.num_keys, open_paths=list(config.open_paths))
