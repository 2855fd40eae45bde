"""The router service: `moemesh router --config FILE`.

    configure logging -> read the model's config.json + tokenizer.json (no weights, no torch)
    -> build SchedulerConfig, EngineConfig, GatewayConfig (frozen, once, here)
    -> on one uvloop event loop: bind the supervisor endpoint (Ready + heartbeats of every
       worker), start the engine loop, serve the Starlette app with uvicorn
    -> SIGTERM / SIGINT: drain (below), then the engine stops, sockets close, exit 0.

Drain: the gateway answers new generation requests 503 with Retry-After (the listener stays
open, so clients get an answer rather than a refused connection) while open requests finish,
for at most `[timeouts] drain_s` (`moemesh serve --drain-timeout`). What is still open then
ends with an error: streams get a final chunk with finish_reason "error", an error event and
`[DONE]`; other requests a 503. uvicorn then closes the connections. A second signal cuts at once.

The router binds the deployment's supervisor endpoint, so `/health` reflects every worker's
readiness and liveness; `moemesh serve` waits on that `/health`. With `[warm_up]` on (by default when the
attention worker runs on CUDA) `/health` stays 503 ("router": "warming up: ...") until the start-time
warm-up's synthetic requests have run through the engine (services/router/warm_up.py).

KV geometry: the scheduler's block counts must equal the attention worker's pool, so both
read the deployment's `[kv]` table (`common.runtime.deployment.KVConfig`: block size, primary
and CPU blocks, prefix caching). Prefix caching and the CPU swap tier are on by default: the
attention worker resumes a sequence from blocks (`PrefixRestore`, `services/attention/boundary.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from dataclasses import dataclass
from pathlib import Path

import structlog
import uvicorn

from moemesh.common.model.step_graphs import DECODE_GRAPH_BUCKETS, GRAPH_CHUNK_TOKENS
from moemesh.common.runtime.deployment import Deployment, DeploymentError, derive_endpoints
from moemesh.services.router.engine_config import EngineConfig
from moemesh.services.router.gateway_config import GatewayConfig
from moemesh.services.router.prompt_tokens import prompt_tokens_for
from moemesh.services.router.scheduler import SchedulerConfig
from moemesh.services.router.warm_up import EngineWarmUpConfig
from moemesh.services.router.warm_up_plan import WarmUpShape

CUT_GRACE_S = 5.0  # after the drain timeout: for cut streams to send their last chunks
CLOSE_GRACE_S = 2.0  # uvicorn's wait for connections to close once nothing is open

log = structlog.get_logger("router")

EOS_TOKEN_TEXT = "<｜end▁of▁sentence｜>"
# synthetic prompts of the warm-up draw their tokens from this text's (ordinary text, no special tokens)
WARM_UP_FILLER_TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and "
                       "void; and darkness was upon the face of the deep. 0123456789, (x + y) * z; {\"key\": [1, 2]}")


@dataclass(frozen=True)
class RouterSettings:
    """Router knobs the deployment file does not carry. The KV fields default to None, which
    means the deployment's [kv] table (the one the attention workers size their pools from);
    set them only in tests that run no attention worker."""

    block_size_tokens: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    max_num_running_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None  # None: the deployment's [scheduler]
    enable_prefix_caching: bool | None = None


def _or(value, default):
    return default if value is None else value


@dataclass(frozen=True)
class RouterConfigs:
    scheduler: SchedulerConfig
    engine: EngineConfig
    gateway: GatewayConfig
    host: str
    port: int
    warm_up: EngineWarmUpConfig | None = None  # None: no start-time warm-up


def _max_model_len(configured: int, max_positions: int, pool_tokens: int) -> int:
    """`[kv] max_model_len` when set (0: unset), else the model's positions capped by the device pool; a configured
    length past the model's positions fails (DeploymentError naming the key); past the pool, the scheduler's
    config refuses it."""
    if not configured:
        return min(max_positions, pool_tokens)
    if configured > max_positions:
        raise DeploymentError(f"kv.max_model_len: {configured} is past the model's max_position_embeddings "
                              f"({max_positions})")
    return configured


def graph_chunk_tokens(deployment: Deployment) -> int:
    """The longest chunk per sequence every attention worker replays as a CUDA graph (0: some worker runs
    every step eagerly): what the scheduler sizes short prefills to."""
    replays = all(worker.cuda_graphs and worker.device.startswith("cuda") for worker in deployment.attention)
    return GRAPH_CHUNK_TOKENS if replays else 0


def build_configs(deployment: Deployment, tokenizer, settings: RouterSettings = RouterSettings()) -> RouterConfigs:
    """Every config the router runs with, from the deployment and the model's config.json."""
    model_dir = Path(deployment.model.path)
    with open(model_dir / "config.json", encoding="utf-8") as handle:
        model = json.load(handle)  # read raw: ModelConfig validation is the workers' business
    kv = deployment.kv
    block_size_tokens = _or(settings.block_size_tokens, kv.block_size_tokens)
    num_gpu_blocks = _or(settings.num_gpu_blocks, kv.num_primary_blocks)
    max_model_len = _max_model_len(kv.max_model_len, int(model.get("max_position_embeddings", 4096)),
                                   num_gpu_blocks * block_size_tokens)
    eos_ids = {model["eos_token_id"]} if isinstance(model.get("eos_token_id"), int) else set()
    tokenizer_eos = tokenizer.token_to_id(EOS_TOKEN_TEXT)
    if tokenizer_eos is not None:
        eos_ids.add(tokenizer_eos)
    eos_token_ids = tuple(sorted(eos_ids))
    scheduler = SchedulerConfig(
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=_or(settings.num_cpu_blocks, kv.num_cpu_blocks),
        max_model_len=max_model_len,
        block_size_tokens=block_size_tokens,
        max_num_running_seqs=settings.max_num_running_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        long_prefill_token_threshold=_or(settings.long_prefill_token_threshold,
                                         deployment.scheduler.long_prefill_token_threshold),
        shared_prefill_token_threshold=deployment.scheduler.shared_prefill_token_threshold,
        short_request_window_s=deployment.scheduler.short_request_window_s,
        snapshot_interval_blocks=deployment.scheduler.snapshot_interval_blocks,
        graph_chunk_tokens=graph_chunk_tokens(deployment),
        graph_step_tokens=DECODE_GRAPH_BUCKETS[-1],
        graph_prefill_token_threshold=deployment.scheduler.graph_prefill_token_threshold,
        enable_prefix_caching=_or(settings.enable_prefix_caching, kv.prefix_caching),
        num_gpu_snapshots=kv.num_primary_snapshots,
        num_cpu_snapshots=kv.num_cpu_snapshots,
    )
    endpoints = derive_endpoints(deployment)
    attention = deployment.attention[0]  # one data-parallel rank for now
    timeouts = deployment.timeouts
    engine = EngineConfig(
        attention_endpoint=endpoints.attention[attention.name],
        attention_name=attention.name,
        required_worker_names=(*(w.name for w in deployment.attention), *(w.name for w in deployment.expert)),
        step_timeout_s=timeouts.step_s,
        max_heartbeat_silence_s=max(3.0, 5 * timeouts.heartbeat_interval_s),
        eos_token_ids=eos_token_ids,
        recovery_timeout_s=timeouts.recovery_s,
    )
    model_name = deployment.model.name or model_dir.name
    aliases = tuple(dict.fromkeys(name for name in (model_dir.name, "moemesh") if name != model_name))
    limits = deployment.router
    gateway = GatewayConfig(model_name=model_name, max_model_len=max_model_len, eos_token_ids=eos_token_ids,
                            model_aliases=aliases,
                            max_body_bytes=limits.max_body_bytes, max_json_depth=limits.max_json_depth,
                            max_concurrent_tokenizations=limits.max_concurrent_tokenizations,
                            prompt_tokens=prompt_tokens_for(tokenizer, model_dir))
    return RouterConfigs(scheduler, engine, gateway, deployment.router.host, deployment.router.port,
                         _warm_up_config(deployment, model_dir, scheduler, tokenizer))


