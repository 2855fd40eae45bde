"""`moemesh serve`: router, attention worker and expert workers on one host, as separate processes.

    write <run_dir>/deployment.toml -> start every service -> wait until /health is 200
    (a progress line on stderr) -> print the URL -> until Ctrl-C / SIGTERM: restart a service
    that dies (serve_restarts.py: backoff, budget) -> stop router, attention, experts, drafter
    in that order (SIGTERM, bounded drain, SIGKILL)

Readiness is what the router reports: it receives every worker's Ready and heartbeats on
the deployment's supervisor endpoint, and /health turns 200 only when all needed workers
are ready. A service dying while starting fails serve at once (that is a config or model
problem, not a transient fault); once serving, a dead service is restarted, and serve only
gives up (stopping everything) when one spends its restart budget. Exit code 0 after a
requested stop, 1 when a service failed, 2 for bad arguments.
Imports nothing heavy: the services load torch in their own processes.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from moemesh.commands.serve_args import add_arguments, request_limits  # noqa: F401 (add_arguments: the cli's entry)


def _size_kv(layout, request, model_dir: Path):
    """The layout with its [kv] pool: the asked-for tokens in blocks, or `auto` sized from the attention device's
    free memory (moemesh/commands/serve_kv.py); ValueError when the pool or --max-model-len cannot be."""
    import dataclasses

    from moemesh.commands.serve_config import deployment_table
    from moemesh.commands.serve_kv import (auto_device_blocks, blocks_for, check_max_model_len,
                                           measure_free_bytes_isolated, planned_bytes_beside_kv)
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.runtime.deployment import parse_deployment

    config = ModelConfig.load(model_dir)
    layout = dataclasses.replace(layout, kv_num_cpu_blocks=blocks_for(request.cpu_tokens))
    if request.device_tokens is not None:
        blocks = blocks_for(request.device_tokens)
    else:
        sized = parse_deployment(deployment_table(dataclasses.replace(layout, kv_num_primary_blocks=1)))
        planned, block_bytes = planned_bytes_beside_kv(sized, config)
        device = layout.devices[0]
        blocks = auto_device_blocks(measure_free_bytes_isolated(device), request.memory_utilization, planned,
                                    block_bytes, device)
    check_max_model_len(request.max_model_len, config.max_position_embeddings, blocks)
    return dataclasses.replace(layout, kv_num_primary_blocks=blocks, max_model_len=request.max_model_len)


def _parse_devices(text: str) -> tuple[str, ...]:
    """The devices of `--devices`; `auto`: every CUDA GPU, else the CPU (moemesh/commands/devices.py)."""
    if text.strip() == "auto":
        from moemesh.commands.devices import auto_devices

        return auto_devices()
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if not devices:
        raise ValueError("--devices names no device")
    return devices


def _write_api_key_file(args: argparse.Namespace, run_dir: Path) -> str | None:
    """The keys of --api-key, --api-key-file and MOEMESH_API_KEY in `<run_dir>/api_keys` (mode 0600),
    the file the router reads (a restarted router too); None when no key is given (the API is open)."""
    import os

    from moemesh.common.security.api_keys import collect_api_keys

    keys = collect_api_keys(args.api_key, args.api_key_file)
    if not keys:
        return None
    path = run_dir / "api_keys"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # a reused run dir: the file may exist with wider permissions
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write("".join(f"{key}\n" for key in keys))
    return str(path)


class _StopRequested:
    """Set by SIGINT / SIGTERM; serve polls it (signal handlers only set a flag)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __call__(self, signum: int, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def __bool__(self) -> bool:
        return self.signal_name is not None


def _health(url: str) -> tuple[bool, dict[str, str]]:
    """(ok, per-service status); the router not listening yet reads as 'router: starting'."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            body = json.loads(response.read() or b"{}")
            return True, body.get("services", {})
    except urllib.error.HTTPError as error:
        try:
            body = json.loads(error.read() or b"{}")
        except ValueError:
            body = {}
        return False, body.get("services", {"router": f"HTTP {error.code}"})
    except (OSError, ValueError):
        return False, {"router": "starting"}


def _progress(services: dict[str, str], elapsed_s: float) -> str:
    parts = [f"{name} {status.split(':')[0]}" for name, status in sorted(services.items())]
    return f"\rwaiting for services ({elapsed_s:.0f}s): " + ", ".join(parts) + " " * 8


def run(args: argparse.Namespace) -> int:
    from moemesh.commands.serve_config import DRAFT_NAME, ServeLayout, write_deployment
    from moemesh.common.drafting.options import draft_block_size
    from moemesh.common.checkpoint.model_dir import ModelMissing, check_model_dir
    from moemesh.common.runtime.launcher import start_service, stop_services
    from moemesh.common.speculation_width import SpeculationConfig
    from moemesh.commands.serve_restarts import RestartPolicy
    from moemesh.commands.serve_kv import parse_kv_request
    from moemesh.commands.serve_model import HubModelMissing, is_hub_id, resolve_model
    from moemesh.common.runtime.deployment import DeploymentError
    from moemesh.common.runtime.logging import configure_logging
    from moemesh.common.security.api_keys import ApiKeyError, collect_api_keys

    try:
        model_dir = check_model_dir(resolve_model(args.model, args.revision))
        model_name = args.model if is_hub_id(args.model) else None  # clients name it as they asked for it
        devices = _parse_devices(args.devices)
        num_expert_workers = len(devices) if args.expert_workers is None else args.expert_workers
        experts_in_attention = _experts_in_attention(args.experts_in_attention, devices, args.expert_workers,
                                                     args.expert_dtype)
        if num_expert_workers < 1:
            raise ValueError(f"--expert-workers must be >= 1, got {num_expert_workers}")
        if args.recovery_timeout is not None and not args.recovery_timeout > 0:
            raise ValueError(f"--recovery-timeout must be > 0, got {args.recovery_timeout}")
        if args.step_timeout is not None and not args.step_timeout > 0:
            raise ValueError(f"--step-timeout must be > 0, got {args.step_timeout}")
        if args.kv_snapshots < 0:
            raise ValueError(f"--kv-snapshots must be >= 0, got {args.kv_snapshots}")
        for flag, value in (("--long-prefill-tokens", args.long_prefill_tokens),
                            ("--shared-prefill-tokens", args.shared_prefill_tokens)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if args.graph_prefill_tokens < 0:
            raise ValueError(f"--graph-prefill-tokens must be >= 0, got {args.graph_prefill_tokens}")
        if args.warm_up_context_tokens is not None and args.warm_up_context_tokens < 1:
            raise ValueError(f"--warm-up-context-tokens must be >= 1, got {args.warm_up_context_tokens}")
        collect_api_keys(args.api_key, args.api_key_file)  # a bad key or key file fails before anything starts
        # refuses a width above dspark_block_size (or speculation without a drafter) before anything starts
        speculation = SpeculationConfig.for_model(args.speculation, args.spec_width, draft_block_size(model_dir))
        kv_request = parse_kv_request(args.kv_tokens, args.kv_cpu_tokens, args.max_model_len,
                                      args.gpu_memory_utilization)
        restart_policy = RestartPolicy(initial_backoff_s=args.restart_backoff_s,
                                       max_backoff_s=max(30.0, args.restart_backoff_s),
                                       max_restarts=args.max_restarts, stable_after_s=args.restart_stable_s)
    except (ModelMissing, HubModelMissing, ApiKeyError, ValueError) as error:
        print(f"moemesh serve: {error}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="moemesh-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    api_key_file = _write_api_key_file(args, run_dir)
    log_dir = Path(args.log_dir).resolve() if args.log_dir else run_dir / "logs"
    configure_logging("serve", log_dir, "warning")
    placement_path = (_write_placement(model_dir, run_dir, num_expert_workers, devices)
                      if experts_in_attention == "none" else None)
    layout = ServeLayout(model_path=str(model_dir.resolve()), run_dir=str(run_dir), log_dir=str(log_dir),
                         host=args.host, port=args.port, num_expert_workers=num_expert_workers, devices=devices,
                         dtype=args.dtype, placement_path=placement_path, with_drafter=speculation.enabled,
                         draft_placement=args.draft_placement,
                         data_plane=args.data_plane,
                         cuda_graphs=args.cuda_graphs == "on" or (args.cuda_graphs == "auto"
                                                                  and devices[0].startswith("cuda")),
                         api_key_file=api_key_file, recovery_timeout_s=args.recovery_timeout, step_timeout_s=args.step_timeout,
                         model_name=model_name, drain_s=args.drain_timeout,
                         router_limits=request_limits(args), expert_dtype=args.expert_dtype,
                         experts_in_attention=experts_in_attention, kv_dtype=args.kv_dtype,
                         warm_up=args.warm_up, warm_up_context_tokens=args.warm_up_context_tokens,
                         long_prefill_tokens=args.long_prefill_tokens, kv_num_primary_snapshots=args.kv_snapshots,
                         shared_prefill_tokens=args.shared_prefill_tokens,
                         graph_prefill_tokens=args.graph_prefill_tokens)
    try:
        layout = _size_kv(layout, kv_request, model_dir)
        config_path, deployment = write_deployment(layout)
    except DeploymentError as error:
        print(f"moemesh serve: bad deployment: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"moemesh serve: {error}", file=sys.stderr)
        return 2

    stop = _StopRequested()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    services = []
    drafter = None
    watched = None  # after readiness: every service serve restarts (the list the restarter updates)
    router_cuts = _set_router_width_policy(speculation)
    try:
        spec_args = _drafter_args(speculation, router_cuts) + ("--draft-sampling", args.draft_sampling)
        services.append(start_service("router", "router", config_path, log_dir))
        services += [start_service("attention", w.name, config_path, log_dir,
                                   extra_args=spec_args if deployment.draft.in_attention else ())
                     for w in deployment.attention]
        services += [start_service("expert", w.name, config_path, log_dir) for w in deployment.expert]
        if deployment.draft.runs_process:  # optional: serving goes on without it (see _DrafterWatch)
            drafter = _DrafterWatch(start_service("draft", DRAFT_NAME, config_path, log_dir, extra_args=spec_args))
        base_url = f"http://{args.host}:{args.port}"
        outcome = _wait_ready(f"{base_url}/health", services, stop, args.ready_timeout, drafter, run_dir,
                              _expected_load_bytes(deployment))
        if outcome == "ready":
            draft_status = _health(f"{base_url}/health")[1].get("draft", "") if deployment.draft.in_attention else ""
            print(f"moemesh serving {model_name or model_dir.name} at {base_url}/v1 (logs: {log_dir}; speculation "
                  f"{_speculation_text(speculation, drafter, draft_status)})", flush=True)
            watched = services + ([drafter.service] if drafter is not None and not drafter.exited else [])
            outcome = _wait_for_stop(watched, stop, restart_policy, run_dir)
    finally:
        if watched is None:
            watched = services + ([drafter.service] if drafter is not None else [])
        codes = stop_services(watched, args.drain_timeout)  # router, attention, experts, drafter
    if outcome == "stopped":
        print(f"moemesh serve: stopped ({stop.signal_name}); exit codes {codes}", file=sys.stderr)
        return 0
    print(f"moemesh serve: {outcome}; logs in {log_dir}", file=sys.stderr)
    return 1


def _experts_in_attention(value: str, devices: tuple[str, ...], expert_workers: int | None, expert_dtype: str) -> str:
    """`--experts-in-attention` resolved: "all", "none" or a placement file's absolute path. ValueError when
    the file does not exist, or with an `--expert-dtype` conversion (the attention worker keeps experts as stored)."""
    if value == "auto":
        one_device = len(set(devices)) == 1 and expert_workers is None
        return "all" if one_device and expert_dtype == "native" else "none"
    if value != "none" and expert_dtype != "native":
        raise ValueError(f"--expert-dtype {expert_dtype} converts experts in expert workers only; the attention "
                         "worker keeps its own as stored: use --experts-in-attention none")
    if value in ("all", "none"):
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--experts-in-attention: {value} is not all, none, auto or a placement file")
    return str(path.resolve())


def _write_placement(model_dir: Path, run_dir: Path, num_workers: int, devices: tuple[str, ...]) -> str | None:
    """With several expert workers, split every layer's experts round-robin (a placement file)."""
    if num_workers == 1:
        return None
    from moemesh.commands.serve_config import write_split_placement

    return write_split_placement(str(model_dir), run_dir / "placement.toml", "round_robin", num_workers, devices)


def _wait_ready(health_url: str, services, stop: _StopRequested, timeout_s: float, drafter=None,
                run_dir: Path | None = None, expected_bytes: dict[str, int] | None = None) -> str:
    """"ready", "stopped" or why not, after printing a progress line while waiting. With a
    drafter, ready also waits for it to come up, unless it exits (then serving goes on without it).
    timeout_s bounds a wait without progress: loading, then each wave of the router's start-time
    warm-up (each new wave restarts the clock; a full-width model's warm-up may take longer in all).
    With `run_dir`, the line also carries a load progress bar per worker (the router loads no
    weights), filled by the bytes each is expected to read (`expected_bytes`)."""
    from moemesh.common.runtime.launcher import first_exited, load_progress_bar

    loading_names = [service.name for service in services if service.name != "router"]

    start_s = progress_s = time.monotonic()
    last_line = last_warm_up = ""
    while True:
        if stop:
            print(file=sys.stderr)
            return "stopped"
        exited = first_exited(services)
        if exited is not None:
            print(file=sys.stderr)
            return f"{exited.name} exited with code {exited.exit_code} while starting:\n{exited.stderr_tail()}"
        ok, statuses = _health(health_url)
        if drafter is not None:
            drafter.check()
        if ok and (drafter is None or drafter.exited or not statuses.get("draft", "ok").startswith("starting")):
            print(file=sys.stderr)
            return "ready"
        now_s = time.monotonic()
        warm_up = statuses.get("router", "")
        if warm_up.startswith("warming up") and warm_up != last_warm_up:
            last_warm_up, progress_s = warm_up, now_s
        elapsed_s = now_s - start_s
        if now_s - progress_s > timeout_s:
            print(file=sys.stderr)
            return f"not ready after {elapsed_s:.0f}s ({timeout_s:.0f}s without progress): {statuses}"
        line = _progress(statuses, elapsed_s)
        if run_dir is not None:
            line = line.rstrip() + "  " + load_progress_bar(run_dir, loading_names,
                                                            expected_bytes=expected_bytes) + " " * 8
        if line != last_line:
            print(line, end="", file=sys.stderr, flush=True)
            last_line = line
        time.sleep(0.25)


def _wait_for_stop(services, stop: _StopRequested, policy, run_dir: Path) -> str:
    """Restart services that die until a stop is requested ("stopped") or one spends its budget
    (why). `services` is updated in place with the replacements."""
    from moemesh.common.runtime.launcher import restart_service
    from moemesh.commands.serve_restarts import ChildRestarter, GaveUp
    from moemesh.commands.serve_config import DRAFT_NAME
    from moemesh.common.runtime.restart_record import restarts_path_for

    record_path = restarts_path_for(run_dir)
    record_path.unlink(missing_ok=True)  # a reused run dir: only this serve's restarts count
    restarter = ChildRestarter(services, policy, restart_service, record_path=record_path,
                               optional=frozenset({DRAFT_NAME}))
    num_restarts, num_given_up = 0, 0
    while not stop:
        try:
            restarter.poll()
        except GaveUp as error:
            return str(error)
        if restarter.num_restarts != num_restarts:
            num_restarts = restarter.num_restarts
            restarted = ", ".join(f"{name} x{record.num_restarts} (pid {record.pid})"
                                  for name, record in sorted(restarter.records.items()) if record.pid is not None)
            print(f"moemesh serve: restarted {restarted}", file=sys.stderr, flush=True)
        if len(restarter.given_up) != num_given_up:
            num_given_up = len(restarter.given_up)
            print(f"moemesh serve: gave up restarting {', '.join(restarter.given_up)}; serving continues "
                  f"without it", file=sys.stderr, flush=True)
        time.sleep(0.2)
    return "stopped"


class _DrafterWatch:
    """The draft worker is optional: if it exits, serve says so once (stderr and log) and keeps
    serving; the router's /health details then show the drafter down."""

    def __init__(self, service) -> None:
        self.service = service
        self.exited = False

    def check(self) -> None:
        if self.exited or self.service.exit_code is None:
            return
        self.exited = True
        import structlog

        structlog.get_logger("serve").error("serve.drafter_exited", exit_code=self.service.exit_code,
                                            action="serving continues without speculation")
        print(f"\nmoemesh serve: the draft worker exited with code {self.service.exit_code}; serving continues "
              f"without speculation:\n{self.service.stderr_tail()}", file=sys.stderr, flush=True)


def _expected_load_bytes(deployment) -> dict[str, int] | None:
    """What each service will read (for the progress bars); None when it cannot be told."""
    from moemesh.services.router.status_page_progress import expected_bytes_for_deployment

    try:
        return expected_bytes_for_deployment(deployment)
    except (OSError, ValueError) as error:
        print(f"moemesh serve: load progress without totals ({error})", file=sys.stderr)
        return None


def _drafter_args(speculation, router_cuts: bool) -> tuple[str, ...]:
    """The drafter's speculation options. When the router cuts the blocks (adaptive mode with the cost-aware
    widths), the drafter proposes whole blocks with their confidences: the router's calibration of the
    confidence head learns each slot's survival only from drafts it sees verified, and a drafter that
    cut its blocks by the uncalibrated head would hide the slots it underrates."""
    from moemesh.common.speculation_width import SpeculationMode

    mode = SpeculationMode.FIXED if router_cuts else speculation.mode
    return "--speculation", mode.value, "--spec-width", str(speculation.width)


def _set_router_width_policy(speculation) -> bool:
    """The router's width policy (services/router/drafter_link.py: width_policy_from_env), inherited
    by the router process: the cost-aware widths with adaptive mode (unless the caller chose
    `drafter`, the confidence rule alone); fixed and off keep the drafter's widths, always.
    True when the router's cost-aware policy cuts the blocks."""
    import os

    from moemesh.common.speculation_width import SpeculationMode
    from moemesh.services.router.drafter_link import WIDTH_POLICY_ENV

    if speculation.mode is SpeculationMode.ADAPTIVE:
        os.environ.setdefault(WIDTH_POLICY_ENV, "cost")
    else:
        os.environ[WIDTH_POLICY_ENV] = "drafter"
    return speculation.mode is SpeculationMode.ADAPTIVE and os.environ[WIDTH_POLICY_ENV].strip().lower() == "cost"


def _speculation_text(speculation, drafter, draft_status: str = "") -> str:
    """drafter: the draft worker process (None with the drafter in the attention worker, whose status
    the router's /health gives as draft_status)."""
    if not speculation.enabled:
        return "off"
    if drafter is not None and drafter.exited:
        return "off: the draft worker failed"
    if draft_status.startswith("down"):
        return "off: the drafter failed to load in the attention worker"
    return f"{speculation.mode.value}, width {speculation.width}"
