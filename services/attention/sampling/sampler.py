"""The sampler: logits of the last position of each request -> one token per request.

Pipeline per row, in float32 (the same in the verifier, see verify.py):
  [grammar token mask, applied by the worker before this pipeline: token_masks.py] ->
  logit_bias (rows that have one) -> penalties (rows that have any) -> temperature (greedy rows: 1) -> top-k -> top-p -> min-p
  (sampled rows that ask for them) -> greedy: argmax (ties to the lowest id, torch.argmax's
  documented first-maximum rule) | sampled: Gumbel-max draw from the row's own stream.
One code path for mixed batches: the work per filter runs on that filter's row group only, and
which rows are in which group is known on the host from the params (no device reads).

Reproducibility: a sampled row's noise comes only from its generator (rng.stream(seed,
Purpose.SAMPLE, position)), and every operation is row-wise, so the same seed and logits give
the same token whatever else is in the batch. Stop tokens and max_tokens are the caller's.

Legend: B rows, V vocabulary, K top logprobs, S sampled rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.common.sampling.draw import sample_from_logits
from moemesh.services.attention.sampling.filters import apply_min_p, apply_top_k, apply_top_k_top_p
from moemesh.services.attention.sampling.logprobs import chosen_logprobs, top_logprobs
from moemesh.services.attention.sampling.penalties import TokenHistory, apply_penalties, build_token_history


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row, with logprobs of the processed distribution (logprobs.py).

    top_logprob_ids / top_logprobs have K = the largest num_logprobs of the batch (0 if none);
    a row that asked for k < K reads the first k columns.
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_logprob_ids: torch.Tensor  # [B, K] int64
    top_logprobs: torch.Tensor  # [B, K] float32


def _update_rows(
    logits: torch.Tensor, index: torch.Tensor, new_rows: torch.Tensor
) -> torch.Tensor:
    return logits.index_copy(0, index, new_rows)


def process_logits(
    logits: torch.Tensor, batch: SamplingBatch, history: TokenHistory | None
) -> torch.Tensor:
    """The logits each row samples from. logits [B, V] (any float dtype) -> [B, V] float32: a new tensor,
    or the input itself when it is float32 and nothing applies (greedy rows without bias or penalties).

    `history` must cover batch.penalty_rows (in that order) when there are any.
    The input is never modified.
    """
    processed = logits.float()
    if batch.has_logit_bias:  # as vLLM: added to the raw logits, before penalties and temperature
        processed = processed.index_put((batch.bias_row_index, batch.bias_token_index), batch.bias_values,
                                        accumulate=True)
    if batch.penalty_rows:
        if history is None or history.num_rows != len(batch.penalty_rows):
            raise ValueError(f"penalties need a history of {len(batch.penalty_rows)} rows")
        rows = processed.index_select(0, batch.penalty_index)  # [P, V]
        rows = apply_penalties(
            rows,
            history,
            batch.presence_penalties,
            batch.frequency_penalties,
            batch.repetition_penalties,
        )
        processed = _update_rows(processed, batch.penalty_index, rows)
    if batch.sampled_rows:  # greedy rows divide by 1: a batch of greedy rows skips the division
        processed = processed / batch.temperatures.unsqueeze(1)
    if batch.top_k_rows:
        rows = apply_top_k(
            processed.index_select(0, batch.top_k_index), batch.top_ks, batch.max_top_k
        )
        processed = _update_rows(processed, batch.top_k_index, rows)
    if batch.top_p_rows:
        rows = apply_top_k_top_p(
            processed.index_select(0, batch.top_p_index), batch.top_p_top_ks, batch.top_ps
        )
        processed = _update_rows(processed, batch.top_p_index, rows)
    if batch.min_p_rows:
        rows = apply_min_p(processed.index_select(0, batch.min_p_index), batch.min_ps)
        processed = _update_rows(processed, batch.min_p_index, rows)
    return processed


def choose_tokens(
    processed: torch.Tensor,
    batch: SamplingBatch,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Greedy rows: argmax; sampled rows: a draw from softmax(processed) with their stream. [B]."""
    token_ids = processed.argmax(dim=-1)  # [B]; the sampled rows are overwritten below
    if batch.sampled_rows:
        sampled_generators = []
        for row in batch.sampled_rows:
            generator = generators[row]
            if generator is None:
                raise ValueError(f"row {row} samples (temperature > 0) but has no generator")
            sampled_generators.append(generator)
        drawn = sample_from_logits(
            processed.index_select(0, batch.sampled_index), sampled_generators
        )  # [S]
        token_ids = token_ids.index_copy(0, batch.sampled_index, drawn)
    return token_ids


def history_for_penalty_rows(
    batch: SamplingBatch,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    num_vocab: int,
    device: torch.device | str,
) -> TokenHistory | None:
    """The TokenHistory of the batch's penalty rows, from per-row id lists (None if no such row)."""
    if not batch.penalty_rows:
        return None
    return build_token_history(
        [prompt_token_ids[row] for row in batch.penalty_rows],
        [output_token_ids[row] for row in batch.penalty_rows],
        num_vocab,
        device,
    )


class Sampler:
    """Stateless; a class so the worker can hold one and tests can build one."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
    ) -> SamplerOutput:
        """Sample one token per row. logits [B, V]; the other arguments have B entries.

        generators[i] must be a stream (rng.stream(seed, Purpose.SAMPLE, position)) for every
        row with temperature > 0; greedy rows may pass None. The id lists only matter for rows
        with penalties; others may pass empty lists.
        """
        num_rows, num_vocab = logits.shape
        if not len(params) == len(generators) == len(prompt_token_ids) == len(output_token_ids) == num_rows:
            raise ValueError(f"logits have {num_rows} rows; every per-row argument needs as many")
        batch = SamplingBatch.from_params(params, num_vocab, logits.device)
        history = history_for_penalty_rows(
            batch, prompt_token_ids, output_token_ids, num_vocab, logits.device
        )
        return self.sample_batch(logits, batch, generators, history)

    def sample_batch(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        generators: Sequence[torch.Generator | None],
        history: TokenHistory | None,
    ) -> SamplerOutput:
        """As sample(), from a prepared batch and history (a worker may keep these across steps)."""
        processed = process_logits(logits, batch, history)  # [B, V]
        token_ids = choose_tokens(processed, batch, generators)  # [B]
        log_norm = torch.logsumexp(processed, dim=-1, keepdim=True)  # [B, 1]
        if batch.max_num_logprobs:
            top_ids, top_values = top_logprobs(processed, batch.max_num_logprobs, log_norm)  # [B, K]
        else:
            top_ids = torch.empty(batch.num_rows, 0, dtype=torch.int64, device=processed.device)
            top_values = torch.empty(batch.num_rows, 0, dtype=torch.float32, device=processed.device)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen_logprobs(processed, token_ids, log_norm[:, 0]),
            top_logprob_ids=top_ids,
            top_logprobs=top_values,
        )
