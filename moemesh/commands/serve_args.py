"""`moemesh serve`'s command line: the options of one host's deployment and the gateway's request limits
(`add_request_limit_arguments`, shared with `moemesh service router`)."""

from __future__ import annotations

import argparse

from moemesh.commands.serve_config import DEFAULT_MODEL_DIR
from moemesh.common.model.kv_sizing import DEFAULT_NUM_PRIMARY_SNAPSHOTS
from moemesh.common.model.kv_storage import KV_DTYPES
from moemesh.common.runtime.deployment import WARM_UP_MODES

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                        help="checkpoint directory, or a Hugging Face hub id (org/name) resolved through the "
                             f"local hub cache (HF_HOME; HF_HUB_OFFLINE=1: never download) (default: the "
                             f"embedded {DEFAULT_MODEL_DIR.name})")
    parser.add_argument("--revision", default=None,
                        help="with a hub id: the branch, tag or commit to serve (default: main)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--expert-workers", type=int, default=None,
                        help="expert worker processes (default: one per device)")
    parser.add_argument("--devices", default="auto",
                        help="comma-separated torch devices: the attention worker uses the first, expert "
                             "worker i uses device i mod count; auto (default): every CUDA GPU when there "
                             "are some, else cpu (`moemesh devices` shows the choice)")
    parser.add_argument("--dtype", default="auto", choices=_DTYPES, help="compute dtype (auto: f32 on CPU, bf16 on GPU)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                        help="how the attention worker stores window and compressed KV rows: bf16 (the compute dtype) "
                             "or fp8 (584-byte V4-Flash rows instead of 1,024, read by the attention kernels "
                             "directly; docs/model.md §3.1)")
    parser.add_argument("--kv-tokens", default="32768", metavar="N|auto",
                        help="context tokens the attention worker's device KV pool holds, over all sequences, in "
                             "128-token blocks; auto: as many as fit in --gpu-memory-utilization of the device's free "
                             "memory beside every worker's plan there (default 32768)")
    parser.add_argument("--kv-cpu-tokens", type=int, default=32768, metavar="N",
                        help="context tokens of the pinned CPU tier (preempted sequences swap there; 0: they are "
                             "recomputed) (default 32768)")
    parser.add_argument("--kv-snapshots", type=int, default=DEFAULT_NUM_PRIMARY_SNAPSHOTS, metavar="N",
                        help="resume snapshots on the device: what a sequence needs besides its KV blocks to resume at "
                             "a block end (one or two per running sequence, the rest keep prefix-cache resume points; "
                             "about 4 MB each for V4-Flash with fp8 rows, priced before --kv-tokens auto) (default "
                             f"{DEFAULT_NUM_PRIMARY_SNAPSHOTS})")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="prompt + output tokens of one request (default: the model's positions, capped by "
                             "the device pool)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="with --kv-tokens auto: the fraction of the device's free memory the workers on it "
                             "may plan (default 0.9)")
    parser.add_argument("--expert-dtype", choices=("native", "fp8", "bf16"), default="native",
                        help="what expert workers keep of the routed experts: native (as stored), fp8 (FP4 "
                             "re-encoded to FP8 e4m3 at load, docs/checkpoints.md) or bf16 (debugging)")
    parser.add_argument("--run-dir", default=None, help="sockets and the deployment file (default: a new temp dir)")
    parser.add_argument("--log-dir", default=None, help="service logs (default: <run-dir>/logs)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait without progress for readiness: loading, then each wave of the "
                             "start-time warm-up (a new wave restarts the clock; default 600)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds open requests get to finish (new ones get 503) before the rest "
                             "end with an error; each service then gets this long to stop (default 30)")
    parser.add_argument("--recovery-timeout", type=float, default=None,
                        help="seconds a request waits for a restarting worker before a 503 with Retry-After "
                             "(default: the deployment's timeouts.recovery_s, 90)")
    parser.add_argument("--step-timeout", type=float, default=None,
                        help="seconds the router waits for one step's answer before it treats the attention worker "
                             "as lost (default: the deployment's timeouts.step_s, 30); the warm-up's own steps, which "
                             "compile kernels and capture graphs, wait [warm_up] step_timeout_s (600) instead")
    parser.add_argument("--long-prefill-tokens", type=int, default=1024, metavar="N",
                        help="the most prompt tokens one request computes per step (default 1024): a longer prompt "
                             "prefills in chunks, beside other requests' steps")
    parser.add_argument("--shared-prefill-tokens", type=int, default=256, metavar="N",
                        help="the chunk of a long prompt while short requests are about (one arrived within the last "
                             "2 s), so a short request's first token waits on a short chunk (default 256; as large as "
                             "--long-prefill-tokens: long prompts keep full chunks, at the cost of short requests' TTFT)")
    parser.add_argument("--graph-prefill-tokens", type=int, default=64, metavar="N",
                        help="with the attention worker's CUDA graphs, a request with at most N tokens left to compute "
                             "(a short prompt, the rest of a prefix hit) computes them 8 a step as graph replays "
                             "instead of one eager forward, while at most 8 sequences are live (default 64; 0: never)")
    parser.add_argument("--warm-up", choices=WARM_UP_MODES, default="auto",
                        help="before /health turns 200, run synthetic requests through the scheduler and the "
                             "workers so that kernels compile and CUDA graphs are captured for every decode batch "
                             "bucket, step size and context class a request can reach (docs/design.md §2.1); auto "
                             "(default): on when the attention worker runs on a CUDA device")
    parser.add_argument("--warm-up-context-tokens", type=int, default=None, metavar="N",
                        help="longest context the warm-up reaches (its prefill costs about half of it; default: "
                             "--max-model-len)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health (repeatable; "
                             "visible in `ps`: prefer --api-key-file or MOEMESH_API_KEY)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="file of accepted API keys, one per line (# comments)")
    add_request_limit_arguments(parser)
    parser.add_argument("--speculation", choices=("off", "fixed", "adaptive"), default=None,
                        help="DSpark speculative decoding (default: adaptive when the checkpoint has a drafter)")
    parser.add_argument("--spec-width", type=int, default=None,
                        help="drafts per request (fixed) or their cap (adaptive); at most dspark_block_size")
    parser.add_argument("--draft-sampling", choices=("greedy", "sampled"), default="greedy",
                        help="a sampled request's drafts: the drafter's argmax, accepted with the target's probability "
                        "of it (default), or drawn from the drafter's own distribution at the request's temperature; "
                        "outputs follow the target's distribution either way (docs/speculation.md)")
    parser.add_argument("--draft-placement", choices=("attention", "process"), default="attention",
                        help="where the drafter runs: in the attention worker's process, on its device (default; "
                        "drafts come back with each step) or in a draft worker process of its own (features and "
                        "draft requests as messages; measured slower on one host: docs/speculation.md)")
    parser.add_argument("--data-plane", choices=("zmq", "cuda_ipc", "mailbox"), default="zmq",
                        help="how Dispatch/Combine tensors reach expert workers: ZeroMQ (default), CUDA device rings "
                        "shared by IPC (every worker on a CUDA device of this host; refused otherwise), or host-memory "
                        "mailboxes with a native loop in the CPU expert workers (no message per layer; one micro-batch)")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                        help="the attention worker replays decode steps as CUDA graphs per batch bucket (bit-identical "
                        "to eager steps); auto: on when the attention worker runs on a CUDA device")
    parser.add_argument("--experts-in-attention", default="auto", metavar="auto|all|none|FILE",
                        help="routed experts the attention worker holds and computes itself, without a hop: all "
                             "(expert workers join empty), none, or a placement file naming attention-0 and every "
                             "expert worker; auto (default): all when every worker runs on one device and "
                             "--expert-workers is not given, else none")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts in a row of a service that keeps dying within --restart-stable-s "
                             "before serve gives up (default 5; 0: stop serving when any service exits)")
    parser.add_argument("--restart-stable-s", type=float, default=60.0,
                        help="a service that ran this long before dying starts a fresh backoff and budget "
                             "(default 60)")
    parser.add_argument("--restart-backoff-s", type=float, default=0.5,
                        help="first restart delay; doubles per quick death in a row, capped at 30 s "
                             "(default 0.5)")


def add_request_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's limits on hostile input (`[router]` keys of the deployment), for serve and router."""
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="largest request body; larger ones get 413 before being read (default 32 MiB)")
    parser.add_argument("--max-json-depth", type=int, default=None,
                        help="deepest JSON nesting of a request body, checked before parsing (default 64)")
    parser.add_argument("--max-concurrent-tokenizations", type=int, default=None,
                        help="worker threads parsing large bodies and tokenizing long prompts at once (default 2)")


def request_limits(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """The limits given on the command line, as (router key, value) pairs."""
    keys = ("max_body_bytes", "max_json_depth", "max_concurrent_tokenizations")
    return tuple((key, getattr(args, key)) for key in keys if getattr(args, key, None) is not None)
