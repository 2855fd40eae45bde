"""Per-request random streams: counter-based, keyed by (seed, purpose, position).

Every random draw the sampler, the drafter or the verifier makes for a request comes from a
stream derived from three integers: the request's seed, the Purpose of the draw, and the
output position of the token it concerns (0 = the first generated token). The derivation is a
cryptographic hash (BLAKE2b), so:

- a draw does not depend on which other requests share the batch, or on their order;
- a draw does not depend on how many tokens were drafted or accepted before it, nor on how the
  generation was split into steps: the token at position p always uses the streams of p;
- streams of different purposes are independent, even at the same position.

Why independence of purposes matters (docs/speculation.md §4.1, §6.5): the losslessness proof of
ratio-test rejection sampling assumes the draft token x ~ p_d is independent of the uniform u
used to accept it and of the noise used to draw the replacement. If the draft and the verifier
shared noise (vLLM's upstream DSpark keyed the draft at position Q with the target's key for
Q-1), acceptance would correlate with the draft and the output distribution would be biased.
Greedy exact-match verification uses no randomness, so it is unaffected.

Stream reuse across steps is safe: a position's DRAFT stream is reused when the drafter redrafts
a position whose earlier draft was discarded unseen (after a rejection before it), and such a
discarded draft never influenced an emitted token.
"""

from __future__ import annotations

import enum
import hashlib
import struct

import torch

_MASK_64 = (1 << 64) - 1
_DOMAIN = b"moemesh.sampling.rng.v1"


class Purpose(enum.IntEnum):
    """What a random draw is for. Each purpose is an independent family of streams."""

    SAMPLE = 1  # plain sampling of the target's token; also the bonus token after all drafts
    DRAFT = 2  # the drafter sampling a draft token from p_d
    VERIFY_ACCEPT = 3  # the uniform of the ratio test min(1, p_t / p_d)
    VERIFY_RESAMPLE = 4  # the replacement drawn from norm(max(0, p_t - p_d)) after a rejection


def derive_key(seed: int, purpose: Purpose, position: int) -> int:
    """A 64-bit key for (seed, purpose, position). Seeds are taken modulo 2**64."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    payload = struct.pack("<QQQ", seed & _MASK_64, int(purpose), position)
    digest = hashlib.blake2b(payload, digest_size=8, person=_DOMAIN[:16]).digest()
    return int.from_bytes(digest, "little")


def stream(
    seed: int, purpose: Purpose, position: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A fresh torch.Generator on `device` seeded from derive_key(seed, purpose, position).

    Fresh on every call: the same arguments always give the same sequence of draws.
    The sequence differs between CPU and CUDA generators (torch's algorithms differ).
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_key(seed, purpose, position) >> 1)  # 63 bits: always accepted
    return generator


def uniform(seed: int, purpose: Purpose, position: int) -> float:
    """One uniform draw in [0, 1), computed on the host from the key alone (no generator).

    24 bits of resolution, so the value is exact in float32 and never rounds up to 1.0, which
    keeps `u < ratio` an exact test of probability min(1, ratio).
    """
    return (derive_key(seed, purpose, position) >> 40) * 2.0**-24


def streams_for_rows(
    seeds: list[int | None],
    purpose: Purpose,
    positions: list[int],
    device: torch.device | str = "cpu",
) -> list[torch.Generator | None]:
    """One stream per row; rows whose seed is None (greedy rows) get None."""
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds but {len(positions)} positions")
    return [
        None if seed is None else stream(seed, purpose, position, device)
        for seed, position in zip(seeds, positions)
    ]
