"""The router service installs Bearer auth from the deployment's [security] keys."""

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import argparse

from moemesh.common.runtime.deployment import add_deployment_arguments, parse_deployment
from moemesh.services.router.main import _install_api_keys


def _app() -> Starlette:
    async def models(request):
        return JSONResponse({"data": []})

    async def health(request):
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/v1/models", models), Route("/health", health)])


def _deployment(flags):
    """A deployment built the way `moemesh router --config FILE --api-key ...` builds it."""
    parser = argparse.ArgumentParser()
    add_deployment_arguments(parser)
    args = parser.parse_args(["--config", "x.toml", *flags])
    return parse_deployment({"model": {"path": "m"}, "attention": [{"name": "a"}], "expert": [{"name": "e"}]},
                            args.overrides)


def test_router_requires_the_configured_api_key():
    app = _app()
    _install_api_keys(app, _deployment(["--api-key", "secret-0123456789abcdef"]))
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer secret-0123456789abcdef"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_router_without_keys_stays_open():
    app = _app()
    _install_api_keys(app, _deployment([]))
    assert TestClient(app).get("/v1/models").status_code == 200
