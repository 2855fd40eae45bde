"""What the router's start-time warm-up runs (services/router/warm_up.py): waves of synthetic requests whose
steps reach the shapes that compile kernels or capture graphs on first use. Plain Python over integers.

What specialises, and the wave that reaches it:
- Decode and verification steps replay CUDA graphs keyed by (token bucket 1, 2, 4, ..., 64; indexer width
  class; row-store geometry) in the attention worker (services/attention/graph_decode.py), by token bucket in
  the expert workers (services/expert/graphs.py) and by drafted-request bucket (1..16, greedy or sampled) in the
  drafter (common/drafting/draft_graphs.py); each is captured the first time a step needs it.
  `decode_buckets` waves: as many short requests as the largest bucket, admitted in one step, their
  `max_tokens` staggered so that the decode steps that follow hold 64, 32, ..., 2, 1 sequences; once greedy,
  once at temperature 1 (sampled drafts and verification with speculation on).
- Step token counts: the Triton linears and the gate pick their tile by next_power_of_2(tokens) at decode
  sizes (common/kernels/fp8_linear_config.py, gate.py), prefill launches other configs.
  `step_tokens` waves: one prompt of 16, 32, ..., long_prefill_token_threshold tokens each (a step of exactly
  that many tokens), then prompts filling the step budget at once.
- A long prompt's chunks beside decodes (mixed steps, eager): `long_prefill` wave, a short request decoding
  while a prompt of two chunks and one token is prefilled.
- Context length: the indexer's width class is next_power_of_2(CSA rows seen), at least 4·index_topk
  (services/attention/graph_tables.py `index_rows_class`), a key of every decode graph; eagerly, the top-k
  kernel's block is next_power_of_2(rows) up to 4096 (common/kernels/indexer_topk.py). A class is reached
  only by a sequence that holds that many CSA rows, so there is no cheap way to it: its KV rows must be
  computed. `context` waves: one lead request per power of two of CSA rows from index_topk up (its prompt
  just past ratio·rows tokens), with staggered short followers sent at its first token, so its decode
  steps run at every bucket in that class. The lead prompts are prefixes of one filler sequence, so each
  stage restores the previous one's blocks (a prefix hit inside the warm-up) and the prefill costed is
  that of the longest stage only: about half of max_context_tokens, which bounds the stages.
Sizes the scheduler refuses to make (past max_num_running_seqs, the step budget, the pool) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.model.step_graphs import DECODE_GRAPH_BUCKETS

GRAPH_BUCKETS = DECODE_GRAPH_BUCKETS  # the workers' decode graph buckets (common/model/step_graphs.py)
SHORT_PROMPT_TOKENS = 8
MIN_STEP_TOKENS = 16  # below it, decode-sized steps: the decode waves reach them
LEAD_EXTRA_TOKENS = 4  # a context lead's tokens beyond its followers' decode steps (their admission, a step late)


@dataclass(frozen=True)
class WarmUpShape:
    """What bounds the synthetic steps: the scheduler's limits (services/router/scheduler/config.py), the
    longest synthetic context (prompt + output tokens), and the model's CSA geometry (None: no CSA layers)."""

    max_num_running_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    block_size_tokens: int
    num_gpu_blocks: int
    max_context_tokens: int
    csa_compress_ratio: int | None = None
    index_topk: int | None = None


@dataclass(frozen=True)
class SyntheticRequest:
    """One synthetic sequence: a prompt of num_prompt_tokens filler tokens (of the shared long filler when
    shared_prefix, else of its own), max_tokens generated with ignore_eos at `temperature`."""

    num_prompt_tokens: int
    max_tokens: int
    temperature: float = 0.0
    shared_prefix: bool = False


@dataclass(frozen=True)
class WarmUpWave:
    """Requests submitted together and awaited; `followers` are submitted when requests[0] has its first
    token (short requests that decode beside a long one's first decode steps)."""

    name: str
    requests: tuple[SyntheticRequest, ...]
    followers: tuple[SyntheticRequest, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.requests) + len(self.followers)


def batch_sizes(max_num_running_seqs: int) -> tuple[int, ...]:
    """Sequences per decode step that reach each graph bucket once, descending: the buckets below
    max_num_running_seqs, and that limit itself for the bucket that holds it."""
    sizes = [bucket for bucket in GRAPH_BUCKETS if bucket < max_num_running_seqs]
    if max_num_running_seqs <= GRAPH_BUCKETS[-1]:
        sizes.append(max_num_running_seqs)
    return tuple(sorted(set(sizes), reverse=True))


