"""Decode steps through `DecodeGraphs` (static tables; CUDA graphs on CUDA) against ModelRunner's eager loop.

One script of steps runs on two identical sets of sequences: the eager `ModelRunner` (on CPU the
torch attention path, on CUDA the Triton kernels with per-forward tables) and a `ModelRunner` with
`graphs` (decode steps through the static tables of `graph_tables`: on CUDA captured and replayed,
on CPU the same segment functions run eagerly under TRITON_INTERPRET=1). The script prefills
sequences of different lengths (those steps run eagerly on both sides), then decodes with
sequences joining (prefilled in between) and leaving, across compression-window closes of both
ratios and across indexer width classes. Verification steps give every sequence its greedy token
and a few random drafts (one chunk of several tokens each, as speculative decoding does), then roll
both sides back by the rejected drafts. Both sides are fed the eager side's greedy tokens;
after every step the logits of every new token and the greedy tokens are compared, and at the end every
tensor the next step could read (`SequenceState.live_tensors`).

`python -m moemesh.bench.checks.decode_graphs --suite interpret|cuda|flash [--micro-batches M]` prints one
JSON object per case. Legend: T tokens, N hc streams, D hidden, V vocab.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from moemesh.common.model.config import AttentionKind


@dataclass(frozen=True)
class GraphCase:
    case_id: str
    prompt_lengths: tuple[int, ...]  # one sequence each, prefilled before the decode steps
    num_decode_steps: int
    joins: tuple[tuple[int, int], ...] = ()  # (decode step, prompt length): a new sequence starts then
    leaves: tuple[tuple[int, int], ...] = ()  # (decode step, sequence index): that sequence stops then
    # (decode step, tokens per sequence, rejected): that step verifies the greedy token and tokens - 1 random drafts
    # per sequence, then both sides roll back the last `rejected` of them
    verifies: tuple[tuple[int, int, int], ...] = ()
    num_micro_batches: int = 1
    buckets: tuple[int, ...] = (1, 2, 4, 8)
    row_store: str = "own"  # "own": each store's growing tensor; "paged": the worker's KV pool, scattered blocks


@dataclass
class GraphCaseResult:
    case_id: str
    device: str
    num_steps: int
    num_graph_steps: int
    num_eager_steps: int
    num_captures: int
    max_relative_error: float  # logits of the new tokens, worst step
    state_relative_error: float  # live state tensors at the end
    num_token_mismatches: int
    elapsed_s: float
    eager_reasons: dict = field(default_factory=dict)
    # per mismatch: (eager's top-1 minus top-2 logit, max |graph - eager| logit of that row): near ties or not
    mismatch_gaps: list = field(default_factory=list)


@dataclass
class _Ticket:
    layer: int
    routed: torch.Tensor  # [T, D]


class LocalDispatcher:
    """The MoEDispatcher interface with the routed experts called in this process."""

    def __init__(self, experts) -> None:
        self.experts = experts

    def start(self, step_id: int, micro_batch: int, layer: int, x, ids, weights) -> _Ticket:
        return _Ticket(layer, self.experts(layer, x, ids, weights))

    def finish(self, ticket: _Ticket) -> torch.Tensor:
        return ticket.routed

    def device_step_ready(self, num_tokens: int) -> bool:
        """False: the experts here may sync with the host, so steps replay segment graphs."""
        return False


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _split(items: list, num_micro_batches: int) -> list[list]:
    from moemesh.services.attention.worker import split_micro_batches

    return [[items[i] for i in group] for group in split_micro_batches(len(items), num_micro_batches)]


def run_graph_case(case: GraphCase, config, device: torch.device, *, capture: bool, dtype: str = "float32",
                   seed: int = 0) -> GraphCaseResult:
    from moemesh.common.model.batch import SequenceChunk
    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.model.random_init import random_model
    from moemesh.common.model.state import SequenceState
    from moemesh.services.attention.graph_decode import DecodeGraphConfig, DecodeGraphs
    from moemesh.services.attention.model_runner import ModelRunner

    started_s = time.perf_counter()
    torch.manual_seed(seed)
    side, experts = random_model(config, device, numerics=NumericsConfig(dtype=dtype), seed=seed)
    dispatcher = LocalDispatcher(experts)
    eager = ModelRunner(side, dispatcher)
    graphed = ModelRunner(side, dispatcher)
    graphed.graphs = DecodeGraphs(side, DecodeGraphConfig(buckets=case.buckets, capture=capture), device)
    generator = torch.Generator(device="cpu").manual_seed(seed + 7)
    eager_states: list[SequenceState] = []
    graph_states: list[SequenceState] = []
    next_tokens: list[int] = []
    active: list[int] = []
    worst = 0.0
    mismatches: list[tuple[float, float]] = []
    num_steps = 0

    def compare(got: torch.Tensor, want: torch.Tensor, row: int = -1) -> int:
        """Record the error of one chunk's logits [n, V]; -> eager's greedy token after row `row`."""
        nonlocal worst
        worst = max(worst, _relative(got, want))
        for got_row, want_row in zip(got, want):
            if int(got_row.argmax()) != int(want_row.argmax()):
                top2 = want_row.topk(2).values
                mismatches.append((float(top2[0] - top2[1]), float((got_row - want_row).abs().max())))
        return int(want[row].argmax())

    def run(runner: ModelRunner, states: list[SequenceState], members: list[int], tokens: list[torch.Tensor],
            step_id: int, all_rows: bool = False) -> list[torch.Tensor]:
        """-> logits [1, V] of each member's last token ([n, V] of all its n tokens with all_rows)."""
        items = [(tokens[k], SequenceChunk(states[i], tokens[k].shape[0])) for k, i in enumerate(members)]
        micro_batches = [(torch.cat([t for t, _ in group]).to(device), [c for _, c in group])
                         for group in _split(items, case.num_micro_batches)]
        finals = runner.forward(step_id, micro_batches)
        out = []
        for (ids, chunks), h in zip(micro_batches, finals):
            if all_rows:
                logits = side.logits(h, torch.arange(h.shape[0], device=device)).float()
                bounds = [0] + torch.tensor([c.num_new_tokens for c in chunks]).cumsum(0).tolist()
                out.extend(logits[bounds[k]: bounds[k + 1]] for k in range(len(chunks)))
                continue
            ends = torch.tensor([c.num_new_tokens for c in chunks]).cumsum(0) - 1
            logits = side.logits(h, ends.to(device)).float()
            out.extend(logits[k: k + 1] for k in range(len(chunks)))
        return out

    pools = [None, None]
    if case.row_store == "paged":  # one pool per side; sequence i owns blocks counting down from the top
        from moemesh.services.attention.kv_config import KVPoolConfig
        from moemesh.services.attention.kv_pool import KVPool

        block_size = max(32, *(config.compress_ratio(layer) or 1 for layer in range(config.num_hidden_layers)))
        pool_config = KVPoolConfig(block_size_tokens=block_size, num_primary_blocks=64)
        pools = [KVPool(config, pool_config, side.dtype, device) for _ in range(2)]

    def new_state(pool, index: int) -> SequenceState:
        if pool is None:
            return SequenceState(config, dtype=side.dtype, device=device)
        from moemesh.services.attention.kv_pool import BlockTable

        table = BlockTable(device)
        table.update([63 - 8 * index - k for k in range(8)])  # scattered, descending
        return SequenceState(config, dtype=side.dtype, device=device, row_store_factory=pool.row_store_factory(table))

    def prefill(length: int) -> None:
        nonlocal num_steps
        index = len(eager_states)
        for states, pool in zip((eager_states, graph_states), pools):
            states.append(new_state(pool, index))
        prompt = torch.randint(0, config.vocab_size, (length,), generator=generator)
        want = run(eager, eager_states, [index], [prompt], num_steps)
        got = run(graphed, graph_states, [index], [prompt], num_steps)
        next_tokens.append(compare(got[0], want[0]))
        active.append(index)
        num_steps += 1

    with torch.inference_mode():
        for length in case.prompt_lengths:
            prefill(length)
        for step in range(case.num_decode_steps):
            for at, length in case.joins:
                if at == step:
                    prefill(length)
            for at, index in case.leaves:
                if at == step and index in active:
                    active.remove(index)
            verify = next(((n, r) for at, n, r in case.verifies if at == step), (1, 0))
            num_new, num_rejected = verify
            drafts = [torch.randint(0, config.vocab_size, (num_new - 1,), generator=generator) for _ in active]
            tokens = [torch.cat([torch.tensor([next_tokens[i]]), d]) for i, d in zip(active, drafts)]
            want = run(eager, eager_states, active, tokens, num_steps, all_rows=True)
            got = run(graphed, graph_states, active, tokens, num_steps, all_rows=True)
            for k, i in enumerate(active):
                next_tokens[i] = compare(got[k], want[k], row=num_new - 1 - num_rejected)
                if num_rejected:
                    eager_states[i].rollback(num_rejected)
                    graph_states[i].rollback(num_rejected)
            num_steps += 1
    state_error = 0.0
    for want_state, got_state in zip(eager_states, graph_states):
        want_live, got_live = want_state.live_tensors(), got_state.live_tensors()
        for name, tensor in want_live.items():
            state_error = max(state_error, _relative(got_live[name], tensor))
    stats = graphed.graphs.stats
    return GraphCaseResult(case.case_id, str(device), num_steps, stats.num_graph_steps, stats.num_eager_steps,
                           stats.num_captures, worst, state_error, len(mismatches), time.perf_counter() - started_s,
                           dict(stats.eager_reasons), mismatches)


