"""Distributed execution with real processes and real ipc sockets, against the single-process reference.

One tiny FP8/FP4 checkpoint (written by the checkpoint writer) is shared by every test. Prompts of
3, 13 and 22 tokens cross sliding-window (8), CSA (4) and HCA (8) window closes during prefill and
decode. Expert workers always run as separate processes; some tests drive an in-process
attention worker (so that they can look at logits, overlap counters and KV pool counters).
"""

from __future__ import annotations

import asyncio

import json

import pytest
import torch
import zmq

from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.generate import GenerationConfig, generate
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.sampling_params import SamplingParams
from moemesh.common.wire import codec
from moemesh.common.wire.messages import Combine, Dispatch, ErrorCode, ErrorReply
from moemesh.common.wire.transport import Kind, pack_envelope, unpack_envelope
from moemesh.commands.generate_distributed import generate_distributed, scheduler_config
from moemesh.common.placement.worker_holdings import WorkerHoldings, contiguous, round_robin
from moemesh.common.runtime.local_cluster import ClusterSpec, LocalCluster
from moemesh.services.attention.kv_config import KVPoolConfig
from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig
from moemesh.services.router.offline_engine import OfflineEngine

PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config(num_experts_per_tok=4)  # K = 4: partial sums of 3 workers re-associate the slot sum
    path = tmp_path_factory.mktemp("dist_ckpt")
    write_checkpoint(path, config, random_hub_state_dict(config, seed=21, include_mtp=False))
    return path, config


@pytest.fixture(scope="module")
def reference_outputs(checkpoint):
    path, config = checkpoint
    reader = CheckpointReader(path, config=config)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config))
    pairs = [(l, e) for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, pairs), config))
    return [generate(model, prompt, GenerationConfig(max_new_tokens=MAX_TOKENS)) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def expert_processes(checkpoint, tmp_path_factory):
    """Three expert worker processes that each hold every expert: the in-process attention
    worker's placement decides which one serves what."""
    path, _ = checkpoint
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path_factory.mktemp("experts")), num_expert_workers=3,
                       placement="all", with_attention=False)
    with LocalCluster(spec) as cluster:
        yield cluster
    assert cluster.exit_codes == {name: 0 for name in cluster.expert_names}


_OPEN_WORKERS: list[AttentionWorker] = []


@pytest.fixture(autouse=True)
def _close_attention_workers():
    """Close every in-process attention worker a test built: their ZeroMQ contexts must not be
    left to the garbage collector, which would terminate them with sockets still open."""
    yield
    while _OPEN_WORKERS:
        asyncio.run(_OPEN_WORKERS.pop().close())


def _attention(checkpoint, cluster, placement_builder, **options) -> AttentionWorker:
    path, config = checkpoint
    placement = placement_builder(cluster.expert_names, ["cpu"] * 3, config.num_hidden_layers,
                                  config.n_routed_experts, 1)
    holdings = tuple(WorkerHoldings(w.name, w.expert_ids) for w in placement.workers)
    worker = AttentionWorker(AttentionWorkerConfig(
        name="attention-test", checkpoint_path=str(path),
        expert_endpoints=tuple(cluster.endpoint_of(n) for n in cluster.expert_names), expert_workers=holdings,
        dispatch_timeout_s=30.0, **options))
    worker.load_now()
    _OPEN_WORKERS.append(worker)
    return worker


def _run_in_process(worker: AttentionWorker, prompts=PROMPTS, params=GREEDY):
    """The router's scheduler drives the in-process worker; the outputs, the engine, each plan's logits."""
    logits = []

    def execute(plan):
        result = worker.step(plan)
        logits.append(worker.last_logits)
        return result

    kv = worker.config.kv
    engine = OfflineEngine(scheduler_config(kv.block_size_tokens, kv.num_primary_blocks, kv.num_cpu_blocks), execute)
    outputs = [engine.add_request(f"req-{i}", p, params) for i, p in enumerate(prompts)]
    engine.run()
    return outputs, engine, logits


def test_one_expert_worker_process_matches_the_reference(checkpoint, reference_outputs, tmp_path):
    path, _ = checkpoint
    spec = ClusterSpec(model_path=str(path), run_dir=str(tmp_path / "run"), num_expert_workers=1,
                       attention_args=("--kv-primary-blocks", "16"))
    outputs = generate_distributed(spec, scheduler_config(128, 16, 0), PROMPTS, GREEDY)
    assert [o.output_token_ids for o in outputs] == reference_outputs
    assert all(o.error is None for o in outputs)