def _warm_up_config(deployment: Deployment, model_dir: Path, scheduler: SchedulerConfig,
                    tokenizer) -> EngineWarmUpConfig | None:
    """The start-time warm-up's config, None when `[warm_up] mode` (auto: on with a CUDA attention worker)
    says off. Its longest context is `max_context_tokens` (0: max_model_len), below max_model_len."""
    from moemesh.common.model.config import AttentionKind, ModelConfig  # torch-free

    settings = deployment.warm_up
    if not settings.enabled_for(deployment.attention[0].device):
        return None
    model = ModelConfig.load(model_dir)
    has_csa = AttentionKind.CSA in model.layer_types
    max_context_tokens = min(settings.max_context_tokens or scheduler.max_model_len, scheduler.max_model_len - 1)
    shape = WarmUpShape(
        max_num_running_seqs=scheduler.max_num_running_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
        long_prefill_token_threshold=scheduler.long_prefill_token_threshold,
        block_size_tokens=scheduler.block_size_tokens, num_gpu_blocks=scheduler.num_gpu_blocks,
        max_context_tokens=max_context_tokens, csa_compress_ratio=model.csa_compress_ratio if has_csa else None,
        index_topk=model.index_topk if has_csa else None)
    filler = tuple(sorted(set(tokenizer.encode(WARM_UP_FILLER_TEXT, add_special_tokens=False).ids)))
    return EngineWarmUpConfig(shape, settings.step_timeout_s, filler)


