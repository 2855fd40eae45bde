"""Per-request random streams: counter-based, keyed by (seed, purpose, position).

Every random draw the sampler, the drafter or the verifier makes for a request comes from a
stream derived from three integers: the request's seed, the Purpose of the draw, and the
output position of the token it concerns (0 = the first generated token). The derivation is a
cryptographic hash (BLAKE2b), so:

- a draw does not depend on which other requests share the batch, or on their order;
- a draw does not depend on how many tokens were drafted or accepted before it, nor on how the
  generation was split into steps: the token at position p always uses the streams of p;
- streams of different purposes are independent, even at the same position.

Two ways to draw from a key: a torch.Generator seeded from it (`stream`), or, where a generator
cannot go (inside a captured CUDA graph, many rows in one launch), `key_exponentials`: tensor
arithmetic on the keys themselves (a splitmix64 mix of key and draw index), the same values on
every device and in every batch. The sparse draft draw uses the latter (common/drafting/chains.py).

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


def signed_key(seed: int, purpose: Purpose, position: int) -> int:
    """derive_key as a signed 64-bit value (what an int64 tensor holds)."""
    key = derive_key(seed, purpose, position)
    return key - (1 << 64) if key >= 1 << 63 else key


_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as signed int64
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny  # a zero draw would make q / E infinite


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def key_exponentials(keys: torch.Tensor, count: int) -> torch.Tensor:
    """keys [...] int64 (`signed_key`) -> [..., count] float32 Exp(1) draws, draw j of a key from
    splitmix64(key + (j + 1)·golden): 24 bits of uniform u in (0, 1], E = -log(u). Pure elementwise int64
    arithmetic (wrapping multiplication), so it runs inside a captured graph and gives the same draws
    whatever the batch or device (`key_exponentials_reference` is the same on Python integers)."""
    index = torch.arange(1, count + 1, dtype=torch.int64, device=keys.device)  # [count]
    z = keys.unsqueeze(-1) + index * _GOLDEN  # [..., count]
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    z = z ^ _shift_right(z, 31)
    u = (_shift_right(z, 40) + 1).float() * 2.0**-24  # (0, 1], exact in float32
    return (-torch.log(u)).clamp_min_(_MIN_EXPONENTIAL)


def key_exponentials_reference(key: int, count: int) -> list[float]:
    """`key_exponentials` of one key on Python integers (the test's reference), as float32 values."""
    import math

    out = []
    for j in range(1, count + 1):
        z = (key + j * 0x9E3779B97F4A7C15) & _MASK_64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
        z ^= z >> 31
        u = ((z >> 40) + 1) * 2.0**-24
        out.append(max(float(torch.tensor(-math.log(u), dtype=torch.float32)), _MIN_EXPONENTIAL))
    return out


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