def prefill_counts(case: GraphCase) -> tuple[int, int]:
    """(prompts short enough for the graphed path, longer prompts that run eagerly) of a case."""
    from moemesh.services.attention.graph_decode import DEFAULT_MAX_TOKENS_PER_SEQUENCE

    lengths = list(case.prompt_lengths) + [length for _, length in case.joins]
    short = sum(1 for length in lengths if length <= DEFAULT_MAX_TOKENS_PER_SEQUENCE)
    return short, len(lengths) - short


INTERPRET_CASES = (  # positions 5..37: CSA rows 1..9 (indexer off, width 8, width 16), HCA closes at 15, 23, 31
    GraphCase("join_leave_windows", prompt_lengths=(13, 6, 28), num_decode_steps=10, joins=((3, 9),),
              leaves=((7, 1),)),
    # chunks of 3..6 tokens across window closes of both ratios, some drafts rejected and rolled back
    GraphCase("verify_chunks", prompt_lengths=(10, 21), num_decode_steps=6, joins=((4, 9),),
              verifies=((0, 6, 2), (1, 3, 0), (2, 5, 4), (3, 4, 1), (4, 3, 1)), buckets=(2, 4, 8, 16)),
    GraphCase("paged_rows", prompt_lengths=(30, 5), num_decode_steps=5, joins=((2, 11),), row_store="paged"),
)
CUDA_CASES = (
    GraphCase("join_leave_windows", prompt_lengths=(13, 6, 30), num_decode_steps=40, joins=((5, 21), (20, 3)),
              leaves=((12, 1), (30, 0))),
    GraphCase("verify_chunks", prompt_lengths=(10, 21, 33), num_decode_steps=24, joins=((6, 9),), leaves=((18, 1),),
              verifies=tuple((step, 2 + step % 5, step % 3) for step in range(0, 24, 2)), buckets=(4, 8, 16, 32)),
    GraphCase("two_micro_batches", prompt_lengths=(13, 6, 30, 17, 2), num_decode_steps=24, joins=((8, 40),),
              leaves=((16, 2),), num_micro_batches=2),
    GraphCase("paged_rows", prompt_lengths=(30, 5, 60), num_decode_steps=30, joins=((2, 11),), leaves=((20, 0),),
              row_store="paged"),
)
FLASH_CASES = (  # sequence 0 crosses 512 CSA rows (the indexer starts) at 2051, sequence 2 closes HCA row 1 at 255
    GraphCase("flash_width", prompt_lengths=(2040, 7, 250), num_decode_steps=14, joins=((4, 60),), leaves=((9, 1),),
              buckets=(1, 2, 4, 8, 16, 32, 64)),
)