def main(deployment: Deployment, name: str | None = None, log_level: str = "info",
         settings: RouterSettings = RouterSettings()) -> int:
    """Run the router until SIGTERM / SIGINT; returns the exit code. `name` is accepted for
    symmetry with the workers' entry points (there is one router per deployment)."""
    import uvloop

    from moemesh.common.runtime.logging import configure_logging
    from moemesh.services.router.app import load_tokenizer

    configure_logging("router", deployment.paths.log_dir, log_level)
    Path(deployment.paths.run_dir).mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(deployment.model.path)
    configs = build_configs(deployment, tokenizer, settings)
    return uvloop.run(serve_router(deployment, configs, tokenizer, deployment.timeouts.drain_s))


def _placement_route(deployment: Deployment, security, supervisor, max_silence_s: float):
    """`/v1/admin/placement` and `/v1/admin/experts`: load on new owners, switch every attention
    worker between two steps, drop (services.router.placement_admin); the registry of expert
    workers that announced themselves (services.router.expert_registry). Returns (route,
    registry, admin); the blocking clients run in worker threads."""
    import zmq

    from moemesh.common.wire.errors import ReplyTimeout, WireError
    from moemesh.common.wire.messages import QueryInventory
    from moemesh.common.wire.transport import SyncClient
    from moemesh.services.router.expert_registry import ExpertRegistry
    from moemesh.services.router.placement_admin import PlacementAdmin, placement_route

    endpoints = derive_endpoints(deployment)
    context = zmq.Context()
    expert_clients: dict[tuple[str, str], SyncClient] = {}

    def expert_client(name: str, endpoint: str) -> SyncClient:
        if (name, endpoint) not in expert_clients:
            expert_clients[(name, endpoint)] = SyncClient(endpoint, context=context, security=security)
        return expert_clients[(name, endpoint)]

    def query_inventory(name: str, endpoint: str):
        client = SyncClient(endpoint, context=context, security=security)  # fresh: a restarted peer
        try:
            return client.request(QueryInventory(), timeout_s=10.0)
        except (ReplyTimeout, WireError) as error:
            return error
        finally:
            client.close()

    attention_clients = [SyncClient(endpoint, context=context, security=security)
                         for endpoint in endpoints.attention.values()]
    admin = PlacementAdmin(expert_client, attention_clients)
    admin.deployment_holdings = _deployment_holdings(deployment)
    registry = ExpertRegistry(supervisor, query_inventory, max_silence_s=max_silence_s, on_restart=admin.reload_worker)
    admin.inventory_listener = registry.note_inventory
    admin.is_gone = lambda name: registry.workers.get(name) is not None and registry.workers[name].state == "gone"
    route = placement_route(admin, lambda: {**endpoints.expert, **registry.endpoints()}, registry)
    return route, registry, admin


