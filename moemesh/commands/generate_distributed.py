"""`moemesh generate --distributed`: the prompts through an attention worker and N expert workers.

`generate_distributed` starts a `LocalCluster` (common/runtime/local_cluster.py), lets the router's
scheduler drive the attention worker process in-process (`services.router.offline_engine`) until
every request finished, and stops every process. `run_distributed(args)` is the command-line glue:
the same prompt encoding and output (text or `--json`) as the single-process `moemesh generate`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from moemesh.commands.serve_config import write_split_placement
from moemesh.common.runtime.local_cluster import ClusterError, ClusterSpec, LocalCluster
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.router.offline_engine import EngineStepError, OfflineEngine, RemoteAttention, RequestOutput
from moemesh.services.router.scheduler import SchedulerConfig


def attention_args(block_size_tokens: int, num_primary_blocks: int, num_cpu_blocks: int, num_micro_batches: int = 1,
                   placement_invariant: bool = False) -> tuple[str, ...]:
    """`moemesh attention` options for a router-less run: the KV pool the scheduler plans for."""
    return ("--micro-batches", str(num_micro_batches), "--kv-block-size", str(block_size_tokens),
            "--kv-primary-blocks", str(num_primary_blocks), "--kv-cpu-blocks", str(num_cpu_blocks),
            *(("--placement-invariant",) if placement_invariant else ()))


def scheduler_config(block_size_tokens: int, num_primary_blocks: int, num_cpu_blocks: int,
                     max_num_running_seqs: int = 64) -> SchedulerConfig:
    return SchedulerConfig(num_gpu_blocks=num_primary_blocks, num_cpu_blocks=num_cpu_blocks,
                           block_size_tokens=block_size_tokens, max_model_len=num_primary_blocks * block_size_tokens,
                           max_num_running_seqs=max_num_running_seqs)


def generate_distributed(spec: ClusterSpec, config: SchedulerConfig, prompts: Sequence[Sequence[int]],
                         params: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> list[RequestOutput]:
    with LocalCluster(spec) as cluster:
        attention = RemoteAttention(cluster.attention_endpoint, spec.step_timeout_s)
        try:
            engine = OfflineEngine(config, attention, eos_token_ids=eos_token_ids)
            outputs = [engine.add_request(f"req-{i}", prompt, params) for i, prompt in enumerate(prompts)]
            engine.run(before_step=cluster.check_alive)
        finally:
            attention.close()
    return outputs


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--expert-workers", type=int, default=1, help="--distributed: expert worker processes")
    parser.add_argument("--placement", default="round_robin", choices=("round_robin", "contiguous"),
                        help="--distributed: how experts are split among the expert workers")
    parser.add_argument("--placement-invariant", action="store_true",
                        help="--distributed: per-expert outputs summed in expert-id order (placement-independent)")
    parser.add_argument("--micro-batches", type=int, default=1, help="--distributed: micro-batches per step")
    parser.add_argument("--expert-device", action="append", default=None,
                        help="--distributed: expert worker devices, cycled (default: --device)")
    parser.add_argument("--kv-block-size", type=int, default=128, help="--distributed: tokens per KV block "
                        "(a multiple of 128)")
    parser.add_argument("--kv-primary-blocks", type=int, default=256)
    parser.add_argument("--kv-cpu-blocks", type=int, default=0)


def run_distributed(args: argparse.Namespace, tokenizer, prompt_ids: list[list[int]],
                    eos_token_ids: tuple[int, ...]) -> int:
    if args.expert_workers < 1 or args.micro_batches < 1:
        print("--expert-workers and --micro-batches must be >= 1", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    try:
        config = scheduler_config(args.kv_block_size, args.kv_primary_blocks, args.kv_cpu_blocks)
    except ValueError as error:
        print(f"moemesh generate --distributed: {error}", file=sys.stderr)
        return 2
    extra = attention_args(args.kv_block_size, args.kv_primary_blocks, args.kv_cpu_blocks, args.micro_batches,
                           args.placement_invariant)
    expert_devices = tuple(args.expert_device or [args.device])
    with tempfile.TemporaryDirectory(prefix="moemesh-gen-") as run_dir:
        placement = write_split_placement(args.model, Path(run_dir) / "placement.toml", args.placement,
                                          args.expert_workers, expert_devices)
        spec = ClusterSpec(model_path=args.model, run_dir=run_dir, num_expert_workers=args.expert_workers,
                           placement=placement, attention_device=args.device, expert_devices=expert_devices,
                           dtype=args.dtype, attention_args=extra)
        try:
            outputs = generate_distributed(spec, config, prompt_ids, params, eos_token_ids)
        except (ClusterError, EngineStepError, ValueError) as error:
            print(f"moemesh generate --distributed: {error}", file=sys.stderr)
            return 1
    failed = [output for output in outputs if output.error is not None]
    for output in failed:
        print(f"{output.request_id}: {output.error}", file=sys.stderr)
    results = [{"prompt_token_ids": list(o.prompt_token_ids), "generated_token_ids": o.output_token_ids,
                "text": tokenizer.decode(o.output_token_ids)} for o in outputs]
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        for prompt, result in zip(args.prompt, results):
            print(f"{prompt}{result['text']}")
    return 1 if failed else 0
