"""The scheduler's one frozen config: budgets, pool sizes and queue bounds.

Built once by the router's `main()` and passed explicitly. Validation here guarantees the
property the scheduler's deadlock freedom rests on: one request at `max_model_len` tokens
(drafts included) always fits into the GPU pool on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.model.kv_sizing import DEFAULT_NUM_CPU_SNAPSHOTS, DEFAULT_NUM_PRIMARY_SNAPSHOTS

# A compressor window of a DeepSeek-V4 HCA layer is 128 tokens; a block must hold whole windows.
COMPRESSOR_WINDOW_TOKENS = 128


def num_blocks_for_tokens(num_tokens: int, block_size_tokens: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceiling division)."""
    return -(-num_tokens // block_size_tokens)


# field -> the least value it may take
_MINIMUMS = {
    "max_model_len": 2, "num_gpu_blocks": 1, "num_cpu_blocks": 0, "max_num_batched_tokens": 1,
    "long_prefill_token_threshold": 1, "max_num_running_seqs": 1, "max_waiting_requests": 1,
    "max_waiting_prompt_tokens": 1, "shared_prefill_token_threshold": 1, "short_request_window_s": 0,
    "num_gpu_snapshots": 0, "num_cpu_snapshots": 0, "snapshot_interval_blocks": 1,
    "graph_chunk_tokens": 0, "graph_step_tokens": 0, "graph_prefill_token_threshold": 0,
}


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler (one attention data-parallel rank).

    max_num_batched_tokens: tokens computed per step over all sequences (drafts included).
    long_prefill_token_threshold: the most tokens one request computes per step, so a
        long prompt is chunked and short requests share the step with it.
    shared_prefill_token_threshold / short_request_window_s: while short requests are about
        (one of at most long_prefill_token_threshold prompt tokens arrived within the window),
        a long prompt computes at most this many tokens a step, so a short request's first
        token waits on a short chunk, not a full one (0 s: never).
    max_num_running_seqs: running sequences, equal to the number of state slots (window
        ring + open compressor state) the attention worker holds.
    block_size_tokens: tokens per KV block; a multiple of 128 so every compressor window
        lies inside one block.
    num_gpu_blocks / num_cpu_blocks: blocks in the GPU pool and in the pinned CPU tier
        (0 CPU blocks: preemption always recomputes).
    num_gpu_snapshots / num_cpu_snapshots: resume snapshots in each tier (what a sequence
        needs besides its blocks to resume at a block end: prefix hits, swap-in); a few per
        running sequence plus those the prefix cache keeps (resume_snapshots.py).
    snapshot_interval_blocks: besides a prompt's last block end, the prefix cache keeps the
        snapshots at every this many blocks (where a shared prefix can resume mid-prompt).
    graph_chunk_tokens / graph_step_tokens / graph_prefill_token_threshold: with the attention worker replaying
        CUDA graphs for steps of up to graph_step_tokens tokens in chunks of up to graph_chunk_tokens per sequence
        (0: it does not), a request with at most graph_prefill_token_threshold tokens left to compute (a short
        prompt, the rest of a prefix hit) computes them in chunks of graph_chunk_tokens, a few graph replays
        instead of one eager forward, in steps whose every sequence fits such a chunk into graph_step_tokens
        (few sequences: a busy step runs eagerly anyway and takes whole chunks; budget.graph_chunks_fit; 0: never).
    max_model_len: prompt + output tokens of one request.
    max_waiting_requests / max_waiting_prompt_tokens: admission bounds of the waiting queue.
    """

    num_gpu_blocks: int
    max_model_len: int
    num_cpu_blocks: int = 0
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 1024
    shared_prefill_token_threshold: int = 256
    short_request_window_s: float = 2.0
    max_num_running_seqs: int = 256
    block_size_tokens: int = 128
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_waiting_prompt_tokens: int = 1 << 20
    num_gpu_snapshots: int = DEFAULT_NUM_PRIMARY_SNAPSHOTS
    num_cpu_snapshots: int = DEFAULT_NUM_CPU_SNAPSHOTS
    snapshot_interval_blocks: int = 16
    graph_chunk_tokens: int = 0
    graph_step_tokens: int = 0
    graph_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.block_size_tokens < 1 or self.block_size_tokens % COMPRESSOR_WINDOW_TOKENS:
            problems.append(
                f"block_size_tokens must be a positive multiple of {COMPRESSOR_WINDOW_TOKENS}, "
                f"got {self.block_size_tokens}"
            )
        problems += [f"{name} must be >= {least}, got {getattr(self, name)}"
                     for name, least in _MINIMUMS.items() if getattr(self, name) < least]
        if not problems:
            needed = num_blocks_for_tokens(self.max_model_len, self.block_size_tokens)
            if needed > self.num_gpu_blocks:
                problems.append(
                    f"one request of max_model_len={self.max_model_len} needs {needed} blocks of "
                    f"{self.block_size_tokens} tokens but num_gpu_blocks={self.num_gpu_blocks}"
                )
        if not problems and self.graph_chunk_tokens and self.graph_step_tokens < self.graph_chunk_tokens:
            problems.append(f"graph_step_tokens={self.graph_step_tokens} must be >= graph_chunk_tokens="
                            f"{self.graph_chunk_tokens}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def max_blocks_per_request(self) -> int:
        return num_blocks_for_tokens(self.max_model_len, self.block_size_tokens)
