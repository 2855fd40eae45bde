"""Hostile input at the HTTP edge: schemathesis generates requests from the gateway's own
`/openapi.json` (valid and invalid bodies, odd headers, odd query strings) and sends them
through the ASGI app over the deterministic in-test engine. No response may be a 5xx: bad input
is the client's fault (4xx), and everything else must be served.

The number of examples per operation is bounded so the test stays within a few seconds.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from router_support import ScriptedEngine, tiny_tokenizer  # noqa: E402

from moemesh.common.chat import tokens as tk  # noqa: E402
from moemesh.services.router.app import build_app  # noqa: E402
from moemesh.services.router.gateway_config import GatewayConfig  # noqa: E402

MAX_EXAMPLES_PER_OPERATION = 40
TOKENIZER = tiny_tokenizer()
EOS = TOKENIZER.token_to_id(tk.EOS)
MODEL_NAME = "dsv4-flash"


def _make_app():
    script = TOKENIZER.encode("Héllo wörld 😀! The end.", add_special_tokens=False).ids + [EOS]
    engine = ScriptedEngine(script, eos_id=EOS)
    config = GatewayConfig(model_name=MODEL_NAME, max_model_len=256, eos_token_ids=(EOS,), keep_alive_interval_s=0.1)
    return engine, build_app(config, engine, TOKENIZER)


ENGINE, APP = _make_app()
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


def test_the_schema_lists_the_generation_endpoints():
    paths = {result.ok().path for result in SCHEMA.get_all_operations()}
    assert {"/v1/completions", "/v1/chat/completions"} <= paths, paths


@SCHEMA.parametrize()
@settings(max_examples=MAX_EXAMPLES_PER_OPERATION, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors_from_generated_requests(case):
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text[:500])
