"""How the router reaches its drafter: the deployment's `[draft]` entry turned into a `DraftCoordinator`
(engine_drafts.py), the socket client of a draft worker process, and the width policy the router is
started with. With `[draft] placement = "attention"` there is no socket: the attention workers draft
and their Ready messages say whether their drafter loaded.
Plain Python, no torch (the router never imports it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import structlog

from moemesh.common.drafting.options import draft_block_size
from moemesh.common.wire.messages import DraftRequest
from moemesh.services.router.engine_drafts import DraftConfig, DraftCoordinator
from moemesh.services.router.spec_policy import WidthPolicyKind

log = structlog.get_logger("router")

# One DraftRequest is a few ms of drafter work (a first CUDA call: about a second). The engine loop
# waits for it, so this bounds the stall a dead drafter costs (once: then heartbeats tell).
DRAFT_TIMEOUT_S = 5.0


class DraftClient:
    """The router's socket to the draft worker: `propose` for DraftCoordinator."""

    def __init__(self, endpoint: str, context: Any, timeout_s: float, security: Any = None) -> None:
        from moemesh.common.wire.codec import TORCH_FREE_MESSAGES
        from moemesh.common.wire.transport import AsyncClient

        self.timeout_s = timeout_s
        self.client = AsyncClient(endpoint, context=context, accept=TORCH_FREE_MESSAGES,
                                  default_timeout_s=timeout_s, security=security)

    async def propose(self, request: DraftRequest) -> Any:
        return await self.client.request(request, timeout_s=self.timeout_s)

    async def close(self) -> None:
        await self.client.close()


WIDTH_POLICY_ENV = "MOEMESH_SPEC_WIDTH_POLICY"


def width_policy_from_env(environ: Mapping[str, str] = os.environ) -> WidthPolicyKind:
    """The router's width policy, from MOEMESH_SPEC_WIDTH_POLICY (`drafter` or `cost`; unset:
    `drafter`). Whoever starts the router sets it: `cost` goes with a drafter in adaptive mode,
    `drafter` with fixed mode (or to serve the confidence rule alone); bench/speculation.py sets it
    per server. It comes from the environment because the router's command line carries no
    speculation options and the drafter's mode is not on the wire. Unset keeps the drafter's
    widths, which is right for every mode (fixed mode must never be cut)."""
    value = environ.get(WIDTH_POLICY_ENV, "").strip().lower() or WidthPolicyKind.DRAFTER.value
    try:
        return WidthPolicyKind(value)
    except ValueError:
        raise ValueError(f"{WIDTH_POLICY_ENV}={value!r}: choose one of "
                         f"{', '.join(kind.value for kind in WidthPolicyKind)}") from None


def coordinator_for(deployment: Any, supervisor: Any, context: Any, security: Any = None
                    ) -> tuple[DraftCoordinator, DraftClient | None] | None:
    """The coordinator and its client when the deployment has a drafter (no client when it runs in the
    attention workers), else None."""
    from moemesh.common.runtime.deployment import derive_endpoints

    if not deployment.draft.enabled:
        return None
    block_size = draft_block_size(deployment.model.path)
    if block_size is None:
        log.warning("router.drafter_unusable", reason="the model has no dspark_block_size")
        return None
    config = DraftConfig(draft_name=deployment.draft.name, max_draft_tokens=block_size,
                         timeout_s=DRAFT_TIMEOUT_S,
                         max_heartbeat_silence_s=max(3.0, 5 * deployment.timeouts.heartbeat_interval_s),
                         width_policy=width_policy_from_env(), max_start_s=deployment.timeouts.ready_s,
                         in_attention=deployment.draft.in_attention)
    log.info("router.speculation_on", draft=deployment.draft.name, max_draft_tokens=block_size,
             width_policy=config.width_policy.value, placement=deployment.draft.placement)
    if config.in_attention:  # the attention workers draft; their Ready says whether their drafter loaded
        return DraftCoordinator(config, _no_draft_service, supervisor), None
    client = DraftClient(derive_endpoints(deployment).draft, context, config.timeout_s, security)
    return DraftCoordinator(config, client.propose, supervisor), client


async def _no_draft_service(request: DraftRequest) -> Any:
    raise RuntimeError("the drafter runs in the attention workers: no DraftRequest is sent")
