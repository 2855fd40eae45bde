"""An in-process attention worker against expert worker processes, driven by the router's scheduler.

`attention_worker` builds and loads one (remote: the expert processes' (primary, replica) pairs, or None for
none; local: the pairs it holds itself); `run_offline` runs prompts through it with `OfflineEngine` and
returns the output tokens and every step's sampling logits; `reference_tokens` is the single-process
reference model's greedy continuation; `tiny_fp4_checkpoint` writes the tiny top-4 checkpoint they run.
"""

from __future__ import annotations

from moemesh.commands.generate_distributed import scheduler_config
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.generate import GenerationConfig, generate
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.placement.worker_holdings import WorkerHoldings, all_pairs
from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
from moemesh.services.router.offline_engine import OfflineEngine
from tiny_checkpoint_support import random_hub_state_dict, tiny_config


def attention_worker(path, cluster, remote, local, name: str = "attention-test", **options) -> AttentionWorker:
    """remote: (primary, replicas) pairs of every expert process of `cluster`, a list of them (one per
    process), or None (no expert worker); local: pairs held here, or None."""
    names = () if remote is None else tuple(cluster.expert_names)
    shares = remote if isinstance(remote, list) else [remote] * len(names)
    worker = AttentionWorker(AttentionWorkerConfig(
        name=name, checkpoint_path=str(path), expert_endpoints=tuple(cluster.endpoint_of(n) for n in names),
        expert_workers=tuple(WorkerHoldings(n, *share) for n, share in zip(names, shares)),
        local_holdings=None if local is None else WorkerHoldings(name, local), **{"dispatch_timeout_s": 30.0, **options}))
    worker.load_now()
    return worker


def run_offline(worker: AttentionWorker, prompts, sampling, before_step=lambda num_steps: None, counters=None):
    """(output tokens per prompt, the sampling logits of every step, on the host); before_step(steps so far)
    runs before each step; counters (a list): every step's StepCounters appended."""
    logits = []

    def execute(plan):
        before_step(len(logits))
        result = worker.step(plan)
        logits.append(None if worker.last_logits is None else worker.last_logits.float().cpu())
        if counters is not None:
            counters.append(result.counters)
        return result

    kv = worker.config.kv
    engine = OfflineEngine(scheduler_config(kv.block_size_tokens, kv.num_primary_blocks, kv.num_cpu_blocks), execute)
    outputs = [engine.add_request(f"req-{i}", p, sampling) for i, p in enumerate(prompts)]
    engine.run()
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.output_token_ids for o in outputs], logits


def reference_tokens(path, config, prompts, max_new_tokens: int) -> list[list[int]]:
    reader = CheckpointReader(path, config=config)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config))
    pairs = list(all_pairs(config.num_hidden_layers, config.n_routed_experts))
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, pairs), config))
    return [generate(model, prompt, GenerationConfig(max_new_tokens=max_new_tokens)) for prompt in prompts]


def tiny_fp4_checkpoint(path, seed: int):
    """A tiny checkpoint (FP8 linears, FP4 experts, top-4 routing, no drafter) written to `path` -> (path, config)."""
    config = tiny_config(num_experts_per_tok=4)
    write_checkpoint(path, config, random_hub_state_dict(config, seed=seed, include_mtp=False))
    return path, config