def _deployment_holdings(deployment: Deployment) -> dict[str, set[tuple[int, int]]]:
    """Expert worker name -> the (layer, expert) pairs the deployment's placement gives it ({} when
    unreadable: /health then treats every down expert worker as needed, the safe side)."""
    from moemesh.common.placement.worker_holdings import holdings_for  # torch-free

    try:
        with open(Path(deployment.model.path) / "config.json", encoding="utf-8") as handle:
            model = json.load(handle)
        num_layers, num_experts = int(model["num_hidden_layers"]), int(model["n_routed_experts"])
        return {w.name: set(holdings_for(w.name, w.placement, num_layers, num_experts).held)
                for w in deployment.expert}
    except Exception as error:  # noqa: BLE001 (health detail only: the router serves without it)
        log.warning("router.deployment_holdings_unavailable", error=str(error)[:200])
        return {}


def _install_api_keys(app, deployment: Deployment) -> None:
    """Bearer auth at the gateway when `--api-key` / `[security] api_key_file` gives keys."""
    from moemesh.common.security.api_keys import load_api_keys
    from moemesh.services.router.auth_middleware import GatewayAuthConfig, install_bearer_auth

    # the [security] table (flags were folded in as overrides) and the MOEMESH_API_KEY environment variable
    api_keys = load_api_keys(deployment.security.api_keys, deployment.security.api_key_file)
    if api_keys is not None:
        install_bearer_auth(app, GatewayAuthConfig(api_keys))


def _watch_weight_bytes(app, progress_dir: str | None) -> None:
    from moemesh.common.runtime.load_progress import weight_records

    app.state.metrics.watch_weight_bytes(lambda: weight_records(progress_dir))


def _status_sources(deployment: Deployment, supervisor):
    """What the status page shows beyond the engine: the supervisor's view of the workers, the
    load-progress files, and the placement (experts per worker and layer) when a file gives it."""
    from moemesh.common.runtime.load_progress import progress_dir_for
    from moemesh.services.router.status_page import StatusSources

    placement = {}
    try:
        with open(Path(deployment.model.path) / "config.json", encoding="utf-8") as handle:
            model = json.load(handle)
        from moemesh.common.placement.worker_holdings import holdings_for  # torch-free

        for worker in (*deployment.attention, *deployment.expert):  # an attention worker may hold experts too
            held = holdings_for(worker.name, worker.placement, int(model["num_hidden_layers"]),
                                int(model["n_routed_experts"])).held
            if not held and worker in deployment.attention:
                continue
            layers: dict[int, list[int]] = {}
            for layer, expert in held:
                layers.setdefault(int(layer), []).append(int(expert))
            placement[worker.name] = layers
    except Exception as error:  # display only: the router serves without it
        log.warning("router.status_placement_unavailable", error=str(error)[:200])
    return StatusSources(supervisor=supervisor, progress_dir=str(progress_dir_for(deployment.paths.run_dir)),
                         placement=placement, model_path=str(deployment.model.path))


run = main  # `services.router.main.run(deployment)` is the name the CLI brief asks for