def test_generate_command_with_three_workers_and_micro_batches(checkpoint, reference_outputs, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from moemesh.cli import main

    path, config = checkpoint
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    argv = ["generate", "--model", str(path), "--max-tokens", str(MAX_TOKENS), "--json", "--distributed",
            "--expert-workers", "3", "--placement", "contiguous", "--micro-batches", "2"]
    for prompt in PROMPTS:
        argv += ["--prompt", " ".join(f"w{t}" for t in prompt)]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["prompt_token_ids"] for r in results] == PROMPTS
    eos = config.eos_token_id
    expected = [out[: out.index(eos) + 1] if eos in out else out for out in reference_outputs]
    assert [r["generated_token_ids"] for r in results] == expected


def test_placement_invariant_logits_are_bit_identical_across_placements(checkpoint, expert_processes,
                                                                       reference_outputs):
    runs = []
    for builder in (round_robin, contiguous):
        worker = _attention(checkpoint, expert_processes, builder, placement_invariant=True)
        requests, _, logits = _run_in_process(worker)
        runs.append(([o.output_token_ids for o in requests], logits))
    (tokens_a, logits_a), (tokens_b, logits_b) = runs
    assert tokens_a == tokens_b == reference_outputs
    assert len(logits_a) == len(logits_b)
    for a, b in zip(logits_a, logits_b):
        assert (a is None and b is None) or torch.equal(a, b)


def test_micro_batched_and_plain_runs_give_identical_tokens(checkpoint, expert_processes, reference_outputs):
    plain = _attention(checkpoint, expert_processes, round_robin, num_micro_batches=1)
    split = _attention(checkpoint, expert_processes, round_robin, num_micro_batches=2)
    plain_requests, _, _ = _run_in_process(plain)
    split_requests, _, _ = _run_in_process(split)
    assert [r.output_token_ids for r in split_requests] == [r.output_token_ids for r in plain_requests]
    assert [r.output_token_ids for r in plain_requests] == reference_outputs
    assert plain.runner.stats.num_overlapped_runs == 0
    assert split.runner.stats.num_overlapped_runs > 0  # attention ran while the other half's dispatch was out


def test_kv_blocks_spill_to_the_cpu_tier_and_return(checkpoint, expert_processes):
    """Two prompts of 125 tokens in a pool of 3 blocks of 128: both decode into a second block, so
    one is swapped out to the CPU tier, and back in (a state restore) once the other finished."""
    path, config = checkpoint
    prompts = [[(7 * i + 3 * r) % config.vocab_size for i in range(125)] for r in range(2)]
    reader = CheckpointReader(path, config=config)
    side = AttentionSide.from_state_dict(config, reader.load_attention_side(config))
    pairs = [(l, e) for l in range(config.num_hidden_layers) for e in range(config.n_routed_experts)]
    model = ReferenceModel(side, RoutedExperts.from_config(reader.load_experts(config, pairs), config))
    expected = [generate(model, prompt, GenerationConfig(max_new_tokens=MAX_TOKENS)) for prompt in prompts]
    kv = KVPoolConfig(block_size_tokens=128, num_primary_blocks=3, num_cpu_blocks=4)
    worker = _attention(checkpoint, expert_processes, contiguous, kv=kv)
    outputs, engine, _ = _run_in_process(worker, prompts)
    assert engine.scheduler.counters.num_preemptions_swap >= 1
    assert worker.pool.num_blocks_swapped_out >= 1
    assert worker.pool.num_blocks_swapped_in == worker.pool.num_blocks_swapped_out
    assert [o.output_token_ids for o in outputs] == expected


def test_malformed_message_is_dropped_and_the_worker_keeps_serving(checkpoint, expert_processes):
    _, config = checkpoint
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(expert_processes.endpoint_of(expert_processes.expert_names[0]))
    try:
        socket.send_multipart([pack_envelope(Kind.REQUEST, 1), b"\xc1not msgpack"])
        assert socket.poll(10_000)
        reply = socket.recv_multipart()
        assert unpack_envelope(reply[0]) == (Kind.REPLY, 1)
        error = codec.decode(reply[1:])
        assert isinstance(error, ErrorReply) and error.code is ErrorCode.MALFORMED
        dispatch = Dispatch(dispatch_id=5, step_id=0, layer=1, micro_batch=0, hidden=torch.randn(2, config.hidden_size),
                            expert_ids=torch.tensor([[0, 3], [1, 2]], dtype=torch.int32), weights=torch.ones(2, 2))
        socket.send_multipart([pack_envelope(Kind.REQUEST, 2), *codec.encode(dispatch)])
        assert socket.poll(10_000)
        reply = socket.recv_multipart()
        combine = codec.decode(reply[1:])
        assert isinstance(combine, Combine) and combine.dispatch_id == 5
        assert tuple(combine.output.shape) == (2, config.hidden_size) and bool(torch.isfinite(combine.output).all())
    finally:
        socket.close()
        context.term()
