"""The gateway's Starlette application and how to serve it (uvicorn + uvloop).

`build_app(config, engine, tokenizer)` is all a caller needs: the engine loop provides an
`EngineClient`, the tokenizer comes from the checkpoint's tokenizer.json (`load_tokenizer`).
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer

from moemesh.common.runtime.restart_record import read_restarts
from moemesh.services.router.engine_client import EngineClient
from moemesh.services.router.gateway import Gateway
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.metrics import CONTENT_TYPE, RouterMetrics
from moemesh.services.router.openapi import openapi_document
from moemesh.services.router.protocol import ProtocolError
from moemesh.services.router.request_id import install_request_ids
from moemesh.services.router.status_page import status_routes

log = structlog.get_logger("router")


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))


def build_app(config: GatewayConfig, engine: EngineClient, tokenizer: Tokenizer,
              placement_route: Route | None = None) -> Starlette:
    """placement_route: `POST /v1/admin/placement` (services.router.placement_admin), or None."""
    metrics = RouterMetrics(engine.stats)
    gateway = Gateway(config, engine, tokenizer, metrics)
    created = int(time.time())
    openapi = openapi_document(config.model_name)

    async def models(_: Request) -> Response:
        names = (config.model_name, *config.model_aliases)
        data = [{"id": name, "object": "model", "created": created, "owned_by": "moemesh",
                 "max_model_len": config.max_model_len} for name in names]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        report = engine.health()
        if gateway.draining:  # a load balancer stops sending here; open requests still finish
            return JSONResponse({"status": "draining", "services": report.services}, status_code=503)
        body = {"status": "ok" if report.ok else "unavailable", "services": report.services}
        sources = getattr(request.app.state, "status_sources", None)
        restarts = read_restarts(sources.restarts_file()) if sources is not None else {}
        if restarts:  # under `moemesh serve`: what it restarted (common.runtime.restart_record)
            body["restarts"] = {name: record.get("num_restarts", 0) for name, record in restarts.items()}
        return JSONResponse(body, status_code=200 if report.ok else 503)

    async def metrics_endpoint(_: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def openapi_endpoint(_: Request) -> Response:
        return JSONResponse(openapi)

    async def http_error(_: Request, error: HTTPException) -> Response:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = ProtocolError(str(error.detail), status=error.status_code, error_type=kind).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    routes = [
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
        *status_routes(engine, metrics),  # `/` and `/status.json` (status_page.py)
    ]
    if placement_route is not None:
        routes.append(placement_route)  # guarded by the API key middleware like every non-open path
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    install_request_ids(app)  # X-Request-Id on every response and log event (request_id.py)
    app.state.gateway = gateway
    app.state.metrics = metrics
    return app


def serve(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Blocking: run the app with uvicorn on uvloop (loopback by default)."""
    import uvicorn

    log.info("router.http_listening", host=host, port=port)
    uvicorn.run(app, host=host, port=port, loop="uvloop", log_level="warning",
                timeout_graceful_shutdown=5)
