"""Sampling and speculative verification for the attention worker (pure torch, any device).

Modules: rng (per-request counter-based streams), draw (Gumbel-max draws), batch (per-row
settings), penalties, filters, logprobs, sampler (plain sampling), verify (draft verification),
token_masks (grammar masks of constrained requests, applied to the logits before both).
"""

from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.services.attention.sampling.draw import sample_from_logits, sample_from_probs
from moemesh.services.attention.sampling.penalties import TokenHistory, build_token_history
from moemesh.services.attention.sampling.rng import Purpose, derive_key, stream, streams_for_rows, uniform
from moemesh.services.attention.sampling.sampler import Sampler, SamplerOutput, process_logits
from moemesh.services.attention.sampling.verify import VerifyOutput, verify

__all__ = [
    "Purpose",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "TokenHistory",
    "VerifyOutput",
    "build_token_history",
    "derive_key",
    "process_logits",
    "sample_from_logits",
    "sample_from_probs",
    "stream",
    "streams_for_rows",
    "uniform",
    "verify",
]