def staggered(alive: tuple[int, ...], num_prompt_tokens: int, temperature: float) -> tuple[SyntheticRequest, ...]:
    """Requests admitted together whose decode step d (1, 2, ...) holds alive[d - 1] of them (alive
    descending): alive[d - 1] - alive[d] of them stop after d + 1 tokens (the first comes with the prefill)."""
    requests = []
    for step, count in enumerate(alive, start=1):
        following = alive[step] if step < len(alive) else 0
        requests += [SyntheticRequest(num_prompt_tokens, step + 1, temperature)] * (count - following)
    return tuple(requests)


def _fits(shape: WarmUpShape, num_tokens: int, num_requests: int = 1) -> bool:
    """A wave's longest sequence and its companions fit the context cap and the device pool."""
    blocks = -(-num_tokens // shape.block_size_tokens) + (num_requests - 1)
    return num_tokens <= shape.max_context_tokens and blocks <= shape.num_gpu_blocks


def step_token_waves(shape: WarmUpShape) -> list[WarmUpWave]:
    waves = []
    size = MIN_STEP_TOKENS
    chunk = min(shape.long_prefill_token_threshold, shape.max_num_batched_tokens)
    while size <= chunk and _fits(shape, size + 1):
        waves.append(WarmUpWave(f"step_tokens_{size}", (SyntheticRequest(size, 1),)))
        size *= 2
    if chunk not in (size // 2, 0) and _fits(shape, chunk + 1):  # a threshold that is no power of two
        waves.append(WarmUpWave(f"step_tokens_{chunk}", (SyntheticRequest(chunk, 1),)))
    num_full = shape.max_num_batched_tokens // chunk
    if num_full > 1 and _fits(shape, chunk + 1, num_full):
        waves.append(WarmUpWave(f"step_tokens_{num_full * chunk}", (SyntheticRequest(chunk, 1),) * num_full))
    return waves


def decode_waves(shape: WarmUpShape) -> list[WarmUpWave]:
    alive = batch_sizes(shape.max_num_running_seqs)
    prompt = max(1, min(SHORT_PROMPT_TOKENS, shape.max_num_batched_tokens // alive[0]))
    if not _fits(shape, prompt + len(alive) + 1, alive[0]):
        return []
    return [WarmUpWave(f"decode_buckets_t{temperature:g}", staggered(alive, prompt, temperature))
            for temperature in (0.0, 1.0)]


def long_prefill_wave(shape: WarmUpShape) -> list[WarmUpWave]:
    chunk = shape.long_prefill_token_threshold
    length = 2 * chunk + 1
    if shape.max_num_running_seqs < 2 or not _fits(shape, length + 1, 2):
        return []
    num_chunk_steps = -(-length // min(chunk, shape.max_num_batched_tokens))
    decoding = SyntheticRequest(SHORT_PROMPT_TOKENS, num_chunk_steps + 3)
    return [WarmUpWave("long_prefill", (decoding, SyntheticRequest(length, 2)))]


def context_waves(shape: WarmUpShape) -> list[WarmUpWave]:
    ratio, topk = shape.csa_compress_ratio, shape.index_topk
    if not ratio or not topk:
        return []
    alive = batch_sizes(shape.max_num_running_seqs)
    followers = staggered(tuple(count - 1 for count in alive if count > 1), SHORT_PROMPT_TOKENS, 0.0)
    lead_tokens = len(alive) + LEAD_EXTRA_TOKENS
    waves = []
    rows = topk
    while True:
        length = (rows + 1) * ratio  # its decode steps see rows + 1 CSA rows: the class above `rows`
        if not _fits(shape, length + lead_tokens, 1 + len(followers)):
            return waves
        lead = SyntheticRequest(length, lead_tokens, shared_prefix=True)
        waves.append(WarmUpWave(f"context_{length}", (lead,), followers))
        rows *= 2


def plan_waves(shape: WarmUpShape) -> tuple[WarmUpWave, ...]:
    """Every wave, in run order: step sizes, decode buckets, a long prompt beside a decode, then context."""
    return tuple(step_token_waves(shape) + decode_waves(shape) + long_prefill_wave(shape) + context_waves(shape))
