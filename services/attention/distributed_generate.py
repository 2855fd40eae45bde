"""`moemesh generate --distributed`: the prompts through an attention worker and N expert workers.

`generate_distributed` starts a `LocalCluster`, drives the attention worker with StepPlans from
the `LocalPlanner` (prefill chunks, then decode) until every request finished, and stops every
process. `run_distributed(args)` is the command-line glue: the same prompts encoding and output
(text or `--json`) as the single-process `moemesh generate`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.local_cluster import ClusterError, ClusterSpec, LocalCluster
from moemesh.services.attention.local_plan import LocalPlanConfig, LocalPlanner, LocalRequest, PlanError
from moemesh.services.attention.main import AttentionOptions


def plan_config_for(options: AttentionOptions, eos_token_ids: tuple[int, ...] = (), max_num_seqs: int = 64
                    ) -> LocalPlanConfig:
    kv = options.kv
    return LocalPlanConfig(block_size_tokens=kv.block_size_tokens, num_primary_blocks=kv.num_primary_blocks,
                           num_cpu_blocks=kv.num_cpu_blocks, max_num_seqs=max_num_seqs, eos_token_ids=eos_token_ids)


def drive(endpoint: str, planner: LocalPlanner, step_timeout_s: float, cluster: LocalCluster | None = None) -> None:
    """Send plans to the attention worker at `endpoint` until the planner is done."""
    import zmq

    from moemesh.common.wire.messages import ErrorReply, StepResult
    from moemesh.common.wire.transport import SyncClient

    context = zmq.Context()
    client = SyncClient(endpoint, context=context, default_timeout_s=step_timeout_s)
    try:
        while not planner.done:
            if cluster is not None:
                cluster.check_alive()
            reply = client.request(planner.next_plan())
            if isinstance(reply, ErrorReply):
                raise PlanError(f"attention worker: {reply.code}: {reply.message}")
            if not isinstance(reply, StepResult):
                raise PlanError(f"attention worker answered {type(reply).__name__}")
            planner.update(reply)
    finally:
        client.close()
        context.term()


def generate_distributed(spec: ClusterSpec, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         eos_token_ids: tuple[int, ...] = ()) -> list[LocalRequest]:
    requests = [LocalRequest(f"req-{i}", list(prompt), params) for i, prompt in enumerate(prompts)]
    planner = LocalPlanner(plan_config_for(spec.options, eos_token_ids), requests)
    with LocalCluster(spec) as cluster:
        drive(cluster.attention_endpoint, planner, spec.step_timeout_s, cluster)
    return requests


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = KVPoolConfig()
    parser.add_argument("--expert-workers", type=int, default=1, help="--distributed: expert worker processes")
    parser.add_argument("--placement", default="round_robin", choices=("round_robin", "contiguous"),
                        help="--distributed: how experts are split among the expert workers")
    parser.add_argument("--placement-invariant", action="store_true",
                        help="--distributed: per-expert outputs summed in expert-id order (placement-independent)")
    parser.add_argument("--micro-batches", type=int, default=1, help="--distributed: micro-batches per step")
    parser.add_argument("--expert-device", action="append", default=None,
                        help="--distributed: expert worker devices, cycled (default: --device)")
    parser.add_argument("--kv-block-size", type=int, default=defaults.block_size_tokens)
    parser.add_argument("--kv-primary-blocks", type=int, default=defaults.num_primary_blocks)
    parser.add_argument("--kv-cpu-blocks", type=int, default=defaults.num_cpu_blocks)


def run_distributed(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenizers import Tokenizer

    from moemesh.commands.generate import _encode_prompts
    from moemesh.common.model.config import ModelConfig
    from moemesh.common.runtime.logging import configure_logging

    configure_logging("generate", None, "warning")
    if args.expert_workers < 1 or args.micro_batches < 1:
        print("--expert-workers and --micro-batches must be >= 1", file=sys.stderr)
        return 2
    tokenizer_path = Path(args.model) / "tokenizer.json"
    if not tokenizer_path.exists():
        print(f"{tokenizer_path}: not found", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    config = ModelConfig.load(args.model)
    prompt_ids = _encode_prompts(tokenizer, args.prompt, args.chat)
    eos = () if config.eos_token_id is None else (config.eos_token_id,)
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    options = AttentionOptions(num_micro_batches=args.micro_batches, placement_invariant=args.placement_invariant,
                               kv=KVPoolConfig(args.kv_block_size, args.kv_primary_blocks, args.kv_cpu_blocks))
    with tempfile.TemporaryDirectory(prefix="moemesh-gen-") as run_dir:
        spec = ClusterSpec(model_path=args.model, run_dir=run_dir, num_expert_workers=args.expert_workers,
                           placement=args.placement, attention_device=args.device,
                           expert_devices=tuple(args.expert_device or [args.device]), dtype=args.dtype,
                           options=options)
        try:
            requests = generate_distributed(spec, prompt_ids, params, eos)
        except (ClusterError, PlanError) as error:
            print(f"moemesh generate --distributed: {error}", file=sys.stderr)
            return 1
    failed = [r for r in requests if r.error is not None]
    for request in failed:
        print(f"{request.request_id}: {request.error}", file=sys.stderr)
    results = [{"prompt_token_ids": r.prompt_token_ids, "generated_token_ids": r.output_token_ids,
                "text": tokenizer.decode(r.output_token_ids)} for r in requests]
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        for prompt, result in zip(args.prompt, results):
            print(f"{prompt}{result['text']}")
    return 1 if failed else 0