def flash_graph_config():
    """V4-Flash width (window, CSA, HCA layers) with 32 routed experts (the expert count does not matter here)."""
    from moemesh.common.model.random_init import flash_config

    return flash_config((AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA), n_routed_experts=32)


def tiny_graph_config():
    from moemesh.common.model.random_init import tiny_flash_like_config

    return tiny_flash_like_config((AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA, AttentionKind.CSA),
                                  sliding_window=8, compress_rate_hca=8, index_topk=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("interpret", "cuda", "flash"), default="interpret")
    args = parser.parse_args(argv)
    if args.suite == "interpret":
        from moemesh.bench.checks.attention import patch_interpreter_scalar_index
        from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot

        patch_interpreter_scalar_index()
        patch_interpreter_bf16_dot()
        device, capture, cases, config = torch.device("cpu"), False, INTERPRET_CASES, tiny_graph_config()
    elif args.suite == "cuda":
        device, capture, cases, config = torch.device("cuda"), True, CUDA_CASES, tiny_graph_config()
    else:
        device, capture, cases, config = torch.device("cuda"), True, FLASH_CASES, flash_graph_config()
    dtype = "bfloat16" if args.suite == "flash" else "float32"
    for case in cases:
        result = run_graph_case(case, config, device, capture=capture, dtype=dtype)
        print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