async def serve_router(deployment: Deployment, configs: RouterConfigs, tokenizer, drain_s: float) -> int:
    import zmq.asyncio

    from moemesh.common.runtime.supervisor import Supervisor
    from moemesh.services.router.app import build_app
    from moemesh.services.router.engine import Engine
    from moemesh.services.router.scheduler import Scheduler

    from moemesh.common.runtime.deployment_security import socket_security_for
    from moemesh.common.security.socket_security import ROUTER_KEY_NAME

    security = socket_security_for(deployment, ROUTER_KEY_NAME)  # refuses a bad key set before binding
    context = zmq.asyncio.Context()
    supervisor = Supervisor(derive_endpoints(deployment).supervisor, context=context, security=security)
    supervisor_task = asyncio.create_task(supervisor.run(), name="supervisor")
    from moemesh.services.router.drafter_link import coordinator_for

    speculation = coordinator_for(deployment, supervisor, context, security)  # None without a drafter
    from moemesh.services.router.warm_up import WarmUp

    engine = Engine(configs.engine, Scheduler(configs.scheduler), supervisor=supervisor, context=context,
                    security=security, drafts=speculation[0] if speculation else None,
                    warm_up=WarmUp(configs.warm_up) if configs.warm_up is not None else None)
    await engine.start()
    route, registry, admin = _placement_route(deployment, security, supervisor,
                                              configs.engine.max_heartbeat_silence_s)
    engine.health_tracker.replica_cover = admin.replica_cover  # a down worker with live twins is not needed
    registry_task = asyncio.create_task(registry.run(), name="expert-registry")
    app = build_app(configs.gateway, engine, tokenizer, placement_route=route)
    app.state.status_sources = _status_sources(deployment, supervisor)
    _watch_weight_bytes(app, app.state.status_sources.progress_dir)
    registry.bind_view(app.state.status_sources.placement)  # the status page shows registered workers live
    _install_api_keys(app, deployment)
    server = _RouterServer(uvicorn.Config(app, host=configs.host, port=configs.port, log_level="warning",
                                          lifespan="off", timeout_graceful_shutdown=CLOSE_GRACE_S),
                           app.state.gateway, drain_s)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.request_stop, signal.Signals(signum).name)
    log.info("router.http_listening", host=configs.host, port=configs.port, model=configs.gateway.model_name,
             max_model_len=configs.gateway.max_model_len)
    try:
        await server.serve()
    finally:
        registry_task.cancel()
        await asyncio.gather(registry_task, return_exceptions=True)
        await engine.stop()
        if speculation is not None and speculation[1] is not None:  # no client: the drafter is in the workers
            await speculation[1].close()
        supervisor_task.cancel()
        await asyncio.gather(supervisor_task, return_exceptions=True)
        supervisor.close()
        context.term()
        log.info("router.stopped")
    return 0


class _RouterServer(uvicorn.Server):
    """uvicorn's Server without its own signal capture: it re-raises captured signals when
    serve() returns, which would kill the process before the engine drained. The router's
    handlers call `request_stop`, which drains the gateway before uvicorn stops."""

    def __init__(self, config: uvicorn.Config, gateway, drain_s: float) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._drain_s = drain_s
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def request_stop(self, signal_name: str) -> None:
        if self._drain_task is None:
            log.info("router.draining", signal=signal_name, drain_s=self._drain_s,
                     num_open_requests=self._gateway.num_open_requests)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(), name="drain")
            return
        log.warning("router.drain_cut_short", signal=signal_name, num_open_requests=self._gateway.num_open_requests)
        self._gateway.cut_open_requests("the server is shutting down")
        if self.should_exit:
            self.force_exit = True  # stop waiting for open connections
        self.should_exit = True

    async def _drain(self) -> None:
        self._gateway.begin_drain()
        if not await self._gateway.wait_closed(self._drain_s):
            log.warning("router.drain_timeout", drain_s=self._drain_s, num_open_requests=self._gateway.num_open_requests)
            self._gateway.cut_open_requests(f"the server is shutting down (open requests had {self._drain_s:g} s "
                                            f"to finish)")
            await self._gateway.wait_closed(CUT_GRACE_S)
        self.should_exit = True
