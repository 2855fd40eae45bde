"""Sampling and speculative verification for the attention worker (pure torch, any device).

Modules: batch (per-row settings), penalties, filters, logprobs, sampler (plain sampling), verify
(draft verification), token_masks (grammar masks of constrained requests, applied to the logits
before both). The random streams and draws they use are common/sampling (shared with the drafter).
"""

from moemesh.services.attention.sampling.batch import SamplingBatch
from moemesh.services.attention.sampling.penalties import TokenHistory, build_token_history
from moemesh.services.attention.sampling.sampler import Sampler, SamplerOutput, process_logits
from moemesh.services.attention.sampling.verify import VerifyOutput, verify

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "TokenHistory",
    "VerifyOutput",
    "build_token_history",
    "process_logits",
    "verify",
]
